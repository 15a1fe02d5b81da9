"""Distributed Acrobot: where more rollout workers mean shorter training.

Gymnasium's ``Acrobot-v1`` integrates a double pendulum with RK4 at every step, so playing
costs several times what learning from the experience costs, and the trainer can keep up with
more workers than CartPole allows. Same machinery as ``examples/cartpole.py`` (everything lives
in :mod:`tensorshare.demo`): workers act without pause and send 64-step segments tagged with
their parameter version; the trainer learns from a fixed amount of experience per update, using
segments up to 4 versions old with importance weights, until the average return of the last
100 episodes reaches -100 (Gymnasium's threshold; an episode scores -1 per step until the tip
swings above the bar, at most 500 steps)::

    pip install -e ".[rl]"
    python examples/acrobot.py --workers 2

``benchmarks/rl_scaling.py`` runs this for 1, 2, 4, ... workers and several seeds.

Exit status: 0 if the target was reached within ``--max-seconds``, 1 if not, 2 without
Gymnasium.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tensorshare.rl.demo import train
from tensorshare.rl.envs import have_gymnasium


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, train, print the summary. Returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--target", type=float, default=-100.0,
                   help="average return over the last 100 episodes that counts as solved "
                        "(default -100)")
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="give up after this long (default 120)")
    p.add_argument("--seed", type=int, default=0, help="seeds the policy and the workers")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if not have_gymnasium():
        print("examples/acrobot.py needs Gymnasium: pip install -e '.[rl]'", file=sys.stderr)
        return 2
    result = train(args.workers, args.target, args.max_seconds, args.seed, env="Acrobot-v1")
    print(result.summary(), flush=True)
    return 0 if result.solved else 1


if __name__ == "__main__":
    sys.exit(main())
