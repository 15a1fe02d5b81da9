"""Distributed deep RL over tensorshare: :class:`RLTrainer` and :class:`RLWorker` (``api``), the
asynchronous learner (``learner``), environments (``envs``) and the demo (``demo``)."""

from __future__ import annotations

from .api import DATA_BIN, PARAMS_BIN, RLTrainer, RLWorker, TrainerStopped, stop_bin_for

__all__ = ["DATA_BIN", "PARAMS_BIN", "RLTrainer", "RLWorker", "TrainerStopped", "stop_bin_for"]
