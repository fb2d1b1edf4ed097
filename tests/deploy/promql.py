"""Test equipment for deploy/: the metric names a PromQL expression reads, the
expressions of the dashboard and of the alerting rules, and where promtool is.

Theory of operation (`metric_names`): PromQL names a metric as a bare identifier; every
other identifier is a function or aggregation (followed by `(`, possibly after a
`by (...)`/`without (...)` clause), a keyword (`and`, `or`, `unless`, `bool`, `offset`,
...), a label name inside `{...}` or inside the parentheses of `by`/`without`/`on`/
`ignoring`/`group_left`/`group_right`, or part of a string, a duration or a number. So:
strip strings, label matchers, ranges/subscripts and modifier clauses, Grafana's template
variables, then keep the identifiers not followed by `(` that are not keywords.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ROOT", "metric_names", "dashboard_exprs", "rule_exprs", "promtool", "prometheus_binary", "Missing"]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "narwhal.json"
RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"

_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
             "bool", "offset", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_CLAUSE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE)
_GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_AT = re.compile(r"@\s*(?:start\(\)|end\(\)|[\d.]+)")
_IDENT = re.compile(r"(?<![\w.:$])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (Grafana variables allowed)."""
    s = _GRAFANA_VAR.sub(lambda m: "[]" if m.group(0).startswith("[[") else " 0 ", expr)  # a variable is a value
    s = _STRING.sub(' "" ', s)
    s = _MATCHERS.sub(" ", s)
    s = _RANGE.sub(" ", s)
    s = _AT.sub(" ", s)
    s = _CLAUSE.sub(" ", s)
    names = set()
    for m in _IDENT.finditer(s):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def _walk_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(_walk_panels(p.get("panels", [])))
    return out


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the dashboard, templating queries included."""
    d = dashboard()
    out = [(p["title"], t["expr"]) for p in _walk_panels(d["panels"]) for t in p.get("targets", [])]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", q)
            assert m, q
            out.append((f"variable {v['name']}", m.group(1)))
    return out


def rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text())
    return [r for g in data["groups"] for r in g["rules"]]


def rule_exprs() -> list[tuple[str, str]]:
    return [(r.get("alert") or r.get("record"), r["expr"]) for r in rules()]


class Missing(Exception):
    """promtool/prometheus could not be installed; the message says why."""


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes") or os.environ.get("NARWHAL_REQUIRE_PROMETHEUS") == "1"


def _install() -> Path:
    """promtool's path: $NARWHAL_PROMTOOL, else the one scripts/ops/prometheus.sh unpacks
    (installing it when absent), else one on PATH."""
    given = os.environ.get("NARWHAL_PROMTOOL")
    if given:
        if not os.access(given, os.X_OK):
            raise Missing(f"NARWHAL_PROMTOOL={given} is not an executable")
        return Path(given)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "ops" / "prometheus.sh")], capture_output=True, text=True, timeout=300)
    if r.returncode == 0:
        return Path(r.stdout.strip().splitlines()[-1])
    found = shutil.which("promtool")
    if found:
        return Path(found)
    raise Missing(f"scripts/ops/prometheus.sh could not install Debian's prometheus: {r.stderr.strip()[-600:]}")


def promtool() -> Path:
    """promtool, installed by scripts/ops/prometheus.sh when needed. Raises Missing."""
    return _install()


def prometheus_binary() -> Path:
    p = promtool().parent / "prometheus"
    if not p.exists():
        raise Missing(f"no prometheus server beside {promtool()}")
    return p


def require(fn: Any) -> Path:
    """fn() or, when Prometheus cannot be had: a failure in CI (CI=true, or
    NARWHAL_REQUIRE_PROMETHEUS=1 as tox sets), a skip with the reason elsewhere."""
    import pytest

    try:
        path: Path = fn()
        return path
    except Missing as e:
        if _in_ci():
            pytest.fail(f"Prometheus is required here (CI): {e}")
        pytest.skip(str(e))
