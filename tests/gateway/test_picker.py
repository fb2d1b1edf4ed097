"""The gRPC shell of `gateway.listen` without Envoy: `narwhal serve` as a subprocess, a gRPC
client in Envoy's place. Health follows readiness (an active router SERVING, a standby
NOT_SERVING); a grant is the destination header and the same value in `envoy.lb`; a stream
Envoy abandons after the grant ends in class cancelled with its slot freed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from narwhal.gateway.decide import DESTINATION, SERVICE, SUBSET, SUBSET_NAMESPACE
from narwhal.gateway.protos import METHOD
from narwhal.gateway.protos import core as base_pb2
from narwhal.gateway.protos import ext_proc as pb
from narwhal.mock import MockConfig, RunningMock, Timing, running_fleet
from narwhal_generated import errors as E
from tests.gateway.harness import Picker, picker, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pool() -> Iterator[list[RunningMock]]:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0", timing=Timing(time_scale=0.25))]) as mocks:
        yield mocks


@pytest.fixture(scope="module")
def narwhal(pool: list[RunningMock]) -> Iterator[Picker]:
    with picker([{"name": m.name, "url": m.url, "role": "unified", "dialect": "vllm"} for m in pool]) as p:
        yield p


def _health(epp: str, service: str) -> int:
    with grpc.insecure_channel(epp) as ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


def test_health_is_serving_only_while_active(narwhal: Picker) -> None:
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert _health(narwhal.epp, SERVICE) == serving
    assert _health(narwhal.epp, "") == serving
    narwhal.set_state("standby")
    try:
        wait_for(lambda: _health(narwhal.epp, SERVICE) == not_serving, 10, "NOT_SERVING on a standby")
        assert _health(narwhal.epp, "") == serving  # liveness: the process runs
    finally:
        narwhal.set_state("active")
    wait_for(lambda: _health(narwhal.epp, SERVICE) == serving, 10, "SERVING again once active")


def _headers(**h: str) -> Any:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in h.items()]))


def _process(ch: Any) -> Any:
    """Envoy's side of one ext_proc stream."""
    return ch.stream_stream(METHOD, request_serializer=pb.ProcessingRequest.SerializeToString, response_deserializer=pb.ProcessingResponse.FromString)()


def _subset_hint(subset: list[str] | None) -> Any:
    if subset is None:
        return None
    meta = base_pb2.Metadata()
    meta.filter_metadata[SUBSET_NAMESPACE].update({SUBSET: subset})
    return meta


async def _grant_then_abandon(epp: str, body: dict[str, Any], subset: list[str] | None = None) -> tuple[Any, Any]:
    """Envoy's first two messages, the picker's first two answers read, then the stream
    cancelled (an answer that is an ImmediateResponse ends the stream: the second is None)."""
    raw = orjson.dumps(body)
    async with grpc.aio.insecure_channel(epp) as ch:
        call = _process(ch)
        await call.write(pb.ProcessingRequest(request_headers=_headers(**{":path": "/v1/chat/completions", ":method": "POST",
                                                                          "content-length": str(len(raw))}),
                                              metadata_context=_subset_hint(subset)))
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True)))
        head = await call.read()
        first = None if head.HasField("immediate_response") else await call.read()
        call.cancel()  # Envoy (or its client) goes away before the response
        return head, first


