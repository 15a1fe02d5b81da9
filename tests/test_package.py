"""The top-level package as a user meets it in a REPL: what ``dir`` and ``__all__`` show."""

from __future__ import annotations

import subprocess
import sys

import tensorshare


def test_dir_shows_the_public_api_and_not_the_modules_helpers() -> None:
    names = dir(tensorshare)
    for helper in ("Any", "TYPE_CHECKING", "annotations", "importlib", "_LAZY", "_ext",
                   "errors", "client"):
        assert helper not in names, helper
    assert set(tensorshare.__all__) <= set(names)
    public = [n for n in names if not n.startswith("_")]
    assert public == sorted(n for n in tensorshare.__all__ if not n.startswith("_"))
    for name in public:  # each one it shows resolves
        assert getattr(tensorshare, name) is not None or name == "NOWAIT"


def test_a_fresh_interpreter_shows_the_same_before_anything_is_loaded() -> None:
    code = "import tensorshare; print(','.join(n for n in dir(tensorshare) if n[0] != '_'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip().split(",") == sorted(
        n for n in tensorshare.__all__ if not n.startswith("_"))
