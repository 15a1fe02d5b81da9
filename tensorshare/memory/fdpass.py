"""File descriptors passed over a Unix socket (SCM_RIGHTS), shared by the
server's transport and the blocking client. Kept apart from :mod:`.shm`, which
the sans-I/O wire layer imports."""

from __future__ import annotations

import array
import socket
from typing import Any

__all__ = ["ANC_SPACE", "MAX_FDS_PER_MESSAGE", "fds_of"]


# Linux passes at most 253 descriptors per message (SCM_MAX_FD).
ANC_SPACE = socket.CMSG_SPACE(253 * array.array("i").itemsize)
#: The most descriptors tensorshare passes with one message (docs/PROTOCOL.md §4.4): what a
#: receiver that makes room for 64 (Twisted's default) takes whole. A frame with more memfd
#: buffers passes them over several messages, each with at least one byte of the frame.
MAX_FDS_PER_MESSAGE = 64


def fds_of(ancdata: Any) -> list[int]:
    """The file descriptors a ``recvmsg`` brought (SCM_RIGHTS), in order."""
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - len(data) % arr.itemsize])
            fds.extend(arr)
    return fds
