"""Token authentication in the handshake: a challenge-response that never sends the token.

Both sides know a shared secret (the token). The client's ``hello`` carries a fresh random
nonce; a server that requires a token answers with its own fresh nonce (a challenge); the
client proves it knows the token with an HMAC-SHA256 over both nonces and what the hello
claimed (its session and name), and the server answers with the same proof under another
label, so the client knows the server has the token too. A captured handshake cannot be
replayed: the server's nonce is new on every connection. See docs/PROTOCOL.md §8.2.

Only the standard library (``hmac``, ``hashlib``, ``secrets``): no home-made cryptography.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["MECH", "NONCE_BYTES", "client_proof", "new_nonce", "server_proof", "token_bytes",
           "verify"]

#: The one mechanism: HMAC-SHA256 over the transcript below.
MECH = "hmac-sha256"
NONCE_BYTES = 32
_LABEL = b"tensorshare-auth-v1\0"


def new_nonce() -> bytes:
    """A fresh random nonce (32 bytes from the OS's CSPRNG)."""
    return secrets.token_bytes(NONCE_BYTES)


def token_bytes(token: str | bytes) -> bytes:
    """The key a token stands for: its UTF-8 bytes, surrounding whitespace removed (a token
    file's trailing newline is not part of the token).

    Raises:
        ValueError: the token is empty.
    """
    raw = token.strip() if isinstance(token, bytes) else token.strip().encode("utf-8")
    if not raw:
        raise ValueError("a token must not be empty")
    return raw


def _transcript(client_nonce: bytes, server_nonce: bytes, session: bytes | None,
                client: str) -> bytes:
    name = client.encode("utf-8")
    sid = session or b""
    return b"".join((_LABEL, client_nonce, server_nonce, len(sid).to_bytes(1, "big"), sid,
                     len(name).to_bytes(4, "big"), name))


def client_proof(key: bytes, client_nonce: bytes, server_nonce: bytes, session: bytes | None,
                 client: str) -> bytes:
    """What the client sends to prove it knows the token."""
    msg = b"client\0" + _transcript(client_nonce, server_nonce, session, client)
    return hmac.new(key, msg, hashlib.sha256).digest()


def server_proof(key: bytes, client_nonce: bytes, server_nonce: bytes, session: bytes | None,
                 client: str) -> bytes:
    """What the server sends back to prove it knows the token too."""
    msg = b"server\0" + _transcript(client_nonce, server_nonce, session, client)
    return hmac.new(key, msg, hashlib.sha256).digest()


def verify(expected: bytes, got: object) -> bool:
    """Compare a proof in constant time (anything but 32 bytes is simply wrong)."""
    return isinstance(got, bytes) and len(got) == len(expected) and \
        hmac.compare_digest(expected, got)
