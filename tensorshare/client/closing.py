"""What the package's closable objects share: ``with obj:`` gives ``obj`` and closes it on the
way out (a :class:`~.sharded.ShardedClient`, an ``InferenceClient``, a ``Relay``)."""

from __future__ import annotations

from typing import Self

__all__ = ["Closing"]


class Closing:
    """A context manager that calls its own :meth:`close` on exit, error or not."""

    __slots__ = ()

    def close(self) -> None:
        """Release what the object holds (each subclass says what); idempotent."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
