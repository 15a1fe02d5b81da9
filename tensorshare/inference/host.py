"""InferenceHost: one model answering the calls of many workers in batches."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..client.services import check_compress
from ..client.sharded import connect
from ..errors import ConnectionLost, Timeout, TransportError

log = logging.getLogger(__name__)

__all__ = ["InferenceHost", "stack_inputs", "split_outputs"]

Signature = tuple[Any, ...]


def _signature(value: Any) -> Signature | None:
    """What must agree for inputs to be stacked: dtype and shape past the batch dimension
    (per key of a dict); ``None``: not a tensor nor a dict of tensors."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape[1:])) if value.dim() else None
    if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) and v.dim()
                                                 for v in value.values()):
        return ("dict",) + tuple(sorted((k, v.dtype, tuple(v.shape[1:]))
                                        for k, v in value.items()))
    return None


def _rows_of(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0])
    sizes = {int(v.shape[0]) for v in value.values()}
    if len(sizes) != 1:
        raise ValueError(f"the tensors of one input have different batch sizes: {sorted(sizes)}")
    return sizes.pop()


_EXPECTED = ("an input must be a tensor, or a dict of tensors, whose first dimension is the "
             "call's batch of rows: shape (rows, ...); one row is shape (1, ...)")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor)
                                                 for v in value.values()):
        return "a dict of tensors of shapes " + ", ".join(
            f"{k}: {tuple(v.shape)}" for k, v in value.items())
    return f"a {type(value).__name__}"


def _input_problem(value: Any, rows: int) -> str | None:
    """Why a call's input (a tensor or dict of tensors of at least one dimension) does not
    fit the call's ``rows``; ``None`` if it does."""
    try:
        n = _rows_of(value)
    except ValueError as exc:
        return f"{exc}: {_EXPECTED}"
    if n != rows:
        return (f"{_EXPECTED}; the call has rows={rows} but the input's first dimension is "
                f"{n} ({_describe(value)})")
    return None


