"""The client ops of service bins (filled in by its issue), mixed into every client face."""

from __future__ import annotations

__all__ = ["ServiceOps"]


class ServiceOps:
    """Service ops for :class:`~.ops.Ops` (see :mod:`tensorshare.inference`)."""
