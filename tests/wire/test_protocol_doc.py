"""Keep docs/PROTOCOL.md honest: its hex dumps, tables and rules must match the code.

* Every ``<!-- golden: NAME -->`` hex dump equals the frame the current code produces for the
  same message; the request dumps, sent to a real server, get the reply dumps back (with the
  server's random ``server_id`` and its version string taken from the live reply); and the
  Python client, talking to a fake server that answers with the reply dumps, writes the
  request dumps byte for byte (with its random session id masked).
* The op table of the doc (§3.2) is the code's ``protocol.OPS``, remembered ops included;
  every op has a header table listing exactly ``Op.fields`` (the ``ack``/``open`` fields are
  documented once for all requests), and every reply class of ``protocol.REPLY_HEADERS`` has
  a table listing exactly the keys the code writes.
* The error table is ``errors.ERROR_CODES``; the stats, limits, server-settings, dtype and
  ext-type tables match the code; a few session rules the doc states are checked on a server.
"""

from __future__ import annotations

import math
import re
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure

from tensorshare import errors, server
from tensorshare._version import __version__
from tensorshare.cli import main as cli
from tensorshare.client import session
from tensorshare.server import core as server_core
from tensorshare.server.store import BinConfig
from tensorshare.wire import codec, protocol
from tensorshare.wire.frames import PREFIX, aligned, encode_frame
from tensorshare.wire.messages import (
    Acked,
    Append,
    Auth,
    Bye,
    Cancel,
    Challenge,
    Changed,
    Configure,
    Configured,
    Delete,
    Deleted,
    ErrorReply,
    Fetch,
    Fetched,
    FetchSpec,
    Hello,
    HelloReply,
    Item,
    Limits,
    ListBins,
    Listen,
    Listening,
    Listing,
    Message,
    Ping,
    Put,
    Reload,
    Stats,
    StatsReply,
    Stored,
    Unlisten,
)
from tensorshare.wire.protocol import (
    ACK_FIELDS,
    MAX_OPEN_ACKS,
    OPS,
    PRE_HELLO_MAX_BYTES,
    REPLY_HEADERS,
    SESSION_ID_BYTES,
    AckInfo,
    BadRequest,
    ClientConnection,
    ProtocolViolation,
    encode_fetched_parts,
    encode_fetched_with_id,
    encode_message,
)
from tensorshare.wire.replay import (
    ReplayInfo,
    ReplayInfoReply,
    ReplayInsert,
    ReplayInserted,
    ReplayOpen,
    ReplayOpened,
    ReplaySample,
    ReplaySampled,
    ReplayUpdate,
    ReplayUpdated,
)
from tensorshare.wire.replication import (
    Promote,
    Psync,
    PsyncReply,
    ReplAck,
    ReplicaCount,
    WaitReplicas,
)
from tensorshare.wire.services import (
    ServiceAnswer,
    ServiceBatch,
    ServiceCall,
    ServiceReply,
    ServiceTake,
)
from tensorshare.wire.streams import (
    StreamAppend,
    StreamAppended,
    StreamEnd,
    StreamEnded,
    StreamItems,
    StreamJoin,
    StreamJoined,
    StreamLeave,
    StreamOpen,
    StreamOpened,
    StreamRead,
)
from tests.rawwire import Get, Peek, ServerWire, WireClient

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"
DOC = DOC_PATH.read_text(encoding="utf-8")

SERVER_OPS = {"reply", "error", "notify"}
GOLDEN_NAMES = [
    "hello-request",
    "hello-request-minimal",
    "hello-reply",
    "put-request",
    "put-reply",
    "get-request",
    "get-reply",
    "get-reply-run",
]
# The session id and server id of the example in §10 (real ones are random).
GOLDEN_SESSION = bytes(range(SESSION_ID_BYTES))
GOLDEN_SERVER_ID = "0123456789abcdef"
# Reply class -> the marker of its header table.
REPLY_TABLES: dict[type, str] = {
    HelloReply: "reply-hello",
    Challenge: "reply-challenge",
    Stored: "reply-put",
    Fetched: "reply-get",
    Listing: "reply-list",
    Deleted: "reply-delete",
    Listening: "reply-listen",
    Acked: "reply-ack",
    StatsReply: "reply-stats",
    Configured: "reply-configure",
    StreamOpened: "reply-stream-open",
    StreamAppended: "reply-stream-append",
    StreamEnded: "reply-stream-end",
    StreamJoined: "reply-stream-join",
    StreamItems: "reply-stream-read",
    ServiceAnswer: "reply-service-call",
    ServiceBatch: "reply-service-take",
    ReplayOpened: "reply-replay-open",
    ReplayInserted: "reply-replay-insert",
    ReplaySampled: "reply-replay-sample",
    ReplayUpdated: "reply-replay-update",
    ReplayInfoReply: "reply-replay-info",
    PsyncReply: "reply-psync",
    ReplicaCount: "reply-replicas",
}


# --------------------------------------------------------------------------- doc parsing


def golden(name: str) -> bytes:
    """The bytes of the hex dump that follows ``<!-- golden: NAME -->`` in the doc."""
    m = re.search(
        rf"^<!-- golden: {re.escape(name)} -->\n```[^\n]*\n(.*?)^```", DOC, re.MULTILINE | re.DOTALL
    )
    assert m, f"no golden block {name!r} in {DOC_PATH}"
    data = bytearray()
    for line in m.group(1).splitlines():
        if not line.strip():
            continue
        offset, *cells = line.split()
        assert int(offset, 16) == len(data), f"{name}: offset column says {offset}"
        assert 0 < len(cells) <= 16 and all(re.fullmatch(r"[0-9a-f]{2}", c) for c in cells), line
        data += bytes.fromhex("".join(cells))
    return bytes(data)


def table(marker: str) -> list[list[str]]:
    """The body rows (cells stripped) of the Markdown table right after ``marker``."""
    assert DOC.count(marker) == 1, f"{marker!r} should appear once in {DOC_PATH}"
    start = DOC.find(marker)
    rows = []
    for line in DOC[start + len(marker) :].lstrip("\n").splitlines():
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    assert len(rows) > 2, f"no table after {marker!r}"
    return rows[2:]  # skip the heading row and the |---| row


def code_cell(cell: str) -> str:
    m = re.fullmatch(r"`([^`]+)`", cell)
    assert m, f"expected a `code` cell, got {cell!r}"
    return m.group(1)


def documented_fields(name: str) -> set[str]:
    return {code_cell(row[0]) for row in table(f"<!-- fields: {name} -->")}


# --------------------------------------------------------------------------- frames


def frame_bytes(msg: Message, extra: dict[str, Any] | None = None) -> bytes:
    return b"".join(bytes(c) for c in encode_message(msg, extra)[0])


def header_of(frame: bytes) -> dict[str, Any]:
    header_len = struct.unpack_from("<I", frame, 4)[0]
    header = msgpack.unpackb(frame[PREFIX : PREFIX + header_len], raw=False)
    assert isinstance(header, dict)
    return header


def w_item() -> Item:
    torch = pytest.importorskip("torch")
    return Item(codec.encode(torch.tensor([1.0, 2.0])))


def hello_reply(server_name: str = "tensorshare/0.1.0",
                server_id: str = GOLDEN_SERVER_ID, runs: bool = True) -> HelloReply:
    return HelloReply(1, 1, server_name, Limits(), False, server_id, runs=runs)


