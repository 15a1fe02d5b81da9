"""The exception tree of tensorshare, shared by the server and every client.

::

    TensorShareError
    ├── CodecError (ValueError)            a value cannot be encoded or decoded
    │   ├── UnsupportedType (TypeError)    a value holds a type we refuse to send
    │   └── NestingTooDeep                 a value nests deeper than max_depth
    ├── ProtocolError                      the peer broke the wire format
    ├── Timeout (TimeoutError)             something did not happen in the time allowed
    │   ├── ReplyTimeout  (TransportError) the server did not answer in time
    │   └── WaitTimeout   (ServerError)    a waiting get/peek found no data in time
    ├── TransportError (ConnectionError)   the connection itself failed
    │   ├── ConnectError                   could not connect / handshake failed
    │   └── ConnectionLost                 the connection dropped (and did not come back in
    │       │                              time); the request may or may not have run
    │       └── SessionLost                the server forgot this client's session (it was
    │                                      restarted without persistence): the outcome of the
    │                                      request cannot be known
    └── ServerError                        the server answered a request with an error
        ├── BinNotFound (LookupError)      the bin is missing or empty
        ├── InvalidRequest (ValueError)    a malformed request, a bad bin name, an unknown op
        ├── LimitExceeded                  a frame, header, depth or name limit was hit
        │   ├── MemoryLimitExceeded        storing the value would exceed the server's memory limit
        │   └── BinFull                    the bin is at its configured max_items / max_bytes
        └── UnsupportedVersion             no protocol version in common with the server

Local mistakes (a bad argument, a value that cannot be sent) raise ``TypeError`` /
``ValueError`` / ``CodecError`` before anything is sent. ``except Timeout`` catches both kinds
of timeout; ``except TransportError`` only real connection trouble; ``except ServerError``
only answers from the server (a ``WaitTimeout`` is one: the server is fine, the bin was empty).

The server sends a short string code (``ERROR_CODES``); clients turn it back into the
same class with :func:`error_from_code`. An unknown code becomes a plain ``ServerError``.
"""

from __future__ import annotations

__all__ = [
    "ERROR_CODES",
    "BinNotFound",
    "CodecError",
    "ConnectError",
    "ConnectionLost",
    "InvalidRequest",
    "LimitExceeded",
    "MemoryLimitExceeded",
    "BinFull",
    "NestingTooDeep",
    "ProtocolError",
    "ReplyTimeout",
    "ServerError",
    "SessionLost",
    "TensorShareError",
    "Timeout",
    "TransportError",
    "UnsupportedType",
    "UnsupportedVersion",
    "WaitTimeout",
    "code_for",
    "error_from_code",
    "is_server_timeout",
]


class TensorShareError(Exception):
    """Base class of every error raised by tensorshare."""


class CodecError(TensorShareError, ValueError):
    """A value could not be encoded for the wire, or a received value is malformed."""


class UnsupportedType(CodecError, TypeError):
    """A value holds a Python type that tensorshare refuses to send.

    The message names the type and where it sat in the value, e.g. ``value['a'][1]``.
    """


class NestingTooDeep(CodecError):
    """A value nests containers deeper than the ``max_depth`` limit."""


class ProtocolError(TensorShareError):
    """The peer sent bytes that break the wire format; the connection is closed."""


class TransportError(TensorShareError, ConnectionError):
    """The connection to the server failed."""


class ConnectError(TransportError):
    """Could not connect to the server, or the handshake failed."""


class ConnectionLost(TransportError):
    """The connection was lost (or closed) before the server answered.

    With automatic reconnect this is raised only once the server stayed unreachable for the
    call's whole timeout (the message says for how long), or the client was closed.
    """


class SessionLost(ConnectionLost):
    """The server no longer knows this client's session, so a request's outcome is unknown.

    Raised for requests that were sent before the connection dropped when the server that
    answers the reconnect does not know the session (it was restarted without persistence,
    or the session expired). The request may or may not have taken effect there; requests
    made after the reconnect work normally.
    """


class Timeout(TensorShareError, TimeoutError):
    """Something did not happen within the time allowed (see the two subclasses)."""


class ServerError(TensorShareError):
    """The server answered a request with an error.

    Attributes:
        code: the wire error code (see ``ERROR_CODES``).
    """

    code = "error"

    def __init__(self, message: str = "", code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class BinNotFound(ServerError, LookupError):
    """The bin does not exist or holds nothing."""

    code = "bin_not_found"


class InvalidRequest(ServerError, ValueError):
    """The request was malformed: a bad bin name, an unknown op, a wrong argument."""

    code = "invalid_request"


class LimitExceeded(ServerError):
    """A configured limit (frame size, header size, nesting depth, name length) was hit."""

    code = "limit_exceeded"


class MemoryLimitExceeded(LimitExceeded):
    """Storing the value would take the server over its memory limit; nothing was stored."""

    code = "memory_limit"


class BinFull(LimitExceeded):
    """The bin holds its configured ``max_items`` / ``max_bytes`` and refuses more."""

    code = "bin_full"


class WaitTimeout(Timeout, ServerError):
    """A waiting get/peek found no (newer) data within its timeout. The connection is fine."""

    code = "timeout"


class ReplyTimeout(Timeout, TransportError):
    """The server did not answer a request within the client's timeout.

    For a put, append or delete the outcome is unknown: it may or may not have taken effect.
    """


class UnsupportedVersion(ServerError):
    """The client and the server share no protocol version."""

    code = "unsupported_version"


# One table, used in both directions.
ERROR_CODES: dict[str, type[TensorShareError]] = {
    "error": ServerError,
    "bin_not_found": BinNotFound,
    "invalid_request": InvalidRequest,
    "limit_exceeded": LimitExceeded,
    "memory_limit": MemoryLimitExceeded,
    "bin_full": BinFull,
    "unsupported_version": UnsupportedVersion,
    "timeout": WaitTimeout,
    # Sent in an "error" message just before the server closes a connection that broke the
    # wire format; the client reports it as the reason of the ConnectionLost that follows.
    "protocol_error": ProtocolError,
}
_CODE_OF = {cls: code for code, cls in ERROR_CODES.items()}


def code_for(exc: BaseException) -> str:
    """Return the wire code for an exception (``"error"`` for anything unknown)."""
    for cls in type(exc).__mro__:
        code = _CODE_OF.get(cls)  # type: ignore[arg-type]
        if code is not None:
            return code
    return "error"


def error_from_code(code: str, message: str) -> TensorShareError:
    """Turn a wire error code and message back into the matching exception instance.

    The instance carries the wire code as ``.code``.
    """
    cls = ERROR_CODES.get(code, ServerError)
    if issubclass(cls, ServerError):
        return cls(message, code)
    exc = cls(message)
    exc.code = code  # type: ignore[attr-defined]
    return exc


def is_server_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is the server saying a waiting get/peek found no data in time.

    Kept for older code; ``isinstance(exc, WaitTimeout)`` says the same.
    """
    return isinstance(exc, WaitTimeout)
