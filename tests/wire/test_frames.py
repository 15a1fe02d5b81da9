"""Unit tests for tensorshare.frames: the wire framing and the incremental decoder."""

from __future__ import annotations

import random
import struct
import tracemalloc
from array import array

import pytest

from tensorshare.errors import ProtocolError
from tensorshare.wire import frames
from tensorshare.wire.frames import (
    ALIGN,
    DIRECT_READ_MIN,
    FORMAT_VERSION,
    LARGE_PART,
    MAGIC,
    PREFIX,
    Frame,
    FrameDecoder,
    OversizedFrame,
    aligned,
    encode_frame,
    payload_layout,
)

MiB = 1 << 20
BIG = 1 << 30  # a frame limit that never gets in the way


def prefix(header_len: int, payload_len: int = 0, *, magic: bytes = b"TS", version: int = 1,
           flags: int = 0) -> bytes:
    return struct.pack("<2sBBIQ", magic, version, flags, header_len, payload_len)


def frame_bytes(header: bytes, buffers: tuple[bytes, ...] | list[bytes] = ()) -> bytes:
    return b"".join(bytes(c) for c in encode_frame(header, buffers))


def expected_frame(header: bytes, buffers: tuple[bytes, ...] | list[bytes] = ()) -> Frame:
    """The Frame a decoder must produce, built from payload_layout (independently of encode)."""
    offsets, payload_len = payload_layout([len(b) for b in buffers])
    payload = bytearray(payload_len)
    for off, buf in zip(offsets, buffers, strict=True):
        payload[off : off + len(buf)] = buf
    return Frame(header, payload)


def decoder(max_frame_bytes: int = BIG, max_header_bytes: int = 1 * MiB) -> FrameDecoder:
    return FrameDecoder(max_frame_bytes, max_header_bytes)


# A few frames of different shapes, used by the round-trip tests.
SAMPLE_FRAMES: list[tuple[bytes, tuple[bytes, ...]]] = [
    (b"\x81\xa2op\xa4ping", ()),
    (b"\x81\xa1k\x01", (b"abc", b"defgh")),
    (bytes(range(47)), (bytes(range(256)) * 3,)),  # 16 + 47 = 63: one byte of padding
    (bytes(range(48)), (b"x" * 64, b"", b"y")),  # 16 + 48 = 64: no padding, empty buffer
    (b"h" * 200, (b"\x00" * 65, b"\xff" * 7, b"z" * 130)),
    (b"\x80", ()),
    (b"tail", (bytes(range(10)),)),
]


# -- constants ------------------------------------------------------------------------------
def test_constants():
    assert MAGIC == b"TS"
    assert FORMAT_VERSION == 1
    assert PREFIX == 16
    assert ALIGN == 64
    assert [aligned(n) for n in (0, 1, 63, 64, 65, 128, 129)] == [0, 64, 64, 64, 128, 128, 192]


# -- encode_frame ---------------------------------------------------------------------------
def test_encode_frame_golden_bytes_header_only():
    header = b"\x81\xa2op\xa4ping"  # msgpack {"op": "ping"}, 9 bytes
    chunks = encode_frame(header)
    assert b"".join(chunks) == (
        b"TS"  # magic
        b"\x01"  # format version
        b"\x00"  # flags
        b"\x09\x00\x00\x00"  # u32 LE header_len = 9
        b"\x00\x00\x00\x00\x00\x00\x00\x00"  # u64 LE payload_len = 0
        b"\x81\xa2op\xa4ping"  # header; no padding without a payload
    )
    assert len(b"".join(chunks)) == 16 + 9


def test_encode_frame_golden_bytes_two_buffers():
    header = b"\x81\xa1k\x01"  # 4 bytes: prefix + header = 20, padded to 64
    buf1, buf2 = b"abc", b"defgh"
    chunks = encode_frame(header, [buf1, buf2])
    data = b"".join(bytes(c) for c in chunks)
    assert data == (
        b"TS\x01\x00"
        + b"\x04\x00\x00\x00"  # header_len = 4
        + (64 + 5).to_bytes(8, "little")  # payload_len = 69
        + header
        + bytes(64 - 20)  # zero padding to the first 64-byte boundary of the frame
        + b"abc"  # payload offset 0
        + bytes(64 - 3)  # zero padding inside the payload
        + b"defgh"  # payload offset 64; no trailing padding
    )
    assert len(data) == 64 + 69
    payload = data[64:]
    assert payload[0:3] == buf1
    assert payload[64:69] == buf2
    assert struct.unpack_from("<Q", data, 8)[0] == 69
    # The buffers are passed through, not copied.
    assert any(c is buf1 for c in chunks)
    assert any(c is buf2 for c in chunks)