def expected_golden(name: str) -> bytes:
    """What the code produces for the message each golden dump shows (see §10 of the doc)."""
    if name == "hello-request":
        return frame_bytes(Hello(1, (1,), "tensorshare-python", None, GOLDEN_SESSION, runs=True))
    if name == "hello-request-minimal":
        return frame_bytes(Hello(1, (1,), "tensorshare-python"))
    if name == "hello-reply":
        return frame_bytes(hello_reply())
    if name == "put-request":
        return frame_bytes(Put(2, "w", w_item()))
    if name == "put-reply":
        return frame_bytes(Stored(2, 1, 1))
    if name == "get-request":
        return b"".join(bytes(c) for c in ClientConnection().send(Get(3, "w"), AckInfo(2)))
    if name == "get-reply":
        return frame_bytes(Fetched(3, "value", (w_item(),), 2, 0))
    if name == "get-reply-run":  # (§3.3.3.1)
        torch = pytest.importorskip("torch")
        run = tuple(Item(codec.encode(torch.tensor([x]))) for x in (1.0, 2.0, 3.0))
        parts = encode_fetched_parts(Fetched(3, "list", run, 4, 0), None, True)
        return b"".join(bytes(c) for c in encode_fetched_with_id(3, *parts))
    raise AssertionError(name)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def read_frame(sock: socket.socket) -> bytes:
    prefix = recv_exact(sock, PREFIX)
    magic, _, _, header_len, payload_len = struct.unpack("<2sBBIQ", prefix)
    assert magic == b"TS"
    rest = aligned(PREFIX + header_len) - PREFIX + payload_len if payload_len else header_len
    return prefix + recv_exact(sock, rest)


# --------------------------------------------------------------------------- golden dumps


def test_every_golden_dump_is_checked() -> None:
    assert set(re.findall(r"<!-- golden: ([\w-]+) -->", DOC)) == set(GOLDEN_NAMES)


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_golden_dump_matches_code(name: str) -> None:
    assert golden(name).hex(" ") == expected_golden(name).hex(" ")


def test_golden_session_and_server_id_are_where_the_doc_says() -> None:
    assert header_of(golden("hello-request"))["session"] == GOLDEN_SESSION
    assert "session" not in header_of(golden("hello-request-minimal"))
    reply = header_of(golden("hello-reply"))
    assert (reply["resumed"], reply["server_id"]) == (False, GOLDEN_SERVER_ID)
    assert header_of(golden("get-request"))["ack"] == 2


@pytest.mark.parametrize("hello", ["hello-request", "hello-request-minimal"])
def test_golden_requests_get_golden_replies_from_a_real_server(hello: str) -> None:
    """Send the doc's request frames to a real server; its replies are the doc's reply frames.

    The hello reply is compared with the server's own version string and its random
    ``server_id`` (checked to be 16 hex digits) in place of the doc's.
    """
    with (
        server.EmbeddedServer(port=0) as srv,
        socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock,
    ):
        sock.sendall(golden(hello))
        live = read_frame(sock)
        server_id = header_of(live)["server_id"]
        assert re.fullmatch(r"[0-9a-f]{16}", server_id), server_id
        # (the minimal hello offers no runs: the reply agrees on none, §10.3)
        assert live == frame_bytes(hello_reply(f"tensorshare/{__version__}", server_id,
                                               runs=hello == "hello-request"))
        sock.sendall(golden("put-request"))
        assert read_frame(sock).hex(" ") == golden("put-reply").hex(" ")
        sock.sendall(golden("get-request"))
        assert read_frame(sock).hex(" ") == golden("get-reply").hex(" ")

        def session_state() -> tuple[int, list[int], int] | None:
            s = srv.factory.sessions.get(GOLDEN_SESSION)
            return None if s is None else (len(srv.factory.sessions), sorted(s.replies), s.held)

        state = srv.call(session_state)
    if hello == "hello-request":
        # §10.6: the get's ack let the server forget the put's reply; it holds the get's item.
        assert state is not None
        n_sessions, remembered, held = state
        assert n_sessions == 1 and remembered == [3] and held > 0
    else:
        assert state is None  # no session: nothing remembered


def test_python_client_writes_the_golden_requests() -> None:
    """The real Client, answered with the doc's reply frames, writes the doc's request frames
    (its session id is random: it is masked with the doc's)."""
    torch = pytest.importorskip("torch")
    from tensorshare.client.blocking import Client

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    seen: dict[str, bytes] = {}
    failures: list[BaseException] = []

    def fake_server() -> None:
        try:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(10)
                for step in ("hello", "put", "get"):
                    seen[step] = read_frame(conn)
                    conn.sendall(golden(f"{step}-reply"))
                while conn.recv(65536):  # until the client closes
                    pass
        except BaseException as exc:  # reported by the test thread
            failures.append(exc)

    thread = threading.Thread(target=fake_server, daemon=True)
    thread.start()
    try:
        with Client("127.0.0.1", listener.getsockname()[1], timeout=10, heartbeat=600,
                    reconnect=False) as client:
            assert client.protocol_version == 1
            assert client.limits == Limits()
            assert client.server_id == GOLDEN_SERVER_ID
            assert client.put("w", torch.tensor([1.0, 2.0])) == 1
            value = client.get("w")
    finally:
        thread.join(10)
        listener.close()
    assert not failures, failures
    assert torch.equal(value, torch.tensor([1.0, 2.0]))
    session_id = header_of(seen["hello"])["session"]
    assert len(session_id) == SESSION_ID_BYTES and session_id != GOLDEN_SESSION
    masked = seen["hello"].replace(session_id, GOLDEN_SESSION)
    assert masked.hex(" ") == golden("hello-request").hex(" ")
    for step in ("put", "get"):
        assert seen[step].hex(" ") == golden(f"{step}-request").hex(" "), step


def test_two_buffer_layout_example() -> None:
    """The numbers of worked example 2 in §2.2."""
    torch = pytest.importorskip("torch")
    enc = codec.encode({"w": torch.zeros(3), "b": torch.arange(5)})
    frame = frame_bytes(Put(2, "params", Item(enc)))
    header_len, payload_len = struct.unpack_from("<IQ", frame, 4)
    assert (header_len, payload_len, len(frame)) == (74, 104, 232)
    assert header_of(frame)["items"][0][1] == [[0, 12], [64, 40]]
    assert "`H = 74`" in DOC and "`payload_len = 104`" in DOC and "`128 + 104 = 232`" in DOC


def test_one_buffer_and_no_payload_examples() -> None:
    """Worked examples 1 and 3 in §2.2 are the get and put replies of §10."""
    get_reply, put_reply = golden("get-reply"), golden("put-reply")
    assert struct.unpack_from("<IQ", get_reply, 4) == (86, 8) and len(get_reply) == 136
    assert struct.unpack_from("<IQ", put_reply, 4) == (36, 0) and len(put_reply) == 52
    assert "`H = 86`" in DOC and "`16 + 36 = 52`" in DOC


# --------------------------------------------------------------------------- errors


def error_table() -> dict[str, list[str]]:
    return {code_cell(row[0]): row for row in table("<!-- table: error-codes -->")}


