"""Distributed CartPole: a trainer process and N worker processes, connected by tensorshare.

The trainer hosts the server (``RLTrainer(host_server=True)`` on a free port) and publishes the
policy; each worker process (``python -m tensorshare.demo worker``) waits for a new parameter
version, plays a batch of episodes with it and sends the rollout back, tagged with the version.
The trainer keeps only rollouts made with its newest parameters (stale ones are dropped on the
server), takes a REINFORCE step and publishes again, until the average return of the last 100
episodes reaches the target.

The environment, policy, worker loop and trainer loop live in :mod:`tensorshare.demo`, which is
also what ``tensorshare demo`` runs; this script only adds the command line::

    python examples/cartpole.py --workers 3

Exit status: 0 if CartPole was solved within ``--max-seconds``, 1 if not.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tensorshare.demo import train


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, train, print the summary. Returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    p.add_argument("--target", type=float, default=195.0,
                   help="average return over the last 100 episodes that counts as solved "
                        "(default 195; the most an episode can return is 200)")
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="give up after this long (default 120)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the initial policy and each worker's episodes (default 0)")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be at least 1")
    result = train(args.workers, args.target, args.max_seconds, args.seed)
    print(result.summary(), flush=True)
    return 0 if result.solved else 1


if __name__ == "__main__":
    sys.exit(main())
