"""``RLWorker(device=)`` and ``load_parameters_into`` on any machine: the device is checked
before connecting; the parameters go straight into the model's own tensors (no new ones),
only when newer, never partly."""

from __future__ import annotations

import pytest
import torch

from tensorshare import EmbeddedServer, RLTrainer, RLWorker

NO_CUDA = not torch.cuda.is_available()


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Linear(8, 2))


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal of a torch without CUDA")
def test_a_cuda_device_without_cuda_is_refused_before_connecting() -> None:
    with pytest.raises(ValueError, match=r"is_available\(\) is False"):
        RLWorker("127.0.0.1", 1, device="cuda")  # (port 1: it never got that far)


def test_parameters_load_straight_into_the_models_own_tensors(server: EmbeddedServer) -> None:
    trainer = RLTrainer("127.0.0.1", server.port)
    worker = RLWorker("127.0.0.1", server.port, device="cpu")
    try:
        model = net(1)
        assert not worker.load_parameters_into(model)  # nothing published yet
        source = net(2)
        version = trainer.publish_parameters(source.state_dict())
        own = {k: v.data_ptr() for k, v in model.state_dict().items()}
        assert worker.load_parameters_into(model)
        for k, v in model.state_dict().items():
            assert torch.equal(v, source.state_dict()[k]) and v.data_ptr() == own[k]
        assert worker.version == version and worker.downloads == 1
        assert not worker.load_parameters_into(model)  # nothing newer: nothing downloaded
        assert worker.downloads == 1
        got = worker.get_parameters()  # the model's own tensors, not another copy
        assert got["0.weight"].data_ptr() == own["0.weight"]

        trainer.publish_parameters({"0.weight": torch.zeros(8, 4)})  # names that do not fit
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(KeyError, match="missing"):
            worker.load_parameters_into(model)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    finally:
        worker.stop()
        trainer.stop()


def test_get_parameters_with_device_cpu_is_as_before(server: EmbeddedServer) -> None:
    trainer = RLTrainer("127.0.0.1", server.port)
    worker = RLWorker("127.0.0.1", server.port, device="cpu")
    try:
        trainer.publish_parameters({"w": torch.arange(4.0)})
        got = worker.get_parameters()
        assert torch.equal(got["w"], torch.arange(4.0)) and got["w"].device.type == "cpu"
    finally:
        worker.stop()
        trainer.stop()
