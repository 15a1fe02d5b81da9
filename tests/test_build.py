"""The build of the compiled twins (setup.py), as pip runs it for ``pip install -e .``.

From a copy of the tree with no build in it (as a fresh clone has) and two twins in
``TWINS``, setuptools' PEP 517 hook ``build_editable`` is run three times: the first compiles
both twins in place, typed by their ``.pxd`` through the one-line ``X_c.pxd`` the build
writes under ``build/``; the second (nothing changed, as for the README's second command)
compiles nothing; the third, after an edit to one ``.pxd``, compiles that twin only.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Two small twins, one of which cimports nothing and one that is cimported by others.
TWINS = ("tensorshare.wire.frames", "tensorshare.client.election")


def _setup_py(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """setup.py's functions (imported: only a run as a script calls setup()), run from the
    project's root as the build runs them."""
    monkeypatch.chdir(ROOT)
    spec = importlib.util.spec_from_file_location("tensorshare_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_twin_depends_on_its_sources_and_every_pxd_it_cimports(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Changing a .pxd rebuilds the twins compiled against it too (connection cimports
    protocol's types, and protocol frames'): one compiled against another's old declarations
    would fail to load."""
    setup_py = _setup_py(monkeypatch)
    depends = set(setup_py.twin_extension("tensorshare.server.connection").depends)
    assert {"tensorshare/server/connection.py", "tensorshare/server/connection.pxd",
            "build/twins/pxd/tensorshare/server/connection_c.pxd",
            "tensorshare/wire/protocol.pxd", "tensorshare/wire/frames.pxd",
            "tensorshare/server/handlers.pxd"} <= depends
    assert set(setup_py.twin_extension("tensorshare.client.election").depends) == {
        "tensorshare/client/election.py", "tensorshare/client/election.pxd",
        "build/twins/pxd/tensorshare/client/election_c.pxd"}


def _tree(tmp_path: Path) -> Path:
    """The sources a fresh clone has (no build/, no compiled module), with :data:`TWINS`."""
    dst = tmp_path / "tree"
    shutil.copytree(ROOT / "tensorshare", dst / "tensorshare",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dst / name)
    ext = dst / "tensorshare" / "_ext.py"
    text, n = re.subn(r"^TWINS = \(.*?\n\)", f"TWINS = {TWINS!r}", ext.read_text(),
                      count=1, flags=re.S | re.M)
    assert n == 1, "tensorshare/_ext.py: no TWINS tuple found"
    ext.write_text(text)
    return dst


def _build_editable(tree: Path) -> str:
    """Runs setuptools' build_editable hook in ``tree`` (what pip runs); its output."""
    code = ("import sys; from setuptools import build_meta; "
            "build_meta.build_editable(sys.argv[1])")
    # (what this file checks is the compiling build: a pure-path run of the suite, with
    # TENSORSHARE_NO_EXTENSIONS set, must not make the build skip the twins)
    env = {k: v for k, v in os.environ.items() if k != "TENSORSHARE_NO_EXTENSIONS"}
    out = subprocess.run([sys.executable, "-c", code, str(tree / "wheels")], cwd=tree,
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def _compiled(tree: Path, name: str) -> Path:
    base = tree.joinpath(*name.split("."))
    return base.parent / (base.name + "_c" + importlib.machinery.EXTENSION_SUFFIXES[0])


def _have_a_compiler() -> bool:
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    return bool(cc) and shutil.which(cc[0]) is not None


@pytest.mark.long
@pytest.mark.timeout(900)
def test_the_build_compiles_each_twin_once_and_again_only_when_its_sources_change(
        tmp_path: Path) -> None:
    pytest.importorskip("Cython", reason="Cython (the test extra) builds the twins")
    if not _have_a_compiler():
        pytest.skip("no C compiler here: the install runs the pure-Python modules")
    tree = _tree(tmp_path)
    said = _build_editable(tree)
    built = {name: _compiled(tree, name) for name in TWINS}
    assert all(p.exists() for p in built.values()), said[-3000:]
    assert "not compiled again" not in said
    for name in TWINS:  # the augmenting .pxd: written under build/, never in the tree
        source = name.replace(".", "/")
        assert (tree / "build" / "twins" / "pxd" / f"{source}_c.pxd").exists()
        assert not (tree / f"{source}_c.pxd").exists()
    # Typed by the .pxd: a cdef class, its declared attribute a descriptor of the type.
    probe = ("import tensorshare.client.election_c as e; "
             "print(type(vars(e.ReadElection)['linger']).__name__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tree, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(tree)})
    assert out.stdout.strip() in ("getset_descriptor", "member_descriptor"), out

    first = {name: p.stat().st_mtime_ns for name, p in built.items()}
    said = _build_editable(tree)  # nothing changed: nothing compiled
    assert said.count("not compiled again") == len(TWINS), said[-3000:]
    assert {name: p.stat().st_mtime_ns for name, p in built.items()} == first

    pxd = tree / "tensorshare" / "client" / "election.pxd"
    pxd.write_text(pxd.read_text() + "\n# edited\n")
    later = pxd.stat().st_mtime + 2
    os.utime(pxd, (later, later))  # (surely newer, whatever the file system's resolution)
    said = _build_editable(tree)  # the edited twin only
    assert said.count("not compiled again") == 1, said[-3000:]
    assert built["tensorshare.client.election"].stat().st_mtime_ns != first[
        "tensorshare.client.election"]
    assert built["tensorshare.wire.frames"].stat().st_mtime_ns == first[
        "tensorshare.wire.frames"]
