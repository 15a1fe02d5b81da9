"""Persistence beside the store: an append-only data log and snapshots in a data directory.

The store stays a pure in-memory structure; it tells this module every effect, in the order
effects happen (:attr:`tensorshare.store.Store.journal`), and the server tells it the session
bookkeeping. Each becomes one **record**: a frame in the documented wire format
(``docs/PROTOCOL.md``: prefix, msgpack header, 64-byte-aligned raw buffers), preceded by its
length and CRC-32::

    record = u32 frame_len | u32 crc32(frame) | frame          (little-endian)

Log records (``log-NNNNNNNNNNNN.tsl``, after an 8-byte magic ``TSLOG01\\n``) are requests as
the server executed them, plus a few log-only fields: ``put``/``append`` (with the item),
``take`` (``n`` items removed from the front after dropping items tagged below ``min_tag``:
what a get did), ``delete``, ``configure``, ``restore`` (items a lost client had taken, back
in front), and the session records ``session``, ``ack`` (only acks that release items a get
took), ``forget`` (a cancelled get: its items go back) and ``expire``. Records caused by a
client request carry its session ``s`` and request ``id``, so that replaying the log also
rebuilds the replies the server must remember: exactly-once survives a restart.

A snapshot (``snapshot-NNNNNNNNNNNN.tss``, magic ``TSSNAP1\\n``) holds the state after every
log segment up to its number: ``meta`` (every name's version, limits), ``bin`` + ``items``
(contents), ``session`` + ``reply`` (remembered replies, with the items of unacknowledged
gets) and a final ``end``. It is written from references to the (immutable) stored items in
a background thread while the server keeps serving, to a temporary file that is fsynced,
renamed and followed by an fsync of the directory; only then are older segments deleted, so
a crash at any moment leaves the previous snapshot and the log after it.

On start the newest snapshot is loaded and the later log segments are replayed. A record
cut short at the very end of the last segment (a crash mid-write) is cut off with one
warning; anything else that does not check out stops the start with a :class:`DataError`
naming the file and offset and what to do. Nothing read from disk is unpickled or executed:
values are parsed and checked exactly like values received from the network.

``fsync`` decides when the log reaches the disk, as Redis's append-only file does:
``always`` (before any reply that depends on the write is sent), ``everysec`` (a background
thread, at most about a second of acknowledged writes at risk on power loss; a killed
process loses nothing) or ``no`` (the operating system decides).
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import Any

import msgpack

from ..wire.frames import ALIGN, PREFIX, BytesLike, aligned, encode_frame, skip_sent
from ..wire.messages import (
    Append,
    Configure,
    Configured,
    Delete,
    Deleted,
    ErrorReply,
    Fetched,
    Item,
    Limits,
    Put,
    Reply,
    Stored,
)
from ..wire.protocol import OPS, encode_message, item_wire_size, items_header, parse_items
from .handlers import EFFECTS
from .kinds import snapshot_groups
from .sessions import Remembered, ServerSession, SessionTable
from .store import BinConfig, Store

__all__ = [
    "FSYNC_POLICIES",
    "DataError",
    "Loaded",
    "Persistence",
    "SnapshotLoader",
    "parse_record",
]

FSYNC_POLICIES = ("always", "everysec", "no")
LOG_MAGIC = b"TSLOG01\n"
SNAP_MAGIC = b"TSSNAP1\n"
_REC = struct.Struct("<II")
_PREFIX = struct.Struct("<2sBBIQ")
_LOG_RE = re.compile(r"^log-(\d{12})\.tsl$")
_SNAP_RE = re.compile(r"^snapshot-(\d{12})\.tss$")
_packb = msgpack.Packer(use_bin_type=True).pack
# Reply class -> the op whose reply parser reads it back from a snapshot (the other kinds'
# replies: Persistence.kind_replies).
_REPLY_OP = {Stored: "put", Fetched: "get", Deleted: "delete", Configured: "configure"}


class DataError(Exception):
    """The data directory cannot be used; the message names the file, the offset and what to
    do about it. The server does not start (nothing is skipped silently)."""


@dataclass(frozen=True, slots=True)
class Loaded:
    """What :meth:`Persistence.open` found.

    Attributes:
        snapshot: the snapshot file loaded, if any.
        logs: the log segments replayed.
        records: how many log records were replayed.
        warning: one line about a record cut off at the end of the log, or ``None``.
        server_id: the data set's id (kept in the directory).
    """

    snapshot: str | None
    logs: tuple[str, ...]
    records: int
    warning: str | None
    server_id: str


class _Bad(Exception):
    def __init__(self, offset: int, reason: str, torn: bool) -> None:
        super().__init__(reason)
        self.offset, self.reason, self.torn = offset, reason, torn


def _frame(header: dict[str, Any], buffers: Sequence[BytesLike] = ()) -> list[BytesLike]:
    return encode_frame(_packb(header), buffers)


def _record(frame: list[BytesLike]) -> list[BytesLike]:
    crc = 0
    n = 0
    for chunk in frame:
        crc = zlib.crc32(chunk, crc)
        n += len(chunk)
    return [_REC.pack(n, crc), *frame]


def _parse_frame(buf: bytearray, offset: int) -> tuple[dict[str, Any], bytearray]:
    if len(buf) < PREFIX:
        raise _Bad(offset, "record shorter than a frame prefix", False)
    magic, version, flags, header_len, payload_len = _PREFIX.unpack_from(buf)
    if magic != b"TS" or version != 1 or flags != 0:
        raise _Bad(offset, "record is not a tensorshare frame", False)
    head_end = PREFIX + header_len
    start = aligned(head_end) if payload_len else head_end
    if start + payload_len != len(buf):
        raise _Bad(offset, "frame lengths do not match the record length", False)
    try:
        header = msgpack.unpackb(bytes(buf[PREFIX:head_end]), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise _Bad(offset, f"record header is not msgpack: {exc}", False) from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise _Bad(offset, "record header is not a map with an 'op'", False)
    # The payload keeps only its own bytes alive (items reference it).
    return header, bytearray(buf[start:]) if payload_len else bytearray()


def _records(path: str, magic: bytes, max_record: int) -> Iterator[tuple[int, dict[str, Any],
                                                                           bytearray]]:
    """Yield ``(offset, header, payload)`` for each record; raise ``_Bad`` at a bad one."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(len(magic))
        if head != magic:
            raise _Bad(0, f"the file does not start with {magic!r}", len(head) < len(magic)
                       and magic.startswith(head))
        offset = len(magic)
        while offset < size:
            pre = f.read(_REC.size)
            if len(pre) < _REC.size:
                raise _Bad(offset, "record length cut short", True)
            n, crc = _REC.unpack(pre)
            end = offset + _REC.size + n
            if n > max_record:
                raise _Bad(offset, f"record length {n} exceeds the largest possible record "
                           f"({max_record} bytes)", end > size)
            if end > size:
                raise _Bad(offset, f"record of {n} bytes cut short at the end of the file",
                           True)
            buf = bytearray(n)
            if f.readinto(buf) != n:
                raise _Bad(offset, "short read", True)
            if zlib.crc32(buf) != crc:
                raise _Bad(offset, "record checksum mismatch", end == size)
            header, payload = _parse_frame(buf, offset)
            yield offset, header, payload
            offset = end


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def parse_record(buf: bytearray) -> tuple[dict[str, Any], bytearray]:
    """One record as a replica receives it (``u32 len | u32 crc32 | frame``): its header and
    payload. Raises ``ValueError`` when it does not check out."""
    if len(buf) < _REC.size:
        raise ValueError("a record shorter than its length and checksum")
    n, crc = _REC.unpack_from(buf)
    if n != len(buf) - _REC.size:
        raise ValueError("a record whose length does not match")
    frame = bytearray(memoryview(buf)[_REC.size:])
    if zlib.crc32(frame) != crc:
        raise ValueError("a record checksum mismatch")
    try:
        return _parse_frame(frame, 0)
    except _Bad as bad:
        raise ValueError(bad.reason) from None