def stack_inputs(values: list[Any], device: torch.device | None = None) -> Any:
    """One batch from inputs of one signature: tensors concatenated along the batch
    dimension (per key of a dict), on ``device``."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        x = first if len(values) == 1 else torch.cat(values)
        return x if device is None else x.to(device, non_blocking=True)
    out = {}
    for k in first:
        parts = [v[k] for v in values]
        x = parts[0] if len(parts) == 1 else torch.cat(parts)
        out[k] = x if device is None else x.to(device, non_blocking=True)
    return out


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu() if x.device.type != "cpu" else x.detach()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_to_cpu(v) for v in x)
    raise TypeError(f"a model's output must be a tensor, a tuple or a dict of tensors, not "
                    f"{type(x).__name__}")


def split_outputs(out: Any, rows: list[int]) -> list[Any]:
    """The model's output for a batch, split into each caller's rows (views, no copy)."""
    total = sum(rows)
    if isinstance(out, torch.Tensor):
        if out.dim() == 0 or out.shape[0] != total:
            raise ValueError(f"the model's output has shape {tuple(out.shape)}: its first "
                             f"dimension must be the batch's {total} rows")
        return list(torch.split(out, rows))
    if isinstance(out, dict):
        parts = {k: split_outputs(v, rows) for k, v in out.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(len(rows))]
    cols = [split_outputs(v, rows) for v in out]
    return [type(out)(c[i] for c in cols) for i in range(len(rows))]


class InferenceHost:
    """Serves ``model`` on service bin ``name``: takes calls in batches, stacks their inputs,
    runs the model once per batch under ``torch.inference_mode()`` and answers each caller
    with its own rows.

    Args:
        name: the service bin (callers use the same name in :class:`InferenceClient`).
        model: any callable taking the stacked batch (a tensor, or a dict of tensors, batch
            dimension first) and returning a tensor, a tuple or a dict of tensors with the
            batch dimension first (an ``nn.Module``, say). When it raises on a batch, the
            calls are run again in halves down to the ones it raises on: only those get
            ``ServiceFailed`` (docs/PROTOCOL.md §14.3).
        host, port: the server (several servers: ``"h1:7000,h2:7000"``), or ``client``.
        max_batch: the most rows per batch.
        max_wait_ms: with fewer than ``max_batch`` rows queued, wait at most this long after
            the oldest for more (a host that waited for work takes the first call at once).
        params_bin: a bin holding the model's ``state_dict`` (what ``RLTrainer`` publishes):
            the host loads each new version between batches and stamps every answer with
            the version it used.
        device: where the model runs (default: where its parameters are, else the CPU).
        lease: seconds a batch may take before its calls go to another host.
        max_queue: the most calls the service queues (default 4096).
        timeout: the client's timeout (also how long one take waits for work).
        compress: how answers travel, as for :class:`InferenceClient`: ``"auto"`` (default)
            compresses with lz4 only large integer and bool buffers that shrink by at least
            an eighth (a model that returns frames), never floats; ``None``, ``"lz4"`` or
            ``"client"`` (the client's own ``compress``).
        client: a client to use instead of connecting (it is not closed by ``stop``).
        client_options: more arguments of the client (``token``, ``tls_ca``, ...).

    Several hosts may serve one name: they share the calls. ``start()`` serves in a thread,
    ``serve_forever()`` in the calling one; ``stop()`` ends both.
    """

    def __init__(self, name: str, model: Callable[[Any], Any], host: str | None = None,
                 port: int | None = None, *, max_batch: int = 256, max_wait_ms: float = 2.0,
                 params_bin: str | None = None, device: str | torch.device | None = None,
                 lease: float = 10.0, max_queue: int | None = None, timeout: float = 10.0,
                 compress: str | None = "auto", client: Any = None,
                 **client_options: Any) -> None:
        self.name = name
        self.compress = check_compress(compress)
        self.model = model
        self.max_batch = max_batch
        self.max_wait_ms = max_wait_ms
        self.params_bin = params_bin
        self.lease = lease
        self.max_queue = max_queue
        if device is None and isinstance(model, torch.nn.Module):
            p = next(iter(model.parameters()), None)
            device = None if p is None else p.device
        self.device = None if device is None else torch.device(device)
        self._own = client is None
        self.client = connect(host, port, timeout, **client_options) if client is None \
            else client
        self._shard: Any = self.client.client_for(name) if hasattr(self.client, "client_for") \
            else self.client
        self.version: int | None = None  # the parameter version answers are stamped with
        self.batches = 0
        self.calls = 0
        self.rows = 0
        self._newest = -1  # the newest parameter version announced
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        if params_bin is not None:
            self.client.listen(params_bin, self._on_params, inline=True)
            self._load_params(force=True)

    # -- parameters -------------------------------------------------------------------------
    def _on_params(self, event: dict[str, Any]) -> None:
        v = event.get("version")
        if isinstance(v, int) and v > self._newest:
            self._newest = v

    def _load_params(self, force: bool = False) -> None:
        if self.params_bin is None or not (force or self._newest > (self.version or 0)):
            return
        try:
            res = self.client.fetch(self.params_bin, remove=False, newer_than=self.version)
        except LookupError:
            return  # nothing published yet
        if res.unchanged:
            return
        load = getattr(self.model, "load_state_dict", None)
        if load is None:
            raise TypeError(f"params_bin {self.params_bin!r} needs a model with "
                            f"load_state_dict (an nn.Module), not {type(self.model).__name__}")
        load(res.value)
        self.version = res.version
        self._newest = max(self._newest, res.version)

    # -- serving ----------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Serve until :meth:`stop` (or the client is closed)."""
        pending = None  # the last batch's answer, sent with the next take
        while not self._stop.is_set():
            try:
                take = self._take_command()
                if pending is not None:
                    answered, got = self._shard._submit_many([pending, take])
                    pending = None
                    answered.result()
                    batch = got.result()
                else:
                    batch = self._shard._execute(take)
            except Timeout:
                continue  # no call came: take again
            except ConnectionLost:
                if self._stop.is_set() or self.client.closed:
                    return
                raise
            except TransportError:
                if self._stop.is_set():
                    return
                raise
            pending = self._answer(batch)
        if pending is not None:
            try:
                self._shard._execute(pending)
            except Exception:  # stopping: the batch goes back to the queue for another host
                pass

    def _take_command(self) -> Any:
        # Each take waits at most 1 s on the server, so that stop() is noticed soon.
        return self._shard.service_take_command(
            self.name, max_batch=self.max_batch, max_wait_ms=self.max_wait_ms,
            timeout=min(1.0, 0.5 * self._shard.timeout), lease=self.lease,
            max_queue=self.max_queue)

    def _answer(self, batch: Any) -> Any:
        """Run the model on a batch; the reply command (sent with the next take)."""
        with self._lock:
            self._load_params()
            values, rows = batch.values, list(batch.rows)
            outs: list[Any] = [None] * len(values)
            failed: dict[int, str] = {}
            groups: dict[Any, list[int]] = {}
            for i, v in enumerate(values):
                sig = _signature(v)
                problem = _input_problem(v, rows[i]) if sig is not None else \
                    f"{_EXPECTED} (rows={rows[i]}), not {_describe(v)}"
                if problem is not None:
                    failed[i] = problem
                    continue
                groups.setdefault(sig, []).append(i)
            for idx in groups.values():
                self._run_isolating(values, rows, idx, outs, failed)
            self.batches += 1
            self.calls += len(values)
            self.rows += sum(rows)
            return self._shard.service_reply_command(self.name, batch.batch, outs,
                                                     version=self.version, failed=failed,
                                                     compress=self.compress)

    def _run_model(self, values: list[Any], rows: list[int], idx: list[int]) -> list[Any]:
        """The model's output for calls ``idx`` run together, split per call."""
        with torch.inference_mode():
            out = self.model(stack_inputs([values[i] for i in idx], self.device))
        return split_outputs(_to_cpu(out), [rows[i] for i in idx])

    def _run_isolating(self, values: list[Any], rows: list[int], idx: list[int],
                       outs: list[Any], failed: dict[int, str]) -> None:
        """Run calls ``idx`` together; if the model raises, only the calls it raises on
        fail: the calls are run again in halves, down to the failing ones alone (a few
        more runs for one bad input among many; at most twice the calls' runs when every
        input fails). A failing call gets the model's error as its ``ServiceFailed``. After
        half the lease, the calls of a part that fails fail together (the message says so),
        so that the answer comes before the lease ends."""
        todo, bad = [idx], 0
        deadline = time.monotonic() + 0.5 * self.lease
        while todo:
            part = todo.pop()
            try:
                parts = self._run_model(values, rows, part)
            except Exception as exc:  # the model's failure fails these calls, not the host
                alone = len(part) == 1
                if not alone and time.monotonic() < deadline:
                    half = len(part) // 2
                    todo += [part[half:], part[:half]]
                    continue
                for i in part:
                    failed[i] = f"{type(exc).__name__}: {exc}" if alone else \
                        (f"{type(exc).__name__}: {exc} (the model failed on these "
                         f"{len(part)} calls together; no time was left to find which)")
                if not bad:
                    log.warning("model failed on a call of %r: %r", self.name, exc)
                bad += len(part)
                continue
            for i, p in zip(part, parts, strict=True):
                outs[i] = p
        if bad > 1:
            log.warning("model failed on %d of %d calls of %r (the others were answered)",
                        bad, len(idx), self.name)

    def start(self) -> InferenceHost:
        """Serve in a daemon thread; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"tensorshare-inference-{self.name}")
            self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.serve_forever()
        except Exception:
            if not self._stop.is_set():
                log.exception("inference host of %r stopped", self.name)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (the batch in hand is answered first) and close the client if this
        host made it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._own:
            self.client.close()

    def __enter__(self) -> InferenceHost:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"<InferenceHost {self.name!r} batches={self.batches} calls={self.calls} "
                f"version={self.version}>")
