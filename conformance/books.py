"""Narwhal's books as a router exposes them on /metrics, and the accounting check of a case.

The books are a capability (`books`): a router that does not expose
`narwhal_requests_offered_total`, `narwhal_requests_unsized_offered_total` and
`narwhal_requests_terminal_total{class}` still gets a verdict on its wire behaviour; the
accounting of its cases is then N/A, never a failure.

Rules
  * C01: the books balance at rest: offered == sum of the terminal classes.
  * A case's `accounting: {offered, unsized_offered, terminal: {class: n}}` is the change of
    the books around the case (setup included); a terminal class the case does not name
    must not move.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from narwhal_generated import accounting as ACC

__all__ = ["Books", "parse_metrics", "check_accounting"]

_METRIC = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)')
_CLASS = re.compile(r'class="([^"]*)"')


@dataclass(frozen=True, slots=True)
class Books:
    offered: float
    unsized: float
    terminal: dict[str, float]

    @property
    def balanced(self) -> bool:
        return abs(self.offered - sum(self.terminal.values())) < 0.5

    def describe(self) -> str:
        return f"offered {self.offered:g}, terminal sum {sum(self.terminal.values()):g}"


def parse_metrics(text: str) -> Books | None:
    """The books from a Prometheus text exposition; None when the router exposes none."""
    offered = unsized = None
    terminal: dict[str, float] = {c: 0.0 for c in ACC.TERMINAL_CLASSES}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == ACC.COUNTER_METRICS["offered"]:
            offered = value
        elif name == ACC.COUNTER_METRICS["unsized_offered"]:
            unsized = value
        elif name == ACC.TERMINAL_METRIC:
            lm = _CLASS.search(labels)
            if lm:
                terminal[lm.group(1)] = value
    if offered is None:
        return None
    return Books(offered, unsized or 0.0, terminal)


def check_accounting(want: dict[str, Any], before: Books | None, after: Books | None) -> list[tuple[str, str, str]]:
    """(what, expected, actual) for each way the books moved differently from `want`."""
    if before is None or after is None:
        return [("accounting", "the router's /metrics exposes the books", "the books could not be read around the case")]
    out = []
    got_off = after.offered - before.offered
    if "offered" in want and got_off != want["offered"]:
        out.append(("accounting: offered (C01)", f"+{want['offered']}", f"+{got_off:g}"))
    if "unsized_offered" in want and after.unsized - before.unsized != want["unsized_offered"]:
        out.append(("accounting: unsized_offered (C02)", f"+{want['unsized_offered']}", f"+{after.unsized - before.unsized:g}"))
    terms = want.get("terminal", {})
    for cls in ACC.TERMINAL_CLASSES:
        d = after.terminal.get(cls, 0.0) - before.terminal.get(cls, 0.0)
        w = terms.get(cls, 0)
        if d != w:
            out.append((f"accounting: terminal class {cls} ({ACC.CLASS_IDS[cls]})", f"+{w}", f"+{d:g}"))
    return out
