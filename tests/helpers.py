"""Test equipment: a real router served by hypercorn on a free loopback port, in a thread
with its own event loop, stopped in bounded time."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from narwhal.authority.control import ControlPlane
from narwhal.compose import build_router
from narwhal.config import parse_config
from narwhal.http.server import free_port, serving_config
from narwhal.upstream.engines import EngineSpec

__all__ = ["RunningRouter", "running_router", "wait_until", "relay_serving", "keys_file"]


def keys_file(tmp: Path, keys: dict[str, str]) -> Path:
    """An auth.keys_file naming each tenant's one key (tenant -> key; id `k-TENANT`, the
    key's SHA-256), written under `tmp`."""
    p = tmp / "keys.yaml"
    p.write_text(json.dumps([{"id": f"k-{t}", "tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for t, k in keys.items()]))  # JSON is YAML
    return p


def wait_until(pred: Any, *, timeout: float = 10.0, interval: float = 0.02, what: str = "condition") -> Any:
    """Poll `pred` until it returns a truthy value; fail after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class RunningRouter:
    """`router` is the running router's authority (engines, scheduler, state, books)."""

    def __init__(self, url: str, router: ControlPlane, loop: asyncio.AbstractEventLoop) -> None:
        self.url = url
        self.router = router
        self.loop = loop
        self.app: Any = None

    def call(self, fn: Any, *args: Any) -> Any:
        """Run fn(*args) on the router's loop (for state the loop owns) and return its result."""
        async def go() -> Any:
            r = fn(*args)
            if asyncio.iscoroutine(r):
                r = await r
            return r

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(timeout=30)

    def books(self) -> dict[str, Any]:
        return self.call(self.router.books.snapshot)

    def balanced(self, timeout: float = 10.0) -> dict[str, Any]:
        """Wait until the books are at rest and balanced; return them."""
        def ok() -> dict[str, Any] | None:
            b = self.books()
            if b["open"] == 0 and b["offered"] == sum(b["terminal"].values()) and b["double_ends"] == 0:
                return b
            return None

        return wait_until(ok, timeout=timeout, what="books to balance")

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, **kw)

    def post(self, path: str, json: Any = None, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=json, timeout=30, **kw)


@contextlib.contextmanager
def running_router(config: dict[str, Any], engines: list[EngineSpec] | None = None, *, wait_profiled: bool = True, start: bool = True) -> Iterator[RunningRouter]:
    """config: a config mapping (validated like a YAML file); engines: the fleet (default:
    the config's engines)."""
    cfg = parse_config(config, source="test config")
    if engines is None:
        engines = [EngineSpec(e.name, e.url, e.role, e.dialect, e.wave, e.model) for e in cfg.engines or ()]
    port = free_port()
    listen = f"127.0.0.1:{port}"
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}
    stop: asyncio.Event | None = None

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        router = build_router(cfg, engines)
        holder["router"] = router.control
        app = holder["app"] = router.app(manage=False)
        if start:
            await router.start()
        from narwhal.http.conn import serve  # the router's own listener (hypercorn's protocols)

        task = asyncio.create_task(serve(app, serving_config(cfg, listen), shutdown_trigger=stop.wait))
        for _ in range(500):
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            except OSError:
                await asyncio.sleep(0.01)
        if start and wait_profiled:
            await router.control.wait_profiled(60)
        ready.set()
        await task
        await router.stop()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(main())
        except BaseException as e:  # surface start-up failures to the test
            holder["error"] = e
            ready.set()

    th = threading.Thread(target=run, name="narwhal-test-router", daemon=True)
    th.start()
    if not ready.wait(90):
        raise AssertionError("router did not start in 90 s")
    if "error" in holder:
        raise holder["error"]
    rr = RunningRouter(f"http://{listen}", holder["router"], loop)
    rr.app = holder["app"]  # the ASGI app itself, for calls without hypercorn (another server's scope)
    try:
        yield rr
    finally:
        if stop is not None:
            loop.call_soon_threadsafe(stop.set)
        th.join(30)
        if not loop.is_closed() and not th.is_alive():
            loop.close()


class Streamed:
    """An SSE answer read to its end: status, headers, parsed events, [DONE] seen."""

    def __init__(self, status: int, headers: httpx.Headers) -> None:
        self.status = status
        self.headers = headers
        self.events: list[Any] = []
        self.done = False
        self.body = b""
        self.error: Exception | None = None  # transport error while reading the body
        self.arrivals: list[float] = []  # seconds since the request, per event
        self.comments: list[str] = []  # SSE comment lines, without the colon

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if isinstance(e, dict) and "error" not in e]

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]

    def json(self) -> Any:
        import orjson

        return orjson.loads(self.body)


