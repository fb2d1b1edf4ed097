"""Open-loop load: arrivals at a fixed rate or from a trace, one task per request.

Rules
  * Open loop: request i is sent at t0 + arrivals[i].at whatever happened to earlier
    requests (no client-side queue, no concurrency cap); how late each one left is kept
    as `Result.lag`, so a load tool that cannot keep up shows it.
  * Fixed rate: Poisson arrivals (exponential gaps, seeded) or, with `uniform`, exactly
    1/rate apart.
  * Trace replay (`../shared/data/traces/*.csv`: arrived_at, num_prefill_tokens,
    num_decode_tokens): a window of the trace starting at `start_s`, time-compressed by a
    factor chosen so the window's first rate*duration requests fill the duration (offered
    rate = `rate` exactly), or by `speedup` directly; token
    counts multiplied by `prompt_scale` / `output_scale` (min 1) and capped.
  * Every run is bounded: arrivals stop at `duration_s`; requests still open
    `drain_s` later are cancelled and recorded as errors ("cut at end of run").
  * A request's output length travels as a `[[mock {"tokens": N, ...}]]` directive in the
    prompt (peers may drop unknown body fields) and as max_tokens; the prompt is padded
    to the intended token count for the mock's sizing (4 bytes per token, +3 per message).
"""

from __future__ import annotations

import asyncio
import csv
import math
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .client import H1Pool, SSERecorder, make_client
from .h2 import H2Client, H2Pool
from .stats import Result

__all__ = ["Arrival", "fixed_rate", "load_trace", "trace_arrivals", "RequestShape", "run_open_loop", "open_loop", "run_closed_loop", "default_trace", "run_loop", "phase", "drain", "post",
           "phases_at_once"]

_FILLER = "the quick brown fox jumps over the lazy dog while narwhals route tokens "


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds from the start of the run
    prompt_tokens: int = 64
    output_tokens: int = 16


def fixed_rate(rate: float, duration_s: float, *, prompt_tokens: int = 64, output_tokens: int = 16, uniform: bool = False, seed: int = 1) -> list[Arrival]:
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if uniform:
        return [Arrival(k / rate, prompt_tokens, output_tokens) for k in range(math.ceil(duration_s * rate - 1e-9))]
    rng = random.Random(seed)
    out: list[Arrival] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        out.append(Arrival(t, prompt_tokens, output_tokens))
        t += rng.expovariate(rate)
    return out


def default_trace(kind: str = "conv") -> Path:
    """The shipped Azure 2023 trace: ../shared/data/traces/azure_llm_2023_<kind>.csv,
    looked up from the repository (or $NARWHAL_TRACES)."""
    import os

    name = f"azure_llm_2023_{kind}.csv"
    env = os.environ.get("NARWHAL_TRACES")
    cands = [Path(env) / name] if env else []
    here = Path(__file__).resolve()
    for p in here.parents:
        cands.append(p.parent / "shared" / "data" / "traces" / name)
        cands.append(p / "shared" / "data" / "traces" / name)
    cands.append(Path("/work/shared/data/traces") / name)
    for c in cands:
        if c.is_file():
            return c
    raise FileNotFoundError(f"trace {name} not found (set NARWHAL_TRACES to its folder)")


def load_trace(path: str | Path) -> list[tuple[float, int, int]]:
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.append((float(row["arrived_at"]), int(row["num_prefill_tokens"]), int(row["num_decode_tokens"])))
    rows.sort()
    return rows


