"""Attack: a client steers engines with request fields — kv_transfer_params (remote host,
port and block IDs of a KV transfer), the engine-side request ID (vLLM's request_id,
SGLang's rid: collide with another request's, or name one in a KV transfer), priority,
vllm_xargs, logits_processors — which reached unified engines verbatim. Defence, the
pass-through policy (docs/passthrough.md): router-only fields are removed from every
client body on every leg and role (the router sets kv_transfer_params itself on P/D
legs), and upstream.deny_fields removes the others an operator names. Removal is silent;
every other field still passes through."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.config import ConfigError, parse_config
from narwhal.core.dialects import PREFILL_KV_REQUEST
from narwhal.core.requests import ROUTER_ONLY
from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from narwhal.worker.plane import ENGINE_REQUEST_IDS
from tests.helpers import RunningRouter, running_router, sse

FAST = Timing(time_scale=0.25)
EVIL_KV = {"do_remote_prefill": True, "remote_host": "203.0.113.9", "remote_port": 1, "remote_block_ids": [1, 2, 3], "remote_engine_id": "x"}
STEERING = {
    "kv_transfer_params": EVIL_KV,
    "bootstrap_host": "203.0.113.9", "bootstrap_port": 1, "bootstrap_room": 7,
    "request_id": "chatcmpl-someone-elses", "rid": "someone-elses",
    "priority": -100, "vllm_xargs": {"a": 1}, "logits_processors": ["os.system"], "custom_logit_processor": "gASV",
}
KEPT = {"cache_salt": "tenant-7", "my_extension": {"k": [1, 2]}, "temperature": 0.5}
DEFAULT_DENY = ("priority", "vllm_xargs", "logits_processors", "custom_logit_processor")
# every field only the router may set: the client-side list and the engine-side IDs
ALL_ROUTER_ONLY = frozenset(ROUTER_ONLY) | ENGINE_REQUEST_IDS


def config(**upstream: Any) -> dict[str, Any]:
    return {
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
        "monitoring": {"poll_interval_ms": 200, "stale_after_ms": 60000, "breaker_failures": 1000},
        "upstream": upstream,
    }


def chat(rid: str, **kw: Any) -> dict[str, Any]:
    return {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "user": rid, **STEERING, **KEPT, **kw}


def bodies(mocks: list[Any], rid: str) -> list[dict[str, Any]]:
    """The bodies the engines received for one request (marked by its `user` field)."""
    return [x["body"] for m in mocks for x in m.requests() if isinstance(x["body"], dict) and x["body"].get("user") == rid]


@pytest.fixture(scope="module", params=["vllm", "sglang", "openai"])
def unified(request: pytest.FixtureRequest) -> Iterator[tuple[RunningRouter, list[Any]]]:
    d = request.param
    with running_fleet([MockConfig(dialect=d, role="unified", name="u0", timing=FAST)]) as mocks, running_router(config(), [EngineSpec("u0", mocks[0].url, "unified", d, None, None)]) as rr:
        yield rr, mocks


@pytest.mark.parametrize("stream", [False, True])
def test_unified_engines_never_see_router_only_or_denied_fields(unified: tuple[RunningRouter, list[Any]], stream: bool) -> None:
    rr, mocks = unified
    rid = f"pass-u-{stream}"
    if stream:
        s = sse(rr.url, chat(rid, stream=True), headers={"x-request-id": rid})
        assert s.status == 200 and s.done and not s.errors
    else:
        r = rr.post("/v1/chat/completions", json=chat(rid), headers={"x-request-id": rid})
        assert r.status_code == 200, r.text
    (b,) = bodies(mocks, rid)
    assert not ALL_ROUTER_ONLY & set(b) and not set(DEFAULT_DENY) & set(b), sorted(b)
    assert not {"request_id", "rid"} & set(b), sorted(b)
    assert {k: b.get(k) for k in KEPT} == KEPT  # everything else passes through


def test_pd_legs_carry_the_routers_kv_transfer_params_only() -> None:
    cfgs = [MockConfig(dialect="vllm", role="prefill", name="p0", timing=FAST), MockConfig(dialect="vllm", role="decode", name="d0", timing=FAST)]
    with running_fleet(cfgs) as mocks:
        specs = [EngineSpec(m.name, m.url, m.config.role, "vllm", None, None) for m in mocks]
        with running_router(config(), specs) as rr:
            for stream in (False, True):
                rid = f"pass-pd-{stream}"
                if stream:
                    s = sse(rr.url, chat(rid, stream=True), headers={"x-request-id": rid})
                    assert s.status == 200 and s.done and not s.errors
                else:
                    r = rr.post("/v1/chat/completions", json=chat(rid), headers={"x-request-id": rid})
                    assert r.status_code == 200, r.text
                (p,) = bodies(mocks[:1], rid)
                (d,) = bodies(mocks[1:], rid)
                assert p["kv_transfer_params"] == PREFILL_KV_REQUEST
                kv = d["kv_transfer_params"]
                assert kv["do_remote_prefill"] is True and kv["remote_host"] != EVIL_KV["remote_host"] and kv["remote_block_ids"] != EVIL_KV["remote_block_ids"]
                for leg in (p, d):
                    assert not {"bootstrap_host", "bootstrap_port", "bootstrap_room", "request_id", "rid", *DEFAULT_DENY} & set(leg)
                    assert leg["cache_salt"] == KEPT["cache_salt"] and leg["my_extension"] == KEPT["my_extension"]
            rr.balanced()


def test_the_deny_list_is_the_operators() -> None:
    """deny_fields [] forwards priority and the rest; router-only fields stay removed.
    A field the operator adds (cache_salt) is removed."""
    cfgs = [MockConfig(dialect="vllm", role="unified", name="u0", timing=FAST)]
    with running_fleet(cfgs) as mocks:
        spec = [EngineSpec("u0", mocks[0].url, "unified", "vllm", None, None)]
        with running_router(config(deny_fields=[]), spec) as rr:
            assert rr.post("/v1/chat/completions", json=chat("d-none"), headers={"x-request-id": "d-none"}).status_code == 200
        with running_router(config(deny_fields=["cache_salt"]), spec) as rr:
            assert rr.post("/v1/chat/completions", json=chat("d-salt"), headers={"x-request-id": "d-salt"}).status_code == 200
        (none,) = bodies(mocks, "d-none")
        (salt,) = bodies(mocks, "d-salt")
        assert {k: none[k] for k in DEFAULT_DENY} == {k: STEERING[k] for k in DEFAULT_DENY}
        assert not ALL_ROUTER_ONLY & set(none) and not ALL_ROUTER_ONLY & set(salt)
        assert "cache_salt" not in salt and salt["priority"] == STEERING["priority"]


@pytest.mark.parametrize(("deny", "why"), [(["model"], "cannot forward"), (["messages"], "cannot forward"), (["priority", "priority"], "twice"), ([""], "not a field name")])
def test_a_deny_list_that_breaks_forwarding_is_a_config_error(deny: list[str], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        parse_config({"upstream": {"deny_fields": deny}})
