"""CUDA IPC descriptors on any machine, with fake handle bytes: the codec's ext 4 encodes,
validates and describes them; the server (and a relay) stores and hands them out untouched
and refuses a malformed one; a TCP reader gets a clear ``CodecError``; ``tensorshare
ls``/``peek`` show them; a stream opened with ``device_ipc`` refuses TCP consumers and
``replay="epoch"``; a reused slot becomes ``Lagged``, never wrong data."""

from __future__ import annotations

import os
from typing import Any

import msgpack
import pytest
import torch

from tensorshare import Client, CodecError, EmbeddedServer, InvalidRequest, Lagged
from tensorshare.cli.main import main
from tensorshare.client.ops import Command
from tensorshare.client.streams import _DecodeBatch
from tensorshare.memory import ipc
from tensorshare.memory.ipc import CudaIpcRing, IpcTensor, SlotReused
from tensorshare.wire import codec
from tensorshare.wire.codec import EXT_CUDA_IPC, Encoded
from tensorshare.wire.messages import Fetch, FetchSpec, Item, Put
from tensorshare.wire.streams import StreamItems
from tests.conftest import wait_until

WAIT = 30.0


def fields(**over: Any) -> dict[str, Any]:
    """A well-formed descriptor with fake handle bytes."""
    f = {"v": 1, "uuid": bytes(range(16)), "boot": ipc.boot_id(), "pid": 4321,
         "ring": b"r" * 16, "gfd": 7, "h": b"\x02c" + b"H" * 64, "ssize": 1 << 20,
         "soff": 0, "ev": b"E" * 64,
         "dtype": "float32", "shape": [4, 8], "stride": [8, 1], "off": 64, "slot": 2,
         "gen": 9}
    f.update(over)
    return f


def encoded(value: Any) -> Encoded:
    return codec.encode(value)


def test_a_descriptor_encodes_validates_and_describes() -> None:
    enc = encoded({"x": IpcTensor(fields()), "y": torch.ones(3), "step": 2})
    assert enc.buffers and len(enc.buffers) == 1  # the descriptor refers to no buffer
    codec.validate(enc.value, 1, raw_sizes=[12])
    text = codec.describe(enc.value)
    assert "x: cuda-ipc float32[4,8] on GPU-00010203" in text and "y: float32[3]" in text
    seen: list[dict[str, Any]] = []
    got = codec.decode(enc, cuda_ipc=lambda f: seen.append(f) or "opened")
    assert got["x"] == "opened" and seen == [fields()] and got["step"] == 2


def test_a_reader_that_cannot_open_it_gets_a_codec_error_saying_why() -> None:
    enc = encoded([IpcTensor(fields())])
    with pytest.raises(CodecError, match=r"float32\[4, 8\].*unix://.*device_ipc=False"):
        codec.decode(enc)


