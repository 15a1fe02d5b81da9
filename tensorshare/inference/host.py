"""InferenceHost: one model answering the calls of many workers in batches."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Unpack

import torch

from ..client.options import ClientOptions, TransportFields
from ..client.services import check_compress
from ..client.sharded import connect
from ..errors import ConnectionLost, Timeout, TransportError
from ..memory.device import (
    check_device,
    host_tensor,
    mark_staged,
    stage_batch,
    upload,
    want_pinned,
)

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


def _groups(values: list[Any], rows: list[int], failed: dict[int, str]) -> list[list[int]]:
    """The calls of a batch in groups that stack (one signature each), in order; a call
    whose input cannot be stacked goes to ``failed`` with why."""
    first = values[0] if values else None
    if type(first) is torch.Tensor and first.dim():  # the common batch: alike tensors
        dtype, shape = first.dtype, first.shape
        n = shape[0]
        if all(type(v) is torch.Tensor and v.dtype is dtype and v.shape == shape
               for v in values) and all(r == n for r in rows):
            return [list(range(len(values)))]
    groups: dict[Any, list[int]] = {}
    for i, v in enumerate(values):
        sig = _signature(v)
        problem = _input_problem(v, rows[i]) if sig is not None else \
            f"{_EXPECTED} (rows={rows[i]}), not {_describe(v)}"
        if problem is not None:
            failed[i] = problem
            continue
        groups.setdefault(sig, []).append(i)
    return list(groups.values())


def stack_inputs(values: list[Any], device: torch.device | None = None) -> Any:
    """One batch from inputs of one signature: tensors concatenated along the batch
    dimension (per key of a dict), on ``device``. For a CUDA device, the parts are
    concatenated into pinned memory (:mod:`tensorshare.memory.pinned`) and go to the device
    in one copy, queued on the current stream."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return _stacked(values, device)
    return {k: _stacked([v[k] for v in values], device) for k in first}


