"""How a client reaches a server: the address, TLS, and the token, from the arguments or the
environment, resolved once for every client API and command.

* The address: ``host`` and ``port`` as given (``host`` may be a URL, see
  :mod:`tensorshare.wire.address`); with neither, ``TENSORSHARE_URL``; else
  ``127.0.0.1:8000``. A Unix socket is ``unix://PATH``: a bare path (``"/tmp/x.sock"``) is
  refused with a message that says so, never taken for a host name.
* TLS: ``tls=True``, or a ``tensorshare+tls://`` URL, or ``TENSORSHARE_URL`` naming the same
  host and port with ``tensorshare+tls://`` (so a script that says ``localhost, 8000`` reaches
  a TLS server when the environment says that server speaks TLS). The CA that signed the
  server's certificate: ``tls_ca=`` or ``TENSORSHARE_TLS_CA`` (else the system's).
* The token: ``token=``, ``token_file=``, ``TENSORSHARE_TOKEN`` or the file
  ``TENSORSHARE_TOKEN_FILE`` names, in that order. Never from a URL.
* The user the token is for (a server with a users file): ``user=``, else
  ``TENSORSHARE_USER``; neither: the user ``default`` (the hello names no user, as a client
  from before users did). A user needs its token.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

from ..wire.address import Address, parse_address
from ..wire.auth import check_user_name, token_bytes, tokens_of

__all__ = ["Endpoint", "resolve", "with_token_hint"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A server and how to reach it.

    Attributes:
        address: where it listens (``address.tls``: TLS on).
        tls_ca: a CA file to check the server's certificate against (``None``: the system's).
        token: the key of the token to prove in the handshake (``None``: no token).
        user: the user the token is for (``None``: none named, the user ``default``).
    """

    address: Address
    tls_ca: str | None = None
    token: bytes | None = None
    user: str | None = None

    @property
    def tls(self) -> bool:
        return self.address.tls

    def __str__(self) -> str:
        return self.address.url if self.address.tls else str(self.address)


def resolve(host: str | None = None, port: int | None = None, *, tls: bool | None = None,
            tls_ca: str | None = None, token: str | bytes | None = None,
            token_file: str | None = None, user: str | None = None) -> Endpoint:
    """Resolve a client's connection arguments (see the module docstring).

    Raises:
        ValueError: a malformed URL, a path without ``unix://`` (``"/tmp/x.sock"``: a host
            name has no ``/``), an empty token, TLS asked for a Unix socket, a malformed
            user name, a user without a token, or (TLS on) a ``tls_ca`` file that holds no
            CA certificate.
        FileNotFoundError: (TLS on) ``tls_ca`` (or ``TENSORSHARE_TLS_CA``) names no file;
            the message names both, and nothing is tried.
        OSError: ``token_file`` (or ``TENSORSHARE_TOKEN_FILE``) cannot be read.
    """
    if host is not None and "://" not in host and "/" in host:
        raise ValueError(f"{host!r} is a path, not a host name: a server's Unix socket is "
                         f"written unix://{host}")
    env_url = os.environ.get("TENSORSHARE_URL") or None
    if host is None and port is None and env_url:
        address = parse_address(env_url, DEFAULT_PORT)
    else:
        address = parse_address(DEFAULT_HOST if host is None else host,
                                DEFAULT_PORT if port is None else port)
    if tls is None and not address.tls and env_url and address.path is None:
        named = parse_address(env_url, DEFAULT_PORT)
        tls = named.tls and (named.host, named.port) == (address.host, address.port)
    if tls:
        if address.path is not None:
            raise ValueError("TLS is for TCP; a Unix socket is already private to this machine")
        address = Address(address.host, address.port, tls=True)
    key = _token(token, token_file)
    ca = tls_ca or os.environ.get("TENSORSHARE_TLS_CA") or None
    if address.tls and ca is not None:
        _check_ca(ca, "tls_ca=" if tls_ca else "TENSORSHARE_TLS_CA")
    return Endpoint(address, ca, key, _user(user, key))


def _check_ca(path: str, given: str) -> None:
    """A CA file that cannot be used fails the client at once, naming the file and where it
    was given (a connection attempt would only fail again, until the timeout)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{given} names {path!r}, which is not a file: give the CA "
                                f"certificate (PEM) that signed the server's certificate")
    try:
        ssl.create_default_context(cafile=path)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"{given} names {path!r}, which holds no CA certificate this "
                         f"client can load ({exc})") from None


def _user(user: str | None, key: bytes | None) -> str | None:
    name = user if user is not None else (os.environ.get("TENSORSHARE_USER") or None)
    if name is None:
        return None
    check_user_name(name)
    if key is None:
        raise ValueError(f"user {name!r} needs its token: give token=, token_file= (--token-file) "
                         f"or TENSORSHARE_TOKEN / TENSORSHARE_TOKEN_FILE")
    return name


def _token(token: str | bytes | None, token_file: str | None) -> bytes | None:
    if token is not None:
        return token_bytes(token)
    path = token_file or os.environ.get("TENSORSHARE_TOKEN_FILE") or None
    if token_file is None and os.environ.get("TENSORSHARE_TOKEN"):
        return token_bytes(os.environ["TENSORSHARE_TOKEN"])
    if path:
        with open(path, "rb") as f:
            # A file of several tokens (one per line: a server's during a rotation): the
            # last, the newest, which the server accepts as long as it holds it.
            return tokens_of(f.read())[-1]
    return None


def with_token_hint(message: str, how: str) -> str:
    """An authentication refusal's ``message`` with its hint on how to give the token (the
    server's, in the terms of the Python API: ``token=``, ``token_file=``) replaced by
    ``how``: a command's own terms (``--token-file PATH``)."""
    return f"{message.split(': give ', 1)[0]}: {how}"
