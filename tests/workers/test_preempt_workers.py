"""Fair preemption with data-plane workers (core/preempt.py; `serving.workers` 2): the
request asked to leave may run in another worker than the one whose request waits; the
authority tells the worker holding it (by its rid, authority/channel.py), and the stream
is carried on there token for token. The scene of tests/migration/test_preempt_http.py,
through `narwhal serve --workers 2` in a subprocess."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.mock import MockConfig, RunningMock, Timing, running_fleet
from tests.helpers import keys_file
from tests.migration.test_migration_http import read
from tests.migration.test_preempt_http import KEYS, MODEL, scene, uninterrupted
from tests.workers.test_workers import at_rest, metrics_of, served


@pytest.fixture(scope="module")
def mock() -> Iterator[RunningMock]:
    cfg = MockConfig(dialect="vllm", role="unified", model=MODEL, name="u0", timing=Timing(prefill_base_ms=5.0, tpot_base_ms=15.0), sequence_output=True)
    with running_fleet([cfg]) as ms:
        yield ms[0]


def test_the_worker_holding_the_preempted_stream_is_told_and_carries_it_on(tmp_path: Path, mock: RunningMock) -> None:
    extra: dict[str, Any] = {
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}, "phase_concurrency": {"prefill": 2, "decode": 2}},  # two slots
        "monitoring": {"poll_interval_ms": 200, "stale_after_ms": 60000},
        "upstream": {"migration": {"max_attempts": 1}},
        "tenants": {"quiet": {"weight": 1}, "noisy": {"weight": 1}}, "auth": {"keys_file": str(keys_file(tmp_path, KEYS))},
    }
    with served(tmp_path, [mock], **extra) as r:
        out = scene(r.url)
        noisy = out["noisy"]
        assert noisy.status == 200 and noisy.done and out["q1"].done and out["q2"].done, noisy.body
        ids, _, _ = read(noisy)
        assert ids == uninterrupted(60) and noisy.comments == ["x-narwhal-migrations 1"]
        assert out["q2_at"] < out["q1_at"]
        at_rest(r)
        m = metrics_of(httpx.get(r.url + "/metrics", timeout=10).text)
        assert m[("narwhal_fair_preemptions_total", ())] == 1.0
        assert sum(v for (n, lb), v in m.items() if n == "narwhal_migrations_total" and dict(lb).get("decision") == "carry_on") == 1.0
