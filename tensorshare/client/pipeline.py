"""Pipelines: many requests queued locally and sent together, without waiting for each reply.

A :class:`Pipeline` is one more face of the op surface (:mod:`.ops`): each op queues its
command and returns the index its result will have. :meth:`Pipeline.execute` groups
consecutive appends to one bin into one request (all stored or none, one new version) and
hands the batch to the client that made the pipeline, which sends it in one write: the
blocking client waits for every reply, the Twisted client returns a ``Deferred``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

from ..wire.messages import Append, Item, Limits
from .ops import Command, Ops, _version, gc_paused, lone_cpu_tensor

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["Pipeline"]


class PipelineHost(Protocol):
    """What a client offers its pipelines."""

    timeout: float
    compress: str | None
    compress_min_bytes: int

    @property
    def limits(self) -> Limits: ...

    def _item(self, name: str, value: Any, tag: int | None) -> Item: ...

    def _run_pipeline(self, pipeline: Pipeline, batch: Sequence[tuple[Command, int]]) -> Any:
        """Send every command of ``batch`` (``(command, how many results it stands for)``)
        and return ``pipeline.finish(outcomes)`` (or a Deferred of it)."""
        ...


class _Lazy:
    """A lone CPU tensor queued for append, encoded at execute() (many at a time, with the
    garbage collector paused) rather than at the call."""

    __slots__ = ("value", "tag")

    def __init__(self, value: Any, tag: int | None) -> None:
        self.value, self.tag = value, tag


class Pipeline(Ops):
    """Requests queued locally and sent together (see ``Client.pipeline()``).

    Each op (the same as the client's: put, append, get, peek, fetch, delete, configure,
    list, stats, ping) returns the index its result will have in :attr:`results`. Local
    mistakes raise at the call; the requests go out when the ``with`` block ends (or at
    :meth:`execute`).

    Attributes:
        results: after :meth:`execute`, what each call returned, in order; a call that
            failed holds its exception instead.
    """

    #: Most items one append request carries (more go in the next one).
    MAX_BATCH_ITEMS = 10_000

    def __init__(self, host: PipelineHost, raise_on_error: bool = True) -> None:
        self._host = host
        self._raise = raise_on_error
        self._cmds: list[Command] = []
        self.results: list[Any] | None = None
        self._limits, self.timeout = host.limits, host.timeout
        self.compress, self.compress_min_bytes = host.compress, host.compress_min_bytes

    @property
    def limits(self) -> Limits:
        return self._limits

    def __len__(self) -> int:
        return len(self._cmds)

    def _execute(self, cmd: Command) -> int:
        if self.results is not None:
            raise RuntimeError("this pipeline was executed already; make a new one")
        if cmd.kind != "call":
            raise TypeError(f"{cmd.kind} cannot be pipelined; call it on the client")
        self._cmds.append(cmd)
        return len(self._cmds) - 1

    def _item(self, name: str, value: Any, tag: int | None) -> Item:
        if lone_cpu_tensor(value, tag):
            self._check_name(name)
            return cast(Item, _Lazy(value, tag))
        return self._host._item(name, value, tag)

    def execute(self) -> Any:
        """Send every queued request and wait for every reply (the blocking client), or
        return a Deferred firing with the results (the Twisted client).

        Returns:
            :attr:`results`.

        Raises:
            the first error among the results (with ``raise_on_error``, the default).
        """
        if self.results is not None:
            return self.results
        with gc_paused(len(self._cmds)):
            batch = self._batch()
        return self._host._run_pipeline(self, batch)

    def finish(self, outcomes: Sequence[Any], counts: Sequence[int]) -> list[Any]:
        """Record each request's outcome (a result or an exception) for the calls it stood
        for; raise the first error if asked to."""
        results: list[Any] = []
        for outcome, count in zip(outcomes, counts, strict=True):
            results.extend([outcome] * count)
        self.results = results
        self._cmds = []
        if self._raise:
            first = next((r for r in results if isinstance(r, BaseException)), None)
            if first is not None:
                raise first
        return results

    def _batch(self) -> list[tuple[Command, int]]:
        """The commands to send, consecutive appends to one bin merged: ``(command, n)``."""
        cmds = [self._materialize(c) for c in self._cmds]
        room = self.limits.max_frame_bytes // 2
        out: list[tuple[Command, int]] = []
        i, n = 0, len(cmds)
        while i < n:
            cmd = cmds[i]
            req = cmd.request
            i += 1
            if type(req) is not Append:
                out.append((cmd, 1))
                continue
            items, size = [req.item], req.item.value.nbytes
            while i < n and len(items) < self.MAX_BATCH_ITEMS:
                nxt = cmds[i].request
                if type(nxt) is not Append or nxt.bin != req.bin or \
                        size + nxt.item.value.nbytes >= room:
                    break
                items.append(nxt.item)
                size += nxt.item.value.nbytes
                i += 1
            if len(items) > 1:
                cmd = Command(Append(0, req.bin, items[0], req.timeout, tuple(items[1:])),
                              f"append of {len(items)} items to bin {req.bin!r}", _version)
            out.append((cmd, len(items)))
        return out

    def _materialize(self, cmd: Command) -> Command:
        req = cmd.request
        if type(req) is Append and type(req.item) is _Lazy:
            lazy = cast(_Lazy, req.item)
            item = self._host._item(req.bin, lazy.value, lazy.tag)
            return Command(Append(0, req.bin, item, req.timeout), cmd.what, cmd.convert)
        return cmd

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.execute()

