"""The compiled hot path and its pure-Python twin, chosen in this one place.

Each module of :data:`TWINS` is one ``.py`` source, the reference, which runs as it is. Where
the package was installed with a C compiler, ``setup.py`` also compiled that same source with
Cython under its own name, the module's name with ``_c`` appended
(``tensorshare/wire/frames.py`` -> ``tensorshare.wire.frames_c``), typed by the augmenting
``frames_c.pxd`` beside it, which includes ``frames.pxd``: the declarations (cdef classes
with declared attributes, typed locals) that other twins cimport by the module's own name
(``from tensorshare.wire.frames cimport FrameDecoder``), so that a ``.py``'s ordinary imports
are the typed ones in its twin. The ``.py`` needs no ``import cython``. As aiohttp does with
its WebSocket reader (``reader_py.py`` compiled as ``reader_c``), the twin is a second
*build*, never a second implementation.

Importing a module of :data:`TWINS` by its own name gives its compiled twin where one was
built, else the ``.py``; ``TENSORSHARE_NO_EXTENSIONS=1`` (set before tensorshare is imported)
forces the ``.py`` modules (as ``AIOHTTP_NO_EXTENSIONS`` does): the test command runs the wire,
client and server tests both ways. A twin can also be imported by its own name beside the
``.py`` module (tests compare the two). :func:`compiled` says which modules run compiled.

Which modules: those callgrind shows on every request (``benchmarks/instructions.py``), in
an order where each comes after the twins whose types its ``.pxd`` uses.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["NO_EXTENSIONS_ENV", "TWINS", "compiled", "install", "twin_of"]

#: The modules with a compiled twin (``setup.py`` reads this tuple without importing it).
TWINS = (
    "tensorshare.wire.records",
    "tensorshare.wire.frames",
    "tensorshare.wire.fields",
    "tensorshare.wire.protocol",
    "tensorshare.server.store",
    "tensorshare.server.sessions",
    "tensorshare.server.stats",
    "tensorshare.server.handlers",
    "tensorshare.server.connection",
    "tensorshare.client.session",
    "tensorshare.client.election",
    "tensorshare.client.ops",
    "tensorshare.client.connection",
)
#: Set (to anything but ``""`` or ``"0"``) to run the pure-Python modules only.
NO_EXTENSIONS_ENV = "TENSORSHARE_NO_EXTENSIONS"


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


class _TwinFinder(importlib.abc.MetaPathFinder):
    """Finds the compiled twin of a module of :data:`TWINS`, when one was built."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _TWIN_SET or not path:
            return None
        twin = twin_of(fullname)
        leaf = twin.rpartition(".")[2]
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            built = os.path.join(path[0], leaf + suffix)
            if os.path.exists(built):
                return importlib.machinery.ModuleSpec(fullname, _TwinLoader(twin),
                                                      origin=built)
        return None  # not built here: the .py


_TWIN_SET = frozenset(TWINS)


def install() -> None:
    """Let the modules of :data:`TWINS` load as their compiled twins, unless
    ``TENSORSHARE_NO_EXTENSIONS`` says otherwise (called first thing by
    ``tensorshare/__init__.py``, before any of them is imported)."""
    if os.environ.get(NO_EXTENSIONS_ENV, "") not in ("", "0"):
        return
    if not any(isinstance(f, _TwinFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TwinFinder())


def compiled(names: Sequence[str] = TWINS) -> dict[str, bool]:
    """Each of ``names`` (modules of :data:`TWINS`): whether it runs compiled in this process
    (it is imported here to find out)."""
    out = {}
    for name in names:
        module: Any = importlib.import_module(name)
        out[name] = module.__name__ == twin_of(name)
    return out


install()  # on import: tensorshare/__init__.py imports this module before any other