def test_a_grant_names_the_engine_twice_and_an_abandoned_stream_is_cancelled(narwhal: Picker, pool: list[RunningMock]) -> None:
    before = narwhal.at_rest()
    body = {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    head, first = asyncio.run(_grant_then_abandon(narwhal.epp, body))
    endpoint = pool[0].url.split("://", 1)[1]
    set_headers = {h.header.key: h.header.raw_value for h in head.request_headers.response.header_mutation.set_headers}
    assert set_headers[DESTINATION] == endpoint.encode()
    assert head.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value == endpoint
    forwarded = first.request_body.response.body_mutation.streamed_response
    assert forwarded.end_of_stream
    sent = orjson.loads(forwarded.body)
    assert sent["stream"] is True and sent["return_token_ids"] is True and sent["stream_options"] == {"include_usage": True}  # T01
    after = narwhal.at_rest()
    assert after["offered"] == before["offered"] + 1
    assert after["terminal"]["cancelled"] == before["terminal"]["cancelled"] + 1


@pytest.mark.parametrize(("inside", "status"), [(True, None), (False, 503)])
def test_the_subset_hint_is_honoured_R09_when_it_names_no_engine(narwhal: Picker, pool: list[RunningMock], inside: bool, status: int | None) -> None:
    before = narwhal.at_rest()
    endpoint = pool[0].url.split("://", 1)[1]
    subset = [endpoint, "10.9.9.9:8000"] if inside else ["10.9.9.9:8000"]
    head, _ = asyncio.run(_grant_then_abandon(narwhal.epp, {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, subset))
    if status is None:
        named = {h.header.key: h.header.raw_value for h in head.request_headers.response.header_mutation.set_headers}[DESTINATION]
        assert named == endpoint.encode()
    else:
        im = head.immediate_response
        assert im.status.code == status == E.R09.status
        assert orjson.loads(im.body)["error"]["code"] == E.R09.code
        assert {h.header.key: h.header.raw_value for h in im.headers.set_headers}["content-type"] == b"application/json"
    after = narwhal.at_rest()
    assert after["offered"] == before["offered"] + 1
    cls = "cancelled" if status is None else E.R09.counter
    assert after["terminal"][cls] == before["terminal"][cls] + 1


async def _headers_only_then_wait(epp: str, wait_s: float) -> None:
    async with grpc.aio.insecure_channel(epp) as ch:
        call = _process(ch)
        await call.write(pb.ProcessingRequest(request_headers=_headers(**{":path": "/v1/chat/completions", ":method": "POST"})))
        await asyncio.sleep(wait_s)  # the body never comes
        call.cancel()


async def _second_while_first_open(epp: str) -> Any:
    """A second ext_proc stream, on another connection (on the same one it would wait for
    the connection's max_concurrent_streams), while the first waits for its body: the
    second's status."""
    async with grpc.aio.insecure_channel(epp) as ch, grpc.aio.insecure_channel(epp, options=[("grpc.use_local_subchannel_pool", 1)]) as ch2:
        first = _process(ch)
        await first.write(pb.ProcessingRequest(request_headers=_headers(**{":path": "/v1/chat/completions", ":method": "POST"})))
        await asyncio.sleep(0.05)
        # the second call is refused as it starts (its head alone reaches the server's
        # limit check); a message written after that races the refusal and may end the
        # call on the client's side instead (INTERNAL), so none is written
        second = _process(ch2)
        code = await asyncio.wait_for(second.code(), 5)
        first.cancel()
        return code


def test_stream_idle_ms_and_max_streams_bound_the_picker(pool: list[RunningMock]) -> None:
    engines = [{"name": m.name, "url": m.url, "role": "unified", "dialect": "vllm"} for m in pool]
    with picker(engines, {"gateway": {"stream_idle_ms": 1000, "max_streams": 1}}) as p:
        before = p.at_rest()
        asyncio.run(_headers_only_then_wait(p.epp, 2.5))
        after = p.at_rest()
        # gateway.stream_idle_ms: nothing heard for 1 s ends the stream, class cancelled, nothing held
        assert after["offered"] == before["offered"] + 1 and after["terminal"]["cancelled"] == before["terminal"]["cancelled"] + 1
        assert asyncio.run(_second_while_first_open(p.epp)) == grpc.StatusCode.RESOURCE_EXHAUSTED  # gateway.max_streams: 1


def test_gateway_needs_one_worker(tmp_path: Any) -> None:
    import subprocess
    import sys

    import yaml

    cfg = tmp_path / "n.yaml"
    cfg.write_text(yaml.safe_dump({"serving": {"workers": 2, "listen": "127.0.0.1:0"}, "gateway": {"listen": "127.0.0.1:0"},
                                   "engines": [{"name": "u0", "url": "http://127.0.0.1:9", "role": "unified", "dialect": "vllm"}]}))
    p = subprocess.run([sys.executable, "-m", "narwhal.cli", "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "gateway.listen needs serving.workers: 1" in p.stderr
