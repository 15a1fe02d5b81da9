"""The wire: values, frames, messages and the sans-I/O protocol. No sockets, threads or Twisted.

Modules:
    codec     values (tensors, arrays, containers) <-> a msgpack tree plus raw buffers
    frames    the 16-byte frame prefix, 64-byte alignment, the incremental frame decoder
    messages  every request, reply and notification as a frozen dataclass
    records   the records a put, append, get and their replies are, and the buffers they carry
    protocol  the op table and both sides of a connection: bytes in -> messages out
    streams   the ops and replies of stream bins, registered in protocol's table
    services  the ops and replies of service bins, registered likewise

The op table is complete once this package is imported (as it is before any of its modules):
the core ops come from :mod:`.protocol`, then :mod:`.streams` and :mod:`.services` register
theirs, in that order (the order of the docs). No module of the package imports one above it.

This package imports nothing of tensorshare but :mod:`tensorshare.errors` and
:mod:`tensorshare.memory`; a test holds it to that.
"""

from . import protocol, streams, services  # noqa: E402, F401, I001  (the op table, in order)
