"""One op surface for every client face: each op's signature, checks and reply conversion,
written once.

As redis-py writes its commands once and mixes them into every client, :class:`Ops` is mixed
into each face of a client: the blocking :class:`~.blocking.Client` (whose calls wait for the
result), its ``begin`` view (whose calls return a :class:`~.blocking.PendingCall`), a
:class:`~.pipeline.Pipeline` (whose calls queue and return an index), the Twisted
:class:`~.twisted.TxClient` (whose calls return a ``Deferred``) and the sharded client (whose
calls go to the server that owns the bin). An op checks its arguments, encodes what it
sends, and hands a :class:`Command` to the face's ``_execute``; what the face returns is what
the caller gets, holding (now or later) the op's converted result.

Local mistakes (a bad name, an unsupported type, a negative timeout) raise at the call,
before anything is sent, in every face.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import CodecError
from ..memory.device import check_device, moves, to_device, want_pinned
from ..wire.codec import CUDA_IPC_REMOTE, decode_many
from ..wire.messages import (
    Configure,
    Configured,
    Delete,
    Limits,
    ListBins,
    Listen,
    Ping,
    Reload,
    Stats,
    Unlisten,
)
from ..wire.protocol import check_bin_name
from ..wire.records import (
    Append,
    Fetch,
    Fetched,
    FetchSpec,
    Item,
    Put,
)
from ..wire.replication import Promote, WaitReplicas
from ..wire.runs import decode_items, run_count
from ..wire.tensors import decode_tensor, encode_tensor
from .command import (
    _FRAME_SLACK,
    BLOCK_SHARE,
    NOWAIT,
    Command,
    NoWait,
    Wait,
    check_reconnect,
    check_timeout,
    cuda_ipc_reader,
    gc_paused,
    make_item,
    make_items,
)
from .replay import ReplayOps
from .services import ServiceOps
from .streams import StreamOps

__all__ = [
    "BLOCK_SHARE",
    "BinClient",
    "NOWAIT",
    "BinLimits",
    "Command",
    "FetchResult",
    "NoWait",
    "Ops",
    "Wait",
    "check_reconnect",
    "check_timeout",
    "decode_fetched",
    "gc_paused",
    "make_item",
    "make_items",
]


#: What a get or peek returns (the one record of a fetch, with its items decoded).
FetchResult = Fetched

@dataclass(frozen=True, slots=True)
class BinLimits:
    """A bin's limits as the server applies them (see :meth:`Ops.configure`)."""

    max_items: int | None
    max_bytes: int | None
    overflow: str


def decode_fetched(reply: Fetched, max_depth: int,
                   cuda_ipc: Callable[[dict[str, Any]], Any] | None = None) -> Fetched:
    """A get/peek reply with its items decoded (and their tags beside them).

    Args:
        cuda_ipc: what a cuda-ipc descriptor becomes (see ``wire.codec.decode``).

    Raises:
        CodecError: a value is malformed.
    """
    if reply.unchanged:
        return reply
    items = reply.items
    n = run_count(items)
    if n:  # runs of like tensors as one buffer (wire/runs.py)
        with gc_paused(n):
            values, tags = decode_items(items, max_depth, cuda_ipc)
        return Fetched(reply.id, reply.kind, values, reply.version, reply.n_items,
                       reply.dropped, False, tags)
    if len(items) == 1:  # (the common reply: one lone tensor of a shape seen before)
        it = items[0]
        value = decode_tensor(it.value, _MAX_RAW_BYTES)
        if value is not None:
            return Fetched(reply.id, reply.kind, (value,), reply.version, reply.n_items,
                           reply.dropped, False, (it.tag,))
    with gc_paused(len(items)):
        values = tuple(decode_many([it.value for it in items], max_depth=max_depth,
                                   cuda_ipc=cuda_ipc))
    return Fetched(reply.id, reply.kind, values, reply.version, reply.n_items, reply.dropped,
                   False, tuple([it.tag for it in items]))


def _version(reply: Any) -> int:
    return int(reply.version)


def _none(reply: Any) -> None:
    return None


def _replica_count(reply: Any) -> int:
    return int(reply.replicas)


def _term(reply: Any) -> int:
    return int(reply.term)


def _true(reply: Any) -> bool:
    return True


def _existed(reply: Any) -> bool:
    return bool(reply.existed)


def _bins(reply: Any) -> dict[str, int]:
    return dict(reply.bins)


def _stats(reply: Any) -> dict[str, Any]:
    return {"server": reply.server, "bins": reply.bins}


def _limits(reply: Configured) -> BinLimits:
    return BinLimits(reply.max_items, reply.max_bytes, reply.overflow)


