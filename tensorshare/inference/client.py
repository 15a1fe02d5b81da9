"""InferenceClient: a worker's handle on a model served by an :class:`InferenceHost`."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, NamedTuple, Unpack

import torch

from ..client.closing import Closing
from ..client.command import Command
from ..client.options import ClientOptions, TransportFields
from ..client.services import check_compress
from ..client.sharded import connect
from ..memory.device import check_device, moves, to_device, want_pinned
from ..wire.services import ServiceCall

__all__ = ["InferenceCaller", "InferenceClient"]


def _add_batch_dim(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.unsqueeze(0)
    if isinstance(x, dict):
        return {k: _add_batch_dim(v) for k, v in x.items()}
    raise TypeError(f"predict takes a tensor or a dict of tensors, not {type(x).__name__}")


def _drop_batch_dim(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x[0]
    if isinstance(x, dict):
        return {k: _drop_batch_dim(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_drop_batch_dim(v) for v in x)
    return x


def _rows(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            raise ValueError("a batch needs a batch dimension: a tensor of at least 1 dim")
        return int(x.shape[0])
    if isinstance(x, dict) and x:
        sizes = {_rows(v) for v in x.values()}
        if len(sizes) != 1:
            raise ValueError(f"the tensors of one input have different batch sizes: "
                             f"{sorted(sizes)}")
        return sizes.pop()
    raise TypeError(f"predict takes a tensor or a dict of tensors, not {type(x).__name__}")


class _Result:
    """Turns a call's reply into what predict returns (on the client's device): the value the
    service call's own conversion decodes (``decode.value``), then the row (or rows) asked
    for."""

    __slots__ = ("decode", "batched", "with_version", "device")

    def __init__(self, decode: Any, batched: bool, with_version: bool,
                 device: Any = None) -> None:
        self.decode = decode
        self.batched, self.with_version, self.device = batched, with_version, device

    def __call__(self, reply: Any) -> Any:
        value = self.decode.value(reply)
        out = value if self.batched else _drop_batch_dim(value)
        if self.device is not None:
            out = to_device(out, self.device)
        return (out, reply.version) if self.with_version else out


class _Prepared(NamedTuple):
    """What every call of one caller shares, checked once (see
    :meth:`InferenceCaller._command`): the server's wait, for the client's ``timeout``, and
    how the request is named; each ``(batched, return_version)``'s conversion."""

    client_timeout: float
    wait: float
    what: str
    results: dict[tuple[bool, bool], _Result]


class InferenceCaller:
    """What a caller of an :class:`InferenceHost` is, whatever its face: the service, how
    long a prediction may take, ``wait_room``, ``compress``, where outputs go, and the call
    ``predict`` sends (written once for :class:`InferenceClient` and
    ``tensorshare.aio.AsyncInferenceClient``). A face sets ``_shard``: the client that
    reaches the service's server.

    Raises:
        ValueError: a ``device`` this torch cannot use, or a bad ``compress``.
    """

    _shard: Any

    def __init__(self, name: str, timeout: float, wait_room: bool, compress: str | None,
                 device: Any, own: bool) -> None:
        self.device = check_device(device)
        want_pinned(self.device)
        self.name = name
        self.timeout = timeout
        self.wait_room = bool(wait_room)
        self.compress = check_compress(compress)
        self._own = own
        self._prepared: _Prepared | None = None

    @property
    def client_timeout(self) -> float:
        """The timeout of a client made for this caller: ``timeout`` and a bit more, so
        that the server's ``WaitTimeout`` comes first."""
        return max(self.timeout * 1.25, self.timeout + 1.0)

    def _command(self, inputs: Any, batched: bool, return_version: bool,
                 wait_room: bool | None) -> Any:
        """The service call of a ``predict`` of ``inputs``; its conversion gives what
        ``predict`` returns (on ``device``, if it moves tensors).

        Raises:
            TypeError, ValueError: ``inputs`` is not a tensor or a dict of tensors with
                rows.
        """
        x = inputs if batched else _add_batch_dim(inputs)
        shard = self._shard
        p = self._prepared
        if p is None or p.client_timeout != shard.timeout:
            p = self._prepare(x)
        result = p.results.get((batched, return_version))
        if result is None:
            result = p.results[batched, return_version] = _Result(
                p.results[False, False].decode, batched, return_version,
                self.device if moves(self.device) else None)
        rows = x.shape[0] if type(x) is torch.Tensor and x.dim() else _rows(x)
        request: Any = ServiceCall(0, self.name, shard._service_item(self.name, x, self.compress),
                                   p.wait, self.wait_room if wait_room is None
                                   else bool(wait_room), rows)
        return Command(request, p.what, result)

    def _prepare(self, x: Any) -> _Prepared:
        """What the calls share, checked as :meth:`ServiceOps.service_call_command` checks a
        call (the name, the timeout), for the client's timeout now."""
        shard = self._shard
        cmd = shard.service_call_command(self.name, x, rows=_rows(x), timeout=self.timeout,
                                         compress=self.compress)
        p = self._prepared = _Prepared(shard.timeout, cmd.request.timeout, cmd.what, {
            (False, False): _Result(cmd.convert, False, False,
                                    self.device if moves(self.device) else None)})
        return p


