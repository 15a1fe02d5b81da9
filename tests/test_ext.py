"""The compiled hot path and its pure-Python twin (tensorshare._ext).

The modules of ``TWINS`` run as their compiled twins wherever the install built them, and as
the pure ``.py`` files with ``TENSORSHARE_NO_EXTENSIONS=1``; the wire, client and server tests,
malformed frames and limits included, pass both ways (the second way in a subprocess,
below)."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys

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


def _built(name: str) -> bool:
    """Whether the install compiled module ``name``'s twin (it lies beside the .py)."""
    folder = os.path.join(ROOT, *name.split(".")[:-1])
    leaf = _ext.twin_of(name).rpartition(".")[2]
    return any(os.path.exists(os.path.join(folder, leaf + suffix))
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def test_each_module_runs_compiled_exactly_where_it_was_built() -> None:
    forced = os.environ.get(_ext.NO_EXTENSIONS_ENV, "") not in ("", "0")
    assert _ext.compiled() == {name: _built(name) and not forced for name in _ext.TWINS}


def test_a_twin_and_its_source_load_side_by_side() -> None:
    """Where a twin was built it is the module its name imports (the same object), and the
    ``.py`` it was compiled from can still be loaded on its own for comparison."""
    import importlib.util

    for name in _ext.TWINS:
        module = importlib.import_module(name)
        if _built(name) and os.environ.get(_ext.NO_EXTENSIONS_ENV, "") in ("", "0"):
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
    """A twin is typed by the .pxd named after it; the build depends on that file, so that
    changing only the .pxd rebuilds the module."""
    setup_py = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    assert "depends=" in setup_py
    for name in _ext.TWINS:
        pxd = os.path.join(ROOT, *_ext.twin_of(name).split(".")) + ".pxd"
        assert os.path.exists(pxd), f"{name} has no {os.path.basename(pxd)}"
