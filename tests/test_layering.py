"""The layering contract (docs/ARCHITECTURE.md, pyproject.toml's [tool.importlinter]): what
each room of the package may import, checked by import-linter."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports() -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe is not None, "import-linter is part of the test extra"
    return subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_every_layering_contract_is_kept() -> None:
    out = _lint_imports()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_the_contracts_cover_every_room() -> None:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    rooms = sorted(p.name for p in (ROOT / "tensorshare").iterdir()
                   if p.is_dir() and (p / "__init__.py").exists())
    for room in rooms:
        assert f'"tensorshare.{room}"' in text, f"no layering contract names {room}"
