"""Clients of several routers at once (the ha, fleet and migration benches), and what a
bench reads back from a router and a mock engine.

Rules
  * FollowingClient is a load balancer that follows the routers: it sends each request to
    the router that last answered 200; on a 503 R01 (router_not_ready) or a connection
    that could not be opened it tries the next router in order, each router at most once
    per request. A request whose connection broke after it was sent is not retried (the
    router may have admitted it). Every attempt is recorded (Attempt, its `kind`).
  * poll_ready polls a router's /ready every READY_POLL_S on one keep-alive connection,
    bounded by max_s and by `stop`.
  * Times are CLOCK (time.perf_counter: CLOCK_MONOTONIC on Linux, the routers' clock too).
  * books_at_rest: /metrics' offered, terminal classes and open, once open is 0 (bounded).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .client import H1Pool, SSERecorder
from .load import Arrival, RequestShape
from .stats import Result

__all__ = ["CLOCK", "READY_POLL_S", "StatusRec", "GapRec", "Attempt", "Request", "FollowingClient", "Poll", "pace", "poll_ready", "BodyRec", "get_json",
           "read_books", "books_at_rest", "read_ha", "engine_ids", "clear_engine"]

CLOCK = time.perf_counter  # CLOCK_MONOTONIC on Linux: the routers' clock (time.monotonic) too
READY_POLL_S = 0.02
_clock = CLOCK


class StatusRec(SSERecorder):
    """SSERecorder that tells the client the status as soon as the headers arrive."""

    __slots__ = ("on_status",)

    def __init__(self, result: Result, on_status: Any) -> None:
        super().__init__(result)
        self.on_status = on_status

    def on_headers(self, status: int, headers: dict[bytes, bytes], now: float) -> None:
        super().on_headers(status, headers, now)
        self.on_status(status)


class GapRec(StatusRec):
    """ha.StatusRec that also keeps the longest gap between two reads of the answer (from the
    response headers on) in r.extra: max_gap_s and gap_end (when that gap ended)."""

    __slots__ = ("last",)

    def __init__(self, result: Result, on_status: Any) -> None:
        super().__init__(result, on_status)
        self.last: float | None = None

    def on_headers(self, status: int, headers: dict[bytes, bytes], now: float) -> None:
        super().on_headers(status, headers, now)
        self.last = now

    def on_body(self, data: bytes, now: float) -> None:
        if self.last is not None:
            g = now - self.last
            if g > self.r.extra.get("max_gap_s", -1.0):
                self.r.extra["max_gap_s"] = g
                self.r.extra["gap_end"] = now
        self.last = now
        super().on_body(data, now)


@dataclass
class Attempt:
    router: int
    r: Result

    @property
    def kind(self) -> str:
        """completed | refused (503 R01) | unreached (could not connect) | lost (broke after
        sending, before a status) | broken (broke after a 200) | error (anything else)."""
        r = self.r
        if r.ok:
            return "completed"
        if r.status == 503 and r.code == "router_not_ready":
            return "refused"
        if r.status == 0 and (r.error or "").startswith("connect:"):
            return "unreached"
        if r.status == 0 and r.error and "connection closed" in r.error:
            return "lost"
        if r.status == 200 and r.error and ("connection closed" in r.error or "without data: [DONE]" in r.error):
            return "broken"
        return "error"


@dataclass
class Request:
    rid: str
    scheduled: float
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        """completed | refused | failed | error."""
        if not self.attempts:
            return "error"
        k = self.attempts[-1].kind
        if k == "completed":
            return "completed"
        if k in ("lost", "broken"):
            return "failed"
        if k in ("refused", "unreached"):
            # every router tried: refused if any said R01 (a router was up and said no)
            return "refused" if any(a.kind == "refused" for a in self.attempts) else "failed"
        return "error"

    @property
    def first_sent(self) -> float:
        return self.attempts[0].r.sent if self.attempts and self.attempts[0].r.sent else self.scheduled


class FollowingClient:
    """Sends each request to the router that last answered 200; on R01 or a connection
    that could not be opened, the next router in order (each at most once). `recorder`:
    what reads each answer (a subclass may keep more of it)."""

    recorder: type[StatusRec] = StatusRec

    def __init__(self, urls: Sequence[str], shape: RequestShape, timeout_s: float, active: int = 0) -> None:
        self.pools = [H1Pool(u, headers={"Connection": "close"}) for u in urls]
        self.shape = shape
        self.timeout_s = timeout_s
        self.active = active

    async def send(self, req: Request, a: Arrival) -> None:
        body = self.shape.body(a)
        i = self.active
        for _ in range(len(self.pools)):
            r = Result(scheduled=req.scheduled, prompt_tokens=a.prompt_tokens, output_tokens=a.output_tokens)
            att = Attempt(i, r)
            req.attempts.append(att)

            def on_status(status: int, i: int = i) -> None:
                if status == 200:
                    self.active = i

            try:
                await self.pools[i].request("POST", self.shape.path, body, self.recorder(r, on_status), headers={"x-request-id": req.rid}, timeout_s=self.timeout_s)
            except asyncio.CancelledError:
                r.error = r.error or "cut at end of run"
                raise
            if att.kind not in ("refused", "unreached"):
                return
            i = (i + 1) % len(self.pools)

    async def aclose(self) -> None:
        for p in self.pools:
            await p.aclose()


@dataclass
class Poll:
    router: int
    sent: float
    answered: float | None
    status: int


async def pace(nxt: float, step: float = READY_POLL_S) -> float:
    """The next poll's due time, nxt + step, slept until; or now when that is past (a
    poll that ran late does not bunch the next ones up)."""
    nxt += step
    d = nxt - CLOCK()
    if d <= 0:
        return CLOCK()
    await asyncio.sleep(d)
    return nxt


async def poll_ready(i: int, url: str, stop: asyncio.Event, dead: set[int], out: list[Poll], last: dict[int, Poll], max_s: float) -> None:
    pool = H1Pool(url, connect_timeout_s=0.5)
    end = _clock() + max_s
    nxt = _clock()
    try:
        while not stop.is_set() and i not in dead and _clock() < end:
            r = Result(scheduled=nxt)
            await pool.request("GET", "/ready", None, SSERecorder(r), timeout_s=0.5)
            p = Poll(i, r.sent, r.headers_at, r.status)
            out.append(p)
            last[i] = p
            nxt = await pace(nxt)
    finally:
        await pool.aclose()


class BodyRec:
    """Keeps a JSON answer's status and body (the /v1/engines read, the etcd range)."""

    __slots__ = ("r", "body")

    def __init__(self, r: Result) -> None:
        self.r = r
        self.body: list[bytes] = []

    def on_headers(self, status: int, headers: dict[bytes, bytes], now: float) -> None:
        self.r.status = status
        self.r.headers_at = now

    def on_body(self, data: bytes, now: float) -> None:
        self.body.append(data)

    def on_end(self, now: float) -> None:
        self.r.done_at = now

    def json(self) -> Any:
        try:
            return json.loads(b"".join(self.body) or b"null")
        except ValueError:
            return None


