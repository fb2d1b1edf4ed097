"""Engine profiling: on registration and on demand (POST /admin/engines/{name}/profile).

Profiling traffic carries `x-narwhal-profiling: 1` and request IDs `narwhal-profile-...`;
it is not offered traffic (the books never see it). It takes no phase slot, except on an
engine with engines[].max_concurrency: there each measurement waits for a slot like a
client request (Scheduler.reserve), so profiling never overlaps live traffic past the
engine's limit (an engine that serialises requests, or cuts a running generation when
another arrives, is never sent a second one), and the batch step runs at most that many.

Prompts are words an instruction model answers (a passage and a request to continue it),
distinct per measurement (a numbered tag first), so that no measurement is a prefix-cache
hit of another. vLLM and SGLang get `ignore_eos`; an engine that still ends at once (the
openai dialect has no ignore_eos) gives a TTFT sample from its finishing event.

Logging: the per-request detail at INFO (under the request ID); one WARNING per change of
an engine's profile status, never one per retry (runtime.py backs retries off).
  * prefill engines: the two-phase prefill leg at each profile_prompt_tokens length;
  * unified engines: a streaming request per length (TTFT ~ prefill) and TPOT at batch 1
    and at batch 4;
  * decode engines: a prefill leg on a prefill engine, then the decode stream: its start
    latency (KV transfer + first token) per length, and TPOT.
T07: a measurement whose token IDs fail the check fails the profile (status "failed",
the reason in /v1/engines); the models keep their previous values.
The reason /v1/engines shows is words: an engine's address and bytes go to the log only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from ..core.dialects import DIALECTS, decode_body, prefill_body
from ..core.fleet import EngineState
from ..core.relay import StreamRelay
from ..core.tickets import Dispatch, Ticket, Work
from ..upstream.client import UpstreamError
from ..upstream.usage import CountTarget, detect
from .authority import Authority

__all__ = ["profile_engine", "profile_all", "profile", "maybe_reprofile", "retry_s", "ProfileError", "PROFILE_RETRY_S", "PROFILE_RETRY_MAX_S"]

log = logging.getLogger("narwhal")


class ProfileError(Exception):
    pass


_PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs at dusk, counting each step as his father had taught him. "
    "Out on the water a fishing boat was making for the harbour, its single lamp swinging with the swell. "
    "In the village below, the baker was banking the ovens for the night and the school bell had long gone quiet. "
    "A storm had been promised for the morning, and the gulls had already gathered on the sea wall to wait for it. "
    "He trimmed the wick, polished the great lens and wrote the hour in the log in his careful, slanting hand. "
    "Somewhere beyond the headland a ship he did not recognise was signalling, three short flashes and one long. "
    "He reached for the old code book, blew the dust from its cover and began to turn the brittle pages. "
    "The wind rose while he read, rattling the windows and carrying the smell of salt and rain up the tower. "
)
_ASK = "Continue this story in detail, in plain prose:"


def _prompt(tokens: int, bytes_per_token: float, tag: str) -> str:
    """About `tokens` tokens of text an instruction model answers, distinct by `tag`."""
    want = max(0, round(tokens * bytes_per_token) - len(tag) - len(_ASK) - 4)
    reps = want // len(_PASSAGE) + 1
    text = (_PASSAGE * reps)[:want]
    cut = text.rfind(". ")
    if cut > want // 2:
        text = text[: cut + 1]
    return f"[{tag}] {text}\n\n{_ASK}" if text else f"[{tag}] {_ASK}"


def _body(a: Authority, e: EngineState, n: int, max_tokens: int, tag: str = "0") -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": e.model or a.config.serving.model,
        "messages": [{"role": "user", "content": _prompt(n, a.sizer.bytes_per_token, f"{e.name}-{tag}")}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if e.dialect in ("vllm", "sglang"):
        body["ignore_eos"] = True  # both accept it: the output runs to max_tokens
    return body


async def _stream(a: Authority, e: EngineState, body: dict[str, Any], rid: str) -> tuple[float, float | None, int | None, int]:
    """(first token s, TPOT s, prompt tokens, tokens) of one streaming measurement."""
    d = DIALECTS[e.dialect]
    checks = d.token_accounting == "token_ids"
    relay = StreamRelay(checks_ids=checks, client_ids=False, client_usage=True, max_event_bytes=a.config.upstream.max_event_bytes)
    clock = a.clock
    t0 = clock.now()
    headers = {"x-narwhal-profiling": "1"}
    if d.propagate_request_id:
        headers["x-request-id"] = rid
    up = await a.client.open("POST", e.url + "/v1/chat/completions", body=orjson.dumps(body), headers=headers)
    first: float | None = None
    finished: float | None = None  # the first event that carried a finish_reason
    done = False
    try:
        if up.status >= 400:
            log.info("engine %s: profiling request %s answered HTTP %d: %r", e.name, rid, up.status, (await up.read(4096))[:200])
            raise ProfileError(f"engine answered HTTP {up.status}")
        while True:
            chunk = await up.next_chunk()
            if not chunk:
                raise ProfileError("the stream ended without data: [DONE]")
            now = clock.now()
            step = relay.feed(chunk, now)
            if step.failure is not None:
                row, detail = step.failure
                log.info("engine %s: profiling request %s: %s %s%s", e.name, rid, row, detail, f": {relay.failure_detail}" if relay.failure_detail else "")
                raise ProfileError(f"{row}: {detail}")  # T07
            if step.first_token and first is None:
                first = now
            if finished is None and relay.finish_reason is not None:
                finished = now
            if step.done:
                done = True
                break
    finally:
        await up.aclose(complete=done)
    if relay.engine_error is not None:
        log.info("engine %s: profiling request %s: engine error event %r", e.name, rid, relay.engine_error)
        raise ProfileError("the engine sent an error event")
    if first is None:
        # an answer that ended at once (EOS first): its finishing event still ends the
        # prefill, so it is a TTFT sample; it has no TPOT
        if finished is None:
            raise ProfileError("the engine produced no token and no finish_reason")
        return finished - t0, None, _prompt_tokens(relay.usage), 0
    tp = relay.arrivals.tpot()
    return first - t0, tp, _prompt_tokens(relay.usage), relay.token_count


def _prompt_tokens(usage: Any) -> int | None:
    u = usage if isinstance(usage, dict) else {}
    pt = u.get("prompt_tokens")
    return pt if isinstance(pt, int) and not isinstance(pt, bool) else None


async def _prefill_leg(a: Authority, e: EngineState, body: dict[str, Any], rid: str) -> tuple[float, dict[str, Any] | None, int | None]:
    clock = a.clock
    t0 = clock.now()
    status, raw = await a.client.post_json(
        e.url + "/v1/chat/completions", prefill_body(body, route="chat"), headers={"x-request-id": rid, "x-narwhal-profiling": "1"}
    )
    dt = clock.now() - t0
    if status >= 400:
        log.info("engine %s: profiling request %s answered HTTP %d: %r", e.name, rid, status, raw[:200])
        raise ProfileError(f"prefill engine answered HTTP {status}")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ProfileError("prefill engine answered with a body that is not JSON") from None
    if not isinstance(obj, dict):
        raise ProfileError("prefill engine answered with JSON that is not an object")
    if "kv_transfer_params" not in obj or not isinstance(obj["kv_transfer_params"], (dict, type(None))):
        raise ProfileError("prefill answer carries no kv_transfer_params")
    kv = obj["kv_transfer_params"]
    u = obj.get("usage") or {}
    return dt, kv, u.get("prompt_tokens") if isinstance(u.get("prompt_tokens"), int) else None


def _fastest(samples: list[tuple[float, float]]) -> list[tuple[float, float]]:
    by: dict[float, float] = {}
    for n, ms in samples:
        by[n] = min(ms, by.get(n, ms))
    return sorted(by.items())


def _median(samples: list[tuple[float, float]]) -> list[tuple[float, float]]:
    by: dict[float, list[float]] = {}
    for b, ms in samples:
        by.setdefault(b, []).append(ms)
    return [(b, sorted(v)[len(v) // 2]) for b, v in sorted(by.items())]


class _Slot:
    """A phase-1 slot on `e` for one measurement when engines[].max_concurrency is set
    (Scheduler.reserve; waits FIFO with client requests), else nothing."""

    WAIT_S = 120.0  # the longest a measurement waits for a slot; then the profile fails

    def __init__(self, a: Authority, e: EngineState, n: int) -> None:
        self.a, self.e, self.n = a, e, n
        self.ticket: Ticket | None = None

    async def __aenter__(self) -> None:
        if self.e.max_concurrency is None or self.e.role == "decode":
            return
        r = self.a
        now = r.clock.now()
        work = Work(route="profile", prompt_tokens=self.n, max_tokens=None, budget_ms=float("inf"), arrival=now, max_wait_s=self.WAIT_S, deadline_s=None)
        g = r.scheduler.reserve(self.e.name, work, now)
        self.ticket = g.ticket
        if isinstance(g, Dispatch):
            return
        got = await r.wait_grant(g.ticket)
        if not isinstance(got, Dispatch):
            raise ProfileError(f"no free slot on the engine within {self.WAIT_S:.0f} s (engines[].max_concurrency)")

    async def __aexit__(self, *exc: object) -> None:
        if self.ticket is not None:
            r = self.a
            r.wake(r.scheduler.finish(self.ticket, r.clock.now()))
            self.ticket = None
            if r.leaving:  # lifecycle M29: a profile's slot was the last thing held
                r.released()


def _outcome(a: Authority, e: EngineState, ok: bool, reason: str | None, detail: str | None = None) -> None:
    """Record a profile's outcome: one WARNING when the status changes (to failed, or back
    to ok after a failure), INFO otherwise; consecutive failures count for the back-off."""
    before = e.profile_reported
    e.profile_status = "ok" if ok else "failed"
    e.profile_error = None if ok else reason
    e.profile_reported = e.profile_status
    a.observed(e)  # lifecycle M01: a joining engine's profile has its outcome
    if ok:
        e.profile_failures = 0
        if before == "failed":
            log.warning("engine %s: profiled again after %s; predictive admission uses its profile", e.name, "a failure")
        else:
            log.info("engine %s profiled: prefill %s decode %s", e.name, e.prefill.snapshot(), e.decode.snapshot())
        return
    e.profile_failures += 1
    retry = retry_s(e)
    if before != "failed":
        log.warning("engine %s: profiling failed (%s); predictive admission uses default models for it; retrying in %.0f s, backing off to %.0f s",
                    e.name, detail or reason, retry, PROFILE_RETRY_MAX_S)
    else:
        log.info("engine %s: profiling failed again (%s, %d in a row); next try in %.0f s", e.name, detail or reason, e.profile_failures, retry)


class _Samples:
    """One profile's measurements (prompt tokens or batch size, milliseconds), warm-up
    excluded, and whether the engine's streams carried usage."""

    __slots__ = ("prefill", "decode", "starts", "usage_seen")

    def __init__(self) -> None:
        self.prefill: list[tuple[float, float]] = []
        self.decode: list[tuple[float, float]] = []
        self.starts: list[tuple[float, float]] = []
        self.usage_seen = False


