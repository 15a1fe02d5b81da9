"""Distributed deep RL over tensorshare: :class:`RLTrainer` and :class:`RLWorker` (``api``), the
asynchronous learner (``learner``), prioritized experience replay (:class:`ReplayBuffer`,
``replay``), environments (``envs``) and the demo (``demo``)."""

from __future__ import annotations

from .api import DATA_BIN, PARAMS_BIN, RLTrainer, RLWorker, TrainerStopped, stop_bin_for
from .replay import ReplayBuffer, Sample

__all__ = ["DATA_BIN", "PARAMS_BIN", "RLTrainer", "RLWorker", "ReplayBuffer", "Sample",
           "TrainerStopped", "stop_bin_for"]
