"""The dashboard's tests: a real server (``EmbeddedServer``), a real dashboard on its own
reactor thread, and plain HTTP clients that read its event stream as a browser would."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from tensorshare import EmbeddedServer
from tensorshare.dashboard import Dashboard
from tensorshare.server import ServerConfig

WRITE_TOKEN = "write-token-for-the-dashboard-tests"
READ_TOKEN = "read-token-for-the-dashboard-tests"


class Events:
    """One ``/events`` stream, parsed as an ``EventSource`` would (``event:``/``data:``)."""

    def __init__(self, url: str, cookie: str | None = None, timeout: float = 10.0) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port,
                                               timeout=timeout)
        self.conn.request("GET", "/events", headers={"Cookie": cookie} if cookie else {})
        self.response = self.conn.getresponse()
        self.buffer = b""
        self.seen: list[tuple[str, Any]] = []

    @property
    def status(self) -> int:
        return self.response.status

    def next(self, kind: str = "snapshot", timeout: float = 10.0) -> Any:
        """The data of the next event named ``kind`` (others are kept in :attr:`seen`)."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n\n" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\n\n", 1)
                event = _parse(raw)
                if event is None:
                    continue
                self.seen.append(event)
                if event[0] == kind:
                    return event[1]
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {kind!r} event within {timeout} s")
            sock = self.conn.sock
            if sock is not None:
                sock.settimeout(left)
            chunk = self.response.read1(65536)
            if not chunk:
                raise AssertionError("the event stream ended")
            self.buffer += chunk

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Events:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse(raw: bytes) -> tuple[str, Any] | None:
    name, data = "message", []
    for line in raw.decode("utf-8").split("\n"):
        if line.startswith(":") or not line:
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            name = value
        elif field == "data":
            data.append(value)
    if not data:
        return None
    return name, json.loads("\n".join(data))


def request(url: str, method: str = "GET", path: str = "/", cookie: str | None = None,
            headers: dict[str, str] | None = None, body: bytes | None = None
            ) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request: status, headers (lower-case names; Set-Cookie joined), body."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=10)
    try:
        hdrs = dict(headers or {})
        if cookie:
            hdrs["Cookie"] = cookie
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        got = {k.lower(): v for k, v in resp.getheaders()}
        got["set-cookie"] = "\n".join(resp.headers.get_all("Set-Cookie") or [])
        return resp.status, got, resp.read() if method != "HEAD" else b""
    finally:
        conn.close()


def log_in(url: str, token: str = READ_TOKEN) -> str:
    """Log in with the token in the URL, as a browser does once; return the cookie."""
    status, headers, _ = request(url, path=f"/?token={token}")
    assert status == 303, status
    return headers["set-cookie"].split(";", 1)[0]


@pytest.fixture
def secured() -> Iterator[EmbeddedServer]:
    """A server with a read-write and a read-only token."""
    srv = EmbeddedServer(port=0, config=ServerConfig(token=WRITE_TOKEN, read_token=READ_TOKEN))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def dash(secured: EmbeddedServer) -> Iterator[Dashboard]:
    """A dashboard of ``secured`` (read-only token; ticks every 0.2 s)."""
    with Dashboard(f"127.0.0.1:{secured.port}", port=0, read_token=READ_TOKEN,
                   interval=0.2) as d:
        assert d.first_contact(10) == [None]
        yield d
