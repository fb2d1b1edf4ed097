"""Fuzzing the HTTP surface with schemathesis (P14): live against a router URL
(`narwhal conformance --fuzz N`, schemathesis.openapi.from_url) and in-process in tests
(schemathesis.openapi.from_asgi), with the same custom checks:

  * error_envelope: every non-2xx answer is exactly {"error": {message, type, param,
    code}}, with a code and a type from the generated set (narwhal_generated.errors);
  * no_internal_error: no answer is a 500 (row H06 is a router bug);
  * server_error_matches_row: a 5xx answer carries the code of a row whose status is that
    5xx (R01, R09, R12, R13, E01-E04, E06, E07), never a 5xx for a request the tables
    answer with a 4xx;
and, after the run, the books balance: narwhal_requests_offered_total equals the sum of
narwhal_requests_terminal_total{class} once the router is at rest.

Every request has a client timeout and each operation a bounded number of examples;
failures are collected (one per check, operation and status), never shrunk.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from narwhal_generated import errors as E

from .books import parse_metrics
from .profiles import MODEL

__all__ = ["FuzzReport", "fuzz_schema", "fuzz_target", "CHECKS", "error_envelope", "no_internal_error", "server_error_matches_row", "books_balance"]

_ENVELOPE_KEYS = {"message", "type", "param", "code"}
_COMPLETION_WEIGHT = 4  # the completion routes get this many times the examples


class _Problem(AssertionError):
    pass


def _json(response: Any) -> Any:
    try:
        return response.json()
    except Exception:  # noqa: BLE001 - any parse failure is "not JSON"
        return None


@schemathesis.check
def error_envelope(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every non-2xx answer is the generated error envelope with a generated code."""
    if response.status_code < 400:
        return None
    body = _json(response)
    err = body.get("error") if isinstance(body, dict) else None
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(err, dict) and set(err) == _ENVELOPE_KEYS):
        raise _Problem(f"{response.status_code} body is not the error envelope: {response.text[:200]!r}")
    if err["code"] not in E.CODES:
        raise _Problem(f"error.code {err['code']!r} is not a generated code")
    if err["type"] not in E.TYPES:
        raise _Problem(f"error.type {err['type']!r} is not a generated type")
    if not isinstance(err["message"], str) or not err["message"]:
        raise _Problem("error.message is empty")
    return None


@schemathesis.check
def no_internal_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """No answer is a 500 (H06: a router bug)."""
    if response.status_code == 500:
        raise _Problem(f"500 internal error: {response.text[:300]!r}")
    return None


@schemathesis.check
def server_error_matches_row(ctx: Any, response: Any, case: Any) -> bool | None:
    """A 5xx answer names a row whose status is exactly that 5xx."""
    if response.status_code < 500 or response.status_code == 500:
        return None
    body = _json(response)
    code = body.get("error", {}).get("code") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
    row = E.BY_CODE.get(code) if isinstance(code, str) else None
    if row is None or row.status != response.status_code:
        raise _Problem(f"{response.status_code} with code {code!r}: no row answers that status with that code")
    return None


CHECKS = [error_envelope, no_internal_error, server_error_matches_row]


@dataclass
class FuzzReport:
    requests: int = 0
    by_operation: dict[str, int] = field(default_factory=dict)
    statuses: dict[int, int] = field(default_factory=dict)
    codes: set[str] = field(default_factory=set)
    problems: dict[str, str] = field(default_factory=dict)  # key -> first reproducer

    def summary(self) -> str:
        ops = ", ".join(f"{k} {v}" for k, v in sorted(self.by_operation.items()))
        rows = sorted(E.BY_CODE[c].id for c in self.codes if c in E.BY_CODE)
        lines = [f"fuzz: {self.requests} requests over {len(self.by_operation)} operations; statuses {dict(sorted(self.statuses.items()))}; rows reached: {', '.join(rows) or 'none'}", f"fuzz: per operation: {ops}"]
        for k, v in self.problems.items():
            lines.append(f"fuzz problem: {k}\n    {v}")
        if not self.problems:
            lines.append("fuzz: no problem found")
        return "\n".join(lines)