def test_error_table_is_the_code_table() -> None:
    rows = error_table()
    assert set(rows) == set(errors.ERROR_CODES), "the error table and ERROR_CODES differ"
    for code, cls in errors.ERROR_CODES.items():
        assert f"`{cls.__name__}`" in rows[code][1], f"{code!r} should name {cls.__name__}"
        assert errors.code_for(cls("x")) == code


def _server_sources() -> str:
    import tensorshare.server as pkg

    root = Path(pkg.__file__).parent
    # (the .py file, not inspect.getsource: a compiled module has no source to give)
    return "".join(f.read_text(encoding="utf-8") for f in sorted(root.glob("*.py"))) + \
        (Path(protocol.__file__).parent / "protocol.py").read_text(encoding="utf-8")


def test_the_server_names_error_codes_by_their_classes_and_the_doc_has_them() -> None:
    sources = _server_sources()
    # No code is spelled as a string literal: each comes from its class (BinFull.code).
    # ("error" and "timeout" are also header fields and stats keys, so they are not looked for.)
    literal = [code for code in errors.ERROR_CODES if code not in ("error", "timeout")
               and re.search(rf'["\']{code}["\']', sources)]
    assert not literal, f"error codes written as string literals in the server: {literal}"
    used = {cls.code for name, cls in vars(errors).items()
            if isinstance(cls, type) and issubclass(cls, errors.TensorShareError)
            and cls.code in errors.ERROR_CODES and re.search(rf"\b{name}\b", sources)}
    assert {"protocol_error", "limit_exceeded", "invalid_request", "timeout", "bin_full",
            "unsupported_version", "session_taken_over"} <= used, used
    missing = used - set(error_table())
    assert not missing, f"codes the server sends but the doc's error table lacks: {missing}"


# --------------------------------------------------------------------------- ops and headers


def test_the_docs_op_table_is_the_code_op_table() -> None:
    rows = {code_cell(row[0]): row for row in table("<!-- table: ops -->")}
    assert list(rows) == list(OPS), "the op table of §3.2 and protocol.OPS differ"
    for name, op in OPS.items():
        remembered = rows[name][3]
        assert remembered in ("yes", "no"), rows[name]
        assert (remembered == "yes") == op.mutating, f"{name}: Remembered column is wrong"


def test_the_op_table_is_in_the_order_of_the_docs_sections() -> None:
    """OPS, the table of §3.2 and the sections §3.2.1, §3.2.2, ... list the ops in one order."""
    sections = re.findall(r"^#### 3\.2\.(\d+) `(\w+)`$", DOC, re.MULTILINE)
    assert [int(n) for n, _ in sections] == list(range(1, len(OPS) + 1))
    assert [op for _, op in sections] == list(OPS)
    rows = table("<!-- table: ops -->")
    assert [row[1] for row in rows] == [f"§3.2.{n}" for n in range(1, len(OPS) + 1)]


def test_remembered_ops_are_named_in_the_sessions_section() -> None:
    mutating = [name for name, op in OPS.items() if op.mutating]
    listed = ", ".join(f"`{name}`" for name in mutating[:-1]) + f" and `{mutating[-1]}`"
    assert f"**{listed}**" in " ".join(DOC.split()), listed


def _ops_between(start: str, end: str) -> set[str]:
    """The `code` names in the doc's text from ``start`` (which must occur once) to ``end``,
    but for the fields and values these sentences also name."""
    text = " ".join(DOC.split())
    assert text.count(start) == 1, f"{start!r} should appear once in {DOC_PATH}"
    part = text.split(start, 1)[1].split(end, 1)[0]
    return set(re.findall(r"`(\w+)`", part)) - {"resumed", "true", "false"}


@pytest.mark.parametrize("start, end, remembered", [
    ("* The other ops (", ") are not remembered", False),  # §9.4
    ("4. After a reconnect: if `resumed`", "5. When giving up", True),  # §9.9 step 4
    ("11. After a reconnect, read `resumed`", "12. ", True),  # Appendix A #11
])
def test_every_list_of_remembered_ops_is_the_op_tables(start: str, end: str,
                                                       remembered: bool) -> None:
    expected = {name for name, op in OPS.items() if op.mutating == remembered}
    assert _ops_between(start, end) == expected


@pytest.mark.parametrize("op", list(OPS))
def test_each_op_has_a_table_listing_exactly_its_fields(op: str) -> None:
    assert documented_fields(op) == set(OPS[op].fields)
    assert re.search(rf"^#### 3\.2\.\d+ `{op}`$", DOC, re.MULTILINE), f"no section for {op}"


def test_ack_fields_are_documented_once_for_every_request() -> None:
    assert documented_fields("ack") == set(ACK_FIELDS)
    for op in OPS.values():
        assert not set(op.fields) & set(ACK_FIELDS)


# One request per op with every optional field set: the code writes exactly ``Op.fields``.
def _full_requests() -> dict[str, list[Message]]:
    item = Item(codec.encode([1, "a", b"b"]), tag=5)
    return {
        "hello": [Hello(1, (1,), "me", b"n" * 32, GOLDEN_SESSION, True, True, "alice", True)],
        "put": [Put(2, "w", item, 4), Put(2, "w", item, room=1.5),
                Put(2, "w", item, room=math.inf)],
        "append": [Append(2, "w", item, 1.5, (), 4), Append(2, "w", item, 1.5, (), wait_room=True)],
        "get": [Get(3, "w", 2, True, 1.5, 1, 4, 2)],
        "peek": [Peek(3, "w", 2, True, 1.5, 1, 4, 2)],
        "list": [ListBins(4)],
        "delete": [Delete(5, "w")],
        "listen": [Listen(6, "w")],
        "unlisten": [Unlisten(7, "w")],
        "ping": [Ping(8)],
        "cancel": [Cancel(9, 3)],
        "stats": [Stats(10, "w*")],
        "configure": [Configure(11, "w", 5, 1024, "block")],
        "bye": [Bye(12)],
        "auth": [Auth(13, b"p" * 32)],
        "reload": [Reload(23)],
        "psync": [Psync(24, "abc", 10, 2, "h:1")],
        "repl_ack": [ReplAck(25, 10)],
        "promote": [Promote(26)],
        "wait_replicas": [WaitReplicas(27, 1, 1.5)],
        "stream_open": [StreamOpen(14, "s", 1, 2, 8, "detach", 2.0, "epoch", 5.0, 640),
                        StreamOpen(14, "s", device_ipc=True)],
        "stream_append": [StreamAppend(15, "s", 1, 0, item, (item,), (64, 64), 1.5)],
        "stream_end": [StreamEnd(16, "s", 1, 0, 128, True, 1.5)],
        "stream_join": [StreamJoin(17, "s", "job", "epoch_start", 5.0, False)],
        "stream_read": [StreamRead(18, "s", "job", 3, 4, 1.5)],
        "stream_leave": [StreamLeave(19, "s", "job")],
        "service_call": [ServiceCall(20, "p", item, 1.5, False, 8)],
        "service_take": [ServiceTake(21, "p", 64, 2.0, 1.5, 10.0, 1024)],
        "service_reply": [ServiceReply(22, "p", 3, item, (item,), 7, None, ((1, "bad"),)),
                          ServiceReply(22, "p", 3, None, (), None, "RuntimeError: boom")],
        "replay_open": [ReplayOpen(23, "r", {
            "max_size": 100, "sampler": "prioritized", "priority_exponent": 0.6,
            "remover": "fifo", "max_times_sampled": 2, "samples_per_insert": 4.0,
            "min_size_to_sample": 10, "error_buffer": 40.0, "seed": 7}, True)],
        "replay_insert": [ReplayInsert(24, "r", item, (item,), (1.0, 0.5), 1.5)],
        "replay_sample": [ReplaySample(25, "r", 32, 1.5)],
        "replay_update": [ReplayUpdate(26, "r", (1, 2), (0.5, 2.0))],
        "replay_info": [ReplayInfo(27, "r")],
    }