def _stacked(parts: list[Any], device: torch.device | None) -> Any:
    cuda = device is not None and device.type == "cuda"
    if len(parts) == 1:
        x = parts[0]
    elif cuda and all(p.is_cpu for p in parts):
        x = stage_batch(parts)
    else:
        x = torch.cat(parts)
    if device is None:
        return x
    return upload(x, device) if cuda and x.is_cpu else x.to(device, non_blocking=True)


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return host_tensor(x) if x.device.type != "cpu" else x.detach()
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
        max_wait_ms: ``0`` (the default): adaptive batching, a batch is every call that
            queued while the previous one ran (up to ``max_batch`` rows), taken at once, and
            a host waiting for work takes the first call the moment it comes. More than
            ``0``: a host back from a batch that finds fewer than ``max_batch`` rows queued
            waits for more, at most this long after the oldest (larger batches for the
            price of latency; a host that waited for work still takes the first call at
            once).
        params_bin: a bin holding the model's ``state_dict`` (what ``RLTrainer`` publishes):
            the host loads each new version between batches and stamps every answer with
            the version it used.
        device: where the model runs (default: where its parameters are, else the CPU).
            On a CUDA device the calls' inputs are stacked into pinned memory and copied in
            one copy; outputs come back through pinned memory.
        devices: run one copy of ``model`` (an ``nn.Module``) on each of these devices, e.g.
            ``["cuda:0", "cuda:1"]``: each copy takes batches of the service on its own
            thread (the server spreads the calls over whoever takes), and each loads every
            new version of ``params_bin`` itself. ``replicas`` holds one host per device
            (their own ``version``); ``batches``/``calls``/``rows`` count them all.
        lease: seconds a batch may take before its calls go to another host.
        max_queue: the most calls the service queues (default 4096).
        timeout: the client's timeout (also how long one take waits for work).
        compress: how answers travel, as for :class:`InferenceClient`: ``"auto"`` (default)
            compresses with lz4 only large integer and bool buffers that shrink by at least
            an eighth (a model that returns frames), never floats; ``None``, ``"lz4"`` or
            ``"client"`` (the client's own ``compress``).
        client: a client to use instead of connecting (it is not closed by ``stop``).
        options, client_options: the new client's :class:`~tensorshare.ClientOptions`, and
            fields of it as keywords (``token``, ``tls_ca``, ...; they override ``options``);
            its ``timeout`` is ``timeout``.

    Several hosts may serve one name: they share the calls. ``start()`` serves in a thread,
    ``serve_forever()`` in the calling one; ``stop()`` ends both.
    """

    def __init__(self, name: str, model: Callable[[Any], Any], host: str | None = None,
                 port: int | None = None, *, max_batch: int = 256, max_wait_ms: float = 0.0,
                 params_bin: str | None = None, device: str | torch.device | None = None,
                 lease: float = 10.0, max_queue: int | None = None, timeout: float = 10.0,
                 compress: str | None = "auto", client: Any = None,
                 devices: list[Any] | None = None, options: ClientOptions | None = None,
                 **client_options: Unpack[TransportFields]) -> None:
        self.replicas: list[InferenceHost] = []
        self._counts = [0, 0, 0]  # batches, calls, rows (shared with the replicas)
        self._count_lock = threading.Lock()
        if client is None:  # (checked before anything else)
            options = ClientOptions.of(options, **client_options)
        if devices is not None:
            self._group(name, model, devices, device, host, port, timeout, client, options,
                        dict(max_batch=max_batch, max_wait_ms=max_wait_ms,
                             params_bin=params_bin, lease=lease, max_queue=max_queue,
                             compress=compress))
            return
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
        self.device = None if device is None else check_device(device)
        want_pinned(self.device)
        self._own = client is None
        self.client = connect(host, port, timeout, options=options) if client is None \
            else client
        self._shard: Any = self.client.client_for(name) if hasattr(self.client, "client_for") \
            else self.client
        self.version: int | None = None  # the parameter version answers are stamped with
        self._newest = -1  # the newest parameter version announced
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._take: Any = None  # the take command (see _take_command)
        if params_bin is not None:
            self.client.listen(params_bin, self._on_params, inline=True)
            self._load_params(force=True)

    def _group(self, name: str, model: Any, devices: list[Any], device: Any, host: Any,
               port: Any, timeout: float, client: Any, client_options: ClientOptions | None,
               options: dict[str, Any]) -> None:
        """``devices=``: one replica of ``model`` per device, each a host of its own on a
        shared client and shared counters."""
        import copy

        if device is not None:
            raise ValueError("give device= or devices=, not both")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"devices= copies the model to each device: it must be an "
                            f"nn.Module, not {type(model).__name__}")
        if not isinstance(devices, (list, tuple)) or not devices:
            raise ValueError(f"devices must be a non-empty list of devices, not {devices!r}")
        checked = [check_device(d) for d in devices]
        self.name, self.model, self.device = name, model, None
        self.params_bin, self.version = options["params_bin"], None
        self._own = client is None
        self.client = connect(host, port, timeout, options=client_options) if client is None \
            else client
        self._stop = threading.Event()
        self._thread = None
        try:
            for d in checked:
                replica = InferenceHost(name, copy.deepcopy(model).to(d), client=self.client,
                                        device=d, timeout=timeout, **options)
                replica._counts, replica._count_lock = self._counts, self._count_lock
                self.replicas.append(replica)
        except BaseException:
            self.stop()
            raise

    @property
    def batches(self) -> int:
        """Batches answered (by every replica)."""
        return self._counts[0]

    @property
    def calls(self) -> int:
        """Calls answered."""
        return self._counts[1]

    @property
    def rows(self) -> int:
        """Rows answered."""
        return self._counts[2]

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
        mark_staged(res.value)  # (its host memory is pinned for the next version)
        load(res.value)
        self.version = res.version
        self._newest = max(self._newest, res.version)

    # -- serving ----------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Serve until :meth:`stop` (or the client is closed)."""
        if self.replicas:
            for r in self.replicas:
                r.start()
            self._stop.wait()
            return
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
        """The take this host sends again and again (made and checked once: the session
        gives each sending its own request id)."""
        take = self._take
        if take is None:
            # Each take waits at most 1 s on the server, so that stop() is noticed soon.
            take = self._take = self._shard.service_take_command(
                self.name, max_batch=self.max_batch, max_wait_ms=self.max_wait_ms,
                timeout=min(1.0, 0.5 * self._shard.timeout), lease=self.lease,
                max_queue=self.max_queue)
        return take

    def _answer(self, batch: Any) -> Any:
        """Run the model on a batch; the reply command (sent with the next take)."""
        with self._lock:
            self._load_params()
            values, rows = batch.values, list(batch.rows)
            outs: list[Any] = [None] * len(values)
            failed: dict[int, str] = {}
            for idx in _groups(values, rows, failed):
                self._run_isolating(values, rows, idx, outs, failed)
            with self._count_lock:
                self._counts[0] += 1
                self._counts[1] += len(values)
                self._counts[2] += sum(rows)
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
        """Serve in a daemon thread (with ``devices``: one per device); returns self."""
        if self.replicas:
            for r in self.replicas:
                r.start()
            return self
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
        for r in self.replicas:
            r.stop(timeout)
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