def test_encode_frame_header_longer_than_one_alignment_block():
    header = b"H" * 60  # 16 + 60 = 76 -> payload starts at 128
    data = frame_bytes(header, [b"P"])
    assert data[16:76] == header
    assert data[76:128] == bytes(52)
    assert data[128:] == b"P"
    assert struct.unpack_from("<IQ", data, 4) == (60, 1)


def test_encode_frame_accepts_bytearray_and_memoryview_buffers():
    backing = bytearray(b"0123456789")
    mv = memoryview(backing)[2:6]
    data = frame_bytes(b"h", [bytearray(b"ab"), mv])
    assert data[64:66] == b"ab"
    assert data[64 + 64 :] == b"2345"


@pytest.mark.parametrize(
    "sizes",
    [[], [0], [1], [3, 5], [64], [64, 64], [65, 1], [0, 0, 7], [1, 0, 1], [200, 3, 129, 64, 1]],
)
def test_payload_layout_agrees_with_encode_frame(sizes):
    offsets, payload_len = payload_layout(sizes)
    assert all(off % ALIGN == 0 for off in offsets)
    assert len(offsets) == len(sizes)
    if sizes:
        assert payload_len == offsets[-1] + sizes[-1]  # no trailing padding
    else:
        assert payload_len == 0
    buffers = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    header = b"\x81\xa1h\xc0"
    data = frame_bytes(header, buffers)
    assert struct.unpack_from("<Q", data, 8)[0] == payload_len
    start = aligned(PREFIX + len(header)) if payload_len else PREFIX + len(header)
    assert len(data) == start + payload_len
    payload = data[start:]
    covered = bytearray(payload_len)
    for off, buf in zip(offsets, buffers, strict=True):
        assert payload[off : off + len(buf)] == buf
        covered[off : off + len(buf)] = b"\x01" * len(buf)
    # Everything that is not a buffer is zero padding.
    assert all(payload[i] == 0 for i in range(payload_len) if not covered[i])


def test_payload_layout_golden():
    assert payload_layout([3, 5]) == ([0, 64], 69)
    assert payload_layout([64, 1]) == ([0, 64], 65)
    assert payload_layout([65, 1]) == ([0, 128], 129)
    assert payload_layout([]) == ([], 0)


# -- round trips ----------------------------------------------------------------------------
def _stream() -> tuple[bytes, list[Frame]]:
    data = b"".join(frame_bytes(h, b) for h, b in SAMPLE_FRAMES)
    return data, [expected_frame(h, b) for h, b in SAMPLE_FRAMES]


def test_round_trip_one_chunk():
    data, expected = _stream()
    out = decoder().feed(data)
    assert out == expected
    for got in out:
        assert type(got) is Frame
        assert type(got.header) is bytes
        assert type(got.payload) is bytearray
    # Exact payload bytes of the two-buffer frame.
    assert bytes(out[1].payload) == b"abc" + bytes(61) + b"defgh"
    assert out[0].payload == bytearray()


def test_round_trip_one_byte_at_a_time():
    data, expected = _stream()
    dec = decoder()
    out: list = []
    for i in range(len(data)):
        out.extend(dec.feed(data[i : i + 1]))
    assert out == expected


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 17, 12345])
def test_round_trip_random_chunks(seed):
    rng = random.Random(seed)
    data, expected = _stream()
    dec = decoder()
    out: list = []
    i = 0
    while i < len(data):
        n = rng.choice([1, 2, 3, rng.randint(1, 20), rng.randint(1, 300)])
        out.extend(dec.feed(data[i : i + n]))
        i += n
    assert out == expected


def test_frames_complete_only_on_their_last_byte():
    data = frame_bytes(b"\x81\xa1k\x01", [b"abc", b"defgh"])
    dec = decoder()
    assert dec.feed(data[:-1]) == []
    assert dec.feed(data[-1:]) == [expected_frame(b"\x81\xa1k\x01", (b"abc", b"defgh"))]
    assert dec.feed(b"") == []


