"""`narwhal bench versus` (issue 25: Narwhal side by side with SMG, vllm-router and Envoy):
its pure parts on synthetic measurements (order, medians, ratios, the targets' verdict, the
tables), the peers' command lines and Envoy's bootstrap, the memory preflight; no processes.

The whole command on a tiny budget (one run, short windows, 200 held streams; ~2 min, every
peer started for real) runs with `NARWHAL_BENCH_SMOKE=1 pytest tests/bench/test_versus_bench.py
-k smoke`; it skips when a peer's venv is missing (scripts/peers/install.sh smg vllm-router envoy)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from narwhal_bench import envoy
from narwhal_bench import experiments as X
from narwhal_bench import harness as H
from narwhal_bench import versus as V
from narwhal_bench.ticker import _dechunk


def _relay(router: str, run: int, eps: float) -> dict[str, Any]:
    return {"part": "relay", "run": run, "position": 1, "router": router, "events_per_cpu_s": eps, "events_per_s": 10_000.0, "cpu_s": 1.0, "seconds": 10.0,
            "tpot_p50": 0.02, "tpot_p99": 0.021, "errors": 0}


def _ttft(router: str, run: int, p50: float, p99: float) -> dict[str, Any]:
    return {"part": "ttft", "run": run, "position": 1, "router": router, "added_p50_ms": p50, "added_p99_ms": p99, "ok": 10, "offered": 10, "direct_p50_ms": 0.5,
            "routed_p50_ms": 0.5 + p50, "direct_p99_ms": 1.0, "routed_p99_ms": 1.0 + p99, "cpu_us_per_token": 40.0}


def _mem(router: str, run: int, kib: float) -> dict[str, Any]:
    return {"part": "memory", "run": run, "position": 1, "router": router, "kib_per_stream": kib, "open": 200, "rss_idle": 50 * 2**20, "rss_open": 60 * 2**20, "errors": 0}


def _measurements() -> list[dict[str, Any]]:
    ms = []
    # Narwhal 20 us/event (50k/s), SMG 15 us, vllm-router 16 us, Envoy 10 us (faster, but the baseline)
    for run, jitter in ((1, 1.0), (2, 1.1), (3, 0.9)):
        ms += [_relay("narwhal", run, 50_000 * jitter), _relay("smg", run, 66_666.67 * jitter), _relay("vllm-router", run, 62_500 * jitter), _relay("envoy", run, 100_000.0)]
        ms += [_ttft("narwhal", run, 0.30, 1.5), _ttft("smg", run, 0.20, 0.4), _ttft("vllm-router", run, 0.15, 3.0), _ttft("envoy", run, 0.01, 0.1)]
        ms += [_mem("narwhal", run, 12.0 + run), _mem("smg", run, 8.0), _mem("vllm-router", run, 30.0), _mem("envoy", run, 5.0)]
    return ms


def test_the_order_alternates_every_run() -> None:
    rs = ["narwhal", "smg", "vllm-router", "envoy"]
    assert V.runs_order(rs, 0) == rs
    assert V.runs_order(rs, 1) == list(reversed(rs))
    assert V.runs_order(rs, 2) == rs


def test_median_skips_missing_values() -> None:
    assert V.median([3.0, None, 1.0, 2.0]) == 2.0
    assert V.median([4.0, 1.0]) == 2.5
    assert V.median([None]) is None and V.median([]) is None


def test_summary_medians_ratios_and_the_best_rust_peer() -> None:
    s = V.summary(_measurements(), ["narwhal", "smg", "vllm-router", "envoy"])
    per = s["routers"]
    assert per["narwhal"]["events_per_cpu_s_median"] == pytest.approx(50_000)
    assert len(per["narwhal"]["events_per_cpu_s"]) == 3
    assert per["narwhal"]["us_per_event_median"] == pytest.approx(20.0)
    assert per["narwhal"]["kib_per_stream_median"] == pytest.approx(14.0)  # 13, 14, 15
    # Envoy is faster but not a Rust peer: the best Rust peer is SMG (15 us), the best TTFT p50 vllm-router
    assert s["rust_peers"] == ["smg", "vllm-router"]
    assert s["best_cpu_peer"] == "smg" and s["best_ttft_peer"] == "vllm-router"
    nv = s["narwhal"]["narwhal"]
    assert nv["cpu_ratio"]["smg"] == pytest.approx(20 / 15, rel=1e-4)
    assert nv["cpu_ratio"]["vllm-router"] == pytest.approx(20 / 16, rel=1e-4)
    assert nv["cpu_ratio"]["envoy"] == pytest.approx(2.0, rel=1e-4)  # shown, never a target's peer
    assert nv["cpu_ratio_best"] == pytest.approx(20 / 15, rel=1e-4)
    assert nv["ttft_p50_minus_best_ms"] == pytest.approx(0.15)


def test_verdict_pass_and_miss_per_target() -> None:
    s = V.summary(_measurements(), ["narwhal", "smg", "vllm-router", "envoy"])
    v = {x["target"]: x for x in V.verdict(s, mem_streams=20_000, rate=200.0)}
    assert [x for x in v] == ["cpu", "cpu-stretch", "ttft-p50", "ttft-p99", "memory"]
    assert v["cpu"]["result"] == "PASS"  # 1.33x <= 1.5x
    assert v["cpu-stretch"]["result"] == "MISS"  # 1.33x > 1.0x
    assert v["ttft-p50"]["result"] == "PASS"  # +0.15 ms <= +0.2 ms
    assert v["ttft-p99"]["result"] == "PASS"  # 1.5 ms <= 2 ms
    assert v["memory"]["result"] == "PASS" and "indicative" not in v["memory"]["line"]  # 14 KiB <= 16
    assert "1.33×" in v["cpu"]["line"] and "smg" in v["cpu"]["line"]
    # measured at fewer streams and another rate: said so in the line
    v2 = {x["target"]: x for x in V.verdict(s, mem_streams=9_000, rate=100.0)}
    assert "measured at 9,000 streams" in v2["memory"]["line"] and "measured at 100 req/s" in v2["ttft-p99"]["line"]


def test_verdict_without_rust_peers_is_not_applicable() -> None:
    ms = [m for m in _measurements() if m["router"] in ("narwhal", "envoy")]
    s = V.summary(ms, ["narwhal", "envoy"])
    v = {x["target"]: x["result"] for x in V.verdict(s, mem_streams=20_000)}
    assert v["cpu"] == v["cpu-stretch"] == v["ttft-p50"] == "n/a"
    assert v["ttft-p99"] == "PASS" and v["memory"] == "PASS"  # Narwhal's own numbers


def _data(ms: list[dict[str, Any]]) -> dict[str, Any]:
    return {"command": "narwhal bench versus --runs 3", "routers": ["narwhal", "smg", "vllm-router", "envoy", "narwhal-granian"], "runs": 3, "parts": list(V.PARTS),
            "mode": "open", "mem_streams": 20_000, "settings": {"streams": 200, "tokens": 100, "interval_ms": 20.0, "warm": 4.0, "window": 15.0, "rate": 200.0,
                                                              "ttft_duration": 10.0, "prompt_tokens": 64, "output_tokens": 16, "tpot_ms": 10.0, "mem_interval_ms": 2000.0,
                                                              "mem_ramp": 15.0, "mem_hold": 5.0},
            "pinning": "Router under test pinned to CPU [0].", "nofile": [65536, 65536], "started": "now", "elapsed_s": 600.0, "measurements": ms,
            "notes": {"smg": "smg 1.13.0 (Rust), round_robin"}, "unavailable": {"narwhal-granian": "granian is not installed"}}


def test_tables_render_medians_runs_targets_and_failures() -> None:
    ms = _measurements() + [{"part": "relay", "run": 3, "position": 2, "router": "smg", "failed": "start: smg exited"}]
    md = V.tables(_data(ms))
    assert "Reproduce: `narwhal bench versus --runs 3`" in md
    assert "| smg (Rust peer) |" in md and "| envoy (baseline) |" in md
    assert "**PASS** narwhal: CPU per relayed event ≤ 1.5×" in md
    assert "failed: start: smg exited" in md
    assert "**narwhal-granian** did not run: granian is not installed" in md
    # the failed run is not a value: SMG's median stays over its three measured runs
    assert V.summary(ms, ["smg"])["routers"]["smg"]["events_per_cpu_s"] == pytest.approx([66_666.67, 73_333.337, 60_000.003], rel=1e-6)
    json.dumps(_data(ms))  # what --out saves is JSON
    # how the direct arm was measured is stated: a saved run of before (no direct_rate),
    # or direct_rate 0, ran the phases one after the other
    assert "direct then routed on the same arrivals" in md and "same arrivals." in md
    d = _data(ms)
    d["settings"]["direct_rate"] = 50.0
    md = V.tables(d)
    assert "the direct arm at 50 req/s at the same time, interleaved" in md and "the arms interleaved." in md


def test_estimate_grows_with_runs_routers_and_streams() -> None:
    one = V.estimate_s(["relay"], 1, 1)
    assert one > 15
    base = V.estimate_s([], 4, 3)  # engines' start
    assert V.estimate_s(["relay"], 4, 3) - base == pytest.approx(12 * (one - base))
    assert V.estimate_s(["memory"], 1, 1, mem_streams=20_000) > V.estimate_s(["memory"], 1, 1, mem_streams=200)


def test_envoy_bootstrap_is_a_plain_round_robin_proxy() -> None:
    cfg = envoy.config("127.0.0.1", 18080, ["http://127.0.0.1:9001", "http://127.0.0.1:9002"])
    json.dumps(cfg)
    lst = cfg["static_resources"]["listeners"][0]
    assert lst["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 18080}
    hcm = lst["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["codec_type"] == "AUTO" and hcm["request_timeout"] == "0s"
    assert hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"] == {"cluster": "engines", "timeout": "0s"}
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]
    cl = cfg["static_resources"]["clusters"][0]
    assert cl["lb_policy"] == "ROUND_ROBIN" and "health_checks" not in cl
    eps = [e["endpoint"]["address"]["socket_address"] for e in cl["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert eps == [{"address": "127.0.0.1", "port_value": 9001}, {"address": "127.0.0.1", "port_value": 9002}]
    th = cl["circuit_breakers"]["thresholds"][0]
    assert th["max_retries"] == 0 and th["max_requests"] >= 20_000 and th["max_connections"] >= 20_000
    limited = envoy.config("127.0.0.1", 1, ["http://127.0.0.1:9001"], max_request_bytes=1024)
    names = [f["name"] for f in limited["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]]
    assert names == ["envoy.filters.http.buffer", "envoy.filters.http.router"]  # the router filter is last


def test_envoy_argv() -> None:
    argv = envoy.argv(Path("/x/envoy"), Path("/tmp/e.json"), concurrency=2)
    assert argv[0] == "/x/envoy"
    assert argv[argv.index("-c") + 1] == "/tmp/e.json" and argv[argv.index("--concurrency") + 1] == "2"
    assert "--disable-hot-restart" in argv
    assert "1 worker thread(s)" in envoy.notes(1, "1.40.0") and "1.40.0" in envoy.notes(1, "1.40.0")


def test_smg_argv_as_a_plain_relay() -> None:
    engines = [H.Engine("u0", "unified", "http://127.0.0.1:9001", None), H.Engine("u1", "unified", "http://127.0.0.1:9002", None)]  # type: ignore[arg-type]
    argv = H.smg_argv("/x/smg", 18000, engines, extra=H.SMG_RELAY_FLAGS)
    assert argv[:2] == ["/x/smg", "launch"]
    i = argv.index("--worker-urls")
    assert argv[i + 1:i + 3] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert argv[argv.index("--port") + 1] == "18000" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--policy") + 1] == "round_robin"
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"  # not its 0.0.0.0:29000 default
    for flag in ("--disable-retries", "--disable-circuit-breaker", "--disable-health-check", "--disable-load-monitoring", "--disable-worker-overload-protection"):
        assert flag in argv
    assert argv[argv.index("--max-concurrent-requests") + 1] == "0"


def test_smg_two_phase_through_its_discovery_file() -> None:
    pd = [H.Engine("p0", "prefill", "http://127.0.0.1:9001", None), H.Engine("d0", "decode", "http://127.0.0.1:9002", None)]  # type: ignore[arg-type]
    # only a discovery-file worker can carry kv_connector: with it SMG's HTTP P/D runs vLLM's two phases
    assert H.smg_workers_file(pd) == {"version": 1, "workers": [
        {"url": "http://127.0.0.1:9001", "worker_type": "prefill", "kv_connector": "NixlConnector"},
        {"url": "http://127.0.0.1:9002", "worker_type": "decode", "kv_connector": "NixlConnector"}]}
    argv = H.smg_argv("/x/smg", 18000, pd, discovery_file=Path("/tmp/w.json"))
    assert "--pd-disaggregation" in argv and argv[argv.index("--discovery-file") + 1] == "/tmp/w.json" and "--worker-urls" not in argv
    with pytest.raises(ValueError, match="discovery file"):
        H.smg_argv("/x/smg", 18000, pd)


def test_envoy_has_no_two_phase_mode() -> None:
    pd = [H.Engine("p0", "prefill", "http://127.0.0.1:9001", None), H.Engine("d0", "decode", "http://127.0.0.1:9002", None)]  # type: ignore[arg-type]
    with pytest.raises(H.PeerUnavailable, match="plain L7 proxy"):
        H.start_peer("envoy", pd)


def test_router_names() -> None:
    assert H.router_names(["narwhal", "smg", "vllm-router", "envoy"]) == ["narwhal", "smg", "vllm-router", "envoy"]
    assert H.router_names(["narwhal", "envoy"], ["hypercorn", "granian"]) == ["narwhal", "narwhal-granian", "envoy"]
    assert {"smg", "envoy"} <= set(H.PEERS)
    with pytest.raises(ValueError, match="unknown router"):
        H.router_names(["nginx"])


def test_narwhal_limits_cover_the_held_streams() -> None:
    ov = X.narwhal_overrides("open", 1, 20_000)
    cfg = H.narwhal_config([H.Engine("t0", "unified", "http://127.0.0.1:9001", None)], **ov)  # type: ignore[arg-type]
    adm = cfg["admission"]
    assert adm["mode"] == "open" and adm["http_retention_limit"] > 20_000 and adm["phase_concurrency"]["decode"] > 20_000
    assert cfg["upstream"]["max_connections"] > 20_000 and adm["prediction"]["profile_on_start"] is False
    assert "workers" not in cfg["serving"]
    assert H.narwhal_config([], **X.narwhal_overrides("predictive", 2))["serving"] == {"model": "narwhal-demo", "workers": 2}


def test_memory_preflight_counts_descriptors_and_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(X, "raise_nofile", lambda: (20_000, 20_000))
    pre = X.memory_preflight(20_000)
    # one router process holds (20,000 - 256) // 2 streams: Narwhal spreads over workers with
    # half of each one's room spare, a peer holds that many, holders and tickers 9,000 each
    assert pre["max_streams"] <= (20_000 - 256) // 2 and pre["peer_streams"] == (20_000 - 256) // 2
    assert (pre["narwhal_workers"], pre["spread"]) == (5, 3)
    small = X.memory_preflight(5_000)
    assert (small["narwhal_workers"], small["peer_streams"], small["spread"]) == (1, 5_000, 1)
    monkeypatch.setattr(X, "raise_nofile", lambda: (1 << 20, 1 << 20))
    big = X.memory_preflight(20_000)
    assert big["narwhal_workers"] == 1 and big["peer_streams"] == 20_000


def test_the_ticker_reads_a_chunked_request_body() -> None:
    raw = b"5\r\nhello\r\n3;ext=1\r\nabc\r\n0\r\n\r\nNEXT"
    assert _dechunk(raw, 0) == (b"helloabc", len(raw) - 4)
    assert _dechunk(raw[:12], 0) is None and _dechunk(raw[:-6], 0) is None


def test_the_command_parses() -> None:
    from narwhal_bench.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["versus", "--runs", "1", "--parts", "relay,ttft", "--mem-streams", "200"])
    assert (a.bench_command, a.runs, a.parts, a.mem_streams, a.routers) == ("versus", 1, "relay,ttft", 200, "narwhal,smg,vllm-router,envoy")
    assert a.direct_rate == 50.0  # the direct arm interleaved with the routed one by default
    assert p.parse_args(["versus", "--direct-rate", "0"]).direct_rate == 0.0  # the phases of before
    r = p.parse_args(["relay", "--routers", "narwhal,smg,envoy"])
    assert r.routers == "narwhal,smg,envoy" and r.servers == "hypercorn"
    assert p.parse_args(["memory", "--routers", "envoy", "--streams", "100"]).routers == "envoy"
    assert p.parse_args(["overhead", "--routers", "vllm-router"]).routers == "vllm-router"


def test_the_command_line_repeats_the_run() -> None:
    p = argparse.ArgumentParser()
    V.add_arguments(p)
    a = p.parse_args(["--runs", "1", "--mem-streams", "200", "--window", "3", "--out", "/tmp/x"])
    assert V.command(a) == "narwhal bench versus --runs 1 --window 3 --mem-streams 200 --out /tmp/x"  # pytest's own argv is not the run's


def _missing_peers() -> list[str]:
    d = H.peers_dir()
    need = {"smg": d / "smg" / "bin" / "smg", "vllm-router": d / "vllm-router" / "bin" / "vllm-router", "envoy": envoy.exe(d)}
    return [k for k, p in need.items() if not p.exists()]


@pytest.mark.skipif(os.environ.get("NARWHAL_BENCH_SMOKE") != "1", reason="the whole command (~2 min: four routers x three parts, processes): NARWHAL_BENCH_SMOKE=1")
def test_smoke_the_whole_command(tmp_path: Path) -> None:
    missing = _missing_peers()
    if missing:
        pytest.skip(f"peer venvs missing: {', '.join(missing)} (scripts/peers/install.sh {' '.join(missing)})")
    p = argparse.ArgumentParser()
    V.add_arguments(p)
    args = p.parse_args(["--runs", "1", "--warm", "1", "--window", "3", "--ttft-duration", "2", "--rate", "100", "--mem-streams", "200", "--mem-ramp", "2",
                         "--mem-hold", "1", "--quiet-wait", "0", "--out", str(tmp_path)])
    cpus = os.sched_getaffinity(0)
    try:
        assert V.run(args) == 0
    finally:
        os.sched_setaffinity(0, cpus)  # the bench pins this process to the load CPUs
    data = json.loads((tmp_path / "versus.json").read_text())
    assert (tmp_path / "versus.md").read_text().startswith("## versus")
    assert data["unavailable"] == {}
    got = {(m["part"], m["router"]): m for m in data["measurements"]}
    assert set(got) == {(p, r) for p in V.PARTS for r in V.ROUTERS}
    for (part, r), m in got.items():
        assert not m.get("failed"), (part, r, m.get("failed"))
        if part == "relay":
            assert m["events"] > 0 and m["errors"] == 0 and m["cpu_s"] > 0, (r, m)
        elif part == "ttft":
            assert m["ok"] == m["offered"] > 0 and m["added_p50_ms"] is not None, (r, m)
        else:
            assert m["open"] == 200 and m["errors"] == 0 and m["rss_open"] > m["rss_idle"] > 0, (r, m)
    assert [v["target"] for v in data["verdict"]] == ["cpu", "cpu-stretch", "ttft-p50", "ttft-p99", "memory"]
    assert all(v["result"] in ("PASS", "MISS") for v in data["verdict"])