def _record(report: FuzzReport, label: str, response: Any) -> None:
    report.requests += 1
    report.by_operation[label] = report.by_operation.get(label, 0) + 1
    report.statuses[response.status_code] = report.statuses.get(response.status_code, 0) + 1
    body = _json(response)
    if isinstance(body, dict) and isinstance(body.get("error"), dict) and isinstance(body["error"].get("code"), str):
        report.codes.add(body["error"]["code"])


def fuzz_schema(
    schema: Any,
    *,
    examples: int,
    call: Callable[[Any], Any],
    report: FuzzReport | None = None,
    seed: int | None = 0,
    skip: Callable[[str], bool] | None = None,
) -> FuzzReport:
    """Generate `examples` cases per operation of `schema` (positive and negative data;
    the completion routes four times as many), send each with `call(case)`, and run
    CHECKS on every answer."""
    report = report or FuzzReport()
    for result in schema.get_all_operations():
        op = result.ok()
        label = op.label
        if skip is not None and skip(label):
            continue
        strategy = op.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE) | op.as_strategy(generation_mode=schemathesis.GenerationMode.NEGATIVE)
        if label.endswith("completions"):
            # half the bodies name the configured model, so fuzzing gets past R05
            strategy = st.tuples(strategy, st.booleans()).map(_with_model)

        n = examples * _COMPLETION_WEIGHT if label.endswith("completions") else examples
        _fuzz_operation(report, label, strategy, n, call, seed)
    return report


def _with_model(pair: tuple[Any, bool]) -> Any:
    case, fix = pair
    if fix and isinstance(case.body, dict):
        case.body["model"] = MODEL
    return case


def _fuzz_operation(report: FuzzReport, label: str, strategy: Any, examples: int, call: Callable[[Any], Any], seed: int | None) -> None:
    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is not None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(strategy)
    def one(case: Any) -> None:
        try:
            response = call(case)
        except Exception as e:  # noqa: BLE001 - a transport failure is a finding too
            report.problems.setdefault(f"{label}: transport error {type(e).__name__}", str(e)[:300])
            return
        _record(report, label, response)
        for chk in CHECKS:
            try:
                chk(None, response, case)
            except _Problem as p:
                key = f"{label}: {chk.__name__}: {response.status_code}"
                if key not in report.problems:
                    try:
                        repro = case.as_curl_command()
                    except Exception:  # noqa: BLE001
                        repro = repr(case)
                    report.problems[key] = f"{p}\n    reproduce: {repro}"

    one()


def books_balance(read_metrics: Callable[[], str], timeout_s: float = 15.0) -> str | None:
    """None once offered == sum(terminal) at rest, or when the router keeps no books (a
    capability); else what the books say."""
    end = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < end:
        b = parse_metrics(read_metrics())
        if b is None:
            return None
        if b.balanced:
            return None
        last = f"offered {b.offered:g} != sum of terminal classes {sum(b.terminal.values()):g} ({b.terminal})"
        time.sleep(0.1)
    return last


def fuzz_target(target: str, *, examples: int, port_base: int | None = None, timeout_s: float = 5.0, headers: dict[str, str] | None = None) -> FuzzReport:
    """Live mode: fuzz the router at `target` through Narwhal's OpenAPI document (the
    target's own /openapi.json when it serves one, else the suite's copy)."""
    import json
    from importlib import resources

    import httpx

    target = target.rstrip("/")
    hdrs = dict(headers or {})
    try:
        served = httpx.get(target + "/openapi.json", headers=hdrs, timeout=5.0)
        doc = served.json() if served.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        doc = None
    if not isinstance(doc, dict) or "paths" not in doc:
        doc = json.loads(resources.files("narwhal_generated").joinpath("openapi.json").read_text())
    schema = schemathesis.openapi.from_dict(doc)

    def call(case: Any) -> Any:
        return case.call(base_url=target, timeout=timeout_s, headers=hdrs or None)

    report = fuzz_schema(schema, examples=examples, call=call)
    problem = books_balance(lambda: httpx.get(target + "/metrics", headers=hdrs, timeout=5.0).text)
    if problem is not None:
        report.problems["books after the run (C01, K01-K08)"] = problem
    return report
