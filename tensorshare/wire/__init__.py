"""The wire: values, frames, messages and the sans-I/O protocol. No sockets, threads or Twisted.

Modules:
    codec     values (tensors, arrays, containers) <-> a msgpack tree plus raw buffers
    frames    the 16-byte frame prefix, 64-byte alignment, the incremental frame decoder
    messages  every request, reply and notification as a frozen dataclass
    protocol  the op table and both sides of a connection: bytes in -> messages out

This package imports nothing of tensorshare but :mod:`tensorshare.errors` and
:mod:`tensorshare.memory`; a test holds it to that.
"""
