"""What `narwhal bench tenants` counts, shared by its engine-bound arms (tenants.py) and
its retention-bound ones (tenants_retention.py): the two tenants' keys, one request's
outcome, one tenant's summary, and Narwhal's books at rest."""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from .harness.processes import log_dir
from .harness.stats import Result, percentile

__all__ = ["KEYS", "keys_file", "outcome", "tenant_summary", "narwhal_books"]

KEYS = {"quiet": "sk-bench-quiet-0123456789abcdef", "noisy": "sk-bench-noisy-0123456789abcdef"}


def keys_file() -> Path:
    p = log_dir() / "tenants-keys.yaml"
    p.write_text(yaml.safe_dump([{"id": f"k-{t}", "tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for t, k in KEYS.items()]))
    return p


def outcome(r: Result) -> tuple[str, str]:
    """(class, detail) of one request: ok | refused (detail 'STATUS code', '+RA' when it
    carried Retry-After) | cancelled (still open at the end) | failed (anything else)."""
    if r.ok:
        return "ok", "200"
    if r.refused:
        return "refused", f"{r.status} {r.code or '?'}" + (" +RA" if r.retry_after is not None else " -RA")
    if r.error and r.error.startswith("cut at end of run"):
        return "cancelled", "cut at end of run"
    return "failed", r.error or f"HTTP {r.status} {r.code or ''}".strip()


def tenant_summary(results: Sequence[Result], budget_s: float) -> dict[str, Any]:
    """What one tenant saw in one arm (module docstring: goodput over offered)."""
    kinds: Counter[str] = Counter()
    refusals: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    for r in results:
        k, d = outcome(r)
        kinds[k] += 1
        if k == "refused":
            refusals[d] += 1
        elif k == "failed":
            failures[d[:80]] += 1
    ttft = [r.ttft for r in results if r.ok and r.ttft is not None]
    good = sum(1 for r in results if r.ok and r.ttft is not None and r.ttft <= budget_s)
    n = len(results)
    refused = kinds["refused"]
    with_ra = sum(v for k, v in refusals.items() if k.endswith("+RA"))
    return {
        "offered": n, "ok": kinds["ok"], "refused": refused, "refused_with_retry_after": with_ra, "failed": kinds["failed"], "cancelled": kinds["cancelled"],
        "refusals": dict(refusals.most_common()), "failures": dict(failures.most_common(5)),
        "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "ttft_p99": percentile(ttft, 99), "ttft_max": max(ttft) if ttft else None,
        "goodput": good / n if n else None, "good": good,
        "send_lag_p99": percentile([r.lag for r in results if r.sent], 99),
    }


def narwhal_books(url: str, timeout_s: float = 15.0) -> dict[str, Any]:
    """Narwhal's books at rest from /metrics: the fleet's and each tenant's offered and
    terminal classes, and whether each balances (offered == sum of terminal classes).
    Waits (bounded) until nothing is open."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    end = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url + "/metrics", timeout=5.0, trust_env=False).text
        fleet: dict[str, Any] = {"offered": 0, "terminal": {}}
        tenants: dict[str, dict[str, Any]] = {}
        open_ = None
        moved = {"preemptions": 0, "migrations": 0}  # fair preemptions, and stream migrations carried on
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                v = int(s.value)
                if s.name == "narwhal_requests_offered_total":
                    fleet["offered"] = v
                elif s.name == "narwhal_requests_terminal_total":
                    fleet["terminal"][s.labels["class"]] = v
                elif s.name == "narwhal_requests_open":
                    open_ = v
                elif s.name == "narwhal_fair_preemptions_total":
                    moved["preemptions"] = v
                elif s.name == "narwhal_migrations_total" and s.labels.get("decision") == "carry_on":
                    moved["migrations"] += v
                elif s.name == "narwhal_tenant_requests_offered_total":
                    tenants.setdefault(s.labels["tenant"], {"offered": 0, "terminal": {}})["offered"] = v
                elif s.name == "narwhal_tenant_requests_terminal_total":
                    tenants.setdefault(s.labels["tenant"], {"offered": 0, "terminal": {}})["terminal"][s.labels["class"]] = v
        if open_ in (0, None) or time.monotonic() > end:
            break
        time.sleep(0.2)
    for b in (fleet, *tenants.values()):
        b["terminal"] = {k: v for k, v in b["terminal"].items() if v}
        b["balanced"] = b["offered"] == sum(b["terminal"].values())
    tenant_sum = sum(b["offered"] for b in tenants.values())
    return {"fleet": fleet, "tenants": tenants, "open": open_, "tenants_sum_to_fleet": tenant_sum == fleet["offered"], **moved,
            "balanced": fleet["balanced"] and all(b["balanced"] for b in tenants.values()) and tenant_sum == fleet["offered"]}
