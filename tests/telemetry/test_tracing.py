"""Traces of a real router (one process) received by an in-test OTLP/HTTP receiver: span
names and tree, the request id, admission's row on a refusal, the legs of a P/D request
and a retry, traceparent to the engines and a client's honoured, sampling 0 and the
drop counter of a full exporter queue."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from narwhal.config import ConfigError, parse_config
from narwhal.upstream.engines import EngineSpec
from narwhal_generated import errors as E
from tests.helpers import running_router, wait_until
from tests.telemetry.fleet import Recorded, recorded_fleet
from tests.telemetry.otlp import Span, receiver

MODEL = "narwhal-demo"
TP = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-0[13]$")  # sampled (0x02: a random trace id)


def config(endpoint: str | None, ratio: float = 1.0, **obs: Any) -> dict[str, Any]:
    o: dict[str, Any] = {"otlp_endpoint": endpoint, "sample_ratio": ratio, "schedule_delay_ms": 20, **obs}
    return {
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
        "monitoring": {"poll_interval_ms": 200, "stale_after_ms": 60000, "breaker_failures": 1000},
        "upstream": {"idle_timeout_ms": 3000},
        "observability": o,
    }


def chat(content: str = "hello", *, stream: bool = False, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": stream, **kw}


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[list[EngineSpec], dict[str, Recorded]]]:
    with recorded_fleet([("p0", "prefill"), ("d0", "decode"), ("d1", "decode")]) as (mocks, rec):
        yield [EngineSpec(m.name, m.url, m.config.role, "vllm", None, None) for m in mocks], rec


def tree(spans: list[Span], rid: str) -> tuple[Span, list[Span]]:
    """The request's root span and every span of its trace."""
    root = next(s for s in spans if s.name == "narwhal.request" and s.attrs.get("narwhal.request_id") == rid)
    return root, [s for s in spans if s.trace_id == root.trace_id]


def has_root(rid: str) -> Any:
    return lambda spans: any(s.name == "narwhal.request" and s.attrs.get("narwhal.request_id") == rid for s in spans)


