"""The compiled hot path and its pure-Python twin (tensorshare._ext).

The modules of ``TWINS`` run as their compiled twins wherever the install built them, and as
the pure ``.py`` files with ``TENSORSHARE_NO_EXTENSIONS=1``; the wire, client and server tests,
malformed frames and limits included, pass both ways (the second way in a subprocess,
below)."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from tensorshare import _ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PURE = {**os.environ, _ext.NO_EXTENSIONS_ENV: "1"}

# The tests of the compiled modules, run again on the pure path.
TWIN_TESTS = [
    # (first: with the variable set it asserts that nothing runs compiled in that process)
    "tests/test_ext.py::test_each_module_runs_compiled_exactly_where_it_was_built",
    "tests/wire", "tests/client/test_session.py", "tests/client/test_election.py",
    "tests/client/test_blocking_scripted.py", "tests/client/test_pipeline.py",
    "tests/client/test_fork_and_takeover.py", "tests/server/test_connection.py",
    "tests/server/test_store.py", "tests/server/test_session_table.py",
    "tests/server/test_limits.py", "tests/server/test_transports.py",
    "tests/server/test_churn.py"]


def _built(name: str, root: str = ROOT) -> str | None:
    """The compiled file of module ``name``'s twin, where the install built one (beside the
    .py)."""
    folder = os.path.join(root, *name.split(".")[:-1])
    leaf = _ext.twin_of(name).rpartition(".")[2]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if os.path.exists(os.path.join(folder, leaf + suffix)):
            return os.path.join(folder, leaf + suffix)
    return None


def _fresh(name: str, root: str = ROOT) -> bool:
    """Whether a twin was built and is newer than its .py and its .pxd."""
    built = _built(name, root)
    source = os.path.join(root, *name.split("."))
    return built is not None and all(
        os.path.getmtime(built) >= os.path.getmtime(source + ext) for ext in (".py", ".pxd"))


def _runs_compiled(name: str) -> bool:
    """Where a twin is expected to run: built, not forced pure, and no twin stale."""
    forced = os.environ.get(_ext.NO_EXTENSIONS_ENV, "") not in ("", "0")
    none_stale = all(_fresh(n) for n in _ext.TWINS if _built(n))
    return _built(name) is not None and none_stale and not forced


def test_each_module_runs_compiled_exactly_where_it_was_built() -> None:
    assert _ext.compiled() == {name: _runs_compiled(name) for name in _ext.TWINS}


def test_a_twin_and_its_source_load_side_by_side() -> None:
    """Where a twin was built it is the module its name imports (the same object), and the
    ``.py`` it was compiled from can still be loaded on its own for comparison."""
    import importlib.util

    for name in _ext.TWINS:
        module = importlib.import_module(name)
        if _runs_compiled(name):
            assert module is importlib.import_module(_ext.twin_of(name))
            assert not module.__file__.endswith(".py")
        else:
            assert module.__file__.endswith(".py")
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None


def test_no_extensions_runs_the_pure_python_modules() -> None:
    code = ("from tensorshare import _ext; import tensorshare.wire.protocol as p; "
            "assert not any(_ext.compiled().values()); assert p.__file__.endswith('.py'); "
            "print('pure')")
    out = subprocess.run([sys.executable, "-c", code], env=PURE, capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "pure", out.stderr


def test_the_server_says_which_hot_path_it_runs() -> None:
    from tensorshare.cli.main import _hot_path_line

    mine = [name for name in _ext.TWINS if name.startswith(("tensorshare.wire.",
                                                            "tensorshare.server."))]
    line = _hot_path_line()
    assert line.startswith("hot path: compiled" if all(_ext.compiled(mine).values())
                           else "hot path: pure Python")


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tests", TWIN_TESTS)
def test_the_wire_and_client_tests_pass_on_the_pure_path(tests: str) -> None:
    """The same cases on the reference modules (in the default run, the compiled ones
    served them, where built): a process for each entry of ``TWIN_TESTS``, so that a
    parallel run spreads them over its workers (each process runs its tests one by one)."""
    env = {k: v for k, v in PURE.items() if not k.startswith("PYTEST_XDIST_")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          "-p", "no:xdist", tests], env=env, capture_output=True, text=True,
                         timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout.splitlines()[-1], out.stdout[-500:]


def test_every_twin_has_its_pxd_and_the_build_lists_it() -> None:
    """A twin is typed by the .pxd of its module's name; the build depends on that file (and
    on the .py), so that changing only the .pxd rebuilds the module. The one-line X_c.pxd
    that includes it is the build's (under build/), never a file of the tree."""
    setup_py = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    assert "depends=" in setup_py and "annotation_typing\": False" in setup_py
    for name in _ext.TWINS:
        base = os.path.join(ROOT, *name.split("."))
        assert os.path.exists(base + ".pxd"), f"{name} has no {os.path.basename(base)}.pxd"
        assert not os.path.exists(base + "_c.pxd"), f"{base}_c.pxd: the build writes it"


# --- a stale twin (a compiled module older than its .py or .pxd) -------------------------------
# Each case works on a copy of the package in a temporary folder (times copied too); the tree
# the tests run from is never made stale. Where the tree has no compiled twin (a pure install),
# the copy gets an empty file of that name: a stale one is never loaded, so it need not be real.

