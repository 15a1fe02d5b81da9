"""Sans-I/O connection state: bytes in -> messages out, messages in -> bytes out.

Shared by the Twisted server, the Twisted client and the blocking client. Nothing here touches
a socket, a thread, a clock or Twisted, so it can be tested byte by byte.

Usage from an I/O shell::

    conn = Connection(CLIENT)
    sock.sendmsg(conn.send(Hello(id=conn.next_id(), versions=(1,))))
    for msg in conn.receive_data(sock.recv(65536)):
        ...

A header is a msgpack map; see ``docs/PROTOCOL.md`` for every field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import msgpack

from .codec import Buffer, Encoded, validate
from .errors import LimitExceeded, ProtocolError
from .frames import BytesLike, Frame, FrameDecoder, OversizedFrame, encode_frame, payload_layout
from .messages import (
    Acked,
    Append,
    Cancel,
    Changed,
    Delete,
    Deleted,
    ErrorReply,
    Fetched,
    Get,
    Hello,
    HelloReply,
    Item,
    Limits,
    ListBins,
    Listen,
    Listening,
    Listing,
    Message,
    Peek,
    Ping,
    Put,
    Stored,
    Unlisten,
)

__all__ = [
    "CLIENT",
    "PROTOCOL_VERSIONS",
    "SERVER",
    "BadRequest",
    "Connection",
    "ProtocolViolation",
    "check_bin_name",
]

CLIENT = "client"
SERVER = "server"
PROTOCOL_VERSIONS: tuple[int, ...] = (1,)
REPLY_SLACK = 64 * 1024  # see Connection.set_limits
_FETCH_OPS: dict[str, type[Get] | type[Peek]] = {"get": Get, "peek": Peek}
_STORE_OPS: dict[str, type[Put] | type[Append]] = {"put": Put, "append": Append}
_ALIGN_MASK = 63

_packb = msgpack.Packer(use_bin_type=True).pack


def _unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)


@dataclass(frozen=True, slots=True)
class ProtocolViolation:
    """The peer broke the wire format: the connection must be closed.

    It comes last in the list returned by ``receive_data``, after every message that was
    complete before the violation, so those are still handled in order.
    """

    message: str


@dataclass(frozen=True, slots=True)
class BadRequest:
    """A request that parsed as a frame but cannot be served; the server answers it with an error.

    The connection stays usable: the frame boundaries were intact.
    """

    id: int
    code: str
    message: str


def check_bin_name(name: object, max_name_bytes: int) -> str:
    """Check a bin name: a non-empty str of at most ``max_name_bytes`` UTF-8 bytes.

    Any characters are allowed (spaces, '|', '/', unicode).

    Returns:
        The name.

    Raises:
        TypeError: the name is not a str.
        ValueError: the name is empty or too long (the message names the limit).
    """
    if not isinstance(name, str):
        raise TypeError(f"bin name must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError("bin name must not be empty")
    n = len(name.encode("utf-8", "surrogatepass"))
    if n > max_name_bytes:
        raise ValueError(f"bin name of {n} bytes exceeds max_name_bytes={max_name_bytes}")
    return name


class _Invalid(Exception):
    """Internal: a request header is malformed; carries the error code."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


