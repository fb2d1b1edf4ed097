"""Stream migration over real HTTP (issue 24; spec/tables/migration.yaml G01-G11): a decode
leg that breaks after response headers is carried on by another engine from the validated
token IDs, and the client's stream is the uninterrupted answer token for token.

The mocks answer with `sequence_output` (narwhal/mock/scenarios.sequence_script): their
answer is a function of the whole token sequence, so the uninterrupted answer is known
here without any engine. The fault (`drop`: the engine closes the connection before output
token `fault_after`, E06) is on u0 only (`fault_engines`); admission places the first
request on u0 (both idle: the first in the fleet's order), which the tests check."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from narwhal.mock import MockConfig, RunningMock, Timing, running_fleet
from narwhal.mock.scenarios import sequence_script
from narwhal.mock.tokens import prompt_token_ids
from narwhal.upstream.engines import EngineSpec
from tests.helpers import RunningRouter, running_router, sse

MODEL = "narwhal-demo"
MSGS = [{"role": "user", "content": "tell me a long story about narwhals"}]
DROP = {"fault": "drop", "fault_after": 25, "fault_engines": ["u0"], "tpot_ms": 3}  # tokens apart: response headers go out before the fault


@pytest.fixture(scope="module")
def mocks() -> Iterator[list[RunningMock]]:
    cfg = [MockConfig(dialect="vllm", role="unified", model=MODEL, name=f"u{i}", timing=Timing(time_scale=0.0), sequence_output=True) for i in range(2)]
    with running_fleet(cfg) as ms:
        yield ms


def router(mocks: list[RunningMock], max_attempts: int) -> Any:
    cfg = {"admission": {"mode": "open", "prediction": {"profile_on_start": False}}, "monitoring": {"poll_interval_ms": 100},
           "upstream": {"migration": {"max_attempts": max_attempts}}}
    return running_router(cfg, [EngineSpec(m.config.name or "", m.url, "unified", "vllm", None, None) for m in mocks])


def uninterrupted(n: int) -> tuple[list[int], str]:
    prompt = prompt_token_ids("chat", {"messages": MSGS}, 4.0)
    s = sequence_script(prompt, max_tokens=n, ignore_eos=True)
    return [p.token_id for p in s.pieces], "".join(p.text for p in s.pieces)


def body(n: int, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSGS, "max_tokens": n, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, **kw}


def read(st: Any) -> tuple[list[int], str, list[dict[str, Any]]]:
    ids: list[int] = []
    text = ""
    for c in st.chunks:
        for ch in c.get("choices") or ():
            ids += ch.get("token_ids") or []
            text += (ch.get("delta") or {}).get("content") or ""
    return ids, text, st.chunks


def metric(rr: RunningRouter, name: str) -> dict[str, float]:
    """`name`'s series on /metrics by their labels (an unlabelled one under "")."""
    out: dict[str, float] = {}
    for line in httpx.get(rr.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            out[labels] = float(value)
        elif line.startswith(name + " "):
            out[""] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_stream_broken_mid_answer_is_carried_on_token_for_token(mocks: list[RunningMock]) -> None:
    want_ids, want_text = uninterrupted(40)
    with router(mocks, max_attempts=1) as rr:
        st = sse(rr.url, body(40, mock=DROP))
        assert st.status == 200 and st.done, st.body
        ids, text, chunks = read(st)
        assert ids == want_ids and text == want_text  # no token repeated or missing
        assert len({c["id"] for c in chunks}) == 1  # one id
        usage = [c["usage"] for c in chunks if c.get("usage")]
        prompt = len(prompt_token_ids("chat", {"messages": MSGS}, 4.0))
        assert usage[-1]["prompt_tokens"] == prompt and usage[-1]["completion_tokens"] == 40 and usage[-1]["total_tokens"] == prompt + 40
        assert st.comments == ["x-narwhal-migrations 1"]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")] == ["length"]
        assert [k for k, v in metric(rr, "narwhal_migrations_total").items() if v] == ['cause="E06",decision="carry_on",worker="0"']
        assert mocks[0].requests()[-1]["route"] == "chat" and mocks[1].requests()[-1]["body"]["prompt"][-25:] == want_ids[:25]


def test_without_migration_the_break_is_an_error_event_as_before(mocks: list[RunningMock]) -> None:
    with router(mocks, max_attempts=0) as rr:
        st = sse(rr.url, body(40, mock=DROP))
        assert st.status == 200
        errors = [e for e in st.events if isinstance(e, dict) and "error" in e]
        assert errors and errors[-1]["error"]["code"] == "engine_stream_incomplete" or errors
        ids, _, _ = read(st)
        assert len(ids) == 25


def test_a_break_after_the_last_token_ends_as_a_finished_answer(mocks: list[RunningMock]) -> None:
    """Issue 40: the engine breaks after sending all max_tokens tokens (before its last
    event): nothing is left to generate, so the stream ends with finish_reason length and
    the usage chunk (G13), not an error event labelled placement_refused; class completed,
    and no other engine is asked."""
    want_ids, want_text = uninterrupted(40)
    with router(mocks, max_attempts=1) as rr:
        before = len(mocks[1].requests())
        st = sse(rr.url, body(40, mock={**DROP, "fault_after": 40}))
        assert st.status == 200 and st.done, st.body
        assert not [e for e in st.events if isinstance(e, dict) and "error" in e]
        ids, text, chunks = read(st)
        assert ids == want_ids and text == want_text
        assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")] == ["length"]
        usage = [c["usage"] for c in chunks if c.get("usage")]
        prompt = len(prompt_token_ids("chat", {"messages": MSGS}, 4.0))
        assert usage[-1] == {"prompt_tokens": prompt, "completion_tokens": 40, "total_tokens": prompt + 40}
        assert len({c["id"] for c in chunks}) == 1
        assert [k for k, v in metric(rr, "narwhal_migrations_total").items() if v] == ['cause="E06",decision="nothing_left",worker="0"']
        assert len(mocks[1].requests()) == before  # no continuation placed
        b = rr.balanced()
        assert b["terminal"].get("completed") == 1 and not b["terminal"].get("failed"), b  # the answer was whole


@pytest.mark.parametrize(("extra", "reason"), [
    ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "structured"),
])
def test_what_a_continuation_cannot_promise_is_not_migrated(mocks: list[RunningMock], extra: dict[str, Any], reason: str) -> None:
    with router(mocks, max_attempts=1) as rr:
        st = sse(rr.url, body(40, mock=DROP, **extra))
        assert st.status == 200
        assert any(isinstance(e, dict) and "error" in e for e in st.events)
        assert any(f'decision="{reason}"' in k for k in metric(rr, "narwhal_migrations_total"))


