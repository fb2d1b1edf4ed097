"""Precedence over the refusal table: the first row whose predicate holds decides.

`first_match` walks generated REFUSALS in order and evaluates predicates lazily (a
callable is called only when every earlier row has not matched), so the HTTP shell can
decide rows 1-2 before reading the body and rows 3-7 while reading it, and still follow
one order. A predicate that is absent counts as not holding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from narwhal_generated import errors as E

__all__ = ["first_match", "REFUSALS", "PREDICATES"]

REFUSALS: tuple[E.ErrorRow, ...] = E.REFUSALS
PREDICATES: tuple[str, ...] = tuple(r.when for r in REFUSALS)


def first_match(facts: Mapping[str, bool | Callable[[], bool]]) -> E.ErrorRow | None:
    for row in REFUSALS:
        v = facts.get(row.when)
        if v is None:
            continue
        if v() if callable(v) else v:
            return row
    return None
