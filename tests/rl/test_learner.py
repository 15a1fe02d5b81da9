"""The learner and actors without a server: V-trace, importance weights, segments."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from tensorshare.rl.envs import BUILTIN_CARTPOLE, MAX_STEPS, CartPole, env_spec
from tensorshare.rl.learner import GAMMA, ActorCritic, Collector, Learner, NumpyActor, vtrace

torch.set_num_threads(1)


def _reference_vtrace(values: list[list[float]], rewards: list[list[float]],
                      dones: list[list[float]], rhos: list[list[float]], gamma: float,
                      lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Espeholt et al. (2018), eq. 1, written as the sum it is (no recursion)."""
    v, r, d, rho = (np.array(x, dtype=np.float64) for x in (values, rewards, dones, rhos))
    steps, width = r.shape
    vs = np.zeros((steps, width))
    for b in range(width):
        for s in range(steps):
            total, c_prod, disc = 0.0, 1.0, 1.0
            for t in range(s, steps):
                delta = min(1.0, rho[t, b]) * (r[t, b] + gamma * (1 - d[t, b]) * v[t + 1, b]
                                               - v[t, b])
                total += disc * c_prod * delta
                disc *= gamma * (1 - d[t, b])
                c_prod *= lam * min(1.0, rho[t, b])
            vs[s, b] = v[s, b] + total
    nxt = np.concatenate([vs[1:], v[-1:]])
    return vs, r + gamma * (1 - d) * nxt - v[:-1]


def test_vtrace_matches_the_paper_formula() -> None:
    g = torch.Generator().manual_seed(0)
    values = torch.randn(7, 3, generator=g, dtype=torch.float64)
    rewards = torch.randn(6, 3, generator=g, dtype=torch.float64)
    dones = (torch.rand(6, 3, generator=g) < 0.3).double()
    rhos = torch.rand(6, 3, generator=g, dtype=torch.float64) * 2  # some above the clip of 1
    vs, adv = vtrace(values, rewards, dones, rhos, gamma=0.9, lam=0.8)
    ref_vs, ref_adv = _reference_vtrace(values.tolist(), rewards.tolist(), dones.tolist(),
                                        rhos.tolist(), 0.9, 0.8)
    np.testing.assert_allclose(vs.numpy(), ref_vs, rtol=1e-10)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-10)


def test_vtrace_on_policy_is_the_discounted_return_and_stops_at_episode_ends() -> None:
    # rho = 1 and lambda = 1: the targets are the discounted returns, bootstrapped from the
    # last value and cut where an episode ended.
    rewards = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    dones = torch.tensor([[0.0], [1.0], [0.0], [0.0]])
    values = torch.tensor([[0.5], [0.5], [0.5], [0.5], [10.0]])
    vs, _ = vtrace(values, rewards, dones, torch.ones(4, 1), gamma=0.5, lam=1.0)
    assert vs[:, 0].tolist() == pytest.approx([1 + 0.5 * 2, 2, 3 + 0.5 * 4 + 0.25 * 10,
                                               4 + 0.5 * 10])