class Connection:
    """The protocol state of one connection, for one side (``CLIENT`` or ``SERVER``).

    Args:
        role: ``CLIENT`` or ``SERVER``.
        limits: the limits applied to received frames and values.

    Not thread-safe as a whole; the blocking client serialises ``send`` with its own lock and
    feeds received data from one reader thread. The only state both touch is the table of
    outstanding request ids, and each side only adds or pops its own keys.
    """

    def __init__(self, role: str, limits: Limits | None = None) -> None:
        if role not in (CLIENT, SERVER):
            raise ValueError(f"role must be {CLIENT!r} or {SERVER!r}")
        self.role = role
        self.limits = limits or Limits()
        self._decoder = FrameDecoder(self.limits.max_frame_bytes, self.limits.max_header_bytes)
        self._next_id = 0
        self._outstanding: dict[int, str] = {}  # client side: request id -> op, to parse replies

    # -- ids --------------------------------------------------------------------------------
    def next_id(self) -> int:
        """Return a fresh request id (1, 2, ...)."""
        self._next_id += 1
        return self._next_id

    def forget(self, request_id: int) -> None:
        """Stop expecting a reply to ``request_id`` (the caller gave up on it)."""
        self._outstanding.pop(request_id, None)

    @property
    def outstanding(self) -> int:
        """How many requests sent by this side still await a reply."""
        return len(self._outstanding)

    @property
    def receiving(self) -> bool:
        """Whether a frame is partly received (its rest is still to come)."""
        return self._decoder.in_frame

    def set_limits(self, limits: Limits) -> None:
        """Adopt new limits (the client takes the server's from the handshake).

        On the client side they bound what it sends; what it receives may be a little
        larger: a reply carries a few more header fields than the request that stored the
        value, and the value trees of several items share one reply header. The server keeps
        each reply's items within ``max_frame_bytes``.
        """
        self.limits = limits
        if self.role == CLIENT:
            self._decoder.max_frame_bytes = limits.max_frame_bytes + REPLY_SLACK
            self._decoder.max_header_bytes = limits.max_frame_bytes + REPLY_SLACK
        else:
            self._decoder.max_frame_bytes = limits.max_frame_bytes
            self._decoder.max_header_bytes = limits.max_header_bytes

    # -- input ------------------------------------------------------------------------------
    def receive_data(self, data: BytesLike) -> list[Message | BadRequest | ProtocolViolation]:
        """Feed received bytes; return the messages they complete.

        Never raises for bad input: if the peer broke the wire format, the last event is a
        :class:`ProtocolViolation` and the connection must be closed.
        """
        try:
            frames = self._decoder.feed(data)
        except ProtocolError as exc:
            return self._parse_frames(getattr(exc, "frames", []), exc)
        return self._parse_frames(frames)

    def get_buffer(self) -> memoryview | None:
        """A writable view to ``recv_into`` directly, when a large frame part is expected."""
        return self._decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> list[Message | BadRequest | ProtocolViolation]:
        """Account for bytes received into :meth:`get_buffer`'s view (see :meth:`receive_data`)."""
        return self._parse_frames(self._decoder.buffer_updated(nbytes))

    def _parse_frames(self, frames: list[Frame | OversizedFrame],
                      error: ProtocolError | None = None,
                      ) -> list[Message | BadRequest | ProtocolViolation]:
        out: list[Message | BadRequest | ProtocolViolation] = []
        try:
            for frame in frames:
                out.append(self._parse_frame(frame))
        except ProtocolError as exc:
            error = exc
        if error is not None:
            out.append(ProtocolViolation(str(error)))
        return out

    def _parse_frame(self, frame: Frame | OversizedFrame) -> Message | BadRequest:
        try:
            header = _unpackb(frame.header)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"frame header is not valid msgpack: {exc}") from None
        if not isinstance(header, dict):
            raise ProtocolError("frame header is not a msgpack map")
        if isinstance(frame, OversizedFrame):
            rid = header.get("id")
            if self.role != SERVER or not _is_int(rid) or rid < 1:
                raise ProtocolError(
                    f"frame payload of {frame.payload_len} bytes exceeds "
                    f"max_frame_bytes={frame.limit}"
                )
            return BadRequest(
                rid,
                "limit_exceeded",
                f"frame of {frame.payload_len} payload bytes exceeds the server's "
                f"max_frame_bytes={frame.limit}; nothing was stored",
            )
        if self.role == SERVER:
            return self._parse_request(header, frame.payload)
        return self._parse_server_message(header, frame.payload)

    # -- server side: parse requests ----------------------------------------------------------
    def _parse_request(self, h: dict[str, Any], payload: bytearray) -> Message | BadRequest:
        op = h.get("op")
        rid = h.get("id")
        if not _is_int(rid) or rid < 1:
            raise ProtocolError(f"request without a valid 'id' (an integer >= 1; op {op!r})")
        try:
            return self._build_request(op, rid, h, payload)
        except _Invalid as exc:
            return BadRequest(rid, exc.code, str(exc))

    def _name(self, h: dict[str, Any]) -> str:
        try:
            return check_bin_name(h.get("bin"), self.limits.max_name_bytes)
        except TypeError as exc:
            raise _Invalid(str(exc)) from None
        except ValueError as exc:
            code = "limit_exceeded" if "exceeds" in str(exc) else "invalid_request"
            raise _Invalid(str(exc), code) from None

    def _build_request(self, op: Any, rid: int, h: dict[str, Any], payload: bytearray) -> Message:
        if op in _STORE_OPS:
            name = self._name(h)
            items = self._parse_items(h, payload)
            if len(items) != 1:
                raise _Invalid(f"{op} carries exactly one item, got {len(items)}")
            return _STORE_OPS[op](rid, name, items[0])
        if op in _FETCH_OPS:
            name = self._name(h)
            max_items = _opt_int(h, "max_items", minimum=1)
            min_tag = _opt_int(h, "min_tag")
            newer_than = _opt_int(h, "newer_than")
            min_items = _opt_int(h, "min_items", minimum=1) or 1
            wait = h.get("wait")
            if wait is None:
                wait = False
            elif not isinstance(wait, bool):
                raise _Invalid("'wait' must be a bool")
            timeout = h.get("timeout")
            if timeout is not None:
                if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                        or not math.isfinite(timeout) or timeout < 0):
                    raise _Invalid("'timeout' must be a finite non-negative number or nil")
                timeout = float(timeout)
            return _FETCH_OPS[op](  # type: ignore[no-any-return]
                rid, name, max_items, wait, timeout, min_tag, newer_than, min_items
            )
        if op == "list":
            return ListBins(rid)
        if op == "delete":
            return Delete(rid, self._name(h))
        if op == "listen":
            return Listen(rid, self._name(h))
        if op == "unlisten":
            return Unlisten(rid, self._name(h))
        if op == "ping":
            return Ping(rid)
        if op == "cancel":
            target = _opt_int(h, "target")
            if target is None:
                raise _Invalid("cancel needs an integer 'target'")
            return Cancel(rid, target)
        if op == "hello":
            versions = h.get("versions")
            if not isinstance(versions, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in versions
            ):
                raise _Invalid("hello needs 'versions', a list of integers")
            client = h.get("client", "")
            auth = h.get("auth")
            return Hello(rid, tuple(versions), client if isinstance(client, str) else "",
                         auth if isinstance(auth, str) else None)
        raise _Invalid(f"unknown op {op!r}")

    def _parse_items(self, h: dict[str, Any], payload: bytearray) -> list[Item]:
        raw_items = h.get("items")
        if not isinstance(raw_items, list):
            raise _Invalid("'items' must be a list")
        view = memoryview(payload)
        end = 0  # buffers must be ordered and disjoint: no aliasing tricks
        items = []
        max_depth = self.limits.max_depth
        for raw in raw_items:
            if not isinstance(raw, list) or len(raw) != 3:
                raise _Invalid("an item must be [value, buffers, tag]")
            value, bufs, tag = raw
            if not isinstance(value, bytes) or not isinstance(bufs, list):
                raise _Invalid("an item must be [bin value, list of buffers, tag]")
            if tag is not None and (not isinstance(tag, int) or isinstance(tag, bool)):
                raise _Invalid("an item's tag must be an integer or nil")
            buffers = []
            for desc in bufs:
                buf, end = _parse_buffer(desc, view, end)
                buffers.append(buf)
            try:
                validate(value, len(buffers), max_depth=max_depth,
                         raw_sizes=[b.raw_nbytes for b in buffers])
            except ValueError as exc:
                code = "limit_exceeded" if "depth" in str(exc) else "invalid_request"
                raise _Invalid(f"malformed value: {exc}", code) from None
            items.append(Item(Encoded(value, tuple(buffers)), tag))
        if end != len(payload):
            raise _Invalid(f"payload of {len(payload)} bytes but buffers end at {end}")
        return items

    # -- client side: parse replies and notifications --------------------------------------
    def _parse_server_message(self, h: dict[str, Any], payload: bytearray) -> Message:
        op = h.get("op")
        try:
            if op == "notify":
                return Changed(_str(h, "bin"), _str(h, "event"), _int(h, "n_items"), _int(h, "version"))
            if op == "error":
                return ErrorReply(0, _str(h, "code"), _str(h, "message"))
            if op != "reply":
                raise ProtocolError(f"unexpected message op {op!r} from server")
            rid = _int(h, "id")
            req_op = self._outstanding.pop(rid, None)
            if not h.get("ok"):
                return ErrorReply(rid, _str(h, "code"), _str(h, "message"))
            if req_op is None:
                # A reply to a request we gave up on (or never sent): surface it as such.
                return Acked(rid, False) if not h.get("items") else Fetched(
                    rid, _str(h, "kind"), tuple(self._parse_items(h, payload)),
                    _int(h, "version"), _int(h, "n_items"))
            return self._build_reply(req_op, rid, h, payload)
        except _Invalid as exc:
            raise ProtocolError(f"malformed message from server: {exc}") from None
        except (KeyError, TypeError) as exc:
            raise ProtocolError(f"malformed message from server: {exc!r}") from None

    def _build_reply(self, req_op: str, rid: int, h: dict[str, Any], payload: bytearray) -> Message:
        if req_op in ("get", "peek"):
            unchanged = bool(h.get("unchanged", False))
            items = () if unchanged else tuple(self._parse_items(h, payload))
            return Fetched(rid, _str(h, "kind"), items, _int(h, "version"), _int(h, "n_items"),
                           _int(h, "dropped"), unchanged)
        if req_op in ("put", "append"):
            return Stored(rid, _int(h, "version"), _int(h, "n_items"))
        if req_op == "list":
            bins = h["bins"]
            if not isinstance(bins, dict):
                raise _Invalid("'bins' must be a map")
            return Listing(rid, bins)
        if req_op == "delete":
            return Deleted(rid, bool(h["existed"]), _int(h, "version"))
        if req_op == "listen":
            return Listening(rid, _int(h, "version"), _int(h, "n_items"))
        if req_op == "hello":
            lim = h["limits"]
            try:
                limits = Limits(
                    int(lim["max_frame_bytes"]), int(lim["max_header_bytes"]),
                    int(lim["max_depth"]), int(lim["max_name_bytes"]),
                )
            except ValueError as exc:
                raise _Invalid(f"impossible limits in the handshake: {exc}") from None
            return HelloReply(rid, _int(h, "version"), _str(h, "server"), limits)
        return Acked(rid, bool(h.get("flag", True)))

    # -- output -----------------------------------------------------------------------------
    def send(self, msg: Message) -> list[BytesLike]:
        """Serialise one message into frame chunks (buffers are not copied).

        Returns:
            Chunks for ``sendmsg`` / ``writeSequence``, in order.
        """
        header: dict[str, Any]
        items: Sequence[Item] = ()
        cls = type(msg)
        if cls is Put or cls is Append:
            header = {"op": "put" if cls is Put else "append", "id": msg.id, "bin": msg.bin}  # type: ignore[union-attr]
            items = (msg.item,)  # type: ignore[union-attr]
        elif cls is Get or cls is Peek:
            m: Get | Peek = msg  # type: ignore[assignment]
            header = {"op": "get" if cls is Get else "peek", "id": m.id, "bin": m.bin}
            if m.max_items is not None:
                header["max_items"] = m.max_items
            if m.wait:
                header["wait"] = True
                header["timeout"] = m.timeout
                if m.min_items != 1:
                    header["min_items"] = m.min_items
            if m.min_tag is not None:
                header["min_tag"] = m.min_tag
            if m.newer_than is not None:
                header["newer_than"] = m.newer_than
        elif cls is Fetched:
            f: Fetched = msg  # type: ignore[assignment]
            header = {"op": "reply", "id": f.id, "ok": True, "kind": f.kind, "version": f.version,
                      "n_items": f.n_items, "dropped": f.dropped}
            if f.unchanged:
                header["unchanged"] = True
            items = f.items
        elif cls is Changed:
            c: Changed = msg  # type: ignore[assignment]
            header = {"op": "notify", "bin": c.bin, "event": c.op, "n_items": c.n_items,
                      "version": c.version}
        elif cls is Stored:
            header = {"op": "reply", "id": msg.id, "ok": True, "version": msg.version,  # type: ignore[union-attr]
                      "n_items": msg.n_items}  # type: ignore[union-attr]
        elif cls is ErrorReply:
            e: ErrorReply = msg  # type: ignore[assignment]
            if e.id == 0:
                header = {"op": "error", "code": e.code, "message": e.message}
            else:
                header = {"op": "reply", "id": e.id, "ok": False, "code": e.code, "message": e.message}
        else:
            header = _simple_header(msg)
        buffers: list[BytesLike] = []
        if items:
            header["items"] = _items_header(items, buffers)
        packed = _packb(header)
        chunks = encode_frame(packed, buffers)
        if self.role == CLIENT and header["op"] != "reply":
            self._check_request_size(header, len(packed), sum(len(c) for c in chunks))
            if "id" in header:
                self._outstanding[header["id"]] = header["op"]
        return chunks

    def _check_request_size(self, header: dict[str, Any], header_len: int, size: int) -> None:
        """Refuse, before sending, a request the server would refuse by its limits.

        Raises:
            LimitExceeded: the frame or its header is over the server's limit; nothing
                was sent, and the connection stays usable.
        """
        limits = self.limits
        what = f"{header['op']} of bin {header['bin']!r}" if "bin" in header else header["op"]
        if size > limits.max_frame_bytes:
            raise LimitExceeded(f"{what} not sent: the request takes {size} bytes, over the "
                                f"server's max_frame_bytes={limits.max_frame_bytes}")
        if header_len > limits.max_header_bytes:
            raise LimitExceeded(
                f"{what} not sent: its header takes {header_len} bytes (strings, bytes and "
                f"numbers travel there, tensors do not), over the server's "
                f"max_header_bytes={limits.max_header_bytes}")


