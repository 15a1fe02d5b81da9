"""One spelling for a server's address: ``(host, port)`` or a URL.

Every client API and command takes a host and a port, or one URL in the host's place:

* ``tensorshare://HOST:PORT`` (TCP; ``[::1]`` for an IPv6 literal),
* ``tensorshare+tls://HOST:PORT`` (TCP with TLS: the server's certificate is checked, and
  its host name),
* ``unix://PATH`` (a Unix socket on this machine: ``unix:///tmp/ts.sock``).

A URL never carries a token (see ``tensorshare.client.endpoint``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Address", "parse_address"]


@dataclass(frozen=True, slots=True)
class Address:
    """Where a server listens: TCP ``host:port``, or a Unix socket ``path``."""

    host: str = "127.0.0.1"
    port: int = 8000
    path: str | None = None
    tls: bool = False

    def __str__(self) -> str:
        return f"unix://{self.path}" if self.path is not None else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The address as a URL (``tensorshare://``, ``tensorshare+tls://`` or ``unix://``)."""
        if self.path is not None:
            return f"unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tensorshare{'+tls' if self.tls else ''}://{host}:{self.port}"


def parse_address(host: str, port: int) -> Address:
    """``host`` and ``port`` as given to a client: a host name and a port, or one URL
    (see the module docstring) in ``host``, whose port then wins.

    Raises:
        ValueError: an unknown scheme, or a URL without a port or a path.
    """
    if "://" not in host:
        return Address(host, port)
    scheme, rest = host.split("://", 1)
    if scheme == "unix":
        if not rest:
            raise ValueError(f"no socket path in {host!r}")
        return Address(path=rest)
    if scheme in ("tensorshare", "tensorshare+tls"):
        if "@" in rest:
            raise ValueError(f"a URL carries no credentials (give a token with token=, "
                             f"token_file= or TENSORSHARE_TOKEN): {scheme}://...@...")
        name, _, number = rest.rstrip("/").rpartition(":")
        if not name or not number.isdigit():
            raise ValueError(f"expected {scheme}://HOST:PORT, got {host!r}")
        return Address(name.strip("[]"), int(number), tls=scheme == "tensorshare+tls")
    raise ValueError(f"unknown address scheme {scheme!r} in {host!r} (use tensorshare://, "
                     f"tensorshare+tls:// or unix://)")
