"""The asynchronous learner: an actor-critic with V-trace targets and a decoupled PPO objective.

Library code, usable without the demo or a server:

- :class:`ActorCritic`: the policy and value networks (torch), which the learner trains.
- :class:`NumpyActor`: the same forward pass in numpy, for the workers that act with it.
- :class:`Collector`: steps a few environments together with an actor and cuts their
  experience into fixed-length segments, each carrying what the learner needs.
- :func:`vtrace`: V-trace targets and advantages (GAE(lambda) on fresh experience).
- :class:`Learner`: learns from segments played with parameters a few versions old, correcting
  the lag with truncated importance weights; :class:`UpdateStats` says what an update did.

A loop without any of the distribution (``env_spec`` is :func:`tensorshare.rl.envs.env_spec`)::

    spec = env_spec("builtin-CartPole")
    learner = Learner(spec.observation_size, spec.n_actions)
    collector = Collector(spec, n_envs=16, seed=0)
    for _ in range(100):
        learner.update([collector.collect(NumpyActor(learner.state_dict()))])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from .envs import EnvSpec

__all__ = [
    "CLIP",
    "ENTROPY_COEF",
    "EPOCHS",
    "GAMMA",
    "HIDDEN",
    "LAMBDA",
    "LEARNING_RATE",
    "MAX_GRAD_NORM",
    "MINIBATCHES",
    "SEGMENT_STEPS",
    "VALUE_COEF",
    "ActorCritic",
    "Collector",
    "Learner",
    "NumpyActor",
    "UpdateStats",
    "vtrace",
]

GAMMA = 0.99
LAMBDA = 0.95  # V-trace's trace-cutting lambda; GAE's lambda on fresh experience
LEARNING_RATE = 4e-3
HIDDEN = 64
# One pass over each batch, in 4 minibatches: a second pass saved ~10-20% of the samples on
# Acrobot but cost ~75% more learner time per sample, and the learner shares the cores with
# the workers (it is what keeps 2 workers on 2 cores from being twice as fast as one).
EPOCHS = 1
MINIBATCHES = 4
CLIP = 0.2  # PPO's clip range
ENTROPY_COEF = 0.02  # keeps Acrobot exploring through its long -500 plateau
VALUE_COEF = 0.5
MAX_GRAD_NORM = 0.5
SEGMENT_STEPS = 64  # time steps per segment (in each of a collector's environments)


# -- the policy ------------------------------------------------------------------------------------
class ActorCritic(nn.Module):
    """Two MLPs (ReLU, two hidden layers): the policy's logits and the state value.

    Separate networks: a shared trunk learns much worse here, because value targets are
    returns in the hundreds while the policy's signal is normalised advantages. ReLU rather
    than tanh: the same results on these tasks for a third less learner time.

    Args:
        observation_size: the length of an observation vector.
        n_actions: how many discrete actions there are.
        hidden: the width of the hidden layers.
    """

    def __init__(self, observation_size: int, n_actions: int, hidden: int = HIDDEN) -> None:
        super().__init__()
        logits = nn.Linear(hidden, n_actions)
        with torch.no_grad():  # start near uniform: every action gets tried
            logits.weight.mul_(0.01)
            logits.bias.zero_()
        self.pi = nn.Sequential(nn.Linear(observation_size, hidden), nn.ReLU(),
                                nn.Linear(hidden, hidden), nn.ReLU(), logits)
        self.v = nn.Sequential(nn.Linear(observation_size, hidden), nn.ReLU(),
                               nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluate both networks.

        Args:
            obs: (..., observation_size) observations.

        Returns:
            ``(logits, value)``: (..., n_actions) and (...).
        """
        return self.pi(obs), self.v(obs).squeeze(-1)


