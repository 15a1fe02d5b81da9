"""The exception tree of tensorshare, shared by the server and every client.

::

    TensorShareError
    ├── CodecError (ValueError)            a value cannot be encoded or decoded
    │   └── UnsupportedType (TypeError)    a value holds a type we refuse to send
    ├── ProtocolError                      the peer broke the wire format
    ├── TransportError (ConnectionError)   the connection itself failed
    │   ├── ConnectError                   could not connect / handshake failed
    │   ├── ConnectionLost                 the connection dropped; pending calls fail with it
    │   └── Timeout (TimeoutError)         no answer, or no data, within the time allowed
    └── ServerError                        the server answered a request with an error
        ├── BinNotFound (LookupError)      the bin is missing or empty
        ├── InvalidRequest (ValueError)    a malformed request, a bad bin name, an unknown op
        ├── LimitExceeded                  a frame, header, depth or name limit was hit
        │   └── MemoryLimitExceeded        storing the value would exceed the server's memory limit
        └── UnsupportedVersion             no protocol version in common with the server

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
    "ProtocolError",
    "ServerError",
    "TensorShareError",
    "Timeout",
    "TransportError",
    "UnsupportedType",
    "UnsupportedVersion",
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


class ProtocolError(TensorShareError):
    """The peer sent bytes that break the wire format; the connection is closed."""


class TransportError(TensorShareError, ConnectionError):
    """The connection to the server failed."""


class ConnectError(TransportError):
    """Could not connect to the server, or the handshake failed."""


class ConnectionLost(TransportError):
    """The connection was lost (or closed) before the server answered."""


class Timeout(TransportError, TimeoutError):
    """No answer, or no data in a waited-on bin, within the time allowed."""


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


class UnsupportedVersion(ServerError):
    """The client and the server share no protocol version."""

    code = "unsupported_version"


# One table, used in both directions. ``Timeout`` is here because a server-side wait
# (get/peek with a timeout) that expires is reported with the code "timeout".
ERROR_CODES: dict[str, type[TensorShareError]] = {
    "error": ServerError,
    "bin_not_found": BinNotFound,
    "invalid_request": InvalidRequest,
    "limit_exceeded": LimitExceeded,
    "memory_limit": MemoryLimitExceeded,
    "unsupported_version": UnsupportedVersion,
    "timeout": Timeout,
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

    The instance carries the wire code as ``.code``, so a ``Timeout`` the server reported
    (a waiting get found no data: ``code == "timeout"``) can be told apart from a
    ``Timeout`` raised because the server did not answer at all (no ``code``).
    """
    cls = ERROR_CODES.get(code, ServerError)
    if issubclass(cls, ServerError):
        return cls(message, code)
    exc = cls(message)
    exc.code = code  # type: ignore[attr-defined]
    return exc


def is_server_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is the server saying a waiting get/peek found no data in time."""
    return isinstance(exc, Timeout) and getattr(exc, "code", None) == "timeout"
