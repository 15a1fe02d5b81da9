"""TensorShare, the seed's callback API, against a real server on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
import torch

from tensorshare import ConnectError, EmbeddedServer, TensorShare
from tests.conftest import wait_until

# The client example of the seed README, verbatim but for the port (PORT is replaced).
SEED_CLIENT_EXAMPLE = textwrap.dedent('''
    from tensorshare import TensorShare
    from threading import Thread
    import torch


    def do_something(ts):
        ts.put('data_bin', dict(a=torch.randn(2, 2), version=0))  # Not blocking
        ts.peek('data_bin', lambda x: print('peek data_bin', x))  # Get data in the bin and it

        # Alternatively specify a callback
        def cb_get_data(response):
            ts.get('xyz', lambda x: print('get xyz', x))  # This is called as soon as the server responds
        ts.put('xyz', dict(a=torch.randn(2, 2), version=0), callback=cb_get_data)

        # Listening to data bins
        def cb_bin_updated(msg):
            if 'bin' in msg.keys():
                print('Bin', msg['bin'], 'updated. Num items: ', msg['n_items'])
        ts.listen('xyz', cb_bin_updated)    # Listen to changes in bin xyz, calling cb_bin_updated whenever it happens
        ts.append('xyz', torch.randn(2, 2))    # Appending will not overwrite data in the bin, but append to it, creating a list
        ts.append('xyz', torch.randn(2, 2))
        ts.get('xyz', lambda x: print('get xyz', x))   # Get removes data in the bin, which will also emit a notification.
        ts.put('xyz', torch.randn(2, 2))

        def cb_print_and_exit(resp):
            print(resp)
            ts.stop()
        ts.list(cb_print_and_exit)  # List the number of items in all bins


    tmp = TensorShare('localhost', 8000)
    Thread(target=do_something, args=(tmp, ), daemon=True).start()
    tmp.start() # This is blocking and must be started in the main thread.
''')


def _run_seed(port: int) -> list[str]:
    code = SEED_CLIENT_EXAMPLE.replace("TensorShare('localhost', 8000)",
                                       f"TensorShare('localhost', {port})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_seed_client_example_runs_unchanged(server: EmbeddedServer) -> None:
    lines = _run_seed(server.port)
    text = "\n".join(lines)
    assert lines[0].startswith("peek data_bin {'status': 'OK', 'data': {'a': tensor(")
    assert "'version': 0}}" in text
    # list came after: put data_bin, put xyz, 2 appends, get (takes all 3), put xyz again.
    assert "{'status': 'OK', 'data': {'data_bin': 1, 'xyz': 1}}" in lines
    gets = [ln for ln in lines if ln.startswith("get xyz {'status': 'OK'")]
    assert len(gets) == 2  # the get in the body and the one from cb_get_data
    updates = [ln for ln in lines if ln.startswith("Bin xyz updated. Num items:")]
    # listen was registered after the first put: append, append, get, put, get.
    assert [u.split()[-1] for u in updates] == ["2", "3", "0", "1", "0"]


def test_seed_client_example_from_several_processes_at_once(server: EmbeddedServer) -> None:
    results: list[list[str]] = []
    threads = [threading.Thread(target=lambda: results.append(_run_seed(server.port)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert len(results) == 3
    for lines in results:
        assert any(ln.startswith("peek data_bin {'status': 'OK'") for ln in lines)
        assert any(ln.startswith("{'status': 'OK', 'data': {") for ln in lines)


def _start_in_thread(ts: TensorShare) -> threading.Thread:
    t = threading.Thread(target=ts.start, daemon=True)
    t.start()
    return t


def test_callbacks_run_in_request_order_on_the_start_thread(server: EmbeddedServer) -> None:
    ts = TensorShare("127.0.0.1", server.port)
    seen: list[tuple[str, Any]] = []
    threads: set[int] = set()

    def cb(tag: str) -> Any:
        def f(resp: dict[str, Any]) -> None:
            threads.add(threading.get_ident())
            seen.append((tag, resp["status"]))
        return f

    # Requests made before start() are queued and sent once it runs.
    for i in range(50):
        ts.put(f"b{i}", torch.full((3,), float(i)), cb(f"put{i}"))
        ts.peek(f"b{i}", cb(f"peek{i}"))
    ts.list(lambda r: (seen.append(("list", r["data"])), ts.stop()))
    runner = threading.Thread(target=ts.start)
    runner.start()
    runner.join(30)
    assert not runner.is_alive()
    expected = [t for i in range(50) for t in (f"put{i}", f"peek{i}")] + ["list"]
    assert [tag for tag, _ in seen] == expected
    assert all(status == "OK" for tag, status in seen[:-1])
    assert seen[-1][1] == {f"b{i}": 1 for i in range(50)}
    assert threads == {runner.ident}


def test_results_and_errors_are_dicts_with_plain_messages(server: EmbeddedServer) -> None:
    ts = TensorShare("127.0.0.1", server.port)
    out: dict[str, Any] = {}
    ts.get("xyz", lambda r: out.__setitem__("get", r))
    ts.peek("xyz", lambda r: out.__setitem__("peek", r))
    ts.put("xyz", torch.arange(4), lambda r: out.__setitem__("put", r))
    ts.append("xyz", torch.arange(2), lambda r: out.__setitem__("append", r))
    ts.peek("xyz", lambda r: out.__setitem__("peek2", r))
    ts.delete("xyz", lambda r: out.__setitem__("delete", r))
    ts.delete("xyz", lambda r: out.__setitem__("delete2", r))
    ts.list(lambda r: (out.__setitem__("list", r), ts.stop()))
    ts.start()
    assert out["get"]["status"] == "ERR" and "bin 'xyz' does not exist" in out["get"]["msg"]
    assert out["peek"]["status"] == "ERR" and "bin 'xyz' does not exist" in out["peek"]["msg"]
    assert out["put"] == {"status": "OK", "data": 1}
    assert out["append"] == {"status": "OK", "data": 2}
    peek2 = out["peek2"]["data"]
    assert isinstance(peek2, list) and torch.equal(peek2[0], torch.arange(4))
    assert torch.equal(peek2[1], torch.arange(2))
    assert out["delete"] == {"status": "OK", "data": True}
    assert out["delete2"] == {"status": "OK", "data": False}
    assert out["list"] == {"status": "OK", "data": {}}


@pytest.mark.parametrize("name", ["a|b", "with space", "π/ü/日本", " | / "])
def test_bin_names_that_broke_the_old_design(server: EmbeddedServer, name: str) -> None:
    ts = TensorShare("127.0.0.1", server.port)
    out: dict[str, Any] = {}
    events: list[dict[str, Any]] = []
    ts.listen(name, events.append)
    ts.put(name, {"t": torch.ones(2)})
    ts.peek(name, lambda r: out.__setitem__("peek", r))
    ts.list(lambda r: out.__setitem__("list", r))
    ts.get(name, lambda r: (out.__setitem__("get", r), ts.stop()))
    ts.start()
    assert torch.equal(out["peek"]["data"]["t"], torch.ones(2))
    assert out["list"]["data"] == {name: 1}
    assert out["get"]["status"] == "OK"
    assert [e["bin"] for e in events] == [name, name] and [e["op"] for e in events] == ["put", "get"]


def test_listen_events_arrive_in_order_with_versions(server: EmbeddedServer) -> None:
    ts = TensorShare("127.0.0.1", server.port)
    events: list[dict[str, Any]] = []
    done = threading.Event()
    t = _start_in_thread(ts)
    ts.listen("q", events.append)
    for i in range(20):
        ts.append("q", torch.tensor([i]))
    ts.get("q", lambda r: done.set())
    wait_until(lambda: len(events) == 21, what="21 events")
    assert done.is_set()
    assert [e["n_items"] for e in events] == list(range(1, 21)) + [0]
    versions = [e["version"] for e in events]
    assert versions == sorted(versions) and len(set(versions)) == 21
    assert all(e["status"] == "OK" and e["bin"] == "q" for e in events)
    ts.ignore("q", lambda r: None)
    ts.stop(timeout=10)
    t.join(10)
    assert not t.is_alive()


def test_server_down_at_start_raises_quickly(free_port: int) -> None:
    ts = TensorShare("127.0.0.1", free_port, timeout=1)
    ts.put("x", 1)
    with pytest.raises(ConnectError, match=f"127.0.0.1:{free_port}"):
        ts.start()


def test_without_reconnect_a_killed_server_gives_err_callbacks() -> None:
    srv = EmbeddedServer(port=0)
    ts = TensorShare("127.0.0.1", srv.port, reconnect=False)
    t = _start_in_thread(ts)
    first = threading.Event()
    ts.put("a", 1, lambda r: first.set())
    assert first.wait(10)
    waiting: list[dict[str, Any]] = []
    got = threading.Event()
    # A get that waits on the server would hang forever in the old design; here the
    # connection loss turns it into an ERR callback.
    ts._request(lambda c: c.begin_fetch("never", remove=True, timeout=None),  # noqa: SLF001
                lambda r: (waiting.append(r), got.set()))
    wait_until(lambda: srv.call(lambda: srv.factory.store.n_waiters) == 1, what="the waiter")
    srv.stop()
    assert got.wait(10)
    assert waiting[0]["status"] == "ERR" and "lost" in waiting[0]["msg"]
    after: list[dict[str, Any]] = []
    ts.peek("a", after.append)  # a request after the loss: ERR, never silence
    ts.stop(timeout=10)
    t.join(10)
    assert not t.is_alive()
    assert after and after[0]["status"] == "ERR"


def test_two_tensorshare_objects_in_one_process(server: EmbeddedServer) -> None:
    a, b = TensorShare("127.0.0.1", server.port), TensorShare("127.0.0.1", server.port)
    ta, tb = _start_in_thread(a), _start_in_thread(b)
    got = threading.Event()
    events: list[dict[str, Any]] = []
    b.listen("shared", lambda e: (events.append(e), got.set()))
    b.list(lambda r: a.put("shared", torch.zeros(2)))  # after b's listen is registered
    assert got.wait(10)
    assert events[0]["op"] == "put"
    a.stop(timeout=10)
    b.stop(timeout=10)
    ta.join(10)
    tb.join(10)
    assert not ta.is_alive() and not tb.is_alive()
    # ... and one after another in the same process.
    c = TensorShare("127.0.0.1", server.port)
    out: list[Any] = []
    c.get("shared", lambda r: (out.append(r), c.stop()))
    c.start()
    assert torch.equal(out[0]["data"], torch.zeros(2))


def test_stop_delivers_every_request_already_made(server: EmbeddedServer) -> None:
    ts = TensorShare("127.0.0.1", server.port)
    t = _start_in_thread(ts)
    delivered: list[int] = []
    for i in range(200):
        ts.append("many", torch.tensor([i]), lambda r, i=i: delivered.append(i))
    ts.stop(timeout=30)  # from another thread: waits until start() has returned
    assert not t.is_alive() or t.join(10) is None
    assert delivered == list(range(200))
    with pytest.raises(RuntimeError, match="stop"):
        ts.put("late", 1)


def test_unsupported_value_raises_at_the_call(server: EmbeddedServer) -> None:
    ts = TensorShare("127.0.0.1", server.port)
    t = _start_in_thread(ts)
    wait_until(lambda: ts._client is not None, what="connection")  # noqa: SLF001
    with pytest.raises(TypeError, match=r"value\['a'\]"):
        ts.put("x", {"a": {1, 2}})
    ts.stop(timeout=10)
    t.join(10)
