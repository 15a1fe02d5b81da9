"""Batched inference: one model in one process answering many small workers, over service
bins.

* :class:`InferenceHost` owns the model (on a GPU when there is one): it takes the workers'
  calls in batches, stacks their inputs, runs the model once per batch and answers each
  worker with its own rows; with ``params_bin`` it reloads the parameters ``RLTrainer``
  publishes and stamps each answer with their version.
* :class:`InferenceClient` is each worker's handle: ``predict(obs)`` (blocking) or
  ``predict_async(obs)`` (a future; many in flight).

The service bin under them (``docs/PROTOCOL.md``, service bins) queues calls on the server,
leases each batch to one host (a host that dies gives its calls back to the queue for another)
and answers every call exactly once. See the README, "Batched inference".
"""

from __future__ import annotations

from ..client.services import ServiceFailed
from .client import InferenceClient
from .host import InferenceHost, split_outputs, stack_inputs

__all__ = ["InferenceClient", "InferenceHost", "ServiceFailed", "split_outputs", "stack_inputs"]
