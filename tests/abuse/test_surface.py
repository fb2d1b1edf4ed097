"""The router's threat model, the HTTP surface: what a probing client learns and what it
can make the router do with odd but well-formed requests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from narwhal.http.errors import RID_OK
from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from tests.helpers import RunningRouter, running_router


@pytest.fixture(scope="module")
def rr(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[RunningRouter]:
    monkeypatch_module.delenv("NARWHAL_ADMIN_TOKEN", raising=False)
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0", timing=Timing(time_scale=0.25))]) as mocks:
        specs = [EngineSpec(m.name, m.url, "unified", "vllm", None, None) for m in mocks]
        cfg = {"admission": {"mode": "open", "prediction": {"profile_on_start": False}}, "monitoring": {"poll_interval_ms": 200, "stale_after_ms": 60000}}
        with running_router(cfg, specs) as r:
            yield r


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "POST"])
def test_H01_admin_routes_are_404_for_every_method_without_a_token(rr: RunningRouter, method: str) -> None:
    import httpx

    r = httpx.request(method, rr.url + "/admin/state", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("path", ["/admin/state/", "/v1/models/", "/health/"])
def test_a_trailing_slash_is_no_redirect_to_the_clients_host(rr: RunningRouter, path: str) -> None:
    import httpx

    r = httpx.post(rr.url + path, headers={"host": "evil.example"}, json={}, timeout=5, follow_redirects=False)
    assert r.status_code in (404, 405) and "location" not in r.headers
    assert r.json()["error"]["code"] in ("not_found", "method_not_allowed")


@pytest.mark.parametrize(("rid", "ok"), [(b"abc", True), (b"abc\n", False), (b"a" * 128, True), (b"a" * 129, False), (b"a b", False), (b"", False)])
def test_request_id_pattern_matches_whole_values(rid: bytes, ok: bool) -> None:
    assert (RID_OK.fullmatch(rid) is not None) is ok


def _raw(rr: RunningRouter, data: bytes) -> bytes:
    import socket

    host, port = rr.url.split("://", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(data)
        out = b""
        while True:
            try:
                d = s.recv(65536)
            except OSError:
                break
            if not d:
                break
            out += d
    return out


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (b"GET / HTTP/1.1\r\nhost: x\r\nthis is no header\r\n\r\n", b"400", b"malformed_http_request"),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n", b"400", b"malformed_http_request"),
        (b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 200_000 + b"\r\n\r\n", b"431", b"request_head_too_large"),
    ],
    ids=["bad-header-line", "tls-on-a-cleartext-port", "head-over-16-KiB"],
)
def test_H08_H09_the_servers_own_refusals_carry_the_envelope(rr: RunningRouter, data: bytes, status: bytes, code: bytes) -> None:
    """hypercorn answered these with an empty body; now with the error envelope."""
    import json

    out = _raw(rr, data)
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 " + status), out[:200]
    assert json.loads(body)["error"]["code"] == code.decode()


def test_two_authorization_headers_on_the_admin_api_are_refused_400(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40 item 10: the admin guard read the first Authorization, client identity the
    last; a proxy checking one and the router the other could be split. Both refuse two."""
    import httpx

    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", "tok-admin-two")
    with running_router({"admission": {"mode": "open", "prediction": {"profile_on_start": False}}}) as r:
        good = [("authorization", "Bearer tok-admin-two")]
        body = {"state": "active"}
        assert httpx.post(r.url + "/admin/state", json=body, headers=good, timeout=5).status_code == 200
        for pair in (good + [("authorization", "Bearer wrong")], [("authorization", "Bearer wrong")] + good, good + good):
            got = httpx.post(r.url + "/admin/state", json=body, headers=pair, timeout=5)
            assert got.status_code == 400 and got.json()["error"]["code"] == "invalid_admin_request", (pair, got.text)