def _healthy_prefill(a: Authority) -> EngineState:
    """A healthy prefill engine, to profile a decode engine with."""
    p = next((x for x in a.engines.values() if x.role == "prefill" and x.healthy), None)
    if p is None:
        raise ProfileError("no healthy prefill engine to profile a decode engine with")
    return p


async def profile_engine(a: Authority, e: EngineState) -> None:
    """Profile `e` by its role (module docstring): the lengths, the small batch, the
    models fitted; the outcome recorded either way (a failure keeps the previous models)."""
    cfg = a.config.admission.prediction
    lengths = [n.root for n in cfg.profile_prompt_tokens]
    e.profile_status = "running"
    e.profile_attempted = a.clock.now()
    try:
        s = _Samples()
        run = int(e.profile_attempted * 1000) % 1000000  # tags distinct across runs too: no prefix-cache hits
        k = await _measure_lengths(a, e, s, lengths, cfg.profile_repeats, cfg.profile_output_tokens, run)
        await _measure_batch(a, e, s, lengths[0], cfg.profile_output_tokens, f"{k}-{run}")
        _fit(e, s)
        if e.role == "unified" and not s.usage_seen and e.name not in a.prompt_counters:
            await _find_prompt_counter(a, e, lengths[0])
        _outcome(a, e, True, None)
    except (ProfileError, UpstreamError) as x:
        reason = str(x) or type(x).__name__
        _outcome(a, e, False, reason, x.log_detail if isinstance(x, UpstreamError) and x.log_detail else None)
    except Exception as x:  # a bug: say so where operators look, keep serving
        log.exception("engine %s: profiling failed with an internal error", e.name)
        _outcome(a, e, False, f"internal error: {type(x).__name__}")