def test_empty_feed_is_a_no_op():
    dec = decoder()
    assert dec.feed(b"") == []
    assert dec.feed(b"TS") == []
    assert dec.feed(b"") == []
    rest = frame_bytes(b"abc")[2:]
    assert dec.feed(rest) == [Frame(b"abc", bytearray())]


# -- get_buffer / buffer_updated --------------------------------------------------------------
def _mib_frame() -> tuple[bytes, bytes, bytes]:
    header = b"\x81\xa3big\xc3"
    payload = bytes(range(256)) * (MiB // 256)
    return header, payload, frame_bytes(header, [payload])


def test_get_buffer_is_none_in_prefix_state():
    dec = decoder()
    assert dec.get_buffer() is None
    header, _, data = _mib_frame()
    dec.feed(data[:10])  # still in the prefix
    assert dec.get_buffer() is None


def test_get_buffer_direct_read_of_a_large_payload():
    header, payload, data = _mib_frame()
    assert len(payload) == MiB
    start = aligned(PREFIX + len(header))
    dec = decoder()
    assert dec.feed(data[: start + 7]) == []  # prefix + header + padding + 7 payload bytes
    buf = dec.get_buffer()
    assert isinstance(buf, memoryview)
    assert not buf.readonly
    assert buf.nbytes == len(buf) == MiB - 7
    buf[:] = payload[7:]
    out = dec.buffer_updated(MiB - 7)
    assert out == [Frame(header, bytearray(payload))]
    assert bytes(out[0].payload) == payload
    # Back in the prefix state; the next frame decodes normally.
    assert dec.get_buffer() is None
    assert dec.feed(frame_bytes(b"next")) == [Frame(b"next", bytearray())]


def test_get_buffer_partial_writes_then_small_remainder():
    header, payload, data = _mib_frame()
    start = aligned(PREFIX + len(header))
    dec = decoder()
    dec.feed(data[: start + 3])
    buf = dec.get_buffer()
    assert buf is not None and len(buf) == MiB - 3
    # Write part of it, as a short recv_into would.
    n = 500_000
    buf[:n] = payload[3 : 3 + n]
    assert dec.buffer_updated(n) == []
    buf2 = dec.get_buffer()
    assert buf2 is not None and len(buf2) == MiB - 3 - n
    # Leave less than DIRECT_READ_MIN: get_buffer declines.
    left = DIRECT_READ_MIN - 1
    m = len(buf2) - left
    buf2[:m] = payload[3 + n : 3 + n + m]
    assert dec.buffer_updated(m) == []
    assert dec.get_buffer() is None
    # Finish with an ordinary feed that also carries the next frame.
    out = dec.feed(data[MiB + start - left :] + frame_bytes(b"after", [b"xyz"]))
    assert out == [Frame(header, bytearray(payload)), expected_frame(b"after", (b"xyz",))]


def test_get_buffer_boundary_at_direct_read_min():
    header = b"h"
    payload = b"\x07" * DIRECT_READ_MIN
    data = frame_bytes(header, [payload])
    dec = decoder()
    dec.feed(data[:64])  # prefix + header + padding: the whole payload is missing
    buf = dec.get_buffer()
    assert buf is not None and len(buf) == DIRECT_READ_MIN
    dec.feed(data[64:65])  # one byte via feed: remainder drops below the threshold
    assert dec.get_buffer() is None
    assert dec.feed(data[65:]) == [Frame(header, bytearray(payload))]


def test_get_buffer_none_for_small_payload_and_padding():
    data = frame_bytes(b"hdr", [b"x" * 1000])
    dec = decoder()
    dec.feed(data[:20])  # inside the padding
    assert dec.get_buffer() is None
    dec.feed(data[20:64])  # payload state, 1000 bytes missing
    assert dec.get_buffer() is None
    assert dec.feed(data[64:]) == [expected_frame(b"hdr", (b"x" * 1000,))]


def test_get_buffer_for_a_large_header():
    header = bytes(range(256)) * 1024  # 256 KiB header
    dec = decoder(max_header_bytes=1 * MiB)
    data = frame_bytes(header, [b"pay"])
    dec.feed(data[: PREFIX + 100])
    buf = dec.get_buffer()
    assert buf is not None and len(buf) == len(header) - 100
    buf[:] = header[100:]
    assert dec.buffer_updated(len(buf)) == []
    out = dec.feed(data[PREFIX + len(header) :])
    assert out == [expected_frame(header, (b"pay",))]


def test_mixing_feed_and_direct_reads_over_several_frames():
    rng = random.Random(99)
    specs = [
        (b"one", (bytes(rng.randrange(256) for _ in range(300_000)),)),
        (b"two", (b"s" * 10,)),
        (b"three", (b"a" * 70_000, b"b" * 90_000)),
        (b"four", ()),
    ]
    data = b"".join(frame_bytes(h, b) for h, b in specs)
    dec = decoder()
    out: list = []
    i = 0
    direct_reads = 0
    while i < len(data):
        buf = dec.get_buffer()
        if buf is not None:
            n = min(len(buf), rng.randint(1, 200_000))
            buf[:n] = data[i : i + n]
            out.extend(dec.buffer_updated(n))
            direct_reads += 1
        else:
            n = rng.randint(1, 50_000)
            out.extend(dec.feed(data[i : i + n]))
        i += n
    assert direct_reads > 0
    assert out == [expected_frame(h, b) for h, b in specs]


# -- limits ---------------------------------------------------------------------------------
def test_oversized_header_is_refused_as_soon_as_the_prefix_is_complete():
    dec = decoder(max_frame_bytes=BIG, max_header_bytes=1024)
    huge = prefix(2**32 - 1, 0)
    tracemalloc.start()
    try:
        for i in range(PREFIX - 1):
            assert dec.feed(huge[i : i + 1]) == []
        with pytest.raises(ProtocolError, match=r"4294967295.*max_header_bytes=1024"):
            dec.feed(huge[PREFIX - 1 :])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 * MiB  # nothing the size of the announced header was allocated


def test_oversized_header_in_one_chunk_with_more_bytes_after_it():
    dec = decoder(max_frame_bytes=BIG, max_header_bytes=100)
    with pytest.raises(ProtocolError, match="max_header_bytes"):
        dec.feed(prefix(101, 0) + b"x" * 101)


def test_header_at_the_limit_is_accepted():
    dec = decoder(max_frame_bytes=BIG, max_header_bytes=100)
    assert dec.feed(frame_bytes(b"h" * 100)) == [Frame(b"h" * 100, bytearray())]


def test_oversized_payload_is_skipped_without_being_stored():
    header = b"\x81\xa2op\xa3put"
    dec = decoder(max_frame_bytes=1 * MiB, max_header_bytes=4096)
    chunk = bytes(1 * MiB)  # allocated before tracing starts
    head = prefix(len(header), 2**40) + header + bytes(aligned(PREFIX + len(header)) - PREFIX - len(header))
    tracemalloc.start()
    try:
        # Reported as soon as the header is in, so the peer hears about it at once.
        assert dec.feed(head) == [OversizedFrame(header, 2**40, 1 * MiB)]
        for _ in range(4):
            assert dec.feed(chunk) == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024  # the payload is dropped as it streams past
    assert dec.get_buffer() is None  # no destination buffer exists
    assert dec._state == frames._SKIP  # still skipping the announced 2**40 bytes
    assert dec._remaining_skip == 2**40 - 4 * MiB


def test_oversized_frame_is_reported_and_the_connection_stays_usable():
    header = b"\x81\xa2op\xa6append"
    payload = b"p" * 5000
    big = frame_bytes(header, [payload])
    after = frame_bytes(b"\x81\xa2op\xa4ping", [b"ok"])
    limit = 1000
    expected = [
        OversizedFrame(header, 5000, limit),
        expected_frame(b"\x81\xa2op\xa4ping", (b"ok",)),
    ]
    assert decoder(max_frame_bytes=limit, max_header_bytes=100).feed(big + after) == expected
    # Same with one byte at a time: the OversizedFrame comes with the header's last byte,
    # then the payload is skipped without producing anything.
    dec = decoder(max_frame_bytes=limit, max_header_bytes=100)
    header_end = PREFIX + len(header)
    out: list = []
    for i in range(len(big)):
        got = dec.feed(big[i : i + 1])
        if i != header_end - 1:
            assert got == []
        out.extend(got)
    assert out == expected[:1]
    assert dec.feed(after) == expected[1:]


def test_max_frame_bytes_boundary_counts_prefix_header_and_padding():
    header = b"hdr"  # 16 + 3 -> payload starts at 64
    at_limit = frame_bytes(header, [b"x" * 36])  # 64 + 36 = 100
    over = frame_bytes(header, [b"x" * 37])  # 101
    assert len(at_limit) == 100
    dec = decoder(max_frame_bytes=100, max_header_bytes=50)
    assert dec.feed(at_limit) == [expected_frame(header, (b"x" * 36,))]
    assert dec.feed(over) == [OversizedFrame(header, 37, 100)]
    assert dec.feed(at_limit) == [expected_frame(header, (b"x" * 36,))]


# -- malformed prefixes ---------------------------------------------------------------------
def test_bad_magic_http_request():
    dec = decoder()
    with pytest.raises(ProtocolError, match="magic") as info:
        dec.feed(b"GET / HTTP/1.1\r\n")
    assert "b'GE'" in str(info.value)


def test_bad_magic_reported_when_the_prefix_is_complete():
    dec = decoder()
    assert dec.feed(b"XX\x01\x00" + bytes(11)) == []
    with pytest.raises(ProtocolError, match="bad magic b'XX'"):
        dec.feed(b"\x00")


@pytest.mark.parametrize("version", [0, 2, 255])
def test_bad_version(version):
    with pytest.raises(ProtocolError, match=f"version {version}"):
        decoder().feed(prefix(3, 0, version=version) + b"abc")


@pytest.mark.parametrize("flags", [1, 0x80, 0xFF])
def test_nonzero_flags(flags):
    with pytest.raises(ProtocolError, match=f"flags {flags:#x}"):
        decoder().feed(prefix(3, 0, flags=flags) + b"abc")


def test_zero_header_len():
    with pytest.raises(ProtocolError, match="empty frame header"):
        decoder().feed(prefix(0, 0))
    with pytest.raises(ProtocolError, match="empty frame header"):
        decoder().feed(prefix(0, 64) + bytes(64))


def test_bad_prefix_after_a_good_frame():
    dec = decoder()
    assert dec.feed(frame_bytes(b"ok")) == [Frame(b"ok", bytearray())]
    with pytest.raises(ProtocolError, match="magic"):
        dec.feed(b"GET / HTTP/1.1\r\n")


# -- input types and copying ----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "memoryview_slice"])
def test_feed_accepts_bytes_like(kind):
    data, expected = _stream()
    chunk = {
        "bytes": lambda: data,
        "bytearray": lambda: bytearray(data),
        "memoryview": lambda: memoryview(data),
        "memoryview_slice": lambda: memoryview(b"junk" + data + b"junk")[4:-4],
    }[kind]()
    assert decoder().feed(chunk) == expected


def test_feed_counts_bytes_of_a_memoryview_with_wider_items():
    data = frame_bytes(b"\x81\xa1k\x01", [b"abc", b"defgh"])  # 133 bytes
    padded = data + frame_bytes(b"abc")[:3]  # 136 bytes = 34 uint32 items
    dec = decoder()
    assert dec.feed(memoryview(array("I", padded))) == [
        expected_frame(b"\x81\xa1k\x01", (b"abc", b"defgh"))
    ]
    assert dec.feed(frame_bytes(b"abc")[3:]) == [Frame(b"abc", bytearray())]


def test_decoder_copies_completed_frames():
    scratch = bytearray(frame_bytes(b"head", [b"payload!"]))
    dec = decoder()
    out = dec.feed(scratch)
    assert out == [expected_frame(b"head", (b"payload!",))]
    scratch[:] = b"\xee" * len(scratch)
    assert out == [expected_frame(b"head", (b"payload!",))]


def test_decoder_copies_frames_in_progress():
    header = b"\x81\xa1k\xa5hello"
    data = frame_bytes(header, [b"A" * 100, b"B" * 30])
    expected = [expected_frame(header, (b"A" * 100, b"B" * 30))]
    # Reuse one scratch buffer for every read, as an I/O layer would.
    for cut_points in ([5, 20, 80, 150], [16, 16 + len(header), 64, 100], [1, 2, 3]):
        dec = decoder()
        scratch = bytearray(len(data))
        out: list = []
        bounds = [0, *cut_points, len(data)]
        for a, b in zip(bounds, bounds[1:], strict=False):
            scratch[: b - a] = data[a:b]
            out.extend(dec.feed(memoryview(scratch)[: b - a]))
            scratch[:] = b"\xaa" * len(scratch)  # clobber what was just fed
        assert out == expected


def test_direct_read_frame_is_not_affected_by_later_feeds():
    header, payload, data = _mib_frame()
    dec = decoder()
    start = aligned(PREFIX + len(header))
    dec.feed(data[:start])
    buf = dec.get_buffer()
    buf[:] = payload
    (frame,) = dec.buffer_updated(MiB)
    dec.feed(frame_bytes(b"x", [b"\x00" * 10]))
    assert bytes(frame.payload) == payload


# ------------------------------------------------------------------------ memory budget


class _Budget:
    def __init__(self, room: int) -> None:
        self.room, self.held, self.asked = room, 0, []

    def reserve(self, n: int) -> str | None:
        self.asked.append(n)
        if self.held + n > self.room:
            return f"no room for {n}"
        self.held += n
        return None

    def release(self, n: int) -> None:
        self.held -= n


def _big_frame(payload_len: int, header: bytes = b"\x81\xa2id\x07") -> bytes:
    return b"".join(bytes(c) for c in encode_frame(header, [bytes(payload_len)]))


def test_a_large_payload_is_reserved_taken_from_allocate_and_released_when_complete() -> None:
    budget, taken = _Budget(1 << 20), []

    def allocate(n: int) -> bytearray:
        taken.append(n)
        return bytearray(n)

    dec = FrameDecoder(1 << 30, 1 << 20, allocate=allocate, budget=budget)
    data = _big_frame(LARGE_PART)
    assert dec.feed(data[:1000]) == []
    assert budget.held == LARGE_PART and dec.reserved == LARGE_PART and taken == [LARGE_PART]
    (frame,) = dec.feed(data[1000:])
    assert isinstance(frame, Frame) and len(frame.payload) == LARGE_PART
    assert budget.held == 0 and dec.reserved == 0


def test_small_parts_are_neither_reserved_nor_allocated() -> None:
    budget = _Budget(0)
    def allocate(n: int) -> bytearray:
        raise AssertionError("a small part is a bytearray")

    dec = FrameDecoder(1 << 30, 1 << 20, allocate=allocate, budget=budget)
    data = _big_frame(LARGE_PART - 1)
    (frame,) = dec.feed(data[:10]) + dec.feed(data[10:])
    assert isinstance(frame, Frame) and budget.asked == []


def test_a_payload_over_the_budget_is_refused_and_skipped_and_the_stream_goes_on() -> None:
    budget = _Budget(LARGE_PART - 1)
    dec = FrameDecoder(1 << 30, 1 << 20, budget=budget)
    data = _big_frame(1 << 20) + _big_frame(0, b"\x81\xa2id\x08")
    out = []
    for i in range(0, len(data), 4096):  # arrives in pieces
        out += dec.feed(data[i:i + 4096])
    refused, nxt = out
    assert isinstance(refused, OversizedFrame) and refused.reason == f"no room for {1 << 20}"
    assert isinstance(nxt, Frame) and nxt.header == b"\x81\xa2id\x08"
    assert budget.held == 0


def test_closing_mid_frame_releases_its_reservation() -> None:
    budget = _Budget(1 << 30)
    dec = FrameDecoder(1 << 30, 1 << 20, budget=budget)
    dec.feed(_big_frame(1 << 20)[:5000])
    assert budget.held == 1 << 20
    dec.close()
    assert budget.held == 0 and dec.reserved == 0


def test_a_large_header_over_the_budget_is_fatal() -> None:
    dec = FrameDecoder(1 << 30, 1 << 30, budget=_Budget(0))
    header = b"\xc6" + (LARGE_PART).to_bytes(4, "big") + bytes(LARGE_PART)
    with pytest.raises(ProtocolError, match="header of .* refused: no room"):
        dec.feed(_big_frame(0, header)[:100])
