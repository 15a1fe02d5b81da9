"""The README stays true: its test command is what CI runs, and its code examples run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tensorshare import EmbeddedServer

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_opens_with_the_two_setup_commands_and_ci_runs_them_in_a_fresh_venv() -> None:
    first = _blocks("bash")[0].strip().splitlines()
    assert len(first) == 2
    assert "tensorshare demo" in first[0]
    assert first[1].endswith("-m pytest")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    # Verbatim, in order, the main job before the tests, and both inside a new venv.
    main_job, tests = ci.index(first[0]), ci.index(first[1])
    assert main_job < tests, "CI must run the main job before the tests"
    venv = next(i for i, line in enumerate(ci) if line.startswith("python3 -m venv "))
    activate = next(i for i, line in enumerate(ci) if "/bin/activate" in line)
    assert venv < activate < main_job
    # The main job must not find the test extras: nothing is installed before it.
    assert not any("pip install" in line for line in ci[:main_job])


def _run(code: str, server: EmbeddedServer) -> str:
    code = code.replace("8000", str(server.port))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_readme_client_tour_runs(server: EmbeddedServer) -> None:
    tour = next(b for b in _blocks("python") if "with Client(" in b)
    # Print what the tour's list() returns, and what is left at the end.
    # (each as one write: the listener's callback prints from another thread meanwhile)
    probe = tour.replace("c.list()  ", "print(f'L1 {c.list()}')", 1)
    out = _run(probe + "    print(f'LEFT {c.list()}')\n", server)
    assert "L1 {'weights': 1, 'queue': 2}" in out
    assert "LEFT {}" in out  # weights deleted, queue emptied by the two gets


def test_readme_callback_example_runs(server: EmbeddedServer) -> None:
    example = next(b for b in _blocks("python") if "TensorShare(" in b)
    out = _run(example, server)
    assert "{'status': 'OK', 'data': {'a': tensor(" in out
    assert "'status': 'ERR', 'msg': \"bin 'missing' does not exist or is empty\"" in out