async def get_json(pool: H1Pool, method: str, path: str, body: bytes | None, timeout_s: float) -> tuple[Result, Any]:
    r = Result(scheduled=_clock())
    rec = BodyRec(r)
    await pool.request(method, path, body, rec, timeout_s=timeout_s)  # type: ignore[arg-type]
    return r, (rec.json() if r.status == 200 else None)


# -- reading the routers and the engine ---------------------------------------------------------

_SAMPLE = re.compile(r'^(narwhal_requests_offered_total|narwhal_requests_terminal_total|narwhal_requests_open)(?:\{class="([^"]*)"\})? ([0-9.eE+-]+)$')


def read_books(url: str) -> dict[str, Any]:
    import httpx

    text = httpx.get(url + "/metrics", timeout=5.0, trust_env=False).text
    books: dict[str, Any] = {"offered": None, "terminal": {}, "open": None}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, cls, v = m.group(1), m.group(2), int(float(m.group(3)))
        if name == "narwhal_requests_offered_total":
            books["offered"] = v
        elif name == "narwhal_requests_open":
            books["open"] = v
        elif cls is not None:
            books["terminal"][cls] = v
    return books


def books_at_rest(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    end = time.monotonic() + timeout_s
    while True:
        b = read_books(url)
        if b["open"] == 0 or time.monotonic() > end:
            return b
        time.sleep(0.1)


def read_ha(url: str) -> dict[str, Any] | None:
    import httpx

    try:
        ha: dict[str, Any] | None = httpx.get(url + "/v1/engines", timeout=5.0, trust_env=False).json()["router"]["ha"]
        return ha
    except (httpx.HTTPError, KeyError, ValueError):
        return None


def engine_ids(engine_url: str) -> Counter[str]:
    import httpx

    recs = httpx.get(engine_url + "/mock/requests", timeout=30.0, trust_env=False).json()
    return Counter(r["x_request_id"] for r in recs if r.get("x_request_id"))


def clear_engine(engine_url: str) -> None:
    import httpx

    httpx.delete(engine_url + "/mock/requests", timeout=10.0, trust_env=False).raise_for_status()