class Persistence:
    """The data log and snapshots of one data directory.

    Args:
        data_dir: the directory (created if missing). One server at a time (a lock file).
        fsync: ``"always"``, ``"everysec"`` or ``"no"`` (see the module docstring).
        snapshot_every: seconds between snapshots (``None``: only by log size and at exit).
        snapshot_log_bytes: take a snapshot once the log has grown this much.
        limits: the limits that values read back must respect (the server's).
        truncate_corrupt: start even if a log segment is corrupt in the middle, dropping it
            from the first bad record on (only after you have read the error that says so).
    """

    #: The records reach a disk (a replica's :class:`~.replication.MemoryLog` says no).
    on_disk = True

    def __init__(self, data_dir: str, *, fsync: str = "everysec",
                 snapshot_every: float | None = 300.0, snapshot_log_bytes: int = 1 << 30,
                 limits: Limits | None = None, truncate_corrupt: bool = False) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, not {fsync!r}")
        self.dir = os.path.abspath(data_dir)
        self.fsync = fsync
        self.snapshot_every = snapshot_every
        self.snapshot_log_bytes = snapshot_log_bytes
        self.limits = limits or Limits()
        self.truncate_corrupt = truncate_corrupt
        self.max_record = self.limits.max_frame_bytes + (1 << 20)
        self._pending: list[BytesLike] = []
        self._pending_bytes = 0
        self._fd: int | None = None
        self._segment = 0  # number of the log segment being written
        self.log_bytes = 0  # bytes in the current segment
        self.written = 0  # bytes written since start (statistics)
        self.records = 0
        self.snapshots = 0
        self.last_snapshot = time.monotonic()
        self._lock_fd: int | None = None
        self._fd_lock = threading.Lock()  # the fd against the background fsync and rotation
        self._unsynced = False
        self._sync_stop = threading.Event()
        self._sync_thread: threading.Thread | None = None
        self._snapshot_thread: threading.Thread | None = None
        # Why the log cannot be written now (a full disk, an I/O error): writes are refused
        # until a retry succeeds; what was not written is kept and written then.
        self.failed: OSError | None = None
        self._free = 0  # bytes free on the data directory's filesystem, at _free_at
        self._free_at = -1.0
        self._margin = 1 << 20  # kept free beyond a record (see room)
        self.server_id = ""
        # What other kinds of bins (replay bins) keep here, registered before :meth:`open`:
        # their records (log and snapshot) by op -> apply (returns the reply to remember),
        # their snapshot parts (called on the server's thread: each returns what to write,
        # as (header, buffers) pairs, from the writing thread), their remembered replies'
        # ops by reply class, and what each does once a snapshot is loaded (a snapshot, or
        # a replica's full copy, replaces every bin of theirs).
        self.kind_records: dict[str, Callable[[dict[str, Any], bytearray], Any]] = {}
        self.kind_parts: list[Callable[[], Iterator[tuple[dict[str, Any], list[Any]]]]] = []
        self.kind_replies: dict[type, str] = {}
        self.kind_loaded: list[Callable[[], None]] = []
        #: What each does when a snapshot starts loading (a replica's full copy may start
        #: again after a cut one: what the cut one left is dropped).
        self.kind_begin: list[Callable[[], None]] = []
        #: What each does once :meth:`open` loaded the directory (streams: their members'
        #: leases run from then).
        self.kind_opened: list[Callable[[], None]] = []
        #: The newest term (replication's epoch) recorded in this data set (``term`` records).
        self.term = 0
        #: Called with each record's chunks and size as it is added (replication's tap).
        self.tap: Callable[[list[BytesLike], int], None] | None = None

    # -- opening and loading ------------------------------------------------------------------
    def open(self, store: Store, sessions: SessionTable) -> Loaded:
        """Lock the directory, load the newest snapshot, replay the log after it, and start a
        new log segment. Call before the server accepts connections.

        Raises:
            DataError: the directory is locked by another server, or a snapshot or a log
                record in the middle of a segment is corrupt (nothing was loaded then).
        """
        os.makedirs(self.dir, exist_ok=True)
        self._lock()
        try:
            loaded = self._open(store, sessions)
        except BaseException:
            self._unlock()
            raise
        for opened in self.kind_opened:
            opened()
        return loaded

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _open(self, store: Store, sessions: SessionTable) -> Loaded:
        self.server_id = self._server_id()
        for name in os.listdir(self.dir):
            if name.endswith(".tmp"):  # a snapshot a crash interrupted: never complete
                os.unlink(os.path.join(self.dir, name))
        snaps = sorted(int(m.group(1)) for m in map(_SNAP_RE.match, os.listdir(self.dir)) if m)
        logs = sorted(int(m.group(1)) for m in map(_LOG_RE.match, os.listdir(self.dir)) if m)
        snap_path = None
        base = 0
        max_memory, store.max_memory = store.max_memory, None  # what was stored, fits
        journal, store.journal = store.journal, None
        try:
            if snaps:
                base = snaps[-1]
                snap_path = self._path("snapshot", base)
                self._load_snapshot(snap_path, store, sessions)
            replay = [n for n in logs if n > base]
            warning = None
            count = 0
            for i, n in enumerate(replay):
                last = i == len(replay) - 1
                got, warning = self._replay(self._path("log", n), store, sessions, last)
                count += got
                if warning is not None and not last:
                    # Cut in the middle (--truncate-corrupt-log): what was logged later
                    # depends on what was lost, so it goes too (kept aside, not deleted).
                    for later in replay[i + 1:]:
                        path = self._path("log", later)
                        os.replace(path, path + ".dropped")
                    warning += "; later log segments were renamed to *.dropped"
                    replay = replay[: i + 1]
                    break
        finally:
            store.max_memory = max_memory
            store.journal = journal
        self._segment = (replay[-1] if replay else base) + 1
        try:
            self._open_segment()
        except OSError as exc:  # a full disk: start anyway, refusing writes until it has room
            self.failed = exc
        self.last_snapshot = time.monotonic()
        if self.fsync == "everysec":
            self._sync_thread = threading.Thread(target=self._sync_loop, daemon=True,
                                                 name="tensorshare-fsync")
            self._sync_thread.start()
        return Loaded(snap_path, tuple(self._path("log", n) for n in replay), count, warning,
                      self.server_id)

    def _lock(self) -> None:
        fd = os.open(os.path.join(self.dir, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise DataError(f"{self.dir} is in use by another tensorshare server (it holds "
                            f"{os.path.join(self.dir, 'lock')}); stop it first") from None
        self._lock_fd = fd

    def _server_id(self) -> str:
        path = os.path.join(self.dir, "server_id")
        try:
            with open(path, encoding="ascii") as f:
                sid = f.read().strip()
            if re.fullmatch(r"[0-9a-f]{16}", sid):
                return sid
        except (OSError, UnicodeDecodeError):
            pass
        sid = os.urandom(8).hex()
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="ascii") as f:
            f.write(sid + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.dir)
        return sid

    def _path(self, kind: str, n: int) -> str:
        ext = "tsl" if kind == "log" else "tss"
        return os.path.join(self.dir, f"{kind}-{n:012d}.{ext}")

    def _load_snapshot(self, path: str, store: Store, sessions: SessionTable) -> None:
        loader = SnapshotLoader(self, store, sessions)
        try:
            for offset, h, payload in _records(path, SNAP_MAGIC, self.max_record):
                if loader.ended:
                    raise _Bad(offset, "records after the end record", False)
                try:
                    loader.feed(h, payload)
                except (KeyError, TypeError, ValueError, OverflowError) as exc:
                    raise _Bad(offset, f"malformed {h['op']!r} record: {exc!r}", False) from None
        except _Bad as bad:
            raise DataError(
                f"snapshot {path} is corrupt at offset {bad.offset}: {bad.reason}. Nothing was "
                f"loaded. Move the file away to start from the snapshot and log before it (if "
                f"any; the log after it may then be incomplete), or restore the directory "
                f"from a backup.") from None
        if not loader.ended:
            raise DataError(f"snapshot {path} has no end record (it is incomplete). Nothing "
                            f"was loaded. Move it away to start from the data before it.")
        loader.finish()

    def _load_reply(self, h: dict[str, Any], payload: bytearray, sessions: SessionTable) -> None:
        s = sessions.get(h["s"]) or sessions.open(h["s"])
        rid = int(h["id"])
        reply: Reply
        if not h.get("ok"):
            reply = ErrorReply(rid, str(h["code"]), str(h["message"]))
        else:
            reply = OPS[h["req_op"]].parse_reply(rid, h, payload, self.limits)
        bin_name = h.get("held_bin")
        sessions.remember(s, rid, reply, bin_name, int(h.get("held", 0)))

    def _replay(self, path: str, store: Store, sessions: SessionTable, last: bool
                ) -> tuple[int, str | None]:
        count = 0
        try:
            for offset, h, payload in _records(path, LOG_MAGIC, self.max_record):
                try:
                    self._apply(h, payload, store, sessions)
                except (KeyError, TypeError, ValueError, OverflowError) as exc:
                    raise _Bad(offset, f"malformed {h.get('op')!r} record: {exc!r}",
                               False) from None
                count += 1
        except _Bad as bad:
            if bad.torn and last:
                lost = os.path.getsize(path) - bad.offset
                os.truncate(path, bad.offset)
                return count, (f"warning: the data log {path} ended with a record cut short "
                               f"(a crash while writing it): {bad.reason}; cut off the last "
                               f"{lost} bytes at offset {bad.offset}, after {count} good "
                               f"records")
            if self.truncate_corrupt:
                lost = os.path.getsize(path) - bad.offset
                os.truncate(path, bad.offset)
                return count, (f"warning: the data log {path} was corrupt at offset "
                               f"{bad.offset} ({bad.reason}); --truncate-corrupt-log dropped "
                               f"the {lost} bytes from there on")
            raise DataError(
                f"data log {path} is corrupt at offset {bad.offset}: {bad.reason}, and "
                f"records follow it. Nothing was loaded. To start from the {count} records "
                f"before it (losing everything after offset {bad.offset}), run again with "
                f"--truncate-corrupt-log; or restore the directory from a backup.") from None
        return count, None

    def _apply(self, h: dict[str, Any], payload: bytearray, store: Store,
               sessions: SessionTable) -> None:
        """Replay one log record through :data:`_REPLAY` (requests through the server's own
        op table, :data:`~.handlers.EFFECTS`), and remember the reply it gave."""
        rec = _Rec(h, payload, store, sessions, self.limits.max_depth)
        if rec.op == "term":
            self.term = max(self.term, _term_of(h))
            return
        row = _REPLAY.get(rec.op)
        kind = self.kind_records.get(rec.op) if row is None else None
        if row is None and kind is None:
            raise ValueError(f"unknown record op {rec.op!r}")
        reply = row(rec) if row is not None else kind(h, payload)  # type: ignore[misc]
        if rec.sid and rec.rid and reply is not None:
            s = sessions.get(rec.sid) or sessions.open(rec.sid)
            sessions.remember(s, rec.rid, reply, rec.held_bin, rec.held)

    # -- recording ------------------------------------------------------------------------------
    def record(self, op: str, name: str, ctx: Any, fields: dict[str, Any]) -> None:
        """The store's journal hook: one effect, as a record (written at :meth:`flush`)."""
        h: dict[str, Any] = {"op": op, "bin": name}
        if ctx is not None:
            h["s"], h["id"] = ctx
        buffers: list[BytesLike] = []
        if op == "put":
            h["items"] = items_header([fields["item"]], buffers)
        elif op == "append":
            h["items"] = items_header([e[0] for e in fields["entries"]], buffers)
        if fields.get("min_version") is not None:
            h["min_version"] = fields["min_version"]
        elif op == "take":
            h["n"] = fields["n"]
            if fields["min_tag"] is not None:
                h["min_tag"] = fields["min_tag"]
        elif op == "configure":
            cfg: BinConfig = fields["config"]
            h.update(max_items=cfg.max_items, max_bytes=cfg.max_bytes, overflow=cfg.overflow)
        elif op == "restore":
            h["kind"] = fields["kind"]
            h["items"] = items_header([it for it, _, _ in fields["items"]], buffers)
        self._add(_frame(h, buffers))

    def add(self, header: dict[str, Any], buffers: list[BytesLike] | None = None) -> None:
        """A record of another kind of bin (its ``op`` one of :attr:`kind_records`)."""
        self._add(_frame(header, buffers or []))

    def session_record(self, op: str, sid: bytes, **fields: Any) -> None:
        """A session record: ``session``, ``ack`` (through, open), ``forget`` (id), ``expire``."""
        h: dict[str, Any] = {"op": op, "s": sid}
        h.update(fields)
        self._add(_frame(h))

    def term_record(self, term: int) -> None:
        """Record a new term (replication's epoch: a promotion)."""
        self.term = term
        self._add(_frame({"op": "term", "term": term}))

    def _add(self, frame: list[BytesLike]) -> None:
        rec = _record(frame)
        n = sum(len(c) for c in rec)
        self._pending.extend(rec)
        self._pending_bytes += n
        self.records += 1
        if self.tap is not None:
            self.tap(rec, n)

    def add_record(self, rec: list[BytesLike], nbytes: int) -> None:
        """Add a record as it is (one a replica received from its primary)."""
        self._pending.extend(rec)
        self._pending_bytes += nbytes
        self.records += 1

    @property
    def dirty(self) -> bool:
        """Whether records wait to be written."""
        return bool(self._pending)

    def flush(self) -> None:
        """Write the pending records (and fsync them, with ``fsync="always"``).

        Raises:
            OSError: the log could not be written (a full disk, an I/O error). What was
                partly written is cut off again and every pending record is kept: the next
                ``flush`` writes them. Until one succeeds, :attr:`failed` says why.
        """
        if not self._pending:
            return
        try:
            if self._fd is None:
                self._open_segment()
            assert self._fd is not None
            _writev_all(self._fd, self._pending)
            if self.fsync == "always":
                os.fsync(self._fd)
            else:
                self._unsynced = True
        except OSError as exc:
            self.failed = exc
            self._free_at = -1.0
            if self._fd is not None:
                try:  # no half record may stay in the middle of the log
                    os.ftruncate(self._fd, self.log_bytes)
                except OSError:
                    pass
            raise
        n = self._pending_bytes
        self._pending, self._pending_bytes = [], 0
        self.failed = None
        self.log_bytes += n
        self.written += n
        self._free -= n

    def room(self, nbytes: int) -> str | None:
        """Whether a write of about ``nbytes`` may be accepted now: ``None``, or why not.

        Refused while the log cannot be written (:attr:`failed`), and when the filesystem's
        free space (looked up at most every 100 ms) would fall below a small margin.
        """
        if self.failed is not None:
            return f"{self.failed.strerror or self.failed}"
        now = time.monotonic()
        if now - self._free_at > 0.1 or self._free - self._pending_bytes < nbytes + self._margin:
            try:
                st = os.statvfs(self.dir)
            except OSError as exc:
                return str(exc)
            self._free, self._free_at = st.f_bavail * st.f_frsize, now
            # Keep 1% of the filesystem (at least 1 MiB, at most 64 MiB) for what cannot be
            # refused: session records, and the records of writes already accepted.
            self._margin = min(max(st.f_blocks * st.f_frsize // 100, 1 << 20), 64 << 20)
        if self._free - self._pending_bytes < nbytes + self._margin:
            return (f"No space left on device for {nbytes} more bytes ("
                    f"{max(self._free, 0)} free)")
        return None

    def _sync_loop(self) -> None:
        while not self._sync_stop.wait(1.0):
            self.sync()

    def sync(self) -> None:
        """fsync what was written (the ``everysec`` thread calls this every second)."""
        with self._fd_lock:
            if self._unsynced and self._fd is not None:
                self._unsynced = False
                try:
                    os.fsync(self._fd)
                except OSError as exc:  # what is written but not on disk: write it again
                    self.failed = exc

    def _open_segment(self) -> None:
        path = self._path("log", self._segment)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if os.fstat(fd).st_size == 0:
            os.write(fd, LOG_MAGIC)
            os.fsync(fd)
            _fsync_dir(self.dir)
        with self._fd_lock:
            self._fd = fd
        self.log_bytes = os.fstat(fd).st_size

    # -- snapshots ------------------------------------------------------------------------------
    def snapshot_due(self, now: float | None = None) -> bool:
        """Whether a snapshot should start (by time or log size), and none is running."""
        if self._snapshot_thread is not None and self._snapshot_thread.is_alive():
            return False
        if self.log_bytes >= self.snapshot_log_bytes:
            return True
        now = time.monotonic() if now is None else now
        return (self.snapshot_every is not None and self.log_bytes > len(LOG_MAGIC)
                and now - self.last_snapshot >= self.snapshot_every)

    @property
    def snapshotting(self) -> bool:
        return self._snapshot_thread is not None and self._snapshot_thread.is_alive()

    def snapshot(self, store: Store, sessions: SessionTable, *, wait: bool = False,
                 done: Callable[[BaseException | None], None] | None = None) -> None:
        """Start a snapshot of the state now (call from the thread that owns the store).

        The log is rotated at this point, references to the stored items are captured, and a
        background thread writes the file; the server keeps serving meanwhile.

        Args:
            wait: write it in this thread and return when it is durable (at shutdown).
            done: called (in the writing thread) with ``None`` or the error once finished.
        """
        if self.snapshotting:
            if not wait:
                return
            assert self._snapshot_thread is not None
            self._snapshot_thread.join()
        self.flush()
        number = self._segment
        with self._fd_lock:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.fsync(fd)
                os.close(fd)
            self._unsynced = False
        self._segment += 1
        self._open_segment()
        state = self.capture(store, sessions)
        self.last_snapshot = time.monotonic()

        def job() -> None:
            error: BaseException | None = None
            try:
                self._write_snapshot(number, state)
                self.snapshots += 1
            except BaseException as exc:  # reported to ``done``; the log still has it all
                error = exc
            if done is not None:
                done(error)

        if wait:
            job()
        else:
            self._snapshot_thread = threading.Thread(target=job, daemon=True,
                                                     name="tensorshare-snapshot")
            self._snapshot_thread.start()

    def capture(self, store: Store, sessions: SessionTable, term: int | None = None) -> _State:
        """References to everything a snapshot holds, the other kinds' bins included (on
        the server's thread; :func:`_snapshot_frames` writes it from any thread): a snapshot
        file, or a replica's full copy."""
        return replace(_capture(store, sessions, self.term if term is None else term),
                       parts=[c() for c in self.kind_parts], reply_ops=self.kind_replies)

    def _write_snapshot(self, number: int, state: _State) -> None:
        path = self._path("snapshot", number)
        tmp = path + ".tmp"
        try:
            self._write_snapshot_file(tmp, state)
        except BaseException:
            try:  # a snapshot that could not be written must not take the space it got
                os.unlink(tmp)
            except OSError:
                pass
            raise
        os.replace(tmp, path)
        _fsync_dir(self.dir)
        self._drop_covered(number)

    def _write_snapshot_file(self, tmp: str, state: _State) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            batch: list[BytesLike] = [SNAP_MAGIC]
            size = len(SNAP_MAGIC)
            for frame in _snapshot_frames(state):
                rec = _record(frame)
                batch.extend(rec)
                size += sum(len(c) for c in rec)
                if size > 8 << 20 or len(batch) > 512:
                    _writev_all(fd, batch)
                    batch, size = [], 0
            _writev_all(fd, batch)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _drop_covered(self, number: int) -> None:
        """The snapshot ``number`` is durable: everything it covers can go."""
        for name in os.listdir(self.dir):
            m = _LOG_RE.match(name) or _SNAP_RE.match(name)
            if m is None:
                continue
            n = int(m.group(1))
            if (n <= number and _LOG_RE.match(name)) or (n < number and _SNAP_RE.match(name)):
                os.unlink(os.path.join(self.dir, name))

    def close(self, store: Store | None = None, sessions: SessionTable | None = None) -> None:
        """Flush, fsync, and (given the state) write a final snapshot; release the directory."""
        self._sync_stop.set()
        if self._sync_thread is not None:
            self._sync_thread.join(10)
        if self.failed is not None:
            try:  # a last try: space may have come back
                self.flush()
            except OSError:
                pass
        if self.failed is None:
            try:
                if store is not None and sessions is not None:
                    self.snapshot(store, sessions, wait=True)
                else:
                    self.flush()
            finally:
                self._close_fd()
        else:
            self._close_fd()
        if self._snapshot_thread is not None:
            self._snapshot_thread.join()
        self._unlock()

    def _close_fd(self) -> None:
        with self._fd_lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class _Rec:
    """One log record being replayed: its common fields, checked, and what it needs."""

    __slots__ = ("h", "payload", "store", "sessions", "max_depth", "op", "name", "sid", "rid",
                 "held_bin", "held")

    def __init__(self, h: dict[str, Any], payload: bytearray, store: Store,
                 sessions: SessionTable, max_depth: int) -> None:
        self.h, self.payload, self.store, self.sessions = h, payload, store, sessions
        self.max_depth = max_depth
        self.op: str = h["op"]
        self.name: str = h.get("bin", "")
        self.sid: bytes = h.get("s", b"")
        self.rid: int = h.get("id", 0)
        if not isinstance(self.name, str):
            raise TypeError("'bin' must be a str")
        if not isinstance(self.sid, bytes) or len(self.sid) not in (0, 16):
            raise TypeError("'s' must be 16 bytes")
        if not isinstance(self.rid, int) or isinstance(self.rid, bool):
            raise TypeError("'id' must be an int")
        if self.op in ("session", "ack", "forget", "expire") and not self.sid:
            raise TypeError(f"a {self.op!r} record needs 's'")
        self.held_bin: str | None = None
        self.held = 0

    def items(self) -> list[Item]:
        return parse_items(self.h, self.payload, self.max_depth)

    def min_version(self) -> int | None:
        v = self.h.get("min_version")
        if v is not None and (type(v) is not int or v < 1):
            raise TypeError("'min_version' must be an int >= 1")
        return v

    def session(self) -> ServerSession | None:
        return self.sessions.get(self.sid)


def _put(r: _Rec) -> Reply:
    (item,) = r.items()
    return EFFECTS[Put](r.store, Put(r.rid, r.name, item, r.min_version()), None)


def _append(r: _Rec) -> Reply:
    first, *rest = r.items()
    return EFFECTS[Append](r.store, Append(r.rid, r.name, first, None, tuple(rest),
                                           r.min_version()), None)


def _delete(r: _Rec) -> Reply:
    return EFFECTS[Delete](r.store, Delete(r.rid, r.name), None)


def _configure(r: _Rec) -> Reply:
    h = r.h
    msg = Configure(r.rid, r.name, h.get("max_items"), h.get("max_bytes"),
                    h.get("overflow", "reject"))
    return EFFECTS[Configure](r.store, msg, None)


def _take(r: _Rec) -> Reply | None:
    taken = r.store.take(r.name, int(r.h["n"]), r.h.get("min_tag"))
    if taken is None:
        return None
    r.held_bin, r.held = r.name, taken.nbytes
    return taken.with_id(r.rid)


def _restore_record(r: _Rec) -> None:
    items = r.items()
    r.store.restore(r.name, r.h["kind"], [(it, item_wire_size(it), it.tag) for it in items])


def _session(r: _Rec) -> None:
    if r.session() is None:
        r.sessions.open(r.sid)


def _ack(r: _Rec) -> None:
    s = r.session()
    if s is not None:
        r.sessions.ack(s, int(r.h["through"]), tuple(r.h.get("open", ())))


def _forget(r: _Rec) -> None:
    s = r.session()
    gone = r.sessions.forget(s, r.rid) if s is not None else None
    if isinstance(gone, Remembered) and gone.bin is not None and \
            isinstance(gone.reply, Fetched):  # (a put's, kept as bytes, holds no items)
        _restore(r.store, gone.bin, gone.reply)


def _expire(r: _Rec) -> None:
    s = r.session()
    if s is not None:
        for bin_name, fetched, _ in reversed(r.sessions.close(s)):
            _restore(r.store, bin_name, fetched)


#: Log record op -> how to replay it: the requests go through the server's op table
#: (:data:`~.handlers.EFFECTS`), the log-only records (what a get took, restores, session
#: bookkeeping) have their own rows. A row returns the reply to remember, if any.
_REPLAY: dict[str, Callable[[_Rec], Reply | None]] = {
    "put": _put, "append": _append, "delete": _delete, "configure": _configure,
    "take": _take, "restore": _restore_record, "session": _session, "ack": _ack,
    "forget": _forget, "expire": _expire,
}


def _restore(store: Store, name: str, reply: Fetched) -> None:
    store.restore(name, reply.kind, [(it, item_wire_size(it), it.tag) for it in reply.items])


def _writev_all(fd: int, chunks: list[BytesLike]) -> None:
    views = [memoryview(c).cast("B") if not isinstance(c, bytes) else memoryview(c)
             for c in chunks]
    i = 0
    while i < len(views):
        i = skip_sent(views, i, os.writev(fd, views[i : i + 512]))


@dataclass(frozen=True, slots=True)
class _State:
    """References to everything a snapshot holds, captured in one go (no bytes copied)."""

    metas: list[tuple[str, int, BinConfig, int]]
    bins: list[tuple[str, str, int, list[tuple[Any, int, int | None]]]]
    sessions: list[tuple[bytes, list[tuple[int, Reply, str | None, int]]]]
    parts: list[Iterator[tuple[dict[str, Any], list[Any]]]] = field(default_factory=list)
    reply_ops: dict[type, str] = field(default_factory=dict)
    term: int = 0


def _capture(store: Store, sessions: SessionTable, term: int = 0) -> _State:
    return _State(
        list(store.metas()),
        list(store.entries()),
        [(s.id, s.remembered()) for s in sessions],
        term=term,
    )


def _term_of(h: dict[str, Any]) -> int:
    term = h["term"]
    if type(term) is not int or term < 0:
        raise TypeError("'term' must be an int >= 0")
    return term


class SnapshotLoader:
    """Loads snapshot records into a store and a session table, one record at a time (from a
    snapshot file, or a replica's full copy from its primary)."""

    def __init__(self, persist: Persistence, store: Store, sessions: SessionTable) -> None:
        self.persist, self.store, self.sessions = persist, store, sessions
        self.bins: dict[str, tuple[str, list[tuple[Any, int, int | None]]]] = {}
        self.metas: list[tuple[str, int, BinConfig, int]] = []
        self.ended = False
        for begin in persist.kind_begin:
            begin()

    def feed(self, h: dict[str, Any], payload: bytearray) -> None:
        """One record; raises ``KeyError``, ``TypeError``, ``ValueError`` if malformed."""
        op = h["op"]
        if op == "meta":  # (set with the contents: a version never shows with old items)
            mi, mb, ov = h["config"]
            self.metas.append((h["bin"], int(h["version"]), BinConfig(mi, mb, ov),
                               int(h.get("drops", 0))))
        elif op == "bin":
            self.bins[h["bin"]] = (h["kind"], [])
        elif op == "items":
            entries = self.bins[h["bin"]][1]
            for it in parse_items(h, payload, self.persist.limits.max_depth):
                entries.append((it, item_wire_size(it), it.tag))
        elif op == "session":
            if self.sessions.get(h["s"]) is None:
                self.sessions.open(h["s"])
        elif op == "reply":
            self.persist._load_reply(h, payload, self.sessions)
        elif op == "term":
            self.persist.term = max(self.persist.term, _term_of(h))
        elif op == "end":
            self.ended = True
        elif op in self.persist.kind_records:  # (another kind of bins: replay bins)
            self.persist.kind_records[op](h, payload)
        else:
            raise ValueError(f"unknown record {op!r}")

    def finish(self) -> None:
        """Every record is in: set the names' versions and limits, and the bins' contents."""
        for name, version, config, drops in self.metas:
            self.store.load_meta(name, version, config, drops)
        for name, (kind, entries) in self.bins.items():
            self.store.load_bin(name, kind, entries)
        for loaded in self.persist.kind_loaded:
            loaded()


def _snapshot_frames(state: _State) -> Iterator[list[BytesLike]]:
    if state.term:
        yield _frame({"op": "term", "term": state.term})
    for name, version, cfg, drops in state.metas:
        yield _frame({"op": "meta", "bin": name, "version": version,
                      "config": [cfg.max_items, cfg.max_bytes, cfg.overflow], "drops": drops})
    for name, kind, _, entries in state.bins:
        yield _frame({"op": "bin", "bin": name, "kind": kind})
        for group in snapshot_groups(entries, itemgetter(1)):  # (item, nbytes, tag)
            buffers: list[BytesLike] = []
            yield _frame({"op": "items", "bin": name,
                          "items": items_header([e[0] for e in group], buffers)}, buffers)
    for part in state.parts:
        for header, buffers in part:
            yield _frame(header, buffers)
    ops = {**_REPLY_OP, **state.reply_ops}
    for sid, replies in state.sessions:
        yield _frame({"op": "session", "s": sid})
        for _rid, reply, bin_name, held in replies:
            if type(reply) is not ErrorReply and type(reply) not in ops:
                continue  # a reply of a bin kind that lives in memory only (services)
            extra: dict[str, Any] = {"rec": "reply", "s": sid, "held": held}
            if type(reply) is not ErrorReply:
                extra["req_op"] = ops[type(reply)]
            if bin_name is not None:
                extra["held_bin"] = bin_name
            chunks, _ = encode_message(reply, extra)
            # A reply frame whose "op" is "reply": its record kind.
            yield chunks
    yield _frame({"op": "end"})


_ = ALIGN  # the record layout relies on the frame's 64-byte alignment (see frames.py)
