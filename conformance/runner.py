"""Runs cases against a router under test and decides their verdicts.

Theory of operation: for each case the runner reads the router's books (/metrics),
executes the steps in order (requests to the router, background requests on their own
connections, the fleet's control API, bounded waits on conditions), checks every
expectation, runs the teardown, restores the fleet (health ok, no defaults), releases
whatever is still open, and waits until the router is at rest again: the books balance
(offered == sum of terminal classes), /ready is 200, every engine is eligible, no mock
engine has a request in flight. The case's accounting is the difference of the books
before and after. Every wait is bounded; nothing sleeps blindly.

Verdicts (Autobahn's): Pass; Fail (a MUST case's expectation failed); Non-Strict (a SHOULD
case's expectation failed; Fail under --strict); Info (an INFO case: observed, never
failed); Missing (the case could not run: a capability it needs is not available).
Invariants checked on every case whatever it says: no response is a 500 (row H06), and
the books balance at rest (C01, K01-K08).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from narwhal_generated import accounting as ACC

from . import matchers
from .cases import Case, spec_rows
from .profiles import DEFAULT_PORT_BASE, Profile
from .transport import Background, Exchange, Probe, RequestData, document

__all__ = ["Failure", "Result", "Runner", "Books", "parse_metrics", "VERDICTS"]

VERDICTS = ("Pass", "Fail", "Non-Strict", "Info", "Missing")
_SETTLE_S = 10.0
_COMPLETIONS = ("/v1/chat/completions", "/v1/completions")
_POLL_S = 0.02


@dataclass(frozen=True, slots=True)
class Failure:
    what: str
    expected: str
    actual: str


@dataclass
class Result:
    case: Case
    verdict: str
    failures: list[Failure] = field(default_factory=list)
    note: str = ""
    duration_ms: float = 0.0
    expected_failure: str | None = None  # the vendor expectation's bug link, when one applies
    unexpected_pass: bool = False

    @property
    def id(self) -> str:
        return self.case.id


@dataclass(frozen=True, slots=True)
class Books:
    offered: float
    unsized: float
    terminal: dict[str, float]

    @property
    def balanced(self) -> bool:
        return abs(self.offered - sum(self.terminal.values())) < 0.5


_METRIC = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)')


def parse_metrics(text: str) -> Books | None:
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
            lm = re.search(r'class="([^"]*)"', labels)
            if lm:
                terminal[lm.group(1)] = value
    if offered is None:
        return None
    return Books(offered, unsized or 0.0, terminal)


class _StepError(Exception):
    pass


class Runner:
    """One run: a target router, the profile it is set up with, and the protocol."""

    def __init__(self, target: str, profile: Profile, *, port_base: int = DEFAULT_PORT_BASE, http2: bool = False, admin_token: str | None = None, strict: bool = False) -> None:
        self.target = target.rstrip("/")
        self.profile = profile
        self.port_base = port_base
        self.http2 = http2
        self.admin_token = admin_token
        self.strict = strict
        self.probe = Probe(self.target, http2=http2)
        self.control = httpx.Client(timeout=5.0)
        self.fleet_url = profile.engines[0].url(port_base)
        self.run_id = uuid.uuid4().hex[:8]
        self._n = 0

    def close(self) -> None:
        self.probe.close()
        self.control.close()

    # -- the target and the fleet ----------------------------------------------------

    def books(self) -> Books | None:
        try:
            r = self.control.get(self.target + "/metrics")
        except httpx.HTTPError:
            return None
        return parse_metrics(r.text) if r.status_code == 200 else None

    def engines_view(self) -> dict[str, dict[str, Any]]:
        try:
            r = self.control.get(self.target + "/v1/engines")
            data = r.json().get("data", [])
        except (httpx.HTTPError, ValueError, AttributeError):
            return {}
        return {str(e["name"]): e for e in data if isinstance(e, dict) and "name" in e}

    def ready_status(self) -> int | None:
        try:
            return self.control.get(self.target + "/ready").status_code
        except httpx.HTTPError:
            return None

    def fleet(self, body: dict[str, Any]) -> None:
        r = self.control.post(self.fleet_url + "/conformance/control", json=body)
        if r.status_code != 200:
            raise _StepError(f"fleet control answered {r.status_code}: {r.text[:200]}")

    def records(self, rid: str) -> list[dict[str, Any]]:
        try:
            r = self.control.get(self.fleet_url + "/conformance/records", params={"rid": rid})
            return list(r.json())
        except (httpx.HTTPError, ValueError):
            return []

    def fleet_idle(self) -> bool:
        for e in self.profile.engines:
            try:
                s = self.control.get(e.url(self.port_base) + "/mock/stats").json()
            except (httpx.HTTPError, ValueError):
                return False
            if s.get("in_flight", 0) != 0:
                return False
        return True

    def at_rest(self) -> bool:
        """The router and the fleet are idle and healthy (the state every case starts in)."""
        b = self.books()
        if b is not None and not b.balanced:
            return False
        if self.ready_status() != 200:
            return False
        view = self.engines_view()
        if any(not e.get("eligible", True) or (isinstance(e.get("profile"), dict) and e["profile"].get("status") == "running") for e in view.values()):
            return False
        return self.fleet_idle()

    def wait_at_rest(self, timeout_s: float = _SETTLE_S) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.at_rest():
                return True
            time.sleep(0.05)
        return False

    def check_target(self) -> list[str]:
        """Why the target cannot run this profile's cases ([] when it can)."""
        view = self.engines_view()
        want = {e.name for e in self.profile.engines}
        if not view:
            return [f"{self.target}/v1/engines lists no engines (is the router running?)"]
        if set(view) != want:
            return [f"the target's engines {sorted(view)} are not profile {self.profile.name}'s {sorted(want)}: set the router up with `narwhal conformance print-config --profile {self.profile.name}`"]
        return []

    # -- one case --------------------------------------------------------------------

    def run_case(self, case: Case) -> Result:
        t0 = time.monotonic()
        if "admin" in case.needs and not self.admin_token:
            return Result(case, "Missing", note="needs the admin API: pass --admin-token (the token the router's admin.token_env names)")
        before = self.books()
        ctx = _Ctx(self, case)
        try:
            for i, step in enumerate(case.data["steps"]):
                ctx.step(i, step)
        except _StepError as e:
            ctx.failures.append(Failure(f"step {ctx.index}", "the step completes", str(e)))
        finally:
            for j, step in enumerate(case.data.get("teardown", ())):
                try:
                    ctx.step(j, step, teardown=True)
                except _StepError as e:
                    ctx.failures.append(Failure(f"teardown step {j}", "the step completes", str(e)))
            for bg in ctx.background.values():
                bg.release()
            try:
                self.fleet({"engine": "all", "health": "ok", "defaults": None})
            except (_StepError, httpx.HTTPError) as e:
                ctx.failures.append(Failure("fleet reset", "the fleet's control API answers", str(e)))
        rested = self.wait_at_rest()
        after = self.books()
        if not rested:
            b = after
            ctx.failures.append(Failure("the router at rest after the case", "books balance, /ready 200, every engine eligible, no engine request in flight",
                                        "books " + (f"offered {b.offered:g}, terminal sum {sum(b.terminal.values()):g}" if b else "unavailable") + f"; /ready {self.ready_status()}"))
        if "accounting" in case.data:
            ctx.failures.extend(_accounting(case.data["accounting"], before, after))
        ctx.failures.extend(ctx.server_errors())
        verdict = _verdict(case.level, ctx.failures, self.strict)
        return Result(case, verdict, ctx.failures, duration_ms=(time.monotonic() - t0) * 1000.0)

    def next_rid(self, case: Case) -> str:
        self._n += 1
        return f"conf-{self.run_id}-{self._n}-" + case.id.replace("/", "-")