async def _measure_lengths(a: Authority, e: EngineState, s: _Samples, lengths: list[int], reps: int, out_tokens: int, run: int) -> int:
    """Each prompt length `reps` times, after one warm-up measurement at the first length
    (discarded: it pays for connection set-up). Returns the measurements made."""
    k = 0
    for n in [lengths[0], *lengths]:
        for _ in range(1 if k == 0 else reps):
            k += 1
            await _measure_one(a, e, s, n, out_tokens, f"narwhal-profile-{e.name}-{k}", f"{k}-{run}", keep=k > 1)
    return k


async def _measure_one(a: Authority, e: EngineState, s: _Samples, n: int, out_tokens: int, rid: str, tag: str, *, keep: bool) -> None:
    """One measurement at `n` prompt tokens, by role: a prefill engine's prefill leg; a
    unified engine's stream (TTFT ~ prefill, and TPOT); a decode engine's stream after a
    prefill leg on a prefill engine (its start latency, and TPOT)."""
    if e.role == "prefill":
        async with _Slot(a, e, n):
            dt, _, pt = await _prefill_leg(a, e, _body(a, e, n, 1, tag), rid)
        if keep:
            s.prefill.append((pt or n, dt * 1000.0))
    elif e.role == "unified":
        body = decode_body(_body(a, e, n, out_tokens, tag), dialect=e.dialect, model=e.model)
        async with _Slot(a, e, n):
            ttft, tp, pt, _ = await _stream(a, e, body, rid)
        s.usage_seen = s.usage_seen or pt is not None
        if keep:
            s.prefill.append((pt or n, ttft * 1000.0))
            if tp is not None:
                s.decode.append((1.0, tp * 1000.0))
    else:
        p = _healthy_prefill(a)
        base = _body(a, e, n, out_tokens, tag)
        async with _Slot(a, p, n):
            _, kv, pt = await _prefill_leg(a, p, base, rid + "-p")
        body = decode_body(base, dialect=e.dialect, model=e.model, kv_transfer_params=kv, disaggregated=True)
        start, tp, pt2, _ = await _stream(a, e, body, rid)
        if keep:
            s.starts.append((pt or pt2 or n, start * 1000.0))
            if tp is not None:
                s.decode.append((1.0, tp * 1000.0))


