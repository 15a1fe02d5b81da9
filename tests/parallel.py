"""The suite in parallel (pytest-xdist), by default: hooks that ``tests/conftest.py`` takes in.

* Without ``-n``, ``python3 -m pytest`` runs on :func:`pytest_xdist_auto_num_workers`
  workers (``-n 0`` or ``-p no:xdist``: in one process, to debug). Not in ``addopts``: there
  ``-n`` would make ``-p no:xdist`` an error.
* The tests of one ``xdist_group`` run on one worker, one after the other: the Ray cluster of
  ``tests/ray``, the browser of ``tests/dashboard/test_browser.py``, the learning runs of
  ``tests/system/test_examples.py`` (which would only slow each other down). pytest-xdist's
  own ``--dist loadgroup`` names a test's group in its node id, which pytest 9.2 no longer
  lets it change (pytest-xdist issue 1386): here each worker writes the groups it collected
  to a file of the run, and the scheduler reads them from there.
* The long tests start first, and a test marked ``alone`` (it measures the whole machine, or
  hands off between threads and processes at every step) runs last, while no other test
  does (:class:`Alone`).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

#: Set to a number of worker processes for the default run (``0``: no workers, one process).
WORKERS_ENV = "PYTEST_XDIST_AUTO_NUM_WORKERS"
RUN_KEY = "tensorshare_run"  # workerinput: the run's temporary folder, which all workers share


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Without ``-n``: ``-n auto``, grouped. (Runs before xdist's hook, which reads these.)"""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    if config.option.numprocesses is None:
        config.option.numprocesses = "auto"  # ("auto" gives way to --pdb)
    if config.option.dist == "no" and config.option.numprocesses not in (0, "0"):
        config.option.dist = "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Workers for ``-n auto`` (the default): twice the cores this process may run on, as
    most tests wait on sockets and child processes rather than compute, up to 8 (each holds
    torch and the suite in memory, and past that the longest tests set the pace);
    ``$PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides it."""
    given = os.environ.get(WORKERS_ENV)
    if given:
        return int(given)
    return min(2 * len(os.sched_getaffinity(0)), 8)


# -- groups ------------------------------------------------------------------------------------
def _run_folder(config: pytest.Config) -> str:
    """The run's temporary folder: the workers' own are in it."""
    return str(config._tmp_path_factory.getbasetemp())  # type: ignore[attr-defined]


def _groups_file(folder: str) -> str:
    return os.path.join(folder, "xdist-groups.json")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    node.workerinput[RUN_KEY] = _run_folder(node.config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GroupScheduling(LoadGroupScheduling):  # type: ignore[misc]
        """``loadgroup``, the groups read from the workers' file."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # (read once every worker has collected)
                with open(_groups_file(_run_folder(config)), encoding="utf-8") as f:
                    self.groups = json.load(f)
            return self.groups.get(nodeid) or str(super()._split_scope(nodeid))

    return GroupScheduling(config, log)


def write_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a worker: write ``{node id: group}`` where the scheduler reads it (every worker
    writes the same: each replaces the file whole)."""
    folder = getattr(config, "workerinput", {}).get(RUN_KEY)
    if folder is None:
        return
    groups = {}
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names:
            groups[item.nodeid] = "_".join(names)
    mine = f"{_groups_file(folder)}.{config.workerinput['workerid']}"  # type: ignore[attr-defined]
    with open(mine, "w", encoding="utf-8") as f:
        json.dump(groups, f)
    os.replace(mine, _groups_file(folder))


# -- the order, and the tests that run alone -----------------------------------------------------
def _order(item: pytest.Item) -> tuple[int, float]:
    """The long tests first, so that a parallel run starts them at once instead of ending on
    them, those that may run longest (the largest ``timeout`` mark) before the others; the
    tests that must run alone last (they wait for all the others)."""
    timeout = item.get_closest_marker("timeout")
    longest = -float(timeout.args[0]) if timeout is not None and timeout.args else 0.0
    if item.get_closest_marker("alone"):
        return 2, longest
    return (0 if item.get_closest_marker("long") else 1), longest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_order)  # (stable: otherwise in the order collected)
    write_groups(config, items)


class Alone:
    """Across the workers of one parallel run, a test marked ``alone`` runs while no other
    test does; every other test may run beside any but those. A readers-writer lock of ``flock`` on two files in the
    run's temporary folder, the writer first: a test marked ``alone`` closes the gate to the
    tests that have yet to start, then waits for the running ones to end."""

    def __init__(self, folder: str) -> None:
        self.gate = os.open(os.path.join(folder, "alone.gate"), os.O_RDWR | os.O_CREAT, 0o600)
        self.room = os.open(os.path.join(folder, "alone.room"), os.O_RDWR | os.O_CREAT, 0o600)

    def enter(self, alone: bool) -> None:
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.gate, fcntl.LOCK_UN)

    def leave(self) -> None:
        fcntl.flock(self.room, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """In a worker, each test (setup, call and teardown, before its timeout starts) holds
    :class:`Alone`; in one process every test runs alone anyway."""
    folder = getattr(item.config, "workerinput", {}).get(RUN_KEY)
    if folder is None:
        yield
        return
    lock = getattr(item.config, "_tensorshare_alone", None)
    if lock is None:
        lock = Alone(folder)
        item.config._tensorshare_alone = lock  # type: ignore[attr-defined]
    lock.enter(item.get_closest_marker("alone") is not None)
    try:
        yield
    finally:
        lock.leave()