@pytest.mark.parametrize("op", list(OPS))
def test_the_code_writes_exactly_the_documented_request_fields(op: str) -> None:
    cases = _full_requests()
    assert set(cases) == set(OPS)
    written: set[str] = set()
    for msg in cases[op]:
        written |= set(header_of(frame_bytes(msg)))
    assert written == documented_fields(op)


@pytest.mark.parametrize("op", list(OPS))
def test_server_accepts_each_documented_op(op: str) -> None:
    """Behaviourally: the server knows the op (a bare request is never an 'unknown op')."""
    conn = ServerWire()
    header = msgpack.packb({"op": op, "id": 7})
    out = conn.receive_data(b"".join(bytes(c) for c in encode_frame(header)))
    assert len(out) == 1
    if isinstance(out[0], BadRequest):
        assert "unknown op" not in out[0].message


def test_server_refuses_an_undocumented_op() -> None:
    assert "`frob`" not in DOC
    conn = ServerWire()
    header = msgpack.packb({"op": "frob", "id": 7})
    (out,) = conn.receive_data(b"".join(bytes(c) for c in encode_frame(header)))
    assert isinstance(out, BadRequest) and out.code == "invalid_request"


def _reply_cases() -> dict[str, list[Message]]:
    item = Item(codec.encode([1, "a", b"b"]), tag=5)
    return {
        "reply-hello": [hello_reply(), HelloReply(1, 1, "s", Limits(), True, "ab", True,
                                                  b"p" * 32, "read", "alice", True)],
        "reply-challenge": [Challenge(1, b"n" * 32)],
        "reply-put": [Stored(2, 1, 1), Stored(2, 3, 2, dropped=1)],
        "reply-get": [Fetched(3, "list", (item, item), 5, 1, 2),
                      Fetched(3, "value", (), 5, 1, 0, True)],
        "reply-list": [Listing(4, {"w": 1})],
        "reply-delete": [Deleted(5, True, 6)],
        "reply-listen": [Listening(6, 6, 0)],
        "reply-ack": [Acked(7, False)],
        "reply-stats": [StatsReply(8, {"uptime": 1.0}, {"w": {"kind": "value"}})],
        "reply-configure": [Configured(9, 5, None, "drop_oldest")],
        "reply-error": [ErrorReply(8, "bin_not_found", "no bin")],
        "error": [ErrorReply(0, "protocol_error", "bad magic")],
        "notify": [Changed("w", "put", 1, 1), Changed("w", "append", 3, 9, 2, 1)],
        "reply-stream-open": [StreamOpened(1, 0, 5, 3, 2, True),
                              StreamOpened(1, 4, 9, 0, 2, False, 3)],
        "reply-stream-append": [StreamAppended(2, 4, 6)],
        "reply-stream-end": [StreamEnded(3, 1, True, False)],
        "reply-stream-join": [StreamJoined(4, None, 1, 0, None, 5, False),
                              StreamJoined(4, 3, 0, 192, 640, 5, True),
                              StreamJoined(4, 9, 2, 0, 640, 9, False, True)],
        "reply-stream-read": [StreamItems(5, (item,), 3, 4, 0, 64, 640),
                              StreamItems(5, (), 7, 9, 0, 576, 640, 576, True, 2, True)],
        "reply-service-call": [ServiceAnswer(6, (item,), 7), ServiceAnswer(6, (item,), None)],
        "reply-service-take": [ServiceBatch(7, 3, (item, item), (1, 8))],
        "reply-replay-open": [ReplayOpened(8, True, 0, {"max_size": 10, "seed": 3})],
        "reply-replay-insert": [ReplayInserted(9, (1, 2), 2)],
        "reply-replay-sample": [ReplaySampled(10, (item, item), (2, 2), (0.5, 0.5), 2, 1.5)],
        "reply-replay-update": [ReplayUpdated(11, 1, 1)],
        "reply-replay-info": [ReplayInfoReply(12, 2, 1.5, {"size": 2})],
        "reply-psync": [PsyncReply(8, "full", "abc", 10, 2, "f" * 16)],
        "reply-replicas": [ReplicaCount(9, 1, 2)],
    }


def test_every_reply_class_has_a_table() -> None:
    assert set(REPLY_TABLES) == set(REPLY_HEADERS), "a reply class has no table in the doc"
    cases = _reply_cases()
    for cls, marker in REPLY_TABLES.items():
        assert {type(m) for m in cases[marker]} == {cls}


@pytest.mark.parametrize("name", list(_reply_cases()))
def test_reply_table_lists_exactly_the_keys_the_code_writes(name: str) -> None:
    written: set[str] = set()
    for msg in _reply_cases()[name]:
        written |= set(header_of(frame_bytes(msg)))
    assert documented_fields(name) == written


def test_server_message_ops_are_documented_and_the_only_ones_a_client_accepts() -> None:
    frames = {
        "reply": {"op": "reply", "id": 1, "ok": False, "code": "error", "message": "m"},
        "error": {"op": "error", "code": "protocol_error", "message": "m"},
        "notify": {"op": "notify", "bin": "w", "event": "put", "n_items": 1, "version": 1},
    }
    assert set(frames) == SERVER_OPS
    for op, header in frames.items():
        assert f'`"{op}"`' in DOC
        data = b"".join(bytes(c) for c in encode_frame(msgpack.packb(header)))
        (msg,) = ClientConnection().receive_data(data, lambda rid: None)
        assert type(msg) is not ProtocolViolation, (op, msg)
    data = b"".join(bytes(c) for c in encode_frame(msgpack.packb({"op": "push"})))
    (msg,) = ClientConnection().receive_data(data, lambda rid: None)
    assert type(msg) is ProtocolViolation


def test_limits_table_matches_the_defaults() -> None:
    limits_map = header_of(frame_bytes(hello_reply()))["limits"]
    rows = {code_cell(row[0]): row for row in table("<!-- fields: limits -->")}
    assert set(rows) == set(limits_map)
    defaults = Limits()
    for name, row in rows.items():
        documented = int(re.match(r"\d+", row[2]).group())  # type: ignore[union-attr]
        assert documented == getattr(defaults, name) == limits_map[name], name


# --------------------------------------------------------------------------- stats


def _flat(d: dict[str, Any], nested: tuple[str, ...]) -> set[str]:
    keys = set(d)
    for k in nested:
        keys |= {f"{k}.{sub}" for sub in d[k]}
    return keys


