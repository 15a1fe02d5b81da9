"""The wire: values, frames, messages and the sans-I/O protocol. No sockets, threads or Twisted.

Modules, each importing only those above it in this list:
    records   the records a put, append, get and their replies are, and the buffers they carry
    frames    the 16-byte frame prefix, 64-byte alignment, the incremental frame decoder
    codec     values (tensors, arrays, containers) <-> a msgpack tree plus raw buffers
    messages  every other request, reply and notification as a frozen dataclass
    auth      the handshake's challenge-response (HMAC-SHA256) and user names
    fields    what a row of the op table is (Op), the checks of header fields, items included
    streams   the messages and op table rows of stream bins
    services  the messages and op table rows of service bins
    protocol  the op table, built from the rows of every kind, and both sides of a connection
    address   server addresses (tensorshare://, unix://) as text and back

The op table (:data:`.protocol.OPS`) is built in one place, :mod:`.protocol`, from the core
rows it writes and the rows :mod:`.streams` and :mod:`.services` export, in the order of
``docs/PROTOCOL.md`` §3.2: it is whole once :mod:`.protocol` is imported, whatever was
imported before it (no module registers anything at import).

This package imports nothing of tensorshare but :mod:`tensorshare.errors` and
:mod:`tensorshare.memory`; a test holds it to that.
"""
