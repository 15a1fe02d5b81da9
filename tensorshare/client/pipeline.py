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
from .ops import BLOCK_SHARE, Command, Ops, _version, gc_paused, lone_cpu_tensor

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence

__all__ = ["Pipeline"]


class PipelineHost(Protocol):
    """What a client offers its pipelines."""

    timeout: float
    compress: str | None
    compress_min_bytes: int

    @property
    def limits(self) -> Limits: ...

    def _item(self, name: str, value: Any, tag: int | None) -> Item: ...

    def _items(self, name: str, values: list[Any], tags: list[int | None]) -> list[Item]: ...

    def _run_pipeline(self, pipeline: Pipeline, batch: Iterable[tuple[Command, int]]) -> Any:
        """Send every command of ``batch`` (``(command, how many results it stands for)``,
        made as they are asked for) and return ``pipeline.finish(outcomes)`` (or a Deferred
        of it)."""
        ...


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
        # A queued command, or (an int k) the k-th ``append(name, tensor)`` of a lone CPU
        # tensor, kept in the lists below: no object per append (tens of thousands of them
        # would keep the garbage collector busy), and a batch of them becomes one request.
        self._cmds: list[Command | int] = []
        self._lazy_bins: list[str] = []
        self._lazy_values: list[Any] = []
        self._lazy_tags: list[int | None] = []
        self._lazy_items: list[Item | None] = []  # encoded at execute()
        self._checked = ""  # the last bin name checked by a lone-tensor append
        self._lazy_timeout: float | None = None  # (their appends' timeout, at execute)
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

    def append(self, name: str, value: Any, *, tag: int | None = None,
               wait_room: bool = False) -> Any:
        """As :meth:`Ops.append`; a lone CPU tensor is only queued here (checked, and
        encoded at execute() with the others). An append that waits for room in its user's
        quota (``wait_room``) is sent on its own."""
        if wait_room:
            item = self._host._item(name, value, tag)
            return self._execute(Command(Append(0, name, item, BLOCK_SHARE * self.timeout, (),
                                                wait_room=True), f"append to bin {name!r}",
                                         _version))
        if lone_cpu_tensor(value, tag):
            if self.results is not None:
                raise RuntimeError("this pipeline was executed already; make a new one")
            if name != self._checked:
                self._check_name(name)
                self._checked = name
            self._cmds.append(len(self._lazy_values))
            self._lazy_bins.append(name)
            self._lazy_values.append(value)
            self._lazy_tags.append(tag)
            return len(self._cmds) - 1
        return super().append(name, value, tag=tag)

    def _item(self, name: str, value: Any, tag: int | None) -> Item:
        # Encoded now, as the client encodes: only append's own queue above defers lone
        # tensors (a put, a stream append or a service call goes as it is, never merged).
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
        with gc_paused(len(self._cmds)):  # the batch's items are encoded on the way out too
            return self._host._run_pipeline(self, self._batches())

    def finish(self, outcomes: Sequence[Any], counts: Sequence[int]) -> list[Any]:
        """Record each request's outcome (a result or an exception) for the calls it stood
        for; raise the first error if asked to."""
        results: list[Any] = []
        for outcome, count in zip(outcomes, counts, strict=True):
            results.extend([outcome] * count)
        self.results = results
        self._cmds = []
        self._lazy_bins, self._lazy_values, self._lazy_tags = [], [], []
        self._lazy_items = []
        if self._raise:
            first = next((r for r in results if isinstance(r, BaseException)), None)
            if first is not None:
                raise first
        return results

    def _batches(self) -> Iterator[tuple[Command, int]]:
        """The commands to send, consecutive appends to one bin merged: ``(command, n)``, made
        as they are asked for: queued lone tensors are encoded a request's worth at a time,
        so that a host that sends each request as it comes (the blocking client) has the
        server store one while it encodes the next."""
        cmds = self._cmds
        room = self.limits.max_frame_bytes // 2
        most = self.MAX_BATCH_ITEMS
        self._lazy_timeout = BLOCK_SHARE * self.timeout
        self._lazy_items = [None] * len(self._lazy_values)
        i, n = 0, len(cmds)
        while i < n:
            if type(cmds[i]) is int:
                self._encode_run(i, most)
            first = self._request(i)
            i += 1
            if first is None:
                yield cast(Command, cmds[i - 1]), 1
                continue
            name, item, timeout = first
            items, size = [item], item.value.nbytes
            while i < n and len(items) < most:
                nxt = self._request(i)
                if nxt is None or nxt[0] != name or nxt[2] != timeout or \
                        size + nxt[1].value.nbytes >= room:
                    break
                items.append(nxt[1])
                size += nxt[1].value.nbytes
                i += 1
            what = f"append to bin {name!r}" if len(items) == 1 else \
                f"append of {len(items)} items to bin {name!r}"
            yield Command(Append(0, name, items[0], timeout, tuple(items[1:])), what,
                          _version), len(items)

    def _encode_run(self, i: int, most: int) -> None:
        """Encode the queued lone tensors appended to one bin from command ``i`` on (at most
        ``most``: one request's worth) together (the host's ``_items``: small like tensors
        cost one copy for the run, not a view each). The appends of a run were queued one
        after another: their numbers are consecutive."""
        cmds, bins = self._cmds, self._lazy_bins
        first = cast(int, cmds[i])
        if self._lazy_items[first] is not None:
            return
        j, n = i + 1, min(len(cmds), i + most)
        while j < n and type(cmds[j]) is int and bins[cast(int, cmds[j])] == bins[first]:
            j += 1
        if j - i > 1:
            end = first + (j - i)
            self._lazy_items[first:end] = self._host._items(
                bins[first], self._lazy_values[first:end], self._lazy_tags[first:end])

    def _request(self, i: int) -> tuple[str, Item, float | None] | None:
        """Queued command ``i`` as ``(bin, item, timeout)`` if it is an append (encoding a
        queued lone tensor, once: the command is replaced by its encoded form); else None."""
        cmd = self._cmds[i]
        if type(cmd) is int:
            name, item = self._lazy_bins[cmd], self._lazy_items[cmd]
            if item is None:
                item = self._lazy_items[cmd] = self._host._item(name, self._lazy_values[cmd],
                                                                self._lazy_tags[cmd])
            return name, item, self._lazy_timeout
        req = cast(Command, cmd).request
        if type(req) is not Append or req.wait_room:
            return None
        return req.bin, req.item, req.timeout

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.execute()

