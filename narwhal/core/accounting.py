"""The books (spec/tables/accounting.yaml): offered arrivals and terminal classes.

Invariant: at rest, offered == sum(terminal.values()). Each request gets one `Entry`;
`Books.end` closes it once, in exactly one class; a second close is a bug and is counted
in `double_ends` (tests assert it stays 0) rather than counted twice.

Per tenant (issue 22, tenants configured): an entry offered with a tenant label is also
counted in that tenant's books (`by_tenant`: offered and each class), so the fleet's
books are the sum of the tenants'. Labels are bounded by the caller (the configured
tenants, `default`, `other`): an unknown key is never a label.
"""

from __future__ import annotations

from narwhal_generated import accounting as _a

__all__ = ["Books", "Entry", "TERMINAL_CLASSES"]

TERMINAL_CLASSES: tuple[str, ...] = _a.TERMINAL_CLASSES


class Entry:
    __slots__ = ("sized", "ended", "tenant")

    def __init__(self, tenant: str | None = None) -> None:
        self.sized = False
        self.ended: str | None = None
        self.tenant = tenant  # its label in the per-tenant books, None: not counted per tenant


class Books:
    __slots__ = ("offered", "unsized_offered", "terminal", "double_ends", "open", "by_tenant")

    def __init__(self) -> None:
        self.offered = 0
        self.unsized_offered = 0
        self.terminal: dict[str, int] = dict.fromkeys(TERMINAL_CLASSES, 0)
        self.double_ends = 0
        self.open = 0
        self.by_tenant: dict[str, dict[str, int]] = {}  # label -> {"offered": n, class: n, ...}

    def offer(self, tenant: str | None = None) -> Entry:
        """C01: one offered arrival per request to a completion route."""
        self.offered += 1
        self.open += 1
        if tenant is not None:
            b = self.by_tenant.get(tenant)
            if b is None:
                b = self.by_tenant[tenant] = {"offered": 0, **dict.fromkeys(TERMINAL_CLASSES, 0)}
            b["offered"] += 1
        return Entry(tenant)

    def sized(self, e: Entry) -> None:
        """The request reached workload sizing (after rows R01-R07)."""
        e.sized = True

    def end(self, e: Entry, cls: str) -> None:
        """Close an entry in its terminal class; C02 counts it unsized if it never got sized."""
        if e.ended is not None:
            self.double_ends += 1
            return
        if cls not in self.terminal:
            raise ValueError(f"unknown terminal class {cls!r}")
        e.ended = cls
        self.open -= 1
        self.terminal[cls] += 1
        if e.tenant is not None:
            self.by_tenant[e.tenant][cls] += 1
        if not e.sized:
            self.unsized_offered += 1

    def balanced(self) -> bool:
        return self.offered == sum(self.terminal.values()) and self.open == 0 and self.double_ends == 0

    def snapshot(self) -> dict[str, object]:
        return {
            "offered": self.offered,
            "unsized_offered": self.unsized_offered,
            "terminal": dict(self.terminal),
            "open": self.open,
            "double_ends": self.double_ends,
            "by_tenant": {k: dict(v) for k, v in self.by_tenant.items()},
        }
