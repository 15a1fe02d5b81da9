"""Memory that travels without being copied: sealed memfds passed over a Unix socket (``shm``).

Pinned host buffers and GPU memory (CUDA IPC on one host) are to land here too.
"""
