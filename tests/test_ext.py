"""The compiled hot path and its pure-Python twin (tensorshare._ext).

The modules of ``COMPILED`` run compiled wherever the install built them, and as the pure
``.py`` files with ``TENSORSHARE_NO_EXTENSIONS=1``; the wire and client tests, malformed frames
and limits included, pass both ways (the second way in a subprocess, below)."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
from typing import Any

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
              "tests/client/test_fork_and_takeover.py"]


def _built(name: str) -> bool:
    """Whether the install compiled module ``name`` (its extension lies beside the .py)."""
    folder = os.path.join(ROOT, *name.split(".")[:-1])
    leaf = name.rpartition(".")[2]
    return any(os.path.exists(os.path.join(folder, leaf + suffix))
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def test_each_module_runs_compiled_exactly_where_it_was_built() -> None:
    forced = os.environ.get(_ext.NO_EXTENSIONS_ENV, "") not in ("", "0")
    assert _ext.compiled() == {name: _built(name) and not forced for name in _ext.COMPILED}


def test_no_extensions_runs_the_pure_python_modules() -> None:
    code = ("from tensorshare import _ext; import tensorshare.wire.protocol as p; "
            "assert not any(_ext.compiled().values()); assert p.__file__.endswith('.py'); "
            "print('pure')")
    out = subprocess.run([sys.executable, "-c", code], env=PURE, capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "pure", out.stderr


def test_the_server_says_which_hot_path_it_runs() -> None:
    from tensorshare.cli.main import _hot_path_line

    wire = [name for name in _ext.COMPILED if name.startswith("tensorshare.wire.")]
    line = _hot_path_line()
    assert line.startswith("hot path: compiled" if all(_ext.compiled(wire).values())
                           else "hot path: pure Python")


@pytest.mark.long
@pytest.mark.timeout(900)
def test_the_wire_and_client_tests_pass_on_the_pure_path() -> None:
    """The same cases on the reference modules (in the default run, the compiled ones
    served them, where built)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          *TWIN_TESTS], env=PURE, capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout.splitlines()[-1], out.stdout[-500:]


def test_a_source_changed_after_compiling_runs_as_pure_python(tmp_path: Any) -> None:
    """An edited checkout that was not rebuilt must not run the old build: the newer
    source runs, with a warning that says to rebuild. (The stale "compiled" module here is an
    empty file, never loaded.)"""
    copy = tmp_path / "tensorshare"
    shutil.copytree(os.path.join(ROOT, "tensorshare"), copy,
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    stale = copy / "wire" / ("protocol" + importlib.machinery.EXTENSION_SUFFIXES[0])
    stale.write_bytes(b"")
    os.utime(stale, (1_000_000, 1_000_000))  # older than every source
    code = ("import warnings; warnings.simplefilter('always'); "
            "import tensorshare.wire.protocol as p; print(p.__file__)")
    env = {k: v for k, v in os.environ.items() if k != _ext.NO_EXTENSIONS_ENV}
    env["PYTHONPATH"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(copy / "wire" / "protocol.py")
    assert "changed after it was compiled" in out.stderr
