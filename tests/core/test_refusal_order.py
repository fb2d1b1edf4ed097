"""The refusal table decides (spec/tables/refusals.yaml rule 2): reorder two rows in a copy
of the table, regenerate in process, and the router's answer follows.

Every pair of rows one request can make hold together is derived from `REQUIRES` (what
each row's fact needs of the request: two rows can hold together unless they need
different values of one thing), not listed by hand. For each pair, a copy of the YAML
with the two rows (and their `order`) swapped is regenerated through the specgen's
Python API, and one request on which both hold (and the rows their setups imply, `ALSO`)
goes through the real path in process: the door's arrival walk (authority/door.py), the
body's facts (core/requests.py `body_facts`, as the HTTP endpoint computes them) and the
admission walk with placement (`LocalEntry.admit_now`, core/placement.py). The answer
must be the first of the holding rows in the walked table's order, in both orders. The
wait rows (R12, R13) are walked while a request waits (`Scheduler.expiry`). The books
balance after every request.
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest

from narwhal.authority.authority import Authority
from narwhal.authority.door import LocalDoor, LocalEntry
from narwhal.config import parse_config
from narwhal.core import refusals
from narwhal.core.clock import ManualClock
from narwhal.core.lease import Order
from narwhal.core.quota import Limits, Quotas
from narwhal.core.requests import body_facts
from narwhal.core.tickets import Enqueued, Refuse, Work
from narwhal.upstream.engines import EngineSpec
from narwhal_generated import errors as E

from . import tablecopy

WAIT_ROWS = {E.R12, E.R13}

# What each row's fact needs of one request: `key` (missing, invalid, valid: a tenant is
# known only from a valid key; without auth every request is the tenant default, valid),
# `body` (over the limit: not read, so not parsed; parsed), `engine` (an eligible one to
# project on, or none), `ends` (refused at once, or after waiting in the queue). Rows
# that need nothing of a thing hold with any value of it.
REQUIRES: dict[E.ErrorRow, dict[str, str]] = {
    E.R01: {"ends": "at_once"},
    E.R15: {"key": "missing", "ends": "at_once"},
    E.R16: {"key": "invalid", "ends": "at_once"},
    E.R17: {"key": "valid", "ends": "at_once"},
    E.R18: {"key": "valid", "ends": "at_once"},
    E.R02: {"ends": "at_once"},
    E.R03: {"body": "over_limit", "ends": "at_once"},
    E.R04: {"ends": "at_once"},  # its header half holds whatever the body
    E.R05: {"body": "parsed", "ends": "at_once"},
    E.R06: {"body": "parsed", "ends": "at_once"},
    E.R07: {"body": "parsed", "ends": "at_once"},
    E.R19: {"key": "valid", "body": "parsed", "ends": "at_once"},
    E.R08: {"body": "parsed", "engine": "eligible", "ends": "at_once"},
    E.R09: {"body": "parsed", "engine": "none", "ends": "at_once"},
    E.R10: {"body": "parsed", "engine": "eligible", "ends": "at_once"},
    E.R20: {"key": "valid", "body": "parsed", "engine": "eligible", "ends": "at_once"},
    E.R11: {"body": "parsed", "engine": "eligible", "ends": "at_once"},
    E.R14: {"body": "parsed", "engine": "eligible", "ends": "at_once"},
    E.R12: {"body": "parsed", "engine": "eligible", "ends": "waited"},
    E.R13: {"body": "parsed", "engine": "eligible", "ends": "waited"},
}

# rows a row's setup makes hold too (the prompt alone over the budget is a projection
# over it as well)
ALSO: dict[E.ErrorRow, set[E.ErrorRow]] = {E.R08: {E.R10}}


def _together(x: E.ErrorRow, y: E.ErrorRow) -> bool:
    rx, ry = REQUIRES[x], REQUIRES[y]
    return all(rx[k] == ry[k] for k in rx.keys() & ry.keys())


PAIRS = [(x, y) for x, y in itertools.combinations(E.REFUSALS, 2) if _together(x, y)]


def test_every_row_has_its_requirements_and_the_pairs_are_many() -> None:
    assert set(REQUIRES) == set(E.REFUSALS)
    assert len(PAIRS) > 100  # most rows can hold together; the derivation keeps them
    assert (E.R05, E.R06) in PAIRS and (E.R15, E.R16) not in PAIRS and (E.R03, E.R05) not in PAIRS


# -- a reordered copy of the table, regenerated ------------------------------------------------


def swapped_text(x: E.ErrorRow, y: E.ErrorRow) -> str:
    return tablecopy.swapped("refusals", x.id, y.id, renumber=True)


def regenerated(text: str) -> tuple[E.ErrorRow, ...]:
    """generated/errors.py rendered with `text` as refusals.yaml; its REFUSALS in their new
    order, as the router's own row constants."""
    mod = tablecopy.regenerated(text, "errors")
    out = tuple(E.ROWS[r.id] for r in mod.REFUSALS)
    for new, ours in zip(mod.REFUSALS, out, strict=True):  # the same rows: only the order moved
        assert (new.stage, new.when, new.status, new.code, new.counter) == (ours.stage, ours.when, ours.status, ours.code, ours.counter)
    return out


