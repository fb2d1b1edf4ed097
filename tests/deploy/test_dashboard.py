"""deploy/grafana/narwhal.json holds together as a Grafana dashboard (no Grafana here to
load it): unique panel ids and refIds, panels inside the 24-column grid without
overlapping, every query on the `datasource` variable, every variable a query uses is
defined (or one of Grafana's own), every row the issue asks for is there. That its
queries run and return data is tests/deploy/test_metrics_live.py."""

from __future__ import annotations

import re

from tests.deploy.promql import _walk_panels, dashboard

GRAFANA_VARS = {"__rate_interval", "__interval", "__range"}
ROWS = {"Traffic and refusals", "TTFT and TPOT against budgets", "Projection error", "Queue and slots",
        "Engines: health and lifecycle", "Books", "High availability", "Broken streams and telemetry"}


def test_panels_ids_and_grid() -> None:
    d = dashboard()
    panels = _walk_panels(d["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], int] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps panel {cells[(x, y)]}"
                cells[(x, y)] = p["id"]
    assert {p["title"] for p in panels if p["type"] == "row"} == ROWS


def test_queries_use_the_datasource_and_defined_variables() -> None:
    d = dashboard()
    defined = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "job", "instance", "ttft_budget", "tpot_budget"} <= defined
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    for p in _walk_panels(d["panels"]):
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            used = set(re.findall(r"\$\{?(\w+)", t["expr"]))
            assert used <= defined | GRAFANA_VARS, (p["title"], used - defined - GRAFANA_VARS)
            assert t["expr"].count("(") == t["expr"].count(")"), (p["title"], t["expr"])