MALFORMED = {
    "a long handle": fields(h=b"H" * 257),
    "an empty handle": fields(h=b""),
    "a short event": fields(ev=b"E" * 63),
    "a str uuid": fields(uuid="0" * 16),
    "a negative offset": fields(off=-1),
    "a float slot": fields(slot=2.0),
    "a bool gen": fields(gen=True),
    "generation 0": fields(gen=0),
    "an unknown dtype": fields(dtype="float8"),
    "strides for another rank": fields(stride=[1]),
    "beyond its storage": fields(ssize=64 * 4 + 4 * 8 * 4 - 1),
    "version 2": fields(v=2),
    "an unknown key": {**fields(), "extra": 1},
    "a missing key": {k: v for k, v in fields().items() if k != "soff"},
    "deep shape": fields(shape=[1] * 65, stride=[1] * 65),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_descriptor_is_refused(case: str) -> None:
    bad = msgpack.packb(msgpack.ExtType(EXT_CUDA_IPC, msgpack.packb(MALFORMED[case])),
                        use_bin_type=True)
    with pytest.raises(CodecError, match="cuda-ipc"):
        codec.validate(bad, 0)
    with pytest.raises(CodecError):
        codec.decode(Encoded(bad), cuda_ipc=lambda f: f)
    assert codec.describe(bad) == "<malformed>"
    with pytest.raises(CodecError, match="cuda-ipc"):  # nor can a producer send one
        codec.encode(IpcTensor(MALFORMED[case]))


def test_an_empty_tensor_and_a_strided_one_fit_their_storage() -> None:
    codec.check_cuda_ipc(fields(shape=[0, 5], stride=[5, 1], off=(1 << 20) // 4))
    codec.check_cuda_ipc(fields(shape=[4, 8], stride=[1, 4], off=0, ssize=32 * 4))
    codec.check_cuda_ipc(fields(shape=[], stride=[], off=0, ssize=4))


def raw_put(client: Any, name: str, value_tree: bytes) -> Any:
    item = Item(Encoded(value_tree), None)
    return client._execute(Command(Put(0, name, item), f"put to bin {name!r}",
                                   lambda r: r.version))


def raw_peek(client: Any, name: str) -> Any:
    return client._execute(Command(Fetch(0, name, FetchSpec(False)), "peek", lambda r: r))


def test_the_server_stores_and_relays_it_untouched_and_refuses_a_malformed_one(
        server: EmbeddedServer) -> None:
    from tensorshare.relay import Relay

    value = {"params": IpcTensor(fields()), "version": 3}
    tree = encoded(value).value
    with Client("127.0.0.1", server.port, timeout=WAIT) as c:
        assert c.put("p", value) == 1
        assert raw_peek(c, "p").items[0].value.value == tree  # byte for byte
        bad = msgpack.packb(msgpack.ExtType(EXT_CUDA_IPC, msgpack.packb(fields(h=b""))),
                            use_bin_type=True)
        with pytest.raises(InvalidRequest, match="malformed value: cuda-ipc"):
            raw_put(c, "bad", bad)
        assert "bad" not in c.list()
        with Relay(f"127.0.0.1:{server.port}", ["p"], poll=0.2) as relay:
            with Client("127.0.0.1", relay.port, timeout=WAIT) as rc:
                wait_until(lambda: "p" in rc.list(), WAIT, "the relay's copy")
                assert raw_peek(rc, "p").items[0].value.value == tree
        with pytest.raises(CodecError, match="unix://"):  # a TCP reader
            c.peek("p")


def test_ls_and_peek_show_it(server: EmbeddedServer,
                             capsys: pytest.CaptureFixture[str]) -> None:
    with Client("127.0.0.1", server.port, timeout=WAIT) as c:
        c.put("gpu-batch", (IpcTensor(fields()), torch.arange(3)))
    assert main(["ls", "--port", str(server.port)]) == 0
    out = capsys.readouterr().out
    assert "cuda-ipc float32[4,8] on GPU-00010203" in out
    assert main(["peek", "gpu-batch", "--port", str(server.port)]) == 0
    out = capsys.readouterr().out
    assert "cuda-ipc float32[4,8] on GPU-00010203 (pid 4321, slot 2, generation 9)" in out


def test_a_unix_reader_without_cuda_is_told_so(tmp_path: Any) -> None:
    sock = str(tmp_path / "s.sock")
    with EmbeddedServer(port=0, unix=sock) as srv, \
            Client(f"unix://{sock}", timeout=WAIT) as c:
        assert srv.port
        c.put("x", IpcTensor(fields()))
        if torch.cuda.is_available():
            pytest.skip("checks a reader without CUDA")
        with pytest.raises(CodecError, match="needs CUDA"):
            c.peek("x")
        with pytest.raises(CodecError, match="another host"):
            c.put("y", IpcTensor(fields(boot=b"\x01" * 16)))
            c.peek("y")


def test_a_stream_with_device_ipc_refuses_tcp_consumers_and_replay(tmp_path: Any) -> None:
    sock = str(tmp_path / "s.sock")
    with EmbeddedServer(port=0, unix=sock) as srv, \
            Client(f"unix://{sock}", timeout=WAIT) as local, \
            Client("127.0.0.1", srv.port, timeout=WAIT) as remote:
        with pytest.raises(ValueError, match="replay"):
            local.stream_open("frames", device_ipc=True, replay="epoch")
        local.stream_open("frames", device_ipc=True)
        local.stream_join("frames", "here")  # same host: fine
        with pytest.raises(InvalidRequest, match=r"device_ipc=True.*unix://.*TCP"):
            remote.stream_join("frames", "there")
        info = local.stats("frames")["bins"]["frames"]["stream"]
        assert info["device_ipc"] is True and list(info["consumers"]) == ["here"]
        # A TCP consumer that joined before the producer said so is refused at its read.
        local.stream_open("other")
        remote.stream_join("other", "early")
        with Client(f"unix://{sock}", timeout=WAIT) as successor:  # (takes producer 0 over)
            successor.stream_open("other", device_ipc=True)
            with pytest.raises(InvalidRequest, match="device_ipc=True"):
                remote.stream_read("other", "early")


def test_a_raw_open_with_device_ipc_and_replay_is_invalid() -> None:
    from tensorshare.wire.messages import Limits
    from tensorshare.wire.streams import _parse_open

    with pytest.raises(Exception, match="device_ipc"):
        _parse_open(1, {"bin": "s", "device_ipc": True, "replay": "epoch"}, b"", Limits())


def item(value: Any) -> Item:
    return Item(encoded(value), None)


def test_a_reused_slot_becomes_lagged_never_wrong_data() -> None:
    """The stream's decoding: an item whose slot was written again before the copy is
    lost with everything before it (``missed``), the rest comes whole, in order."""
    stale = {3}

    def reader(f: dict[str, Any]) -> Any:
        if f["gen"] in stale:
            raise SlotReused("reused", samples=f["shape"][0])
        return torch.full(f["shape"], float(f["gen"]))

    items = tuple(item((IpcTensor(fields(gen=g, shape=[4, 2], stride=[2, 1])), g))
                  for g in (2, 3, 4, 5))
    reply = StreamItems(1, items, 10, 14, 0, 40, None, None, False, 0, False)
    batch = _DecodeBatch(64, reader)(reply)
    assert [v[1] for v in batch.items] == [4, 5]  # gen 2 was fine, but comes before 3
    assert batch.missed == 2 and batch.first == 12 and batch.offset == 48
    assert all(torch.equal(v[0], torch.full((4, 2), float(v[1]))) for v in batch.items)
    assert issubclass(SlotReused, Lagged)


def test_the_consumer_side_checks_of_copy_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU: another host's item, and a producer that is gone."""
    with pytest.raises(CodecError, match="another host"):
        ipc.copy_out(fields(boot=bytes(16) if ipc.boot_id() != bytes(16) else b"\x01" * 16))
    monkeypatch.setattr(ipc, "local_index", lambda uuid: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from tensorshare import ProducerGone

    with pytest.raises(ProducerGone, match="gone"):
        ipc.copy_out(fields(pid=_dead_pid()))


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_the_generation_table_is_read_through_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer's table as a consumer process sees it: the ring's id, then one
    generation per slot, live."""
    ring_id = b"i" * 16
    table = ipc._GenTable(ring_id, 4)
    try:
        f = fields(pid=os.getpid(), gfd=table.fd, ring=ring_id)
        seen = ipc._table_of(f)
        opened = ipc._Opened(None, seen)
        table.set(2, 9)
        assert opened.gen(2) == 9
        table.set(2, 13)  # the producer writes the slot again
        assert opened.gen(2) == 13
        with pytest.raises(CodecError):
            opened.gen(7)
        from tensorshare import ProducerGone

        with pytest.raises(ProducerGone, match="closed"):
            ipc._table_of(fields(pid=os.getpid(), gfd=table.fd, ring=b"x" * 16))
        seen.close()
    finally:
        table.close()


def test_a_ring_where_ipc_cannot_work_falls_back_with_one_message(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(ipc, "why_not", lambda device_type="cuda": "WSL2 (its CUDA has no IPC)")
    monkeypatch.setattr(ipc, "_WARNED", set())
    ring = CudaIpcRing(4)

    class FakeCuda(torch.Tensor):
        is_cuda = True

    x = torch.ones(3).as_subclass(FakeCuda)
    batches = [(x, 1), (x, 2), (x, 3)]
    out = [ring.export(b) for b in batches]
    assert out == batches and all(o[0] is x for o in out)  # as they were: host path
    assert ring.reason == "WSL2 (its CUDA has no IPC)" and ring.fallbacks == 3
    msgs = [r.message for r in caplog.records if "CUDA IPC is not used" in r.message]
    assert len(msgs) == 1 and "WSL2" in msgs[0]
    assert ring.stats()["exported"] == 0


def test_why_not_names_the_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ipc.IPC_ENV, "0")
    assert ipc.why_not() == "TENSORSHARE_CUDA_IPC=0"
    monkeypatch.delenv(ipc.IPC_ENV)
    if not torch.cuda.is_available():
        assert "no CUDA" in (ipc.why_not() or "")
    assert "device" in (ipc.why_not("mps") or "")


def test_ring_arguments() -> None:
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="slots"):
            CudaIpcRing(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slot_bytes"):
        CudaIpcRing(4, slot_bytes=0)
