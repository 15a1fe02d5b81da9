"""Kinds of bins beside the store's value and list bins: streams (one sequence every consumer
reads with its own cursor, :mod:`.streams`) and services (calls answered by hosts that take
them in batches, :mod:`.services`).

A kind brings its own requests (their handlers join the responder's table), keeps its own
bookkeeping keyed by connection and session, owns the names of its bins (a name is of one
kind at a time), and describes its bins for the stats.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .connection import ServerProtocol
    from .core import ServerFactory

__all__ = ["Kind", "kinds_for"]

Handler = Callable[["ServerProtocol", Any], None]


class Kind(Protocol):
    """What the server asks of a kind of bin."""

    #: What ``ls`` and the stats call its bins ("stream", "service").
    name: str
    @property
    def table(self) -> Mapping[str, Any]:
        """Its bins by name (what :meth:`owns` looks in): the responder checks a store
        request's name against it without a call."""
        ...

    def handlers(self) -> dict[type, Handler]:
        """Its requests' handlers, by request type."""
        ...

    def owns(self, name: str) -> bool:
        """Whether the bin ``name`` is one of this kind's."""
        ...

    def connection_lost(self, conn: ServerProtocol) -> None:
        """A connection is gone: what it held (waits, leases) is released or starts to expire."""
        ...

    def session_ended(self, sid: bytes) -> None:
        """A session ended (expired, or said bye)."""
        ...

    def describe(self, glob: str | None) -> dict[str, dict[str, Any]]:
        """Its bins (matching ``glob``) for the stats: each with at least ``kind``,
        ``n_items``, ``nbytes`` and ``version``."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes its bins hold (counted against max_memory)."""
        ...


def kinds_for(server: ServerFactory) -> list[Kind]:
    """The kinds a server has (each bound to it)."""
    from .services import ServiceKind
    from .streams import StreamKind

    return [StreamKind(server), ServiceKind(server)]
