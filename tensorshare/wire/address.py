"""One spelling for a server's address: ``(host, port)``, ``HOST:PORT`` or a URL.

Every client API and command takes a host and a port, or one address in the host's place
(whose port then wins over ``port``):

* ``HOST:PORT`` (TCP; ``[::1]:PORT`` for an IPv6 literal; a bare IPv6 literal is a host),
* ``tensorshare://HOST:PORT`` (TCP, the same),
* ``tensorshare+tls://HOST:PORT`` (TCP with TLS: the server's certificate is checked, and
  its host name),
* ``unix://PATH`` (a Unix socket on this machine: ``unix:///tmp/ts.sock``).

A URL never carries a token (see ``tensorshare.client.endpoint``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FORMS", "Address", "parse_address"]


@dataclass(frozen=True, slots=True)
class Address:
    """Where a server listens: TCP ``host:port``, or a Unix socket ``path``."""

    host: str = "127.0.0.1"
    port: int = 8000
    path: str | None = None
    tls: bool = False

    def __str__(self) -> str:
        if self.path is not None:
            return f"unix://{self.path}"
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The address as a URL (``tensorshare://``, ``tensorshare+tls://`` or ``unix://``)."""
        if self.path is not None:
            return f"unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tensorshare{'+tls' if self.tls else ''}://{host}:{self.port}"


FORMS = ("HOST:PORT, tensorshare://HOST:PORT, tensorshare+tls://HOST:PORT or unix://PATH "
         "(or a host name and a port)")


def parse_address(host: str, port: int) -> Address:
    """``host`` and ``port`` as given to a client: a host name and a port, or one address
    (``HOST:PORT`` or a URL, see the module docstring) in ``host``, whose port then wins.

    Raises:
        ValueError: an unknown scheme, a port that is not a number from 0 to 65535, or a
            URL without a port or a path (the message lists the forms that work).
    """
    if "://" not in host:
        if host.startswith("[") and host.endswith("]"):
            return Address(host[1:-1], port)  # [V6] alone: a host
        if host.startswith("[") or host.count(":") == 1:
            return _host_port(host, host, "tensorshare")
        return Address(host, port)  # a host name, or a bare IPv6 literal (several colons)
    scheme, rest = host.split("://", 1)
    if scheme == "unix":
        if not rest:
            raise ValueError(f"no socket path in {host!r}")
        return Address(path=rest)
    if scheme in ("tensorshare", "tensorshare+tls"):
        if "@" in rest:
            raise ValueError(f"a URL carries no credentials (give a token with token=, "
                             f"token_file= or TENSORSHARE_TOKEN): {scheme}://...@...")
        return _host_port(rest.rstrip("/"), host, scheme)
    raise ValueError(f"unknown address scheme {scheme!r} in {host!r}: give {FORMS}")


def _host_port(rest: str, given: str, scheme: str) -> Address:
    """``HOST:PORT`` (``[V6]:PORT``) of an address ``given`` as written."""
    name, _, number = rest.rpartition(":")
    if name.startswith("[") != name.endswith("]"):
        name = ""
    if not name.strip("[]") or not number.isdigit() or int(number) > 65535:
        raise ValueError(f"{given!r} is not a server address: give {FORMS}")
    return Address(name.strip("[]"), int(number), tls=scheme == "tensorshare+tls")
