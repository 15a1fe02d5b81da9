"""The asyncio face's way to the primary of an address list: the blocking client's probes
(:class:`~tensorshare.client.failover.Probe`, the choice in
:class:`~tensorshare.client.failover.PrimaryChoice`), over the loop's own connections.

Every server of the list is asked at once (each within the probe's timeout), so a server
that is down costs one timeout, not one per server.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

from ..client.endpoint import Endpoint
from ..client.failover import PROBE_ERRORS, PrimaryChoice, Probe

__all__ = ["find_primary"]


async def find_primary(choice: PrimaryChoice,
                       tls: Callable[[Endpoint], ssl.SSLContext]) -> Endpoint:
    """Ask every server of ``choice`` its role and term; fence a former primary that has not
    heard of the newer term (best effort); return the primary's endpoint.

    Args:
        tls: the TLS context for an endpoint that speaks TLS (the client's own).

    Raises:
        ConnectionRefusedError: none says it is the primary (an ``OSError``: the client
            tries again within its timeout, as after a refused connection).
    """

    async def ask(ep: Endpoint) -> None:
        try:
            choice.heard(ep, await _exchange(choice.role_probe(ep), choice.probe_timeout, tls))
        except (*PROBE_ERRORS, TimeoutError) as exc:
            choice.failed(ep, exc)

    async def fence(ep: Endpoint, term: int) -> None:
        try:
            await _exchange(choice.fence_probe(ep, term), choice.probe_timeout, tls)
        except (*PROBE_ERRORS, TimeoutError):
            pass  # (a user without the replicate right cannot: nothing fails)

    await asyncio.gather(*(ask(ep) for ep in choice.endpoints))
    primary, stale = choice.choose()
    await asyncio.gather(*(fence(ep, term) for ep, term in stale))
    return primary


async def _exchange(probe: Probe, timeout: float,
                    tls: Callable[[Endpoint], ssl.SSLContext]) -> Probe:
    """Run ``probe`` over a connection of its own, within ``timeout``."""
    where = probe.ep.address
    async with asyncio.timeout(timeout):
        if where.path is not None:
            reader, writer = await asyncio.open_unix_connection(where.path)
        elif probe.ep.tls:
            reader, writer = await asyncio.open_connection(
                where.host, where.port, ssl=tls(probe.ep), server_hostname=where.host)
        else:
            reader, writer = await asyncio.open_connection(where.host, where.port)
        try:
            writer.write(probe.start())
            while not probe.done:
                writer.write(probe.feed(await reader.read(1 << 16)))
            return probe
        finally:
            writer.close()
