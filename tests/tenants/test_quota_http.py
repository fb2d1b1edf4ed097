"""What each tenant may use, over real HTTP (issue 22 item 2; rows R17-R20): limits per
tenant from tenants:, keys naming the tenants, Retry-After from the bucket, and one
tenant at its limit leaving the others their answers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from tests.helpers import RunningRouter, keys_file, running_router, sse, wait_until

KEYS = {"noisy": "sk-noisy-0123456789", "quiet": "sk-quiet-0123456789", "other": "sk-other-0123456789"}


@pytest.fixture(scope="module")
def mock() -> Iterator[Any]:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="m0", timing=Timing(tpot_base_ms=20.0))]) as ms:
        yield ms[0]


def router(tmp: Path, mock: Any, tenants: dict[str, Any], *, auth: bool = True, **admission: Any) -> Any:
    cfg: dict[str, Any] = {
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}, **admission},
        "monitoring": {"poll_interval_ms": 100, "stale_after_ms": 60000},
        "tenants": tenants,
    }
    if auth:
        cfg["auth"] = {"keys_file": str(keys_file(tmp, KEYS))}
    return running_router(cfg, [EngineSpec("e0", mock.url, "unified", "vllm", None, None)])


def ask(rr: RunningRouter, tenant: str | None, *, max_tokens: int = 4, content: str = "hi") -> httpx.Response:
    h = {"authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
    return httpx.post(rr.url + "/v1/chat/completions", json={"model": "narwhal-demo", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens},
                      headers=h, timeout=30)


def streams(rr: RunningRouter, tenant: str, n: int, max_tokens: int) -> tuple[list[Any], list[threading.Thread]]:
    out: list[Any] = []
    h = {"authorization": f"Bearer {KEYS[tenant]}"}
    body = {"model": "narwhal-demo", "messages": [{"role": "user", "content": "long"}], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    ts = [threading.Thread(target=lambda: out.append(sse(rr.url, body, headers=h))) for _ in range(n)]
    for t in ts:
        t.start()
    return out, ts


def test_R17_a_tenant_at_its_in_flight_limit_leaves_the_others_their_answers(tmp_path: Path, mock: Any) -> None:
    with router(tmp_path, mock, {"noisy": {"max_in_flight": 2}}) as rr:
        out, ts = streams(rr, "noisy", 2, 60)
        wait_until(lambda: rr.call(lambda: getattr(rr.router.quotas.books.get("noisy"), "in_flight", 0)) == 2, timeout=10, what="two noisy streams")
        r = ask(rr, "noisy")
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        err = r.json()["error"]
        assert err["code"] == "tenant_in_flight_full" and "noisy" in err["message"] and "2" in err["message"]
        assert ask(rr, "quiet").status_code == 200  # another tenant: not limited by noisy's
        for t in ts:
            t.join(30)
        assert all(s.status == 200 and s.done for s in out)
        assert ask(rr, "noisy").status_code == 200  # its streams ended: in flight again
        b = rr.balanced()
        assert b["terminal"]["rejected"] == 1


def test_R18_request_rate_with_retry_after_from_the_bucket(tmp_path: Path, mock: Any) -> None:
    with router(tmp_path, mock, {"default": {"requests_per_s": 0.25}}) as rr:  # a bucket of 1, refilled in 4 s
        assert ask(rr, "other").status_code == 200
        r = ask(rr, "other")
        assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_request_rate_exceeded"
        assert 3 <= int(r.headers["retry-after"]) <= 4  # the bucket's wait, not a constant
        assert ask(rr, "quiet").status_code == 200  # default's limits, but its own bucket


def test_R19_tokens_per_minute_charge_the_prompt_and_refund_what_was_not_used(tmp_path: Path, mock: Any) -> None:
    with router(tmp_path, mock, {"quiet": {"tokens_per_min": 600}}) as rr:  # 10 tokens/s
        big = "word " * 2000  # about 500+ tokens by the estimate
        r = ask(rr, "quiet", content=big)
        got = r.status_code
        r2 = ask(rr, "quiet", content=big)
        assert (got, r2.status_code) in ((200, 429), (429, 429)), (r.text, r2.text)
        err = r2.json()["error"]
        assert err["code"] == "tenant_token_rate_exceeded" and int(r2.headers["retry-after"]) >= 1
        assert ask(rr, "noisy", content=big).status_code == 200  # no budget of its own: unlimited
        rr.balanced()


def test_R20_a_tenant_queue_limit_and_fair_service_of_the_queue(tmp_path: Path, mock: Any) -> None:
    with router(tmp_path, mock, {"noisy": {"queue_limit": 1}}, phase_concurrency={"prefill": 1, "decode": 1}) as rr:
        out, ts = streams(rr, "noisy", 1, 60)  # holds the one slot
        wait_until(lambda: rr.call(lambda: rr.router.engines["e0"].decode_in_use) == 1, timeout=10, what="the slot taken")
        q_out, q_ts = streams(rr, "noisy", 1, 4)  # queued: its one queue place
        wait_until(lambda: rr.call(lambda: rr.router.scheduler.queued) == 1, timeout=10, what="one queued")
        r = ask(rr, "noisy")
        assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_queue_full" and r.headers["retry-after"] == "1"
        quiet, qts = streams(rr, "quiet", 1, 4)  # queues too: no limit of its own
        wait_until(lambda: rr.call(lambda: rr.router.scheduler.queued) == 2, timeout=10, what="two queued")
        for t in ts + q_ts + qts:
            t.join(30)
        assert all(s.status == 200 and s.done for s in out + q_out + quiet)
        rr.balanced()


def test_without_auth_the_default_entry_limits_every_request(tmp_path: Path, mock: Any) -> None:
    with router(tmp_path, mock, {"default": {"max_in_flight": 1}}, auth=False) as rr:
        body = {"model": "narwhal-demo", "messages": [{"role": "user", "content": "long"}], "max_tokens": 40, "ignore_eos": True, "stream": True}
        out: list[Any] = []
        t = threading.Thread(target=lambda: out.append(sse(rr.url, body)))
        t.start()
        wait_until(lambda: rr.call(lambda: getattr(rr.router.quotas.books.get("default"), "in_flight", 0)) == 1, timeout=10, what="one in flight")
        r = ask(rr, None)
        assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_in_flight_full"
        t.join(30)
        time.sleep(0.05)
        assert ask(rr, None).status_code == 200


def test_the_books_and_metrics_per_tenant_sum_to_the_fleets(tmp_path: Path, mock: Any) -> None:
    with router(tmp_path, mock, {"noisy": {"max_in_flight": 1}, "quiet": {"weight": 2}}) as rr:
        out, ts = streams(rr, "noisy", 1, 40)
        wait_until(lambda: rr.call(lambda: getattr(rr.router.quotas.books.get("noisy"), "in_flight", 0)) == 1, timeout=10, what="noisy in flight")
        assert ask(rr, "noisy").status_code == 429
        assert ask(rr, "quiet").status_code == 200 and ask(rr, "other").status_code == 200
        view = rr.get("/v1/engines").json()["router"]["tenants"]
        assert view["noisy"] == {"in_flight": 1, "queued": 0, "weight": 1.0} and view["quiet"]["weight"] == 2.0
        for t in ts:
            t.join(30)
        b = rr.balanced()
        bt = b["by_tenant"]
        assert set(bt) == {"noisy", "quiet", "other"}  # "other": a key whose tenant is not configured
        assert bt["noisy"]["offered"] == 2 and bt["noisy"]["rejected"] == 1 and bt["noisy"]["completed"] == 1
        assert sum(v["offered"] for v in bt.values()) == b["offered"]
        for cls in b["terminal"]:
            assert sum(v[cls] for v in bt.values()) == b["terminal"][cls]
        m = rr.get("/metrics").text
        assert 'narwhal_tenant_requests_offered_total{tenant="noisy"} 2.0' in m
        assert 'narwhal_tenant_requests_terminal_total{class="rejected",tenant="noisy"} 1.0' in m
        assert 'narwhal_tenant_in_flight{tenant="quiet"} 0.0' in m
        assert KEYS["noisy"] not in m and "k-noisy" not in m
        # the TTFT histogram per tenant: configured tenants by name, any other as "other"
        counts = {line.split('tenant="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in m.splitlines() if line.startswith("narwhal_tenant_ttft_seconds_count{")}
        assert counts == {"noisy": 1.0, "quiet": 1.0, "other": 1.0}, counts


def test_R02_fair_retention_the_tenant_over_its_share_yields_its_newest_queued_request(tmp_path: Path, mock: Any) -> None:
    """Issue 40 item 6: with the HTTP retention (R02) binding, a noisy tenant's queued
    requests held it and the quiet tenant got 33-35% of its answers. Now the tenant
    furthest over its share yields its newest request not yet granted (R02, Retry-After,
    in its books) and the quiet tenant's request is held in its place."""
    cfg: dict[str, Any] = {
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}, "http_retention_limit": 4, "queue_limit": 64},
        "monitoring": {"poll_interval_ms": 100, "stale_after_ms": 60000},
        "tenants": {"noisy": {"weight": 1}, "quiet": {"weight": 1}},
        "auth": {"keys_file": str(keys_file(tmp_path, KEYS))},
    }
    spec = EngineSpec("e0", mock.url, "unified", "vllm", None, None, max_concurrency=1)
    with running_router(cfg, [spec]) as rr:
        out, ts = streams(rr, "noisy", 4, 40)  # one runs, three wait in the queue: the retention is full
        wait_until(lambda: rr.call(lambda: rr.router.held) == 4 and rr.call(lambda: rr.router.scheduler.queued) == 3, timeout=10, what="the retention full of noisy")
        r = ask(rr, "quiet")
        assert r.status_code == 200, r.text
        for t in ts:
            t.join(30)
        statuses = sorted(s.status for s in out)
        assert statuses == [200, 200, 200, 429], statuses
        refused = next(s for s in out if s.status == 429)
        assert "http_retention_full" in str(refused.__dict__)
        assert ask(rr, "noisy").status_code == 200
        b = rr.balanced()
        assert b["terminal"]["rejected"] == 1
        assert b["by_tenant"]["noisy"]["rejected"] == 1 and b["by_tenant"]["quiet"]["completed"] == 1
