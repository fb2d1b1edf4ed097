"""Per-request records, percentiles and Markdown tables (pure Python: the default install
has no numpy).

Rules
  * `percentile(values, q)` interpolates linearly between closest ranks (numpy's default
    "linear" method): p50 of [1, 2, 3, 4] is 2.5; p0 and p100 are the min and max.
  * Times in a `Result` are seconds from `time.perf_counter()`; summaries print
    milliseconds.
  * A *refusal* is a response with status 429, 503 or 504 before any token (the router
    said no); its OpenAI error `code` is kept. Any other status >= 400, a transport error
    or a stream that ends with an error event is an *error*.
  * TPOT of one stream = (last token time - first token time) / (tokens - 1), for
    streams with at least 2 tokens (vLLM bench's definition).
  * Goodput (docs/prediction.md section 10) is counted over OFFERED requests: the share of all
    requests sent that completed with TTFT <= the target (and, when given, TPOT <= the
    TPOT target); a refusal or an error is a miss.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Result", "percentile", "summarize", "markdown_table", "goodput", "REFUSAL_STATUSES", "fmt_ms", "fmt_whole", "to_ms"]

REFUSAL_STATUSES = frozenset((429, 503, 504))


@dataclass(slots=True)
class Result:
    """One offered request, as the load tool saw it."""

    scheduled: float  # when the arrival process wanted it sent
    sent: float = 0.0  # when its first byte was written
    status: int = 0  # HTTP status (0: no response)
    headers_at: float | None = None  # response headers received
    first_token_at: float | None = None
    last_token_at: float | None = None
    done_at: float | None = None
    tokens: int = 0  # output tokens received (token_ids when present, else one per output event)
    events: int = 0  # SSE data events received (streaming)
    code: str | None = None  # OpenAI error code of a refusal or an error body
    error: str | None = None  # transport error, bad status, or error event
    prompt_tokens: int = 0
    output_tokens: int = 0  # what was asked for
    retry_after: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def refused(self) -> bool:
        return self.status in REFUSAL_STATUSES and self.first_token_at is None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.done_at is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent

    @property
    def e2e(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.sent

    @property
    def tpot(self) -> float | None:
        if self.tokens < 2 or self.first_token_at is None or self.last_token_at is None:
            return None
        return (self.last_token_at - self.first_token_at) / (self.tokens - 1)

    @property
    def lag(self) -> float:
        """How late the load tool sent it (a load tool that is the bottleneck shows here)."""
        return self.sent - self.scheduled

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ttft=self.ttft, e2e=self.e2e, tpot=self.tpot, refused=self.refused)
        return d


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    return float(xs[lo] + (xs[hi] - xs[lo]) * frac)


def _pcts(values: list[float], qs: Iterable[float] = (50, 90, 99)) -> dict[str, float | None]:
    return {f"p{q:g}": percentile(values, q) for q in qs}


def goodput(results: Sequence[Result], ttft_target_s: float, tpot_target_s: float | None = None) -> float:
    """Share of offered requests that completed within the targets (refusals are misses)."""
    if not results:
        return 0.0
    good = 0
    for r in results:
        if not r.ok or r.ttft is None or r.ttft > ttft_target_s:
            continue
        if tpot_target_s is not None and r.tpot is not None and r.tpot > tpot_target_s:
            continue
        good += 1
    return good / len(results)


def summarize(results: Sequence[Result], *, duration_s: float | None = None, ttft_target_s: float | None = None, tpot_target_s: float | None = None) -> dict[str, Any]:
    """Counts, rates and p50/p90/p99 of TTFT, TPOT, end-to-end and refusal latency (s)."""
    n = len(results)
    ok = [r for r in results if r.ok]
    refused = [r for r in results if r.refused]
    errors = [r for r in results if not r.ok and not r.refused]
    statuses = Counter(r.status for r in results)
    codes = Counter(r.code for r in refused if r.code)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    ref_lat = [r.e2e for r in refused if r.e2e is not None]
    lag = [r.lag for r in results if r.sent]
    span = duration_s
    if span is None and results:
        span = max((r.done_at or r.sent) for r in results) - min(r.scheduled for r in results)
    out: dict[str, Any] = {
        "offered": n,
        "ok": len(ok),
        "refused": len(refused),
        "errors": len(errors),
        "refusal_rate": len(refused) / n if n else 0.0,
        "error_rate": len(errors) / n if n else 0.0,
        "statuses": dict(sorted(statuses.items())),
        "refusal_codes": dict(codes.most_common()),
        "error_samples": [r.error or f"HTTP {r.status} {r.code or ''}".strip() for r in errors[:3]],
        "tokens": sum(r.tokens for r in ok),
        "events": sum(r.events for r in results),
        "ttft": _pcts(ttft),
        "tpot": _pcts(tpot),
        "e2e": _pcts(e2e),
        "refusal_latency": _pcts(ref_lat),
        "send_lag": _pcts(lag),
        "offered_rate": (n / span) if span else None,
    }
    if ttft_target_s is not None:
        out["goodput"] = goodput(results, ttft_target_s, tpot_target_s)
        out["ttft_target_s"] = ttft_target_s
    return out


def to_ms(v: float | None) -> float | None:
    """Seconds as milliseconds to a tenth (None stays None): the JSON of the benches."""
    return None if v is None else round(v * 1000.0, 1)


def fmt_whole(v: Any) -> str:
    """A table cell: an em dash for None, a float to the unit, anything else as str()."""
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.0f}"
    return str(v)


def fmt_ms(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v * 1000.0:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table; None prints as an em dash."""
    def cell(v: Any) -> str:
        if v is None:
            return "—"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def latency_rows(name: str, s: dict[str, Any]) -> list[Any]:
    """One Markdown row: name, offered, ok, refused, errors, TTFT/TPOT/e2e p50/p90/p99 (ms)."""
    row: list[Any] = [name, s["offered"], s["ok"], s["refused"], s["errors"]]
    for k in ("ttft", "tpot", "e2e"):
        row += [fmt_ms(s[k]["p50"]), fmt_ms(s[k]["p90"]), fmt_ms(s[k]["p99"])]
    return row


LATENCY_HEADER = [
    "run", "offered", "ok", "refused", "errors",
    "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms",
    "TPOT p50 ms", "TPOT p90 ms", "TPOT p99 ms",
    "e2e p50 ms", "e2e p90 ms", "e2e p99 ms",
]
