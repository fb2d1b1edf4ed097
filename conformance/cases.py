"""The case files: loading, validation against case.schema.json, selection by ID, and the
coverage check (every spec row has a case, every case names a real row).

Rules
  * A case lives in cases/<table>/<ROW>-<n>.yaml and its id is <table>/<ROW>/<n>; the
    file name and the id must agree, and ids are unique.
  * Titles are short, unique, in the present tense, and never say "should"
    (JSON-Schema-Test-Suite's sanity rules).
  * Rows come from the generated tables (narwhal_generated), so a row added to spec/
    without a case, or a case naming a retired or unknown row, fails the check.
  * cases/untestable.yaml lists rows no black-box case can reach, each with the reason.
  * A case is classed `interoperability` (what any OpenAI-compatible router owes its
    clients) or `narwhal` (Narwhal's own policy and API); it runs on one profile or a
    list of them; its needs are the capabilities it names plus those its steps imply
    (capabilities.implied_needs), so a case cannot forget one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from narwhal_generated import accounting as _acc
from narwhal_generated import assembly as _asm
from narwhal_generated import dialects as _dia
from narwhal_generated import errors as _err
from narwhal_generated import migration as _mig
from narwhal_generated import router_states as _st
from narwhal_generated import token_identity as _tok

from .capabilities import implied_needs
from .profiles import PROFILES

__all__ = ["Case", "Row", "spec_rows", "load_cases", "select_cases", "check_cases", "CASES_DIR", "untestable"]

_HERE = resources.files("narwhal_conformance")
CASES_DIR = Path(str(_HERE.joinpath("cases")))
_FILE = re.compile(r"^([A-Z][0-9]{2})-([0-9]+)\.yaml$")
_SHOULD = re.compile(r"\bshould\b", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Row:
    id: str
    table: str
    quote: str
    level: str


@dataclass(frozen=True, slots=True)
class Case:
    data: dict[str, Any]
    path: Path

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def rows(self) -> list[str]:
        return list(self.data["rows"])

    @property
    def level(self) -> str:
        return str(self.data["level"])

    @property
    def profiles(self) -> list[str]:
        p = self.data["profile"]
        return [p] if isinstance(p, str) else list(p)

    @property
    def cls(self) -> str:
        """interoperability | narwhal"""
        return str(self.data["class"])

    @property
    def needs(self) -> list[str]:
        """The capabilities it names and those its steps imply, sorted."""
        return sorted(set(self.data.get("needs", ())) | implied_needs(self.data))

    @property
    def title(self) -> str:
        return str(self.data["title"])

    @property
    def quote(self) -> str:
        return str(self.data["quote"])


@cache
def spec_rows() -> dict[str, Row]:
    """Every row of the spec tables, from the generated modules."""
    rows: dict[str, Row] = {}
    for r in _err.REFUSALS:
        rows[r.id] = Row(r.id, "refusals", r.quote, "SHOULD" if r.id == "R14" else "MUST")
    for r in _err.FAILURES + _err.HTTP_ERRORS:
        rows[r.id] = Row(r.id, "failures", r.quote, "MUST")
    for a in _asm.ROWS:
        rows[a.id] = Row(a.id, "assembly", a.quote, a.level)
    for t in _tok.ROWS:
        rows[t.id] = Row(t.id, "token_identity", t.quote, t.level)
    for s in _st.ROWS:
        rows[s.id] = Row(s.id, "router_states", s.quote, "MUST")
    for g in _mig.ROWS:
        rows[g.id] = Row(g.id, "migration", g.quote, "MUST")
    for d in _dia.ROWS:
        rows[d.id] = Row(d.id, "dialects", d.quote, "MUST")
    for i, name in enumerate(_acc.COUNTER_METRICS, start=1):
        rows[f"C{i:02d}"] = Row(f"C{i:02d}", "accounting", f"counter {name} ({_acc.COUNTER_METRICS[name]})", "MUST")
    for name, kid in _acc.CLASS_IDS.items():
        rows[kid] = Row(kid, "accounting", f"terminal class {name} ({_acc.TERMINAL_METRIC}{{class=\"{name}\"}})", "MUST")
    return rows


@cache
def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(_HERE.joinpath("case.schema.json").read_text())
    return schema


def untestable(root: Path | None = None) -> dict[str, str]:
    p = (root or CASES_DIR) / "untestable.yaml"
    if not p.exists():
        return {}
    data = yaml.safe_load(p.read_text()) or {}
    return {str(k): str(v) for k, v in data.items()}


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*/*.yaml"))


def load_cases(root: Path | None = None, *, validate: bool = True) -> list[Case]:
    """Every case, sorted by id; raises ValueError on a file that does not validate."""
    root = root or CASES_DIR
    validator = jsonschema.Draft202012Validator(_schema())
    out = []
    for p in _files(root):
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ValueError(f"{p}: not valid YAML: {e}") from None
        if validate:
            errs = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
            if errs:
                first = errs[0]
                where = "/".join(str(x) for x in first.absolute_path) or "(top)"
                raise ValueError(f"{p}: {where}: {first.message}")
        out.append(Case(data, p))
    return sorted(out, key=_sort_key)


def _sort_key(c: Case) -> tuple[str, str, int]:
    table, row, n = c.id.split("/")
    return table, row, int(n)


def select_cases(cases: list[Case], patterns: list[str] | None, *, profile: str | None = None, version: int | None = None) -> list[Case]:
    """Cases whose id equals a pattern or lies under it (`refusals`, `refusals/R11`);
    only the given profile's; only cases of suite version <= version."""
    out = []
    for c in cases:
        if profile is not None and profile not in c.profiles:
            continue
        if version is not None and int(c.data["since"]) > version:
            continue
        if patterns and not any(c.id == p.rstrip("/") or c.id.startswith(p.rstrip("/") + "/") for p in patterns):
            continue
        out.append(c)
    return out


