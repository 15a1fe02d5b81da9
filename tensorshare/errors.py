"""The exception tree of tensorshare, shared by the server and every client.

::

    TensorShareError
    ├── CodecError (ValueError)            a value cannot be encoded or decoded
    │   ├── UnsupportedType (TypeError)    a value holds a type we refuse to send
    │   └── NestingTooDeep                 a value nests deeper than max_depth
    ├── ProtocolError                      the peer broke the wire format
    ├── StreamFinished                     a stream's producers ended it and this job read
    │                                      all of it: no pass is left (never from the wire)
    ├── DeviceCopyFailed                   a read took its items but could not copy them to
    │                                      the device asked for (``value``: the CPU value)
    ├── Timeout (TimeoutError)             something did not happen in the time allowed
    │   ├── ReplyTimeout  (TransportError) the server did not answer in time
    │   └── WaitTimeout   (ServerError)    a waiting get/peek found no data in time
    ├── TransportError (ConnectionError)   the connection itself failed
    │   ├── ConnectError                   could not connect / handshake failed
    │   └── ConnectionLost                 the connection dropped (and did not come back in
    │       │                              time); the request may or may not have run
    │       ├── SessionLost                the server forgot this client's session (it was
    │       │                              restarted without persistence): the outcome of the
    │       │                              request cannot be known
    │       ├── SessionTakenOver           another connection took this client's session over
    │       │                              (two processes share one session id); not retried
    │       └── ShardsUnavailable          a ShardedClient's list/stats/ping: some servers did
    │                                      not answer (``result``: the others' answer merged,
    │                                      ``missing``: which servers, and why)
    └── ServerError                        the server answered a request with an error
        ├── BinNotFound (LookupError)      the bin is missing or empty
        ├── InvalidRequest (ValueError)    a malformed request, a bad bin name, an unknown op
        ├── LimitExceeded                  a frame, header, depth or name limit was hit
        │   ├── FrameTooLarge (ValueError) the client refused a value over the server's
        │   │                              max_frame_bytes: nothing was sent (never from the wire)
        │   ├── MemoryLimitExceeded        storing the value would exceed the server's memory limit
        │   ├── BinFull                    the bin is at its configured max_items / max_bytes
        │   └── QuotaExceeded              the user is at its max_memory / max_connections
        ├── AuthenticationError            no token, a wrong token, or a server without it
        ├── PermissionDenied               the user (or the read-only token) may not do this
        ├── StorageUnavailable             the server cannot write its data log (a full disk):
        │                                  writes are refused until it can, reads go on
        ├── Lagged                         a stream consumer fell behind and items it had not
        │                                  read were freed (``missed`` says how many)
        ├── ProducerGone                   a stream's producer died before ending its epoch
        ├── ServiceFailed                  a service's host failed the call (its model raised)
        ├── ReadOnlyReplica                a write sent to a replica (``primary``: where to send it)
        ├── NotEnoughReplicas              fewer replicas than --min-replicas confirmed the write
        └── UnsupportedVersion             no protocol version in common with the server

Local mistakes (a bad argument, a value that cannot be sent) raise ``TypeError`` /
``ValueError`` / ``CodecError`` before anything is sent. ``except Timeout`` catches both kinds
of timeout; ``except TransportError`` only real connection trouble; ``except ServerError``
only answers from the server (a ``WaitTimeout`` is one: the server is fine, the bin was empty),
but for ``FrameTooLarge``: a value over the server's frame limit is refused by the client
itself, before anything is sent, as a ``ValueError`` that is also the ``LimitExceeded`` the
server would have answered (``except LimitExceeded`` catches it either way).

Every error that travels has its wire code as the class attribute ``code`` (``BinFull.code ==
"bin_full"``); :data:`ERROR_CODES` is built from them, and clients turn a code back into the
same class with :func:`error_from_code`. An unknown code becomes a plain ``ServerError``.
"""

from __future__ import annotations

import re