def _verdict(level: str, failures: list[Failure], strict: bool) -> str:
    if level == "INFO":
        return "Info"
    if not failures:
        return "Pass"
    if level == "SHOULD" and not strict:
        return "Non-Strict"
    return "Fail"


def _accounting(want: dict[str, Any], before: Books | None, after: Books | None) -> list[Failure]:
    if before is None or after is None:
        return [Failure("accounting", "the router's /metrics exposes the books", "no narwhal_requests_offered_total on /metrics")]
    out = []
    got_off = after.offered - before.offered
    if "offered" in want and got_off != want["offered"]:
        out.append(Failure("accounting: offered (C01)", f"+{want['offered']}", f"+{got_off:g}"))
    if "unsized_offered" in want and after.unsized - before.unsized != want["unsized_offered"]:
        out.append(Failure("accounting: unsized_offered (C02)", f"+{want['unsized_offered']}", f"+{after.unsized - before.unsized:g}"))
    terms = want.get("terminal", {})
    for cls in ACC.TERMINAL_CLASSES:
        d = after.terminal.get(cls, 0.0) - before.terminal.get(cls, 0.0)
        w = terms.get(cls, 0)
        if d != w:
            out.append(Failure(f"accounting: terminal class {cls} ({ACC.CLASS_IDS[cls]})", f"+{w}", f"+{d:g}"))
    return out


