"""The compiled hot path and its pure-Python twin, chosen in this one place.

Each module of :data:`TWINS` is one ``.py`` source, the reference, which runs as it is. Where
the package was installed with a C compiler, ``setup.py`` also compiled that same source with
Cython under its own name, the module's name with ``_c`` appended
(``tensorshare/wire/frames.py`` -> ``tensorshare.wire.frames_c``), typed by ``frames.pxd``
beside it: the declarations (cdef classes with declared attributes, typed locals) that other
twins cimport by the module's own name (``from tensorshare.wire.frames cimport
FrameDecoder``), so that a ``.py``'s ordinary imports are the typed ones in its twin. (Cython
types module ``frames_c`` by a file named ``frames_c.pxd``: the build writes that one line,
``include "tensorshare/wire/frames.pxd"``, under ``build/twins/pxd``; it is not committed.) The
``.py`` needs no ``import cython``; ``tests/test_pxd.py`` checks that each ``.pxd`` declares
what its ``.py`` assigns, and nothing the ``.py`` lacks. As aiohttp does with its WebSocket
reader (``reader_py.py`` compiled as ``reader_c``), the twin is a second *build*, never a
second implementation.

Importing a module of :data:`TWINS` by its own name gives its compiled twin where one was
built, else the ``.py``; ``TENSORSHARE_NO_EXTENSIONS=1`` (set before tensorshare is imported)
forces the ``.py`` modules (as ``AIOHTTP_NO_EXTENSIONS`` does): the test command runs the wire,
client and server tests both ways. A twin can also be imported by its own name beside the
``.py`` module (tests compare the two). :func:`compiled` says which modules run compiled.

A compiled module older than its ``.py`` or its ``.pxd`` is *stale*: after ``pip install -e .``,
editing a twin's source changes nothing until the next build. Where any twin is stale, every
module of :data:`TWINS` loads as its ``.py`` (the twins cimport each other's types: a compiled
module beside a stale one's source could not load, and the two ways were each tested whole),
and each stale module says so once, in a :class:`RuntimeWarning` that names its files and the
command that rebuilds them. The files are looked at once, when the first twin is imported;
nothing is checked per call.

Which modules: those callgrind shows on every request (``benchmarks/instructions.py``), in
an order where each comes after the twins whose types its ``.pxd`` uses.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NamedTuple

__all__ = ["NO_EXTENSIONS_ENV", "REBUILD", "TWINS", "Stale", "compiled", "install", "pure_reason",
           "stale", "twin_of"]

#: The modules with a compiled twin (``setup.py`` reads this tuple without importing it).
TWINS = (
    "tensorshare.wire.records",
    "tensorshare.wire.tensors",
    "tensorshare.wire.runs",
    "tensorshare.wire.frames",
    "tensorshare.wire.fields",
    "tensorshare.wire.prepared",
    "tensorshare.wire.replies",
    "tensorshare.wire.protocol",
    "tensorshare.server.store",
    "tensorshare.server.sessions",
    "tensorshare.server.stats",
    "tensorshare.server.replay",
    "tensorshare.server.parts",
    "tensorshare.server.handlers",
    "tensorshare.server.connection",
    "tensorshare.client.session",
    "tensorshare.client.election",
    "tensorshare.client.ops",
    "tensorshare.client.connection",
)
#: Set (to anything but ``""`` or ``"0"``) to run the pure-Python modules only.
NO_EXTENSIONS_ENV = "TENSORSHARE_NO_EXTENSIONS"
#: What rebuilds the compiled twins in a source tree.
REBUILD = "pip install -e . or python setup.py build_ext --inplace"


def twin_of(name: str) -> str:
    """The compiled twin's module name of module ``name``."""
    return name + "_c"


class _TwinLoader(importlib.abc.Loader):
    """Loads a module of :data:`TWINS` as its compiled twin (the same module object)."""

    def __init__(self, twin: str) -> None:
        self.twin = twin

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.twin)

    def exec_module(self, module: ModuleType) -> None:
        pass  # (the twin ran when it was imported)


