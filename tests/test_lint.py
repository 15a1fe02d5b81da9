"""Static checks the project promises: ruff and mypy are clean (see pyproject.toml), and no
function in the package is over 60 lines."""

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


def test_no_function_in_the_package_is_over_60_lines() -> None:
    """The house's rule: functions stay small enough to read in one screen."""
    import ast

    long = []
    for path in sorted((ROOT / "tensorshare").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                                f"({lines} lines)")
    assert not long, long