class _Ctx:
    """The state of one case while it runs."""

    def __init__(self, runner: Runner, case: Case) -> None:
        self.r, self.case = runner, case
        self.failures: list[Failure] = []
        self.background: dict[str, Background] = {}
        self.rids: dict[str, str] = {}
        self.index = 0
        self.exchanges: list[tuple[str, Exchange]] = []

    # -- helpers -------------------------------------------------------------------------

    def _vars(self, rid: str) -> dict[str, str]:
        return {"request_id": rid, "admin_token": self.r.admin_token or ""}

    def _subst(self, v: Any, rid: str) -> Any:
        if isinstance(v, str):
            return re.sub(r"\$\{([a-z_]+)\}", lambda m: self._vars(rid).get(m.group(1), m.group(0)), v)
        if isinstance(v, list):
            return [self._subst(x, rid) for x in v]
        if isinstance(v, dict):
            return {k: self._subst(x, rid) for k, x in v.items()}
        return v

    def build(self, spec: dict[str, Any], rid: str) -> RequestData:
        spec = self._subst(spec, rid)
        method = spec.get("method", "POST")
        headers = {k.lower(): v for k, v in (spec.get("headers") or {}).items()}
        headers.setdefault("x-request-id", rid)
        body: bytes | None = None
        if "body_raw" in spec:
            body = spec["body_raw"].encode()
        elif "body_size" in spec:
            body = _sized_body(spec["body_size"])
        elif "body" in spec:
            obj = spec["body"]
            if "fill_prompt" in spec:
                obj = _fill(obj, spec["fill_prompt"])
            if spec["route"] in _COMPLETIONS and isinstance(obj, dict) and isinstance(obj.get("mock", {}), dict):
                # the request id again, for engines a router sends no x-request-id
                obj = {**obj, "mock": {**obj.get("mock", {}), "rid": rid}}
            body = json.dumps(obj).encode()
        if body is not None:
            headers.setdefault("content-type", "application/json")
        return RequestData(method, spec["route"], headers, body, spec.get("timeout_ms", 15000) / 1000.0)

    def server_errors(self) -> list[Failure]:
        """H06: a 500 is a router bug, whatever the case expected."""
        row = spec_rows().get("H06")
        return [Failure(f"{label}: no internal error (H06)", "a status other than 500", f"500 {ex.body[:300].decode('utf-8', 'replace')}") for label, ex in self.exchanges if ex.status == 500 and row]

    # -- steps ---------------------------------------------------------------------------

    def step(self, i: int, s: dict[str, Any], *, teardown: bool = False) -> None:
        self.index = i
        label = f"{'teardown ' if teardown else ''}step {i}"
        if "request" in s:
            if "background" in s:
                return self._background(label, s)
            return self._request(label, s)
        if "await" in s:
            name = s["await"]
            bg = self.background[name]
            ex = bg.wait(s.get("timeout_ms", 15000) / 1000.0)
            self.exchanges.append((f"{label} ({name})", ex))
            if "expect" in s:
                self._expect(f"{label} ({name})", s["expect"], ex, [self.rids[name]])
            return None
        if "release" in s:
            names = s["release"] if isinstance(s["release"], list) else [s["release"]]
            for n in names:
                self.background[n].release()
            for n in names:
                self.background[n].wait(5.0)
            return None
        if "fleet" in s:
            return self.r.fleet(s["fleet"])
        if "wait" in s:
            return self._wait(label, s["wait"], None, None)
        raise _StepError(f"unknown step {sorted(s)}")

    def _request(self, label: str, s: dict[str, Any]) -> None:
        rids = []
        for k in range(s.get("repeat", 1)):
            rid = self.r.next_rid(self.case)
            rids.append(rid)
            ex = self.r.probe.send(self.build(s["request"], rid))
            lab = label if "repeat" not in s else f"{label} (repeat {k + 1})"
            self.exchanges.append((lab, ex))
            if "expect" in s:
                e = dict(s["expect"])
                e.pop("received", None)
                self._expect(lab, e, ex, [rid])
        if "expect" in s and "received" in s["expect"]:
            self._received(label, s["expect"]["received"], rids)

    def _background(self, label: str, s: dict[str, Any]) -> None:
        name = s["background"]
        rid = self.r.next_rid(self.case) + "-" + name
        self.rids[name] = rid
        start = self.r.books()
        self.background[name] = Background(self.r.target, self.build(s["request"], rid), partial=bool(s.get("partial_body")))
        if "until" in s:
            self._wait(f"{label} ({name})", s["until"], rid, start, self.background[name])

    def _wait(self, label: str, cond: dict[str, Any], rid: str | None, start: Books | None, bg: Background | None = None) -> None:
        timeout = cond.get("timeout_ms", 5000) / 1000.0
        if "offered" in cond and start is None:
            start = self.r.books()
        end = time.monotonic() + timeout
        last = ""
        while True:
            ok, last = self._holds(cond, rid, start, bg)
            if ok:
                return
            if bg is not None and bg.finished:
                ex = bg.exchange
                raise _StepError(f"{label}: the background request ended (status {ex.status}, {ex.error or ex.body[:200]!r}) before {last}")
            if time.monotonic() > end:
                raise _StepError(f"{label}: not within {timeout:g} s: {last}")
            time.sleep(_POLL_S)

    def _holds(self, cond: dict[str, Any], rid: str | None, start: Books | None, bg: Background | None) -> tuple[bool, str]:
        r = self.r
        if "ready" in cond:
            st = r.ready_status()
            if st != cond["ready"]:
                return False, f"GET /ready answers {cond['ready']} (it answers {st})"
        if "engines" in cond:
            view = r.engines_view()
            for name, fields in cond["engines"].items():
                targets = list(view.values()) if name == "all" else [view.get(name, {})]
                for e in targets:
                    for k, v in fields.items():
                        if not _subset(e.get(k), v):
                            return False, f"/v1/engines {e.get('name', name)}.{k} is {matchers.render(v)} (it is {matchers.render(e.get(k))})"
        if "received" in cond:
            want = cond["received"]
            recs = r.records(rid or "")
            n = sum(1 for x in recs if want.get("role", "any") in ("any", x["role"]) and want.get("engine", x["engine"]) == x["engine"])
            if n < want.get("count", 1):
                return False, f"the fleet received the request {want.get('count', 1)} time(s) ({want}; it did {n})"
        if "offered" in cond:
            b = r.books()
            if b is None or start is None:
                return False, "narwhal_requests_offered_total is readable on /metrics"
            if b.offered - start.offered < cond["offered"]:
                return False, f"narwhal_requests_offered_total rises by {cond['offered']} (it rose by {b.offered - start.offered:g})"
        if "events" in cond and (bg is None or bg.events < cond["events"]):
            return False, f"the stream has delivered {cond['events']} event(s) ({bg.events if bg else 0} so far)"
        return True, ""

    # -- expectations --------------------------------------------------------------------

    def _fail(self, label: str, what: str, expected: str, actual: str) -> None:
        self.failures.append(Failure(f"{label}: {what}", expected, actual))

    def _expect(self, label: str, e: dict[str, Any], ex: Exchange, rids: list[str]) -> None:
        e = self._subst(e, rids[0])
        doc = document(ex)
        if "status" in e:
            allowed = e["status"] if isinstance(e["status"], list) else [e["status"]]
            if ex.status not in allowed:
                self._fail(label, "status", " or ".join(map(str, allowed)), f"{ex.status} {_brief(ex)}")
        for name, spec in (e.get("headers") or {}).items():
            hv = ex.headers.get(name.lower())
            if spec is None:
                if hv is not None:
                    self._fail(label, f"header {name}", "absent", repr(hv))
            elif isinstance(spec, str):
                if hv != spec:
                    self._fail(label, f"header {name}", repr(spec), repr(hv) if hv is not None else "<absent>")
            else:
                for what, exp, act in matchers.check({"headers": {name.lower(): hv} if hv is not None else {}}, {"path": f"headers.{name.lower()}", **spec}):
                    self._fail(label, what, exp, act)
        if "error" in e:
            self._error(label, e["error"], doc)
        if "stream" in e:
            self._stream(label, e["stream"], doc)
        for what, exp, act in matchers.check_all(doc, e.get("assert", ())):
            self._fail(label, what, exp, act)
        if "received" in e:
            self._received(label, e["received"], rids)

    def _error(self, label: str, want: dict[str, Any], doc: dict[str, Any]) -> None:
        body = doc.get("json")
        err = body.get("error") if isinstance(body, dict) else None
        shape_ok = isinstance(body, dict) and set(body) == {"error"} and isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} \
            and isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str) and isinstance(err["code"], str) and (err["param"] is None or isinstance(err["param"], str))
        if not shape_ok:
            self._fail(label, "error envelope", '{"error": {"message": str, "type": str, "param": str|null, "code": str}}', matchers.render(body if "json" in doc else doc.get("text") or doc.get("sse")))
            return
        assert isinstance(err, dict)
        for k in ("type", "code", "param", "message"):
            if k in want and not matchers.json_equal(err.get(k), want[k]):
                self._fail(label, f"error.{k}", matchers.render(want[k]), matchers.render(err.get(k)))
        for s in want.get("message_contains", ()):
            if s.lower() not in err["message"].lower():
                self._fail(label, "error.message", f"containing {s!r}", repr(err["message"]))

    def _stream(self, label: str, want: dict[str, Any], doc: dict[str, Any]) -> None:
        sse = doc.get("sse")
        if sse is None:
            self._fail(label, "event stream", "content-type text/event-stream", f"{doc.get('status')} {doc['headers'].get('content-type')} {matchers.render(doc.get('json', doc.get('text')))}")
            return
        if not sse["done"]:
            self._fail(label, "stream end", "data: [DONE] (never a silent cut)", f"no [DONE]; {len(sse['events'])} events; {doc.get('transport_error') or ''}")
        if sse["after_done"]:
            self._fail(label, "stream end", "nothing after data: [DONE]", matchers.render(sse["after_done"]))
        last = sse["events"][-1] if sse["events"] else None
        is_err = isinstance(last, dict) and "error" in last
        if "error_code" in want:
            code = want["error_code"]
            if code is None and sse["errors"]:
                self._fail(label, "error event", "none", matchers.render(sse["errors"]))
            elif code is not None and not (isinstance(last, dict) and isinstance(last.get("error"), dict) and last["error"].get("code") == code):
                self._fail(label, "last event", f'an error event with code {code!r}', matchers.render(last))
        if want.get("error_event") and not is_err:
            self._fail(label, "last event", "an error event", matchers.render(last))

    def _received(self, label: str, assertions: list[dict[str, Any]], rids: list[str]) -> None:
        recs = [x for rid in rids for x in self.r.records(rid)]
        doc: dict[str, Any] = {"all": recs, "prefill": [], "decode": [], "unified": [], "engines": {}}
        for x in recs:
            doc.setdefault(x["role"], []).append(x)
            doc["engines"].setdefault(x["engine"], []).append(x)
        for what, exp, act in matchers.check_all(doc, self._subst(assertions, rids[0])):
            self._fail(label, f"received {what}", exp, act)


def _subset(actual: Any, want: Any) -> bool:
    """want's keys have these values in actual (recursively); other values: equal."""
    if isinstance(want, dict):
        return isinstance(actual, dict) and all(k in actual and _subset(actual[k], v) for k, v in want.items())
    return matchers.json_equal(actual, want)


def _brief(ex: Exchange) -> str:
    if ex.error and ex.status is None:
        return ex.error
    return ex.body[:240].decode("utf-8", "replace")


def _fill(obj: Any, n: int) -> Any:
    obj = json.loads(json.dumps(obj))
    text = "abc " * n
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"]:
        obj["messages"][-1]["content"] = text
    elif isinstance(obj, dict):
        obj["prompt"] = text
    return obj


def _sized_body(n: int) -> bytes:
    head = b'{"model": "narwhal-demo", "messages": [{"role": "user", "content": "'
    tail = b'"}]}'
    pad = max(0, n - len(head) - len(tail))
    return head + b"x" * pad + tail
