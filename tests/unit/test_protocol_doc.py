"""Keep docs/PROTOCOL.md honest: its hex dumps, tables and lists must match the code.

* Every ``<!-- golden: NAME -->`` hex dump equals the frame the current code produces for the
  same message; the request dumps, sent to a real server, get the reply dumps back; and the
  Python client, talking to a fake server that answers with the reply dumps, writes the
  request dumps byte for byte.
* Every error code (``errors.ERROR_CODES`` and the codes the server writes literally) is in
  the error table, with its exception.
* Every op the server accepts has a header table, and every header table lists exactly the
  keys the code writes for that message.
* The dtype, ext type and default-limit tables match the code.
"""

from __future__ import annotations

import inspect
import re
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tensorshare import codec, errors, protocol, server
from tensorshare._version import __version__
from tensorshare.frames import PREFIX, aligned, encode_frame
from tensorshare.messages import (
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
from tensorshare.protocol import CLIENT, SERVER, BadRequest, Connection

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"
DOC = DOC_PATH.read_text(encoding="utf-8")

# The ops a client may send. If the server learns a new op, this test fails until the op is
# documented (a header table with a ``<!-- fields: OP -->`` marker) and added here.
REQUEST_OPS = {
    "hello",
    "put",
    "append",
    "get",
    "peek",
    "list",
    "delete",
    "listen",
    "unlisten",
    "ping",
    "cancel",
}
SERVER_OPS = {"reply", "error", "notify"}
GOLDEN_NAMES = [
    "hello-request",
    "hello-reply",
    "put-request",
    "put-reply",
    "get-request",
    "get-reply",
]


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
    start = DOC.find(marker)
    assert start >= 0, f"no {marker!r} in {DOC_PATH}"
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


def frame_bytes(role: str, msg: Message) -> bytes:
    return b"".join(bytes(c) for c in Connection(role).send(msg))


def header_of(frame: bytes) -> dict[str, Any]:
    header_len = struct.unpack_from("<I", frame, 4)[0]
    header = msgpack.unpackb(frame[PREFIX : PREFIX + header_len], raw=False)
    assert isinstance(header, dict)
    return header


def w_item() -> Item:
    torch = pytest.importorskip("torch")
    return Item(codec.encode(torch.tensor([1.0, 2.0])))


def hello_reply(server_name: str = "tensorshare/0.1.0") -> HelloReply:
    return HelloReply(1, 1, server_name, Limits())


def expected_golden(name: str) -> bytes:
    """What the code produces for the message each golden dump shows (see §9 of the doc)."""
    if name == "hello-request":
        return frame_bytes(CLIENT, Hello(1, (1,), "tensorshare-python"))
    if name == "hello-reply":
        return frame_bytes(SERVER, hello_reply())
    if name == "put-request":
        return frame_bytes(CLIENT, Put(2, "w", w_item()))
    if name == "put-reply":
        return frame_bytes(SERVER, Stored(2, 1, 1))
    if name == "get-request":
        return frame_bytes(CLIENT, Get(3, "w"))
    if name == "get-reply":
        return frame_bytes(SERVER, Fetched(3, "value", (w_item(),), 2, 0))
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


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_golden_dump_matches_code(name: str) -> None:
    assert golden(name).hex(" ") == expected_golden(name).hex(" ")


def test_golden_requests_get_golden_replies_from_a_real_server() -> None:
    """Send the doc's request frames to a real server; its replies are the doc's reply frames."""
    with (
        server.EmbeddedServer(port=0) as srv,
        socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock,
    ):
        sock.sendall(golden("hello-request"))
        # The server names its own version; everything else is as in the doc.
        assert read_frame(sock) == frame_bytes(SERVER, hello_reply(f"tensorshare/{__version__}"))
        sock.sendall(golden("put-request"))
        assert read_frame(sock).hex(" ") == golden("put-reply").hex(" ")
        sock.sendall(golden("get-request"))
        assert read_frame(sock).hex(" ") == golden("get-reply").hex(" ")


def test_python_client_writes_the_golden_requests() -> None:
    """The real Client, answered with the doc's reply frames, writes the doc's request frames."""
    torch = pytest.importorskip("torch")
    from tensorshare.client import Client

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
        with Client("127.0.0.1", listener.getsockname()[1], timeout=10) as client:
            assert client.protocol_version == 1
            assert client.limits == Limits()
            assert client.put("w", torch.tensor([1.0, 2.0])) == 1
            value = client.get("w")
    finally:
        thread.join(10)
        listener.close()
    assert not failures, failures
    assert torch.equal(value, torch.tensor([1.0, 2.0]))
    for step in ("hello", "put", "get"):
        assert seen[step].hex(" ") == golden(f"{step}-request").hex(" "), step


def test_two_buffer_layout_example() -> None:
    """The numbers of worked example 2 in §2.2."""
    torch = pytest.importorskip("torch")
    enc = codec.encode({"w": torch.zeros(3), "b": torch.arange(5)})
    frame = frame_bytes(CLIENT, Put(2, "params", Item(enc)))
    header_len, payload_len = struct.unpack_from("<IQ", frame, 4)
    assert (header_len, payload_len, len(frame)) == (74, 104, 232)
    assert header_of(frame)["items"][0][1] == [[0, 12], [64, 40]]
    assert "`H = 74`" in DOC and "`payload_len = 104`" in DOC and "`128 + 104 = 232`" in DOC


# --------------------------------------------------------------------------- errors


def error_table() -> dict[str, list[str]]:
    return {code_cell(row[0]): row for row in table("<!-- table: error-codes -->")}


def test_every_error_code_is_in_the_error_table() -> None:
    rows = error_table()
    for code, cls in errors.ERROR_CODES.items():
        assert code in rows, f"error code {code!r} is missing from the doc's error table"
        assert f"`{cls.__name__}`" in rows[code][1], f"{code!r} should name {cls.__name__}"


def test_codes_written_literally_by_the_server_are_documented() -> None:
    sources = inspect.getsource(server) + inspect.getsource(protocol)
    patterns = [
        r'_fail_connection\(\s*"(\w+)"',
        r'ErrorReply\(\s*[\w.]+,\s*"(\w+)"',
        r'BadRequest\(\s*\w+,\s*"(\w+)"',
        r'_Invalid\([^()]*\),\s*"(\w+)"',
        r'code = "(\w+)"',
        r'code: str = "(\w+)"',
    ]
    found = {code for pattern in patterns for code in re.findall(pattern, sources)}
    assert {"protocol_error", "limit_exceeded", "invalid_request", "timeout"} <= found, found
    missing = found - set(error_table())
    assert not missing, f"codes the server sends but the doc's error table lacks: {missing}"


# --------------------------------------------------------------------------- ops and headers


def test_request_ops_in_the_code_are_the_documented_ones() -> None:
    src = inspect.getsource(Connection._build_request)
    in_code = (
        set(protocol._STORE_OPS) | set(protocol._FETCH_OPS) | set(re.findall(r'op == "(\w+)"', src))
    )
    assert in_code == REQUEST_OPS, "the server's ops changed: update REQUEST_OPS and the doc"
    for op in sorted(REQUEST_OPS):
        assert f"<!-- fields: {op} -->" in DOC, f"op {op!r} has no header table in the doc"
        assert f"`{op}`" in DOC


@pytest.mark.parametrize("op", sorted(REQUEST_OPS))
def test_server_accepts_each_documented_op(op: str) -> None:
    """Behaviourally: the server knows the op (a bare request is never an 'unknown op')."""
    conn = Connection(SERVER)
    header = msgpack.packb({"op": op, "id": 7})
    out = conn.receive_data(b"".join(bytes(c) for c in encode_frame(header)))
    assert len(out) == 1
    if isinstance(out[0], BadRequest):
        assert "unknown op" not in out[0].message


def test_server_refuses_an_undocumented_op() -> None:
    conn = Connection(SERVER)
    header = msgpack.packb({"op": "frob", "id": 7})
    (out,) = conn.receive_data(b"".join(bytes(c) for c in encode_frame(header)))
    assert isinstance(out, BadRequest) and out.code == "invalid_request"


def test_server_message_ops_are_documented() -> None:
    src = inspect.getsource(Connection._parse_server_message)
    in_code = set(re.findall(r'op [!=]= "(\w+)"', src))
    assert in_code == SERVER_OPS
    for op in SERVER_OPS:
        assert f'`"{op}"`' in DOC


def _header_cases() -> list[tuple[str, str, list[Message]]]:
    item = Item(codec.encode([1, "a", b"b"]), tag=5)
    return [
        ("hello", CLIENT, [Hello(1, (1,), "me", "token")]),
        ("put", CLIENT, [Put(2, "w", item)]),
        ("append", CLIENT, [Append(2, "w", item)]),
        ("get", CLIENT, [Get(3, "w", 2, True, 1.5, 1, 4, 2)]),
        ("peek", CLIENT, [Peek(3, "w", 2, True, 1.5, 1, 4, 2)]),
        ("list", CLIENT, [ListBins(4)]),
        ("delete", CLIENT, [Delete(5, "w")]),
        ("listen", CLIENT, [Listen(6, "w")]),
        ("unlisten", CLIENT, [Unlisten(7, "w")]),
        ("ping", CLIENT, [Ping(8)]),
        ("cancel", CLIENT, [Cancel(9, 3)]),
        ("reply-hello", SERVER, [hello_reply()]),
        ("reply-put", SERVER, [Stored(2, 1, 1)]),
        (
            "reply-get",
            SERVER,
            [Fetched(3, "list", (item, item), 5, 1, 2), Fetched(3, "value", (), 5, 1, 0, True)],
        ),
        ("reply-list", SERVER, [Listing(4, {"w": 1})]),
        ("reply-delete", SERVER, [Deleted(5, True, 6)]),
        ("reply-listen", SERVER, [Listening(6, 6, 0)]),
        ("reply-ack", SERVER, [Acked(7, False)]),
        ("reply-error", SERVER, [ErrorReply(8, "bin_not_found", "no bin")]),
        ("error", SERVER, [ErrorReply(0, "protocol_error", "bad magic")]),
        ("notify", SERVER, [Changed("w", "put", 1, 1)]),
    ]


@pytest.mark.parametrize(
    "name,role,msgs", _header_cases(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_header_table_lists_exactly_the_keys_the_code_writes(
    name: str, role: str, msgs: list[Message]
) -> None:
    written: set[str] = set()
    for msg in msgs:
        written |= set(header_of(frame_bytes(role, msg)))
    assert documented_fields(name) == written


def test_limits_table_matches_the_defaults() -> None:
    limits_map = header_of(frame_bytes(SERVER, hello_reply()))["limits"]
    rows = {code_cell(row[0]): row for row in table("<!-- fields: limits -->")}
    assert set(rows) == set(limits_map)
    defaults = Limits()
    for name, row in rows.items():
        documented = int(re.match(r"\d+", row[2]).group())  # type: ignore[union-attr]
        assert documented == getattr(defaults, name) == limits_map[name], name


# --------------------------------------------------------------------------- values


def test_dtype_table_matches_the_codec() -> None:
    rows = table("<!-- table: dtypes -->")
    names = [code_cell(row[0]) for row in rows]
    assert tuple(names) == codec.DTYPES
    assert {code_cell(row[0]): int(row[1]) for row in rows} == codec._ITEMSIZE
    for row in rows:  # a dtype numpy lacks is marked as tensor-only
        numpy_ok = code_cell(row[0]) in codec._NUMPY_DTYPES
        assert numpy_ok == row[3].startswith("`"), row


def test_ext_type_table_matches_the_codec() -> None:
    rows = {int(row[0]): code_cell(row[1]) for row in table("<!-- table: ext-types -->")}
    assert rows == {
        codec.EXT_TENSOR: "EXT_TENSOR",
        codec.EXT_NDARRAY: "EXT_NDARRAY",
        codec.EXT_TUPLE: "EXT_TUPLE",
    }


def test_small_value_examples() -> None:
    """The byte examples given in §5.2."""
    assert codec.encode((1, "a")).value.hex(" ") == "d6 03 92 01 a1 61"
    assert codec.encode(()).value.hex(" ") == "d4 03 90"
    assert "`d6 03 92 01 a1 61`" in DOC and "`d4 03 90`" in DOC
    torch = pytest.importorskip("torch")
    scalar = codec.encode(torch.tensor(3.5)).value
    assert scalar == bytes.fromhex("c70b0193") + msgpack.packb("float32") + bytes.fromhex("9000")
