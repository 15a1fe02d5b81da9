"""Service bins (filled in by its issue): a placeholder kind with no bins and no requests."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connection import ServerProtocol
    from .core import ServerFactory
    from .kinds import Handler

__all__ = ["ServiceKind"]


class ServiceKind:
    """Service bins."""

    name = "service"

    def __init__(self, server: ServerFactory) -> None:
        self.server = server

    def handlers(self) -> dict[type, Handler]:
        return {}

    def owns(self, name: str) -> bool:
        return False

    def connection_lost(self, conn: ServerProtocol) -> None:
        pass

    def session_ended(self, sid: bytes) -> None:
        pass

    def describe(self, glob: str | None) -> dict[str, dict[str, Any]]:
        return {}

    @property
    def nbytes(self) -> int:
        return 0
