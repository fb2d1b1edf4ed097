"""Runs cases against a router under test and decides their verdicts.

Theory of operation: the runner talks to the target only through what the case and the
target's capabilities allow. Before every case it knows the router is at rest: the ready
URL answers 200, no mock engine has a request in flight, and, where the router has them,
its books balance (`books`) and every engine is eligible and profiled (`engines-api`;
without it, after a case whose engines faulted or whose fleet changed, the profile's
breaker cooldown and two health polls are waited out: `Profile.breaker_rest_s`).
For each case it reads the books (if any), runs the steps (`caserun.CaseRun`), runs the
teardown, restores the fleet (and thaws the run's etcd, if a case froze it), releases
what is still open and waits until the router is at rest again. Engine requests that outlive their case are a failure of the case (the
router did not cancel them); the fleet then aborts them so that one slow router does not
make every later case wait out its bounds.

Verdicts (Autobahn's, plus N/A):
  Pass        every check held
  Fail        a MUST case's check did not hold (a SHOULD case's too, under --strict)
  Non-Strict  a SHOULD case's check did not hold; still conformant
  Info        an INFO case: observed, never failed
  N/A         the case needs a capability the target lacks (or the vendor's expectation
              file says it does not apply); the reason goes with it
The books are their own check (`Result.books`: Pass, Fail or N/A), reported apart from
what the client and the engines saw.
Checked on every case whatever it says: no answer is a 500 (H06); on the completion
routes, every 429 and 503 carries Retry-After (except R08, which has none) and every
error answer is a JSON error envelope.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from .books import Books, check_accounting, parse_metrics
from .capabilities import Capabilities
from .caserun import CaseRun, Mismatch, StepError
from .cases import Case
from .etcd import EtcdServer
from .profiles import DEFAULT_PORT_BASE, Profile
from .transport import Exchange, RequestData, RouterClient

__all__ = ["Mismatch", "Result", "Runner", "VERDICTS", "READY_PATHS", "StepError", "engines_may_be_out"]

VERDICTS = ("Pass", "Fail", "Non-Strict", "Info", "N/A")
READY_PATHS = ("/ready", "/health", "/v1/models")  # the default ready URL: the first that exists
_SETTLE_S = 5.0  # the router comes to rest within this after a case (then once more after an abort)
_SETTLE_HA_S = 15.0  # ... after a case that froze etcd: the router leads again first (its back-off, a campaign)


@dataclass
class Result:
    case: Case
    verdict: str
    failures: list[Mismatch] = field(default_factory=list)
    note: str = ""
    duration_ms: float = 0.0
    expected_failure: str | None = None  # the vendor expectation's bug link, when one applies
    unexpected_pass: bool = False
    books: str | None = None  # Pass | Fail | N/A; None when the case has no accounting to check
    books_failures: list[Mismatch] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)  # checks skipped for a capability the target lacks

    @property
    def id(self) -> str:
        return self.case.id

    @property
    def cls(self) -> str:
        return self.case.cls


class Runner:
    """One run: a target router, the profile it is set up with, the protocol, the headers
    every request carries, and the target's capabilities."""

    def __init__(self, target: str, profile: Profile, *, port_base: int = DEFAULT_PORT_BASE, http2: bool = False, admin_token: str | None = None,
                 strict: bool = False, headers: dict[str, str] | None = None, ready_url: str | None = None, etcd: EtcdServer | None = None) -> None:
        self.target = target.rstrip("/")
        self.profile = profile
        self.port_base = port_base
        self.http2 = http2
        self.admin_token = admin_token
        self.strict = strict
        self.headers = {k.lower(): v for k, v in (headers or {}).items()}
        self.ready_url = ready_url
        self.etcd = etcd  # the etcd this run started for ha-etcd (the router under test uses it)
        self.caps = Capabilities()
        self.client = RouterClient(self.target, http2=http2)
        self.control = httpx.Client(timeout=5.0)
        self.fleet_url = profile.engines[0].url(port_base)
        self.run_id = uuid.uuid4().hex[:8]
        self._n = 0

    def close(self) -> None:
        self.client.close()
        self.control.close()

    # -- the target ----------------------------------------------------------------------

    def send(self, req: RequestData) -> Exchange:
        """A request to the target with the run's headers (the request's own win; a
        request's header whose value is None is not sent, the run's included)."""
        headers = {k: v for k, v in {**self.headers, **req.headers}.items() if v is not None}
        return self.client.send(RequestData(req.method, req.path, headers, req.body, req.timeout_s))

    def _get(self, url: str) -> httpx.Response | None:
        try:
            return self.control.get(url, headers=self.headers)
        except httpx.HTTPError:
            return None

    def books(self) -> Books | None:
        r = self._get(self.target + "/metrics")
        return parse_metrics(r.text) if r is not None and r.status_code == 200 else None

    def engines_view(self) -> dict[str, dict[str, Any]]:
        r = self._get(self.target + "/v1/engines")
        try:
            data = r.json().get("data", []) if r is not None else []
        except (ValueError, AttributeError):
            return {}
        return {str(e["name"]): e for e in data if isinstance(e, dict) and "name" in e} if isinstance(data, list) else {}

    def resolve_ready_url(self) -> str | None:
        """--ready-url, else the first of the target's /ready, /health, /v1/models that
        exists (answers anything but 404/405); None while the target does not answer."""
        if self.ready_url:
            return self.ready_url
        for path in READY_PATHS:
            r = self._get(self.target + path)
            if r is None:
                return None
            if r.status_code not in (404, 405):
                self.ready_url = self.target + path
                return self.ready_url
        self.ready_url = self.target + READY_PATHS[-1]
        return self.ready_url

    def ready_status(self) -> int | None:
        url = self.target + "/ready" if "ready" in self.caps else self.resolve_ready_url()
        r = self._get(url) if url else None
        return r.status_code if r is not None else None

    # -- the fleet -----------------------------------------------------------------------

    def fleet(self, body: dict[str, Any]) -> None:
        try:
            r = self.control.post(self.fleet_url + "/conformance/control", json=body)
        except httpx.HTTPError as e:
            raise StepError(f"the fleet's control API did not answer: {e}") from None
        if r.status_code != 200:
            raise StepError(f"fleet control answered {r.status_code}: {r.text[:200]}")

    def etcd_control(self, action: str) -> None:
        """The `etcd` step: freeze (SIGSTOP: etcd answers nothing, connections stay open)
        or thaw (SIGCONT)."""
        if self.etcd is None:
            raise StepError("this run started no etcd (capability ha-etcd, with --serve)")
        if not self.etcd.alive():
            raise StepError(f"etcd exited: {self.etcd.log_tail(400)}")
        if action == "freeze":
            self.etcd.freeze()
        elif action == "thaw":
            self.etcd.thaw()
        else:
            raise StepError(f"unknown etcd action {action!r}")

    def records(self, rid: str) -> list[dict[str, Any]]:
        try:
            r = self.control.get(self.fleet_url + "/conformance/records", params={"rid": rid})
            return list(r.json())
        except (httpx.HTTPError, ValueError):
            return []

    def _mock_stats(self) -> dict[str, dict[str, Any] | None]:
        """Each of the fleet's engines' GET /mock/stats (None: it did not answer)."""
        out: dict[str, dict[str, Any] | None] = {}
        for e in self.profile.engines:
            try:
                s = self.control.get(e.url(self.port_base) + "/mock/stats").json()
            except (httpx.HTTPError, ValueError):
                s = None
            out[e.name] = s if isinstance(s, dict) else None
        return out

    def fleet_busy(self) -> list[str]:
        """The fleet's engines with a request in flight (or that do not answer)."""
        busy = []
        for name, s in self._mock_stats().items():
            if s is None:
                busy.append(f"{name} (no answer)")
            elif s.get("in_flight", 0) != 0:
                busy.append(f"{name} ({s['in_flight']} in flight)")
        return busy

    def fleet_faults(self) -> int | None:
        """The faults the fleet's engines have made so far (None: one did not answer)."""
        n = 0
        for s in self._mock_stats().values():
            f = None if s is None else s.get("faulted", 0)
            if type(f) is not int:
                return None
            n += f
        return n

    def new_rid(self, label: str) -> str:
        self._n += 1
        return f"conf-{self.run_id}-{self._n}-" + label.replace("/", "-")

    # -- rest ----------------------------------------------------------------------------

    def rest_problems(self) -> dict[str, str]:
        """What keeps the router and the fleet from rest, by kind ({} at rest)."""
        out: dict[str, str] = {}
        if "books" in self.caps:
            b = self.books()
            if b is None or not b.balanced:
                out["books"] = "the books balance (C01)" if b is None else f"the books do not balance: {b.describe()}"
        st = self.ready_status()
        if st != 200:
            out["ready"] = f"the ready URL answers {st}"
        if "engines-api" in self.caps:
            view = self.engines_view()
            bad = [n for n, e in view.items() if not e.get("eligible", True) or (isinstance(e.get("profile"), dict) and e["profile"].get("status") == "running")]
            if bad or not view:
                out["engines"] = f"engines not eligible or still profiling: {bad or 'no /v1/engines'}"
        busy = self.fleet_busy()
        if busy:
            out["fleet"] = "engine requests in flight: " + ", ".join(busy)
        return out

    def wait_at_rest(self, timeout_s: float = _SETTLE_S) -> dict[str, str]:
        end = time.monotonic() + timeout_s
        while True:
            problems = self.rest_problems()
            if not problems or time.monotonic() > end:
                return problems
            time.sleep(0.05)

    def settle(self, timeout_s: float = _SETTLE_S) -> tuple[dict[str, str], list[Mismatch]]:
        """Wait for rest after a case; engine requests that outlive it are a failure and
        are aborted. Returns (what still keeps it from rest, the failures)."""
        failures = []
        problems = self.wait_at_rest(timeout_s)
        if "fleet" in problems:
            failures.append(Mismatch("engine requests end with their case", f"no engine request in flight {timeout_s:g} s after the case (the router cancels what its clients left)", problems["fleet"]))
            try:
                self.fleet({"engine": "all", "abort": True})
            except StepError as e:
                failures.append(Mismatch("fleet abort", "the fleet's control API answers", str(e)))
            problems = self.wait_at_rest()
        return problems, failures

    # -- one case ------------------------------------------------------------------------

    def run_case(self, case: Case) -> Result:
        t0 = time.monotonic()
        missing = self.caps.missing(sorted(set(case.needs) | self.profile.needs))
        if missing:
            return Result(case, "N/A", note="; ".join(self.caps.reason(m) for m in missing))
        with_books = "books" in self.caps
        before = self.books() if with_books else None
        # without engines-api, rest cannot include "every engine eligible": a router whose
        # breaker opened on this case's faults would refuse the next case's request. The
        # profile says how long it may keep an engine out; that is waited out instead.
        blind = "engines-api" not in self.caps
        faults = self.fleet_faults() if blind else None
        run = CaseRun(self, case)
        run.execute()
        problems, failures = self.settle(_SETTLE_HA_S if "ha-etcd" in case.needs else _SETTLE_S)
        if blind and engines_may_be_out(case.data, faults, self.fleet_faults()):
            time.sleep(self.profile.breaker_rest_s())
        run.failures.extend(failures)
        after = self.books() if with_books else None
        books_problem = problems.pop("books", None)
        if problems:
            run.failures.append(Mismatch("the router at rest after the case", "ready, every engine eligible, no engine request in flight", "; ".join(problems.values())))
        run.failures.extend(run.invariants())
        res = Result(case, _verdict(case.level, run.failures, self.strict), run.failures, duration_ms=(time.monotonic() - t0) * 1000.0, unchecked=run.unchecked)
        if with_books:
            bf = [Mismatch(*m) for m in check_accounting(case.data["accounting"], before, after)] if "accounting" in case.data else []
            if books_problem:
                bf.append(Mismatch("the books at rest (C01)", "offered == sum of the terminal classes", books_problem))
            if "accounting" in case.data or bf:
                res.books = "Pass" if not bf else _verdict(case.level, bf, self.strict).replace("Info", "Pass")
                res.books_failures = bf
        elif "accounting" in case.data:
            res.books = "N/A"
        return res


def engines_may_be_out(case: dict[str, Any], faults_before: int | None, faults_after: int | None) -> bool:
    """After a case, may the router under test have put an engine out (its breaker open,
    its health stale)? Yes when the fleet's engines faulted during it, when the case
    changed the fleet (a `fleet` step, its teardown's included), and when the fault
    counts could not be read (unknown: assume so)."""
    if faults_before is None or faults_after is None or faults_after != faults_before:
        return True
    return any("fleet" in s for s in (*case.get("steps", ()), *case.get("teardown", ())))


def _verdict(level: str, failures: list[Mismatch], strict: bool) -> str:
    if level == "INFO":
        return "Info"
    if not failures:
        return "Pass"
    if level == "SHOULD" and not strict:
        return "Non-Strict"
    return "Fail"
