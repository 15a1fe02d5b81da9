"""RLTrainer / RLWorker against a real server on 127.0.0.1."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tensorshare import (
    Client,
    ConnectionLost,
    EmbeddedServer,
    RLTrainer,
    RLWorker,
    TensorShare,
)
from tensorshare.rl.api import TrainerStopped
from tests.conftest import wait_until


def _params(scale: float = 1.0) -> dict[str, torch.Tensor]:
    net = torch.nn.Linear(4, 2)
    with torch.no_grad():
        net.weight.fill_(scale)
    return net.state_dict()


def test_versions_live_on_the_server_and_survive_a_trainer_restart(server: EmbeddedServer) -> None:
    with RLTrainer("127.0.0.1", server.port) as trainer:
        assert trainer.publish_parameters(_params(1)) == 1
        assert trainer.publish_parameters(_params(2)) == 2
    # publish_parameters returned only once the server held them: a fresh client sees them.
    with Client("127.0.0.1", server.port) as c:
        assert torch.equal(c.peek("rl/parameters")["weight"], torch.full((2, 4), 2.0))
    with RLTrainer("127.0.0.1", server.port) as restarted:
        assert restarted.publish_parameters(_params(3)) == 3  # continues the count


def test_worker_downloads_each_version_at_most_once(server: EmbeddedServer) -> None:
    with RLTrainer("127.0.0.1", server.port) as trainer, RLWorker("127.0.0.1", server.port) as w:
        assert w.get_parameters() is None  # nothing published yet
        trainer.publish_parameters(_params(1))
        first = w.get_parameters()
        for _ in range(5):
            assert w.get_parameters() is first  # unchanged: nothing downloaded
        assert w.downloads == 1 and w.version == 1
        trainer.publish_parameters(_params(2))
        assert torch.equal(w.get_parameters()["weight"], torch.full((2, 4), 2.0))
        assert w.downloads == 2 and w.version == 2


def test_await_new_parameters_has_no_lost_wakeup(server: EmbeddedServer) -> None:
    with RLTrainer("127.0.0.1", server.port) as trainer, RLWorker("127.0.0.1", server.port) as w:
        trainer.publish_parameters(_params(1))
        w.get_parameters()
        # The publish happens between the worker's last fetch and its wait: the wait must
        # still see it (the server compares versions; no notification can be missed).
        trainer.publish_parameters(_params(2))
        got = w.await_new_parameters(timeout=5)
        assert got is not None and w.version == 2


def test_await_new_parameters_waits_then_returns_none_on_timeout(server: EmbeddedServer) -> None:
    with RLTrainer("127.0.0.1", server.port) as trainer, RLWorker("127.0.0.1", server.port) as w:
        assert w.await_new_parameters(timeout=0.2) is None  # nothing published: None, not stale
        trainer.publish_parameters(_params(1))
        w.get_parameters()
        assert w.await_new_parameters(timeout=0.2) is None  # nothing newer than version 1
        result: list[Any] = []
        t = threading.Thread(target=lambda: result.append(w.await_new_parameters(timeout=None)))
        t.start()
        wait_until(lambda: server.call(lambda: server.factory.store.n_waiters) == 1,
                   what="the worker's wait to reach the server")
        trainer.publish_parameters(_params(5))
        t.join(10)
        assert not t.is_alive()
        assert torch.equal(result[0]["weight"], torch.full((2, 4), 5.0)) and w.version == 2


def test_filter_version_drops_stale_rollouts_on_the_server(server: EmbeddedServer) -> None:
    with RLTrainer("127.0.0.1", server.port) as trainer, RLWorker("127.0.0.1", server.port) as w:
        trainer.publish_parameters(_params(1))
        w.get_parameters()
        for i in range(3):
            w.add_data(torch.tensor([i]))  # made with version 1
        trainer.publish_parameters(_params(2))
        w.get_parameters()
        w.add_data(torch.tensor([10]))  # made with version 2
        data = trainer.get_data(return_versions=True)
        assert [(int(x), v) for x, v in data] == [(10, 2)]
        assert trainer.last_dropped == 3 and trainer.dropped == 3
        with Client("127.0.0.1", server.port) as c:
            assert c.list() == {"rl/parameters": 1}  # the stale ones are gone, not shipped


def test_a_version_from_predict_tags_a_rollout_for_the_staleness_filter(
        server: EmbeddedServer) -> None:
    # A worker acting through an InferenceHost tags each rollout with the version predict()
    # returned, not with its own: the server's staleness filter then drops a rollout made
    # with parameters that are too old and keeps a fresh one.
    from tensorshare.inference import InferenceClient, InferenceHost

    with RLTrainer("127.0.0.1", server.port) as trainer, \
            RLWorker("127.0.0.1", server.port) as w, \
            InferenceHost("policy", torch.nn.Linear(4, 2), "127.0.0.1", server.port,
                          params_bin="rl/parameters", max_wait_ms=0), \
            InferenceClient("policy", "127.0.0.1", server.port) as pc:
        trainer.publish_parameters(_params(1))
        _, old = pc.predict(torch.zeros(4), return_version=True)
        assert old == 1
        new = _params(2)
        trainer.publish_parameters(new)
        wait_until(lambda: pc.predict(torch.zeros(4), return_version=True)[1] == 2,
                   what="the host to load version 2")
        out, fresh = pc.predict(torch.ones(4), return_version=True)
        assert fresh == 2 and torch.allclose(out, 8.0 + new["bias"])  # computed with them
        w.get_parameters()
        assert w.version == 2  # untagged, the stale rollout would pass as version 2
        w.add_data(torch.tensor([1]), version=old)
        w.add_data(torch.tensor([2]), version=fresh)
        data = trainer.get_data(return_versions=True)
        assert [(int(x), v) for x, v in data] == [(2, 2)]
        assert trainer.last_dropped == 1


def test_no_filter_and_max_version_lag(server: EmbeddedServer) -> None:
    with RLTrainer("127.0.0.1", server.port, filter_version=False) as t0, \
            RLWorker("127.0.0.1", server.port) as w:
        for v in range(1, 4):
            t0.publish_parameters(_params(v))
            w.get_parameters()
            w.add_data(torch.tensor([v]))
        assert [int(x) for x in t0.get_data()] == [1, 2, 3]
        for v in range(1, 4):
            w.add_data(torch.tensor([v]))  # all tagged with version 3 now
        with RLTrainer("127.0.0.1", server.port, max_version_lag=1) as lagged:
            lagged.publish_parameters(_params(4))  # version 4: keeps versions 3 and 4
            w.get_parameters()
            w.add_data(torch.tensor([4]))
            assert [(int(x), v) for x, v in lagged.get_data(return_versions=True)] == \
                [(1, 3), (2, 3), (3, 3), (4, 4)]


def test_get_data_waits_for_min_items_and_returns_what_arrived(server: EmbeddedServer) -> None:
    with RLTrainer("127.0.0.1", server.port) as trainer, RLWorker("127.0.0.1", server.port) as w:
        trainer.publish_parameters(_params(1))
        w.get_parameters()
        assert trainer.get_data() == []  # nothing yet: at once, empty
        w.add_data(torch.tensor([1]))
        # Fewer than min_items arrive within the timeout: what did arrive is returned.
        assert [int(x) for x in trainer.get_data(timeout=0.3, min_items=2)] == [1]
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.extend(trainer.get_data(timeout=10, min_items=3)))
        t.start()
        for i in range(3):
            w.add_data(torch.tensor([i]))
        t.join(15)
        assert not t.is_alive() and [int(x) for x in got] == [0, 1, 2]


def test_parameters_of_every_kind_are_bit_exact(server: EmbeddedServer) -> None:
    base = torch.randn(6, 8)
    state = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "noncontig": base.t()[::2],
        "half": torch.randn(7).half(),
        "int": torch.arange(10),
        "scalar": torch.tensor(3.5),
    }
    with RLTrainer("127.0.0.1", server.port) as trainer, RLWorker("127.0.0.1", server.port) as w:
        trainer.publish_parameters(state)
        got = w.get_parameters()
    for k, v in state.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert torch.equal(got[k], v), k


def test_hosting_trainer_stops_and_workers_get_a_clear_error() -> None:
    # Clients reconnect, so a vanished server alone would leave the worker waiting: the
    # hosting trainer signals the end of the run before it stops its server.
    trainer = RLTrainer("127.0.0.1", 0, host_server=True)
    worker = RLWorker("127.0.0.1", trainer.port)
    trainer.publish_parameters(_params(1))
    assert worker.get_parameters() is not None
    errors: list[BaseException] = []

    def wait_forever() -> None:
        try:
            worker.await_new_parameters(timeout=None)
        except BaseException as exc:  # recorded and checked below
            errors.append(exc)

    t = threading.Thread(target=wait_forever)
    t.start()
    trainer.stop()
    t.join(10)
    assert not t.is_alive(), "a worker waiting for parameters hung after the trainer stopped"
    assert isinstance(errors[0], TrainerStopped) and isinstance(errors[0], ConnectionLost)
    assert worker.trainer_stopped
    with pytest.raises(ConnectionLost):
        worker.add_data(torch.ones(1))
    worker.stop()


def _wait_in_thread(worker: RLWorker, errors: list[BaseException]) -> threading.Thread:
    def wait_forever() -> None:
        try:
            worker.await_new_parameters(timeout=None)
        except BaseException as exc:  # recorded and checked by the caller
            errors.append(exc)

    t = threading.Thread(target=wait_forever)
    t.start()
    return t


def test_signal_stop_ends_every_worker_while_the_server_stays_up(server: EmbeddedServer) -> None:
    with RLTrainer("127.0.0.1", server.port) as trainer, \
            RLWorker("127.0.0.1", server.port) as w1, RLWorker("127.0.0.1", server.port) as w2:
        trainer.publish_parameters(_params(1))
        w1.get_parameters()
        w2.get_parameters()
        errors: list[BaseException] = []
        t = _wait_in_thread(w1, errors)
        wait_until(lambda: server.call(lambda: server.factory.store.n_waiters) == 1,
                   what="the worker's wait to reach the server")
        trainer.signal_stop()
        t.join(10)
        assert not t.is_alive() and isinstance(errors[0], TrainerStopped)
        # The other worker was not waiting: it hears of it on its next call.
        wait_until(lambda: w2.trainer_stopped, what="the second worker to hear the signal")
        with pytest.raises(TrainerStopped):
            w2.add_data(torch.ones(1))
        with pytest.raises(TrainerStopped):
            w2.get_parameters()
        # The server and the trainer carry on: the stop bin holds the last version.
        assert trainer.client.peek(trainer.stop_bin) == 1
        assert trainer.publish_parameters(_params(2)) == 2


def test_a_trainer_that_does_not_host_leaves_workers_running_when_it_stops(
        server: EmbeddedServer) -> None:
    with RLWorker("127.0.0.1", server.port) as w:
        with RLTrainer("127.0.0.1", server.port) as trainer:
            trainer.publish_parameters(_params(1))
        assert w.get_parameters() is not None and not w.trainer_stopped
        with RLTrainer("127.0.0.1", server.port) as restarted:
            restarted.publish_parameters(_params(2))  # a restarted trainer: same run
        assert w.await_new_parameters(timeout=5) is not None and w.version == 2


def test_a_worker_can_ignore_the_stop_signal(server: EmbeddedServer) -> None:
    with RLTrainer("127.0.0.1", server.port) as trainer, \
            RLWorker("127.0.0.1", server.port, watch_stop=False) as w:
        trainer.publish_parameters(_params(1))
        trainer.signal_stop()
        assert w.get_parameters() is not None and not w.trainer_stopped
        w.add_data(torch.ones(1))


def test_start_blocks_until_stop_from_another_thread(server: EmbeddedServer) -> None:
    w = RLWorker("127.0.0.1", server.port)
    t = threading.Thread(target=w.start)
    t.start()
    assert t.is_alive()
    w.stop()
    t.join(10)
    assert not t.is_alive()


def test_a_seed_style_worker_loop_and_a_tensorshare_client_ride_out_a_server_restart() -> None:
    """The server dies and comes back on the same port without its data: the worker's loop
    (written as in the seed) and a callback client carry on by themselves."""
    srv = EmbeddedServer(port=0)
    port = srv.port
    stop = threading.Event()
    errors: list[BaseException] = []
    replies: queue.Queue[dict[str, Any]] = queue.Queue()
    trainer = RLTrainer("127.0.0.1", port, timeout=20.0)
    worker = RLWorker("127.0.0.1", port, timeout=20.0)
    ts = TensorShare("127.0.0.1", port, timeout=20.0)
    callbacks = threading.Thread(target=ts.start, daemon=True)
    callbacks.start()

    def generate_rollouts() -> None:  # the seed's worker loop
        try:
            params = worker.get_parameters()
            if params is None:
                params = worker.await_new_parameters(timeout=None)
            while not stop.is_set():
                worker.add_data(params["weight"][0, :1].clone())  # says which params made it
                params = worker.get_parameters()
                stop.wait(0.005)
        except BaseException as exc:  # checked below
            errors.append(exc)

    def rollouts_made_with(scale: float, tag: int) -> Callable[[], bool]:
        def check() -> bool:
            got = trainer.get_data(return_versions=True)
            return any(float(x[0]) == scale and v == tag for x, v in got)
        return check

    loop = threading.Thread(target=generate_rollouts)
    try:
        trainer.publish_parameters(_params(1))
        assert trainer.publish_parameters(_params(2)) == 2
        loop.start()
        wait_until(rollouts_made_with(2.0, 2), what="rollouts from the first server")
        ts.put("ts/x", torch.ones(2), replies.put)
        assert replies.get(timeout=10)["status"] == "OK"

        srv.stop()
        srv = EmbeddedServer(port=port)  # same port, no data: versions start again

        # The trainer's publish waits for its reconnect; the new server numbers it 1.
        assert trainer.publish_parameters(_params(7)) == 1
        wait_until(rollouts_made_with(7.0, 1), timeout=20.0,
                   what="rollouts made with the new server's parameters, tagged 1")
        assert worker.version == 1 and not errors and loop.is_alive()
        ts.put("ts/x", torch.full((2,), 3.0), replies.put)
        ts.peek("ts/x", replies.put)
        assert replies.get(timeout=20)["status"] == "OK"
        peeked = replies.get(timeout=10)
        assert peeked["status"] == "OK" and torch.equal(peeked["data"], torch.full((2,), 3.0))
    finally:
        stop.set()
        if loop.ident is not None:
            loop.join(20)
        ts.stop(timeout=10)
        callbacks.join(10)
        worker.stop()
        trainer.stop()
        srv.stop()
    assert not errors, errors
    assert not loop.is_alive()


def test_a_trainer_that_hosts_its_server_gives_it_its_token() -> None:
    from tensorshare import AuthenticationError

    trainer = RLTrainer("127.0.0.1", 0, host_server=True, token="rl-token", timeout=10)
    try:
        trainer.publish_parameters({"w": torch.ones(2)})
        with RLWorker("127.0.0.1", trainer.port, token="rl-token", timeout=10) as worker:
            assert torch.equal(worker.get_parameters()["w"], torch.ones(2))
        with pytest.raises(AuthenticationError):
            RLWorker("127.0.0.1", trainer.port, timeout=10)
    finally:
        trainer.stop()


def test_a_trainer_that_hosts_its_server_gives_it_the_token_of_its_options() -> None:
    from tensorshare import AuthenticationError, ClientOptions

    opts = ClientOptions(token="rl-options-token", timeout=10)
    trainer = RLTrainer("127.0.0.1", 0, host_server=True, options=opts)
    try:
        trainer.publish_parameters({"w": torch.ones(2)})
        with RLWorker("127.0.0.1", trainer.port, options=opts) as worker:
            assert torch.equal(worker.get_parameters()["w"], torch.ones(2))
        with pytest.raises(AuthenticationError):
            RLWorker("127.0.0.1", trainer.port, timeout=10)
    finally:
        trainer.stop()


def test_a_trainer_that_hosts_its_server_beyond_loopback_takes_insecure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the protected-mode refusal recommends (insecure=True) is what RLTrainer takes;
    without host_server it is refused: a client needs a token, never insecure."""
    monkeypatch.delenv("TENSORSHARE_TOKEN", raising=False)
    monkeypatch.delenv("TENSORSHARE_TOKEN_FILE", raising=False)
    with pytest.raises(ValueError, match="insecure=True"):
        RLTrainer("0.0.0.0", 0, host_server=True, timeout=10)
    with pytest.raises(ValueError, match="host_server=True"):
        RLTrainer("127.0.0.1", 0, insecure=True, timeout=10)
    trainer = RLTrainer("0.0.0.0", 0, host_server=True, insecure=True, timeout=10)
    try:
        trainer.publish_parameters({"w": torch.ones(2)})
        with RLWorker("127.0.0.1", trainer.port, timeout=10) as worker:
            assert torch.equal(worker.get_parameters()["w"], torch.ones(2))
    finally:
        trainer.stop()


