"""The dashboard's HTTP side, on twisted.web: one static page, its script and style, and
one event stream per tab (``/events``, server-sent events).

Read-only by construction: only ``GET`` and ``HEAD`` are served (anything else is ``405``
before authentication, and a request's body is never kept), no route takes a bin name or
anything else to act on, and the page is what ships in the package (no CDN, no inline
script: the content security policy forbids both).

**Authentication.** With a token (the server's read-only token), a browser logs in once
with ``/?token=TOKEN``: the answer sets an ``HttpOnly; SameSite=Strict`` cookie (an HMAC of
the token, never the token) and redirects to the same path without the token, so the URL
in the address bar, the history and any ``Referer`` is clean. ``EventSource`` cannot send
headers, so the cookie is what authenticates the stream. Anything without the cookie (or
with a wrong token) gets ``401``. Without a token (a server that has none, on loopback),
requests are accepted only with a loopback ``Host`` header, so that a web page elsewhere
cannot read the dashboard through DNS rebinding.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from importlib import resources
from typing import Any

from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from ..wire.auth import token_bytes
from .hub import Hub

__all__ = ["CSP", "Auth", "DashboardResource", "DashboardSite", "is_loopback", "static_files"]

#: The page's content security policy: its own script and style only, no inline script,
#: no framing, no form posting anywhere, requests to its own origin only.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

_TYPES = {".html": b"text/html; charset=utf-8", ".js": b"text/javascript; charset=utf-8",
          ".css": b"text/css; charset=utf-8", ".svg": b"image/svg+xml"}
_FILES = ("index.html", "dashboard.js", "dashboard.css", "favicon.svg")


def static_files() -> dict[bytes, tuple[bytes, bytes]]:
    """``path -> (content type, bytes)`` of the page's files (package data)."""
    root = resources.files("tensorshare.dashboard") / "static"
    out: dict[bytes, tuple[bytes, bytes]] = {}
    for name in _FILES:
        body = (root / name).read_bytes()
        out[f"/{name}".encode()] = (_TYPES["." + name.rsplit(".", 1)[1]], body)
    out[b"/"] = out[b"/index.html"]
    return out


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an interface to bind, or a ``Host`` header's name) is this
    machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(header: bytes | None) -> str:
    """The name of a ``Host`` header, without its port."""
    text = (header or b"").decode("latin-1").strip()
    if text.startswith("["):
        return text[1:].split("]", 1)[0]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class Auth:
    """Who may look: a browser that proved the token once (its cookie), or, without a
    token, any request whose ``Host`` is a loopback name.

    Args:
        token: the token browsers log in with (``None``: no login).
        port: the dashboard's port (the cookie's name carries it: cookies do not tell ports
            apart, and two dashboards on one host must not overwrite each other's).
    """

    def __init__(self, token: str | None, port: int) -> None:
        self.key = token_bytes(token) if token is not None else None
        self.port = port
        self.cookie = hmac.new(self.key, b"tensorshare-dashboard-login", hashlib.sha256
                               ).hexdigest().encode() if self.key is not None else b""

    @property
    def cookie_name(self) -> bytes:
        return f"tensorshare_dashboard_{self.port}".encode()

    def token_ok(self, given: bytes) -> bool:
        if self.key is None:
            return False
        try:
            key = token_bytes(given)
        except ValueError:
            return False
        return hmac.compare_digest(key, self.key)

    def allowed(self, request: Request) -> bool:
        if self.key is None:
            return is_loopback(_host_name(request.getHeader(b"host")))
        got = request.getCookie(self.cookie_name)
        return got is not None and hmac.compare_digest(got, self.cookie)

    def log_in(self, request: Request) -> None:
        request.addCookie(self.cookie_name, self.cookie, path=b"/", httpOnly=True,
                          sameSite="strict")


def _headers(request: Request) -> None:
    for name, value in ((b"content-security-policy", CSP.encode()),
                        (b"x-content-type-options", b"nosniff"),
                        (b"x-frame-options", b"DENY"),
                        (b"referrer-policy", b"no-referrer"),
                        (b"cache-control", b"no-store")):
        request.setHeader(name, value)


def _text(request: Request, code: int, text: str) -> bytes:
    request.setResponseCode(code)
    request.setHeader(b"content-type", b"text/plain; charset=utf-8")
    return text.encode()


class DashboardResource(Resource):
    """Every path of the dashboard (see the module docstring)."""

    isLeaf = True

    def __init__(self, hub: Hub, auth: Auth) -> None:
        super().__init__()
        self.hub, self.auth = hub, auth
        self.files = static_files()

    def render(self, request: Request) -> bytes | int:
        _headers(request)
        if request.method not in (b"GET", b"HEAD"):
            request.setHeader(b"allow", b"GET, HEAD")
            return _text(request, 405, "405 method not allowed: this dashboard is read-only\n")
        args: dict[bytes, list[bytes]] = request.args or {}
        tokens = args.get(b"token")
        if tokens:
            if not self.auth.token_ok(tokens[0]):
                return _text(request, 401, "401: wrong token\n")
            self.auth.log_in(request)
            request.setResponseCode(303)
            request.setHeader(b"location", request.path or b"/")  # the same page, no token
            return b""
        if not self.auth.allowed(request):
            return _text(request, 401, "401: log in once with this page's address followed "
                                       "by ?token=TOKEN (the server's read-only token)\n"
                         if self.auth.key is not None else
                         "401: without a token this dashboard answers loopback names only\n")
        path = request.path
        if path == b"/events":
            return self._events(request)
        found = self.files.get(path)
        if found is None:
            return _text(request, 404, "404 not found\n")
        request.setHeader(b"content-type", found[0])
        return found[1]

    def _events(self, request: Request) -> bytes | int:
        request.setHeader(b"content-type", b"text/event-stream; charset=utf-8")
        request.setHeader(b"x-accel-buffering", b"no")  # proxies: do not buffer the stream
        if request.method == b"HEAD":
            return b""
        if self.hub.add(request) is None:
            return _text(request, 503, f"503: {self.hub.max_streams} event streams are open "
                                       f"already\n")
        return NOT_DONE_YET


class _Request(Request):
    """A request whose body is never kept: the dashboard reads none, so a large one costs
    nothing (its bytes are dropped as they arrive)."""

    def gotLength(self, length: int | None) -> None:
        super().gotLength(None)  # in memory (empty), never a temporary file

    def handleContentChunk(self, data: bytes) -> None:
        pass


class DashboardSite(Site):
    """The dashboard's ``Site``: its requests keep no body, idle connections close after a
    minute, at most ``max_connections`` are open at once (more are closed at once), and
    nothing is logged per request."""

    requestFactory = _Request
    noisy = False

    def __init__(self, resource: Resource, *, max_connections: int = 256) -> None:
        super().__init__(resource, timeout=60)
        self.max_connections = max_connections
        self.open = 0

    def buildProtocol(self, addr: Any) -> Any:
        if self.open >= self.max_connections:
            return None
        proto = super().buildProtocol(addr)
        self.open += 1
        lost = proto.connectionLost

        def connection_lost(reason: Any) -> None:
            self.open -= 1
            lost(reason)

        proto.connectionLost = connection_lost
        return proto

    def log(self, request: Any) -> None:
        pass
