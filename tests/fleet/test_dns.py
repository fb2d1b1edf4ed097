"""discovery.dns: every address a name resolves to is one engine; resolved again every
interval; a name that does not resolve changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.config import parse_config
from narwhal.fleet.dns import dns_source, engine_name
from narwhal.fleet.source import Snapshot, SourceError
from narwhal.mock import MockConfig, running_fleet
from tests.helpers import running_router, sse, wait_until


@pytest.fixture(scope="module")
def mock() -> Iterator[Any]:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="m0")]) as ms:
        yield ms[0]


def first(cfg: dict[str, Any], timeout: float = 10.0) -> Snapshot | SourceError:
    got: list[Snapshot | SourceError] = []

    async def go() -> None:
        task = asyncio.create_task(dns_source(parse_config(cfg))(got.append))
        try:
            async with asyncio.timeout(timeout):
                while not got:
                    await asyncio.sleep(0.01)
        finally:
            task.cancel()

    asyncio.run(go())
    return got[0]


def test_every_address_of_the_name_is_an_engine() -> None:
    snap = first({"discovery": {"dns": {"name": "localhost", "port": 8123, "role": "unified", "dialect": "sglang", "wave": "w"}}})
    assert isinstance(snap, Snapshot) and snap.source == "dns"
    by_name = {s.name: s for s in snap.engines}
    assert by_name[engine_name("127.0.0.1", 8123)].url == "http://127.0.0.1:8123"
    assert all(s.dialect == "sglang" and s.wave == "w" for s in snap.engines)
    if "::1" in {s.url.split("[")[-1].split("]")[0] for s in snap.engines}:
        assert by_name["dns--1-8123"].url == "http://[::1]:8123"


def test_a_name_that_does_not_resolve_changes_nothing() -> None:
    err = first({"discovery": {"dns": {"name": "no-such-engine.invalid", "port": 1, "interval_ms": 2000}}})
    assert isinstance(err, SourceError) and "no-such-engine.invalid" in err.message


def test_more_addresses_than_max_engines_is_an_error() -> None:
    err = first({"discovery": {"dns": {"name": "localhost", "port": 1, "max_engines": 1}}})
    # localhost may have one address here (no ::1): then it is a fleet of one
    assert isinstance(err, SourceError | Snapshot)
    if isinstance(err, SourceError):
        assert "max_engines" in err.message


def test_the_router_serves_through_engines_found_by_dns(mock: Any) -> None:
    cfg = {"admission": {"mode": "open", "prediction": {"profile_on_start": False}}, "monitoring": {"poll_interval_ms": 100, "stale_after_ms": 60000},
           "discovery": {"dns": {"name": "localhost", "port": mock.port, "interval_ms": 500}}}
    with running_router(cfg, []) as rr:
        name = engine_name("127.0.0.1", mock.port)
        wait_until(lambda: any(e["name"] == name and e["lifecycle"]["state"] == "active" for e in rr.get("/v1/engines").json()["data"]), timeout=10, what="the DNS engine")
        assert next(e for e in rr.get("/v1/engines").json()["data"] if e["name"] == name)["lifecycle"]["source"] == "dns"
        s = sse(rr.url, {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
        assert s.status == 200 and s.done
        rr.balanced()