def test_a_trainer_hosts_its_server_where_a_url_says() -> None:
    trainer = RLTrainer("tensorshare://127.0.0.1:0", host_server=True, timeout=10)
    try:
        assert trainer.port > 0
        trainer.publish_parameters({"w": torch.zeros(3)})
        with RLWorker(f"tensorshare://127.0.0.1:{trainer.port}", timeout=10) as worker:
            assert torch.equal(worker.get_parameters()["w"], torch.zeros(3))
    finally:
        trainer.stop()
    with pytest.raises(ValueError, match="listens on TCP"):
        RLTrainer("unix:///tmp/no.sock", host_server=True, timeout=10)


def test_trainer_and_worker_take_the_keywords_client_options_types() -> None:
    from tensorshare import ClientOptions

    with EmbeddedServer(port=0) as srv:
        with RLWorker("127.0.0.1", srv.port, options=ClientOptions(timeout=3.0),
                      compress="lz4", watch_stop=False) as worker:
            assert worker.client.options.timeout == 3.0  # (no timeout given: the options')
            assert worker.client.options.compress == "lz4"
        bogus: dict[str, Any] = {"tokn": "x"}
        with pytest.raises(TypeError, match="tokn"):
            RLWorker("127.0.0.1", srv.port, timeout=10, **bogus)
