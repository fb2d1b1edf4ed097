"""The router's threat model, alerts that see the first event (issue 40 item 9): an
attacker who does a thing once must not go unnoticed because the counter it moves had no
series before. The shipped alerts take `increase()` of labelled counters
(deploy/prometheus/alerts.yaml: NarwhalFleetSourceErrors, the refusal and migration
counters); a series that first appears at 1 is no increase, so one corrupted discovery
file (or one refusal of a kind) raised nothing.

The attack here: whoever can write the discovery file writes it broken, once. The scrape
before has the file source's error series at 0, the scrape after at 1: the alert's
increase over any window holding both is 1 (tests/deploy has promtool firing it)."""

from __future__ import annotations

from pathlib import Path

from narwhal.mock import MockConfig, running_fleet
from tests.helpers import running_router, wait_until

SERIES = 'narwhal_fleet_source_errors_total{source="file"}'


def _value(text: str, series: str) -> float | None:
    for ln in text.splitlines():
        if ln.startswith(series + " "):
            return float(ln.rsplit(" ", 1)[1])
    return None


def test_one_corrupted_discovery_file_moves_a_series_that_was_there_at_zero(tmp_path: Path) -> None:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0")]) as (m,):
        fleet = tmp_path / "fleet.yaml"
        fleet.write_text(f"- {{name: u0, url: '{m.url}', role: unified, dialect: vllm}}\n")
        cfg = {"admission": {"mode": "open", "prediction": {"profile_on_start": False}},
               "discovery": {"file": str(fleet), "file_interval_ms": 100}}
        with running_router(cfg) as rr:
            before = _value(rr.get("/metrics").text, SERIES)
            fleet.write_text("- {name: [unclosed\n")  # once
            wait_until(lambda: _value(rr.get("/metrics").text, SERIES) == 1.0, timeout=10, what="the source error counted")
            engines = [e["name"] for e in rr.get("/v1/engines").json()["data"]]
    assert before == 0.0, "no series before the first event: increase() would not see it"
    assert engines == ["u0"]  # the fleet stayed as it was
