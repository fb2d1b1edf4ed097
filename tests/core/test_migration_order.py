"""The migration table decides (spec/tables/migration.yaml: first match): swap two G rows
that can hold together in a copy of the table, regenerate in process, and the decision
(and its outcome) follows. Every pair of rows is tried whose facts one broken stream can
hold together: G01-G09, G12 and G13 all can (and G10 or G11 with them), G10 and G11 never (the
continuation is placed or it is not)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from narwhal.core.migration import MIGRATE, Progress, obstacle, placed
from narwhal_generated import migration as G

from . import tablecopy

EXCLUSIVE = {frozenset((G.G10, G.G11))}  # placed, or not
ALSO = {G.G01: {G.G03}}  # no attempts allowed: every attempt is spent too
PAIRS = [(x, y) for x, y in itertools.combinations(G.ROWS, 2) if frozenset((x, y)) not in EXCLUSIVE]


class Break:
    def __init__(self) -> None:
        self.route = "completion"
        self.body: dict[str, Any] = {"model": "m", "prompt": "hi", "stream": True, "temperature": 0}
        self.p: dict[str, Any] = {"output_ids": (1000, 1001), "text": "Hello wor", "plain": True, "attempts": 0, "deadline_left_ms": None, "max_tokens": None}
        self.kw: dict[str, Any] = {"max_attempts": 1, "token_ids": True, "projected_ttft_ms": 50.0}
        self.ok = True


SETUP: dict[G.MigrationRow, Any] = {
    G.G01: lambda b: b.kw.update(max_attempts=0),
    G.G02: lambda b: b.kw.update(token_ids=False),
    G.G03: lambda b: b.p.update(attempts=1),
    G.G13: lambda b: b.p.update(max_tokens=2),  # both output tokens out already
    G.G04: lambda b: b.p.update(deadline_left_ms=10.0),
    G.G05: lambda b: b.body.update(echo=True),
    G.G06: lambda b: b.body.update(logprobs=2),
    G.G07: lambda b: b.body.update(guided_json={}),
    G.G08: lambda b: b.p.update(plain=False),
    G.G09: lambda b: b.body.update(stop=["world"]),
    G.G12: lambda b: b.body.update(prompt=["hi", "there"]),
    G.G10: lambda b: setattr(b, "ok", False),
    G.G11: lambda b: None,  # placed: carry on holds
}


def decide(rows: tuple[G.MigrationRow, ...], setups: list[G.MigrationRow]) -> G.MigrationRow:
    """What core/migration.py decides for one break, the table walked in `rows`' order:
    before placement, and (when nothing decided) after it, as worker/request.py calls it."""
    b = Break()
    for r in setups:
        SETUP[r](b)
    p = Progress(**b.p)
    got = obstacle(b.route, b.body, p, rows=rows, **b.kw)
    return got if got is not None else placed(b.route, b.body, p, ok=b.ok, rows=rows, **b.kw)


def swapped_text(x: G.MigrationRow, y: G.MigrationRow) -> str:
    return tablecopy.swapped("migration", x.id, y.id, renumber=False)


def regenerated(text: str) -> tuple[G.MigrationRow, ...]:
    """generated/migration.py rendered with `text` as migration.yaml; its ROWS as ours."""
    return tuple(G.BY_ID[r.id] for r in tablecopy.regenerated(text, "migration").ROWS)


def _first(rows: tuple[G.MigrationRow, ...], holding: set[G.MigrationRow]) -> G.MigrationRow:
    return next(r for r in rows if r in holding)


@pytest.mark.parametrize("row", G.ROWS, ids=lambda r: r.id)
def test_each_setup_decides_its_row(row: G.MigrationRow) -> None:
    holding = {row, *ALSO.get(row, ())}
    assert decide(G.ROWS, [row]) is _first(G.ROWS, holding)


@pytest.mark.parametrize(("x", "y"), PAIRS, ids=lambda r: r.id)
def test_swapping_two_rows_swaps_the_decision(x: G.MigrationRow, y: G.MigrationRow) -> None:
    holding = {x, y, *ALSO.get(x, ()), *ALSO.get(y, ())}
    if G.G10 not in holding:
        holding.add(G.G11)  # placed: carry on holds whatever else does
    swapped = regenerated(swapped_text(x, y))
    assert swapped.index(x) > swapped.index(y)
    before, after = decide(G.ROWS, [x, y]), decide(swapped, [x, y])
    assert before is _first(G.ROWS, holding) and after is _first(swapped, holding)
    if holding <= {x, y, G.G11} and G.G11 not in (x, y) or holding == {x, y}:
        assert (before, after) == (x, y)


def test_carrying_on_is_the_rows_outcome() -> None:
    """A table that puts carry_on above echo carries an echo request on (outcome migrate)."""
    rows = regenerated(swapped_text(G.G05, G.G11))
    got = decide(rows, [G.G05])
    assert got is G.G11 and got.outcome == MIGRATE
    assert decide(G.ROWS, [G.G05]).outcome != MIGRATE
