"""Fleet membership at run time over real HTTP (spec/tables/lifecycle.yaml): engines
added, updated, replaced, drained and removed through the admin API and a watched
discovery file while clients stream, with the books balanced after each."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from tests.helpers import RunningRouter, running_router, sse, wait_until

TOKEN = "fleet-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SLOW = Timing(tpot_base_ms=15.0)  # 60 tokens: about a second of stream


@pytest.fixture(scope="module")
def mocks() -> Iterator[dict[str, Any]]:
    cfgs = [MockConfig(dialect="vllm", role="unified", name=n, timing=SLOW) for n in ("m0", "m1", "m2")]
    with running_fleet(cfgs) as ms:
        yield {m.name: m for m in ms}


@pytest.fixture(autouse=True)
def admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", TOKEN)


def config(**discovery: Any) -> dict[str, Any]:
    return {
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
        "monitoring": {"poll_interval_ms": 100, "stale_after_ms": 60000},
        "discovery": {"drain_timeout_ms": 10000, **discovery},
    }


def spec(name: str, mock: Any) -> EngineSpec:
    return EngineSpec(name, mock.url, "unified", "vllm", None, None)


def engines(rr: RunningRouter) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in rr.get("/v1/engines").json()["data"]}


def lifecycle(rr: RunningRouter, name: str) -> str | None:
    e = engines(rr).get(name)
    return None if e is None else e["lifecycle"]["state"]


def ask(rr: RunningRouter, *, max_tokens: int = 8, stream: bool = True) -> Any:
    return sse(rr.url, {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": stream,
                        "ignore_eos": True})


def put(rr: RunningRouter, name: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.put(f"{rr.url}/admin/engines/{name}", json=body, headers=AUTH, timeout=10)


def delete(rr: RunningRouter, name: str) -> httpx.Response:
    return httpx.delete(f"{rr.url}/admin/engines/{name}", headers=AUTH, timeout=10)


def stream_in_thread(rr: RunningRouter, n: int, max_tokens: int) -> tuple[list[Any], list[Any]]:
    import threading

    out: list[Any] = []
    threads = [threading.Thread(target=lambda: out.append(ask(rr, max_tokens=max_tokens))) for _ in range(n)]
    for t in threads:
        t.start()
    return out, threads


def test_put_adds_an_engine_that_joins_and_then_takes_traffic(mocks: dict[str, Any]) -> None:
    with running_router(config(), [spec("e0", mocks["m0"])]) as rr:
        r = put(rr, "e1", {"url": mocks["m1"].url, "role": "unified", "dialect": "vllm"})
        assert r.status_code == 200, r.text
        assert r.json()["change"] == "added"
        assert r.json()["lifecycle"] in ("joining", "active")
        wait_until(lambda: lifecycle(rr, "e1") == "active", timeout=10, what="e1 active")
        e1 = engines(rr)["e1"]
        assert e1["eligible"] and e1["lifecycle"]["source"] == "admin"
        assert [h["row"] for h in e1["lifecycle"]["history"]] == ["M01"]
        # e0 drained by the operator (M10): the traffic goes to the new engine
        assert httpx.post(f"{rr.url}/admin/engines/e0/drain", json={"drain": True}, headers=AUTH).status_code == 200
        assert lifecycle(rr, "e0") == "paused"
        mocks["m1"].clear_requests()
        got = ask(rr)
        assert got.status == 200 and got.done
        assert len(mocks["m1"].requests()) == 1
        # the same entry again changes nothing; a settings change is an update in place
        assert put(rr, "e1", {"url": mocks["m1"].url}).json()["change"] == "unchanged"
        r = put(rr, "e1", {"url": mocks["m1"].url, "wave": "w2", "max_concurrency": 3})
        assert r.json()["change"] == "updated" and r.json()["lifecycle"] == "active"
        e1 = engines(rr)["e1"]
        assert e1["wave"] == "w2" and e1["max_concurrency"] == 3 and e1["load"]["decode_slots"] == 3
        metrics = rr.get("/metrics").text
        assert 'narwhal_fleet_changes_total{change="join"} 1.0' in metrics
        assert 'narwhal_engine_lifecycle{engine="e1",state="active"} 1.0' in metrics
        assert 'narwhal_engine_lifecycle{engine="e0",state="paused"} 1.0' in metrics
        rr.balanced()


def test_delete_drains_the_engine_and_its_streams_finish_whole(mocks: dict[str, Any]) -> None:
    with running_router(config(), [spec("e0", mocks["m0"]), spec("e1", mocks["m1"])]) as rr:
        httpx.post(f"{rr.url}/admin/engines/e1/drain", json={"drain": True}, headers=AUTH)
        out, threads = stream_in_thread(rr, 3, 60)  # all on e0
        wait_until(lambda: engines(rr)["e0"]["load"]["decode_in_use"] == 3, timeout=10, what="3 streams on e0")
        httpx.post(f"{rr.url}/admin/engines/e1/drain", json={"drain": False}, headers=AUTH)
        r = delete(rr, "e0")
        assert r.status_code == 200 and r.json()["lifecycle"] == "draining", r.text
        e0 = engines(rr)["e0"]
        assert not e0["eligible"] and "draining" in e0["ineligible_reasons"] and e0["lifecycle"]["leave_in_s"] > 0
        # new requests go elsewhere while e0 drains
        mocks["m1"].clear_requests()
        assert ask(rr).status == 200 and len(mocks["m1"].requests()) == 1
        for t in threads:
            t.join(30)
        assert [(s.status, s.done, s.errors) for s in out] == [(200, True, [])] * 3
        assert sum(len(c["choices"][0]["delta"].get("content") or "") > 0 for s in out for c in s.chunks) > 0
        wait_until(lambda: lifecycle(rr, "e0") is None, timeout=10, what="e0 gone")
        assert delete(rr, "e0").status_code == 404
        b = rr.balanced()
        assert b["terminal"]["completed"] == 4 and b["terminal"]["failed"] == 0
        assert rr.call(lambda: "e0" not in rr.router.scheduler.engines and not rr.router.leaving)


def test_past_the_drain_timeout_its_requests_are_cut_in_the_failed_class(mocks: dict[str, Any]) -> None:
    with running_router(config(drain_timeout_ms=300), [spec("e0", mocks["m0"])]) as rr:
        out, threads = stream_in_thread(rr, 2, 200)  # ~3 s each
        wait_until(lambda: engines(rr)["e0"]["load"]["decode_in_use"] == 2 and all(True for _ in out), timeout=10, what="2 streams")
        time.sleep(0.3)  # response headers sent: the cut is after them
        t0 = time.monotonic()
        assert delete(rr, "e0").json()["lifecycle"] == "draining"
        for t in threads:
            t.join(30)
        took = time.monotonic() - t0
        for s in out:
            assert s.status == 200 and s.done
            assert [e["code"] for e in s.errors] == ["engine_unreachable"], s.errors
            assert "left the fleet" in s.errors[0]["message"]
        assert took < 3.0  # cut, not waited out
        wait_until(lambda: lifecycle(rr, "e0") is None, timeout=10, what="e0 gone")
        b = rr.balanced()
        assert b["terminal"]["failed"] == 2
        assert 'narwhal_fleet_changes_total{change="cut"} 1.0' in rr.get("/metrics").text


def test_a_changed_url_replaces_the_engine_which_rejoins_after_its_drain(mocks: dict[str, Any]) -> None:
    with running_router(config(), [spec("e0", mocks["m0"]), spec("e1", mocks["m1"])]) as rr:
        r = put(rr, "e1", {"url": mocks["m2"].url})
        assert r.json()["change"] == "replaced", r.text
        wait_until(lambda: (e := engines(rr).get("e1")) is not None and e["url"] == mocks["m2"].url and e["lifecycle"]["state"] == "active",
                   timeout=10, what="e1 again, at m2")
        httpx.post(f"{rr.url}/admin/engines/e0/drain", json={"drain": True}, headers=AUTH)
        mocks["m2"].clear_requests()
        assert ask(rr).status == 200 and len(mocks["m2"].requests()) == 1
        rr.balanced()


def test_a_removed_engine_that_comes_back_is_a_new_engine(mocks: dict[str, Any]) -> None:
    with running_router(config(), [spec("e0", mocks["m0"]), spec("e1", mocks["m1"])]) as rr:
        assert delete(rr, "e1").json()["lifecycle"] == "gone"  # idle: released at once (M12, M29)
        assert lifecycle(rr, "e1") is None
        assert put(rr, "e1", {"url": mocks["m1"].url}).json()["change"] == "added"
        wait_until(lambda: lifecycle(rr, "e1") == "active", timeout=10, what="e1 back")
        assert engines(rr)["e1"]["lifecycle"]["history"][0]["row"] == "M01"


@pytest.mark.parametrize(("body", "param"), [
    ({"url": "http://127.0.0.1:1", "role": "middle"}, "role"),
    ({"url": "http://127.0.0.1:1", "colour": "red"}, "colour"),
    ({"url": "https://127.0.0.1:1"}, "url"),
    ({"role": "unified"}, "url"),
    ({"url": "http://127.0.0.1:1", "dialect": "sglang", "role": "decode"}, "role"),
    ({"name": "other", "url": "http://127.0.0.1:1"}, "name"),
])
def test_put_refuses_an_invalid_entry_naming_the_field(mocks: dict[str, Any], body: dict[str, Any], param: str) -> None:
    with running_router(config(), [spec("e0", mocks["m0"])]) as rr:
        r = put(rr, "e9", body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_admin_request" and err["param"] == param, err
        assert set(engines(rr)) == {"e0"}
        assert put(rr, "e9", None).status_code == 400  # type: ignore[arg-type]
        assert httpx.put(f"{rr.url}/admin/engines/e9", json={"url": mocks["m1"].url}).status_code == 401


def test_the_discovery_file_is_applied_as_one_diff_and_a_bad_file_changes_nothing(mocks: dict[str, Any], tmp_path: Path) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_text(f"- {{name: f0, url: '{mocks['m0'].url}'}}\n")
    with running_router(config(file=str(f), file_interval_ms=100), []) as rr:
        wait_until(lambda: lifecycle(rr, "f0") == "active", timeout=10, what="f0 from the file")
        assert ask(rr).status == 200
        # one write: f1 added, f0 removed (renamed into place, as editors and ConfigMaps do)
        tmp = tmp_path / "fleet.yaml.new"
        tmp.write_text(f"engines:\n  - {{name: f1, url: '{mocks['m1'].url}'}}\n")
        tmp.rename(f)
        wait_until(lambda: set(engines(rr)) == {"f1"} and lifecycle(rr, "f1") == "active", timeout=10, what="f1 alone")
        # not valid: the fleet stays, the error names the file, line and key
        f.write_text(f"- {{name: f1, url: '{mocks['m1'].url}'}}\n- {{name: f2, url: '{mocks['m2'].url}', role: sideways}}\n")
        wait_until(lambda: 'narwhal_fleet_source_errors_total{source="file"} 1.0' in rr.get("/metrics").text, timeout=10, what="error counted")
        err = rr.get("/v1/engines").json()["router"]["fleet"]["last_errors"]["file"]
        assert str(f) in err and "line 2" in err and "engines[1].role" in err, err
        f.write_text("- {name: [unclosed\n")
        wait_until(lambda: 'narwhal_fleet_source_errors_total{source="file"} 2.0' in rr.get("/metrics").text, timeout=10, what="YAML error counted")
        assert "line" in rr.get("/v1/engines").json()["router"]["fleet"]["last_errors"]["file"]
        assert set(engines(rr)) == {"f1"} and ask(rr).status == 200
        # an empty list is valid: the file's engines leave
        f.write_text("[]\n")
        wait_until(lambda: not engines(rr), timeout=10, what="the file's engines gone")
        b = rr.balanced()
        assert b["terminal"]["completed"] == 2


def test_prefill_and_decode_engines_join_and_leave_under_load(mocks: dict[str, Any]) -> None:
    cfgs = [MockConfig(dialect="vllm", role=role, name=n, timing=SLOW) for n, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"), ("p1", "prefill"))]
    with running_fleet(cfgs) as ms:
        pd = {m.name: m for m in ms}
        fleet = [EngineSpec("p0", pd["p0"].url, "prefill", "vllm", None, None), EngineSpec("d0", pd["d0"].url, "decode", "vllm", None, None)]
        with running_router(config(), fleet) as rr:
            out, threads = stream_in_thread(rr, 3, 60)
            wait_until(lambda: engines(rr)["d0"]["load"]["decode_in_use"] == 3, timeout=10, what="3 streams on d0")
            assert put(rr, "d1", {"url": pd["d1"].url, "role": "decode"}).json()["change"] == "added"
            assert put(rr, "p1", {"url": pd["p1"].url, "role": "prefill"}).json()["change"] == "added"
            wait_until(lambda: lifecycle(rr, "d1") == "active" and lifecycle(rr, "p1") == "active", timeout=10, what="d1 and p1 active")
            assert delete(rr, "d0").json()["lifecycle"] == "draining"
            assert delete(rr, "p0").json()["lifecycle"] == "gone"  # its prefills were done: nothing held
            more = [ask(rr, max_tokens=4) for _ in range(3)]
            assert [(s.status, s.done) for s in more] == [(200, True)] * 3
            assert len(pd["d1"].requests()) == 3 and len(pd["p1"].requests()) == 3
            for t in threads:
                t.join(30)
            assert [(s.status, s.done, s.errors) for s in out] == [(200, True, [])] * 3
            wait_until(lambda: set(engines(rr)) == {"d1", "p1"}, timeout=10, what="d0 gone")
            b = rr.balanced()
            assert b["terminal"]["completed"] == 6 and b["offered"] == 6


def test_a_joining_engine_takes_traffic_once_profiled_when_admission_is_predictive(mocks: dict[str, Any]) -> None:
    cfg = config()
    cfg["admission"] = {"mode": "predictive", "prediction": {"profile_on_start": True, "profile_prompt_tokens": [16, 32, 64], "profile_repeats": 1, "profile_output_tokens": 4}}
    with running_router(cfg, [spec("e0", mocks["m0"])]) as rr:
        assert put(rr, "e1", {"url": mocks["m1"].url}).json()["lifecycle"] == "joining"
        e1 = engines(rr)["e1"]
        assert not e1["eligible"] and "joining" in e1["ineligible_reasons"]
        wait_until(lambda: lifecycle(rr, "e1") == "active", timeout=30, what="e1 profiled and active")
        e1 = engines(rr)["e1"]
        assert e1["profile"]["status"] == "ok" and e1["eligible"]
        assert e1["prompt_count"] == engines(rr)["e0"]["prompt_count"]  # counted as the start-up engines are


def test_a_removed_engine_leaves_nothing_behind(mocks: dict[str, Any]) -> None:
    cfg = config()
    cfg["admission"]["prediction"]["prefix_cache"] = "auto"
    kv = EngineSpec("e1", mocks["m1"].url, "unified", "vllm", None, None, kv_events="tcp://127.0.0.1:9")  # nobody publishes there
    with running_router(cfg, [spec("e0", mocks["m0"]), kv]) as rr:
        def held() -> dict[str, Any]:
            a = rr.router
            return {"scheduler": set(a.scheduler.engines), "prefix": set(a.scheduler.prefix), "feeds": set(a.kv_feeds), "kv_tasks": set(a._kv_tasks),
                    "specs": set(a.specs)}

        assert rr.call(held) == {"scheduler": {"e0", "e1"}, "prefix": {"e0", "e1"}, "feeds": {"e1"}, "kv_tasks": {"e1"}, "specs": {"e0", "e1"}}
        task = rr.call(lambda: rr.router._kv_tasks["e1"])
        assert delete(rr, "e1").json()["lifecycle"] == "gone"
        assert rr.call(held) == {"scheduler": {"e0"}, "prefix": {"e0"}, "feeds": set(), "kv_tasks": set(), "specs": {"e0"}}
        wait_until(lambda: rr.call(task.done), timeout=5, what="the KV subscription to end")
        assert ask(rr).status == 200
        rr.balanced()


def test_a_removed_engine_leaves_no_series_in_the_scrape(mocks: dict[str, Any]) -> None:
    """Its TPOT histogram (the data plane's, per engine) goes with it: a fleet whose
    engines come and go under new names does not grow the scrape, or the process, for ever."""
    with running_router(config(), [spec("e0", mocks["m0"]), spec("e1", mocks["m1"])]) as rr:
        series = {n: f'narwhal_tpot_seconds_count{{engine="{n}"' for n in ("e0", "e1")}
        for _ in range(10):  # until both have streamed (four at once: both take some): each has its TPOT series
            out, threads = stream_in_thread(rr, 4, 16)
            for t in threads:
                t.join(30)
            assert len(out) == 4 and all(x.status == 200 for x in out)
            if all(v in rr.get("/metrics").text for v in series.values()):
                break
        assert all(v in rr.get("/metrics").text for v in series.values())
        assert delete(rr, "e1").json()["lifecycle"] == "gone"
        wait_until(lambda: series["e1"] not in rr.get("/metrics").text, timeout=5, what="e1's TPOT series to go")
        assert series["e0"] in rr.get("/metrics").text
        assert ask(rr).status == 200
        rr.balanced()


def test_a_joining_engine_removed_while_its_profile_holds_a_slot_leaves(mocks: dict[str, Any]) -> None:
    cfg = config()
    cfg["admission"] = {"mode": "predictive", "prediction": {"profile_on_start": True, "profile_prompt_tokens": [16, 32, 64], "profile_repeats": 2, "profile_output_tokens": 8}}
    with running_router(cfg, [spec("e0", mocks["m0"])]) as rr:
        assert put(rr, "e1", {"url": mocks["m1"].url, "max_concurrency": 1}).status_code == 200
        wait_until(lambda: engines(rr)["e1"]["load"]["prefill_in_use"] == 1, timeout=10, what="e1's profile on its one slot")
        r = delete(rr, "e1")  # lifecycle M04: leaves like any engine; the profile is cancelled
        assert r.status_code == 200 and r.json()["lifecycle"] in ("draining", "gone"), r.text
        wait_until(lambda: lifecycle(rr, "e1") is None, timeout=10, what="e1 gone")
        assert ask(rr).status == 200
        rr.balanced()