async def _measure_batch(a: Authority, e: EngineState, s: _Samples, n: int, out_tokens: int, tag: str) -> None:
    """TPOT under a small batch, for the slope of the load-conditioned profile; never more
    at once than the engine's max_concurrency (at 1 the slope stays a prior)."""
    batch = min(4, e.max_concurrency or 4)
    if e.role not in ("unified", "decode") or batch < 2:
        return
    bodies = []
    for i in range(batch):
        base = _body(a, e, n, out_tokens * 2, f"b{i}-{tag}")
        kv = None
        if e.role == "decode":
            p = _healthy_prefill(a)
            async with _Slot(a, p, n):
                _, kv, _ = await _prefill_leg(a, p, base, f"narwhal-profile-{e.name}-b{i}-p")
        bodies.append(decode_body(base, dialect=e.dialect, model=e.model, kv_transfer_params=kv, disaggregated=e.role == "decode"))

    async def one(i: int, b: dict[str, Any]) -> tuple[float, float | None, int | None, int]:
        async with _Slot(a, e, n):
            return await _stream(a, e, b, f"narwhal-profile-{e.name}-b{i}")

    res = await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    for _, tp, _, _ in res:
        if tp is not None:
            s.decode.append((float(batch), tp * 1000.0))


def _fit(e: EngineState, s: _Samples) -> None:
    """The models fitted to the samples, kept for /v1/engines. Delays from a busy machine
    only ever add time: per prompt length the fastest of the repeats is the measurement
    (TPOT: the median per batch size)."""
    if s.prefill:
        e.prefill.fit(_fastest(s.prefill))
    if s.decode:
        e.decode.fit(_median(s.decode))
    if s.starts:
        fs = _fastest(s.starts)
        e.start_model.fit([[1.0, n / 1000.0] for n, _ in fs], [ms for _, ms in fs])
    e.profile_samples = {
        "prefill_ms_by_prompt_tokens": [[round(n), round(ms, 3)] for n, ms in s.prefill],
        "tpot_ms_by_batch": [[b, round(ms, 3)] for b, ms in s.decode],
        "decode_start_ms_by_prompt_tokens": [[round(n), round(ms, 3)] for n, ms in s.starts],
    }


