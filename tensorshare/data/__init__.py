"""Shared data loading: one data pipeline for several training jobs, over stream bins.

* :func:`serve_loader` feeds the batches of one DataLoader (or any iterable of batches) to a
  stream bin, epoch by epoch;
* :class:`SharedLoader` is a one-line swap for the DataLoader in each training job: it
  yields the same batches, re-batched to its own batch size, with a true ``len()``;
* :class:`StreamProducer` and :class:`StreamConsumer` are the pieces both are built on, for
  data that does not come from a DataLoader.

Every consumer receives every batch, at its own pace within the stream's ``window``; memory
on the server stays bounded; consumers and producers join and leave at will (see the README,
"Sharing one data pipeline", and ``docs/PROTOCOL.md`` for the stream bin). The errors a job
may see are :class:`ProducerGone` (a producer died mid-epoch), :class:`Lagged` (items were
skipped for a job that fell behind under ``on_lag="detach"``, or was away past its lease)
and :class:`StreamFinished` (a pass over a stream whose producers ended it, once the job read
all of it).
"""

from __future__ import annotations

from ..client.streams import Lagged, ProducerGone, StreamBatch
from ..errors import StreamFinished
from .batching import Rebatcher, sample_count
from .loader import ServeReport, SharedLoader, serve_loader
from .stream import StreamConsumer, StreamProducer

__all__ = [
    "Lagged",
    "ProducerGone",
    "Rebatcher",
    "ServeReport",
    "SharedLoader",
    "StreamBatch",
    "StreamConsumer",
    "StreamFinished",
    "StreamProducer",
    "sample_count",
    "serve_loader",
]