def trace_arrivals(
    rows: Sequence[tuple[float, int, int]],
    *,
    duration_s: float,
    rate: float | None = None,
    speedup: float | None = None,
    start_s: float = 0.0,
    prompt_scale: float = 1.0,
    output_scale: float = 1.0,
    max_prompt: int | None = None,
    max_output: int | None = None,
) -> tuple[list[Arrival], float]:
    """(arrivals, the speed-up used). `rate` picks the speed-up from the window itself (the
    first rate*duration_s requests after start_s fill duration_s), so every load replays
    the same requests in the same order, only closer together."""
    if not rows:
        return [], 1.0
    base = rows[0][0] + start_s
    if speedup is None:
        if rate:
            # the window's own pace: the first rate*duration requests from `base` span
            # duration_s once compressed, so the offered rate is exactly `rate`
            window = [t for t, _, _ in rows if t >= base]
            n = max(1, round(rate * duration_s))
            if not window:
                return [], 1.0
            span = window[min(n, len(window) - 1)] - base
            speedup = max(span, 1e-9) / duration_s
        else:
            speedup = 1.0
    out = []
    for t, p, o in rows:
        if t < base:
            continue
        at = (t - base) / speedup
        if at >= duration_s:
            break
        pt = max(1, round(p * prompt_scale))
        ot = max(1, round(o * output_scale))
        if max_prompt is not None:
            pt = min(pt, max_prompt)
        if max_output is not None:
            ot = min(ot, max_output)
        out.append(Arrival(at, pt, ot))
    return out, speedup


@dataclass(frozen=True)
class RequestShape:
    """How a request body is built from an arrival."""

    model: str = "narwhal-demo"
    route: str = "chat"  # chat | completion
    stream: bool = True
    mock: dict[str, Any] = field(default_factory=dict)  # extra [[mock {...}]] options
    mock_field: bool = False  # send `"mock": {...}` as a body field instead of the directive
    max_tokens: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    bytes_per_token: float = 4.0

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.route == "chat" else "/v1/completions"

    def body(self, a: Arrival) -> bytes:
        opts = {"tokens": a.output_tokens, **self.mock}
        directive = "" if self.mock_field else "[[mock " + orjson.dumps(opts).decode() + "]] "
        want = max(0, round((a.prompt_tokens - (3 if self.route == "chat" else 0)) * self.bytes_per_token) - len(directive))
        reps = want // len(_FILLER) + 1
        text = directive + (_FILLER * reps)[:want]
        b: dict[str, Any] = {"model": self.model, "stream": self.stream}
        if self.route == "chat":
            b["messages"] = [{"role": "user", "content": text}]
        else:
            b["prompt"] = text
        if self.max_tokens:
            b["max_tokens"] = a.output_tokens
        if self.mock_field:
            b["mock"] = opts
        b.update(self.extra_body)
        return orjson.dumps(b)


async def post(client: Any, path: str, body: bytes, rec: SSERecorder, *, headers: dict[str, str] | None, timeout_s: float) -> None:
    """POST one request; cancelled (the run's end), it is recorded as cut, sent when it
    was due (rec.r.scheduled) if it had not left yet."""
    r = rec.r
    try:
        await client.request("POST", path, body, rec, headers=headers, timeout_s=timeout_s)
    except asyncio.CancelledError:
        r.error = r.error or "cut at end of run"
        if not r.sent:
            r.sent = r.scheduled
        raise


async def _one(client: H1Pool | H2Pool | H2Client, shape: RequestShape, a: Arrival, scheduled: float, timeout_s: float, out: list[Result]) -> None:
    r = Result(scheduled=scheduled, prompt_tokens=a.prompt_tokens, output_tokens=a.output_tokens)
    out.append(r)
    await post(client, shape.path, shape.body(a), SSERecorder(r), headers=shape.headers or None, timeout_s=timeout_s)


async def run_open_loop(
    client: H1Pool | H2Pool | H2Client,
    arrivals: Sequence[Arrival],
    shape: RequestShape,
    *,
    timeout_s: float = 60.0,
    drain_s: float = 30.0,
) -> list[Result]:
    """Send every arrival on time; wait at most drain_s after the last for the rest."""
    out: list[Result] = []
    await open_loop([a.at for a in arrivals], lambda i, target: _one(client, shape, arrivals[i], target, timeout_s, out), drain_s=drain_s)
    return out


