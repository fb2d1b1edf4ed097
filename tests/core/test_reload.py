"""core/reload.py: which keys a reload changes at run time and which need a restart."""

from __future__ import annotations

import pytest

from narwhal.config import parse_config
from narwhal.core.reload import changed_keys, plan, runtime_key


@pytest.mark.parametrize(("key", "runtime"), [
    ("admission.queue_limit", True), ("admission.ttft_budget_ms", True), ("admission.phase_concurrency.decode", True),
    ("admission.mode", True), ("admission.prediction.tpot_budget_ms", True), ("admission.prediction.prefix_cache", False),
    ("monitoring.poll_interval_ms", True), ("upstream.idle_timeout_ms", True), ("upstream.max_connections", False),
    ("engines", True), ("discovery.file", True), ("discovery.drain_timeout_ms", True),
    ("serving.listen", False), ("serving.tls.certfile", False), ("serving.workers", False), ("ha.etcd", False), ("admin.token_env", False),
    ("serving.max_request_bytes", False),
])
def test_runtime_keys(key: str, runtime: bool) -> None:
    assert runtime_key(key) is runtime


def test_changed_keys_are_leaves_and_engines_is_one() -> None:
    a = {"admission": {"queue_limit": 1, "phase_concurrency": {"prefill": 4}}, "engines": [{"name": "a"}]}
    b = {"admission": {"queue_limit": 2, "phase_concurrency": {"prefill": 4}}, "engines": [{"name": "b"}], "ha": None}
    assert changed_keys(a, b) == ["admission.queue_limit", "engines"]
    assert changed_keys(a, a) == []


def test_the_plan_keeps_what_needs_a_restart_and_takes_the_rest() -> None:
    old = parse_config({"serving": {"listen": "127.0.0.1:9000", "workers": 2}, "admission": {"queue_limit": 10},
                        "engines": [{"name": "e0", "url": "http://127.0.0.1:1"}]}).model_dump(mode="json", by_alias=True)
    new = parse_config({"serving": {"listen": "0.0.0.0:9000"}, "admission": {"queue_limit": 20, "prediction": {"prefix_cache": "off"}},
                        "engines": [{"name": "e1", "url": "http://127.0.0.1:2"}]}).model_dump(mode="json", by_alias=True)
    p = plan(old, new)
    assert p.changed == ("admission.queue_limit", "engines")
    assert p.restart == ("admission.prediction.prefix_cache", "serving.listen", "serving.workers")
    cfg = parse_config(p.merged)
    assert cfg.admission.queue_limit == 20 and cfg.serving.listen == "127.0.0.1:9000" and str(cfg.serving.workers.root) == "2"  # type: ignore[union-attr]
    assert [e.name for e in cfg.engines or ()] == ["e1"] and cfg.admission.prediction.prefix_cache == "auto"
