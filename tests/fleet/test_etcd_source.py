"""discovery.etcd (narwhal/fleet/etcd.py) against a real etcd (tests/ha/etcd.py): the
source's snapshots and errors as keys are put, deleted, expire with their lease, do not
validate, name one engine twice, outnumber max_engines, and while etcd is killed and
started again on its data directory and port. Every wait is bounded; etcd is stopped by
its PID in a fixture."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from narwhal.config import ConfigError, parse_config
from narwhal.fleet.etcd import EtcdFleet, etcd_source
from narwhal.fleet.source import Snapshot, SourceError
from narwhal.upstream.etcd import Etcd, EtcdCompacted, KeyValue, WatchEvent, prefix_end
from tests.ha.etcd import OwnEtcd, own_etcd

PREFIX = "/narwhal/engines/"


@pytest.fixture
def etcd() -> Iterator[OwnEtcd]:
    with own_etcd() as srv:
        yield srv


def entry(name: str, port: int = 9000, **kw: Any) -> bytes:
    return orjson.dumps({"name": name, "url": f"http://127.0.0.1:{port}", "role": "unified", "dialect": "vllm", **kw})


class Kv:
    """Test-side writes to etcd over its gateway."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.c = httpx.AsyncClient(timeout=5)

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = await self.c.post(self.url + path, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        b = {"key": base64.b64encode(key.encode()).decode(), "value": base64.b64encode(value).decode()}
        if lease:
            b["lease"] = str(lease)
        return int((await self.call("/v3/kv/put", b))["header"]["revision"])

    async def delete(self, key: str) -> None:
        await self.call("/v3/kv/deleterange", {"key": base64.b64encode(key.encode()).decode()})

    async def grant(self, ttl: int) -> int:
        return int((await self.call("/v3/lease/grant", {"TTL": ttl}))["ID"])


class Run:
    """The source running as a task, what it emitted in order."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = parse_config(cfg, source="test")
        self.got: list[Snapshot | SourceError] = []
        self.task: asyncio.Task[None] | None = None

    def start(self) -> Run:
        self.task = asyncio.create_task(etcd_source(self.cfg)(self.got.append))
        return self

    async def stop(self) -> None:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(BaseException):
            await self.task
        assert self.task.done()

    def snapshots(self) -> list[Snapshot]:
        return [x for x in self.got if isinstance(x, Snapshot)]

    def errors(self) -> list[SourceError]:
        return [x for x in self.got if isinstance(x, SourceError)]

    def names(self) -> set[str] | None:
        s = self.snapshots()
        return {e.name for e in s[-1].engines} if s else None

    async def until(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        end = time.monotonic() + timeout
        while True:
            v = pred()
            if v:
                return v
            if self.task is not None and self.task.done():
                self.task.result()
                raise AssertionError(f"the source ended while waiting for {what}")
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; emitted {self.got}")
            await asyncio.sleep(0.02)


def cfg_for(url: str, **kw: Any) -> dict[str, Any]:
    return {"discovery": {"etcd": {"endpoints": [url], "prefix": PREFIX, "request_timeout_ms": 500, **kw}}}


@contextlib.asynccontextmanager
async def running(cfg: dict[str, Any]) -> AsyncIterator[Run]:
    r = Run(cfg).start()
    try:
        yield r
    finally:
        await r.stop()


def go(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), 30))


def test_engines_come_leave_and_expire_with_their_lease(etcd: OwnEtcd) -> None:
    async def main() -> None:
        kv = Kv(etcd.url)
        await kv.put(PREFIX + "a", entry("a", 9001))
        await kv.put(PREFIX + "b", entry("b", 9002))
        await kv.put("/narwhal/enginesX", entry("outside", 9009))  # not under the prefix
        async with running(cfg_for(etcd.url)) as r:
            await r.until(lambda: r.names() == {"a", "b"}, 5, "a snapshot with both")
            first = r.snapshots()[0]
            assert first.source == "etcd" and first.where.startswith(PREFIX + "@")
            assert {e.url for e in first.engines} == {"http://127.0.0.1:9001", "http://127.0.0.1:9002"}
            await kv.delete(PREFIX + "a")
            await r.until(lambda: r.names() == {"b"}, 5, "a snapshot without a")
            lease = await kv.grant(2)
            await kv.put(PREFIX + "c", entry("c", 9003), lease=lease)
            await r.until(lambda: r.names() == {"b", "c"}, 5, "c with its lease")
            t0 = time.monotonic()
            await r.until(lambda: r.names() == {"b"}, 6, "c gone when its lease expired")
            assert time.monotonic() - t0 > 0.5  # it did not leave at once: the lease ran out
            await kv.put(PREFIX + "b", entry("b", 9012))  # an update in place
            await r.until(lambda: r.snapshots()[-1].engines[0].url == "http://127.0.0.1:9012", 5, "b's new url")
            assert r.errors() == []
        await kv.c.aclose()

    go(main)


def test_an_invalid_value_is_left_out_and_named_others_unaffected(etcd: OwnEtcd) -> None:
    async def main() -> None:
        kv = Kv(etcd.url)
        await kv.put(PREFIX + "a", entry("a", 9001))
        await kv.put(PREFIX + "bad", entry("b", 9002, role="sideways"))
        await kv.put(PREFIX + "yaml", b"name: y\nurl: http://127.0.0.1:9005\nrole: unified\ndialect: vllm\n")
        async with running(cfg_for(etcd.url)) as r:
            await r.until(lambda: r.names() == {"a", "y"} and r.errors(), 5, "a and y, and an error")
            (err,) = r.errors()
            assert f"etcd key {PREFIX}bad" in err.message and "role" in err.message, err.message
            await kv.put(PREFIX + "worse", b"{not json: [")
            await kv.put(PREFIX + "c", entry("c", 9003))
            await r.until(lambda: r.names() == {"a", "y", "c"}, 5, "c joins despite the bad keys")
            await r.until(lambda: any(f"{PREFIX}worse" in e.message for e in r.errors()), 5, "the error naming worse")
            assert len(r.errors()) == 2  # bad is not reported again for every change
            # a key that named an engine and is overwritten with an invalid value: the engine leaves
            await kv.put(PREFIX + "a", entry("a", 9001, dialect="klingon"))
            await r.until(lambda: r.names() == {"y", "c"}, 5, "a leaves")
            assert "dialect" in r.errors()[-1].message and f"{PREFIX}a" in r.errors()[-1].message
            # the same engine named twice: the key created first wins
            await kv.put(PREFIX + "c-again", entry("c", 9099))
            await r.until(lambda: any("c-again" in e.message for e in r.errors()), 5, "an error naming c-again")
            assert [e.url for e in r.snapshots()[-1].engines if e.name == "c"] == ["http://127.0.0.1:9003"]
            assert "name" in r.errors()[-1].message
        await kv.c.aclose()

    go(main)


def test_more_than_max_engines_is_an_error_and_no_snapshot(etcd: OwnEtcd) -> None:
    async def main() -> None:
        kv = Kv(etcd.url)
        for n in ("a", "b", "c"):
            await kv.put(PREFIX + n, entry(n, 9000 + ord(n)))
        async with running(cfg_for(etcd.url, max_engines=2)) as r:
            await r.until(r.errors, 5, "the error")
            assert "max_engines" in r.errors()[0].message and r.snapshots() == []
            await kv.delete(PREFIX + "c")
            await r.until(lambda: r.names() == {"a", "b"}, 5, "a snapshot once under the bound")
            await kv.put(PREFIX + "d", entry("d", 9100))
            await r.until(lambda: len(r.errors()) == 2, 5, "the error again")
            await asyncio.sleep(0.2)
            assert r.names() == {"a", "b"}  # no snapshot while over the bound
        await kv.c.aclose()

    go(main)


def test_etcd_killed_and_started_again_one_error_then_a_snapshot(etcd: OwnEtcd) -> None:
    async def main() -> None:
        kv = Kv(etcd.url)
        await kv.put(PREFIX + "a", entry("a", 9001))
        await kv.put(PREFIX + "b", entry("b", 9002))
        async with running(cfg_for(etcd.url)) as r:
            await r.until(lambda: r.names() == {"a", "b"}, 5, "the first snapshot")
            n = len(r.snapshots())
            etcd.kill()
            await r.until(r.errors, 5, "an error: etcd unreachable")
            await asyncio.sleep(2.0)  # several retries
            assert len(r.errors()) == 1, r.errors()  # once per outage
            assert "unreachable" in r.errors()[0].message
            assert len(r.snapshots()) == n  # the fleet is unchanged while etcd is away
            await asyncio.to_thread(etcd.start)
            await kv.delete(PREFIX + "b")  # changed while the source was away from etcd
            await r.until(lambda: len(r.snapshots()) > n and r.names() == {"a"}, 10, "a snapshot after etcd is back")
            assert len(r.errors()) == 1
            await kv.put(PREFIX + "c", entry("c", 9003))  # and it watches again
            await r.until(lambda: r.names() == {"a", "c"}, 5, "c after the restart")
        await kv.c.aclose()

    go(main)


def test_a_compacted_start_revision_is_an_exception_to_read_again(etcd: OwnEtcd) -> None:
    async def main() -> None:
        kv = Kv(etcd.url)
        first = await kv.put(PREFIX + "a", entry("a"))
        last = await kv.put(PREFIX + "a", entry("a", 9002))
        await kv.call("/v3/kv/compaction", {"revision": str(last), "physical": True})
        c = Etcd([etcd.url], timeout_s=1.0)
        try:
            rev, items = await c.get_prefix(PREFIX.encode())
            assert rev == last and [k for k, _ in items] == [(PREFIX + "a").encode()]
            with pytest.raises(EtcdCompacted) as x:
                async for _ in c.watch_prefix(PREFIX.encode(), first):
                    pass
            assert x.value.compact_revision == last
            # a watch from the read's revision + 1 sees what comes next
            got: list[WatchEvent] = []

            async def watch() -> None:
                async for batch in c.watch_prefix(PREFIX.encode(), rev + 1):
                    got.extend(batch)
                    if len(got) >= 2:
                        return

            w = asyncio.create_task(watch())
            await asyncio.sleep(0.2)
            await kv.put(PREFIX + "b", entry("b"))
            await kv.delete(PREFIX + "a")
            await asyncio.wait_for(w, 5)
            assert [(e.type, e.key) for e in got] == [("PUT", (PREFIX + "b").encode()), ("DELETE", (PREFIX + "a").encode())]
        finally:
            await c.aclose()
        await kv.c.aclose()

    go(main)


def test_prefix_end_and_the_fleet_state_pure() -> None:
    assert prefix_end(b"/a/") == b"/a0" and prefix_end(b"a\xff") == b"b" and prefix_end(b"\xff\xff") == b"\0"
    f = EtcdFleet(PREFIX, 8)
    f.reset(7, [(b"/narwhal/engines/x", KeyValue(entry("x"), 0, 5, 5)), (b"/narwhal/engines/w", KeyValue(entry("x", 9100), 0, 3, 3))])
    snap, errors = f.state()
    assert [e.url for e in snap.engines] == ["http://127.0.0.1:9100"]  # w was created first
    assert len(errors) == 1 and "/narwhal/engines/x" in errors[0].message and snap.where == PREFIX + "@7"
    f.apply([WatchEvent("DELETE", b"/narwhal/engines/w", KeyValue(b"", 0, 0, 9))])
    snap, errors = f.state()
    assert [e.url for e in snap.engines] == ["http://127.0.0.1:9000"] and errors == [] and f.revision == 9


def test_endpoints_and_settings_fall_back_to_ha(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from narwhal.fleet.etcd import _settings

    monkeypatch.setenv("ETCD_PW", "pw-1")
    ha = {"etcd": ["https://10.0.0.1:2379"], "username": "router", "password_env": "ETCD_PW"}
    urls, s = _settings(parse_config({"ha": ha, "discovery": {"etcd": {}}}, source="t"))
    assert urls == ["https://10.0.0.1:2379"] and s["username"] == "router" and s["password"] == "pw-1"
    monkeypatch.setenv("OTHER_PW", "pw-2")
    urls, s = _settings(parse_config({"ha": ha, "discovery": {"etcd": {"username": "reader", "password_env": "OTHER_PW"}}}, source="t"))
    assert urls == ["https://10.0.0.1:2379"] and (s["username"], s["password"]) == ("reader", "pw-2")
    urls, s = _settings(parse_config({"ha": ha, "discovery": {"etcd": {"endpoints": ["http://127.0.0.1:1"]}}}, source="t"))
    assert urls == ["http://127.0.0.1:1"] and s["username"] is None
    with pytest.raises(ConfigError, match="endpoints"):
        _settings(parse_config({"discovery": {"etcd": {}}}, source="t"))
    monkeypatch.delenv("ETCD_PW")
    with pytest.raises(ConfigError, match="ETCD_PW") as x:
        etcd_source(parse_config({"ha": ha, "discovery": {"etcd": {}}}, source="t"))
    assert "pw-1" not in str(x.value)