def test_stats_tables_match_a_live_server() -> None:
    with server.EmbeddedServer(port=0) as srv:
        f = srv.factory

        def fill() -> tuple[dict[str, Any], dict[str, Any]]:
            f.store.put("w", Item(codec.encode({"x": 1})), 100)
            f.store.configure("q", BinConfig(2, None, "block"))
            return f.server_stats(), f.bin_stats()

        stats, bins = srv.call(fill)
    # (``user``, the asking connection's own entry, is added to each reply: see users.stats)
    assert _flat(stats, ("memory", "waiting", "latency")) | {"user"} == \
        documented_fields("stats-server")
    assert set(bins) == {"q", "w"}  # data or limits
    for summary in bins.values():
        assert _flat(summary, ("limits",)) == documented_fields("stats-bin")
    assert bins["q"]["kind"] == "empty" and bins["w"]["first"] == "{x: int}"


def test_every_counter_the_server_keeps_is_in_the_stats_table() -> None:
    """§3.3.8's ``counters``: every counter the server counts (server/*.py) and exports
    (server/metrics.py), and no other."""
    from tensorshare.server import metrics

    row = next(r for r in table("<!-- fields: stats-server -->") if r[0] == "`counters`")
    documented = set(re.findall(r"`(\w+)`", row[2])) - {"bye", "max_connections",
                                                          "max_sessions", "max_memory",
                                                          "max_client_buffer", "frame_timeout",
                                                          "authentication_failed",
                                                          "permission_denied"}
    counted = set(re.findall(r'counters\["(\w+)"\]', _server_sources()))
    assert len(counted) > 15  # (the pattern still finds them)
    assert counted == documented, (counted - documented, documented - counted)
    assert set(metrics._COUNTERS) <= documented


def test_stats_and_configure_replies_from_a_live_server() -> None:
    """A stats and a configure reply, as a foreign client gets them on the wire."""
    with (
        server.EmbeddedServer(port=0) as srv,
        socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock,
    ):
        sock.sendall(golden("hello-request-minimal"))
        read_frame(sock)
        sock.sendall(frame_bytes(Configure(2, "q", 3, None, "drop_oldest")))
        assert header_of(read_frame(sock)) == {"op": "reply", "id": 2, "ok": True,
                                               "max_items": 3, "max_bytes": None,
                                               "overflow": "drop_oldest"}
        sock.sendall(frame_bytes(Stats(3, "q")))
        reply = header_of(read_frame(sock))
    assert set(reply) == documented_fields("reply-stats")
    assert reply["bins"]["q"]["limits"] == {"max_items": 3, "max_bytes": None,
                                            "overflow": "drop_oldest"}
    assert reply["stats"]["server_id"] == srv.factory.server_id


# --------------------------------------------------------------------------- settings


def test_server_settings_table_matches_the_defaults_and_the_cli() -> None:
    defaults = server.ServerConfig()
    serve = vars(cli._parser().parse_args(["serve"]))  # the options of `tensorshare serve`
    rows = table("<!-- table: server-config -->")
    assert rows
    for row in rows:
        name = code_cell(row[0])
        value = getattr(defaults, name)
        if name == "max_memory":  # depends on the machine: half of its memory, "auto"
            from tensorshare.server.config import default_max_memory

            assert value == default_max_memory() and row[1].startswith("half of the machine")
            assert serve[name] == "auto" and code_cell(row[2]) == "--max-memory"
            continue
        if value is None or isinstance(value, bool):
            assert row[1] == str(value), name
        else:
            assert type(value)(row[1]) == value, name
        if row[2] == "—":
            assert name not in serve, f"`tensorshare serve` has an option for {name}: document it"
        else:
            assert code_cell(row[2]) == f"--{name.replace('_', '-')}", name
            assert serve[name] == value, f"the CLI default of {name} differs"


def test_the_service_limits_are_the_codes() -> None:
    """§3.2.23 / §3.2.24: the bounds a host's take and reply are held to."""
    from tensorshare.wire import services as svc

    take = {code_cell(r[0]): " ".join(r[1:]) for r in table("<!-- fields: service_take -->")}
    reply = {code_cell(r[0]): " ".join(r[1:]) for r in table("<!-- fields: service_reply -->")}
    assert svc.MAX_BATCH == protocol.MAX_APPEND_ITEMS
    assert f"1 to {svc.MAX_BATCH} (`services.MAX_BATCH`" in take["max_batch"]
    assert f"at most {svc.MAX_BATCH}, `services.MAX_BATCH`" in reply["items"]
    assert f"0 to {svc.MAX_WAIT_MS:g}" in take["max_wait_ms"]
    assert f"at most {svc.MAX_LEASE:g}" in take["lease"]
    assert f"1 to {svc.MAX_QUEUE} (default {svc.DEFAULT_MAX_QUEUE})" in take["max_queue"]
    assert f"cut to {svc.MAX_ERROR_CHARS} characters" in reply["error"]
    # The server holds to them: one more is refused.
    conn = ServerWire()
    conn.handshake_done()
    for header in ({"op": "service_take", "id": 7, "bin": "s", "max_batch": svc.MAX_BATCH},
                   {"op": "service_take", "id": 7, "bin": "s",
                    "max_batch": svc.MAX_BATCH + 1}):
        (out,) = conn.receive_data(b"".join(bytes(c) for c in encode_frame(
            msgpack.packb(header))))
        assert isinstance(out, BadRequest) == (header["max_batch"] > svc.MAX_BATCH), out


def test_constants_the_doc_states() -> None:
    assert PRE_HELLO_MAX_BYTES == 65536 and "**65536 bytes**" in DOC
    assert server.ServerConfig().hello_timeout == 10.0 and "within **10 s**" in DOC
    assert MAX_OPEN_ACKS == 64 and "(`protocol.MAX_OPEN_ACKS`)" in DOC
    assert SESSION_ID_BYTES == 16 and "16 bytes (`protocol.SESSION_ID_BYTES`)" in DOC
    assert protocol.REPLY_SLACK == 65536 and "`max_frame_bytes + 65536`" in DOC
    assert (session.BACKOFF_BASE, session.BACKOFF_CAP) == (0.05, 2.0)
    assert "backoff of 50 ms, doubling with each failed attempt up to 2 s" in DOC
    s = session.ClientSession(address="x", timeout=30.0)
    assert s.heartbeat == 5.0 and session.ClientSession(address="x", timeout=6.0).heartbeat == 2.0
    assert all(0.025 <= s.backoff(0) <= 0.05 and 1.0 <= s.backoff(9) <= 2.0 for _ in range(50))
    from tensorshare.client.ops import BLOCK_SHARE

    assert BLOCK_SHARE == 0.8 and "0.8 × its own reply timeout" in DOC


# --------------------------------------------------------------------------- session rules


SID = bytes(16 * [7])


class Peer:
    """A connection to a ServerFactory over a StringTransport (no sockets, no real time)."""

    _ports = iter(range(50000, 60000))

    def __init__(self, factory: server_core.ServerFactory, session_id: bytes | None = None,
                 resume: bool = False, wire: WireClient | None = None) -> None:
        addr = IPv4Address("TCP", "127.0.0.1", next(self._ports))
        self.proto = factory.buildProtocol(addr)
        self.transport = StringTransport(peerAddress=addr)
        self.proto.makeConnection(self.transport)
        self.wire = wire or WireClient()
        self.hello = self.request(Hello(self.wire.next_id(), (1,), "doc", None, session_id,
                                        resume))

    def request(self, msg: Any, ack: AckInfo | None = None) -> Any:
        self.proto.dataReceived(self.wire.frame(msg, ack))
        (reply,) = self.received()
        return reply

    def received(self) -> list[Any]:
        data = self.transport.value()
        self.transport.clear()
        return self.wire.receive_data(data)

    def fetch(self, name: str, max_items: int | None = None) -> list[Any]:
        reply = self.request(Get(self.wire.next_id(), name, max_items))
        assert type(reply) is Fetched, reply
        return [codec.decode(it.value) for it in reply.items]

    def append(self, name: str, value: Any) -> None:
        reply = self.request(Append(self.wire.next_id(), name, Item(codec.encode(value))))
        assert type(reply) is Stored, reply

    def lose(self) -> None:
        self.proto.connectionLost(Failure(ConnectionDone()))