#: The largest item a reply's buffer may decompress to (as ``wire/codec.decode_many``).
_MAX_RAW_BYTES = 1 << 40
_TENSOR: Any = None  # torch.Tensor, once torch is imported


class _Decode:
    """Converts a get/peek reply: the decoded record, or only its value; with a device, its
    tensors copied there (see :mod:`tensorshare.memory.device`). A cuda-ipc item is read
    where ``face`` reaches bin ``name`` on this host (asked only when one comes)."""

    __slots__ = ("max_depth", "value_only", "device", "non_blocking", "face", "name")

    def __init__(self, max_depth: int, value_only: bool, device: Any = None,
                 non_blocking: bool = False, face: Any = None, name: str = "") -> None:
        self.max_depth, self.value_only = max_depth, value_only
        self.device, self.non_blocking = device, non_blocking
        self.face, self.name = face, name

    def _ipc(self, fields: dict[str, Any]) -> Any:
        reader = cuda_ipc_reader(self.face, self.name, self.device)
        if reader is None:
            raise CodecError(f"cannot read {fields['dtype']}{fields['shape']} here: "
                             f"{CUDA_IPC_REMOTE}")
        return reader(fields)

    def __call__(self, reply: Fetched) -> Any:
        if self.value_only and self.device is None and not reply.unchanged and \
                len(reply.items) == 1 and type(reply.items[0]) is Item:
            # (the common get: one item, a lone tensor, its value only, on the CPU)
            value = decode_tensor(reply.items[0].value, _MAX_RAW_BYTES)
            if value is not None:
                return value if reply.kind == "value" else [value]
        res = decode_fetched(reply, self.max_depth, self._ipc)
        if moves(self.device) and not res.unchanged:
            items = to_device(res.items, self.device, non_blocking=self.non_blocking,
                              whole=res.value if self.value_only else res)
            res = Fetched(res.id, res.kind, items, res.version, res.n_items, res.dropped,
                          False, res.tags)
        return res.value if self.value_only else res


