"""What the rows of the op table are made of: :class:`Op`, and the checks of header fields.

A row (:class:`Op`) says how a request becomes a header and back, and how its reply is
parsed. Every kind of bin writes its rows with the checks here: :mod:`.protocol` the core's,
:mod:`.streams` and :mod:`.services` theirs, and :mod:`.protocol` builds the one table
(``OPS``) from them all. Each check reads one field of a header (a msgpack map already
unpacked into a dict) and raises :class:`InvalidField` (a ``ValueError``) when it is malformed,
with the error code the server answers (``invalid_request`` unless said otherwise); the
server turns it into an error reply, and a client into a protocol violation.

:func:`read_items` reads the ``items`` of a header and the buffers they describe in the
frame's payload (``docs/PROTOCOL.md`` §4), memfd buffers included (:class:`Fds`).

No I/O: this module is compiled with the protocol (``fields.pxd``), and runs on every request.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeGuard

from ..errors import CodecError, InvalidRequest, LimitExceeded, NestingTooDeep, ProtocolError
from .codec import validate
from .frames import Payload
from .messages import Limits, Reply, Request
from .records import Acked, Buffer, Item, encoded_of, raw_buffer
from .runs import read_run

__all__ = [
    "ACCESS",
    "MAX_APPEND_ITEMS",
    "PARSING_FDS",
    "Fds",
    "InvalidField",
    "NameTooLong",
    "Op",
    "ParseReply",
    "ParseRequest",
    "check_bin",
    "check_bin_name",
    "check_name",
    "check_bool",
    "check_int",
    "check_str",
    "check_timeout",
    "is_int",
    "kind_op",
    "opt_int",
    "parse_acked",
    "read_items",
]

# The most items one append may carry (a pipeline sends larger batches as several appends).
MAX_APPEND_ITEMS = 100_000
_ALIGN_MASK = 63


class InvalidField(ValueError):
    """A header field is malformed: the request is answered with the error ``code``.

    Attributes:
        code: the wire error code (``invalid_request``, or ``limit_exceeded`` for a field
            over a limit).
    """

    def __init__(self, message: str, code: str = InvalidRequest.code) -> None:
        super().__init__(message)
        self.code = code


class NameTooLong(ValueError):
    """A bin name is longer than ``max_name_bytes`` (a limit, not a malformed request)."""


# -- a row of the op table --------------------------------------------------------------------
#: Builds a request from its header (server side); raises :class:`InvalidField`.
ParseRequest = Callable[[int, dict[str, Any], Payload, Limits], Request]
#: Builds an ``ok`` reply from its header (client side); raises :class:`InvalidField`.
ParseReply = Callable[[int, dict[str, Any], Payload, Limits], Reply]


@dataclass(frozen=True, slots=True)
class Op:
    """One row of the op table.

    Attributes:
        name: the wire ``op``.
        request: the request class.
        header: the request's header fields besides ``op``, ``id`` and ``items``.
        parse: builds the request from a header (server side); raises :class:`InvalidField`.
        parse_reply: builds an ``ok`` reply to this op from its header (client side).
        mutating: the server remembers the reply for exactly-once replay after a reconnect
            (re-running the request would change something twice).
        fields: every header key the request may carry (docs/PROTOCOL.md lists these).
        read: a connection with the read-only token may send it (it changes nothing others
            can see); a relay serves only these.
        access: what a user must be allowed on the request's ``bin`` (see :data:`ACCESS`):
            ``"read"``, ``"write"``, ``"take"`` (both: a get reads and removes), ``"admin"``
            (not about a bin: only a user with ``admin = true``) or ``"none"`` (no bin, or
            one it only answers with what the user may read). A new op needs write unless
            its row says otherwise.
    """

    name: str
    request: type
    header: Callable[[Any], dict[str, Any]]
    parse: ParseRequest
    parse_reply: ParseReply
    mutating: bool
    fields: tuple[str, ...]
    read: bool = False
    access: str = "write"


#: The values of :attr:`Op.access`.
ACCESS = ("none", "read", "write", "take", "admin")


def kind_op(name: str, request: type, header: Callable[[Any], dict[str, Any]],
            parse: Callable[[int, dict[str, Any], Payload, Limits], Any],
            parse_reply: Callable[[int, dict[str, Any], Payload, Limits], Any], mutating: bool,
            access: str, *fields: str) -> Op:
    """A row of the op table for the ops of a bin kind or of replication: the request's
    header keys are ``op``, ``id`` and ``fields``; none is open to the read-only token."""
    return Op(name, request, header, parse, parse_reply, mutating, ("op", "id", *fields),
              access=access)


# -- field checks -----------------------------------------------------------------------------
def is_int(v: object) -> TypeGuard[int]:
    """An integer, and not a bool (msgpack keeps them apart; Python does not)."""
    return isinstance(v, int) and not isinstance(v, bool)


def opt_int(h: dict[str, Any], key: str, minimum: int | None = None) -> int | None:
    """An optional integer field (absent or nil: ``None``), at least ``minimum`` if given."""
    v = h.get(key)
    if v is None:
        return None
    if type(v) is not int:  # (not a bool either: msgpack keeps them apart)
        raise InvalidField(f"{key!r} must be an integer")
    if minimum is not None and v < minimum:
        raise InvalidField(f"{key!r} must be at least {minimum}")
    return v


def check_int(h: dict[str, Any], key: str) -> int:
    """A required integer field."""
    v = h.get(key)
    if type(v) is not int:
        raise InvalidField(f"{key!r} must be an integer")
    return v


def check_str(h: dict[str, Any], key: str) -> str:
    """A required str field."""
    v = h.get(key)
    if not isinstance(v, str):
        raise InvalidField(f"{key!r} must be a string")
    return v


def check_bool(h: dict[str, Any], key: str, default: bool = False) -> bool:
    """An optional bool field (absent or nil: ``default``)."""
    v = h.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidField(f"{key!r} must be a bool")
    return v


def check_timeout(h: dict[str, Any]) -> float | None:
    """The ``timeout`` field: a finite number of seconds >= 0, or ``None`` (absent or nil)."""
    timeout = h.get("timeout")
    if timeout is None:
        return None
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout) or timeout < 0):
        raise InvalidField("'timeout' must be a finite non-negative number or nil")
    return float(timeout)


def check_bin_name(name: object, max_name_bytes: int) -> str:
    """Check a bin name: a non-empty str of at most ``max_name_bytes`` UTF-8 bytes.

    Any characters are allowed (spaces, '|', '/', unicode).

    Returns:
        The name.

    Raises:
        TypeError: the name is not a str.
        ValueError: the name is empty; :class:`NameTooLong` (a ValueError): it is too long.
    """
    if not isinstance(name, str):
        raise TypeError(f"bin name must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError("bin name must not be empty")
    if len(name) * 4 > max_name_bytes:  # cheap pre-check: at most 4 bytes per code point
        n = len(name.encode("utf-8", "surrogatepass"))
        if n > max_name_bytes:
            raise NameTooLong(f"bin name of {n} bytes exceeds max_name_bytes={max_name_bytes}")
    return name


def check_bin(h: dict[str, Any], limits: Limits) -> str:
    """The ``bin`` field: see :func:`check_name`."""
    name = h.get("bin")
    if type(name) is str and name and len(name) * 4 <= limits.max_name_bytes:
        return name  # (short enough whatever its characters: the usual case)
    return check_name(h, "bin", limits)


def check_name(h: dict[str, Any], key: str, limits: Limits) -> str:
    """A name field (``bin``, or one held to the same rules: a stream's ``consumer``), checked
    by :func:`check_bin_name`; one over ``max_name_bytes`` is ``limit_exceeded``."""
    what = "" if key == "bin" else f"{key} name: "
    try:
        return check_bin_name(h.get(key), limits.max_name_bytes)
    except NameTooLong as exc:
        raise InvalidField(f"{what}{exc}", LimitExceeded.code) from None
    except (TypeError, ValueError) as exc:
        raise InvalidField(f"{what}{exc}") from None


def parse_acked(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Reply:
    """The reply of every op answered by a bare acknowledgement (:class:`Acked`)."""
    return Acked(rid, check_bool(h, "flag", True))


# -- items ------------------------------------------------------------------------------------
class Fds:
    """Descriptors a peer passed (Unix socket), waiting for the ``memfd`` buffers they carry.

    A ``memfd`` buffer takes the next descriptor in arrival order: the peer sends each one
    no later than the frame that uses it.
    """

    __slots__ = ("queue", "writable", "limit")

    def __init__(self, writable: bool, limit: int = 1 << 62) -> None:
        self.queue: deque[int] = deque()
        self.writable = writable
        self.limit = limit  # the largest buffer accepted (the frame limit, as for bytes)

    def take(self, size: int) -> tuple[memoryview, None, int, Any]:
        """The next descriptor, checked and mapped: the arguments of its :class:`Buffer`."""
        if not self.queue:
            raise ProtocolError("a memfd buffer arrived without its file descriptor")
        if size > self.limit:
            import os

            os.close(self.queue.popleft())
            raise InvalidField(f"a shared buffer of {size} bytes exceeds max_frame_bytes="
                               f"{self.limit}", LimitExceeded.code)
        from ..memory import shm  # only connections that pass descriptors need it

        try:
            mem = shm.receive(self.queue.popleft(), size, writable=self.writable)
        except (ValueError, OSError) as exc:
            raise InvalidField(str(exc)) from None
        return mem.view, None, size, mem

    def close(self) -> None:
        """Close descriptors nobody took (the connection ended)."""
        import os

        while self.queue:
            try:
                os.close(self.queue.popleft())
            except OSError:
                pass


#: The descriptors of the connection parsing right now (a connection sets it around each
#: parse that may need them, so that the rows' parse functions need not carry them).
PARSING_FDS: ContextVar[Fds | None] = ContextVar("tensorshare_fds", default=None)


def read_items(h: dict[str, Any], payload: Payload, max_depth: int,
               check: bool) -> list[Item]:
    """The ``items`` of a header, with their buffers in ``payload`` (docs/PROTOCOL.md §4).

    ``check``: also check every value (at most ``max_depth`` deep, its ext types and
    buffers): the server does, so that whatever it hands out, readers can decode; a client
    decodes (and so checks) each value when used.

    Raises:
        InvalidField: the items, their buffers or their values are malformed.
        ProtocolError: a memfd buffer came without its descriptor.
    """
    raw_items = h.get("items")
    if not isinstance(raw_items, list):
        raise InvalidField("'items' must be a list")
    view = memoryview(payload)
    end = 0  # buffers must be ordered and disjoint: no aliasing tricks
    items: list[Item] = []
    fds = PARSING_FDS.get()
    size = len(view)
    for raw in raw_items:
        if type(raw) is not list or len(raw) != 3:
            if type(raw) is dict and not check:  # a run of like tensors (a reply: wire/runs)
                end = _read_run(raw, view, end, items)
                continue
            raise InvalidField("an item must be [value, buffers, tag]")
        value, bufs, tag = raw
        if type(value) is not bytes or type(bufs) is not list:
            raise InvalidField("an item must be [bin value, list of buffers, tag]")
        if tag is not None and type(tag) is not int:
            raise InvalidField("an item's tag must be an integer or nil")
        buffers = []
        total = len(value)
        for desc in bufs:
            if type(desc) is list and len(desc) == 2:  # [offset, nbytes]: the usual case
                off, n = desc
                if (type(off) is int and type(n) is int and end <= off and not off & _ALIGN_MASK
                        and 0 <= n and off + n <= size):
                    end = off + n
                    buffers.append(raw_buffer(view[off:end], n))
                    total += n
                    continue
            buf, end = _parse_buffer(desc, view, end, fds)  # (also says what is wrong)
            buffers.append(buf)
            total += len(buf.data)
        if check:
            try:
                validate(value, len(buffers), max_depth=max_depth,
                         raw_sizes=[b.raw_nbytes for b in buffers])
            except NestingTooDeep as exc:
                raise InvalidField(f"malformed value: {exc}", LimitExceeded.code) from None
            except CodecError as exc:
                raise InvalidField(f"malformed value: {exc}") from None
        items.append(Item(encoded_of(value, tuple(buffers), total), tag))
    if end != len(payload):
        raise InvalidField(f"payload of {len(payload)} bytes but buffers end at {end}")
    return items


def _read_run(raw: dict[str, Any], view: memoryview, end: int, items: list[Any]) -> int:
    """Read the run ``raw`` of a reply's items into ``items`` (see :mod:`.runs`)."""
    try:
        run, end = read_run(raw, view, end)
    except ValueError as exc:
        raise InvalidField(str(exc)) from None
    items.append(run)
    return end


def _parse_buffer(desc: Any, view: memoryview, end: int, fds: Fds | None = None
                  ) -> tuple[Buffer, int]:
    if not isinstance(desc, list) or len(desc) not in (2, 4):
        raise InvalidField(
            "a buffer must be [offset, nbytes] or [offset, nbytes, codec, raw_nbytes]")
    off, n = desc[0], desc[1]
    if type(off) is not int or type(n) is not int or off < 0 or n < 0:
        raise InvalidField("buffer offset and size must be non-negative integers")
    if off & _ALIGN_MASK:
        raise InvalidField(f"buffer offset {off} is not a multiple of 64")
    if off < end:
        raise InvalidField(f"buffer at offset {off} overlaps the previous one (ends at {end})")
    if off + n > len(view):
        raise InvalidField(
            f"buffer [{off}, {off + n}) lies outside the {len(view)}-byte payload")
    if len(desc) == 4:
        codec, raw = desc[2], desc[3]
        if codec == "memfd" and fds is not None and is_int(raw) and raw >= 0 and n == 0:
            return Buffer(*fds.take(raw)), off
        if codec != "lz4" or not is_int(raw) or raw < 0:
            raise InvalidField(f"unsupported buffer codec {codec!r}")
        return Buffer(view[off : off + n], codec, raw), off + n
    return Buffer(view[off : off + n]), off + n
