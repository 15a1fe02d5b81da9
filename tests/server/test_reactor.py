"""The server's reactor (tensorshare.server.reactor): the lean epoll reactor where this
Twisted has, and behaves as, the privates it uses; Twisted's own otherwise, with one log line
saying why. And the server's tests on the oldest Twisted that setup.py allows."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import twisted
from packaging.version import Version
from twisted.internet.epollreactor import EPollReactor
from twisted.logger import formatEvent, globalLogPublisher

from tensorshare import Client
from tensorshare.server import EmbeddedServer
from tensorshare.server import reactor as lean

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_check() -> Iterator[None]:
    """The check's verdict is cached per process: made again for this test, and after it."""
    lean.lean_unsupported.cache_clear()
    yield
    lean.lean_unsupported.cache_clear()


@pytest.fixture
def logged() -> Iterator[list[str]]:
    """The lines the server logs through twisted.logger while the test runs."""
    lines: list[str] = []

    def observe(event: dict[str, Any]) -> None:
        if event.get("log_namespace", "").startswith("tensorshare"):
            lines.append(formatEvent(event))

    globalLogPublisher.addObserver(observe)
    yield lines
    globalLogPublisher.removeObserver(observe)


def test_the_lean_path_runs_on_this_twisted(fresh_check: None, logged: list[str]) -> None:
    """The check passes, the server gets the lean reactor, and a request's read events really
    take the lean path (on the Twisted this runs on: the newest installed, or the oldest
    supported in the test below)."""
    assert lean.lean_unsupported() is None, twisted.__version__
    with EmbeddedServer(port=0) as server:
        assert type(server.reactor) is lean.LeanEPollReactor
        reads: list[Any] = []
        direct = server.reactor._lean_read

        def counted(selectable: Any) -> None:
            reads.append(selectable)
            direct(selectable)

        server.reactor._lean_read = counted  # type: ignore[method-assign]
        with Client("127.0.0.1", server.port) as client:
            client.put("x", 1)
            assert client.get("x") == 1
        assert reads, "no read event took the lean path"
    assert not [line for line in logged if "lean reactor" in line]


# Each break is made on LeanEPollReactor only, as a newer Twisted would make it: Twisted's own
# reactor keeps working (with whatever it renamed), and the server falls back to it.


def _no_read(self: Any, selectable: Any, fd: int, event: int) -> None:
    """A _doReadOrWrite that changed its behaviour: it reads nothing."""


def _gone(name: str) -> property:
    def get(self: Any) -> Any:
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
    return property(get)


def _renamed(name: str) -> Callable[[pytest.MonkeyPatch], None]:
    """A break: the instance attribute ``name`` that __init__ sets goes by another name."""
    def apply(mp: pytest.MonkeyPatch) -> None:
        init = lean.LeanEPollReactor.__init__

        def patched(self: Any) -> None:
            init(self)
            setattr(self, f"_new{name}", self.__dict__.pop(name))
        mp.setattr(lean.LeanEPollReactor, "__init__", patched)
    return apply


BREAKS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "_disconnectSelectable": lambda mp: mp.setattr(lean.LeanEPollReactor, "_disconnectSelectable",
                                                   _gone("_disconnectSelectable")),
    "_selectables": _renamed("_selectables"),
    "_poller": _renamed("_poller"),
    "_doReadOrWrite": lambda mp: mp.setattr(lean.LeanEPollReactor, "_doReadOrWrite", _no_read),
}


@pytest.mark.parametrize("private", sorted(BREAKS))
def test_a_twisted_without_what_the_lean_path_uses_gets_its_own_reactor(
        private: str, monkeypatch: pytest.MonkeyPatch, fresh_check: None,
        logged: list[str]) -> None:
    BREAKS[private](monkeypatch)
    why = lean.lean_unsupported()
    assert why is not None and private in why, why
    with EmbeddedServer(port=0) as server:
        assert type(server.reactor) is EPollReactor  # Twisted's own, unchanged
        with Client("127.0.0.1", server.port) as client:
            client.put("x", 1)
            assert client.get("x") == 1  # and it serves
    said = [line for line in logged if "lean reactor" in line]
    assert len(said) == 1, said
    assert twisted.__version__ in said[0] and why in said[0]


def test_the_check_leaves_no_descriptor_behind(fresh_check: None) -> None:
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        lean.lean_unsupported.cache_clear()
        assert lean.lean_unsupported() is None
    assert len(os.listdir("/proc/self/fd")) <= before


# --- the oldest supported Twisted --------------------------------------------------------------

# The server's tests (the long runs aside): about a minute, and every Twisted API the server
# uses: the reactor (above), the transports (lean and stock, TCP and Unix, descriptors
# passed), TLS, persistence, metrics, every kind of bin.
OLDEST_TWISTED_TESTS = ["tests/server"]
# What pip says when it cannot reach the package index (then the test is skipped, saying so).
UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name "
               "resolution", "Network is unreachable", "Could not fetch URL")


def oldest_supported_twisted() -> str:
    """The lower bound of ``twisted`` in setup.py's install_requires."""
    text = (ROOT / "setup.py").read_text(encoding="utf-8")
    match = re.search(r'"twisted\[tls\]>=([0-9.]+)', text)
    assert match, "setup.py names no lower bound for twisted"
    return match.group(1)


def _twisted_at(version: str, config: pytest.Config) -> Path:
    """A folder holding Twisted ``version`` alone (its dependencies are this environment's),
    installed there once and kept (in pytest's cache, else the temporary folder)."""
    cache = getattr(config, "cache", None)
    name = f"twisted-{version}-py{sys.version_info[0]}{sys.version_info[1]}"
    root = cache.mkdir(name) if cache is not None else Path(tempfile.gettempdir()) / name
    root.mkdir(parents=True, exist_ok=True)
    site = root / "site"
    if (site / "twisted" / "__init__.py").exists():
        return site
    staging = Path(tempfile.mkdtemp(prefix="staging-", dir=root))
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                          "--target", str(staging), f"twisted=={version}"],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        said = out.stdout + out.stderr
        if any(sign in said for sign in UNREACHABLE):
            pytest.skip(f"the package index is unreachable: cannot install Twisted {version}")
        raise AssertionError(f"pip could not install Twisted {version}:\n{said[-3000:]}")
    shutil.rmtree(site, ignore_errors=True)  # (a half install is never used)
    staging.rename(site)
    return site


@pytest.mark.long
@pytest.mark.timeout(900)
def test_the_server_tests_pass_on_the_oldest_supported_twisted(
        request: pytest.FixtureRequest) -> None:
    """The server's tests, the lean reactor's among them, on the oldest Twisted setup.py
    allows (shadowing the installed one on PYTHONPATH); the default run covers the newest."""
    version = oldest_supported_twisted()
    where = _twisted_at(version, request.config)
    path = os.pathsep.join([str(where), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path}
    seen = subprocess.run([sys.executable, "-c", "import twisted; print(twisted.__version__)"],
                          env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert Version(seen.stdout.strip()) == Version(version), seen.stdout + seen.stderr
    # (-m "not long": not this test again, nor the long runs of those files)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          "-m", "not long", *OLDEST_TWISTED_TESTS], env=env,
                         capture_output=True, text=True, timeout=880, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout.splitlines()[-1], out.stdout[-500:]