class Ops(StreamOps, ServiceOps, ReplayOps):
    """The ops of a tensorshare client, for any face (see the module docstring).

    A face provides ``limits`` (the server's), ``timeout``, ``compress`` and
    ``compress_min_bytes``, and implements :meth:`_execute`; it may override :meth:`_item`
    (how a value becomes an item: shared memory, deferred encoding).
    """

    timeout: float
    compress: str | None
    compress_min_bytes: int

    @property
    def limits(self) -> Limits:
        """The server's limits (from the last handshake)."""
        raise NotImplementedError

    #: Send a command the way this face does; return what the caller gets (a method of the
    #: face, or its engine's, bound when the face is made: ``Client``).
    _execute: Callable[[Command], Any]

    def _item(self, name: str, value: Any, tag: int | None) -> Item:
        global _TENSOR
        if _TENSOR is None:  # (torch is imported by whoever made a tensor, not by us)
            torch = sys.modules.get("torch")
            _TENSOR = torch.Tensor if torch is not None else None
        if (type(value) is _TENSOR and tag is None
                and (self.compress is None or value.nbytes < self.compress_min_bytes)):
            # A lone CPU tensor (the common value): encoded by wire/tensors, checked as
            # make_item checks it; anything else (or shared memory's size) goes that way.
            limits = self.limits
            enc = encode_tensor(value)
            if enc is not None and enc.nbytes + _FRAME_SLACK <= limits.max_frame_bytes:
                share = self._share_min_bytes()
                if share is None or enc.nbytes < share:
                    check_bin_name(name, limits.max_name_bytes)
                    return Item(enc, None)
        return make_item(name, value, tag, self.limits, self.compress, self.compress_min_bytes,
                         self._share_min_bytes())

    def _items(self, name: str, values: list[Any], tags: list[int | None]) -> list[Item]:
        """:meth:`_item` for a batch of appends to one bin (see :func:`make_items`)."""
        return make_items(name, values, tags, self.limits, self.compress,
                          self.compress_min_bytes, self._share_min_bytes())

    def _share_min_bytes(self) -> int | None:
        """The smallest buffer this face passes through shared memory right now (``None``:
        none; a face whose connection agreed on memfds says otherwise)."""
        return None

    def _check_name(self, name: str) -> None:
        check_bin_name(name, self.limits.max_name_bytes)

    def _same_host(self, name: str) -> bool:
        """Whether bin ``name`` is on a server this face reaches over ``unix://`` (so on
        this host: a cuda-ipc item can be read)."""
        pick = getattr(type(self), "client_for", None)  # (on the class: a face's own
        if pick is not None:                            # __getattr__ is not asked)
            return bool(pick(self, name)._same_host(name))
        for attr in ("_client", "_host"):
            inner = self.__dict__.get(attr) if hasattr(self, "__dict__") else None
            if inner is not None and inner is not self:
                return bool(inner._same_host(name))
        return str(getattr(self, "address", "")).startswith("unix://")

    # -- writes -----------------------------------------------------------------------------
    def put(self, name: str, value: Any, *, tag: int | None = None,
            wait_room: bool = False) -> Any:
        """Store ``value`` in bin ``name``, replacing whatever it held.

        Args:
            name: the bin (any non-empty str up to the server's name limit).
            value: tensors, numpy arrays, and dict/list/tuple/str/bytes/int/float/bool/None.
            tag: optional integer stored with the item (see ``min_tag`` in :meth:`fetch`).
            wait_room: when this client's user is at its quota (``max_memory`` in the
                server's users file), wait on the server for room (up to 80% of the client's
                timeout, then ``QuotaExceeded``) instead of failing at once. (Items a get
                took count until its client acknowledges them: with its next request, or
                by itself ``ACK_DELAY``, 0.2 s, after the reply when it sends nothing.)

        Returns:
            The bin's new version; the server holds the value when it is returned. Do not
            change the tensors of ``value`` before then: they are sent from their own memory
            (and sent again if the connection drops meanwhile).

        Raises:
            UnsupportedType: ``value`` holds a type that cannot be sent (nothing was sent).
            MemoryLimitExceeded: the server's memory limit would be exceeded.
            FrameTooLarge: the value is larger than the server's frame limit: refused here,
                before anything is sent (a ``ValueError``, and a ``LimitExceeded``).
            BinFull: the bin is configured with ``max_bytes`` and the value does not fit.
            QuotaExceeded: this client's user is at its ``max_memory`` (after waiting, with
                ``wait_room``); the message names the user and the quota.
            PermissionDenied: the user may not write this bin.
            ReplyTimeout, ConnectionLost, SessionLost: no confirmation from the server (the
                message says whether the put may have taken effect).
        """
        item = self._item(name, value, tag)
        put = Put(0, name, item, room=BLOCK_SHARE * self.timeout) if wait_room else \
            Put(0, name, item)
        return self._execute(Command(put, f"put to bin {name!r}", _version))

    def append(self, name: str, value: Any, *, tag: int | None = None,
               wait_room: bool = False) -> Any:
        """Append ``value`` as one item to bin ``name`` (a list is one item, never flattened).

        Appending to a bin that holds a put value turns it into ``[value, new]``. On a bin
        configured with ``overflow="block"`` that is full, this waits on the server for a
        get to make room (up to 80% of the client's timeout, then ``BinFull``). With
        ``wait_room``, it also waits for room in its user's quota (see :meth:`put`).

        Returns:
            The bin's new version. Raises: as :meth:`put`, and ``BinFull`` for a full bin.
        """
        item = self._item(name, value, tag)
        return self._execute(Command(Append(0, name, item, BLOCK_SHARE * self.timeout, (),
                                            wait_room=bool(wait_room)),
                                     f"append to bin {name!r}", _version))

    def delete(self, name: str) -> Any:
        """Delete bin ``name``. Returns whether it existed."""
        self._check_name(name)
        return self._execute(Command(Delete(0, name), f"delete of bin {name!r}", _existed))

    def configure(self, name: str, max_items: int | None = None, max_bytes: int | None = None,
                  overflow: str = "reject") -> Any:
        """Bound bin ``name``: at ``max_items`` items or ``max_bytes`` bytes it is full.

        Args:
            overflow: what an append to a full bin does: ``"reject"`` raises ``BinFull``;
                ``"drop_oldest"`` removes the oldest items to make room (listeners' events
                say how many in ``dropped``); ``"block"`` waits on the server until a get
                makes room (backpressure for producers that outrun their consumers).

        Returns:
            The limits as the server now applies them (:class:`BinLimits`; they persist
            with the bin's name).
        """
        self._check_name(name)
        return self._execute(Command(Configure(0, name, max_items, max_bytes, overflow),
                                     f"configure of bin {name!r}", _limits))

    # -- reads ------------------------------------------------------------------------------
    def get(self, name: str, *, max_items: int | None = None, timeout: Wait = NOWAIT,
            device: Any = None, non_blocking: bool = False) -> Any:
        """Return the content of bin ``name`` and remove it.

        Args:
            name: the bin.
            max_items: for an appended bin, take at most this many items from the front
                (FIFO) and leave the rest.
            timeout: by default (:data:`NOWAIT`), do not wait. A number: wait up to that
                many seconds for data. ``None``: wait without limit (across reconnects).
            device: copy every ``torch.Tensor`` of the value to this device (``"cuda"``,
                ``"cuda:1"``, a ``torch.device``); numpy arrays, strings and numbers stay.
                Checked before anything is sent: a device this torch cannot use is a
                ``ValueError`` and the bin is untouched. ``None`` (default) or ``"cpu"``:
                CPU tensors, as always. (A cuda-ipc item arrives on its own GPU unless
                ``device`` says otherwise.)
            non_blocking: with a CUDA ``device``: return once the copies are queued; they
                are ordered before the caller's *current* CUDA stream (it waits on an event
                recorded after them), so work queued on that stream sees the data; work on
                another stream must wait on the current one first. Default: return when
                the copies are done.

        Returns:
            The value of a put bin, or the list of items of an appended bin.

        Raises:
            BinNotFound: the bin is missing or empty (when not waiting).
            WaitTimeout: no data arrived within ``timeout`` (a :class:`Timeout`).
            DeviceCopyFailed: the items were taken but could not be copied to ``device``:
                the error's ``value`` holds them, on the CPU (nothing is lost).
        """
        return self._fetch(name, True, max_items, timeout, None, None, 1, value_only=True,
                           device=device, non_blocking=non_blocking)

    def peek(self, name: str, *, max_items: int | None = None, timeout: Wait = NOWAIT,
             device: Any = None, non_blocking: bool = False) -> Any:
        """Like :meth:`get`, but leave the content in the bin."""
        return self._fetch(name, False, max_items, timeout, None, None, 1, value_only=True,
                           device=device, non_blocking=non_blocking)

    def fetch(self, name: str, *, remove: bool, max_items: int | None = None,
              timeout: Wait = NOWAIT, min_tag: int | None = None,
              newer_than: int | None = None, min_items: int = 1, device: Any = None,
              non_blocking: bool = False) -> Any:
        """The full form of get (``remove=True``) and peek (``remove=False``).

        Args:
            min_tag: skip items tagged below this (and untagged ones); a get also removes
                them from the bin. How many is reported in ``dropped``.
            newer_than: only a bin whose version is above this counts. Without waiting, an
                older bin gives ``unchanged=True`` and no data (nothing is downloaded); when
                waiting, the call returns once the bin is newer.
            min_items: when waiting, wait until at least this many items are available.
            (others as :meth:`get`; a ``DeviceCopyFailed``'s ``value`` is the whole record)

        Returns:
            A :class:`FetchResult`: ``value``, ``items``, ``tags``, ``kind``, ``version``,
            ``n_items`` (left in the bin), ``dropped``, ``unchanged``.
        """
        return self._fetch(name, remove, max_items, timeout, min_tag, newer_than, min_items,
                           value_only=False, device=device, non_blocking=non_blocking)

    def _fetch(self, name: str, remove: bool, max_items: int | None, timeout: Wait,
               min_tag: int | None, newer_than: int | None, min_items: int, *,
               value_only: bool, device: Any = None, non_blocking: bool = False) -> Any:
        dev = None if device is None else check_device(device)  # (before anything is sent)
        seconds: float | None = None
        if timeout is NOWAIT:
            wait = False
        else:
            wait = True
            if timeout is not None:
                if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                        or not 0 <= timeout < math.inf):
                    raise ValueError(f"timeout must be a finite number >= 0, or None; got "
                                     f"{timeout!r}")
                seconds = float(timeout)
        limits = self.limits  # (read once: a face's property)
        check_bin_name(name, limits.max_name_bytes)
        spec = FetchSpec(remove, max_items, wait, seconds, min_tag, newer_than, min_items)
        if dev is None:
            convert = _Decode(limits.max_depth, value_only, face=self, name=name)
        else:
            want_pinned(dev)
            convert = _Decode(limits.max_depth, value_only, dev, bool(non_blocking), self, name)
        return self._execute(Command(Fetch(0, name, spec), f"{spec.op} on bin {name!r}",
                                     convert))

    def list(self) -> Any:
        """Return ``{bin: n_items}`` for every non-empty bin: how many items each holds (1
        for a put bin), not its version (:meth:`stats` has both, per bin)."""
        return self._execute(Command(ListBins(0), "list", _bins))

    def stats(self, glob: str | None = None) -> Any:
        """The server's statistics and a summary of every bin (matching ``glob``).

        On a server with users, a user who may not read every bin sees only the bins it
        may read, and its own totals (``server["user"]``: memory held against its quota,
        connections, requests, denials); one who may read ``*`` sees the whole server,
        every user's entry included (``server["users"]``).

        Returns:
            ``{"server": {...}, "bins": {name: {...}}}`` (see docs/PROTOCOL.md, ``stats``).
        """
        return self._execute(Command(Stats(0, glob), "stats", _stats))

    def ping(self) -> Any:
        """Round-trip to the server (raises if it does not answer within ``timeout``)."""
        return self._execute(Command(Ping(0), "ping", _none))

    def reload_users(self) -> Any:
        """Make the server reread its users file and token files (what ``SIGHUP`` does).

        Raises:
            PermissionDenied: this client's user is not an ``admin``.
            InvalidRequest: a file does not load; the server keeps its old users (the
                message says why).
        """
        return self._execute(Command(Reload(0), "reload of the users", _true))

    def wait_replicas(self, n: int, timeout: float) -> Any:
        """How many replicas have every write this client made so far (as Redis's ``WAIT``):
        answered once ``n`` have them, or after ``timeout`` seconds (at most nine tenths of
        the client's own ``timeout``) with how many do. ``0`` from a server without
        replicas."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError("n must be a whole number >= 0")
        wait = min(check_timeout(timeout), self.timeout * 0.9)
        request: Any = WaitReplicas(0, n, wait)
        return self._execute(Command(request, "wait_replicas", _replica_count))

    def promote(self) -> Any:
        """Make the server (a replica) the primary under a new term; returns the term. A
        primary answers its own term and changes nothing. Needs an ``admin`` user."""
        request: Any = Promote(0)
        return self._execute(Command(request, "promote", _term))

    # -- listeners --------------------------------------------------------------------------
    def listen(self, name: str, callback: Callable[[dict[str, Any]], Any], *,
               inline: bool = False) -> Any:
        """Call ``callback(event)`` on every change of bin ``name``.

        ``event`` is a dict: ``{'status': 'OK', 'bin': name, 'op': 'put'|'append'|'get'|
        'delete'|'restore', 'n_items': n, 'version': v}``. After a reconnect, a bin that
        changed meanwhile gives one ``op: 'resync'`` event with its current version and item
        count (``'restarted': True`` if the server restarted without persistence). Events
        come in the order the changes happened. Completes once the server has registered
        the listener; if it refuses, the callback is forgotten.

        Args:
            inline: (blocking client) run ``callback`` on the thread that reads the
                connection, before any reply that arrives after the event is handed over;
                only for callbacks that return at once (e.g. put the event on a queue). By
                default callbacks run on the client's own event thread, so a slow callback
                never delays replies.
        """
        self._check_name(name)
        if not callable(callback):
            raise TypeError("callback must be callable")
        return self._execute(Command(Listen(0, name), f"listen to bin {name!r}", _none,
                                     "listen", (callback, inline)))

    def unlisten(self, name: str) -> Any:
        """Stop listening to bin ``name``. Returns whether this client was listening."""
        self._check_name(name)
        return self._execute(Command(Unlisten(0, name), f"unlisten from bin {name!r}", _true,
                                     "unlisten"))


def lone_cpu_tensor(value: Any, tag: int | None) -> bool:
    """Whether ``value`` is a lone CPU tensor with a plain tag (the common batch item, which
    a pipeline encodes later, many at a time)."""
    torch = sys.modules.get("torch")
    return (torch is not None and type(value) is torch.Tensor and value.is_cpu
            and (tag is None or type(tag) is int))


class BinClient(Ops):
    """A blocking client of one server or of several: what ``rl``, ``compat`` and the wings
    depend on, so that a :class:`~.sharded.ShardedClient` fits wherever a
    :class:`~.blocking.Client` does. Both are one; a face that is not (a pipeline, the
    ``begin`` face) is only an :class:`Ops`."""

    #: The face whose ops send at once and return a ``PendingCall``.
    begin: Ops

    @property
    def closed(self) -> bool:
        """Whether the client is closed (every call fails)."""
        raise NotImplementedError

    @property
    def connected(self) -> bool:
        """Whether the client is connected right now (``False`` while reconnecting)."""
        raise NotImplementedError

    @property
    def server_id(self) -> str:
        """Changes when a server restarted without persistence (its versions began again)."""
        raise NotImplementedError

    def pipeline(self, *, raise_on_error: bool = True) -> Any:
        """Queue many requests and send them together (see ``Client.pipeline``)."""
        raise NotImplementedError

    def close(self) -> None:
        """Close the connection(s); pending calls fail. Idempotent."""
        raise NotImplementedError
