"""Fair preemption over real HTTP (core/preempt.py, issue 40 item 6): with tenants, the
fair reserve and stream migration on, a quiet tenant's request waiting for an engine whose
two slots hold its own request and a noisy one past its first token has the noisy stream
cut and carried on after it; the noisy client's stream is the uninterrupted answer token
for token, the engine is not counted as failed, and the books balance. Off (the knob, or
migration), the quiet request waits for a slot as before.

One mock vLLM engine (`sequence_output`: its answer is a function of the whole token
sequence, so the uninterrupted answer is known here), engines[].max_concurrency 2."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.mock import MockConfig, RunningMock, Timing, running_fleet
from narwhal.mock.scenarios import sequence_script
from narwhal.mock.tokens import prompt_token_ids
from narwhal.upstream.engines import EngineSpec
from tests.helpers import keys_file, running_router, sse, wait_until
from tests.migration.test_migration_http import metric, read

MODEL = "narwhal-demo"
KEYS = {"noisy": "sk-noisy-0123456789", "quiet": "sk-quiet-0123456789"}
LONG = [{"role": "user", "content": "tell me a long story about narwhals"}]


@pytest.fixture(scope="module")
def mock() -> Iterator[RunningMock]:
    cfg = MockConfig(dialect="vllm", role="unified", model=MODEL, name="u0", timing=Timing(prefill_base_ms=5.0, tpot_base_ms=15.0), sequence_output=True)
    with running_fleet([cfg]) as ms:
        yield ms[0]


def router(tmp: Path, mock: RunningMock, *, preempt: bool = True, attempts: int = 1) -> Any:
    cfg = {"admission": {"mode": "open", "prediction": {"profile_on_start": False}, "fair_preempt": preempt},
           "monitoring": {"poll_interval_ms": 100, "stale_after_ms": 60000},
           "upstream": {"migration": {"max_attempts": attempts}},
           "tenants": {"quiet": {"weight": 1}, "noisy": {"weight": 1}}, "auth": {"keys_file": str(keys_file(tmp, KEYS))}}
    return running_router(cfg, [EngineSpec("u0", mock.url, "unified", "vllm", None, None, max_concurrency=2)])


def body(n: int, messages: list[dict[str, str]] = LONG) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": n, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}


def start(url: str, tenant: str, b: dict[str, Any], out: dict[str, Any], key: str) -> threading.Thread:
    def run() -> None:
        out[key] = sse(url, b, headers={"authorization": f"Bearer {KEYS[tenant]}"})
        out[key + "_at"] = time.monotonic()

    t = threading.Thread(target=run)
    t.start()
    return t


def load(url: str) -> dict[str, int]:
    """The one engine's slots in use, as the router's /v1/engines shows them."""
    return dict(httpx.get(url + "/v1/engines", timeout=10).json()["data"][0]["load"])


def scene(url: str) -> dict[str, Any]:
    """noisy heaviest lately and quiet active; a noisy stream past its first token and a
    quiet one hold both slots; then a second quiet request arrives (any router at `url`:
    one process, or an authority and its workers)."""
    out: dict[str, Any] = {}
    for tenant in ("quiet", "noisy", "noisy", "noisy"):
        start(url, tenant, body(1, [{"role": "user", "content": "hi"}]), out, "warm").join(30)
    ts = [start(url, "noisy", body(60), out, "noisy")]
    wait_until(lambda: (ld := load(url))["decode_in_use"] == 1 and ld["prefill_in_use"] == 0, timeout=10, what="the noisy stream past its first token")
    ts.append(start(url, "quiet", body(30, [{"role": "user", "content": "first quiet"}]), out, "q1"))
    wait_until(lambda: load(url)["decode_in_use"] == 2, timeout=10, what="both slots held")
    ts.append(start(url, "quiet", body(4, [{"role": "user", "content": "second quiet"}]), out, "q2"))
    for t in ts:
        t.join(60)
    return out


def uninterrupted(n: int) -> list[int]:
    s = sequence_script(prompt_token_ids("chat", {"messages": LONG}, 4.0), max_tokens=n, ignore_eos=True)
    return [p.token_id for p in s.pieces]


def test_a_quiet_request_preempts_the_noisy_stream_which_is_carried_on_token_for_token(tmp_path: Path, mock: RunningMock) -> None:
    with router(tmp_path, mock) as rr:
        out = scene(rr.url)
        noisy, q2 = out["noisy"], out["q2"]
        assert noisy.status == 200 and noisy.done and q2.status == 200 and q2.done and out["q1"].done
        ids, _, chunks = read(noisy)
        assert ids == uninterrupted(60)  # no token repeated or missing across the cut
        assert noisy.comments == ["x-narwhal-migrations 1"]
        assert len({c["id"] for c in chunks}) == 1
        assert out["q2_at"] < out["q1_at"]  # the second quiet request ran beside the first: it waited for neither stream
        assert {k: v for k, v in metric(rr, "narwhal_migrations_total").items() if v} == {'cause="E06",decision="carry_on",worker="0"': 1.0}
        assert metric(rr, "narwhal_fair_preemptions_total") == {"": 1.0}
        e = rr.router.scheduler.engines["u0"]
        assert rr.call(lambda: e.breaker.failures) == 0 and rr.call(lambda: e.decode_in_use) == 0  # not a failure of the engine
        assert rr.balanced()


@pytest.mark.parametrize(("preempt", "attempts"), [(False, 1), (True, 0)], ids=["fair_preempt off", "migration off"])
def test_off_the_quiet_request_waits_for_a_slot(tmp_path: Path, mock: RunningMock, preempt: bool, attempts: int) -> None:
    with router(tmp_path, mock, preempt=preempt, attempts=attempts) as rr:
        out = scene(rr.url)
        assert out["noisy"].done and out["q2"].done
        assert out["noisy"].comments == []
        assert out["q2_at"] > out["q1_at"]  # it waited for the first quiet stream's slot
        assert metric(rr, "narwhal_fair_preemptions_total") == {"": 0.0}
        assert rr.balanced()