@pytest.fixture
def clock() -> MemoryReactorClock:
    return MemoryReactorClock()


@pytest.fixture
def factory(clock: MemoryReactorClock) -> Iterator[server_core.ServerFactory]:
    yield server_core.ServerFactory(clock)


def test_doc_6_7_cancel_of_a_remembered_put_undoes_nothing_and_keeps_its_reply(
        factory: server_core.ServerFactory) -> None:
    """§6.7: cancelling a remembered put undoes nothing (flag false); resent, it is still
    answered from memory."""
    peer = Peer(factory, SID)
    rid = peer.wire.next_id()
    put = Put(rid, "w", Item(codec.encode(1)))
    assert peer.request(put) == Stored(rid, 1, 1)
    assert peer.request(put) == Stored(rid, 1, 1)  # replayed: version 1 again
    cancel = peer.wire.next_id()
    assert peer.request(Cancel(cancel, rid)) == Acked(cancel, False)
    assert peer.request(put) == Stored(rid, 1, 1)  # still remembered: never runs twice


def test_doc_6_7_cancel_of_a_get_whose_value_was_superseded(
        factory: server_core.ServerFactory) -> None:
    """§6.7: the value is dropped, not restored, and the cancel still says true."""
    writer, peer = Peer(factory), Peer(factory, SID)
    writer.request(Put(writer.wire.next_id(), "v", Item(codec.encode("old"))))
    rid = peer.wire.next_id()
    assert type(peer.request(Get(rid, "v"))) is Fetched
    writer.request(Put(writer.wire.next_id(), "v", Item(codec.encode("new"))))
    cancel = peer.wire.next_id()
    assert peer.request(Cancel(cancel, rid)) == Acked(cancel, True)
    assert writer.fetch("v") == ["new"]


def test_doc_9_6_only_resume_resumes_a_known_session(
        factory: server_core.ServerFactory, clock: MemoryReactorClock) -> None:
    """§9.6: ``resume`` carries a known session on; without it the old session ends first
    (its get items go back), and an unknown id is new despite ``resume``."""
    writer = Peer(factory)
    writer.append("q", "a")
    first = Peer(factory, SID)
    assert first.hello.resumed is False and first.hello.server_id == factory.server_id
    assert first.fetch("q", 1) == ["a"]
    first.lose()
    again = Peer(factory, SID, resume=True)
    assert again.hello.resumed is True
    again.lose()
    restarted = Peer(factory, SID, resume=False)  # the same id, requests numbered afresh
    assert restarted.hello.resumed is False
    assert writer.fetch("q") == ["a"]  # the old session ended: its get went back
    fresh = Peer(factory, bytes(16), resume=True)
    assert fresh.hello.resumed is False


def test_doc_9_7_expiry_restores_unacknowledged_gets_with_a_restore_event(
        factory: server_core.ServerFactory, clock: MemoryReactorClock) -> None:
    writer, listener, peer = Peer(factory), Peer(factory), Peer(factory, SID)
    listener.request(Listen(listener.wire.next_id(), "q"))
    for i in range(3):
        writer.append("q", i)
    assert peer.fetch("q", 2) == [0, 1]
    listener.received()
    peer.lose()
    clock.advance(factory.config.session_ttl + 0.1)
    events = listener.received()
    assert [(e.op, e.n_items) for e in events] == [("restore", 3)]
    assert writer.fetch("q") == [0, 1, 2]


def test_doc_9_7_expiry_keeps_the_order_of_items_across_gets(
        factory: server_core.ServerFactory, clock: MemoryReactorClock) -> None:
    writer, peer = Peer(factory), Peer(factory, SID)
    for i in range(5):
        writer.append("q", i)
    assert peer.fetch("q", 2) == [0, 1]
    assert peer.fetch("q", 2) == [2, 3]
    peer.lose()
    clock.advance(factory.config.session_ttl + 0.1)
    assert writer.fetch("q") == [0, 1, 2, 3, 4]


def test_doc_9_3_an_ack_makes_a_gets_items_the_clients_for_good(
        factory: server_core.ServerFactory, clock: MemoryReactorClock) -> None:
    writer, peer = Peer(factory), Peer(factory, SID)
    writer.append("q", "a")
    get_id = peer.wire.next_id()
    assert type(peer.request(Get(get_id, "q"))) is Fetched
    ping = peer.wire.next_id()
    assert peer.request(Ping(ping), AckInfo(get_id)) == Acked(ping, True)
    cancel = peer.wire.next_id()
    assert peer.request(Cancel(cancel, get_id)) == Acked(cancel, False)
    peer.lose()
    clock.advance(factory.config.session_ttl + 0.1)
    assert factory.store.n_items("q") == 0


# --------------------------------------------------------------------------- values


def test_dtype_table_matches_the_codec() -> None:
    rows = table("<!-- table: dtypes -->")
    names = [code_cell(row[0]) for row in rows]
    assert tuple(names) == codec.DTYPES
    assert {code_cell(row[0]): int(row[1]) for row in rows} == codec._ITEMSIZE
    for row in rows:  # a dtype numpy lacks is marked as tensor-only
        numpy_ok = code_cell(row[0]) in codec._NUMPY_DTYPES
        assert numpy_ok == row[3].startswith("`"), row


def test_cuda_ipc_table_is_the_codecs_fields() -> None:
    rows = table("<!-- table: cuda-ipc -->")
    assert [code_cell(row[0]) for row in rows] == list(codec.CUDA_IPC_FIELDS)


def test_ext_type_table_matches_the_codec() -> None:
    rows = {int(row[0]): code_cell(row[1]) for row in table("<!-- table: ext-types -->")}
    assert rows == {
        codec.EXT_TENSOR: "EXT_TENSOR",
        codec.EXT_NDARRAY: "EXT_NDARRAY",
        codec.EXT_TUPLE: "EXT_TUPLE",
        codec.EXT_CUDA_IPC: "EXT_CUDA_IPC",
    }


def test_small_value_examples() -> None:
    """The byte examples given in §5.2."""
    assert codec.encode((1, "a")).value.hex(" ") == "d6 03 92 01 a1 61"
    assert codec.encode(()).value.hex(" ") == "d4 03 90"
    assert "`d6 03 92 01 a1 61`" in DOC and "`d4 03 90`" in DOC
    torch = pytest.importorskip("torch")
    scalar = codec.encode(torch.tensor(3.5)).value
    assert scalar == bytes.fromhex("c70b0193") + msgpack.packb("float32") + bytes.fromhex("9000")


def test_fetch_spec_is_what_get_and_peek_carry() -> None:
    """The doc's get/peek tables are one FetchSpec; the helpers of tests/wire.py build it."""
    assert Get(1, "w") == Fetch(1, "w", FetchSpec(True))
    assert Peek(1, "w") == Fetch(1, "w", FetchSpec(False))