def test_a_continuation_that_breaks_again_spends_the_attempts_then_the_error_event(mocks: list[RunningMock]) -> None:
    # 60 tokens: the continuation breaks after its own 25th token, with tokens still left
    # (at 40 it would break after the answer's last token: G13, a finished answer)
    with router(mocks, max_attempts=1) as rr:
        st = sse(rr.url, body(60, mock={**DROP, "fault_engines": ["u0", "u1"]}))
        ids, _, _ = read(st)
        want, _ = uninterrupted(60)
        assert len(ids) > 25 and ids == want[: len(ids)]  # what was relayed is the answer's start: carried on once, never a repeat
        assert any(isinstance(e, dict) and "error" in e for e in st.events) and st.comments == []
        m = {k: v for k, v in metric(rr, "narwhal_migrations_total").items() if v}
        assert m == {'cause="E06",decision="carry_on",worker="0"': 1.0, 'cause="E06",decision="attempts_spent",worker="0"': 1.0}


def test_an_engines_error_event_mid_answer_is_carried_on(mocks: list[RunningMock]) -> None:
    want_ids, want_text = uninterrupted(40)
    with router(mocks, max_attempts=1) as rr:
        st = sse(rr.url, body(40, mock={**DROP, "fault": "error_event"}))
        ids, text, _ = read(st)
        assert ids == want_ids and text == want_text
        assert not any(isinstance(e, dict) and "error" in e for e in st.events)  # held back, never shown
        assert any(k.startswith('cause="E04",decision="carry_on"') for k, v in metric(rr, "narwhal_migrations_total").items() if v)
        b = rr.balanced()
        assert b["terminal"].get("completed") == 1 and not b["terminal"].get("failed"), b  # the answer was whole: completed


def test_an_engines_error_event_not_carried_on_reaches_the_client_as_before(mocks: list[RunningMock]) -> None:
    with router(mocks, max_attempts=1) as rr:
        st = sse(rr.url, body(40, mock={**DROP, "fault": "error_event"}, logprobs=True))
        assert st.done and isinstance(st.events[-1], dict) and "error" in st.events[-1]


def test_a_stop_string_begun_before_the_cut_is_not_carried_on(mocks: list[RunningMock]) -> None:
    _, text = uninterrupted(25)
    with router(mocks, max_attempts=1) as rr:
        st = sse(rr.url, body(40, mock=DROP, stop=[text[-3:] + "\u2603\u2603"]))
        assert any(isinstance(e, dict) and "error" in e for e in st.events)
        assert any('decision="stop_straddles"' in k for k, v in metric(rr, "narwhal_migrations_total").items() if v)


