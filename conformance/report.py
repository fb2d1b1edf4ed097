"""Reports: the console lines, JUnit XML, and vendor expectation files.

Expectation file (owned by the vendor, kept outside the suite; YAML or JSON):
    refusals/R11/1: {status: FAIL, bug: https://tracker.example/123}
    assembly/A07:   {status: FAIL, bug: https://tracker.example/124}   # every case under it
A case expected to FAIL that fails is reported as an expected failure and does not fail
the run; one that passes is an *unexpected pass*, which does (the expectation is stale).
"""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path
from typing import Any, TextIO
from xml.etree import ElementTree as ET

import yaml

from .cases import spec_rows
from .runner import Result

__all__ = ["load_expectations", "apply_expectations", "print_result", "print_summary", "write_junit", "exit_code", "format_failure"]


def load_expectations(path: str | Path) -> dict[str, dict[str, Any]]:
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: an expectation file maps case ids to {{status: FAIL, bug: URL}}")
    out = {}
    for k, v in data.items():
        if not isinstance(v, dict) or str(v.get("status", "")).upper() != "FAIL":
            raise ValueError(f"{path}: {k}: expected {{status: FAIL, bug: URL}}")
        out[str(k).rstrip("/")] = v
    return out


def _expectation(case_id: str, exp: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    best = None
    for k, v in exp.items():
        if (case_id == k or case_id.startswith(k + "/")) and (best is None or len(k) > len(best[0])):
            best = (k, v)
    return best[1] if best else None


def apply_expectations(results: list[Result], exp: dict[str, dict[str, Any]]) -> None:
    for r in results:
        e = _expectation(r.id, exp)
        if e is None:
            continue
        bug = str(e.get("bug", "(no bug link)"))
        if r.verdict in ("Fail", "Non-Strict"):
            r.expected_failure = bug
        elif r.verdict == "Pass":
            r.unexpected_pass = True
            r.note = f"expected to FAIL ({bug}); remove the expectation"


def format_failure(r: Result) -> str:
    rows = spec_rows()
    lines = [f"  {r.case.title}"]
    for rid in r.case.rows[:1]:
        row = rows.get(rid)
        src = r.case.data["source"]
        lines.append(f"  Requirement {rid} ({r.case.level}, {src}): {r.case.quote!r}")
        if row is not None and row.quote != r.case.quote:
            lines.append(f"  Spec row {rid}: {row.quote!r}")
    for f in r.failures:
        lines.append(f"  - {f.what}")
        lines.append(textwrap.indent(f"Expected: {f.expected}\nActual:   {f.actual}", "      "))
    return "\n".join(lines)


def _label(r: Result) -> str:
    if r.unexpected_pass:
        return "UNEXPECTED-PASS"
    if r.expected_failure:
        return "EXPECTED-FAIL"
    return r.verdict.upper()


def print_result(r: Result, out: TextIO, *, verbose: bool = False) -> None:
    out.write(f"{_label(r):<15} {r.id:<28} {', '.join(r.case.rows):<14} {r.duration_ms:7.0f} ms  {r.case.title}\n")
    if r.note:
        out.write(f"  note: {r.note}\n")
    if r.failures and (r.verdict in ("Fail", "Non-Strict") or verbose or r.verdict == "Info"):
        out.write(format_failure(r) + "\n")
    if r.expected_failure:
        out.write(f"  expected failure: {r.expected_failure}\n")
    out.flush()


def print_summary(results: list[Result], out: TextIO, *, version: str, label: str) -> None:
    c = Counter(_label(r) for r in results)
    parts = ", ".join(f"{k.lower()} {v}" for k, v in sorted(c.items()))
    out.write(f"narwhal conformance {version} [{label}]: {len(results)} cases: {parts}\n")


def exit_code(results: list[Result]) -> int:
    bad = [r for r in results if (r.verdict == "Fail" and not r.expected_failure) or r.unexpected_pass]
    return 1 if bad else 0


def write_junit(results: list[Result], path: str | Path, *, version: str, label: str) -> None:
    suites = ET.Element("testsuites", name=f"narwhal-conformance {version}")
    by_table: dict[str, list[Result]] = {}
    for r in results:
        by_table.setdefault(r.id.split("/")[0], []).append(r)
    for table, rs in by_table.items():
        s = ET.SubElement(suites, "testsuite", name=f"{table} [{label}]", tests=str(len(rs)))
        props = ET.SubElement(s, "properties")
        ET.SubElement(props, "property", name="suite_version", value=version)
        fails = skipped = 0
        total = 0.0
        for r in rs:
            total += r.duration_ms / 1000.0
            tc = ET.SubElement(s, "testcase", classname=f"narwhal_conformance.{table}", name=f"{r.id} [{label}]", time=f"{r.duration_ms / 1000.0:.3f}")
            if r.unexpected_pass:
                fails += 1
                ET.SubElement(tc, "failure", message="unexpected pass", type="UnexpectedPass").text = r.note
            elif r.expected_failure:
                skipped += 1
                ET.SubElement(tc, "skipped", message=f"expected failure: {r.expected_failure}").text = format_failure(r)
            elif r.verdict == "Fail":
                fails += 1
                first = r.failures[0] if r.failures else None
                msg = f"{', '.join(r.case.rows)}: {first.what}" if first else "failed"
                ET.SubElement(tc, "failure", message=msg, type="Fail").text = format_failure(r)
            elif r.verdict == "Missing":
                skipped += 1
                ET.SubElement(tc, "skipped", message=f"Missing: {r.note}")
            elif r.verdict in ("Non-Strict", "Info"):
                ET.SubElement(tc, "system-out").text = f"{r.verdict}\n" + (format_failure(r) if r.failures else "")
        s.set("failures", str(fails))
        s.set("skipped", str(skipped))
        s.set("errors", "0")
        s.set("time", f"{total:.3f}")
    ET.indent(suites)
    Path(path).write_bytes(ET.tostring(suites, encoding="utf-8", xml_declaration=True))