class InferenceClient(InferenceCaller, Closing):
    """Calls the model an :class:`InferenceHost` serves on service bin ``name``.

    Args:
        name: the service bin.
        host, port: the server (several servers: ``"h1:7000,h2:7000"``), or ``client``.
        timeout: seconds a prediction may take (queued and computed) before ``WaitTimeout``
            (the server answers no later; a server that is unreachable that long gives
            ``ReplyTimeout`` or ``ConnectionLost``).
        wait_room: when the service's queue is full (its ``max_queue`` calls), a call waits
            for room within ``timeout`` (``True``, the default) or fails at once with
            ``BinFull`` (``False``: the caller sheds load itself). ``predict`` and
            ``predict_async`` may choose otherwise per call.
        compress: how inputs travel: ``"auto"`` (default) compresses with lz4 only where it
            pays: buffers of at least 64 KiB (the client's ``compress_min_bytes``) of an
            integer or bool dtype (image frames, masks), kept compressed only when that
            saves at least an eighth; floats never. ``None``: never; ``"lz4"``: every buffer
            of at least 64 KiB that shrinks; ``"client"``: as the client's own ``compress``.
            Nothing is compressed on a connection that passes shared memory (a Unix socket).
        client: a client to use instead of connecting (not closed by :meth:`close`).
        device: where the outputs ``predict`` returns live (``"cuda"``, ...; checked here: a
            torch without CUDA is a ``ValueError``); ``None``: the CPU. If the copy fails,
            ``DeviceCopyFailed`` carries the output on the CPU. (Inputs may be CUDA tensors
            whatever this says: they are copied once to host memory to travel.)
        options, client_options: the new client's :class:`~tensorshare.ClientOptions`, and
            fields of it as keywords (``token``, ``tls_ca``, ...; they override ``options``);
            its ``timeout`` is ``timeout`` and a bit more (the server says ``WaitTimeout``
            first).

    ``predict(x)`` sends one input (no batch dimension) and returns the model's output row
    for it; ``predict(x, batched=True)`` sends a batch (first dimension) and returns the
    output rows for it. ``predict_async`` returns a ``concurrent.futures.Future`` instead:
    any number may be in flight. Thread-safe.
    """

    def __init__(self, name: str, host: str | None = None, port: int | None = None, *,
                 timeout: float = 5.0, wait_room: bool = True, compress: str | None = "auto",
                 client: Any = None, device: Any = None, options: ClientOptions | None = None,
                 **client_options: Unpack[TransportFields]) -> None:
        super().__init__(name, timeout, wait_room, compress, device, client is None)
        self.client = connect(host, port, self.client_timeout, options=options,
                              **client_options) if client is None else client
        self._shard = self.client.client_for(name) if hasattr(self.client, "client_for") \
            else self.client

    def predict(self, inputs: Any, *, batched: bool = False, return_version: bool = False,
                wait_room: bool | None = None) -> Any:
        """The model's output for ``inputs`` (its row; with ``batched``, its rows).

        Args:
            inputs: a tensor or a dict of tensors (with ``batched``, batch dimension first).
            batched: ``inputs`` is a batch of rows; the output keeps its batch dimension.
            return_version: return the parameter version the answer was computed with too.
            wait_room: this call's choice when the queue is full (``None``: the
                constructor's ``wait_room``): wait for room, or fail at once with
                ``BinFull``.

        Returns:
            The output (a tensor, tuple or dict, as the model returns), or ``(output,
            version)`` with ``return_version``: the parameter version the host used
            (``None`` if it has none); pass it to ``RLWorker.add_data(x, version=...)``.

        Raises:
            WaitTimeout: no answer within ``timeout``.
            ServiceFailed: the host's model raised on this input (only this call fails:
                the host runs its batch again in halves, down to the inputs it raises on,
                and answers the other calls), or the input was not a batch of rows (with
                ``batched``: first dimension, one row as shape ``(1, ...)``).
            BinFull: the service's queue was full and this call did not wait for room
                (``wait_room`` false), or as many calls already wait for room as it queues.
        """
        return self._shard._execute(self._command(inputs, batched, return_version, wait_room))

    def predict_async(self, inputs: Any, *, batched: bool = False,
                      return_version: bool = False, wait_room: bool | None = None
                      ) -> Future[Any]:
        """Like :meth:`predict`, but returns at once with a ``concurrent.futures.Future``
        of the result (its callbacks run on the client's reading thread: keep them short;
        ``BinFull`` and the other errors come through the future)."""
        return self._shard._submit_future(self._command(inputs, batched, return_version,
                                                        wait_room))

    def close(self) -> None:
        """Close the client (if this object made it)."""
        if self._own:
            self.client.close()

    def __repr__(self) -> str:
        return f"<InferenceClient {self.name!r}>"
