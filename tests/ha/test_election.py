"""High availability against a real etcd (tests/ha/etcd.py): three `narwhal serve`
processes with the same `ha` section in front of the same mock engine.

Timing: lease_ttl_ms 2000, renew 500 ms, fence margin 400 ms. Every wait is bounded; every
router is stopped by its PID in a `finally`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from narwhal.http.server import free_port
from narwhal.mock import MockConfig, Timing, running_fleet
from tests.ha.etcd import DelayProxy, EtcdServer, etcd_get, etcd_server, split_url, wait_for
from tests.helpers import keys_file

MODEL = "narwhal-demo"
TTL_MS = 2000
HA = {"lease_ttl_ms": TTL_MS, "renew_interval_ms": 500, "fence_margin_ms": 400, "request_timeout_ms": 500}


class Router:
    def __init__(self, name: str, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.name = name
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log

    def ready(self) -> tuple[int, dict[str, Any]] | None:
        try:
            r = httpx.get(self.url + "/ready", timeout=1.0)
            return r.status_code, r.json()
        except httpx.HTTPError:
            return None

    def ha(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/v1/engines", timeout=2.0)
        return r.json()["router"]["ha"]

    def state(self) -> str | None:
        got = self.ready()
        if got is None:
            return None
        return "active" if got[0] == 200 else got[1].get("state")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextlib.contextmanager
def routers(etcd_urls: list[list[str]], engine_url: str, *, workers: int = 1, extra: dict[str, Any] | None = None) -> Iterator[list[Router]]:
    """One router per entry of etcd_urls (each its own list of etcd URLs: a router may
    reach etcd through a proxy); `extra`: more top-level sections of their configuration."""
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-ha-"))
    out: list[Router] = []
    try:
        for i, urls in enumerate(etcd_urls):
            port = free_port()
            cfg = {
                "serving": {"model": MODEL, "listen": f"127.0.0.1:{port}", "workers": workers, "shutdown_delay_ms": 0},
                "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
                "monitoring": {"poll_interval_ms": 200},
                "engines": [{"name": "u0", "url": engine_url, "role": "unified", "dialect": "vllm"}],
                "ha": {"etcd": urls, "key": "/narwhal-test/leader", "name": f"r{i}", **HA},
                **(extra or {}),
            }
            path = tmp / f"r{i}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            log = tmp / f"r{i}.log"
            proc = subprocess.Popen([sys.executable, "-c", "import sys; from narwhal.cli import main; sys.exit(main())", "serve", "--config", str(path), "--log-level", "info"],
                                    stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
            out.append(Router(f"r{i}", proc, port, log))
        for r in out:
            wait_for(lambda r=r: r.ready() is not None, 30, f"{r.name} to answer")
        yield out
    finally:
        for r in out:
            r.stop()


def leaders(rs: list[Router]) -> list[Router]:
    return [r for r in rs if r.alive() and r.state() == "active"]


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    with running_fleet([MockConfig(dialect="vllm", role="unified", model=MODEL, name="u0", timing=Timing(time_scale=0.0))]) as fleet:
        yield fleet[0].url


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    with etcd_server() as srv:
        yield srv


def _chat(r: Router) -> httpx.Response:
    return httpx.post(r.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, timeout=10)


def test_one_leader_among_three_candidates(etcd: EtcdServer, engine: str) -> None:
    with routers([[etcd.url]] * 3, engine) as rs:
        wait_for(lambda: len(leaders(rs)) == 1, 15, "one leader")
        time.sleep(1.0)  # and it stays one
        (lead,) = leaders(rs)
        others = [r for r in rs if r is not lead]
        assert [r.state() for r in others] == ["standby", "standby"]
        ha = lead.ha()
        kv = etcd_get(etcd, "/narwhal-test/leader")
        assert kv is not None and ha["state"] == "leader" and ha["fencing_token"] == int(kv["create_revision"])
        assert _chat(lead).status_code == 200
        refused = _chat(others[0])
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "router_not_ready" and "standby" in refused.json()["error"]["message"]


def test_the_leader_killed_a_new_leader_is_active_within_the_ttl_and_a_second(etcd: EtcdServer, engine: str) -> None:
    with routers([[etcd.url]] * 3, engine) as rs:
        wait_for(lambda: len(leaders(rs)) == 1, 15, "one leader")
        (lead,) = leaders(rs)
        lead.kill()
        t0 = time.monotonic()
        rest = [r for r in rs if r is not lead]
        new = wait_for(lambda: leaders(rest), TTL_MS / 1000 + 3, "a new leader", interval=0.02)
        took = time.monotonic() - t0
        assert len(new) == 1
        assert took <= TTL_MS / 1000 + 1.0, took
        assert _chat(new[0]).status_code == 200


def test_etcd_frozen_the_leader_fences_before_its_lease_can_expire(etcd: EtcdServer, engine: str) -> None:
    with routers([[etcd.url]] * 3, engine) as rs:
        wait_for(lambda: len(leaders(rs)) == 1, 15, "one leader")
        (lead,) = leaders(rs)
        time.sleep(0.6)  # a renewal or two
        etcd.freeze()
        t0 = time.monotonic()
        try:
            wait_for(lambda: lead.state() == "fenced", TTL_MS / 1000 + 1, "the leader to fence", interval=0.02)
            fenced_after = time.monotonic() - t0
            # the last renewal was sent before the freeze: etcd cannot expire the lease
            # before t0 + TTL - (time since that renewal); the leader fenced before t0 + TTL
            assert fenced_after < TTL_MS / 1000, fenced_after
            assert _chat(lead).status_code == 503
            time.sleep(1.0)
            assert leaders(rs) == []  # nobody else can lead while etcd is frozen
        finally:
            etcd.thaw()
        wait_for(lambda: len(leaders(rs)) == 1, 15, "one leader after etcd is back")
        time.sleep(1.0)
        assert len(leaders(rs)) == 1


def test_late_renewals_fence_rather_than_split(etcd: EtcdServer, engine: str) -> None:
    """Each router reaches etcd through its own proxy; the leader's starts delaying every
    byte by more than the lease's slack: it fences (its renewals are late), etcd expires
    its lease, another leads; at no instant did two routers admit."""
    proxies = [DelayProxy(split_url(etcd.url)) for _ in range(3)]
    try:
        with routers([[p.url] for p in proxies], engine) as rs:
            wait_for(lambda: len(leaders(rs)) == 1, 15, "one leader")
            (lead,) = leaders(rs)
            proxies[rs.index(lead)].delay_s = 2.5
            wait_for(lambda: lead.state() == "fenced", TTL_MS / 1000 + 2, "the leader to fence")
            rest = [r for r in rs if r is not lead]
            new = wait_for(lambda: leaders(rest), TTL_MS / 1000 + 5, "another leader")
            assert len(new) == 1
            old_h, new_h = lead.ha()["history"], new[0].ha()["history"]
            fenced_at = next(h["at"] for h in reversed(old_h) if h["to"] == "fenced")
            won_at = next(h["at"] for h in reversed(new_h) if h["to"] == "leader")
            assert fenced_at < won_at, (old_h, new_h)  # the old authority ended first
            assert lead.state() == "fenced"
    finally:
        for p in proxies:
            p.close()


def test_a_new_leader_counts_the_streams_a_fenced_leader_left_running(etcd: EtcdServer) -> None:
    """The old leader is fenced (its etcd link delayed) while streams run on the engine;
    the new leader takes over with the engine's own count of them (dialects.yaml
    load_metrics) as slots taken, and lets go of them as they end."""
    slow = MockConfig(dialect="vllm", role="unified", model=MODEL, name="u0", timing=Timing(time_scale=1.0))
    with running_fleet([slow]) as fleet:
        proxies = [DelayProxy(split_url(etcd.url)) for _ in range(2)]
        try:
            with routers([[p.url] for p in proxies], fleet[0].url) as rs:
                wait_for(lambda: len(leaders(rs)) == 1, 15, "one leader")
                (lead,) = leaders(rs)
                other = next(r for r in rs if r is not lead)
                import threading

                done: list[int] = []

                def stream() -> None:
                    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 200, "mock": {"tpot_ms": 30, "tokens": 200}}
                    with httpx.stream("POST", lead.url + "/v1/chat/completions", json=body, timeout=30) as r:
                        for _ in r.iter_bytes():
                            pass
                        done.append(r.status_code)

                ts = [threading.Thread(target=stream, daemon=True) for _ in range(3)]
                for t in ts:
                    t.start()
                wait_for(lambda: httpx.get(fleet[0].url + "/mock/stats", timeout=2).json()["in_flight"] == 3, 10, "3 streams on the engine")
                proxies[rs.index(lead)].delay_s = 2.5
                wait_for(lambda: other.state() == "active", TTL_MS / 1000 + 6, "the other router to lead")
                eng = httpx.get(other.url + "/v1/engines", timeout=2).json()["data"][0]
                assert eng["load"]["external"] == 3, eng["load"]
                for t in ts:
                    t.join(20)
                assert done == [200, 200, 200]  # the fenced leader's streams ran to their end
                wait_for(lambda: httpx.get(other.url + "/v1/engines", timeout=2).json()["data"][0]["load"]["external"] == 0, 5, "the external load to drain")
        finally:
            for p in proxies:
                p.close()


def test_a_new_leader_keeps_the_tenants_buckets_the_old_one_spent(etcd: EtcdServer, engine: str, tmp_path: Path) -> None:
    """Issue 22 item 3: the leader hands on the tenants' bucket levels after each renewal
    (core/quota_state.py); killed, its successor refuses the tenant that spent its bucket
    (R18, Retry-After from the bucket) rather than granting it a second burst, and serves
    the tenant that spent nothing."""
    keys = {"spent": "sk-spent-0123456789", "fresh": "sk-fresh-0123456789"}
    kf = keys_file(tmp_path, keys)
    extra = {"auth": {"keys_file": str(kf)}, "tenants": {"default": {"requests_per_s": 0.02}}}  # one request, then one per 50 s

    def ask(r: Router, tenant: str) -> httpx.Response:
        return httpx.post(r.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                          headers={"authorization": f"Bearer {keys[tenant]}"}, timeout=10)

    with routers([[etcd.url]] * 2, engine, extra=extra) as rs:
        wait_for(lambda: len(leaders(rs)) == 1, 15, "one leader")
        (lead,) = leaders(rs)
        assert ask(lead, "spent").status_code == 200
        assert ask(lead, "spent").json()["error"]["code"] == "tenant_request_rate_exceeded"
        def handed_on() -> bool:  # the spent bucket in the levels (not an earlier, empty hand-on)
            import base64

            kv = etcd_get(etcd, "/narwhal-test/leader/tenants")
            return kv is not None and b'"spent"' in base64.b64decode(kv.get("value", ""))

        wait_for(handed_on, 5, "the spent bucket handed on")
        lead.kill()
        (new,) = wait_for(lambda: leaders([r for r in rs if r is not lead]), TTL_MS / 1000 + 5, "a new leader")
        refused = ask(new, "spent")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "tenant_request_rate_exceeded", refused.text
        assert 30 <= int(refused.headers["retry-after"]) <= 50
        assert ask(new, "fresh").status_code == 200
        assert "restored 1 tenants' buckets" in new.log.read_text()