__all__ = [
    "ERROR_CODES",
    "AuthenticationError",
    "BinNotFound",
    "CodecError",
    "ConnectError",
    "ConnectionLost",
    "DeviceCopyFailed",
    "InvalidRequest",
    "Lagged",
    "FrameTooLarge",
    "LimitExceeded",
    "MemoryLimitExceeded",
    "BinFull",
    "NestingTooDeep",
    "NotEnoughReplicas",
    "PermissionDenied",
    "QuotaExceeded",
    "ReadOnlyReplica",
    "ProducerGone",
    "ProtocolError",
    "ReplyTimeout",
    "ServerError",
    "ServiceFailed",
    "SessionLost",
    "SessionTakenOver",
    "ShardsUnavailable",
    "StorageUnavailable",
    "StreamFinished",
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
    """Base class of every error raised by tensorshare.

    Attributes:
        code: the wire code of the errors that travel (``None`` for local ones).
    """

    code: str | None = None


class CodecError(TensorShareError, ValueError):
    """A value could not be encoded for the wire, or a received value is malformed."""


class UnsupportedType(CodecError, TypeError):
    """A value holds a Python type that tensorshare refuses to send.

    The message names the type and where it sat in the value, e.g. ``value['a'][1]``.
    """


class NestingTooDeep(CodecError):
    """A value nests containers deeper than the ``max_depth`` limit."""


class ProtocolError(TensorShareError):
    """The peer sent bytes that break the wire format; the connection is closed.

    The server says so in a connection-level error with this code just before it closes;
    the client reports it as the reason of the ``ConnectionLost`` that follows.
    """

    code = "protocol_error"


class TransportError(TensorShareError, ConnectionError):
    """The connection to the server failed."""


class ConnectError(TransportError):
    """Could not connect to the server, or the handshake failed."""


class ConnectionLost(TransportError):
    """The connection was lost (or closed) before the server answered.

    With automatic reconnect this is raised only once the server stayed unreachable for the
    call's whole timeout (the message says for how long), or the client was closed. A
    ``ShardedClient`` raises it too for a call to a server that could not be reached at its
    first use (nothing was sent; the ``ConnectError`` is its ``__cause__``).
    """


class SessionLost(ConnectionLost):
    """The server no longer knows this client's session, so a request's outcome is unknown.

    Raised for requests that were sent before the connection dropped when the server that
    answers the reconnect does not know the session (it was restarted without persistence,
    or the session expired). The request may or may not have taken effect there; requests
    made after the reconnect work normally.
    """


class SessionTakenOver(ConnectionLost):
    """Another connection resumed this client's session, and the server closed this one.

    Two live processes are using the same session id (a client object shared across a
    fork, or a session id given twice). Reconnecting would only take it back, so the client
    stops: every call fails with this error.
    """

    code = "session_taken_over"


class ShardsUnavailable(ConnectionLost):
    """Some servers of a :class:`~tensorshare.ShardedClient` did not answer a request that
    asks every server (``list``, ``stats``, ``ping``); the others did.

    Attributes:
        result: what the call returns, merged from the servers that answered (for ``stats``,
            ``"servers"`` holds only those).
        missing: ``{address: the error}`` for each server that did not answer.
    """

    def __init__(self, message: str, result: object = None,
                 missing: dict[str, BaseException] | None = None) -> None:
        super().__init__(message)
        self.result = result
        self.missing: dict[str, BaseException] = dict(missing or {})


class Timeout(TensorShareError, TimeoutError):
    """Something did not happen within the time allowed (see the two subclasses)."""


class ServerError(TensorShareError):
    """The server answered a request with an error.

    Attributes:
        code: the wire error code (see ``ERROR_CODES``).
    """

    code: str = "error"

    def __init__(self, message: str = "", code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code  # an unknown code (a newer server's) is kept on the instance


class BinNotFound(ServerError, LookupError):
    """The bin does not exist or holds nothing."""

    code = "bin_not_found"


class InvalidRequest(ServerError, ValueError):
    """The request was malformed: a bad bin name, an unknown op, a wrong argument."""

    code = "invalid_request"


class LimitExceeded(ServerError):
    """A configured limit (frame size, header size, nesting depth, name length) was hit."""

    code = "limit_exceeded"


class FrameTooLarge(LimitExceeded, ValueError):
    """A value is larger than the server's frame limit (``max_frame_bytes``): the client
    refused it before anything was sent (a local error, never from the wire; it is a
    ``LimitExceeded`` too, what the server would have answered, with its code)."""


class MemoryLimitExceeded(LimitExceeded):
    """Storing the value would take the server over its memory limit; nothing was stored."""

    code = "memory_limit"


class BinFull(LimitExceeded):
    """The bin holds its configured ``max_items`` / ``max_bytes`` and refuses more."""

    code = "bin_full"


class QuotaExceeded(LimitExceeded):
    """The user this client authenticated as is at its quota (``max_memory`` or
    ``max_connections`` in the server's users file): nothing was stored (or the connection was
    refused). The message names the user and the quota. A write that asked to wait for room
    (``wait_room=True``) raises it once its wait runs out. Other users are not affected."""

    code = "quota_exceeded"


class WaitTimeout(Timeout, ServerError):
    """A waiting get/peek found no (newer) data within its timeout. The connection is fine."""

    code = "timeout"


class ReplyTimeout(Timeout, TransportError):
    """The server did not answer a request within the client's timeout.

    For a put, append or delete the outcome is unknown: it may or may not have taken effect.
    """


class AuthenticationError(ServerError):
    """The handshake failed: no token, a wrong token, or a server that cannot prove it knows
    the token. The message names the server. Never retried as if it were a network blip."""

    code = "authentication_failed"


class PermissionDenied(ServerError):
    """The connection's user may not do this: the bin is outside its patterns in the server's
    users file (the read-only token may only peek, list, stat and listen). The message names
    the user, the operation and the bin; the connection stays usable."""

    code = "permission_denied"


class StorageUnavailable(ServerError):
    """The server cannot write its data log (a full disk, an I/O error), so it refuses writes
    until it can; nothing was changed. Reads, listens and stats still work, and the server
    accepts writes again by itself once the log can be written. The message names the data
    directory and the cause."""

    code = "storage_unavailable"


class Lagged(ServerError):
    """A stream consumer missed items: it fell behind (it was detached under
    ``on_lag="detach"``, or it was away longer than its lease) and the items it had not read
    were freed. ``missed`` says how many.

    The consumer continues from the oldest item still kept: nothing else is lost. What to do:
    carry on (the items missed are gone), or join again at ``"next_epoch"`` to restart at a
    clean epoch boundary; a consumer that must never miss anything belongs on a stream with
    ``on_lag="wait"`` and a lease long enough for its restarts.

    Attributes:
        missed: how many items were missed (``None`` when not known).
    """

    code = "lagged"

    def __init__(self, message: str = "", code: str | None = None, *,
                 missed: int | None = None) -> None:
        super().__init__(message, code)
        self.missed = missed


class ProducerGone(ServerError):
    """A producer of the stream died (its connection was gone for longer than its lease, or
    its client closed) before it ended the epoch: that epoch can never be complete.

    Consumers get it instead of waiting forever; producers that are still alive get it for
    appends to that epoch. What to do: a consumer joins again at ``"next_epoch"`` (the
    Python ``SharedLoader`` does so on its next iteration) and waits for a producer to come
    back; a producer opens the stream again and restarts its epoch. A producer that comes
    back (opens with the same ``producer`` index) ends the broken epoch as aborted and starts
    a new one that every consumer sees.
    """

    code = "producer_gone"


class StreamFinished(TensorShareError):
    """A pass over a finished stream: its producers ended their last epoch (the stream
    is finished) and this job has read all of it, so no batch will ever come. Raised by
    :class:`~tensorshare.data.SharedLoader` at the start of such a pass, never a silent
    empty epoch. A producer that opens the stream again starts a new run.

    Attributes:
        stream: the stream's name.
        epochs: how many epochs the stream had (aborted ones included).
    """

    def __init__(self, message: str = "", *, stream: str = "", epochs: int = 0) -> None:
        super().__init__(message)
        self.stream = stream
        self.epochs = epochs


class DeviceCopyFailed(TensorShareError):
    """A read with ``device=`` received its value but could not copy it to the device (out of
    device memory, a device error). Whatever the read took from its bin is in ``value``, on
    the CPU, so nothing is lost: use it, or put it back.

    Never from the wire: the server did its part. (A bad ``device`` argument, or a CUDA
    device asked of a torch without CUDA, is a ``ValueError`` raised before anything is
    sent.)

    Attributes:
        value: what the call would have returned, its tensors on the CPU (for ``fetch``,
            the whole result record; for a stream read, the whole batch).
        device: the device the copy was for (a ``torch.device``).
    """

    def __init__(self, message: str = "", *, value: object = None,
                 device: object = None) -> None:
        super().__init__(message)
        self.value = value
        self.device = device


class ServiceFailed(ServerError):
    """The host of a service bin could not compute this call's answer: its model raised
    (the message is the host's error), or the host sent no answer for it. The call ran at
    most once; nothing else is affected (other calls go on)."""

    code = "service_failed"


class ReadOnlyReplica(ServerError):
    """A write (or a stream or service op) sent to a replica, or to a former primary that
    heard of a newer term: nothing was changed. Send it to the primary; a client given an
    address list finds it by itself.

    Attributes:
        primary: the primary's address as this server knows it (``None`` when it knows none,
            as on a former primary fenced by a newer term).
    """

    code = "read_only_replica"

    def __init__(self, message: str = "", code: str | None = None) -> None:
        super().__init__(message, code)
        found = re.search(r"\(primary: ([^)\s]+)\)", message)
        self.primary: str | None = found.group(1) if found else None


class NotEnoughReplicas(ServerError):
    """The server runs with ``--min-replicas N`` and could not get the write onto N replicas.

    Refused at once (nothing applied) while fewer than N replicas are in sync; answered after
    ``--replica-timeout`` when the replicas did not confirm it in time: then the write may
    have been applied (as with Redis's ``WAIT``), and retried in the same session it is
    applied once.
    """

    code = "not_enough_replicas"


class UnsupportedVersion(ServerError):
    """The client and the server share no protocol version."""

    code = "unsupported_version"


# One table, used in both directions: wire code -> class, from the classes' own ``code``.
ERROR_CODES: dict[str, type[TensorShareError]] = {
    cls.code: cls for cls in (ServerError, BinNotFound, InvalidRequest, LimitExceeded,
                              MemoryLimitExceeded, BinFull, QuotaExceeded, UnsupportedVersion,
                              WaitTimeout,
                              ProtocolError, SessionTakenOver, StorageUnavailable,
                              AuthenticationError, PermissionDenied, Lagged, ProducerGone,
                              ServiceFailed, ReadOnlyReplica, NotEnoughReplicas)
    if cls.code is not None
}


def code_for(exc: BaseException) -> str:
    """Return the wire code for an exception (``"error"`` for anything unknown)."""
    code = getattr(exc, "code", None)
    return code if isinstance(code, str) and code in ERROR_CODES else "error"


def error_from_code(code: str, message: str) -> TensorShareError:
    """Turn a wire error code and message back into the matching exception instance.

    The instance carries the wire code as ``.code``.
    """
    cls = ERROR_CODES.get(code, ServerError)
    if issubclass(cls, ServerError):
        return cls(message, code if code != cls.code else None)
    return cls(message)


def is_server_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is the server saying a waiting get/peek found no data in time.

    Kept for older code; ``isinstance(exc, WaitTimeout)`` says the same.
    """
    return isinstance(exc, WaitTimeout)
