"""The environments: the built-in CartPole and the specs of Gymnasium's."""

from __future__ import annotations

import pytest

from tensorshare.rl.envs import BUILTIN_CARTPOLE, MAX_STEPS, CartPole, env_spec


def test_builtin_cartpole_has_the_gymnasium_api() -> None:
    env = CartPole()
    obs, info = env.reset(seed=3)
    assert len(obs) == 4 and info == {} and all(abs(x) <= 0.05 for x in obs)
    assert env.reset(seed=3)[0] == obs  # seeded: the same start
    steps, terminated, truncated = 0, False, False
    while not (terminated or truncated):
        obs, reward, terminated, truncated, _ = env.step(steps % 2)  # wiggle: stays up long
        assert reward == 1.0
        steps += 1
    assert steps <= MAX_STEPS and (truncated == (steps == MAX_STEPS))


def test_env_specs() -> None:
    builtin = env_spec(BUILTIN_CARTPOLE)
    assert (builtin.observation_size, builtin.n_actions, builtin.target) == (4, 2, 195.0)
    pytest.importorskip("gymnasium")
    acrobot = env_spec("Acrobot-v1")
    assert (acrobot.observation_size, acrobot.n_actions, acrobot.target) == (6, 3, -100.0)
    with pytest.raises(ValueError, match="discrete actions"):
        env_spec("Pendulum-v1")
