"""The refusal table decides: one walk over its rows in `order`, and a row's answer.

spec/tables/refusals.yaml rule 2: the first row whose predicate holds decides, and
nothing else decides a refusal. The door (authority/door.py), the body checks
(core/requests.py) and admission (core/admission.py) only compute facts; this module
walks the rows in the table's order over them:

  * Each row's `when` names one predicate; a facts object answers it with the method of
    that name, `fact(row) -> Refuse | None` (the row's refusal with its fields, or None:
    it does not hold). The method is looked up once per (table, facts class), so a walk
    costs one call per row it passes, like the if-chain it replaces.
  * Each row's `stage` (head, body, admission, wait) is when its fact becomes known. A
    walk is made at a stage from where the last one stopped: a row of a later stage stops
    it, undecided so far (`Walk.pos`), and the rows below it, even one that holds, wait
    for it. The wait stage's facts are known at admission (nothing has waited yet: they
    do not hold then), so they never stop an admission walk; they are decided again while
    the request waits (`Table.first_at(WAIT, ...)`).
  * A fact that takes something (R02 retention, R17 an in-flight place, R18 a rate token,
    R19 the prompt's tokens) only looks; the facts object's `take_<predicate>` method
    takes it after the walk has passed the row with no refusal (`Table.take`), so a
    refused request takes nothing the rows above its own would have.
  * The answer comes from the row alone: status, envelope, Retry-After, headers
    (`render`), and the terminal class (`row.counter`).

`TABLE` is the table the router walks (generated REFUSALS); `using(rows)` walks another
order of the same rows for a while (the swap tests: a reordered copy of the spec).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from narwhal_generated import errors as E

from .tickets import Refuse

__all__ = ["Table", "TABLE", "using", "HEAD", "BODY", "ADMISSION", "WAIT", "STAGE",
           "PREDICATES", "REFUSALS", "QUIET_BODY", "first_match", "retry_after_seconds", "envelope", "render", "decode_row"]

REFUSALS: tuple[E.ErrorRow, ...] = E.REFUSALS
PREDICATES: tuple[str, ...] = tuple(r.when for r in REFUSALS)
STAGE: dict[str, int] = {s: i for i, s in enumerate(E.STAGES)}
HEAD, BODY, ADMISSION, WAIT = (STAGE[s] for s in ("head", "body", "admission", "wait"))

_WAIT_BIT = 1 << WAIT
QUIET_BODY = 1 << BODY  # `walk(quiet=...)`: no body row holds

Fact = Callable[[Any, E.ErrorRow], "Refuse | None"]


class Table:
    """Refusal rows in precedence order, compiled for walks."""

    __slots__ = ("rows", "stages", "_known", "_stops", "_facts", "_at", "_takes")

    def __init__(self, rows: Iterable[E.ErrorRow]) -> None:
        self.rows = tuple(rows)
        self.stages = tuple(STAGE[r.stage or "head"] for r in self.rows)
        # the stage a row's fact is known at: its own, but a wait row's at admission
        self._known = tuple(min(s, ADMISSION) for s in self.stages)
        # per stage, from each row: the first row at or after it whose fact is not known yet
        n = len(self.rows)
        self._stops = tuple(tuple(next((j for j in range(i, n) if self._known[j] > st), n) for i in range(n + 1))
                            for st in range(len(STAGE)))
        self._facts: dict[Any, Any] = {}
        self._at = {r.id: i for i, r in enumerate(self.rows)}
        self._takes: dict[type, tuple[tuple[int, Callable[[Any], None]], ...]] = {}

    def facts_of(self, cls: type) -> tuple[tuple[Fact, E.ErrorRow], ...]:
        """(fact, row) of every row, in row order, from a facts class (one method per
        predicate: a predicate with no method is a bug, caught here)."""
        fs = self._facts.get(cls)
        if fs is None:
            fs = self._facts[cls] = tuple((getattr(cls, r.when), r) for r in self.rows)
        return fs

    def walk(self, facts: object, stage: int, start: int = 0, quiet: int = 0) -> tuple[Refuse | None, int]:
        """From row `start`: (the first holding row's Refuse, its index), or (None, the
        index of the first row not known at `stage`; len(rows) when every row passed).
        `quiet`: a mask of stages (1 << stage) whose facts the caller knows hold none for
        this request (no body row held): their rows are passed without a call. The wait
        stage's rows are passed so at admission (nothing has waited yet)."""
        fns = self._facts.get(type(facts)) or self.facts_of(type(facts))
        stop = self._stops[stage][start]
        stages = self.stages
        quiet |= _WAIT_BIT
        for i in range(start, stop):
            if quiet >> stages[i] & 1:
                continue
            fn, row = fns[i]
            got = fn(facts, row)
            if got is not None:
                return got, i
        return None, stop

    def first_at(self, stage: int, facts: object) -> Refuse | None:
        """The first holding row of one stage only, in order (the earlier stages' rows
        were passed when that stage was walked): the wait's R12/R13."""
        key = (type(facts), stage)
        fs = self._facts.get(key)
        if fs is None:  # a stage's facts alone: a facts class may know no other stage
            fs = self._facts[key] = tuple(
                (getattr(type(facts), r.when), r) for i, r in enumerate(self.rows) if self.stages[i] == stage)
        for fn, r in fs:
            got = fn(facts, r)
            if got is not None:
                return got  # type: ignore[no-any-return]
        return None

    def take(self, facts: object, start: int, stop: int) -> None:
        """What the rows in [start, stop) take, taken (the walk passed them)."""
        cls = type(facts)
        ts = self._takes.get(cls)
        if ts is None:
            ts = self._takes[cls] = tuple(
                (i, getattr(cls, "take_" + r.when)) for i, r in enumerate(self.rows) if hasattr(cls, "take_" + r.when))
        for i, fn in ts:
            if start <= i < stop:
                fn(facts)

    def index(self, row: E.ErrorRow) -> int:
        return self._at[row.id]


