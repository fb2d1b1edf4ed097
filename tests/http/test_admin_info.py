"""The admin API (token from admin.token_env, constant-time compare, off without a token),
/v1/models, /health, /ready, /v1/engines, /metrics, /openapi.json."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from narwhal_generated import errors as E
from tests.helpers import RunningRouter, running_router
from tests.http.test_rows_early import config, envelope

TOKEN_ENV = "NARWHAL_TEST_ADMIN_TOKEN"


@pytest.fixture(scope="module")
def rr() -> Iterator[RunningRouter]:
    os.environ[TOKEN_ENV] = "s3cret-token"
    cfg = config(admin={"token_env": TOKEN_ENV})
    cfg["engines"].append({"name": "u1", "url": cfg["engines"][0]["url"], "role": "unified", "wave": "x"})
    try:
        with running_router(cfg) as r:
            yield r
    finally:
        os.environ.pop(TOKEN_ENV, None)


AUTH = {"authorization": "Bearer s3cret-token"}


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret-token"}, {"authorization": "s3cret-token"}])
def test_H03_admin_refuses_missing_or_wrong_token(rr: RunningRouter, headers: dict[str, str]) -> None:
    r = rr.post("/admin/state", json={"state": "standby"}, headers=headers)
    envelope(r, E.H03)
    assert r.headers["www-authenticate"] == "Bearer"
    assert rr.get("/ready").json()["state"] == "active"


def test_admin_sets_standby_and_active(rr: RunningRouter) -> None:
    r = rr.post("/admin/state", json={"state": "standby"}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"ok": True, "state": "standby"}
    assert rr.get("/ready").status_code == 503
    envelope(rr.post("/v1/chat/completions", json={"model": "narwhal-demo", "messages": [{"role": "user", "content": "x"}]}), E.R01)
    assert rr.post("/admin/state", json={"state": "active"}, headers=AUTH).json()["state"] == "active"
    assert rr.get("/ready").status_code == 200


@pytest.mark.parametrize("body", [{"state": "fenced"}, {"state": 1}, {}, {"state": "active", "x": 1}, [1]])
def test_H04_admin_invalid_body(rr: RunningRouter, body: object) -> None:
    envelope(rr.post("/admin/state", json=body, headers=AUTH), E.H04)


def test_admin_drain_and_wave_maintenance_change_eligibility(rr: RunningRouter) -> None:
    def eng(name: str) -> dict[str, object]:
        return next(e for e in rr.get("/v1/engines").json()["data"] if e["name"] == name)

    assert rr.post("/admin/engines/u1/drain", json={"drain": True}, headers=AUTH).status_code == 200
    assert "draining" in eng("u1")["ineligible_reasons"] and eng("u1")["eligible"] is False
    rr.post("/admin/engines/u1/drain", json={"drain": False}, headers=AUTH)
    assert "draining" not in eng("u1")["ineligible_reasons"]
    assert rr.post("/admin/waves/x/maintenance", json={"maintenance": True}, headers=AUTH).status_code == 200
    assert "wave_maintenance" in eng("u1")["ineligible_reasons"]
    assert rr.get("/ready").status_code == 200  # another wave than the router's own
    rr.post("/admin/waves/x/maintenance", json={"maintenance": False}, headers=AUTH)
    # the router's own wave: whole-wave maintenance makes the router not ready (R01)
    rr.post("/admin/waves/w/maintenance", json={"maintenance": True}, headers=AUTH)
    assert rr.get("/ready").json()["reason"] == "maintenance"
    rr.post("/admin/waves/w/maintenance", json={"maintenance": False}, headers=AUTH)
    assert rr.get("/ready").status_code == 200


def test_H05_admin_unknown_targets(rr: RunningRouter) -> None:
    envelope(rr.post("/admin/engines/nope/drain", json={"drain": True}, headers=AUTH), E.H05)
    envelope(rr.post("/admin/waves/nope/maintenance", json={"maintenance": True}, headers=AUTH), E.H05)
    envelope(rr.post("/admin/engines/nope/profile", headers=AUTH), E.H05)


def test_H01_admin_off_without_a_token() -> None:
    with running_router(config(admin={"token_env": "NARWHAL_NO_SUCH_VARIABLE_SET"})) as r:
        envelope(r.post("/admin/state", json={"state": "standby"}, headers=AUTH), E.H01)


def test_models_health_openapi(rr: RunningRouter) -> None:
    m = rr.get("/v1/models").json()
    assert m["object"] == "list" and [x["id"] for x in m["data"]] == ["narwhal-demo"]
    assert rr.get("/health").json() == {"status": "ok"}
    doc = rr.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1") and "/v1/chat/completions" in doc["paths"]


def test_T12_engines_report_token_accounting_and_learned_state(rr: RunningRouter) -> None:
    data = rr.get("/v1/engines").json()
    assert data["object"] == "list"
    for e in data["data"]:
        assert e["token_accounting"] == "token_ids"  # vllm dialect (T12)
        for k in ("name", "role", "dialect", "wave", "healthy", "eligible", "ineligible_reasons", "profile", "drift", "output_length", "load"):
            assert k in e
        assert {"prefill", "decode"} <= set(e["profile"]) and {"prefill", "decode"} <= set(e["drift"])
    assert "scheduler" in data["router"] and "margin" in data["router"]["scheduler"]


def test_metrics_exposition(rr: RunningRouter) -> None:
    rr.post("/v1/chat/completions", json={"model": "x", "messages": [{"role": "user", "content": "x"}]})
    text = rr.get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("narwhal_requests_offered", "narwhal_requests_unsized_offered", "narwhal_requests_terminal", "narwhal_queue_depth", "narwhal_engine_inflight", "narwhal_ttft_seconds", "narwhal_tpot_seconds", "narwhal_engine_healthy", "narwhal_engine_drift_score"):
        assert name in fams, name
    classes = {s.labels["class"] for s in fams["narwhal_requests_terminal"].samples if s.name.endswith("_total")}
    assert classes == {"completed", "rejected", "refused", "invalid_requests", "expired", "unavailable", "failed", "cancelled"}
    offered = next(s.value for s in fams["narwhal_requests_offered"].samples if s.name.endswith("_total"))
    assert offered >= 1
