"""Rows R01-R07 over real HTTP (hypercorn), decided without any engine call: the fleet
here is one engine on a dead port, so a row that reached an engine would fail differently."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from narwhal_generated import errors as E
from tests.helpers import RunningRouter, running_router, wait_until

CHAT = {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hi"}]}


def dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def config(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "serving": {"max_request_bytes": 4096, "wave": "w"},
        "admission": {"prediction": {"profile_on_start": False}},
        "engines": [{"name": "u0", "url": f"http://127.0.0.1:{dead_port()}", "role": "unified", "wave": "w"}],
        "monitoring": {"poll_interval_ms": 60000, "stale_after_ms": 600000},
    }
    for k, v in over.items():
        cfg.setdefault(k, {}).update(v)
    return cfg


@pytest.fixture(scope="module")
def rr() -> Iterator[RunningRouter]:
    with running_router(config()) as r:
        yield r


def envelope(resp: httpx.Response, row: E.ErrorRow) -> dict[str, Any]:
    assert resp.status_code == row.status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["code"]) == (row.type, row.code)
    assert resp.headers.get("x-request-id")
    return body["error"]


def test_R03_body_over_the_limit_by_content_length(rr: RunningRouter) -> None:
    big = {**CHAT, "pad": "x" * 5000}
    err = envelope(rr.post("/v1/chat/completions", json=big), E.R03)
    assert "4096" in err["message"]


def test_R03_chunked_body_stops_reading_past_the_limit(rr: RunningRouter) -> None:
    sent = 0

    def gen() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"model": "narwhal-demo", "pad": "'
        for _ in range(10_000):  # 10 MB offered; the router stops reading after 4 KB
            sent += 1
            yield b"x" * 1024
        yield b'"}'

    try:
        r = httpx.post(rr.url + "/v1/chat/completions", content=gen(), timeout=30)
        envelope(r, E.R03)
    except httpx.HTTPError:
        pass  # the router may close the connection while we still send: that is the point
    assert sent < 10_000


@pytest.mark.parametrize(
    ("body", "param"),
    [(b"{not json", None), (b"[]", None), ({"messages": [{"role": "user", "content": "x"}]}, "model"), ({**CHAT, "stream": "yes"}, "stream"), ({**CHAT, "messages": [{"role": "user", "content": 1}]}, "messages[0].content")],
)
def test_R04_invalid_request_names_param(rr: RunningRouter, body: Any, param: str | None) -> None:
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    err = envelope(httpx.post(rr.url + "/v1/chat/completions", timeout=10, **kw), E.R04)
    assert err["param"] == param


def test_R04_bad_router_header(rr: RunningRouter) -> None:
    err = envelope(rr.post("/v1/chat/completions", json=CHAT, headers={"x-narwhal-deadline-ms": "soon"}), E.R04)
    assert err["param"] == "x-narwhal-deadline-ms"


def test_R05_model_not_found(rr: RunningRouter) -> None:
    err = envelope(rr.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), E.R05)
    assert err["param"] == "model"


def test_R06_invalid_sampling_width(rr: RunningRouter) -> None:
    err = envelope(rr.post("/v1/chat/completions", json={**CHAT, "n": 2}), E.R06)
    assert (err["param"], err["message"]) == ("n", "Invalid sampling width")
    err = envelope(rr.post("/v1/completions", json={"model": "narwhal-demo", "prompt": "x", "best_of": 2}), E.R06)
    assert err["param"] == "best_of"


@pytest.mark.parametrize(("extra", "param"), [({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {"voice": "alloy"}}, "audio"), ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type")])
def test_R07_unsupported_option(rr: RunningRouter, extra: dict[str, Any], param: str) -> None:
    err = envelope(rr.post("/v1/chat/completions", json={**CHAT, **extra}), E.R07)
    assert err["param"] == param


def test_rows_count_into_their_classes_and_unsized(rr: RunningRouter) -> None:
    before = rr.books()
    rr.post("/v1/chat/completions", json={**CHAT, "n": 3})
    b = rr.balanced()
    assert b["terminal"]["invalid_requests"] == before["terminal"]["invalid_requests"] + 1
    assert b["unsized_offered"] == before["unsized_offered"] + 1
    assert b["offered"] == before["offered"] + 1


def test_x_request_id_is_propagated(rr: RunningRouter) -> None:
    r = rr.post("/v1/chat/completions", json={**CHAT, "n": 2}, headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"


def test_x_request_id_is_generated_when_absent_as_a_uuid4(rr: RunningRouter) -> None:
    import uuid

    from narwhal.http.completions import new_request_id

    ids = {new_request_id() for _ in range(2000)}
    assert len(ids) == 2000
    for x in ids:  # uuid.uuid4().hex's form: 32 lower-case hex digits, version 4, RFC 4122 variant
        u = uuid.UUID(hex=x)
        assert u.hex == x and u.version == 4 and u.variant == uuid.RFC_4122
    # every bit but the six fixed ones varies
    fixed = ~0
    for x in ids:
        fixed &= ~(int(x, 16) ^ int(next(iter(ids)), 16))
    assert bin(fixed & ((1 << 128) - 1)).count("1") == 6
    r = rr.post("/v1/chat/completions", json={**CHAT, "n": 2})
    u = uuid.UUID(hex=r.headers["x-request-id"])
    assert u.version == 4 and u.hex == r.headers["x-request-id"]


def test_H01_H02_unknown_routes_and_methods(rr: RunningRouter) -> None:
    envelope(rr.get("/v2/nothing"), E.H01)
    envelope(rr.get("/v1/chat/completions"), E.H02)
    envelope(rr.post("/v1/models"), E.H02)


def test_R01_standby_answers_before_reading_the_body() -> None:
    with running_router(config()) as r:
        r.call(r.router.state.set_operator, "standby")
        resp = r.post("/v1/chat/completions", json={**CHAT, "n": 5})  # R06 too, but R01 first
        err = envelope(resp, E.R01)
        assert resp.headers["retry-after"] == "1" and "standby" in err["message"]
        ready = r.get("/ready")
        assert ready.status_code == 503 and ready.json() == {"ready": False, "state": "standby", "reason": "standby"}
        r.call(r.router.state.set_operator, "active")
        assert r.get("/ready").json() == {"ready": True, "state": "active"}


def test_R01_monitoring_degraded() -> None:
    cfg = config(monitoring={"poll_interval_ms": 60000, "stale_after_ms": 300})
    with running_router(cfg) as r:
        wait_until(lambda: r.get("/ready").status_code == 503, timeout=10, what="health data to go stale")
        assert r.get("/ready").json()["reason"] == "monitoring_degraded"
        err = envelope(r.post("/v1/chat/completions", json=CHAT), E.R01)
        assert "monitoring_degraded" in err["message"]
        r.balanced()


def test_R01_whole_wave_maintenance() -> None:
    with running_router(config()) as r:
        r.call(r.router.state.set_wave_maintenance, "w", True)
        envelope(r.post("/v1/chat/completions", json=CHAT), E.R01)
        assert r.get("/ready").json()["reason"] == "maintenance"


def test_R02_retention_limit_full() -> None:
    cfg = config(admission={"http_retention_limit": 1, "prediction": {"profile_on_start": False}})
    with running_router(cfg) as r:
        r.call(lambda: setattr(r.router, "held", 1))  # one request held
        resp = r.post("/v1/chat/completions", json=CHAT)
        envelope(resp, E.R02)
        assert resp.headers["retry-after"] == "1"
        r.call(lambda: setattr(r.router, "held", 0))
        b = r.balanced()
        assert b["terminal"]["rejected"] == 1 and b["unsized_offered"] == 1


def test_H06_a_router_bug_is_a_500_envelope_and_counted_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    import narwhal.http.completions as comp

    async def boom(*_: Any) -> str:
        raise RuntimeError("a bug")

    monkeypatch.setattr(comp, "run_request", boom)
    with running_router(config()) as r:
        err = envelope(r.post("/v1/chat/completions", json=CHAT), E.H06)
        assert "bug" in err["message"]
        b = r.balanced()
        assert b["terminal"]["failed"] == 1
