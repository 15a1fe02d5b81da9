"""Distributed CartPole: a trainer process and N worker processes, connected by tensorshare.

The trainer hosts the server (``RLTrainer(host_server=True)`` on a free port) and publishes
the policy. Each worker process (``python -m tensorshare.demo worker``) steps 16 CartPoles
without pause, sends every 64-step segment tagged with the parameter version that played it,
and picks up new parameters between segments (one download per version). The trainer learns
from a fixed amount of experience per update, whichever workers sent it, using segments up to
4 versions old with importance weights (V-trace and a clipped PPO objective), until the
average return of the last 100 episodes reaches the target.

With Gymnasium installed (``pip install -e ".[rl]"``) this is ``CartPole-v1`` (500 steps,
solved at 475); without it, the built-in CartPole (200 steps, solved at 195). CartPole's step
is so cheap that the trainer's updates, not the workers, set the pace: see
``examples/acrobot.py`` for a task where more workers pay off. The environment, policy, worker
and trainer live in :mod:`tensorshare.demo`; this script only adds the command line::

    python examples/cartpole.py --workers 2

Exit status: 0 if the target was reached within ``--max-seconds``, 1 if not.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tensorshare.rl.demo import train
from tensorshare.rl.envs import BUILTIN_CARTPOLE, have_gymnasium


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, train, print the summary. Returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--target", type=float, default=None,
                   help="average return over the last 100 episodes that counts as solved "
                        "(default: 475 for CartPole-v1, 195 for the built-in CartPole)")
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="give up after this long (default 120)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the initial policy and each worker's episodes (default 0)")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if have_gymnasium():
        env = "CartPole-v1"
    else:
        env = BUILTIN_CARTPOLE
        print("Gymnasium is not installed (pip install -e '.[rl]'): using the built-in CartPole",
              flush=True)
    result = train(args.workers, args.target, args.max_seconds, args.seed, env=env)
    print(result.summary(), flush=True)
    return 0 if result.solved else 1


if __name__ == "__main__":
    sys.exit(main())
