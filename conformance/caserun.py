"""One case while it runs: its steps, the conditions it waits for, and its expectations.

Rules
  * A path assertion marked `unless: CAP` is checked only when the target lacks CAP (what
    a router with CAP legitimately does otherwise, e.g. carry a failed stream on:
    migration); with CAP it is listed as unchecked.
  * Checks a case marks with `needs: CAP` (path assertions), and the parts of an error
    envelope that name Narwhal's vocabulary (`code`, `type`, `message`) in an
    interoperability case, are checked only when the target has the capability
    (`narwhal-errors` for the envelope); otherwise they are listed as unchecked, never
    passed in silence.
  * Every wait is bounded; a wait for a background request fails at once when that
    request has already ended.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Protocol

from . import matchers
from .books import Books
from .capabilities import Capabilities
from .cases import Case
from .etcd import EtcdServer
from .transport import COMPLETION_ROUTES, Background, Exchange, RequestData, document, raw_exchange

__all__ = ["CaseRun", "Mismatch", "StepError", "RunContext"]


class RunContext(Protocol):
    """What a case run needs of its run (runner.py Runner provides it)."""

    target: str
    admin_token: str | None
    headers: dict[str, str]
    etcd: EtcdServer | None
    caps: Capabilities

    def send(self, req: RequestData) -> Exchange: ...
    def books(self) -> Books | None: ...
    def fleet(self, body: dict[str, Any]) -> None: ...
    def etcd_control(self, action: str) -> None: ...
    def records(self, rid: str) -> list[dict[str, Any]]: ...
    def new_rid(self, label: str) -> str: ...
    def ready_status(self) -> int | None: ...
    def engines_view(self) -> dict[str, dict[str, Any]]: ...

_POLL_S = 0.02


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One check that did not hold: what, Expected, Actual (h2spec's verifier output)."""

    what: str
    expected: str
    actual: str


class StepError(Exception):
    """A step could not complete (its wait ran out, the fleet did not answer)."""