async def drain(tasks: set[asyncio.Task[Any]], drain_s: float) -> int:
    """Wait at most drain_s for tasks to end, then cancel the rest and give them 5 s to
    unwind; how many were cut."""
    if not tasks:
        return 0
    _, pending = await asyncio.wait(set(tasks), timeout=drain_s)
    for tk in pending:
        tk.cancel()
    if pending:
        await asyncio.wait(pending, timeout=5.0)
    return len(pending)


async def open_loop(offsets: Sequence[float], start: Callable[[int, float], Coroutine[Any, Any, None]], *, drain_s: float) -> None:
    """Start `start(i, scheduled)` as a task at t0 + offsets[i] (t0: 50 ms from now, on
    time.perf_counter), in order; wait at most drain_s after the last start for them all,
    then cancel the rest (and give them 5 s to unwind)."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.perf_counter() + 0.05
    for i, at in enumerate(offsets):
        target = t0 + at
        delay = target - time.perf_counter()
        if delay > 0.0005:
            await asyncio.sleep(delay)
        tk = loop.create_task(start(i, target))
        tasks.add(tk)
        tk.add_done_callback(tasks.discard)
    await drain(tasks, drain_s)


async def run_closed_loop(
    client: H1Pool | H2Pool | H2Client,
    shape: RequestShape,
    *,
    concurrency: int,
    duration_s: float,
    prompt_tokens: int = 64,
    output_tokens: int = 16,
    timeout_s: float = 120.0,
    ramp_s: float = 1.0,
) -> list[Result]:
    """`concurrency` streams kept open for duration_s (each restarts when it ends); the
    workers start spread over ramp_s. Requests still open at the end are cut."""
    out: list[Result] = []
    stop_at = time.perf_counter() + duration_s
    a = Arrival(0.0, prompt_tokens, output_tokens)

    async def worker(k: int) -> None:
        await asyncio.sleep(ramp_s * k / max(1, concurrency))
        while time.perf_counter() < stop_at:
            await _one(client, shape, a, time.perf_counter(), timeout_s, out)

    tasks = [asyncio.create_task(worker(k)) for k in range(concurrency)]
    await drain(set(tasks), duration_s + 0.5)
    return out


def run_loop(coro: Any) -> Any:
    """Run coro to its end in a fresh event loop: uvloop's when installed, else asyncio's."""
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


async def _phase(url: str, headers: dict[str, str], http: str, arrivals: Sequence[Arrival], shape: RequestShape, *, timeout_s: float = 60.0,
                 drain_s: float = 30.0) -> list[Result]:
    c = make_client(url, http, headers=headers)
    try:
        return await run_open_loop(c, arrivals, shape, timeout_s=timeout_s, drain_s=drain_s)
    finally:
        await c.aclose()


def phase(url: str, headers: dict[str, str], http: str, arrivals: Sequence[Arrival], shape: RequestShape, **kw: Any) -> list[Result]:
    """One open loop of these arrivals against url (a client of its own, closed after)."""
    return run_loop(_phase(url, headers, http, arrivals, shape, **kw))


async def _phases_at_once(arms: Sequence[tuple[str, dict[str, str], Sequence[Arrival]]], http: str, shape: RequestShape, **kw: Any) -> list[list[Result]]:
    return list(await asyncio.gather(*(_phase(url, headers, http, arrivals, shape, **kw) for url, headers, arrivals in arms)))


def phases_at_once(arms: Sequence[tuple[str, dict[str, str], Sequence[Arrival]]], http: str, shape: RequestShape, **kw: Any) -> list[list[Result]]:
    """Each arm (url, headers, arrivals) an open loop of its own, all in one event loop at
    the same time: their requests interleave, so whatever drifts on the machine during the
    run (the VM's speed, the engine's load) drifts for every arm alike. One list of results
    per arm, in the arms' order."""
    return run_loop(_phases_at_once(arms, http, shape, **kw))
