"""Reports: the console lines, the scores, and JUnit XML.

Scores: each case counts in its class, `interoperability` or `narwhal` (the Narwhal
profile): passed / decided, where decided = Pass + Fail + Non-Strict (expected failures
included: they are failures the vendor knows of). N/A and Info cases are counted apart.
The books (accounting) are a third score over the cases that carry an accounting check.

JUnit: one `testsuite` per table and one `testcase` per case; Fail and unexpected passes
are `failure`; N/A and expected failures are `skipped` (with the reason); Non-Strict and
Info pass with their details in `system-out`. Every testcase carries the properties
class, rows, level, verdict, books (and na_reason). A `books` testsuite holds one
testcase per case whose books were checked.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from xml.etree import ElementTree as ET

from .cases import spec_rows
from .expectations import expectation_for
from .runner import Mismatch, Result

__all__ = ["apply_expectations", "print_result", "print_summary", "write_junit", "exit_code", "format_failure", "scores", "Score", "CLASS_LABEL"]

CLASS_LABEL = {"interoperability": "interoperability", "narwhal": "Narwhal profile"}


@dataclass(frozen=True, slots=True)
class Score:
    passed: int
    decided: int

    def __str__(self) -> str:
        return f"{self.passed}/{self.decided}"


def apply_expectations(results: list[Result], exp: dict[str, dict[str, Any]]) -> None:
    for r in results:
        e = expectation_for(r.id, exp)
        if e is None or e["status"] != "FAIL":
            continue
        bug = str(e.get("bug", "(no bug link)"))
        if r.verdict in ("Fail", "Non-Strict") or r.books == "Fail":
            r.expected_failure = bug
        elif r.verdict == "Pass":
            r.unexpected_pass = True
            r.note = f"expected to FAIL ({bug}); remove the expectation"


def scores(results: list[Result]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cls in CLASS_LABEL:
        rs = [r for r in results if r.cls == cls and r.verdict in ("Pass", "Fail", "Non-Strict")]
        out[cls] = Score(sum(1 for r in rs if r.verdict == "Pass"), len(rs))
    books = [r for r in results if r.books in ("Pass", "Fail", "Non-Strict")]
    out["books"] = Score(sum(1 for r in books if r.books == "Pass"), len(books))
    out["na"] = sum(1 for r in results if r.verdict == "N/A")
    out["info"] = sum(1 for r in results if r.verdict == "Info")
    out["books_na"] = sum(1 for r in results if r.books == "N/A")
    return out


def _mismatches(ms: list[Mismatch]) -> list[str]:
    lines = []
    for f in ms:
        lines.append(f"  - {f.what}")
        lines.append(textwrap.indent(f"Expected: {f.expected}\nActual:   {f.actual}", "      "))
    return lines


def format_failure(r: Result, *, books: bool = False) -> str:
    rows = spec_rows()
    lines = [f"  {r.case.title}"]
    for rid in r.case.rows[:1]:
        row = rows.get(rid)
        lines.append(f"  Requirement {rid} ({r.case.level}, {r.case.data['source']}): {r.case.quote!r}")
        if row is not None and row.quote != r.case.quote:
            lines.append(f"  Spec row {rid}: {row.quote!r}")
    lines += _mismatches(r.books_failures if books else r.failures)
    if not books and r.books_failures:
        lines.append("  Books (accounting, reported apart):")
        lines += _mismatches(r.books_failures)
    return "\n".join(lines)


def _label(r: Result) -> str:
    if r.unexpected_pass:
        return "UNEXPECTED-PASS"
    if r.expected_failure:
        return "EXPECTED-FAIL"
    return r.verdict.upper()


def print_result(r: Result, out: TextIO, *, verbose: bool = False) -> None:
    books = "" if r.books is None else f" books {r.books}"
    cls = "interop" if r.cls == "interoperability" else "narwhal"
    out.write(f"{_label(r):<15} {r.id:<28} {', '.join(r.case.rows):<14} {cls:<7} {r.duration_ms:7.0f} ms  {r.case.title}{books}\n")
    if r.note:
        out.write(f"  {'N/A' if r.verdict == 'N/A' else 'note'}: {r.note}\n")
    if (r.failures and (r.verdict in ("Fail", "Non-Strict", "Info") or verbose)) or r.books in ("Fail", "Non-Strict"):
        out.write(format_failure(r) + "\n")
    if r.unchecked and verbose:
        out.write("".join(f"  unchecked: {u}\n" for u in r.unchecked))
    if r.expected_failure:
        out.write(f"  expected failure: {r.expected_failure}\n")
    out.flush()


def print_summary(results: list[Result], out: TextIO, *, version: str, label: str) -> None:
    s = scores(results)
    c = Counter(_label(r) for r in results)
    extra = ", ".join(f"{k.lower()} {v}" for k, v in sorted(c.items()) if k in ("EXPECTED-FAIL", "UNEXPECTED-PASS"))
    books = f"books {s['books']}" + (f" (N/A {s['books_na']})" if s["books_na"] else "")
    out.write(f"narwhal conformance {version} [{label}]: {len(results)} cases: interoperability {s['interoperability']} · "
              f"Narwhal profile {s['narwhal']} · N/A {s['na']} · info {s['info']} · {books}" + (f" · {extra}" if extra else "") + "\n")


def exit_code(results: list[Result]) -> int:
    bad = [r for r in results if ((r.verdict == "Fail" or r.books == "Fail") and not r.expected_failure) or r.unexpected_pass]
    return 1 if bad else 0


def _props(tc: ET.Element, items: dict[str, str]) -> None:
    props = ET.SubElement(tc, "properties")
    for k, v in items.items():
        ET.SubElement(props, "property", name=k, value=v)


def write_junit(results: list[Result], path: str | Path, *, version: str, label: str, run_props: dict[str, str] | None = None) -> None:
    suites = ET.Element("testsuites", name=f"narwhal-conformance {version}")
    by_table: dict[str, list[Result]] = {}
    for r in results:
        by_table.setdefault(r.id.split("/")[0], []).append(r)
    s = scores(results)
    summary = {"suite_version": version, "run": label, **(run_props or {}),
               "score_interoperability": str(s["interoperability"]), "score_narwhal": str(s["narwhal"]), "score_books": str(s["books"]), "na": str(s["na"])}
    for table, rs in by_table.items():
        suite = ET.SubElement(suites, "testsuite", name=f"{table} [{label}]", tests=str(len(rs)))
        _props(suite, summary)
        fails = skipped = 0
        total = 0.0
        for r in rs:
            total += r.duration_ms / 1000.0
            tc = ET.SubElement(suite, "testcase", classname=f"narwhal_conformance.{table}", name=f"{r.id} [{label}]", time=f"{r.duration_ms / 1000.0:.3f}")
            _props(tc, {"class": r.cls, "rows": ",".join(r.case.rows), "level": r.case.level, "verdict": _label(r), "books": r.books or "none",
                        **({"na_reason": r.note} if r.verdict == "N/A" else {}), **({"unchecked": " | ".join(r.unchecked)} if r.unchecked else {})})
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
            elif r.verdict == "N/A":
                skipped += 1
                ET.SubElement(tc, "skipped", message=f"N/A: {r.note}")
            elif r.verdict in ("Non-Strict", "Info"):
                ET.SubElement(tc, "system-out").text = f"{r.verdict}\n" + (format_failure(r) if r.failures else "")
        suite.set("failures", str(fails))
        suite.set("skipped", str(skipped))
        suite.set("errors", "0")
        suite.set("time", f"{total:.3f}")
    checked = [r for r in results if r.books is not None]
    if checked:
        suite = ET.SubElement(suites, "testsuite", name=f"books [{label}]", tests=str(len(checked)))
        _props(suite, summary)
        fails = skipped = 0
        for r in checked:
            tc = ET.SubElement(suite, "testcase", classname="narwhal_conformance.books", name=f"{r.id} books [{label}]", time="0")
            _props(tc, {"class": "narwhal", "rows": ",".join(r.case.rows), "verdict": r.books or "none"})
            if r.books == "N/A":
                skipped += 1
                ET.SubElement(tc, "skipped", message="N/A: the router exposes no books on /metrics")
            elif r.books == "Fail" and not r.expected_failure:
                fails += 1
                ET.SubElement(tc, "failure", message=r.books_failures[0].what if r.books_failures else "books", type="Fail").text = format_failure(r, books=True)
        suite.set("failures", str(fails))
        suite.set("skipped", str(skipped))
        suite.set("errors", "0")
    ET.indent(suites)
    Path(path).write_bytes(ET.tostring(suites, encoding="utf-8", xml_declaration=True))