class CaseRun:
    """The state of one case while it runs."""

    def __init__(self, runner: RunContext, case: Case) -> None:
        self.r, self.case = runner, case
        self.failures: list[Mismatch] = []
        self.unchecked: list[str] = []
        self.background: dict[str, Background] = {}
        self.rids: dict[str, str] = {}
        self.index = 0
        self.exchanges: list[tuple[str, str, Exchange]] = []  # (label, route, exchange)

    def _fail(self, what: str, expected: str, actual: str) -> None:
        self.failures.append(Mismatch(what, expected, actual))

    def execute(self) -> None:
        try:
            for i, step in enumerate(self.case.data["steps"]):
                self.step(i, step)
        except StepError as e:
            self._fail(f"step {self.index}", "the step completes", str(e))
        finally:
            for j, step in enumerate(self.case.data.get("teardown", ())):
                try:
                    self.step(j, step, teardown=True)
                except StepError as e:
                    self._fail(f"teardown step {j}", "the step completes", str(e))
            for bg in self.background.values():
                bg.release()
            try:
                self.r.fleet({"engine": "all", "health": "ok", "defaults": None})
            except StepError as e:
                self._fail("fleet reset", "the fleet's control API answers", str(e))
            if self.r.etcd is not None and self.r.etcd.frozen:
                self.r.etcd.thaw()  # a case that failed before its teardown thawed it

    # -- request building ---------------------------------------------------------------

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
        headers = {**self.r.headers, **{k.lower(): v for k, v in (spec.get("headers") or {}).items()}}
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
            if spec["route"] in COMPLETION_ROUTES and isinstance(obj, dict) and isinstance(obj.get("mock", {}), dict):
                # the request id again, in the body: the fleet keys its records on it, so a
                # router that rewrites x-request-id (or sends none) is still followed
                obj = {**obj, "mock": {**obj.get("mock", {}), "rid": rid}}
            body = json.dumps(obj).encode()
        if body is not None:
            headers.setdefault("content-type", "application/json")
        return RequestData(spec.get("method", "POST"), spec["route"], headers, body, spec.get("timeout_ms", 15000) / 1000.0)

    # -- steps ----------------------------------------------------------------------------

    def step(self, i: int, s: dict[str, Any], *, teardown: bool = False) -> None:
        self.index = i
        label = f"{'teardown ' if teardown else ''}step {i}"
        if "request" in s:
            if "background" in s:
                return self._background(label, s)
            return self._request(label, s)
        if "await" in s:
            name = s["await"]
            ex = self.background[name].wait(s.get("timeout_ms", 15000) / 1000.0)
            self.exchanges.append((f"{label} ({name})", self.background[name].req.path, ex))
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
        if "etcd" in s:
            return self.r.etcd_control(s["etcd"])
        if "wait" in s:
            return self._wait(label, s["wait"], None, None)
        raise StepError(f"unknown step {sorted(s)}")

    def _request(self, label: str, s: dict[str, Any]) -> None:
        rids = []
        for k in range(s.get("repeat", 1)):
            rid = self.r.new_rid(self.case.id)
            rids.append(rid)
            if "raw" in s["request"]:
                raw = s["request"]["raw"].replace("${pad}", "a" * s["request"].get("raw_pad", 0))
                # the run's headers (--header, the run key), one line each: a router that
                # asks for a key sees it on a raw request too
                raw = raw.replace("${run_headers}", "".join(f"{k}: {v}\r\n" for k, v in self.r.headers.items() if v is not None))
                rep = s["request"].get("raw_repeat")
                if rep:
                    raw = raw.replace("${repeat}", rep["text"] * rep["times"])
                ex = raw_exchange(self.r.target, raw.encode("latin-1"), s["request"].get("timeout_ms", 5000) / 1000.0)
            else:
                ex = self.r.send(self.build(s["request"], rid))
            lab = label if "repeat" not in s else f"{label} (repeat {k + 1})"
            self.exchanges.append((lab, s["request"]["route"], ex))
            if "expect" in s:
                e = dict(s["expect"])
                e.pop("received", None)
                self._expect(lab, e, ex, [rid])
        if "expect" in s and "received" in s["expect"]:
            self._received(label, s["expect"]["received"], rids)

    def _background(self, label: str, s: dict[str, Any]) -> None:
        name = s["background"]
        rid = self.r.new_rid(self.case.id) + "-" + name
        self.rids[name] = rid
        start = self.r.books() if "books" in self.r.caps else None
        req = self.build(s["request"], rid)
        # a header whose value is None is not sent (the run's included), as Runner.send does
        req = RequestData(req.method, req.path, {k: v for k, v in req.headers.items() if v is not None}, req.body, req.timeout_s)
        self.background[name] = Background(self.r.target, req, partial=bool(s.get("partial_body")))
        if "until" in s:
            self._wait(f"{label} ({name})", s["until"], rid, start, self.background[name])

    def _wait(self, label: str, cond: dict[str, Any], rid: str | None, start: Any, bg: Background | None = None) -> None:
        timeout = cond.get("timeout_ms", 5000) / 1000.0
        if "offered" in cond and start is None:
            start = self.r.books()
        end = time.monotonic() + timeout
        while True:
            ok, last = self._holds(cond, rid, start, bg)
            if ok:
                return
            if bg is not None and bg.finished:
                ex = bg.exchange
                raise StepError(f"{label}: the background request ended (status {ex.status}, {ex.error or ex.body[:200]!r}) before {last}")
            if time.monotonic() > end:
                raise StepError(f"{label}: not within {timeout:g} s: {last}")
            time.sleep(_POLL_S)

    def _holds(self, cond: dict[str, Any], rid: str | None, start: Any, bg: Background | None) -> tuple[bool, str]:
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
            role = want.get("role", "any")
            roles = ("decode", "unified") if role == "output" else None if role == "any" else (role,)
            n = sum(1 for x in recs if (roles is None or x["role"] in roles) and want.get("engine", x["engine"]) == x["engine"])
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

    # -- expectations ---------------------------------------------------------------------

    def _checked(self, assertions: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
        """The assertions whose capability the target has; the others are listed unchecked."""
        out = []
        for a in assertions:
            need, unless = a.get("needs"), a.get("unless")
            if need is not None and need not in self.r.caps:
                self.unchecked.append(f"{where} {a['path']}: {self.r.caps.reason(need)}")
            elif unless is not None and unless in self.r.caps:
                self.unchecked.append(f"{where} {a['path']}: holds only without {unless} (the target has it)")
            else:
                out.append({k: v for k, v in a.items() if k not in ("needs", "unless")})
        return out

    def _expect(self, label: str, e: dict[str, Any], ex: Exchange, rids: list[str]) -> None:
        e = self._subst(e, rids[0])
        doc = document(ex)
        if "status" in e:
            allowed = e["status"] if isinstance(e["status"], list) else [e["status"]]
            if ex.status not in allowed:
                self._fail(f"{label}: status", " or ".join(map(str, allowed)), f"{ex.status} {_brief(ex)}")
        for name, spec in (e.get("headers") or {}).items():
            hv = ex.headers.get(name.lower())
            if spec is None:
                if hv is not None:
                    self._fail(f"{label}: header {name}", "absent", repr(hv))
            elif isinstance(spec, str):
                if hv != spec:
                    self._fail(f"{label}: header {name}", repr(spec), repr(hv) if hv is not None else "<absent>")
            else:
                for what, exp, act in matchers.check({"headers": {name.lower(): hv} if hv is not None else {}}, {"path": f"headers.{name.lower()}", **spec}):
                    self._fail(f"{label}: {what}", exp, act)
        if "error" in e:
            self._error(label, e["error"], doc)
        if "stream" in e:
            self._stream(label, e["stream"], doc)
        asserts = self._checked(list(e.get("assert", ())), label)
        if any(a["path"].startswith("received.") or str(a.get("equals_path", "")).startswith("received.") for a in asserts):
            doc["received"] = self._received_doc(rids)
        for what, exp, act in matchers.check_all(doc, asserts):
            self._fail(f"{label}: {what}", exp, act)
        if "received" in e:
            self._received(label, e["received"], rids)

    def _narwhal_vocabulary(self) -> bool:
        return self.case.cls == "narwhal" or "narwhal-errors" in self.r.caps

    def _error(self, label: str, want: dict[str, Any], doc: dict[str, Any]) -> None:
        body = doc.get("json")
        err = body.get("error") if isinstance(body, dict) else None
        strict = self._narwhal_vocabulary()
        if strict:
            # docs/contract.md "Refusals": {"error": {"message", "type", "param", "code"}}, code a string
            ok = isinstance(body, dict) and set(body) == {"error"} and isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} \
                and isinstance(err["message"], str) and bool(err["message"]) and isinstance(err["type"], str) and isinstance(err["code"], str) \
                and (err["param"] is None or isinstance(err["param"], str))
            shape = '{"error": {"message": str, "type": str, "param": str|null, "code": str}}'
        else:
            ok = _interop_envelope(body)
            shape = '{"error": {"message": str, "type": str, ...}} (OpenAI\'s error envelope)'
        if not ok:
            self._fail(f"{label}: error envelope", shape, matchers.render(body if "json" in doc else doc.get("text") or doc.get("sse")))
            return
        assert isinstance(err, dict)
        for k in ("type", "code", "param", "message"):
            if k not in want:
                continue
            # an interoperability case checks param where it names a field (OpenAI: "the
            # affected field appears in param"); the rest is Narwhal's vocabulary
            if not strict and (k != "param" or want[k] is None):
                self.unchecked.append(f"{label} error.{k}: {self.r.caps.reason('narwhal-errors')}")
            elif not matchers.json_equal(err.get(k), want[k]):
                self._fail(f"{label}: error.{k}", matchers.render(want[k]), matchers.render(err.get(k)))
        for s in want.get("message_contains", ()):
            if not strict:
                self.unchecked.append(f"{label} error.message: {self.r.caps.reason('narwhal-errors')}")
            elif s.lower() not in err["message"].lower():
                self._fail(f"{label}: error.message", f"containing {s!r}", repr(err["message"]))

    def _stream(self, label: str, want: dict[str, Any], doc: dict[str, Any]) -> None:
        sse = doc.get("sse")
        if sse is None:
            self._fail(f"{label}: event stream", "content-type text/event-stream", f"{doc.get('status')} {doc['headers'].get('content-type')} {matchers.render(doc.get('json', doc.get('text')))}")
            return
        if not sse["done"]:
            self._fail(f"{label}: stream end", "data: [DONE] (never a silent cut)", f"no [DONE]; {len(sse['events'])} events; {doc.get('transport_error') or ''}")
        if sse["after_done"]:
            self._fail(f"{label}: stream end", "nothing after data: [DONE]", matchers.render(sse["after_done"]))
        last = sse["events"][-1] if sse["events"] else None
        last_err = last.get("error") if isinstance(last, dict) else None
        if "error_code" in want:
            code = want["error_code"]
            if code is None and sse["errors"]:
                self._fail(f"{label}: error event", "none", matchers.render(sse["errors"]))
            elif code is not None and not isinstance(last_err, dict):
                self._fail(f"{label}: last event", f"an error event (code {code!r})", matchers.render(last))
            elif code is not None and last_err.get("code") != code:
                if self._narwhal_vocabulary():
                    self._fail(f"{label}: last event", f"an error event with code {code!r}", matchers.render(last))
                else:
                    self.unchecked.append(f"{label} error event code: {self.r.caps.reason('narwhal-errors')}")
        if want.get("error_event") and not isinstance(last_err, dict):
            self._fail(f"{label}: last event", "an error event", matchers.render(last))

    def _received_doc(self, rids: list[str]) -> dict[str, Any]:
        recs = [x for rid in rids for x in self.r.records(rid)]
        doc: dict[str, Any] = {"all": recs, "prefill": [], "decode": [], "unified": [], "output": [], "engines": {}}
        for x in recs:
            doc.setdefault(x["role"], []).append(x)
            if x["role"] in ("decode", "unified"):
                doc["output"].append(x)  # the engines that generate the client's output
            doc["engines"].setdefault(x["engine"], []).append(x)
        return doc

    def _received(self, label: str, assertions: list[dict[str, Any]], rids: list[str]) -> None:
        doc = self._received_doc(rids)
        for what, exp, act in matchers.check_all(doc, self._checked(self._subst(assertions, rids[0]), f"{label} received")):
            self._fail(f"{label}: received {what}", exp, act)

    # -- checked on every case ------------------------------------------------------------

    def invariants(self) -> list[Mismatch]:
        """H06 (no 500); on the completion routes, Retry-After on 429/503 (R08 excepted)
        and an error envelope on every error answer."""
        out = []
        for label, route, ex in self.exchanges:
            if ex.status is None:
                continue
            body = document(ex).get("json")
            code = body["error"].get("code") if _interop_envelope(body) else None
            if ex.status == 500:
                out.append(Mismatch(f"{label}: no internal error (H06)", "a status other than 500", f"500 {_brief(ex)}"))
            if ex.status in (429, 503) and route in COMPLETION_ROUTES and "retry-after" not in ex.headers and code != "prompt_exceeds_ttft_budget":
                out.append(Mismatch(f"{label}: Retry-After on {ex.status}", "a Retry-After header (every 429 and 503 but R08's)", "<absent>"))
            if ex.status >= 400 and route in COMPLETION_ROUTES and not _interop_envelope(body):
                out.append(Mismatch(f"{label}: error envelope on {ex.status}", '{"error": {"message": str, "type": str, ...}}', _brief(ex) or "<empty body>"))
        return out


def _interop_envelope(body: Any) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and bool(err["message"]) and isinstance(err.get("type"), str)


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
