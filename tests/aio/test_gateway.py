"""An inference gateway: a Starlette app whose handlers await
``AsyncInferenceClient.predict``, driven by an HTTP client (httpx), against a real
``InferenceHost`` serving a real ``nn.Module`` on a real server. Many requests at once are
batched on the host with each other; each gets its own row; errors come back typed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tensorshare import EmbeddedServer, ServiceFailed, WaitTimeout
from tensorshare.aio import AsyncClient, AsyncInferenceClient
from tensorshare.inference import InferenceHost
from tests.aio.conftest import Run


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def gateway(address: str, service: str) -> Starlette:
    """The app: POST /predict with ``{"x": [8 floats]}`` answers ``{"y": [4 floats],
    "version": v}``; one AsyncInferenceClient for the app's life (its lifespan)."""
    model: dict[str, AsyncInferenceClient] = {}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with AsyncInferenceClient(service, address, timeout=5.0) as client:
            model["client"] = client
            yield

    async def predict(request: Request) -> JSONResponse:
        body = await request.json()
        x = torch.tensor(body["x"], dtype=torch.float32)
        try:
            y, version = await model["client"].predict(x, return_version=True)
        except (ServiceFailed, WaitTimeout) as exc:
            return JSONResponse({"error": type(exc).__name__, "message": str(exc)}, 503)
        return JSONResponse({"y": y.tolist(), "version": version})

    return Starlette(routes=[Route("/predict", predict, methods=["POST"])], lifespan=lifespan)


async def _serve(app: Starlette, requests: list[Any]) -> list[httpx.Response]:
    """Run ``app`` (its lifespan too) and send it every request at once."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            return list(await asyncio.gather(*[http.post("/predict", json={"x": x})
                                               for x in requests]))


def test_a_starlette_gateway_awaits_predict_and_each_request_gets_its_own_row(
        run: Run, server: EmbeddedServer) -> None:
    model = _mlp()
    inputs = [torch.randn(8, generator=torch.Generator().manual_seed(i)) for i in range(64)]
    with InferenceHost("policy", model, "127.0.0.1", server.port, max_wait_ms=5) as host:
        app = gateway(f"tensorshare://127.0.0.1:{server.port}", "policy")
        responses = run(_serve(app, [x.tolist() for x in inputs]))
        batches, calls = host.batches, host.calls
    assert [r.status_code for r in responses] == [200] * 64
    with torch.inference_mode():
        expected = model(torch.stack(inputs))
    for i, r in enumerate(responses):
        got = torch.tensor(r.json()["y"])
        assert torch.allclose(got, expected[i], atol=1e-6), (i, got, expected[i])
        assert r.json()["version"] is None  # no params_bin: no version
    assert calls == 64 and batches < 64  # batched with each other on the host


def test_predict_keeps_its_keywords_and_errors(run: Run, server: EmbeddedServer) -> None:
    model = _mlp()
    x = torch.randn(3, 8)

    async def scenario() -> None:
        async with AsyncClient(f"tensorshare://127.0.0.1:{server.port}", timeout=10) as c:
            m = AsyncInferenceClient("policy", client=c, timeout=5.0)
            rows = await m.predict(x, batched=True)
            with torch.inference_mode():
                assert torch.allclose(rows, model(x), atol=1e-6)
            with pytest.raises(ServiceFailed):  # not a batch of rows: 8 features expected
                await m.predict(torch.randn(5))
            await m.aclose()  # not its client: still open
            assert await c.ping() is None
            nobody = AsyncInferenceClient("nobody", client=c, timeout=0.2)
            with pytest.raises(WaitTimeout):
                await nobody.predict(x[0])
            with pytest.raises(TypeError):
                await m.predict([1.0, 2.0])

    with InferenceHost("policy", model, "127.0.0.1", server.port, max_wait_ms=1):
        run(scenario())