def _simple_header(msg: Message) -> dict[str, Any]:
    if isinstance(msg, ListBins):
        return {"op": "list", "id": msg.id}
    if isinstance(msg, (Delete, Listen, Unlisten)):
        op = {Delete: "delete", Listen: "listen", Unlisten: "unlisten"}[type(msg)]
        return {"op": op, "id": msg.id, "bin": msg.bin}
    if isinstance(msg, Ping):
        return {"op": "ping", "id": msg.id}
    if isinstance(msg, Cancel):
        return {"op": "cancel", "id": msg.id, "target": msg.target}
    if isinstance(msg, Hello):
        h: dict[str, Any] = {"op": "hello", "id": msg.id, "versions": list(msg.versions),
                             "client": msg.client}
        if msg.auth is not None:
            h["auth"] = msg.auth
        return h
    if isinstance(msg, HelloReply):
        lim = msg.limits
        return {"op": "reply", "id": msg.id, "ok": True, "version": msg.version,
                "server": msg.server, "limits": {
                    "max_frame_bytes": lim.max_frame_bytes, "max_header_bytes": lim.max_header_bytes,
                    "max_depth": lim.max_depth, "max_name_bytes": lim.max_name_bytes}}
    if isinstance(msg, Listing):
        return {"op": "reply", "id": msg.id, "ok": True, "bins": msg.bins}
    if isinstance(msg, Deleted):
        return {"op": "reply", "id": msg.id, "ok": True, "existed": msg.existed,
                "version": msg.version}
    if isinstance(msg, Listening):
        return {"op": "reply", "id": msg.id, "ok": True, "version": msg.version,
                "n_items": msg.n_items}
    if isinstance(msg, Acked):
        return {"op": "reply", "id": msg.id, "ok": True, "flag": msg.flag}
    raise TypeError(f"cannot send {type(msg).__name__}")