def test_a_migrated_request_is_one_offered_request_with_one_terminal_class(mocks: list[RunningMock]) -> None:
    with router(mocks, max_attempts=1) as rr:
        for _ in range(3):
            assert sse(rr.url, body(40, mock=DROP)).done
        offered = sum(metric(rr, "narwhal_requests_offered_total").values()) or sum(
            float(line.rsplit(" ", 1)[1]) for line in httpx.get(rr.url + "/metrics", timeout=5).text.splitlines() if line.startswith("narwhal_requests_offered_total "))
        terminal = {k: v for k, v in metric(rr, "narwhal_requests_terminal_total").items() if v}
        assert offered == 3 and terminal == {'class="completed"': 3.0}, (offered, terminal)


def test_pd_a_decode_engine_that_breaks_is_continued_by_a_direct_decode_on_another() -> None:
    """P/D: the continuation goes to another decode engine as a direct decode of the
    token-ID prompt (no new prefill leg: the decode engine prefills it itself)."""
    cfg = [MockConfig(dialect="vllm", role=role, model=MODEL, name=name, timing=Timing(time_scale=0.0), sequence_output=True)
           for role, name in (("prefill", "p0"), ("decode", "d0"), ("decode", "d1"))]
    want_ids, want_text = uninterrupted(40)
    with running_fleet(cfg) as ms:
        conf = {"admission": {"mode": "open", "prediction": {"profile_on_start": False}}, "monitoring": {"poll_interval_ms": 100},
                "upstream": {"migration": {"max_attempts": 1}}}
        with running_router(conf, [EngineSpec(m.config.name or "", m.url, m.config.role, "vllm", None, None) for m in ms]) as rr:
            st = sse(rr.url, body(40, mock={**DROP, "fault_engines": ["d0"]}))
            ids, text, _ = read(st)
            assert ids == want_ids and text == want_text and st.comments == ["x-narwhal-migrations 1"]
            assert len(ms[0].requests()) == 1  # one prefill leg only
            cont = ms[2].requests()[-1]["body"]
            assert cont["prompt"][-25:] == want_ids[:25] and "kv_transfer_params" not in cont


def test_drain_migrate_moves_running_answers_at_once_and_the_engine_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """discovery.drain: migrate (issue 24 item 3): DELETE an engine in the middle of three
    answers of ~3 s each; they are carried on by the other engine at once (each the
    uninterrupted answer), the engine is gone long before they end, nothing failed."""
    import threading
    import time

    from tests.helpers import wait_until

    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", "t0k3n-migrate")
    slow = Timing(tpot_base_ms=15.0)
    cfg = [MockConfig(dialect="vllm", role="unified", model=MODEL, name=f"u{i}", timing=slow, sequence_output=True) for i in range(2)]
    want_ids, _ = uninterrupted(200)
    with running_fleet(cfg) as ms:
        conf = {"admission": {"mode": "open", "prediction": {"profile_on_start": False}}, "monitoring": {"poll_interval_ms": 100, "stale_after_ms": 60000},
                "upstream": {"migration": {"max_attempts": 1}}, "discovery": {"drain": "migrate", "drain_timeout_ms": 30000}}
        with running_router(conf, [EngineSpec("u0", ms[0].url, "unified", "vllm", None, None)]) as rr:
            out: list[Any] = []
            ts = [threading.Thread(target=lambda: out.append(sse(rr.url, body(200)))) for _ in range(3)]
            for t in ts:
                t.start()
            wait_until(lambda: httpx.get(ms[0].url + "/mock/stats", timeout=2).json()["in_flight"] == 3, timeout=10, what="3 answers on u0")
            auth = {"authorization": "Bearer t0k3n-migrate"}
            assert httpx.put(f"{rr.url}/admin/engines/u1", json={"name": "u1", "url": ms[1].url, "role": "unified", "dialect": "vllm"}, headers=auth, timeout=10).status_code in (200, 201)
            wait_until(lambda: any(e["name"] == "u1" and e["lifecycle"]["state"] == "active" for e in rr.get("/v1/engines").json()["data"]), timeout=10, what="u1 active")
            time.sleep(0.3)  # a few tokens each: response headers are out
            t0 = time.monotonic()
            assert httpx.delete(f"{rr.url}/admin/engines/u0", headers=auth, timeout=10).json()["lifecycle"] == "draining"
            wait_until(lambda: all(e["name"] != "u0" for e in rr.get("/v1/engines").json()["data"]), timeout=10, what="u0 gone")
            gone_after = time.monotonic() - t0
            for t in ts:
                t.join(30)
            assert gone_after < 2.0, gone_after  # not the ~2.5 s the answers had left, nor the 30 s drain timeout
            for st in out:
                ids, _, _ = read(st)
                assert st.done and ids == want_ids and st.comments == ["x-narwhal-migrations 1"]
            b = rr.balanced()
            assert b["terminal"].get("failed", 0) == 0 and b["terminal"]["completed"] == 3


