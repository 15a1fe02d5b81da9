"""Token authentication in the handshake: a challenge-response that never sends the token.

Both sides know a shared secret (the token). The client's ``hello`` carries a fresh random
nonce; a server that requires a token answers with its own fresh nonce (a challenge); the
client proves it knows the token with an HMAC-SHA256 over both nonces and what the hello
claimed (its session, its name and, when it names one, its user), and the server answers with
the same proof under another label, so the client knows the server has the token too. A captured handshake cannot be
replayed: the server's nonce is new on every connection. See docs/PROTOCOL.md §8.2.

Only the standard library (``hmac``, ``hashlib``, ``secrets``): no home-made cryptography.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["MAX_USER_CHARS", "MECH", "NONCE_BYTES", "check_user_name", "client_proof",
           "new_nonce", "server_proof", "token_bytes", "tokens_of", "verify"]

#: The one mechanism: HMAC-SHA256 over the transcript below.
MECH = "hmac-sha256"
NONCE_BYTES = 32
_LABEL = b"tensorshare-auth-v1\0"
#: The longest user name (ASCII letters, digits and ``._@-``, starting with a letter or digit).
MAX_USER_CHARS = 64
_USER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._@-")


def check_user_name(name: object) -> str:
    """A user name: 1 to 64 ASCII letters, digits and ``._@-``, starting with a letter or a
    digit (what a users file's table names and a hello's ``user`` may be).

    Raises:
        ValueError: anything else (the message says what is allowed).
    """
    if (not isinstance(name, str) or not 0 < len(name) <= MAX_USER_CHARS
            or not set(name) <= _USER_CHARS or not name[0].isalnum()):
        raise ValueError(f"a user name is 1 to {MAX_USER_CHARS} ASCII letters, digits and "
                         f"'._@-', starting with a letter or a digit, not {name!r}")
    return name


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


def tokens_of(text: str | bytes) -> list[bytes]:
    """The keys of a token file's text: one token per line (so a new token can be rolled out
    before the old one is removed), surrounding whitespace removed; blank lines and lines
    starting with ``#`` are skipped.

    Raises:
        ValueError: there is no token in the text.
    """
    raw = text if isinstance(text, bytes) else text.encode("utf-8")
    keys = [line.strip() for line in raw.splitlines()]
    keys = [k for k in keys if k and not k.startswith(b"#")]
    if not keys:
        raise ValueError("a token file must hold at least one token (one per line)")
    return keys


def _transcript(client_nonce: bytes, server_nonce: bytes, session: bytes | None,
                client: str, user: str | None) -> bytes:
    name = client.encode("utf-8")
    sid = session or b""
    parts = [_LABEL, client_nonce, server_nonce, len(sid).to_bytes(1, "big"), sid,
             len(name).to_bytes(4, "big"), name]
    if user is not None:  # only when the hello names a user: older transcripts are unchanged
        who = user.encode("utf-8")
        parts += [len(who).to_bytes(4, "big"), who]
    return b"".join(parts)


def client_proof(key: bytes, client_nonce: bytes, server_nonce: bytes, session: bytes | None,
                 client: str, user: str | None = None) -> bytes:
    """What the client sends to prove it knows the token (of ``user``, if the hello names
    one)."""
    msg = b"client\0" + _transcript(client_nonce, server_nonce, session, client, user)
    return hmac.new(key, msg, hashlib.sha256).digest()


def server_proof(key: bytes, client_nonce: bytes, server_nonce: bytes, session: bytes | None,
                 client: str, user: str | None = None) -> bytes:
    """What the server sends back to prove it knows the token too."""
    msg = b"server\0" + _transcript(client_nonce, server_nonce, session, client, user)
    return hmac.new(key, msg, hashlib.sha256).digest()


def verify(expected: bytes, got: object) -> bool:
    """Compare a proof in constant time (anything but 32 bytes is simply wrong)."""
    return isinstance(got, bytes) and len(got) == len(expected) and \
        hmac.compare_digest(expected, got)
