"""The data plane's request histograms (narwhal/worker/telemetry.py): a labelled child is
kept once made (Telemetry.child), is the child prometheus_client itself holds, and the
kept ones are bounded (CHILDREN)."""

from __future__ import annotations

import pytest

from narwhal.worker import telemetry as T


def test_a_child_is_the_one_prometheus_holds_and_is_kept() -> None:
    t = T.Telemetry()
    c = t.child(t.ttft, "chat")
    assert c is t.ttft.labels("chat")
    assert t.child(t.ttft, "chat") is c
    assert t.child(t.e2e, "chat") is t.e2e.labels("chat") and t.child(t.e2e, "chat") is not c  # per metric
    c.observe(0.2)
    t.child(t.ttft, "chat").observe(0.3)
    got = {s.name: s.value for m in t.registry.collect() if m.name == "narwhal_ttft_seconds" for s in m.samples if s.labels.get("route") == "chat"}
    assert got["narwhal_ttft_seconds_count"] == 2 and got["narwhal_ttft_seconds_sum"] == pytest.approx(0.5)


def test_the_kept_children_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(T, "CHILDREN", 8)
    t = T.Telemetry()
    for i in range(50):
        t.child(t.tpot, f"engine-{i}").observe(0.01)
        assert len(t._children) <= 8
    assert t.child(t.tpot, "engine-3") is t.tpot.labels("engine-3")  # forgotten here, still prometheus_client's
    samples = [s for m in t.registry.collect() if m.name == "narwhal_tpot_seconds" for s in m.samples if s.name.endswith("_count")]
    assert len(samples) == 50


def test_an_engine_that_left_has_its_children_removed() -> None:
    t = T.Telemetry()
    t.child(t.tpot, "e0").observe(0.01)
    t.child(t.tpot, "e1").observe(0.02)
    t.forget_engine("e1")
    t.forget_engine("e9")  # never observed: nothing to remove, no error
    engines = {s.labels["engine"] for m in t.registry.collect() if m.name == "narwhal_tpot_seconds" for s in m.samples}
    assert engines == {"e0"}
    assert ("narwhal_tpot_seconds", "e1") not in t._children
    t.child(t.tpot, "e1").observe(0.03)  # back under the same name: a new child, counted from zero
    got = {s.labels["engine"]: s.value for m in t.registry.collect() if m.name == "narwhal_tpot_seconds" for s in m.samples if s.name.endswith("_count")}
    assert got == {"e0": 1.0, "e1": 1.0}
