"""The compiled hot path and its pure-Python twin.

The modules in :data:`COMPILED` are compiled by Cython when the package is installed and a C
compiler is found (``setup.py`` builds them from these very ``.py`` files: the source is the
reference, and the compiled module is that source, compiled). Python then imports the
compiled module in place of the ``.py``. Where no compiler was found the install says so in
one line and the package runs as pure Python, with the same behaviour.

Setting ``TENSORSHARE_NO_EXTENSIONS=1`` before tensorshare is imported forces the pure-Python
modules even where the compiled ones are built (as ``AIOHTTP_NO_EXTENSIONS`` does for
aiohttp): the test suite runs the wire and client tests both ways, and a suspected
difference between the two can be checked in a minute. :func:`compiled` says which modules
run compiled in this process.

Which modules: those that run on every request and gain from compilation as they are, measured
(callgrind instruction counts, ``benchmarks/README.md``): the frame layer and the protocol's
message encoding and parsing (both sides), and the client's session, read election, op surface
and blocking client. The server's other modules gained nothing measurable compiled.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

__all__ = ["COMPILED", "NO_EXTENSIONS_ENV", "compiled", "install"]

#: The modules compiled at install time (``setup.py`` reads this tuple without importing it).
COMPILED = (
    "tensorshare.wire.frames",
    "tensorshare.wire.protocol",
    "tensorshare.client.session",
    "tensorshare.client.election",
    "tensorshare.client.ops",
    "tensorshare.client.blocking",
)

#: Set (to anything but ``""`` or ``"0"``) to run the pure-Python modules only.
NO_EXTENSIONS_ENV = "TENSORSHARE_NO_EXTENSIONS"


class _PureFinder(importlib.abc.MetaPathFinder):
    """Finds the ``.py`` source of a module of :data:`COMPILED`, before the import system's
    own finder would find the compiled module beside it: always (``all_pure``), or when the
    source changed after it was compiled (an edited checkout not rebuilt yet: running a stale
    build would run other code than the source says)."""

    def __init__(self, all_pure: bool) -> None:
        self.all_pure = all_pure

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED or not path:
            return None
        leaf = fullname.rpartition(".")[2]
        source = os.path.join(path[0], leaf + ".py")
        if not os.path.exists(source):
            return None
        if not self.all_pure:
            built = [os.path.join(path[0], leaf + suffix)
                     for suffix in importlib.machinery.EXTENSION_SUFFIXES]
            built = [b for b in built if os.path.exists(b)]
            if not built or os.path.getmtime(source) <= max(map(os.path.getmtime, built)):
                return None  # compiled and up to date (or not compiled): the usual finders
            warnings.warn(f"{source} changed after it was compiled: running it as pure Python "
                          f"(rebuild with pip install -e .)", RuntimeWarning, stacklevel=2)
        return importlib.util.spec_from_file_location(fullname, source)


def install() -> None:
    """Prefer the pure-Python modules if ``TENSORSHARE_NO_EXTENSIONS`` asks for it, or where a
    source is newer than its compiled module (called first thing by ``tensorshare/__init__.py``,
    before any of them is imported)."""
    if not any(isinstance(f, _PureFinder) for f in sys.meta_path):
        pure = os.environ.get(NO_EXTENSIONS_ENV, "") not in ("", "0")
        sys.meta_path.insert(0, _PureFinder(pure))


def compiled(names: Sequence[str] = COMPILED) -> dict[str, bool]:
    """Each of ``names`` (modules of :data:`COMPILED`): whether it runs compiled in this
    process (it is imported here to find out)."""
    out = {}
    for name in names:
        module = importlib.import_module(name)
        out[name] = not (getattr(module, "__file__", "") or "").endswith(".py")
    return out


install()  # on import: tensorshare/__init__.py imports this module before any other