def check_cases(root: Path | None = None) -> list[str]:
    """Problems with the case data: [] when every rule of this module holds."""
    root = root or CASES_DIR
    problems: list[str] = []
    try:
        cases = load_cases(root)
    except (ValueError, yaml.YAMLError) as e:
        return [str(e)]
    rows = spec_rows()
    seen: dict[str, Path] = {}
    titles: dict[str, str] = {}
    covered: set[str] = set()
    for c in cases:
        rel = c.path.relative_to(root)
        m = _FILE.match(c.path.name)
        table = rel.parts[0]
        if m is None or c.id != f"{table}/{m.group(1)}/{int(m.group(2))}":
            problems.append(f"{rel}: id {c.id!r} does not match the file name (expected {table}/<ROW>/<n> from <ROW>-<n>.yaml)")
        if c.id in seen:
            problems.append(f"{rel}: id {c.id} is used by {seen[c.id]} too")
        seen[c.id] = rel
        if _SHOULD.search(c.title):
            problems.append(f"{c.id}: the title says 'should' (state what happens: {c.title!r})")
        key = c.title.lower()
        if key in titles:
            problems.append(f"{c.id}: the title is the same as {titles[key]}'s")
        titles[key] = c.id
        for prof in c.profiles:
            if prof not in PROFILES:
                problems.append(f"{c.id}: unknown profile {prof!r}")
        for r in c.rows:
            if r not in rows:
                problems.append(f"{c.id}: names {r}, which is no spec row")
        own = c.id.split("/")[1]
        if own not in c.rows:
            problems.append(f"{c.id}: its rows do not include {own}, the row its id names")
        covered.update(c.rows)
        problems.extend(f"{c.id}: {p}" for p in _step_problems(c))
    exempt = untestable(root)
    for r in exempt:
        if r not in rows:
            problems.append(f"untestable.yaml: {r} is no spec row")
        elif r in covered:
            problems.append(f"untestable.yaml: {r} has a case; drop it from the list")
    for r in rows:
        if r not in covered and r not in exempt:
            problems.append(f"row {r} ({rows[r].table}) has no case")
    return problems


def _step_problems(c: Case) -> list[str]:
    """Rules the schema cannot say: names used before they are defined, background-only
    keys on foreground requests, variables that exist."""
    out: list[str] = []
    names: set[str] = set()
    for i, s in enumerate([*c.data["steps"], *c.data.get("teardown", ())]):
        if "request" in s:
            bg = s.get("background")
            if bg is None and ("until" in s or "partial_body" in s):
                out.append(f"step {i}: until/partial_body need background")
            if bg is not None:
                if bg in names:
                    out.append(f"step {i}: background name {bg!r} is used twice")
                names.add(bg)
                if "expect" in s:
                    out.append(f"step {i}: a background request's expect goes on its await step")
            text = json.dumps(s["request"])
            for var in re.findall(r"\$\{([^}]*)\}", text):
                if var not in ("admin_token", "request_id") and not (var in ("pad", "repeat", "run_headers") and "raw" in s["request"]):
                    out.append(f"step {i}: unknown variable ${{{var}}}")
                if var == "admin_token" and "admin" not in c.needs:
                    out.append(f"step {i}: uses ${{admin_token}}; add needs: [admin]")
        for key in ("await", "release"):
            if key in s:
                for n in s[key] if isinstance(s[key], list) else [s[key]]:
                    if n not in names:
                        out.append(f"step {i}: {key} {n!r} names no earlier background request")
        if "fleet" in s:
            eng = s["fleet"]["engine"]
            for name in c.profiles:
                prof = PROFILES.get(name)
                if prof is not None and eng != "all" and eng not in {e.name for e in prof.engines}:
                    out.append(f"step {i}: fleet engine {eng!r} is not in profile {name}")
        for named in re.findall(r'"fault_engines": \[([^\]]*)\]', json.dumps(s)):
            for eng in re.findall(r'"([^"]+)"', named):
                for name in c.profiles:
                    if name in PROFILES and eng not in {e.name for e in PROFILES[name].engines}:
                        out.append(f"step {i}: fault_engines names {eng!r}, no engine of profile {name}")
    return out
