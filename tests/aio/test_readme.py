"""The README's asyncio section runs: its AsyncClient example against a real server, and its
FastAPI handler calling AsyncInferenceClient against a real InferenceHost (driven by httpx)."""

from __future__ import annotations

import asyncio
import re
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import torch

from tensorshare import EmbeddedServer
from tensorshare.inference import InferenceHost

ROOT = Path(__file__).resolve().parents[2]
SECTION = (ROOT / "README.md").read_text(encoding="utf-8").split("## asyncio\n", 1)[1] \
    .split("\n## ", 1)[0]
BLOCKS = re.findall(r"```python\n(.*?)```", SECTION, flags=re.S)


def test_the_readme_async_client_example_runs(server: EmbeddedServer) -> None:
    example = next(b for b in BLOCKS if "AsyncClient(" in b)
    code = example.replace("8000", str(server.port))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == ["[1, 1, 1] 1", "put 2"], out.stdout  # the pipeline: one request


def test_the_readme_fastapi_handler_calls_the_inference_host(server: EmbeddedServer,
                                                              tmp_path: Path) -> None:
    example = next(b for b in BLOCKS if "FastAPI(" in b)
    module = tmp_path / "gateway.py"  # the README's block as a module of its own
    module.write_text(example.replace("tensorshare://trainer:8000",
                                      f"tensorshare://127.0.0.1:{server.port}"))
    app: Any = runpy.run_path(str(module))["app"]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    obs = [[float(i), 1.0, -1.0, 0.5] for i in range(16)]

    async def drive() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
                return list(await asyncio.gather(*[http.post("/act", json=o) for o in obs]))

    with InferenceHost("policy", model, "127.0.0.1", server.port, max_wait_ms=2):
        responses = asyncio.run(drive())
    with torch.inference_mode():
        expected = model(torch.tensor(obs))
    assert [r.status_code for r in responses] == [200] * 16, responses[0].text
    for r, want in zip(responses, expected, strict=True):
        assert torch.allclose(torch.tensor(r.json()["action"]), want, atol=1e-6)