# Imports every twin, asks the finder again for each (a second import of the same name), and
# prints where frames came from and which modules run compiled.
_PROBE = """
import sys
import tensorshare.wire.frames as frames
from tensorshare import _ext
compiled = _ext.compiled()
for finder in sys.meta_path:
    for name in _ext.TWINS * (type(finder).__name__ == "_TwinFinder"):
        finder.find_spec(name, None)
print(frames.__file__)
print(",".join(sorted(name for name, c in compiled.items() if c)))
print(_ext.pure_reason())
"""


def _copy(tmp_path: Path, fake_missing: bool) -> Path:
    """The package copied under ``tmp_path`` with every twin fresh (compiled after its
    sources), where built (or, with ``fake_missing``, everywhere)."""
    shutil.copytree(os.path.join(ROOT, "tensorshare"), tmp_path / "tensorshare",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in _ext.TWINS:
        base = tmp_path.joinpath(*name.split("."))
        built = _built(name, str(tmp_path))
        if built is None and fake_missing:
            built = str(base) + "_c" + importlib.machinery.EXTENSION_SUFFIXES[0]
            Path(built).write_bytes(b"")
        if built is not None:
            newest = max(os.path.getmtime(f"{base}.py"), os.path.getmtime(f"{base}.pxd"))
            os.utime(built, (newest + 10, newest + 10))
    return tmp_path


class Probe(NamedTuple):
    frames_file: str  # where tensorshare.wire.frames came from
    compiled: list[str]  # the modules running compiled
    warned: list[str]  # the RuntimeWarning lines
    reason: str  # _ext.pure_reason() (what the CLI says of a pure hot path)


def _probe(root: Path, **env: str) -> Probe:
    """What a fresh interpreter that imports tensorshare from ``root`` runs and says, with
    every warning shown."""
    environ = {k: v for k, v in os.environ.items() if k != _ext.NO_EXTENSIONS_ENV}
    environ.update(PYTHONPATH=str(root), **env)
    out = subprocess.run([sys.executable, "-W", "always::RuntimeWarning", "-c", _PROBE],
                         env=environ, capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    frames_file, compiled, reason = out.stdout.split("\n")[:3]
    warned = [line for line in out.stderr.splitlines() if "RuntimeWarning" in line]
    return Probe(frames_file, [c for c in compiled.split(",") if c], warned, reason)


def _touch_newer(path: Path) -> None:
    """Make ``path`` newer than every file of the copy (its twin included)."""
    later = max(os.path.getmtime(path), time.time()) + 3600
    os.utime(path, (later, later))


@pytest.mark.parametrize("edited", ["wire/frames.py", "client/session.pxd"])
def test_a_stale_twin_warns_once_and_the_pure_modules_run(tmp_path: Path, edited: str) -> None:
    root = _copy(tmp_path, fake_missing=True)
    source = root / "tensorshare" / edited
    _touch_newer(source)
    probe = _probe(root)
    assert probe.frames_file == str(root / "tensorshare" / "wire" / "frames.py")
    assert probe.compiled == []  # every twin: the .py (a compiled one cannot sit beside a stale one)
    assert len(probe.warned) == 1, probe.warned  # once, though every twin was looked up twice
    twin = _built(f"tensorshare.{edited.rpartition('.')[0].replace('/', '.')}", str(root))
    for what in (str(twin), str(source), "pip install -e .", "setup.py build_ext --inplace"):
        assert what in probe.warned[0], (what, probe.warned[0])
    assert probe.reason.startswith("a stale build: ") and str(source) in probe.reason


def test_no_extensions_runs_pure_without_a_word_about_a_stale_twin(tmp_path: Path) -> None:
    root = _copy(tmp_path, fake_missing=True)
    _touch_newer(root / "tensorshare" / "wire" / "frames.py")
    probe = _probe(root, **{_ext.NO_EXTENSIONS_ENV: "1"})
    assert probe.frames_file.endswith(".py") and probe.compiled == [] and probe.warned == []
    assert probe.reason == f"{_ext.NO_EXTENSIONS_ENV} is set"


def test_a_fresh_build_runs_compiled_without_a_warning(tmp_path: Path) -> None:
    """(Compiled where this tree has its twins built; on a pure install, pure, and quiet.)"""
    root = _copy(tmp_path, fake_missing=False)
    probe = _probe(root)
    assert probe.warned == []
    assert probe.compiled == sorted(n for n in _ext.TWINS if _built(n, str(root)))
    assert probe.frames_file.endswith(".py") == (
        _built("tensorshare.wire.frames", str(root)) is None)


def test_stale_names_each_twin_older_than_a_source(tmp_path: Path) -> None:
    root = _copy(tmp_path, fake_missing=True)
    assert _ext.stale(str(root / "tensorshare")) == []
    _touch_newer(root / "tensorshare" / "server" / "store.pxd")
    (found,) = _ext.stale(str(root / "tensorshare"))
    assert found.module == "tensorshare.server.store"
    assert found.source == str(root / "tensorshare" / "server" / "store.pxd")