def test_the_unchanged_table_regenerates_to_the_generated_order() -> None:
    assert regenerated((tablecopy.ROOT / "spec" / "tables" / "refusals.yaml").read_text()) == E.REFUSALS


# -- one request, in process -----------------------------------------------------------------


class Request:
    """What a scenario sets: the request, and the router's state around it."""

    def __init__(self) -> None:
        self.denied: E.ErrorRow | None = None
        self.tenant: str | None = None
        self.limits: dict[str, Any] = {}
        self.over_limit = False
        self.ttft: str | None = None
        self.body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}
        self.prompt_bytes = 300
        self.budget_ms: float | None = None  # the request's TTFT budget (else the header's or the default)
        self.config: dict[str, Any] = {}
        self.router: list[Any] = []  # changes to the authority before the request


def _not_ready(q: Request) -> None:
    q.router.append(lambda a, e: setattr(a.state, "operator", "standby"))


def _retention_full(q: Request) -> None:
    q.router.append(lambda a, e: setattr(a, "held", a.config.admission.http_retention_limit))


def _in_flight_full(q: Request) -> None:
    q.limits["max_in_flight"] = 1
    q.router.append(lambda a, e: setattr(a.quotas.book("acme", 0.0), "in_flight", 1))


def _rate_exceeded(q: Request) -> None:
    q.limits["requests_per_s"] = 1.0
    q.router.append(lambda a, e: a.quotas.book("acme", 0.0).requests.take(1.0, 0.0))


def _tokens_exceeded(q: Request) -> None:
    q.limits["tokens_per_min"] = 600
    q.router.append(lambda a, e: a.quotas.book("acme", 0.0).tokens.take(600, 0.0))  # the minute's budget spent


def _busy(a: Authority, e: Any) -> None:
    e.prefill_in_use = e.prefill_slots  # its next request would queue


def _tenant_queue_full(q: Request) -> None:
    q.limits["queue_limit"] = 0
    q.router.append(_busy)


def _queue_full(q: Request) -> None:
    q.config["queue_limit"] = 0
    q.router.append(_busy)


def _backlog(q: Request) -> None:
    q.router.append(lambda a, e: setattr(e, "busy_until", 60.0))  # a minute of prefill ahead of it


def _tpot(q: Request) -> None:
    q.config["prediction"] = {**q.config.get("prediction", {}), "tpot_budget_ms": 0.001}


def _set(attr: str, value: Any) -> Any:
    return lambda q: setattr(q, attr, value)


def _body(**fields: Any) -> Any:
    return lambda q: q.body.update(fields)


