"""The distributed RL demo, at the path the README documents (see :mod:`tensorshare.rl.demo`).

``python -m tensorshare.demo`` runs it as ``tensorshare demo`` does.
"""

from __future__ import annotations

from .rl.demo import main, run_demo, train

__all__ = ["main", "run_demo", "train"]

if __name__ == "__main__":
    raise SystemExit(main())
