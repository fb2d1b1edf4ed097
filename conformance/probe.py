"""`narwhal probe-engine URL --dialect D --model M`: is this engine's stream compatible with
Narwhal? A small set of requests (plain, completions, reasoning field names, a tool call,
logprobs, usage on and off, non-streaming beside streaming), each checked per rule with
Narwhal's own core (the SSE parser, the token-ID check, the assembler), ending with the
`token_accounting` the router would report for it.

Verdicts per rule: Pass, Fail (the router would refuse or fail this engine's output),
Info (not exercised or not applicable: e.g. a model that never calls tools).
The exit status is 1 when any rule failed, else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from narwhal.core.assembly import Assembler, Failure
from narwhal.core.dialects import DIALECTS, ToolCallNormaliser, decode_body
from narwhal.core.sse import DONE, SSEParser
from narwhal.core.tokens import carries_output, check_token_ids

__all__ = ["Probe", "ProbeResult", "probe_engine", "add_arguments", "run"]

PASS, FAIL, INFO = "Pass", "Fail", "Info"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    rule: str  # a spec row ID where one applies (T02, A15, ...), else a probe rule name
    name: str
    verdict: str
    detail: str


@dataclass
class _Stream:
    status: int
    events: list[dict[str, Any]] = field(default_factory=list)
    raw_errors: list[str] = field(default_factory=list)
    done: bool = False
    body: bytes = b""
    seconds: float = 0.0
    transport_error: str | None = None


def _iter_raw(r: httpx.Response) -> list[bytes]:
    out: list[bytes] = []
    try:
        for c in r.iter_raw():
            out.append(c)
    except httpx.HTTPError as e:
        # keep what arrived before the failure, then report it
        raise _Partial(out, e) from e
    return out


class _Partial(httpx.HTTPError):
    def __init__(self, got: list[bytes], exc: Exception) -> None:
        super().__init__(str(exc))
        self.got = got


class Probe:
    def __init__(self, url: str, *, dialect: str, model: str, extra_body: dict[str, Any] | None = None, timeout_s: float = 120.0, headers: dict[str, str] | None = None) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {sorted(DIALECTS)}")
        self.url = url.rstrip("/")
        self.dialect = dialect
        self.model = model
        self.extra = extra_body or {}
        self.client = httpx.Client(timeout=timeout_s, headers=headers)
        self.results: list[ProbeResult] = []
        self.token_ids_seen = False
        self.token_ids_failed = False
        self.recommended_max_concurrency: int | None = None

    def add(self, rule: str, name: str, verdict: str, detail: str = "") -> None:
        self.results.append(ProbeResult(rule, name, verdict, detail))

    # -- transport -------------------------------------------------------------------

    def _body(self, route: str, *, stream: bool, **kw: Any) -> dict[str, Any]:
        b: dict[str, Any] = {"model": self.model, "temperature": 0, "max_tokens": 12, **kw}
        if route == "chat":
            b.setdefault("messages", [{"role": "user", "content": "Say hello in one short sentence."}])
        else:
            b.setdefault("prompt", "The capital of France is")
        b.update(self.extra)
        if stream:
            # exactly what the router sends a decode engine of this dialect (T01, T08)
            so = b.get("stream_options")
            b = decode_body(b, dialect=self.dialect)
            if so is not None:
                b["stream_options"] = {**so}
        else:
            b["stream"] = False
        return b

    def stream(self, route: str, body: dict[str, Any]) -> _Stream:
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
        t0 = time.monotonic()
        with self.client.stream("POST", self.url + path, json=body) as r:
            out = _Stream(r.status_code)
            if r.status_code != 200:
                out.body = r.read()
                return out
            p = SSEParser()
            try:
                chunks = list(_iter_raw(r))
            except _Partial as e:
                chunks = e.got
                out.transport_error = str(e)
            for chunk in chunks:
                for payload in p.feed(chunk):
                    if payload == DONE:
                        out.done = True
                        continue
                    try:
                        obj = orjson.loads(payload)
                    except orjson.JSONDecodeError:
                        out.raw_errors.append(payload[:120].decode(errors="replace"))
                        continue
                    if isinstance(obj, dict):
                        out.events.append(obj)
                    else:
                        out.raw_errors.append(f"not an object: {payload[:80]!r}")
        out.seconds = time.monotonic() - t0
        return out

    def post(self, route: str, body: dict[str, Any]) -> tuple[int, Any]:
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
        try:
            r = self.client.post(self.url + path, json=body)
        except httpx.HTTPError as e:
            return 0, f"{type(e).__name__}: {e}"
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    # -- checks ----------------------------------------------------------------------

    def check_stream(self, label: str, route: str, s: _Stream, *, want_usage: bool | None) -> Any:
        if s.status != 200:
            self.add("E05" if s.status < 500 else "E04", f"{label}: engine answers the streaming request", FAIL, f"HTTP {s.status}: {s.body[:200]!r}")
            return None
        self.add("stream", f"{label}: stream ends with data: [DONE]", PASS if s.done else FAIL, "" if s.done else f"no [DONE] (E06: the router fails such a stream){': ' + s.transport_error if s.transport_error else ''}")
        if s.raw_errors:
            self.add("E02", f"{label}: every event is a JSON object", FAIL, s.raw_errors[0])
        errs = [e for e in s.events if "error" in e]
        if errs:
            self.add("E04", f"{label}: no error event", FAIL, json.dumps(errs[0])[:200])
        # token identity (T02-T04) on the vllm dialect; T08 on the others
        if DIALECTS[self.dialect].token_accounting == "token_ids":
            total, bad = 0, None
            for ev in s.events:
                k, err = check_token_ids(ev)
                if err is not None and bad is None:
                    bad = err
                total += k
            if bad is not None:
                self.token_ids_failed = True
                self.add("T02", f"{label}: valid token IDs on every output event", FAIL, bad)
            else:
                self.token_ids_seen = self.token_ids_seen or total > 0
                self.add("T02", f"{label}: valid token IDs on every output event", PASS if total else FAIL, f"{total} IDs" if total else "no IDs at all (an old vLLM ignores return_token_ids: T03 fails the attempt)")
            usage = next((e["usage"] for e in reversed(s.events) if isinstance(e.get("usage"), dict)), None)
            if usage is not None and total and bad is None:
                ct = usage.get("completion_tokens")
                self.add("T11", f"{label}: token IDs count the output", PASS if ct == total else FAIL, f"IDs {total}, usage.completion_tokens {ct}")
        else:
            ids = sum(len(c.get("token_ids") or ()) for e in s.events for c in e.get("choices") or () if isinstance(c, dict))
            self.add("T08", f"{label}: dialect without token IDs", INFO, f"{ids} IDs seen unasked" if ids else "no IDs (token_accounting: unavailable)")
        # usage (A15/A18)
        usage_chunks = [e for e in s.events if not e.get("choices") and isinstance(e.get("usage"), dict)]
        if want_usage is True:
            ok = bool(usage_chunks) and all(isinstance(usage_chunks[-1]["usage"].get(k), int) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
            self.add("A15", f"{label}: a usage chunk (choices: []) with integer counts", PASS if ok else INFO, "" if ok else "no usage chunk: the router computes usage itself (A18)")
        elif want_usage is False:
            self.add("A15", f"{label}: no usage chunk when not asked", PASS if not usage_chunks else INFO, "" if not usage_chunks else "usage sent unasked (the router strips it)")
        # reasoning field names (D02)
        names = {k for e in s.events for c in e.get("choices") or () if isinstance(c, dict) for k in (c.get("delta") or {}) if k in ("reasoning", "reasoning_content") and (c.get("delta") or {}).get(k)}
        if names:
            self.add("D02", f"{label}: reasoning field names", PASS, ", ".join(sorted(names)))
        # assembly (A01-A23): what a non-streaming client would get
        a = Assembler(route, content_null_when_empty=DIALECTS[self.dialect].content_null_when_empty)
        norm = ToolCallNormaliser() if "repeated_tool_call_fields" in DIALECTS[self.dialect].quirks else None
        f: Failure | None = None
        for ev in s.events:
            if "error" in ev:
                continue
            if norm is not None:
                norm(ev)
            f = a.feed(ev)
            if f is not None:
                break
        res = f if f is not None else a.finish(prompt_tokens=0)
        if isinstance(res, Failure):
            self.add(res.rule, f"{label}: the stream assembles", FAIL, f"{res.row}: {res.detail}")
            return None
        self.add("A01", f"{label}: the stream assembles", PASS, "")
        return res

    # -- the probe set ----------------------------------------------------------------

    def run(self) -> list[ProbeResult]:
        try:
            r = self.client.get(self.url + "/v1/models")
            ids = [m.get("id") for m in r.json().get("data", [])] if r.status_code == 200 else []
            self.add("models", "GET /v1/models lists the model", PASS if self.model in ids else INFO, f"models: {ids}")
        except (httpx.HTTPError, ValueError) as e:
            self.add("models", "GET /v1/models lists the model", INFO, str(e))
        # plain chat, usage on
        s = self.stream("chat", self._body("chat", stream=True))
        streamed = self.check_stream("chat", "chat", s, want_usage=True)
        # the engine's own non-streaming answer beside the assembled stream
        st, full = self.post("chat", self._body("chat", stream=False))
        if st == 200 and isinstance(full, dict) and streamed is not None:
            want = ((full.get("choices") or [{}])[0].get("message") or {}).get("content")
            got = streamed["choices"][0]["message"].get("content") if streamed["choices"] else None
            self.add("A01", "chat: assembled content equals the engine's non-streaming answer (greedy)", PASS if want == got else INFO, "" if want == got else f"engine {want!r} vs assembled {got!r}")
        elif st != 200:
            self.add("A14", "chat: non-streaming answer", INFO, f"HTTP {st}")
        # usage off: stream_options.include_usage false
        s = self.stream("chat", {**self._body("chat", stream=True), "stream_options": {"include_usage": False}})
        self.check_stream("chat, include_usage false", "chat", s, want_usage=False)
        # completions
        s = self.stream("completion", self._body("completion", stream=True))
        self.check_stream("completions", "completion", s, want_usage=True)
        # logprobs
        s = self.stream("chat", self._body("chat", stream=True, logprobs=True, top_logprobs=1))
        res = self.check_stream("chat logprobs", "chat", s, want_usage=None)
        if res is not None:
            lp = res["choices"][0].get("logprobs") if res["choices"] else None
            n = len((lp or {}).get("content") or [])
            self.add("A07", "chat logprobs arrays join", PASS if n else INFO, f"{n} entries" if n else "no logprobs streamed")
        s = self.stream("completion", self._body("completion", stream=True, logprobs=1))
        res = self.check_stream("completions logprobs", "completion", s, want_usage=None)
        if res is not None:
            lp = res["choices"][0].get("logprobs") if res["choices"] else None
            n = len((lp or {}).get("tokens") or [])
            self.add("A08", "completion logprobs arrays join", PASS if n else INFO, f"{n} tokens" if n else "no logprobs streamed")
        # a tool call
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        body = self._body("chat", stream=True, tools=tools, tool_choice="auto", max_tokens=64, messages=[{"role": "user", "content": "What is the weather in Paris? Use the tool."}])
        s = self.stream("chat", body)
        if s.status != 200:
            self.add("A05", "tool call stream", INFO, f"HTTP {s.status}: tools not supported by this server/model ({s.body[:160]!r})")
        else:
            res = self.check_stream("tool call", "chat", s, want_usage=None)
            calls = (res["choices"][0]["message"].get("tool_calls") if res and res["choices"] else None) or []
            self.add("A05", "tool calls assemble with an ID and a function name", PASS if calls else INFO, f"{len(calls)} call(s)" if calls else "the model answered without a tool call")
        # output-carrying events without text still count (T04) - informational census
        empty = sum(1 for e in s.events for c in e.get("choices") or () if isinstance(c, dict) and not carries_output(c) and c.get("token_ids"))
        if empty:
            self.add("T04", "IDs on events without text", PASS, f"{empty} such events")
        self.check_concurrency()
        return self.results

    # -- concurrency -------------------------------------------------------------------

    def _timed(self, client: httpx.Client, body: dict[str, Any], first: threading.Event | None = None) -> tuple[int, str | None, float | None, float, float]:
        """(output events, last finish_reason, first-output time, end time, start time)."""
        n, finish, t_first = 0, None, None
        t0 = time.monotonic()
        p = SSEParser()
        with client.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise httpx.HTTPStatusError(f"HTTP {r.status_code}", request=r.request, response=r)
            for raw in r.iter_raw():
                for payload in p.feed(raw):
                    if payload == DONE:
                        continue
                    try:
                        ev = orjson.loads(payload)
                    except orjson.JSONDecodeError:
                        continue
                    for c in (ev.get("choices") or ()) if isinstance(ev, dict) else ():
                        if isinstance(c, dict) and carries_output(c):
                            n += 1
                            if t_first is None:
                                t_first = time.monotonic()
                                if first is not None:
                                    first.set()
                        if isinstance(c, dict) and c.get("finish_reason"):
                            finish = c["finish_reason"]
        return n, finish, t_first, time.monotonic(), t0

    def check_concurrency(self) -> None:
        """Two overlapping greedy requests: does the engine serve both at once, serialise
        them, or cut the first short when the second arrives (llama-cpp-python's server by
        default)? The last two want `engines[].max_concurrency: 1`."""
        body = self._body("chat", stream=True, max_tokens=48, messages=[{"role": "user", "content": "Count from 1 to 200, separated by commas."}])
        if self.dialect in ("vllm", "sglang"):
            body["ignore_eos"] = True
        try:
            alone = self._timed(self.client, body)
            first = threading.Event()
            box: dict[str, Any] = {}

            def run_first() -> None:
                try:
                    box["a"] = self._timed(self.client, body, first)
                except httpx.HTTPError as e:
                    box["err"] = e
                    first.set()

            with httpx.Client(timeout=self.client.timeout, headers=self.client.headers) as other:
                th = threading.Thread(target=run_first, daemon=True)
                th.start()
                first.wait(timeout=60)
                b = self._timed(other, body)
                th.join(timeout=120)
        except httpx.HTTPError as e:
            self.add("concurrency", "two overlapping requests", INFO, f"not measured: {e}")
            return
        if "a" not in box:
            self.add("concurrency", "two overlapping requests", INFO, f"not measured: {box.get('err')}")
            return
        a = box["a"]
        if b[4] >= a[3]:
            self.add("concurrency", "two overlapping requests", INFO, "not measured: the first answer ended before the second was sent (answers too short)")
        elif a[0] < alone[0]:
            self.recommended_max_concurrency = 1
            self.add("concurrency", "a second request leaves the first one whole", FAIL,
                     f"the first answer was cut to {a[0]} events (alone: {alone[0]}, finish {alone[1]!r} -> {a[1]!r}) when a second arrived: "
                     "set engines[].max_concurrency: 1 (llama-cpp-python: or start it with --interrupt_requests False)")
        elif b[2] is not None and alone[2] is not None and b[2] >= a[3] and (b[2] - b[4]) > (alone[2] - alone[4]) + 0.5 * max(0.0, a[3] - b[4]):
            # the second's first output came only after the first ended, later than its
            # own time alone by at least half of what remained of the first: serialised
            self.recommended_max_concurrency = 1
            self.add("concurrency", "two requests are served at once", INFO,
                     "the engine serialises requests (the second's first token came after the first ended): set engines[].max_concurrency: 1, "
                     "so that the router queues them and predicts their waits")
        else:
            self.add("concurrency", "two requests are served at once", PASS, f"both whole ({a[0]} and {b[0]} events), overlapping")

    @property
    def token_accounting(self) -> str:
        if DIALECTS[self.dialect].token_accounting != "token_ids":
            return "unavailable"
        return "token_ids" if self.token_ids_seen and not self.token_ids_failed else "unavailable (token IDs missing or invalid: the router fails this engine's decode attempts)"

    @property
    def failed(self) -> bool:
        return any(r.verdict == FAIL for r in self.results)


def probe_engine(url: str, *, dialect: str, model: str, extra_body: dict[str, Any] | None = None) -> Probe:
    p = Probe(url, dialect=dialect, model=model, extra_body=extra_body)
    try:
        p.run()
    finally:
        p.client.close()
    return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the engine's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--dialect", required=True, choices=sorted(DIALECTS))
    parser.add_argument("--model", required=True)
    parser.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    extra = json.loads(args.extra_body) if args.extra_body else None
    try:
        p = probe_engine(args.url, dialect=args.dialect, model=args.model, extra_body=extra)
    except httpx.HTTPError as e:
        print(f"narwhal probe-engine: cannot reach {args.url}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"results": [dataclasses.asdict(r) for r in p.results], "token_accounting": p.token_accounting,
                          "recommended_max_concurrency": p.recommended_max_concurrency}, indent=2))
    else:
        print(f"# narwhal probe-engine {args.url} (dialect {args.dialect}, model {args.model})\n")
        print("| verdict | rule | check | detail |\n|---|---|---|---|")
        for r in p.results:
            print(f"| {r.verdict} | {r.rule} | {r.name} | {r.detail.replace('|', '/')} |")
        print(f"\ntoken_accounting: {p.token_accounting}")
        if p.recommended_max_concurrency is not None:
            print(f"recommended: engines[].max_concurrency: {p.recommended_max_concurrency}")
    return 1 if p.failed else 0
