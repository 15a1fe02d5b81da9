"""CartPole workers acting through one shared policy: batched inference with tensorshare.

The same distributed CartPole as ``examples/cartpole.py``, with one change: the workers do not
run the policy themselves. The trainer's process hosts an ``InferenceHost`` on the service bin
of the run; every worker sends each step's observations (one call for its 16 environments)
and gets the actions' logits and values back, computed in batches with the other workers'
calls. The host reloads the parameters each time the learner publishes them, and every
answer carries the version it was computed with: a worker tags each segment with the oldest
version that played it, so the learner's staleness filter works as with local copies.

It runs twice, with local copies of the policy (the direct-parameter example) and with
central inference, and both must reach the target::

    python examples/central_inference.py --workers 2

Exit status: 0 if both reached the target within ``--max-seconds`` each, 1 if not.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tensorshare.rl.demo import train
from tensorshare.rl.envs import BUILTIN_CARTPOLE, have_gymnasium


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, train both ways, print the summaries. Returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--target", type=float, default=None,
                   help="average return over the last 100 episodes that counts as solved "
                        "(default: the environment's)")
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="give up on a run after this long (default 120)")
    p.add_argument("--seed", type=int, default=0, help="seeds the runs (default 0)")
    p.add_argument("--only-central", action="store_true",
                   help="skip the run with local copies of the policy")
    args = p.parse_args(argv)
    env = "CartPole-v1" if have_gymnasium() else BUILTIN_CARTPOLE
    results = {}
    for central in ((True,) if args.only_central else (False, True)):
        name = "central inference" if central else "local copies"
        print(f"--- {name} ---", flush=True)
        result = train(args.workers, args.target, args.max_seconds, args.seed, env=env,
                       central=central, progress_every=5.0)
        print(result.summary(), flush=True)
        results[name] = result
    for name, result in results.items():
        print(f"{name}: {'reached' if result.solved else 'did not reach'} the target",
              flush=True)
    return 0 if all(r.solved for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
