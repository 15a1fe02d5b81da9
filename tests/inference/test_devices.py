"""Inference on devices, on any machine: ``InferenceHost(devices=[...])`` runs one copy of
the model per device (two CPU "devices" here), spreads the calls over them and loads every
new parameter version into each; ``InferenceClient(device=)`` and the devices are checked
before anything is sent."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from tensorshare import Client, EmbeddedServer
from tensorshare.inference import InferenceClient, InferenceHost
from tests.conftest import wait_until

DEADLINE = 30.0
NO_CUDA = not torch.cuda.is_available()


class Scaled(torch.nn.Module):
    """``x * scale``, and which replica answered (``who``)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.register_buffer("who", torch.zeros(1), persistent=False)
        self.slow = threading.Event()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.slow.wait(0.002)  # (a model that takes a moment: the other replica takes too)
        return x * self.scale, self.who.expand(x.shape[0])

    def __deepcopy__(self, memo: dict[int, Any]) -> Scaled:
        twin = Scaled()
        twin.load_state_dict(self.state_dict())
        return twin


def test_one_replica_per_device_shares_the_calls_and_loads_every_version(
        server: EmbeddedServer) -> None:
    with InferenceHost("m", Scaled(), "127.0.0.1", server.port, devices=["cpu", "cpu"],
                       params_bin="params", max_batch=4, max_wait_ms=1) as host, \
            InferenceClient("m", "127.0.0.1", server.port, timeout=DEADLINE) as client, \
            Client("127.0.0.1", server.port) as trainer:
        assert len(host.replicas) == 2
        assert host.replicas[0].model is not host.replicas[1].model
        for i, r in enumerate(host.replicas):
            r.model.who.fill_(i)

        def answers(scale: float) -> set[int]:
            futures = [client.predict_async(torch.full((3,), float(k))) for k in range(200)]
            who = set()
            for k, f in enumerate(futures):
                out, replica = f.result(DEADLINE)
                assert torch.equal(out, torch.full((3,), k * scale))
                who.add(int(replica))
            return who

        assert answers(1.0) == {0, 1}  # both replicas took calls
        state = {k: v.clone() for k, v in Scaled().state_dict().items()}
        state["scale"] = torch.full((1,), 3.0)
        version = trainer.put("params", state)
        wait_until(lambda: all(r._newest >= version for r in host.replicas), DEADLINE,
                   "both replicas told of the new version")
        who = answers(3.0)  # every answer from the new weights, whichever replica
        assert who == {0, 1}
        assert all(r.version == version for r in host.replicas)
        assert host.calls == 400 and host.batches >= 2 * 400 // 4 // 2
    assert host.rows == 400


def test_devices_arguments_are_checked(server: EmbeddedServer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        InferenceHost("m", Scaled(), "127.0.0.1", server.port, devices=[])
    with pytest.raises(ValueError, match="not both"):
        InferenceHost("m", Scaled(), "127.0.0.1", server.port, devices=["cpu"], device="cpu")
    with pytest.raises(TypeError, match="nn.Module"):
        InferenceHost("m", lambda x: x, "127.0.0.1", server.port, devices=["cpu"])
    if NO_CUDA:
        with pytest.raises(ValueError, match=r"is_available\(\) is False"):
            InferenceHost("m", Scaled(), "127.0.0.1", server.port,
                          devices=["cuda:0", "cuda:1"])
        with pytest.raises(ValueError, match=r"is_available\(\) is False"):
            InferenceClient("m", "127.0.0.1", server.port, device="cuda")


def test_a_client_with_device_cpu_gets_cpu_outputs(server: EmbeddedServer) -> None:
    with InferenceHost("m", Scaled(), "127.0.0.1", server.port, max_wait_ms=1), \
            InferenceClient("m", "127.0.0.1", server.port, device="cpu",
                            timeout=DEADLINE) as client:
        out, who = client.predict(torch.ones(2))
        assert out.device.type == "cpu" and torch.equal(out, torch.ones(2))