def metric(text: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_a_pd_request_is_one_trace_with_admission_and_both_legs(fleet: Any) -> None:
    specs, rec = fleet
    with pytest.raises(ConfigError, match="otlp_endpoint"):  # traces need somewhere to go
        parse_config(config(None))
    with receiver() as otlp, running_router(config(otlp.endpoint), specs) as rr:
        for r in rec.values():
            r.seen.clear()
        got = httpx.post(rr.url + "/v1/chat/completions", json=chat(stream=True), headers={"x-request-id": "trace-pd-1"}, timeout=30)
        assert got.status_code == 200, got.text
        spans = otlp.wait_spans(has_root("trace-pd-1"))
        root, mine = tree(spans, "trace-pd-1")
        assert otlp.paths and all(p == "/v1/traces" for p in otlp.paths)
        assert root.parent_id == "" and root.kind == 2  # SERVER, a new trace
        assert root.attrs["narwhal.class"] == "completed" and root.attrs["http.response.status_code"] == 200
        assert root.attrs["narwhal.engines"] == ["p0", "d0"] or root.attrs["narwhal.engines"] == ["p0", "d1"]
        assert root.resource["service.name"] == "narwhal"
        by = {s.name: s for s in mine}
        assert set(by) == {"narwhal.request", "narwhal.admission", "narwhal.prefill", "narwhal.decode", "narwhal.relay"}
        adm, pre, dec, rel = by["narwhal.admission"], by["narwhal.prefill"], by["narwhal.decode"], by["narwhal.relay"]
        for s in (adm, pre, dec):
            assert s.parent_id == root.span_id
        assert rel.parent_id == dec.span_id
        assert adm.attrs["narwhal.admission.decision"] == "granted"
        assert adm.attrs["narwhal.admission.engine"] == "p0" and adm.attrs["narwhal.admission.phase"] == "prefill"
        assert adm.attrs["narwhal.admission.placement"] == "least loaded" and "narwhal.admission.queue_wait_ms" in adm.attrs
        assert pre.attrs["narwhal.engine"] == "p0" and pre.kind == 3  # CLIENT
        assert dec.attrs["narwhal.phase"] == "decode" and dec.attrs["narwhal.attempt"] == 1
        assert rel.events == ["first_token"] and rel.attrs["narwhal.output_tokens"] == 16
        assert rel.attrs["narwhal.finish_reason"] == "stop" and rel.attrs["narwhal.class"] == "completed"
        # the engines got the leg's own span as their parent
        tp_p = [tp for path, tp, rid in rec["p0"].seen if rid == "trace-pd-1"]
        tp_d = [tp for n in ("d0", "d1") for path, tp, _ in rec[n].seen]
        assert len(tp_p) == 1 and len(tp_d) == 1
        mp, md = TP.match(tp_p[0] or ""), TP.match(tp_d[0] or "")
        assert mp and md, (tp_p, tp_d)
        assert mp.group(1) == md.group(1) == root.trace_id
        assert mp.group(2) == pre.span_id and md.group(2) == dec.span_id


def test_a_client_traceparent_is_the_parent_and_a_non_streaming_answer_is_assembled(fleet: Any) -> None:
    specs, rec = fleet
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with receiver() as otlp, running_router(config(otlp.endpoint), specs) as rr:
        got = httpx.post(rr.url + "/v1/chat/completions", json=chat(), timeout=30,
                         headers={"x-request-id": "trace-client-1", "traceparent": f"00-{client_trace}-{client_span}-01", "tracestate": "vendor=abc"})
        assert got.status_code == 200, got.text
        assert rec["p0"].states["trace-client-1"] == "vendor=abc"  # passed on with the router's traceparent
        root, mine = tree(otlp.wait_spans(has_root("trace-client-1")), "trace-client-1")
        assert root.trace_id == client_trace and root.parent_id == client_span
        names = sorted(s.name for s in mine)
        assert names == sorted(["narwhal.request", "narwhal.admission", "narwhal.prefill", "narwhal.decode", "narwhal.assembly"])
        assert root.attrs["narwhal.stream"] is False


def test_a_retry_is_a_second_decode_leg(fleet: Any) -> None:
    specs, rec = fleet
    with receiver() as otlp, running_router(config(otlp.endpoint), specs) as rr:
        # whichever decode engine is chosen first fails before streaming (E04): the retry goes to the other
        body = chat(stream=True, mock={"fault": "error_before", "fault_engines": ["d0"]})
        for i in range(4):  # until one request met d0 first
            rid = f"trace-retry-{i}"
            got = httpx.post(rr.url + "/v1/chat/completions", json=body, headers={"x-request-id": rid}, timeout=30)
            assert got.status_code == 200, got.text
            root, mine = tree(otlp.wait_spans(has_root(rid)), rid)
            decs = sorted((s for s in mine if s.name == "narwhal.decode"), key=lambda s: s.attrs["narwhal.attempt"])
            if len(decs) == 2:
                break
        else:
            pytest.skip("the decode engine that fails was never chosen first")
        first, second = decs
        assert first.attrs["narwhal.engine"] == "d0" and first.status == 2 and first.attrs["narwhal.row"] == "E04"
        assert second.attrs["narwhal.engine"] == "d1" and second.attrs["narwhal.retry"] is True and second.status != 2
        assert root.attrs["narwhal.retries"] == 1 and root.attrs["narwhal.engines"] == ["p0", "d0", "d1"]


def test_a_refused_request_has_the_row_on_its_admission_span(fleet: Any) -> None:
    specs, rec = fleet
    cfg = config(None)
    cfg["admission"] = {"mode": "predictive", "prediction": {"profile_on_start": False}}
    with receiver() as otlp:
        cfg["observability"]["otlp_endpoint"] = otlp.endpoint
        with running_router(cfg, specs) as rr:
            got = httpx.post(rr.url + "/v1/chat/completions", json=chat("x " * 2000), timeout=30,
                             headers={"x-request-id": "trace-refused-1", "x-narwhal-ttft-target-ms": "1"})
            assert got.status_code == 429, got.text
            row = next(r for r in E.ROWS.values() if r.code == got.json()["error"]["code"])
            root, mine = tree(otlp.wait_spans(has_root("trace-refused-1")), "trace-refused-1")
            adm = next(s for s in mine if s.name == "narwhal.admission")
            assert adm.attrs["narwhal.admission.decision"] == "refused"
            assert adm.attrs["narwhal.row"] == row.id and adm.attrs["narwhal.code"] == row.code
            assert root.attrs["narwhal.row"] == row.id and root.attrs["http.response.status_code"] == 429
            assert not any(s.name in ("narwhal.prefill", "narwhal.decode") for s in mine)


def test_sampling_0_makes_no_spans_and_passes_the_clients_traceparent_on(fleet: Any) -> None:
    specs, rec = fleet
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with receiver() as otlp, running_router(config(otlp.endpoint, ratio=0.0), specs) as rr:
        for r in rec.values():
            r.seen.clear()
        for i in range(5):
            got = httpx.post(rr.url + "/v1/chat/completions", json=chat(), headers={"x-request-id": f"trace-off-{i}", "traceparent": tp}, timeout=30)
            assert got.status_code == 200
        seen = [t for n in ("p0", "d0", "d1") for _, t, _ in rec[n].seen]
        assert seen and all(t == tp for t in seen)  # a router that does not trace passes it on unchanged
    assert otlp.requests == 0 and otlp.snapshot() == []


def test_a_clients_sampled_flag_is_honoured_only_up_to_its_rate(fleet: Any) -> None:
    """sample_ratio tiny: the client's sampled flag is what traces, at most
    client_sampled_per_s per process (burst at least 1): at 0.01/s the first of 8
    client-sampled requests is traced, the next token would take 100 s."""
    specs, rec = fleet
    with receiver() as otlp, running_router(config(otlp.endpoint, ratio=1e-9, client_sampled_per_s=0.01), specs) as rr:
        for i in range(8):
            tp = f"00-{i + 1:032x}-{i + 1:016x}-01"
            got = httpx.post(rr.url + "/v1/chat/completions", json=chat(), headers={"x-request-id": f"trace-cap-{i}", "traceparent": tp}, timeout=30)
            assert got.status_code == 200
        got = httpx.post(rr.url + "/v1/chat/completions", json=chat(), headers={"x-request-id": "trace-cap-last"}, timeout=30)
        otlp.wait_spans(has_root("trace-cap-0"))
    roots = [s for s in otlp.snapshot() if s.name == "narwhal.request"]  # the router has stopped: everything flushed
    assert [s.attrs["narwhal.request_id"] for s in roots] == ["trace-cap-0"]
    assert roots[0].trace_id == f"{1:032x}" and roots[0].parent_id == f"{1:016x}"


def test_a_full_exporter_queue_drops_spans_and_counts_them(fleet: Any) -> None:
    specs, rec = fleet
    with receiver(hang=True) as otlp, running_router(config(otlp.endpoint, max_queue_size=2, max_export_batch_size=1, export_timeout_ms=20000), specs) as rr:
        for i in range(6):
            got = httpx.post(rr.url + "/v1/chat/completions", json=chat(stream=True), headers={"x-request-id": f"trace-drop-{i}"}, timeout=30)
            assert got.status_code == 200  # the relay is not held up by an exporter that never answers

        def dropped() -> float:
            return metric(httpx.get(rr.url + "/metrics", timeout=10).text, "narwhal_trace_spans_dropped_total")

        # 6 requests x 5 spans; the exporter holds one batch, the queue two: the rest dropped
        n = wait_until(lambda: dropped() or None, timeout=10, what="dropped spans counted")
        assert n >= 6 * 5 - 1 - 2 - 1
        assert otlp.requests == 0


def test_json_logs_without_tracing_name_the_clients_trace(fleet: Any, caplog: pytest.LogCaptureFixture) -> None:
    """serving.log_format json, tracing off: a request_end per request, sampled false, the
    trace id the client's traceparent names (null without one)."""
    specs, rec = fleet
    cfg = config(None, ratio=0.0)
    cfg["serving"] = {"log_format": "json"}
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with caplog.at_level(logging.INFO, logger="narwhal.request"), running_router(cfg, specs) as rr:
        assert httpx.post(rr.url + "/v1/chat/completions", json=chat(), headers={"x-request-id": "json-1", "traceparent": tp}, timeout=30).status_code == 200
        assert httpx.post(rr.url + "/v1/chat/completions", json=chat(stream=True), headers={"x-request-id": "json-2"}, timeout=30).status_code == 200
        rr.balanced()
    ends = {r.narwhal_event[1]["request_id"]: r.narwhal_event[1] for r in caplog.records if getattr(r, "narwhal_event", ("",))[0] == "request_end"}
    assert set(ends) == {"json-1", "json-2"}
    assert ends["json-1"]["trace_id"] == "0af7651916cd43dd8448eb211c80319c" and ends["json-1"]["sampled"] is False
    assert ends["json-2"]["trace_id"] is None and ends["json-2"]["class"] == "completed" and ends["json-2"]["engines"][0] == "p0"
