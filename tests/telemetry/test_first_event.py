"""Issue 40 item 9: labelled counters whose label values the router knows are exported at
0 from its start, so the shipped alerts' increase() and rate() see the first event (a
series that first appears at 1 is no increase). deploy/prometheus/alerts.test.yaml has
the promtool side: an alert firing on the first event."""

from __future__ import annotations

from pathlib import Path

from narwhal.mock import MockConfig, running_fleet
from narwhal_generated import errors as E
from narwhal_generated import migration as G
from tests.helpers import running_router


def _series(text: str) -> dict[str, float]:
    out = {}
    for ln in text.splitlines():
        if ln and not ln.startswith("#"):
            name, _, v = ln.rpartition(" ")
            out[name] = float(v)
    return out


def test_known_label_values_start_at_zero(tmp_path: Path) -> None:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0")]) as (m,):
        fleet = tmp_path / "fleet.yaml"
        fleet.write_text(f"- {{name: u0, url: '{m.url}', role: unified, dialect: vllm}}\n")
        cfg = {"admission": {"mode": "open", "prediction": {"profile_on_start": False}},
               "discovery": {"file": str(fleet)}, "tenants": {"acme": {"weight": 2}}}
        with running_router(cfg) as rr:
            got = _series(rr.get("/metrics").text)
    assert got['narwhal_fleet_source_errors_total{source="file"}'] == 0.0
    for row in E.ROWS.values():
        if row.id.startswith("R"):
            assert got[f'narwhal_refusal_seconds_count{{code="{row.code}",worker="0"}}'] == 0.0, row.id
    for cause in G.FAILURES:
        for decision in G.REASONS:
            assert got[f'narwhal_migrations_total{{cause="{cause}",decision="{decision}",worker="0"}}'] == 0.0
    assert got['narwhal_tenant_requests_offered_total{tenant="acme"}'] == 0.0
    assert got['narwhal_tenant_requests_terminal_total{class="completed",tenant="acme"}'] == 0.0


def test_the_zeros_are_bounded() -> None:
    """The zeros add a bounded number of series: the refusal rows and the migration table."""
    from narwhal.worker.telemetry import Telemetry

    t = Telemetry()
    names = [s.name for fam in t.registry.collect() for s in fam.samples]
    assert len(names) <= 12 * 25 + 3 * len(G.FAILURES) * len(G.REASONS) + 64