def sse(url: str, body: dict[str, Any], *, path: str = "/v1/chat/completions", headers: dict[str, str] | None = None, client: httpx.Client | None = None, timeout: Any = 30.0) -> Streamed:
    """POST and read an SSE answer to its end (or to a transport error); a non-SSE answer
    is kept whole in `body`."""
    import time

    import orjson

    t0 = time.monotonic()
    c = client or httpx.Client(timeout=timeout)
    try:
        with c.stream("POST", url + path, json=body, headers=headers, timeout=timeout) as r:
            out = Streamed(r.status_code, r.headers)
            if not r.headers.get("content-type", "").startswith("text/event-stream"):
                out.body = r.read()
                return out
            try:
                for line in r.iter_lines():
                    if not line:
                        continue
                    if line.startswith(":"):  # an SSE comment (x-narwhal-migrations)
                        out.comments.append(line[1:].strip())
                        continue
                    assert line.startswith("data: "), line
                    data = line[6:]
                    out.arrivals.append(time.monotonic() - t0)
                    if data == "[DONE]":
                        out.done = True
                        continue
                    try:
                        out.events.append(orjson.loads(data))
                    except orjson.JSONDecodeError:
                        out.events.append(data)
            except httpx.HTTPError as e:
                out.error = e
            return out
    finally:
        if client is None:
            c.close()


def accumulate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client builds from streamed chat deltas (the naive way: join strings by
    field, tool calls by index), to compare with the router's assembled answer."""
    msg: dict[str, Any] = {}
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for ch in chunks:
        for c in ch.get("choices") or ():
            d = c.get("delta") or {}
            for k in ("content", "reasoning", "reasoning_content", "refusal"):
                if isinstance(d.get(k), str):
                    msg[k] = msg.get(k, "") + d[k]
            for tc in d.get("tool_calls") or ():
                acc = calls.setdefault(tc.get("index", 0), {"id": "", "name": "", "arguments": ""})
                acc["id"] += tc.get("id") or ""
                fn = tc.get("function") or {}
                acc["name"] += fn.get("name") or ""
                acc["arguments"] += fn.get("arguments") or ""
            if c.get("finish_reason"):
                finish = c["finish_reason"]
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    msg["finish_reason"] = finish
    return msg


def relay_serving(path: str) -> dict[str, Any]:
    """The serving keys of a relay path as tests/conftest.py names them: "direct" (the
    compiled step where built), "direct-python" (the direct path with it off), "asgi"."""
    if path == "direct-python":
        return {"relay_path": "direct", "relay_native": False}
    return {"relay_path": path}


@contextlib.contextmanager
def serve_logging(tmp: Path, engine_url: str, log_format: str, log_level: str) -> Iterator[tuple[str, Path, Path]]:
    """`narwhal serve` in a subprocess over one vllm engine, its standard output and error
    written to files: yields (its URL, out, err) once ready; at the exit, stopped by SIGTERM
    (killed by PID if it does not end)."""
    port = free_port()
    cfg = {"engines": [{"name": "u0", "url": engine_url, "role": "unified", "dialect": "vllm"}],
           "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
           "serving": {"shutdown_delay_ms": 0, "shutdown_grace_ms": 500}}
    path = tmp / "narwhal.yaml"
    path.write_text(json.dumps(cfg))
    out, err = tmp / "out.log", tmp / "err.log"
    url = f"http://127.0.0.1:{port}"
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen([sys.executable, "-m", "narwhal.cli", "serve", "--config", str(path), "--listen", f"127.0.0.1:{port}",
                                 "--log-format", log_format, "--log-level", log_level],
                                stdout=o, stderr=e, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        def up() -> bool:
            assert proc.poll() is None, err.read_text()[-2000:]
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(url + "/ready", timeout=1).status_code == 200
            return False

        wait_until(up, timeout=45, interval=0.1, what="narwhal serve ready")
        yield url, out, err
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
