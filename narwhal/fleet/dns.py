"""discovery.dns: engines from a DNS name, resolved again every interval.

Every address the name resolves to (A and AAAA, through the system resolver:
getaddrinfo, so /etc/hosts and the cluster's DNS alike) is one engine
`http://ADDRESS:PORT` named `dns-ADDRESS-PORT` (an IPv6 address with `-` for `:`), with
the section's role, dialect, model and wave. The names are per address, so an address
that changes is an engine that leaves and another that joins (lifecycle M12, M01), never
a replace. A name that does not resolve is a SourceError (the fleet stays: a resolver
outage must not empty it); a name that resolves to no address is an empty fleet.

SRV records are not read: that needs a DNS library and a server to test it against,
neither of which this project has; one name per port does the same.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from narwhal_generated.models.config import NarwhalConfig

from ..upstream.engines import EngineSpec
from .source import Emit, Snapshot, Source, SourceError

__all__ = ["dns_source", "engine_name"]


def engine_name(addr: str, port: int) -> str:
    return f"dns-{addr.replace(':', '-')}-{port}"


def _url(addr: str, port: int) -> str:
    return f"http://[{addr}]:{port}" if ipaddress.ip_address(addr).version == 6 else f"http://{addr}:{port}"


def dns_source(cfg: NarwhalConfig) -> Source:
    d = cfg.discovery.dns
    assert d is not None
    interval = d.interval_ms / 1000.0

    async def resolve() -> list[str] | str:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(interval):
                infos = await loop.getaddrinfo(d.name, d.port, type=socket.SOCK_STREAM)
        except TimeoutError:
            return f"{d.name}: no answer within {d.interval_ms} ms"
        except OSError as e:
            return f"{d.name}: {e.strerror or e}"
        return sorted({str(i[4][0]).split("%", 1)[0] for i in infos})

    async def run(emit: Emit) -> None:
        last: object = None
        while True:
            got = await resolve()
            if isinstance(got, str):
                item: Snapshot | SourceError = SourceError("dns", got)
            elif len(got) > d.max_engines:
                item = SourceError("dns", f"{d.name} resolves to {len(got)} addresses, more than discovery.dns.max_engines ({d.max_engines})")
            else:
                item = Snapshot("dns", tuple(EngineSpec(engine_name(a, d.port), _url(a, d.port), d.role, d.dialect, d.wave, d.model) for a in got), where=d.name)
            key = item.message if isinstance(item, SourceError) else tuple(s.url for s in item.engines)
            if key != last:
                emit(item)
            last = key
            await asyncio.sleep(interval)

    return run