def sample_actions(logits: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One action per row of ``logits`` (N, n_actions), and the log-probability each had."""
    logits = logits - logits.max(axis=1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    cdf = np.exp(log_probs).cumsum(axis=1)
    u = rng.random(len(logits))[:, None]
    actions = np.minimum((u > cdf).sum(axis=1), logits.shape[1] - 1)
    return actions, log_probs[np.arange(len(logits)), actions]


class Actor(Protocol):
    """What :meth:`Collector.collect` plays with: a :class:`NumpyActor`, or an actor that asks
    an inference host (``tensorshare.rl.demo.RemoteActor``)."""

    checksum: float  #: of the parameters it acts with (0.0 where they live elsewhere)

    def act(self, obs: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """One action per row of ``obs``, and its log-probability."""
        ...

    def value(self, obs: np.ndarray) -> np.ndarray:
        """The state values of the rows of ``obs``."""
        ...


class NumpyActor:
    """The workers' copy of an :class:`ActorCritic`, in numpy.

    For a handful of environments a torch call costs more in overhead than the arithmetic;
    numpy does the same forward pass in a fraction of the time, and acting is the workers'
    whole job.

    Args:
        state_dict: an :class:`ActorCritic`'s parameters, as published by the trainer.

    Raises:
        KeyError: ``state_dict`` is not an :class:`ActorCritic`'s.
    """

    def __init__(self, state_dict: dict[str, torch.Tensor]) -> None:
        def layers(net: str) -> list[tuple[np.ndarray, np.ndarray]]:
            return [(state_dict[f"{net}.{i}.weight"].numpy().astype(np.float32).T.copy(),
                     state_dict[f"{net}.{i}.bias"].numpy().astype(np.float32))
                    for i in (0, 2, 4)]

        self.pi, self.v = layers("pi"), layers("v")
        # A fingerprint of the parameters, sent with each segment: a test can check which
        # parameters really played it, independently of the version tag.
        self.checksum = float(sum(float(t.double().sum()) for t in state_dict.values()))

    @staticmethod
    def _mlp(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
        (w1, b1), (w2, b2), (w3, b3) = layers
        h = np.maximum(x @ w1 + b1, 0.0)
        return np.maximum(h @ w2 + b2, 0.0) @ w3 + b3

    def act(self, obs: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Sample one action per row of ``obs``.

        Args:
            obs: (N, observation_size) float32 observations.
            rng: draws the actions.

        Returns:
            ``(actions, log_probs)``: the actions and the log-probability each had.
        """
        return sample_actions(self._mlp(self.pi, obs), rng)

    def value(self, obs: np.ndarray) -> np.ndarray:
        """The state values of the rows of ``obs``.

        Args:
            obs: (N, observation_size) float32 observations.

        Returns:
            (N,) values.
        """
        return self._mlp(self.v, obs)[:, 0]


# -- collecting experience ------------------------------------------------------------------------
class Collector:
    """Steps ``n_envs`` environments together and cuts their experience into segments.

    Episodes run across segments: a segment ends after a fixed number of steps, wherever the
    episodes are, and carries the observation after its last step so that the learner can
    bootstrap from it. When an episode is truncated (a time limit, not a failure), the value
    of its last observation, discounted, is added to its last reward: the episode did not end
    there, it was only cut off.

    Args:
        spec: the environment. n_envs: how many to run.
        seed: seeds the environments and the action sampling.
        gamma: the discount (for the truncation bootstrap).

    Raises:
        ImportError: ``spec`` is a Gymnasium environment and Gymnasium is not installed.
    """

    def __init__(self, spec: EnvSpec, n_envs: int, seed: int, gamma: float = GAMMA) -> None:
        seeds = np.random.SeedSequence(seed).generate_state(n_envs + 1)
        self.envs = [spec.make() for _ in range(n_envs)]
        self.obs = np.stack([np.asarray(env.reset(seed=int(s))[0], dtype=np.float32)
                             for env, s in zip(self.envs, seeds[1:], strict=True)])
        self.rng = np.random.default_rng(int(seeds[0]))
        self.gamma = gamma
        self.episode_return = np.zeros(n_envs)
        self.episode_length = np.zeros(n_envs, dtype=np.int64)

    def collect(self, actor: Actor, steps: int = SEGMENT_STEPS) -> dict[str, Any]:
        """Play ``steps`` steps in every environment with ``actor``.

        Args:
            actor: the policy to act with (its values bootstrap truncated episodes).
            steps: the segment's length T.

        Returns:
            The segment: ``obs`` (T+1, E, D) float32, ``actions`` (T, E) int64, ``log_probs``
            (T, E) float32 (the actor's, "mu"), ``rewards`` (T, E) float32, ``dones`` (T, E)
            float32 (1 where an episode ended at that step), ``episode_returns`` and
            ``episode_lengths`` (K,) of the episodes that ended, and ``params_checksum``.
        """
        n = len(self.envs)
        obs = np.empty((steps + 1, n, self.obs.shape[1]), dtype=np.float32)
        actions = np.empty((steps, n), dtype=np.int64)
        log_probs = np.empty((steps, n), dtype=np.float32)
        rewards = np.empty((steps, n), dtype=np.float32)
        dones = np.zeros((steps, n), dtype=np.float32)
        finished: list[float] = []
        lengths: list[int] = []
        for t in range(steps):
            obs[t] = self.obs
            a, lp = actor.act(self.obs, self.rng)
            actions[t], log_probs[t] = a, lp
            nxt = self.obs.copy()
            for i, (env, action) in enumerate(zip(self.envs, a.tolist(), strict=True)):
                o, r, terminated, truncated, _ = env.step(action)
                self.episode_return[i] += float(r)
                self.episode_length[i] += 1
                if terminated or truncated:
                    if truncated and not terminated:
                        last = np.asarray(o, dtype=np.float32)[None]
                        r = float(r) + self.gamma * float(actor.value(last)[0])
                    dones[t, i] = 1.0
                    finished.append(float(self.episode_return[i]))
                    lengths.append(int(self.episode_length[i]))
                    self.episode_return[i], self.episode_length[i] = 0.0, 0
                    o, _ = env.reset()
                rewards[t, i] = r
                nxt[i] = o
            self.obs = nxt
        obs[steps] = self.obs
        return {
            "obs": torch.from_numpy(obs),
            "actions": torch.from_numpy(actions),
            "log_probs": torch.from_numpy(log_probs),
            "rewards": torch.from_numpy(rewards),
            "dones": torch.from_numpy(dones),
            "episode_returns": torch.tensor(finished, dtype=torch.float32),
            "episode_lengths": torch.tensor(lengths, dtype=torch.int64),
            "params_checksum": actor.checksum,
        }


# -- learning ---------------------------------------------------------------------------------------
def vtrace(values: torch.Tensor, rewards: torch.Tensor, dones: torch.Tensor,
           rhos: torch.Tensor, gamma: float = GAMMA, lam: float = LAMBDA,
           rho_bar: float = 1.0, c_bar: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets (Espeholt et al., 2018, eq. 1), and the advantages they give.

    Args:
        values: (T+1, B) the learner's values of the segment's observations.
        rewards, dones: (T, B). rhos: (T, B) importance ratios pi/mu of the actions taken.
        gamma: discount. lam: trace cutting (lambda). rho_bar, c_bar: truncation levels.

    Returns:
        ``(vs, advantages)``, both (T, B): the value targets, and
        ``r_t + gamma * vs_{t+1} - V(x_t)``. With all ``rhos`` 1 these are the lambda-returns
        and GAE(lambda).
    """
    discounts = gamma * (1.0 - dones)
    clipped_rho = rhos.clamp(max=rho_bar)
    cs = lam * rhos.clamp(max=c_bar)
    deltas = clipped_rho * (rewards + discounts * values[1:] - values[:-1])
    corrections = torch.empty_like(rewards)
    acc = torch.zeros_like(values[0])
    for t in range(rewards.shape[0] - 1, -1, -1):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        corrections[t] = acc
    vs = values[:-1] + corrections
    vs_next = torch.cat([vs[1:], values[-1:]])
    return vs, rewards + discounts * vs_next - values[:-1]


@dataclass
class UpdateStats:
    """What one update did.

    Attributes:
        samples: steps learned from. stale_samples: those played with older parameters.
        weight_by_lag: the mean importance weight ``min(1, pi/mu)`` of the steps, by how many
            versions old their parameters were (0: fresh).
        policy_loss, value_loss, entropy: of the last minibatch.
    """

    samples: int
    stale_samples: int
    weight_by_lag: dict[int, float]
    policy_loss: float
    value_loss: float
    entropy: float


@dataclass
class _Steps:
    """A batch's time steps, flattened to one row each: what the minibatch steps use."""

    obs: torch.Tensor
    actions: torch.Tensor
    prox: torch.Tensor  # the actions' log-probabilities under the parameters at the start
    weights: torch.Tensor  # min(1, pi_prox / mu)
    vs: torch.Tensor  # V-trace's value targets
    advantages: torch.Tensor

    def __getitem__(self, idx: torch.Tensor) -> _Steps:
        return _Steps(self.obs[idx], self.actions[idx], self.prox[idx], self.weights[idx],
                      self.vs[idx], self.advantages[idx])


class Learner:
    """Actor-critic with V-trace targets and a decoupled PPO objective, for async experience.

    Per batch: the values and log-probabilities under the current parameters (the
    "proximal" policy) are computed once; ``rho = pi_prox / mu`` measures how far the
    parameters that acted (mu) lag behind. V-trace turns ``rho`` into value targets and
    advantages; the policy loss is PPO's clipped surrogate against ``pi_prox``, each step
    weighted by ``min(1, rho)``. So stale steps count, less where the policy has moved away
    from what was done; fresh steps have weight 1 and this is plain PPO.

    Args:
        observation_size, n_actions: the environment's. seed: initial parameters, shuffling.
        lr, epochs, minibatches, clip, entropy_coef, value_coef, gamma, lam, max_grad_norm:
            the usual PPO hyperparameters.
    """

    def __init__(self, observation_size: int, n_actions: int, seed: int = 0, *,
                 lr: float = LEARNING_RATE, epochs: int = EPOCHS, minibatches: int = MINIBATCHES,
                 clip: float = CLIP, entropy_coef: float = ENTROPY_COEF,
                 value_coef: float = VALUE_COEF, gamma: float = GAMMA, lam: float = LAMBDA,
                 max_grad_norm: float = MAX_GRAD_NORM) -> None:
        torch.manual_seed(seed)
        self.net = ActorCritic(observation_size, n_actions)
        # fused: one kernel for all parameters; the per-tensor loop costs more than the math
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=lr, eps=1e-5, fused=True)
        self.generator = torch.Generator().manual_seed(seed)
        self.epochs, self.minibatches, self.clip = epochs, minibatches, clip
        self.entropy_coef, self.value_coef = entropy_coef, value_coef
        self.gamma, self.lam, self.max_grad_norm = gamma, lam, max_grad_norm

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters to publish.

        Returns:
            The network's state dict (the tensors themselves, not copies).
        """
        return self.net.state_dict()

    def update(self, segments: Sequence[dict[str, Any]],
               lags: Sequence[int] | None = None) -> UpdateStats:
        """Learn from ``segments`` (as :meth:`Collector.collect` makes them).

        Args:
            segments: the batch, all of the same length.
            lags: per segment, how many versions older than the current parameters the ones
                that played it were (for the statistics only: the correction itself comes
                from the log-probabilities each segment carries).

        Returns:
            What the update did.

        Raises:
            ValueError: no segments, or segments of different lengths.
        """
        if not segments:
            raise ValueError("no segments to learn from")
        if len({int(s["actions"].shape[0]) for s in segments}) != 1:
            raise ValueError("segments must all have the same number of time steps")
        lags = list(lags) if lags is not None else [0] * len(segments)
        lag = torch.cat([torch.full(s["actions"].shape, lg) for s, lg in
                         zip(segments, lags, strict=True)], dim=1)
        steps, weights = self._targets(segments)
        policy_loss, value_loss, entropy = self._optimize(steps)
        by_lag = {int(lg): float(weights[lag == lg].mean()) for lg in sorted(set(lags))}
        return UpdateStats(samples=len(steps.actions), stale_samples=int((lag > 0).sum()),
                           weight_by_lag=by_lag, policy_loss=policy_loss.item(),
                           value_loss=value_loss.item(), entropy=entropy.item())

    def _targets(self, segments: Sequence[dict[str, Any]]) -> tuple[_Steps, torch.Tensor]:
        """Stack the segments and compute, once, what the minibatch steps learn towards.

        Returns the flattened steps (advantages normalised) and the (T, B) weights.
        """
        obs = torch.cat([s["obs"] for s in segments], dim=1)
        actions = torch.cat([s["actions"] for s in segments], dim=1)
        mu = torch.cat([s["log_probs"] for s in segments], dim=1)
        rewards = torch.cat([s["rewards"] for s in segments], dim=1)
        dones = torch.cat([s["dones"] for s in segments], dim=1)
        with torch.no_grad():
            logits, values = self.net(obs)
            prox = torch.log_softmax(logits[:-1], -1).gather(-1, actions[..., None])[..., 0]
            rhos = torch.exp(prox - mu)
            vs, advantages = vtrace(values, rewards, dones, rhos, self.gamma, self.lam)
            weights = rhos.clamp(max=1.0)
        n = actions.shape[0] * actions.shape[1]
        f_adv = advantages.reshape(n)
        f_adv = (f_adv - f_adv.mean()) / (f_adv.std() + 1e-8)
        steps = _Steps(obs[:-1].reshape(n, -1), actions.reshape(n), prox.reshape(n),
                       weights.reshape(n), vs.reshape(n), f_adv)
        return steps, weights

    def _optimize(self, steps: _Steps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``epochs`` passes over ``steps`` in shuffled minibatches.

        Returns the last minibatch's policy loss, value loss and entropy.
        """
        n = len(steps.actions)
        size = n // self.minibatches
        losses = (torch.zeros(()), torch.zeros(()), torch.zeros(()))
        for _ in range(self.epochs):
            order = torch.randperm(n, generator=self.generator)
            for k in range(self.minibatches):
                losses = self._step(steps[order[k * size:(k + 1) * size]])
        return losses

    def _step(self, mb: _Steps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One gradient step on minibatch ``mb``: its policy loss, value loss and entropy."""
        logits, values = self.net(mb.obs)
        log_probs = torch.log_softmax(logits, -1)
        chosen = log_probs.gather(-1, mb.actions[:, None])[:, 0]
        ratio = torch.exp(chosen - mb.prox)
        adv = mb.advantages
        surrogate = torch.min(ratio * adv, ratio.clamp(1 - self.clip, 1 + self.clip) * adv)
        policy_loss = -(mb.weights * surrogate).mean()
        value_loss = 0.5 * (values - mb.vs).square().mean()
        entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
        loss = policy_loss + self.value_coef * value_loss - self.entropy_coef * entropy
        self.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(self.net.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return policy_loss, value_loss, entropy
