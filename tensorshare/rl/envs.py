"""Environments for the RL learner: Gymnasium's when it is installed, else a built-in CartPole.

:func:`env_spec` describes an environment by name: a Gymnasium id with discrete actions and a
vector observation (``Acrobot-v1``, ``CartPole-v1``, ...), or :data:`BUILTIN_CARTPOLE`, the
hand-written cart-pole of :class:`CartPole` (as in gym's v0: 200 steps, solved at 195), which
needs nothing beyond the standard library. :meth:`EnvSpec.make` builds one; everything the
workers call on it is the :class:`Env` protocol, Gymnasium's ``reset``/``step``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Protocol, SupportsFloat

__all__ = [
    "BEST_RETURN",
    "BUILTIN_CARTPOLE",
    "DEFAULT_GYM_ENV",
    "MAX_STEPS",
    "CartPole",
    "Env",
    "EnvSpec",
    "default_env",
    "env_spec",
    "have_gymnasium",
]

# -- the hand-written CartPole: Barto, Sutton & Anderson (1983), as in gym's v0 ------------------
GRAVITY = 9.8
MASS_CART = 1.0
MASS_POLE = 0.1
TOTAL_MASS = MASS_CART + MASS_POLE
HALF_LENGTH = 0.5  # half the pole's length
POLE_MASS_LENGTH = MASS_POLE * HALF_LENGTH
FORCE_MAG = 10.0
TAU = 0.02  # seconds per step (explicit Euler)
X_LIMIT = 2.4
THETA_LIMIT = 12 * 2 * math.pi / 360  # 12 degrees
MAX_STEPS = 200  # reward is 1 per step, so 200 is the best possible return

BUILTIN_CARTPOLE = "builtin-CartPole"
DEFAULT_GYM_ENV = "Acrobot-v1"
# The most an episode can return, where we know it: a target above it can never be reached.
BEST_RETURN = {"CartPole-v0": 200.0, "CartPole-v1": 500.0, "Acrobot-v1": 0.0,
               "MountainCar-v0": 0.0, BUILTIN_CARTPOLE: float(MAX_STEPS)}


class Env(Protocol):
    """The part of Gymnasium's ``Env`` API the workers use."""

    def reset(self, *, seed: int | None = None) -> tuple[Any, dict[str, Any]]: ...

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]: ...


class CartPole:
    """The hand-written cart-pole, with Gymnasium's ``reset``/``step`` API (no Gymnasium needed).

    Plain Python floats: for one pole this beats numpy. An episode ends when the cart leaves
    the track or the pole passes 12 degrees (terminated) or after ``MAX_STEPS`` steps
    (truncated); every step rewards 1.

    Args:
        seed: seeds the random start states (``reset(seed=...)`` reseeds).
    """

    observation_size = 4
    n_actions = 2

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.state = [0.0, 0.0, 0.0, 0.0]
        self.steps = 0

    def reset(self, *, seed: int | None = None) -> tuple[list[float], dict[str, Any]]:
        """Start an episode near upright and still.

        Args:
            seed: reseed the start states first (``None``: go on with the current ones).

        Returns:
            ``(observation, info)``; ``info`` is empty.
        """
        if seed is not None:
            self.rng.seed(seed)
        self.state = [self.rng.uniform(-0.05, 0.05) for _ in range(4)]
        self.steps = 0
        return list(self.state), {}

    def step(self, action: int) -> tuple[list[float], float, bool, bool, dict[str, Any]]:
        """Push left (0) or right (1) for one time step.

        Args:
            action: 0 or 1.

        Returns:
            ``(observation, reward, terminated, truncated, info)`` as in Gymnasium; the
            observation is ``[x, x_dot, theta, theta_dot]``.
        """
        x, x_dot, theta, theta_dot = self.state
        force = FORCE_MAG if action == 1 else -FORCE_MAG
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + POLE_MASS_LENGTH * theta_dot * theta_dot * sin) / TOTAL_MASS
        theta_acc = (GRAVITY * sin - cos * temp) / (
            HALF_LENGTH * (4.0 / 3.0 - MASS_POLE * cos * cos / TOTAL_MASS))
        x_acc = temp - POLE_MASS_LENGTH * theta_acc * cos / TOTAL_MASS
        x += TAU * x_dot
        x_dot += TAU * x_acc
        theta += TAU * theta_dot
        theta_dot += TAU * theta_acc
        self.state = [x, x_dot, theta, theta_dot]
        self.steps += 1
        terminated = abs(x) > X_LIMIT or abs(theta) > THETA_LIMIT
        return list(self.state), 1.0, terminated, self.steps >= MAX_STEPS and not terminated, {}


def have_gymnasium() -> bool:
    """Whether Gymnasium can be imported (the ``rl`` extra).

    Returns:
        ``True`` if ``import gymnasium`` works.
    """
    try:
        import gymnasium  # noqa: F401
    except ImportError:
        return False
    return True


def default_env() -> str:
    """The environment used when none is named.

    Returns:
        ``Acrobot-v1`` with Gymnasium, else :data:`BUILTIN_CARTPOLE`.
    """
    return DEFAULT_GYM_ENV if have_gymnasium() else BUILTIN_CARTPOLE


@dataclass(frozen=True)
class EnvSpec:
    """What the trainer and the workers need to know about an environment.

    Attributes:
        name: a Gymnasium id, or ``BUILTIN_CARTPOLE``.
        observation_size, n_actions: a vector observation, discrete actions.
        target: the average return that counts as solved (Gymnasium's reward threshold).
        best_return: the most an episode can return, if known.
    """

    name: str
    observation_size: int
    n_actions: int
    target: float
    best_return: float | None

    def make(self) -> Env:
        """A new instance of the environment (seed it with ``reset(seed=...)``).

        Returns:
            The environment.

        Raises:
            ImportError: a Gymnasium environment, and Gymnasium is not installed.
        """
        if self.name == BUILTIN_CARTPOLE:
            return CartPole()
        import gymnasium

        return gymnasium.make(self.name)


def env_spec(name: str | None = None) -> EnvSpec:
    """Describe environment ``name``.

    Args:
        name: a Gymnasium id or :data:`BUILTIN_CARTPOLE` (``None``: :func:`default_env`).

    Returns:
        Its sizes, target and best return.

    Raises:
        ImportError: a Gymnasium id was named and Gymnasium is not installed.
        ValueError: the environment does not have discrete actions and a vector observation,
            or has no reward threshold to use as the target.
    """
    name = name or default_env()
    if name == BUILTIN_CARTPOLE:
        return EnvSpec(name, CartPole.observation_size, CartPole.n_actions, 195.0,
                       BEST_RETURN[name])
    try:
        import gymnasium
    except ImportError as exc:
        raise ImportError(f"environment {name!r} needs Gymnasium: pip install -e '.[rl]' "
                          f"(or use {BUILTIN_CARTPOLE!r})") from exc
    env = gymnasium.make(name)
    try:
        obs_space, act_space = env.observation_space, env.action_space
        if not (isinstance(act_space, gymnasium.spaces.Discrete)
                and isinstance(obs_space, gymnasium.spaces.Box) and len(obs_space.shape) == 1):
            raise ValueError(f"{name}: only discrete actions and vector observations are "
                             f"supported (it has {act_space} and {obs_space})")
        threshold = env.spec.reward_threshold if env.spec is not None else None
        if threshold is None:
            raise ValueError(f"{name} has no reward threshold: give a target")
        return EnvSpec(name, int(obs_space.shape[0]), int(act_space.n), float(threshold),
                       BEST_RETURN.get(name))
    finally:
        env.close()
