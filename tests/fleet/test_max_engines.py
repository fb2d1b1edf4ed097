"""discovery.max_engines (issue 40 item 4): no change takes the fleet past it, whatever
names the engines; a change that would is refused whole, naming the key, and the fleet
stays as it was. The admin API, a source's snapshot, a discovery file, the configuration
at start and a reload."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from narwhal.config import ConfigError, parse_config
from narwhal.fleet.file import read_fleet_file
from narwhal.fleet.source import SourceError
from narwhal.mock import MockConfig, running_fleet
from narwhal.upstream.engines import EngineSpec
from tests.helpers import running_router

TOKEN = "max-engines-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def mock() -> Iterator[Any]:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="m0")]) as (m,):
        yield m


@pytest.fixture(autouse=True)
def admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", TOKEN)


def _cfg(limit: int) -> dict[str, Any]:
    return {"admission": {"mode": "open", "prediction": {"profile_on_start": False}},
            "monitoring": {"poll_interval_ms": 200, "stale_after_ms": 60000}, "discovery": {"max_engines": limit}}


def _names(rr: Any) -> list[str]:
    return sorted(e["name"] for e in rr.get("/v1/engines").json()["data"])


def test_put_past_the_limit_is_refused_naming_it(mock: Any) -> None:
    specs = [EngineSpec(f"e{i}", mock.url, "unified", "vllm", None, None) for i in range(2)]
    with running_router(_cfg(3), specs) as rr:
        entry = {"url": mock.url, "role": "unified", "dialect": "vllm"}
        assert httpx.put(rr.url + "/admin/engines/e2", json=entry, headers=AUTH, timeout=10).status_code == 200
        r = httpx.put(rr.url + "/admin/engines/e3", json=entry, headers=AUTH, timeout=10)
        assert r.status_code == 400 and "discovery.max_engines (3)" in r.json()["error"]["message"], r.text
        assert _names(rr) == ["e0", "e1", "e2"]
        # an engine already there may still be updated at the limit
        assert httpx.put(rr.url + "/admin/engines/e2", json={**entry, "wave": "b"}, headers=AUTH, timeout=10).status_code == 200


def test_a_source_past_the_limit_is_refused_whole(mock: Any) -> None:
    specs = [EngineSpec("e0", mock.url, "unified", "vllm", None, None)]
    with running_router(_cfg(3), specs) as rr:
        three = [EngineSpec(f"f{i}", mock.url, "unified", "vllm", None, None) for i in range(3)]
        out = rr.call(rr.router.membership.apply, "file", three)
        assert out["refused"] == ["f0", "f1", "f2"] and not out["added"]
        assert _names(rr) == ["e0"]
        assert "discovery.max_engines (3)" in rr.call(lambda: rr.router.membership.last_error["file"])
        out = rr.call(rr.router.membership.apply, "file", three[:2])
        assert out["added"] == ["f0", "f1"] and _names(rr) == ["e0", "f0", "f1"]


def test_a_discovery_file_past_the_limit_is_refused_before_its_entries_are_validated(tmp_path: Path) -> None:
    f = tmp_path / "fleet.json"
    f.write_text(yaml.safe_dump([{"name": f"e{i}", "url": f"http://127.0.0.1:{9000 + i}"} for i in range(5)]))
    got = read_fleet_file(str(f), 1 << 20, 4)
    assert isinstance(got, SourceError) and "5 engines, over discovery.max_engines (4)" in got.message
    assert not isinstance(read_fleet_file(str(f), 1 << 20, 5), SourceError)


def test_a_configuration_past_the_limit_is_refused() -> None:
    engines = [{"name": f"e{i}", "url": f"http://127.0.0.1:{9000 + i}", "role": "unified"} for i in range(3)]
    with pytest.raises(ConfigError, match=r"engines: 3 entries, over discovery.max_engines \(2\)"):
        parse_config({"engines": engines, "discovery": {"max_engines": 2}})
    parse_config({"engines": engines, "discovery": {"max_engines": 3}})
    with pytest.raises(ConfigError, match="max_engines"):
        parse_config({"discovery": {"max_engines": 0}})
