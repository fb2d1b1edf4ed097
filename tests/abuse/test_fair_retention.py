"""The router's threat model, fair retention (issue 40 item 6): a tenant that floods the
router must not take the HTTP retention (admission.http_retention_limit, R02) from the
others. With tenants configured and R02 the binding limit, a noisy tenant's queued
requests held the retention and a quiet tenant at a tenth of its rate got a third of its
answers, every refusal `http_retention_full`. The behaviour now: the tenant furthest over
its share yields its newest request not yet granted (R02 for it, Retry-After), and the
quiet tenant's request is held in its place and answered.

The attack at small scale: one engine taking one request at a time, a retention of 6,
12 noisy clients sending streams back to back for as long as the quiet tenant's 8
requests, one after another, take; bounded in count and time."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from tests.helpers import keys_file, running_router, wait_until

KEYS = {"noisy": "sk-flood-noisy-0123", "quiet": "sk-flood-quiet-0123"}
BODY = {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="m0", timing=Timing(tpot_base_ms=5.0))]) as (m,):
        yield m.url


@contextlib.contextmanager
def _flooding(flood: Callable[[str, threading.Event], None], url: str, n: int) -> Iterator[None]:
    """`n` threads running `flood(url, stop)` for as long as the block runs; joined (30 s
    each at most) at its end."""
    stop = threading.Event()
    threads = [threading.Thread(target=flood, args=(url, stop)) for _ in range(n)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(30)


def _ask(client: httpx.Client, url: str, tenant: str) -> httpx.Response:
    return client.post(url + "/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer {KEYS[tenant]}"})


def test_a_tenant_flooding_the_retention_leaves_a_quiet_tenant_its_answers(tmp_path: Path, engine: str) -> None:
    cfg: dict[str, Any] = {
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}, "http_retention_limit": 6, "queue_limit": 64},
        "monitoring": {"poll_interval_ms": 100, "stale_after_ms": 60000},
        "tenants": {"noisy": {"weight": 1}, "quiet": {"weight": 1}},
        "auth": {"keys_file": str(keys_file(tmp_path, KEYS))},
    }
    noisy: list[tuple[int, str]] = []

    def flood(url: str, stop: threading.Event) -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                r = _ask(c, url, "noisy")
                noisy.append((r.status_code, r.json()["error"]["code"] if r.status_code != 200 else ""))

    with running_router(cfg, [EngineSpec("e0", engine, "unified", "vllm", None, None, max_concurrency=1)]) as rr:
        with _flooding(flood, rr.url, 12):
            wait_until(lambda: rr.call(lambda: rr.router.held) == 6, timeout=10, what="the retention full of the noisy tenant")
            with httpx.Client(timeout=30) as c:
                quiet = [_ask(c, rr.url, "quiet") for _ in range(8)]
        assert [r.status_code for r in quiet] == [200] * 8, [r.text for r in quiet if r.status_code != 200]
        refused = [code for status, code in noisy if status != 200]
        assert refused and set(refused) == {"http_retention_full"}, noisy  # the flood was held at R02, and only the flood
        b = rr.balanced()
        assert b["by_tenant"]["quiet"]["completed"] == 8 and b["by_tenant"]["quiet"].get("rejected", 0) == 0


def test_a_noisy_tenant_cannot_turn_preemption_into_a_failure_of_its_own_or_the_engine(tmp_path: Path) -> None:
    """Fair preemption (core/preempt.py) cuts a running noisy stream for a waiting quiet
    request. Attacked from both sides at small scale: 8 noisy streams kept running back to
    back on an engine of 2 slots while a quiet client sends 12 requests one after another
    (each can preempt): every noisy stream still ends complete, with its whole answer and
    no error event (with max_attempts 1, a second cut of one request would end in one);
    the engine's breaker counts no failure; the books balance."""
    cfg: dict[str, Any] = {
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
        "monitoring": {"poll_interval_ms": 100, "stale_after_ms": 60000},
        "upstream": {"migration": {"max_attempts": 1}},
        "tenants": {"noisy": {"weight": 1}, "quiet": {"weight": 1}},
        "auth": {"keys_file": str(keys_file(tmp_path, KEYS))},
    }
    stream = {**BODY, "max_tokens": 24, "ignore_eos": True, "stream": True}
    noisy: list[tuple[int, bool, int, int]] = []  # status, [DONE] seen, content pieces, error events

    def flood(url: str, stop: threading.Event) -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                with c.stream("POST", url + "/v1/chat/completions", json=stream, headers={"authorization": f"Bearer {KEYS['noisy']}"}) as r:
                    data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
                done = bool(data) and data[-1] == "[DONE]"
                events = [json.loads(ev) for ev in data if ev != "[DONE]"]
                pieces = sum(1 for ev in events for ch in ev.get("choices") or () if (ch.get("delta") or {}).get("content"))
                noisy.append((r.status_code, done, pieces, sum("error" in ev for ev in events)))

    with running_fleet([MockConfig(dialect="vllm", role="unified", name="p0", timing=Timing(prefill_base_ms=5.0, tpot_base_ms=10.0))]) as (m,), \
            running_router(cfg, [EngineSpec("e0", m.url, "unified", "vllm", None, None, max_concurrency=2)]) as rr:
        e = rr.router.scheduler.engines["e0"]
        with _flooding(flood, rr.url, 8):
            wait_until(lambda: rr.call(lambda: len(e.queue)) >= 4, timeout=10, what="noisy streams queued behind both slots")
            with httpx.Client(timeout=30) as c:
                quiet = [_ask(c, rr.url, "quiet") for _ in range(12)]
        assert [r.status_code for r in quiet] == [200] * 12
        preempted = rr.call(lambda: rr.router.preemptions)
        assert preempted > 0  # the attack ran: quiet requests did preempt noisy streams
        assert noisy and all(s == 200 and done and n == 24 and err == 0 for s, done, n, err in noisy), noisy
        assert rr.call(lambda: e.breaker.failures) == 0
        b = rr.balanced()
        assert b["by_tenant"]["noisy"]["completed"] == len(noisy) and b["by_tenant"]["quiet"]["completed"] == 12