SETUP: dict[E.ErrorRow, Any] = {
    E.R01: _not_ready,
    E.R15: _set("denied", E.R15),
    E.R16: _set("denied", E.R16),
    E.R17: _in_flight_full,
    E.R18: _rate_exceeded,
    E.R02: _retention_full,
    E.R03: _set("over_limit", True),
    E.R04: _set("ttft", "soon"),
    E.R05: _body(model="another"),
    E.R06: _body(n=2),
    E.R07: _body(modalities=["text", "audio"]),
    E.R19: _tokens_exceeded,
    E.R08: _set("budget_ms", 0.0),
    E.R09: lambda q: q.router.append(lambda a, e: setattr(e, "healthy", False)),
    E.R10: _backlog,
    E.R20: _tenant_queue_full,
    E.R11: _queue_full,
    E.R14: _tpot,
}


def _authority(q: Request) -> tuple[Authority, Any]:
    cfg = parse_config({"admission": {"mode": "predictive", "prediction": {"profile_on_start": False, **q.config.pop("prediction", {})}, **q.config}})
    a = Authority(cfg, [EngineSpec("u0", "http://127.0.0.1:9", "unified", "vllm", None, None)], clock=ManualClock(0.0))
    a.quotas = Quotas({"acme": Limits(**q.limits)})  # tenants configured: the tenant rows apply
    e = a.engines["u0"]
    for change in q.router:
        change(a, e)
    return a, e


def answer(rows: tuple[E.ErrorRow, ...], setups: list[E.ErrorRow]) -> E.ErrorRow | None:
    """The row the router answers one request with, the table walked in `rows`' order."""
    q = Request()
    for r in setups:
        SETUP[r](q)
    q.tenant = None if q.denied is not None else "acme"
    a, _ = _authority(q)
    held = a.held
    with refusals.using(rows):
        got = LocalDoor(a).arrive_now(0.0, None if q.denied is None else Refuse(q.denied), q.tenant)
        if isinstance(got, LocalEntry):
            facts, parsed, hv = body_facts("chat", orjson.dumps(q.body), q.ttft, None, too_large=1024 if q.over_limit else None,
                                           model="m", budget_ms=a.config.admission.ttft_budget_ms,
                                           max_target_ms=a.config.admission.max_ttft_target_ms)
            budget = hv.ttft_target_ms if hv is not None and hv.ttft_target_ms is not None else a.config.admission.ttft_budget_ms
            budget = budget if q.budget_ms is None else q.budget_ms
            order = None if parsed is None else Order("chat", q.prompt_bytes, None, 16, float(budget), 0.0, None, tenant=q.tenant)
            lease = got.admit_now(order, facts)
            got.end(lease.row.counter if isinstance(lease, Refuse) else "completed")
            got = lease
    snap = a.books.snapshot()
    assert snap["offered"] == 1 and sum(snap["terminal"].values()) == 1  # the books balance
    assert a.held == held  # what it held is freed at its end; a refused arrival took none
    if a.quotas is not None and "acme" in a.quotas.books:
        assert a.quotas.books["acme"].in_flight == (1 if E.R17 in setups else 0)
    return got.row if isinstance(got, Refuse) else None


def _first(rows: tuple[E.ErrorRow, ...], holding: set[E.ErrorRow]) -> E.ErrorRow:
    return next(r for r in rows if r in holding)


@pytest.mark.parametrize("row", [r for r in E.REFUSALS if r not in WAIT_ROWS], ids=lambda r: r.id)
def test_each_setup_makes_its_row_hold_alone(row: E.ErrorRow) -> None:
    assert answer(E.REFUSALS, [row]) is row


def test_no_setup_is_admitted() -> None:
    assert answer(E.REFUSALS, []) is None


