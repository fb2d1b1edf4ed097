"""Engine profiling: on registration and on demand (POST /admin/engines/{name}/profile).

Profiling traffic carries `x-narwhal-profiling: 1` and request IDs `narwhal-profile-...`;
it is not offered traffic (the books never see it) and takes no phase slot.
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
from .client import UpstreamError

__all__ = ["profile_engine", "ProfileError"]

log = logging.getLogger("narwhal")


class ProfileError(Exception):
    pass


def _prompt(tokens: int, bytes_per_token: float) -> str:
    words = max(1, round(tokens * bytes_per_token / 8))
    return ("narwhal " * words).strip()


def _body(router: Any, e: EngineState, n: int, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": e.model or router.config.serving.model,
        "messages": [{"role": "user", "content": _prompt(n, router.sizer.bytes_per_token)}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if e.dialect in ("vllm", "sglang"):
        body["ignore_eos"] = True  # both accept it: the output runs to max_tokens
    return body


async def _stream(router: Any, e: EngineState, body: dict[str, Any], rid: str) -> tuple[float, float | None, int | None, int]:
    """(first token s, TPOT s, prompt tokens, tokens) of one streaming measurement."""
    d = DIALECTS[e.dialect]
    checks = d.token_accounting == "token_ids"
    relay = StreamRelay(checks_ids=checks, client_ids=False, client_usage=True, max_event_bytes=router.config.upstream.max_event_bytes)
    clock = router.clock
    t0 = clock.now()
    headers = {"x-narwhal-profiling": "1"}
    if d.propagate_request_id:
        headers["x-request-id"] = rid
    up = await router.client.open("POST", e.url + "/v1/chat/completions", body=orjson.dumps(body), headers=headers)
    first: float | None = None
    done = False
    try:
        if up.status >= 400:
            log.warning("engine %s: profiling request %s answered HTTP %d: %r", e.name, rid, up.status, (await up.read(4096))[:200])
            raise ProfileError(f"engine answered HTTP {up.status}")
        while True:
            chunk = await up.next_chunk()
            if not chunk:
                raise ProfileError("the stream ended without data: [DONE]")
            now = clock.now()
            step = relay.feed(chunk, now)
            if step.failure is not None:
                row, detail = step.failure
                log.warning("engine %s: profiling request %s: %s %s%s", e.name, rid, row, detail, f": {relay.failure_detail}" if relay.failure_detail else "")
                raise ProfileError(f"{row}: {detail}")  # T07
            if step.first_token and first is None:
                first = now
            if step.done:
                done = True
                break
    finally:
        await up.aclose(complete=done)
    if relay.engine_error is not None:
        log.warning("engine %s: profiling request %s: engine error event %r", e.name, rid, relay.engine_error)
        raise ProfileError("the engine sent an error event")
    if first is None:
        raise ProfileError("the engine produced no token")
    u = relay.usage or {}
    pt = u.get("prompt_tokens") if isinstance(u.get("prompt_tokens"), int) else None
    tp = relay.arrivals.tpot()
    return first - t0, tp, pt, relay.token_count


async def _prefill_leg(router: Any, e: EngineState, body: dict[str, Any], rid: str) -> tuple[float, dict[str, Any] | None, int | None]:
    clock = router.clock
    t0 = clock.now()
    status, raw = await router.client.post_json(
        e.url + "/v1/chat/completions", prefill_body(body, route="chat"), headers={"x-request-id": rid, "x-narwhal-profiling": "1"}
    )
    dt = clock.now() - t0
    if status >= 400:
        log.warning("engine %s: profiling request %s answered HTTP %d: %r", e.name, rid, status, raw[:200])
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


async def profile_engine(router: Any, e: EngineState) -> None:
    cfg = router.config.admission.prediction
    lengths = list(cfg.profile_prompt_tokens)
    reps = cfg.profile_repeats
    out_tokens = cfg.profile_output_tokens
    e.profile_status = "running"
    e.profile_error = None
    e.profile_attempted = router.clock.now()
    try:
        prefill: list[tuple[float, float]] = []
        decode: list[tuple[float, float]] = []
        starts: list[tuple[float, float]] = []
        k = 0
        # one warm-up measurement, discarded: it pays for connection set-up
        warm = [lengths[0]]
        for n in [*warm, *lengths]:
            for _ in range(1 if k == 0 else reps):
                k += 1
                rid = f"narwhal-profile-{e.name}-{k}"
                keep = k > 1
                if e.role == "prefill":
                    dt, _, pt = await _prefill_leg(router, e, _body(router, e, n, 1), rid)
                    if keep:
                        prefill.append((pt or n, dt * 1000.0))
                elif e.role == "unified":
                    body = decode_body(_body(router, e, n, out_tokens), dialect=e.dialect, model=e.model)
                    ttft, tp, pt, _ = await _stream(router, e, body, rid)
                    if keep:
                        prefill.append((pt or n, ttft * 1000.0))
                        if tp is not None:
                            decode.append((1.0, tp * 1000.0))
                else:
                    p = next((x for x in router.engines.values() if x.role == "prefill" and x.healthy), None)
                    if p is None:
                        raise ProfileError("no healthy prefill engine to profile a decode engine with")
                    base = _body(router, e, n, out_tokens)
                    _, kv, pt = await _prefill_leg(router, p, base, rid + "-p")
                    body = decode_body(base, dialect=e.dialect, model=e.model, kv_transfer_params=kv, disaggregated=True)
                    start, tp, pt2, _ = await _stream(router, e, body, rid)
                    if keep:
                        starts.append((pt or pt2 or n, start * 1000.0))
                        if tp is not None:
                            decode.append((1.0, tp * 1000.0))
        if e.role in ("unified", "decode"):
            # TPOT under a small batch, for the slope of the load-conditioned profile
            batch = 4
            bodies = []
            for i in range(batch):
                base = _body(router, e, lengths[0], out_tokens * 2)
                kv = None
                if e.role == "decode":
                    p = next(x for x in router.engines.values() if x.role == "prefill" and x.healthy)
                    _, kv, _ = await _prefill_leg(router, p, base, f"narwhal-profile-{e.name}-b{i}-p")
                bodies.append(decode_body(base, dialect=e.dialect, model=e.model, kv_transfer_params=kv, disaggregated=e.role == "decode"))
            res = await asyncio.gather(*(_stream(router, e, b, f"narwhal-profile-{e.name}-b{i}") for i, b in enumerate(bodies)))
            for _, tp, _, _ in res:
                if tp is not None:
                    decode.append((float(batch), tp * 1000.0))
        # Delays from a busy machine only ever add time: per prompt length the fastest of
        # the repeats is the measurement (TPOT: the median per batch size).
        if prefill:
            e.prefill.fit(_fastest(prefill))
        if decode:
            e.decode.fit(_median(decode))
        if starts:
            fs = _fastest(starts)
            e.start_model.fit([[1.0, n / 1000.0] for n, _ in fs], [ms for _, ms in fs])
        e.profile_samples = {
            "prefill_ms_by_prompt_tokens": [[round(n), round(ms, 3)] for n, ms in prefill],
            "tpot_ms_by_batch": [[b, round(ms, 3)] for b, ms in decode],
            "decode_start_ms_by_prompt_tokens": [[round(n), round(ms, 3)] for n, ms in starts],
        }
        e.profile_status = "ok"
        log.info("engine %s profiled: prefill %s decode %s", e.name, e.prefill.snapshot(), e.decode.snapshot())
    except (ProfileError, UpstreamError, StopIteration) as x:
        e.profile_status = "failed"
        e.profile_error = str(x) or type(x).__name__
        log.warning("engine %s: profiling failed: %s", e.name, x.log_detail if isinstance(x, UpstreamError) and x.log_detail else e.profile_error)
    except Exception as x:  # a bug: say so where operators look, keep serving
        e.profile_status = "failed"
        e.profile_error = f"internal error: {type(x).__name__}: {x}"
        log.exception("engine %s: profiling failed", e.name)
