"""Static checks the project promises: ruff and mypy are clean (see pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_ruff_is_clean() -> None:
    out = _run("ruff", "check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_is_clean() -> None:
    with tempfile.TemporaryDirectory() as cache:
        out = _run("mypy", "tensorshare", "--cache-dir", cache)
    assert out.returncode == 0, out.stdout + out.stderr
