"""Every face follows the primary of an address list (README: Replication and failover).

Each test starts a primary (``--min-replicas 1``) and its replica as real ``tensorshare
serve`` processes, connects one face with the address list (the replica first: the face must
find the primary itself), appends in a session, then ``kill -9``s the primary and promotes the
replica. The face's session resumes on the promoted replica: every acknowledged append is
there, none twice, and the server counts the resumed session. Nothing waits on a sleep.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
from twisted.internet import defer
from twisted.internet.epollreactor import EPollReactor
from twisted.python.failure import Failure

from tensorshare import Client, RLTrainer, RLWorker
from tensorshare.aio import AsyncClient
from tensorshare.client.sharded import connect as connect_blocking
from tensorshare.client.twisted import connect as connect_twisted
from tensorshare.errors import ConnectError
from tests.chaos import HOST, ServerProcess
from tests.conftest import wait_until
from tests.system.conftest import fail_over_under

TIMEOUT = 20.0
#: A producer's loop: ``produce(addresses, acked, stop)`` appends ``0, 1, 2, ...`` to bin
#: ``q`` until ``stop`` is set, recording each acknowledged one in ``acked``.
Produce = Callable[[list[str], list[int], threading.Event], None]


def fail_over(procs: Callable[..., ServerProcess], clients: Callable[..., Client],
              produce: Produce, bin: str = "q") -> None:
    """Run ``produce`` against a primary and its replica, kill -9 the primary and promote
    the replica under it; check that its session resumed there with nothing lost or
    doubled."""
    primary = procs("--min-replicas", "1")
    replica = procs("--replica-of", f"{HOST}:{primary.port}")
    admin = clients(replica.port)
    wait_until(lambda: admin.stats()["server"]["replication"]["synced"], TIMEOUT, "in sync")
    resumed = admin.stats()["server"]["counters"].get("sessions_resumed", 0)
    both = [f"{HOST}:{replica.port}", f"{HOST}:{primary.port}"]
    acked: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def run() -> None:
        try:
            produce(both, acked, stop)
        except BaseException as exc:  # reported by fail_over_under
            errors.append(exc)

    face = threading.Thread(target=run, name="tensorshare-test-face")
    fail_over_under([face], [acked], errors, stop, primary, admin, 100)
    items = admin.peek(bin, max_items=None)
    assert len(items) == len(set(items)), "an append applied twice"
    missing = set(acked) - set(items)
    assert not missing, f"{len(missing)} acknowledged appends lost"
    assert admin.stats()["server"]["counters"]["sessions_resumed"] > resumed, \
        "the face's session did not resume on the promoted replica"


def test_the_twisted_client_follows_the_promotion(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    def produce(both: list[str], acked: list[int], stop: threading.Event) -> None:
        reactor = EPollReactor()
        outcome: list[Any] = []

        @defer.inlineCallbacks
        def scenario() -> Any:
            c = yield connect_twisted(reactor, both, timeout=TIMEOUT)
            assert c.primary_choice.current.address.port == int(both[1].rsplit(":", 1)[1])
            i = 0
            while not stop.is_set():
                yield c.append("q", i)
                acked.append(i)
                i += 1
            yield c.close()

        def finish(result: Any) -> None:
            outcome.append(result)
            reactor.stop()

        reactor.callWhenRunning(lambda: scenario().addBoth(finish))
        reactor.run(installSignalHandlers=False)
        if isinstance(outcome[0], Failure):
            outcome[0].raiseException()

    fail_over(procs, clients, produce)


def test_the_asyncio_client_follows_the_promotion(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    def produce(both: list[str], acked: list[int], stop: threading.Event) -> None:
        async def scenario() -> None:
            # One string with commas, the scheme applying to each.
            async with AsyncClient("tensorshare://" + ",".join(both), timeout=TIMEOUT) as c:
                assert c.primary_choice is not None
                assert c.primary_choice.current == c.primary_choice.endpoints[1]
                i = 0
                while not stop.is_set():
                    await c.append("q", i)
                    acked.append(i)
                    i += 1

        asyncio.run(scenario())

    fail_over(procs, clients, produce)


def test_connect_with_an_address_list_follows_the_promotion(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    def produce(both: list[str], acked: list[int], stop: threading.Event) -> None:
        with connect_blocking(both, timeout=TIMEOUT) as c:  # type: ignore[arg-type]
            i = 0
            while not stop.is_set():
                c.append("q", i)
                acked.append(i)
                i += 1

    fail_over(procs, clients, produce)


def test_an_rl_worker_with_an_address_list_follows_the_promotion(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    def produce(both: list[str], acked: list[int], stop: threading.Event) -> None:
        worker = RLWorker(both, timeout=TIMEOUT, watch_stop=False)  # type: ignore[arg-type]
        try:
            i = 0
            while not stop.is_set():
                assert worker.add_data(i) > 0
                acked.append(i)
                i += 1
        finally:
            worker.close()

    fail_over(procs, clients, produce, bin="rl/rollouts")


def test_the_faces_say_why_when_no_server_of_the_list_is_the_primary(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    primary = procs()
    replica = procs("--replica-of", f"{HOST}:{primary.port}")
    r = clients(replica.port)
    wait_until(lambda: r.stats()["server"]["replication"]["synced"], TIMEOUT, "in sync")
    only = [f"{HOST}:{replica.port}"]

    async def aio() -> None:
        await AsyncClient(only, timeout=1, reconnect=False).connect()

    with pytest.raises(ConnectError, match="no primary among .* is a replica"):
        asyncio.run(aio())
    reactor = EPollReactor()
    outcome: list[Any] = []
    reactor.callWhenRunning(lambda: connect_twisted(reactor, only, timeout=1, reconnect=False)
                            .addBoth(lambda r: (outcome.append(r), reactor.stop())))
    reactor.run(installSignalHandlers=False)
    assert isinstance(outcome[0], Failure) and outcome[0].check(ConnectError)
    assert "is a replica" in str(outcome[0].value)


def test_the_wings_and_the_callback_api_reach_the_primary_of_an_address_list(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    """``SharedLoader`` (and ``serve_loader``), ``InferenceClient`` (and ``InferenceHost``),
    ``TensorShare`` and ``RLTrainer`` given the list with the replica first: they work, on the primary
    (stream and service bins live on the primary only, and a replica refuses their ops)."""
    import torch

    from tensorshare import TensorShare
    from tensorshare.data import SharedLoader, serve_loader
    from tensorshare.inference import InferenceClient, InferenceHost

    primary = procs()
    replica = procs("--replica-of", f"{HOST}:{primary.port}")
    r = clients(replica.port)
    wait_until(lambda: r.stats()["server"]["replication"]["synced"], TIMEOUT, "in sync")
    both = [f"{HOST}:{replica.port}", f"{HOST}:{primary.port}"]
    samples = [torch.full((2,), float(i)) for i in range(12)]
    loader = SharedLoader("s", both, batch_size=4, timeout=TIMEOUT)  # type: ignore[arg-type]
    feeder = threading.Thread(target=serve_loader, args=([torch.stack(samples)], "s", both),
                              kwargs={"wait_for": 1, "timeout": TIMEOUT})
    feeder.start()
    got = torch.cat(list(loader))
    feeder.join(TIMEOUT)
    loader.close()
    assert torch.equal(got, torch.stack(samples))
    model = torch.nn.Linear(2, 1)
    with InferenceHost("policy", model, both, timeout=TIMEOUT), \
            InferenceClient("policy", both, timeout=TIMEOUT) as pc:  # type: ignore[arg-type]
        with torch.no_grad():
            assert torch.allclose(pc.predict(samples[3]), model(samples[3][None])[0])
    answers: list[dict[str, Any]] = []
    ts = TensorShare(both, timeout=TIMEOUT)  # type: ignore[arg-type]
    ts.put("via-callbacks", 7, answers.append)
    ts.peek("via-callbacks", lambda a: (answers.append(a), ts.stop()))
    ts.start()
    assert [a["status"] for a in answers] == ["OK", "OK"] and answers[1]["data"] == 7
    wait_until(lambda: "via-callbacks" in r.list(), TIMEOUT, "the put, replicated")
    trainer = RLTrainer(both, timeout=TIMEOUT)  # type: ignore[arg-type]
    try:
        version = trainer.publish_parameters({"w": torch.ones(3)})
    finally:
        trainer.close()
    wait_until(lambda: r.list().get("rl/parameters") == version, TIMEOUT,
               "the trainer's parameters, replicated")


def test_an_inference_client_and_its_host_follow_the_promotion(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    """A service lives on the primary only; with address lists, the host takes again from
    the promoted replica and the caller's calls are answered there, each right."""
    import torch

    from tensorshare.inference import InferenceClient, InferenceHost

    primary = procs()
    replica = procs("--replica-of", f"{HOST}:{primary.port}")
    admin = clients(replica.port)
    wait_until(lambda: admin.stats()["server"]["replication"]["synced"], TIMEOUT, "in sync")
    both = [f"{HOST}:{replica.port}", f"{HOST}:{primary.port}"]
    model = torch.nn.Linear(2, 1)
    answered: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def call() -> None:
        try:
            with InferenceClient("policy", both, timeout=TIMEOUT) as pc:  # type: ignore[arg-type]
                i = 0
                while not stop.is_set():
                    x = torch.full((2,), float(i))
                    with torch.no_grad():
                        assert torch.allclose(pc.predict(x), model(x[None])[0])
                    answered.append(i)
                    i += 1
        except BaseException as exc:  # reported by fail_over_under
            errors.append(exc)

    with InferenceHost("policy", model, both, timeout=TIMEOUT):  # type: ignore[arg-type]
        fail_over_under([threading.Thread(target=call)], [answered], errors, stop, primary,
                        admin, 50)