async def _find_prompt_counter(a: Authority, e: EngineState, n: int) -> None:
    """A unified engine whose streams carry no usage: can it count prompts exactly?
    (upstream/usage.py); assembled answers' prompt tokens are an estimate otherwise."""
    async with _Slot(a, e, n):
        pc = await detect(CountTarget(a.client, e.url, e.name, e.model or a.config.serving.model))
    if pc is not None:
        a.add_prompt_counter(e.name, pc)
    log.info("engine %s: its streams carry no usage; prompt tokens of assembled answers: %s", e.name, pc.kind if pc else "an estimate")


# -- when to profile ---------------------------------------------------------------------

PROFILE_RETRY_S = 30.0  # the first retry after a failed profile ...
PROFILE_RETRY_MAX_S = 600.0  # ... doubling per consecutive failure up to this


def retry_s(e: EngineState) -> float:
    """The wait before profiling `e` again after its consecutive failures."""
    n = max(0, e.profile_failures - 1)
    return min(PROFILE_RETRY_MAX_S, PROFILE_RETRY_S * (2.0 ** min(n, 16)))


async def profile_all(a: Authority, *, only_healthy: bool = False) -> None:
    """Profile the fleet: prefill and unified engines together, then decode engines one
    at a time (their measurements send prefill legs, which must not queue behind one
    another's or behind a prefill engine's own profiling)."""
    todo = [e for e in a.engines.values() if e.healthy or not only_healthy]
    for e in todo:
        e.profile_status = "running"
    await asyncio.gather(*(profile_engine(a, e) for e in todo if e.role != "decode"))
    for e in todo:
        if e.role == "decode":
            await profile_engine(a, e)


def maybe_reprofile(a: Authority, e: EngineState, now: float) -> None:
    """A healthy engine without a profile (down at start, or its profiling failed)
    is profiled again: after a failure, with exponential back-off (retry_s)."""
    if not a.config.admission.prediction.profile_on_start or e.profile_status not in ("pending", "failed"):
        return
    if any(not t.done() for t in a.profiling.values()):
        return
    wait = retry_s(e) if e.profile_status == "failed" else PROFILE_RETRY_S
    if e.profile_attempted is not None and now - e.profile_attempted < wait:
        return
    if e.role == "decode" and not any(p.role == "prefill" and p.healthy for p in a.engines.values()):
        return
    profile(a, e.name)


def profile(a: Authority, name: str) -> None:
    """Profile one engine now, unless it is being profiled."""
    old = a.profiling.get(name)
    if old is not None and not old.done():
        return
    e = a.engines[name]
    e.profile_status = "running"
    a.profiling[name] = asyncio.create_task(profile_engine(a, e), name=f"narwhal-profile-{name}")