def test_the_numpy_actor_computes_what_the_torch_network_does() -> None:
    torch.manual_seed(1)
    net = ActorCritic(6, 3)
    actor = NumpyActor(net.state_dict())
    obs = torch.randn(32, 6)
    logits, values = net(obs)
    rng = np.random.default_rng(0)
    actions, chosen = actor.act(obs.numpy(), rng)
    expected = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(actions)[:, None])[:, 0]
    np.testing.assert_allclose(chosen, expected.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(actor.value(obs.numpy()), values.detach().numpy(), atol=1e-5)
    assert actor.checksum == pytest.approx(sum(float(t.sum()) for t in net.state_dict().values()))


def test_actions_follow_the_policy() -> None:
    net = ActorCritic(4, 2)
    with torch.no_grad():  # push right with probability sigmoid(2) = 0.88 everywhere
        net.pi[-1].weight.zero_()
        net.pi[-1].bias.copy_(torch.tensor([-1.0, 1.0]))
    actions, log_probs = NumpyActor(net.state_dict()).act(np.zeros((4000, 4), np.float32),
                                                         np.random.default_rng(0))
    p_right = 1 / (1 + math.exp(-2))
    assert abs(actions.mean() - p_right) < 0.03
    assert np.allclose(log_probs[actions == 1], math.log(p_right), atol=1e-5)


def test_segments_carry_what_the_learner_needs() -> None:
    spec = env_spec(BUILTIN_CARTPOLE)
    net = ActorCritic(spec.observation_size, spec.n_actions)
    actor = NumpyActor(net.state_dict())
    collector = Collector(spec, n_envs=3, seed=0)
    seg = collector.collect(actor, steps=50)
    assert seg["obs"].shape == (51, 3, 4) and seg["obs"].dtype == torch.float32
    assert seg["actions"].shape == seg["log_probs"].shape == seg["rewards"].shape == (50, 3)
    assert seg["params_checksum"] == actor.checksum
    # Episodes run on across segments: the next segment starts where this one stopped.
    nxt = collector.collect(actor, steps=50)
    assert torch.equal(nxt["obs"][0], seg["obs"][-1])
    # Every finished episode is one done, and its return is its length (reward 1 per step).
    both = torch.cat([seg["dones"], nxt["dones"]])
    finished = torch.cat([seg["episode_returns"], nxt["episode_returns"]])
    assert int(both.sum()) == len(finished) > 0
    assert torch.equal(finished, torch.cat([seg["episode_lengths"],
                                            nxt["episode_lengths"]]).float())


def test_a_truncated_episode_bootstraps_from_its_last_state() -> None:
    spec = env_spec(BUILTIN_CARTPOLE)
    net = ActorCritic(spec.observation_size, spec.n_actions)
    with torch.no_grad():
        net.v[-1].bias.fill_(7.0)
        net.v[-1].weight.zero_()  # V = 7 everywhere
    collector = Collector(spec, n_envs=1, seed=0)
    env = collector.envs[0]
    assert isinstance(env, CartPole)
    env.steps = MAX_STEPS - 2  # two steps left before the time limit
    env.state = [0.0, 0.0, 0.0, 0.0]
    seg = collector.collect(NumpyActor(net.state_dict()), steps=2)
    assert seg["dones"][:, 0].tolist() == [0.0, 1.0]
    assert seg["rewards"][:, 0].tolist() == pytest.approx([1.0, 1.0 + GAMMA * 7.0])


def _segment(actor: NumpyActor, collector: Collector) -> dict[str, Any]:
    return collector.collect(actor, steps=32)


def test_stale_experience_is_weighted_by_how_far_the_policy_moved() -> None:
    spec = env_spec(BUILTIN_CARTPOLE)
    learner = Learner(spec.observation_size, spec.n_actions, seed=0, lr=3e-3)
    collector = Collector(spec, n_envs=8, seed=0)
    old_actor = NumpyActor(learner.state_dict())
    stale = _segment(old_actor, collector)
    for _ in range(3):  # the policy moves on: three updates on fresh experience
        stats = learner.update([_segment(NumpyActor(learner.state_dict()), collector)])
        assert stats.stale_samples == 0
        assert stats.weight_by_lag[0] == pytest.approx(1.0, abs=1e-4)  # fresh: weight 1
    fresh = _segment(NumpyActor(learner.state_dict()), collector)
    before = {k: v.clone() for k, v in learner.state_dict().items()}
    stats = learner.update([stale, fresh], lags=[3, 0])
    # Used, not dropped: both segments count, the stale one with weights min(1, pi/mu) < 1.
    assert stats.samples == 2 * 32 * 8 and stats.stale_samples == 32 * 8
    assert stats.weight_by_lag[0] == pytest.approx(1.0, abs=1e-4)
    assert 0.0 < stats.weight_by_lag[3] < 1.0
    assert any(not torch.equal(before[k], v) for k, v in learner.state_dict().items())


def test_an_update_on_stale_experience_alone_still_learns() -> None:
    spec = env_spec(BUILTIN_CARTPOLE)
    learner = Learner(spec.observation_size, spec.n_actions, seed=0)
    collector = Collector(spec, n_envs=4, seed=1)
    stale = _segment(NumpyActor(learner.state_dict()), collector)
    learner.update([_segment(NumpyActor(learner.state_dict()), collector)])
    before = {k: v.clone() for k, v in learner.state_dict().items()}
    stats = learner.update([stale], lags=[1])
    assert stats.stale_samples == stats.samples == 32 * 4
    assert all(math.isfinite(x) for x in (stats.policy_loss, stats.value_loss, stats.entropy))
    assert any(not torch.equal(before[k], v) for k, v in learner.state_dict().items())


def test_the_learner_refuses_segments_it_cannot_stack() -> None:
    spec = env_spec(BUILTIN_CARTPOLE)
    learner = Learner(spec.observation_size, spec.n_actions)
    collector = Collector(spec, n_envs=2, seed=0)
    actor = NumpyActor(learner.state_dict())
    with pytest.raises(ValueError, match="no segments"):
        learner.update([])
    with pytest.raises(ValueError, match="same number of time steps"):
        learner.update([collector.collect(actor, 8), collector.collect(actor, 9)])