def _items_header(items: Sequence[Item], buffers: list[BytesLike]) -> list[list[Any]]:
    """Describe items for the header and collect their buffers in payload order."""
    sizes = [b.nbytes for it in items for b in it.value.buffers]
    offsets, _ = payload_layout(sizes)
    k = 0
    out = []
    for it in items:
        descs: list[list[Any]] = []
        for b in it.value.buffers:
            off = offsets[k]
            k += 1
            buffers.append(b.data)
            if b.codec is None:
                descs.append([off, b.nbytes])
            else:
                descs.append([off, b.nbytes, b.codec, b.raw_nbytes])
        out.append([it.value.value, descs, it.tag])
    return out


def _parse_buffer(desc: Any, view: memoryview, end: int) -> tuple[Buffer, int]:
    if not isinstance(desc, list) or len(desc) not in (2, 4):
        raise _Invalid("a buffer must be [offset, nbytes] or [offset, nbytes, codec, raw_nbytes]")
    off, n = desc[0], desc[1]
    if not (_is_int(off) and _is_int(n)) or off < 0 or n < 0:
        raise _Invalid("buffer offset and size must be non-negative integers")
    if off & _ALIGN_MASK:
        raise _Invalid(f"buffer offset {off} is not a multiple of 64")
    if off < end:
        raise _Invalid(f"buffer at offset {off} overlaps the previous one (ends at {end})")
    if off + n > len(view):
        raise _Invalid(f"buffer [{off}, {off + n}) lies outside the {len(view)}-byte payload")
    if len(desc) == 4:
        codec, raw = desc[2], desc[3]
        if codec != "lz4" or not _is_int(raw) or raw < 0:
            raise _Invalid(f"unsupported buffer codec {codec!r}")
        return Buffer(view[off : off + n], codec, raw), off + n
    return Buffer(view[off : off + n]), off + n


def _is_int(v: object) -> TypeGuard[int]:
    """An integer, and not a bool (msgpack keeps them apart; Python does not)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_int(h: dict[str, Any], key: str, minimum: int | None = None) -> int | None:
    v = h.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise _Invalid(f"{key!r} must be an integer")
    if minimum is not None and v < minimum:
        raise _Invalid(f"{key!r} must be at least {minimum}")
    return v


def _int(h: dict[str, Any], key: str) -> int:
    v = h[key]
    if not _is_int(v):
        raise _Invalid(f"{key!r} must be an integer")
    return v


def _str(h: dict[str, Any], key: str) -> str:
    v = h[key]
    if not isinstance(v, str):
        raise _Invalid(f"{key!r} must be a string")
    return v
