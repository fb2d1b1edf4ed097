"""The router's threat model, the HTTP surface: what a probing client learns and what it
can make the router do with odd but well-formed requests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from narwhal.engines.runtime import EngineSpec
from narwhal.http.errors import RID_OK
from narwhal.mock import MockConfig, Timing, running_fleet
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
