"""Shared fixtures: a real server on 127.0.0.1, port 0, on a private reactor thread; the
parallel run's hooks (tests/parallel.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import hypothesis
import pytest

from tensorshare.server import EmbeddedServer

# The suite runs in parallel by default (pytest-xdist): the hooks are in tests/parallel.py.
from tests.parallel import (  # noqa: F401
    pytest_cmdline_main,
    pytest_collection_modifyitems,
    pytest_configure_node,
    pytest_runtest_protocol,
    pytest_xdist_auto_num_workers,
    pytest_xdist_make_scheduler,
)

# Timing is never asserted in a test (benchmarks show speed), nor by Hypothesis: on a loaded
# machine generating examples may be slow.
hypothesis.settings.register_profile(
    "tensorshare", suppress_health_check=[hypothesis.HealthCheck.too_slow], deadline=None)
hypothesis.settings.load_profile("tensorshare")


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    """A fresh server for one test; stopped afterwards."""
    srv = EmbeddedServer(port=0)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def free_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, read back, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition",
               interval: float = 0.005) -> None:
    """Poll ``condition`` every ``interval`` seconds until it is true; fail the test after
    ``timeout`` seconds. (A condition that costs much, such as one that asks a Ray actor
    which asks others, takes a longer ``interval``: each poll takes CPU from what the test
    waits for.)"""
    deadline = time.monotonic() + timeout
    tick = threading.Event()  # never set: wait() is the poll interval
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        tick.wait(interval)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a test CA and a server certificate it signed (for localhost and
    127.0.0.1), another CA that signed nothing here, and a certificate for ``localhost``
    only (to reach by another name)."""

    ca: str
    cert: str
    key: str
    other_ca: str
    localhost_cert: str
    localhost_key: str


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    import trustme  # a well-kept library makes the certificates, not the test by hand

    where = tmp_path_factory.mktemp("tls")
    ca, other = trustme.CA(), trustme.CA()
    both = ca.issue_cert("localhost", "127.0.0.1")
    local = ca.issue_cert("localhost")
    paths = {name: str(where / f"{name}.pem") for name in
             ("ca", "cert", "key", "other_ca", "localhost_cert", "localhost_key")}
    ca.cert_pem.write_to_path(paths["ca"])
    other.cert_pem.write_to_path(paths["other_ca"])
    for cert, c, k in ((both, "cert", "key"), (local, "localhost_cert", "localhost_key")):
        for i, blob in enumerate(cert.cert_chain_pems):
            blob.write_to_path(paths[c], append=i > 0)
        cert.private_key_pem.write_to_path(paths[k])
    return TlsFiles(**paths)


def interruptible() -> dict[str, Any]:
    """``Popen`` arguments for a child that :func:`interrupt` stops: Ctrl+C at its default
    (a test run started in the background, as ``cmd &`` in a script, passes SIGINT on
    ignored, and Python then never raises KeyboardInterrupt), and every thread's stack
    printed on SIGABRT (so that a child that would not stop says where it was stuck)."""
    return {"env": {**os.environ, "PYTHONFAULTHANDLER": "1"}, "preexec_fn": _default_sigint}


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(proc: subprocess.Popen[Any], timeout: float = 15.0) -> int:
    """Ctrl+C a child process and return its exit status. A child still running after
    ``timeout`` seconds fails the test with its threads' stacks (started with
    :func:`interruptible` and ``stderr=PIPE``), and is killed."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack on stderr
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        err = proc.stderr.read() if proc.stderr is not None else ""
        text = err.decode(errors="replace") if isinstance(err, bytes) else err
        pytest.fail(f"still running {timeout:g} s after SIGINT; its stderr and threads:\n"
                    f"{text[-8000:]}")