TABLE = Table(E.REFUSALS)


@contextmanager
def using(rows: Iterable[E.ErrorRow]) -> Iterator[Table]:
    """Walk `rows` (the same rows in another order) instead of the generated order."""
    global TABLE
    old, TABLE = TABLE, Table(rows)
    try:
        yield TABLE
    finally:
        TABLE = old


def first_match(facts: dict[str, bool | Callable[[], bool]], table: Table | None = None) -> E.ErrorRow | None:
    """The first row (in the walked table's order) whose fact, given by value or by a
    callable evaluated only when reached, holds; an absent fact does not hold."""
    for r in (table or TABLE).rows:
        v = facts.get(r.when)
        if v is not None and (v() if callable(v) else v):
            return r
    return None


def decode_row(row_id: str | None) -> E.ErrorRow | None:
    """A row carried by its ID (IPC, records) back to its constant."""
    return None if row_id is None else E.ROWS[row_id]


# -- a row's answer ------------------------------------------------------------------------


class _Blank(dict):  # type: ignore[type-arg]
    def __missing__(self, key: str) -> str:
        return "?"


def retry_after_seconds(row: E.ErrorRow, overrun_s: float | None = None) -> int | None:
    """The Retry-After value of a row: its constant, or for "overrun" rows
    max(1, round-half-up(overrun_s)) as R10 says."""
    if row.retry_after is None:
        return None
    if row.retry_after == "overrun":
        return max(1, math.floor((overrun_s or 0.0) + 0.5))
    return int(row.retry_after)


def envelope(row: E.ErrorRow, *, param: str | None = None, **fields: object) -> dict[str, object]:
    """The OpenAI-style error envelope of a row; `fields` fill the message template."""
    p = param if row.param == "from_check" else row.param
    return {"error": {"message": row.message.format_map(_Blank(fields)), "type": row.type, "param": p, "code": row.code}}


def render(row: E.ErrorRow, *, param: str | None = None, overrun_s: float | None = None,
           **fields: object) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """(status, headers, body) of a row's HTTP answer."""
    ra = retry_after_seconds(row, overrun_s)
    if ra is not None:
        fields.setdefault("retry_after", ra)
    body = json.dumps(envelope(row, param=param, **fields), separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json")]
    if ra is not None:
        headers.append((b"retry-after", str(ra).encode()))
    for name, value in row.headers:
        headers.append((name.lower().encode(), value.encode()))
    return row.status, headers, body