def test_the_authentication_example_is_what_the_code_computes() -> None:
    from tensorshare.wire.auth import client_proof, server_proof

    args = (b"s3cret", b"\1" * 32, b"\2" * 32, None, "ex")
    assert f"`{client_proof(*args).hex()}`" in DOC
    assert f"`{server_proof(*args).hex()}`" in DOC
    assert "`74656e736f7273686172652d617574682d763100` `01`×32 `02`×32 `00` `00000002` " \
        "`6578`" in DOC


# --------------------------------------------------------------------------- handshake rules


class _Raw:
    """A connection to a ServerFactory that writes whatever frames a test gives it."""

    def __init__(self, factory: server_core.ServerFactory) -> None:
        addr = IPv4Address("TCP", "127.0.0.1", next(Peer._ports))
        self.proto = factory.buildProtocol(addr)
        self.transport = StringTransport(peerAddress=addr)
        self.proto.makeConnection(self.transport)
        self.wire = WireClient()

    def write(self, *msgs: Any) -> list[Any]:
        """Send ``msgs`` in one write; everything the server wrote back, parsed."""
        self.proto.dataReceived(b"".join(self.wire.frame(m) for m in msgs))
        data = self.transport.value()
        self.transport.clear()
        return self.wire.receive_data(data)


NONCE = bytes(32 * [9])


def _with_token(clock: MemoryReactorClock, **kw: Any) -> server_core.ServerFactory:
    return server_core.ServerFactory(clock, config=server.ServerConfig(token="tok", **kw))


def test_doc_8_1_pipelining_follows_the_handshakes_last_request(
        factory: server_core.ServerFactory, clock: MemoryReactorClock) -> None:
    from tensorshare.wire.auth import client_proof, token_bytes

    # Without a token: requests right after the hello are served after it.
    raw = _Raw(factory)
    out = raw.write(Hello(1, (1,), "doc"), Ping(2), ListBins(3))
    assert [type(m) for m in out] == [HelloReply, Acked, Listing]
    # With a token: after a hello that asks for a challenge, nothing but auth (fatal) ...
    raw = _Raw(_with_token(clock))
    out = raw.write(Hello(1, (1,), "doc", NONCE), Ping(2))
    assert [type(m) for m in out] == [Challenge, ErrorReply]
    assert out[1].id == 0 and out[1].code == "protocol_error"
    assert "then 'auth'" in out[1].message and raw.transport.disconnecting
    # ... and requests pipelined after the auth are served after it.
    raw = _Raw(_with_token(clock))
    (challenge,) = raw.write(Hello(1, (1,), "doc", NONCE))
    proof = client_proof(token_bytes("tok"), NONCE, challenge.nonce, None, "doc")
    out = raw.write(Auth(2, proof), Ping(3), ListBins(4))
    assert [type(m) for m in out] == [HelloReply, Acked, Listing]
    text = " ".join(DOC.split())
    assert "the `hello` of a client without a token, and the `auth` of one with a token" in text


def test_doc_3_2_15_an_auth_after_the_handshake_is_invalid_and_the_connection_stays(
        factory: server_core.ServerFactory) -> None:
    raw = _Raw(factory)
    raw.write(Hello(1, (1,), "doc"))
    (out,) = raw.write(Auth(2, b"p" * 32))
    assert isinstance(out, ErrorReply) and out.id == 2 and out.code == "invalid_request"
    assert out.message == "auth is not expected after the handshake"
    assert f'("{out.message}")' in DOC  # §3.2.15 and the table of §3.4 quote it
    assert [type(m) for m in raw.write(Ping(3))] == [Acked]


def test_doc_8_2_the_read_only_ops_are_the_op_tables_everywhere(
        clock: MemoryReactorClock, capsys: pytest.CaptureFixture[str]) -> None:
    from tensorshare.server.auth import read_ops, read_ops_text
    from tensorshare.wire.auth import client_proof, token_bytes

    ops = [name for name, op in OPS.items() if op.read and name not in ("hello", "auth")]
    assert read_ops() == ops and len(ops) == 8
    listed = ", ".join(f"`{n}`" for n in ops[:-1]) + f" and `{ops[-1]}`"
    text = " ".join(DOC.split())
    assert f"may send {listed} (the ops the op table" in text  # §8.2
    assert f"the read-only token always had: {listed})" in text  # §8.2.1
    readme = " ".join((DOC_PATH.parents[1] / "README.md").read_text(encoding="utf-8").split())
    assert f"may {listed} (the ops the op table marks read" in readme
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["serve", "--help"])
    assert f"may only {read_ops_text()}" in " ".join(capsys.readouterr().out.split())
    # The server's refusal names the same ops.
    raw = _Raw(_with_token(clock, read_token="ro"))
    (challenge,) = raw.write(Hello(1, (1,), "doc", NONCE))
    proof = client_proof(token_bytes("ro"), NONCE, challenge.nonce, None, "doc")
    raw.write(Auth(2, proof))
    (out,) = raw.write(Put(3, "w", Item(codec.encode(1))))
    assert out.code == "permission_denied" and f"(it may {read_ops_text()})" in out.message


def test_every_section_of_this_document_that_is_cited_exists() -> None:
    """A "§N.M" in the document, or after a mention of it in the package, README or
    ARCHITECTURE, names one of its headings (a cited §2.6 that does not exist misleads)."""
    root = DOC_PATH.parents[1]
    headings = set(re.findall(r"^#+ (?:Appendix )?([0-9A-Z]+(?:\.\d+)*)[. ]", DOC, re.M))
    cited = [(DOC_PATH.name, n) for n in re.findall(r"§ ?(\d+(?:\.\d+)*)", DOC)]
    others = [*sorted((root / "tensorshare").rglob("*.py")), root / "README.md",
              root / "docs" / "ARCHITECTURE.md"]
    for path in others:
        text = path.read_text(encoding="utf-8")
        cited += [(path.name, n) for n in
                  re.findall(r"PROTOCOL\.md`?[^§\n]{0,60}§ ?(\d+(?:\.\d+)*)", text)]
    assert len(cited) > 300
    missing = sorted({c for c in cited if c[1] not in headings})
    assert not missing, f"sections cited that docs/PROTOCOL.md does not have: {missing}"


def test_the_test_files_the_docs_name_exist() -> None:
    root = DOC_PATH.parents[1]
    for doc in (DOC_PATH, root / "README.md", root / "docs" / "ARCHITECTURE.md"):
        for path in re.findall(r"`(tests/[\w/]+\.py)`", doc.read_text(encoding="utf-8")):
            assert (root / path).exists(), f"{doc.name} names {path}, which does not exist"


def test_doc_14_3_the_input_an_inference_host_expects_is_what_it_says() -> None:
    pytest.importorskip("torch")
    from tensorshare.inference.host import _EXPECTED, _input_problem

    section = " ".join(DOC.split("### 14.3", 1)[1].split("\n### ", 1)[0].split())
    assert "**first dimension is the call's `rows`**" in section and "`(1, ...)`" in section
    assert "shape (rows, ...)" in _EXPECTED and "(1, ...)" in _EXPECTED
    import torch

    assert _input_problem(torch.zeros(1, 8), 1) is None
    problem = _input_problem(torch.zeros(8), 1)
    assert problem is not None and _EXPECTED in problem and "rows=1" in problem