@pytest.mark.parametrize(("x", "y"), [p for p in PAIRS if not (set(p) & WAIT_ROWS)], ids=lambda r: r.id)
def test_swapping_two_rows_that_hold_together_swaps_the_answer(x: E.ErrorRow, y: E.ErrorRow) -> None:
    holding = {x, y, *ALSO.get(x, ()), *ALSO.get(y, ())}
    swapped = regenerated(swapped_text(x, y))
    assert swapped.index(x) > swapped.index(y)
    before, after = answer(E.REFUSALS, [x, y]), answer(swapped, [x, y])
    assert before is _first(E.REFUSALS, holding) and after is _first(swapped, holding)
    if holding == {x, y}:  # the pair alone holds: the answer is the other row now
        assert (before, after) == (x, y)


@pytest.mark.parametrize("order", ["generated", "swapped"])
def test_the_wait_rows_follow_the_table(order: str) -> None:
    """R12 and R13 expire together for a request waiting with admission.max_wait_ms and
    its deadline both past: the table's order names the row."""
    rows = E.REFUSALS if order == "generated" else regenerated(swapped_text(E.R12, E.R13))
    q = Request()
    _queue_full(q)
    q.config["queue_limit"] = 8
    a, _ = _authority(q)
    with refusals.using(rows):
        d = a.scheduler.admit(Work("chat", 10, 4, 60_000.0, 0.0, 1.0, 1.0), 0.0)
        assert isinstance(d, Enqueued)
        assert a.scheduler.expiry(d.ticket, 5.0) is _first(rows, WAIT_ROWS)


def test_a_body_row_above_the_head_rows_reads_the_body_first() -> None:
    """The issue's example: with R03 moved above R01, a router that is not ready answers
    R03 for a body over the limit (the arrival's walk stops at R03, undecided), and R01
    for any other body (the walk goes on over the head rows after the body)."""
    rows = regenerated(swapped_text(E.R01, E.R03))
    assert answer(rows, [E.R01, E.R03]) is E.R03
    assert answer(rows, [E.R01]) is E.R01
    assert answer(rows, [E.R01, E.R05]) is E.R01


def test_a_refused_request_takes_nothing_a_row_below_its_own_would_have() -> None:
    """R02 below R05 (swapped): a body refused by R05 never took retention, and the
    tenant's in-flight count and rate token are untouched by a refused arrival."""
    rows = regenerated(swapped_text(E.R02, E.R05))
    assert answer(rows, [E.R05]) is E.R05  # answer() asserts held == 0 after the end
    assert answer(rows, [E.R02, E.R05]) is E.R05


@pytest.mark.parametrize("order", ["generated", "swapped"])
def test_authority_lost_while_the_body_arrived_is_placed_by_the_table(order: str) -> None:
    """The router hands on its authority (standby) after the arrival's walk and before
    admission, and the body names an unknown model: R01 above R05 (generated) answers
    R01, its fact read again; R05 above R01 answers R05."""
    from types import SimpleNamespace

    rows = E.REFUSALS if order == "generated" else regenerated(swapped_text(E.R01, E.R05))
    q = Request()
    SETUP[E.R05](q)
    a, _ = _authority(q)
    with refusals.using(rows):
        entry = LocalDoor(a).arrive_now(0.0, None, "acme")
        assert isinstance(entry, LocalEntry)
        a.state.election = SimpleNamespace(fenced=lambda now: False, standby=lambda now: True)
        facts, parsed, _ = body_facts("chat", orjson.dumps(q.body), None, None, too_large=None, model="m",
                                      budget_ms=2000, max_target_ms=60000)
        got = entry.admit_now(Order("chat", 300, None, 16, 2000.0, 0.0, None, tenant="acme"), facts)
        assert isinstance(got, Refuse)
        entry.end(got.row.counter)
    assert got.row is (E.R01 if order == "generated" else E.R05)
    snap = a.books.snapshot()
    assert snap["offered"] == 1 and sum(snap["terminal"].values()) == 1 and a.held == 0