def test_a_continuation_frees_its_prefill_slot_at_its_first_token_so_the_next_break_is_carried_on_too() -> None:
    """phase_concurrency.prefill 1: the continuation of answer A takes u1's one prefill
    slot; at the continuation's first token the slot is free again (the scheduler's
    first_token), so answer B, broken later on u0, is carried on by u1 as well (not G10)."""
    from tests.helpers import wait_until

    slow = Timing(tpot_base_ms=10.0)
    cfg = [MockConfig(dialect="vllm", role="unified", model=MODEL, name=f"u{i}", timing=slow, sequence_output=True) for i in range(2)]
    with running_fleet(cfg) as ms:
        conf = {"admission": {"mode": "open", "phase_concurrency": {"prefill": 1}, "prediction": {"profile_on_start": False}},
                "monitoring": {"poll_interval_ms": 100}, "upstream": {"migration": {"max_attempts": 2}}}
        with running_router(conf, [EngineSpec(m.config.name or "", m.url, "unified", "vllm", None, None) for m in ms]) as rr:
            import threading

            out: list[Any] = []
            ta = threading.Thread(target=lambda: out.append(sse(rr.url, body(200, mock={**DROP, "fault_after": 20, "tpot_ms": 30}))))  # ~6 s
            ta.start()

            wait_until(lambda: httpx.get(ms[1].url + "/mock/stats", timeout=2).json()["in_flight"] == 1, timeout=10, what="A carried on by u1")
            # long before A ends (~5 s more): the continuation's first token freed the slot
            wait_until(lambda: {x["name"]: x for x in rr.get("/v1/engines").json()["data"]}["u1"]["load"]["prefill_in_use"] == 0, timeout=2, what="u1's prefill slot free")
            b = sse(rr.url, body(40, mock={**DROP, "fault_after": 10, "tpot_ms": 3}))
            ta.join(30)
            assert b.done and read(b)[0] == uninterrupted(40)[0] and b.comments == ["x-narwhal-migrations 1"]
            decisions = {k: v for k, v in metric(rr, "narwhal_migrations_total").items() if v}
            assert decisions == {'cause="E06",decision="carry_on",worker="0"': 2.0}, decisions


def test_with_no_free_slot_the_continuation_waits_for_one_instead_of_failing() -> None:
    """u1's one prefill slot is taken by a slow prefill (1.5 s) when A breaks on u0: the
    continuation waits in u1's queue until the slot frees and then carries A on (before:
    G10 placement_refused, the error event)."""
    import threading

    from tests.helpers import wait_until

    cfg = [MockConfig(dialect="vllm", role="unified", model=MODEL, name=f"u{i}", timing=Timing(time_scale=0.0), sequence_output=True) for i in range(2)]
    with running_fleet(cfg) as ms:
        conf = {"admission": {"mode": "open", "phase_concurrency": {"prefill": 1}, "prediction": {"profile_on_start": False}},
                "monitoring": {"poll_interval_ms": 100}, "upstream": {"migration": {"max_attempts": 1}}}
        with running_router(conf, [EngineSpec(m.config.name or "", m.url, "unified", "vllm", None, None) for m in ms]) as rr:
            out: list[Any] = []
            # A on u0 (both idle: the first in order), slow enough to still stream when B holds u1
            ta = threading.Thread(target=lambda: out.append(sse(rr.url, body(60, mock={**DROP, "fault_after": 30, "tpot_ms": 30}))))
            ta.start()
            wait_until(lambda: httpx.get(ms[0].url + "/mock/stats", timeout=2).json()["in_flight"] == 1, timeout=10, what="A on u0")
            tb = threading.Thread(target=lambda: sse(rr.url, body(4, mock={"prefill_ms": 1500})))
            tb.start()  # u0's slot is A's until its first token, then free: B may land on either, so wait for u1
            wait_until(lambda: httpx.get(ms[1].url + "/mock/stats", timeout=2).json()["in_flight"] == 1, timeout=10, what="B prefilling on u1")
            ta.join(30)
            tb.join(30)
            (st,) = out
            assert st.done and read(st)[0] == uninterrupted(60)[0] and st.comments == ["x-narwhal-migrations 1"]
            assert [k for k, v in metric(rr, "narwhal_migrations_total").items() if v] == ['cause="E06",decision="carry_on",worker="0"']