# --------------------------------------------------------------------------- stream rules


def _stream_peers(factory: server_core.ServerFactory, **settings: Any) -> tuple[Peer, Peer]:
    """A producer that opened stream "s" with ``settings``, and a consumer peer."""
    prod, cons = Peer(factory, bytes(16 * [1])), Peer(factory, bytes(16 * [2]))
    reply = prod.request(StreamOpen(prod.wire.next_id(), "s", **settings))
    assert type(reply) is StreamOpened, reply
    return prod, cons


def _tensor(i: int) -> Item:
    return Item(codec.encode(i))


def test_doc_3_2_20_a_stream_read_without_timeout_answers_at_once(
        factory: server_core.ServerFactory) -> None:
    """§3.2.20: ``timeout`` absent or nil answers at once (never an unlimited wait)."""
    _, cons = _stream_peers(factory)
    assert type(cons.request(StreamJoin(cons.wire.next_id(), "s", "c"))) is StreamJoined
    for header in ({}, {"timeout": None}):
        rid = cons.wire.next_id()
        frame = encode_frame(msgpack.packb({"op": "stream_read", "id": rid, "bin": "s",
                                            "consumer": "c", **header}))
        cons.proto.dataReceived(b"".join(bytes(c) for c in frame))
        (reply,) = cons.received()
        assert type(reply) is ErrorReply and reply.code == "timeout", reply


def test_doc_3_2_17_and_18_appends_and_ends_without_timeout_are_held_without_limit(
        factory: server_core.ServerFactory, clock: MemoryReactorClock) -> None:
    """§3.2.17, §3.2.18: a held append or end without ``timeout`` waits until it can go."""
    prod, cons = _stream_peers(factory, window=1)
    cons.request(StreamJoin(cons.wire.next_id(), "s", "c"))
    assert type(prod.request(StreamAppend(prod.wire.next_id(), "s", 0, 0, _tensor(0)))) \
        is StreamAppended
    held = prod.wire.next_id()
    prod.proto.dataReceived(prod.wire.frame(StreamAppend(held, "s", 0, 0, _tensor(1))))
    clock.advance(3600.0)
    assert prod.received() == []  # still held, an hour on
    cons.request(StreamRead(cons.wire.next_id(), "s", "c", None))
    cons.request(StreamRead(cons.wire.next_id(), "s", "c", 1))  # acknowledges item 0
    assert prod.received() == [StreamAppended(held, 1, 2)]


def test_doc_3_2_17_an_append_of_more_items_than_the_window_is_refused(
        factory: server_core.ServerFactory) -> None:
    """§3.2.17, §13.3: refused even with no consumer in the stream; the window's worth goes."""
    prod, _ = _stream_peers(factory, window=2)
    items = tuple(_tensor(i) for i in range(3))
    reply = prod.request(StreamAppend(prod.wire.next_id(), "s", 0, 0, items[0], items[1:]))
    assert type(reply) is ErrorReply and reply.code == "invalid_request"
    assert "can never fit its window=2" in reply.message
    reply = prod.request(StreamAppend(prod.wire.next_id(), "s", 0, 0, items[0], items[1:2]))
    assert type(reply) is StreamAppended


def test_doc_3_2_19_epoch_start_needs_replay_epoch(
        factory: server_core.ServerFactory) -> None:
    """§3.2.19: refused without ``replay: "epoch"`` even while the first items are kept;
    accepted with it, and on a stream no producer opened yet."""
    nobody = Peer(factory)
    assert type(nobody.request(StreamJoin(nobody.wire.next_id(), "new", "c",
                                          "epoch_start"))) is StreamJoined
    prod, cons = _stream_peers(factory, window=8)
    cons.request(StreamJoin(cons.wire.next_id(), "s", "holds", "now"))
    prod.request(StreamAppend(prod.wire.next_id(), "s", 0, 0, _tensor(0)))  # kept: unread
    reply = cons.request(StreamJoin(cons.wire.next_id(), "s", "late", "epoch_start"))
    assert type(reply) is ErrorReply and reply.code == "invalid_request"
    assert "replay='epoch' keeps it" in reply.message
    kept_peer = Peer(factory, bytes(16 * [3]))
    kept_peer.request(StreamOpen(kept_peer.wire.next_id(), "r", replay="epoch"))
    kept_peer.request(StreamAppend(kept_peer.wire.next_id(), "r", 0, 0, _tensor(0)))
    joined = cons.request(StreamJoin(cons.wire.next_id(), "r", "late", "epoch_start"))
    assert type(joined) is StreamJoined and joined.position == 0


def test_doc_6_7_cancel_withdraws_waiting_stream_requests(
        factory: server_core.ServerFactory, clock: MemoryReactorClock) -> None:
    """§6.7: a waiting stream_read and a held stream_append and stream_end are withdrawn
    (flag true): no reply ever comes, nothing is stored or marked."""
    prod, cons = _stream_peers(factory, window=1)
    cons.request(StreamJoin(cons.wire.next_id(), "s", "c"))
    read = cons.wire.next_id()
    cons.proto.dataReceived(cons.wire.frame(StreamRead(read, "s", "c", None, None, 60.0)))
    cancel = cons.wire.next_id()
    assert cons.request(Cancel(cancel, read)) == Acked(cancel, True)
    prod.request(StreamAppend(prod.wire.next_id(), "s", 0, 0, _tensor(0)))
    held = [prod.wire.next_id() for _ in range(2)]
    prod.proto.dataReceived(prod.wire.frame(StreamAppend(held[0], "s", 0, 0, _tensor(1),
                                                         timeout=60.0)))
    prod.proto.dataReceived(prod.wire.frame(StreamEnd(held[1], "s", 0, 0, 1, False, 60.0)))
    for rid in held:
        cancel = prod.wire.next_id()
        assert prod.request(Cancel(cancel, rid)) == Acked(cancel, True)
    clock.advance(120.0)
    assert cons.received() == [] and prod.received() == []  # never answered
    stream = factory.bin_stats()["s"]["stream"]
    assert stream["head"] == 1 and stream["epoch"] == 0  # nothing stored, nothing marked


def test_doc_3_3_13_the_open_that_ends_a_broken_epoch_says_which(
        factory: server_core.ServerFactory, clock: MemoryReactorClock) -> None:
    """§3.3.13, §13.4: ``aborted`` names the epoch the open ended; ``broken`` is the stream
    after the open."""
    prod, cons = _stream_peers(factory, lease=1.0)
    cons.request(StreamJoin(cons.wire.next_id(), "s", "c", "now", 60.0))  # (keeps it)
    prod.request(StreamAppend(prod.wire.next_id(), "s", 0, 0, _tensor(0)))
    prod.lose()
    clock.advance(1.01)  # its lease ran out mid-epoch: gone
    assert factory.bin_stats()["s"]["stream"]["broken"]
    again = Peer(factory)
    rid = again.wire.next_id()
    assert again.request(StreamOpen(rid, "s", lease=1.0)) == \
        StreamOpened(rid, 1, 2, 0, 1, False, 0)
    rid = again.wire.next_id()
    assert again.request(StreamOpen(rid, "s", lease=1.0)) == StreamOpened(rid, 1, 2, 0, 1)
