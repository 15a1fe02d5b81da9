"""The client ops of stream bins (filled in by its issue), mixed into every client face."""

from __future__ import annotations

__all__ = ["StreamOps"]


class StreamOps:
    """Stream ops for :class:`~.ops.Ops` (see :mod:`tensorshare.data`)."""