class Stale(NamedTuple):
    """A compiled twin older than a file it was built from."""

    module: str  #: the module of :data:`TWINS`
    built: str  #: its compiled file
    source: str  #: its ``.py`` or ``.pxd``, newer than ``built``


def _built(name: str, root: str) -> str | None:
    """The compiled file of module ``name``'s twin under package folder ``root``, if any."""
    folder = os.path.join(root, *name.split(".")[1:-1])
    leaf = twin_of(name).rpartition(".")[2]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        built = os.path.join(folder, leaf + suffix)
        if os.path.exists(built):
            return built
    return None


def _survey(root: str) -> tuple[dict[str, str], list[Stale]]:
    """Each twin's compiled file under ``root`` (the folder of package ``tensorshare``), and
    the stale ones."""
    built, stale = {}, []
    for name in TWINS:
        path = _built(name, root)
        if path is None:
            continue
        built[name] = path
        # (an installed wheel is not stale: its installer writes each .py before its twin,
        # in the order of their names)
        when = os.path.getmtime(path)
        base = os.path.join(os.path.dirname(path), name.rpartition(".")[2])
        for source in (base + ".py", base + ".pxd"):
            if os.path.exists(source) and os.path.getmtime(source) > when:
                stale.append(Stale(name, path, source))
                break
    return built, stale


class _TwinFinder(importlib.abc.MetaPathFinder):
    """Finds the compiled twin of a module of :data:`TWINS`, when one was built and none is
    stale (decided once, at the first twin imported)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._usable: dict[str, str] | None = None

    def usable(self) -> dict[str, str]:
        """The compiled file of each twin that loads compiled (none while any is stale)."""
        if self._usable is None:
            built, stale = _survey(self.root)
            for s in stale:
                warnings.warn(
                    f"tensorshare: the compiled {s.built} is older than {s.source}: running "
                    f"the pure-Python modules of tensorshare._ext.TWINS until it is rebuilt "
                    f"(in the source tree: {REBUILD})", RuntimeWarning, stacklevel=2)
            self._usable = {} if stale else built
        return self._usable

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _TWIN_SET:
            return None
        built = self.usable().get(fullname)
        if built is None:
            return None  # not built here, or a twin is stale: the .py
        return importlib.machinery.ModuleSpec(fullname, _TwinLoader(twin_of(fullname)),
                                              origin=built)


_TWIN_SET = frozenset(TWINS)
_ROOT = os.path.dirname(os.path.abspath(__file__))


def stale(root: str = _ROOT) -> list[Stale]:
    """The compiled twins under ``root`` (this package's folder) older than their ``.py`` or
    ``.pxd`` (looked at now)."""
    return _survey(root)[1]


def install() -> None:
    """Let the modules of :data:`TWINS` load as their compiled twins, unless
    ``TENSORSHARE_NO_EXTENSIONS`` says otherwise (called first thing by
    ``tensorshare/__init__.py``, before any of them is imported)."""
    if os.environ.get(NO_EXTENSIONS_ENV, "") not in ("", "0"):
        return
    if not any(isinstance(f, _TwinFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TwinFinder(_ROOT))


def pure_reason() -> str:
    """Why a module of :data:`TWINS` runs as its ``.py`` in this process, in a few words."""
    if os.environ.get(NO_EXTENSIONS_ENV, "") not in ("", "0"):
        return f"{NO_EXTENSIONS_ENV} is set"
    late = stale()
    if late:
        return (f"a stale build: {late[0].built} is older than {late[0].source}; rebuild: "
                f"{REBUILD}")
    return "not built at install: no C compiler was found"


def compiled(names: Sequence[str] = TWINS) -> dict[str, bool]:
    """Each of ``names`` (modules of :data:`TWINS`): whether it runs compiled in this process
    (it is imported here to find out)."""
    out = {}
    for name in names:
        module: Any = importlib.import_module(name)
        out[name] = module.__name__ == twin_of(name)
    return out


install()  # on import: tensorshare/__init__.py imports this module before any other
