"""Logs (issue 23 item 2): `serving.log_format` text or json, the request-end record and
the router's own events, with stable field names.

Rules
  * json: one JSON object per line on standard error. Every line has `ts` (RFC 3339, UTC,
    milliseconds), `level`, `logger`, `event` and `msg`; a worker process's lines carry
    `worker`. `event` is `request_end` (one per completion request, at its end: the
    REQUEST_FIELDS below), a router event (ROUTER_EVENTS, with their own fields), or `log`
    for any other line (its words in `msg`).
  * No client content (prompt, messages, output) and no secret (an API key, the admin
    token, a password) is ever a field: a request is known by its id, its tenant and its
    key's id; engines by their names. Router events name engines and states, never URLs
    with credentials (an engine URL's userinfo is removed).
  * The names below are the stable interface (docs/observability.md; WARNING: keep both
    in sync). New fields may be added; none is renamed or changes type.
  * text: the lines as before; request_end is not written (a text log stays as quiet as
    it was), router events are their `msg`.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

__all__ = ["JsonFormatter", "configure", "event", "RequestRecord", "REQUEST_END", "REQUEST_FIELDS", "ROUTER_EVENTS",
           "emit_request_end", "request_log", "announce"]

# -- field names of every line
TS, LEVEL, LOGGER, EVENT, MSG, WORKER, EXC = "ts", "level", "logger", "event", "msg", "worker", "exc"
REQUEST_END = "request_end"
# -- request_end fields, in the order they are written
REQUEST_FIELDS = (
    "request_id",  # str: x-request-id (the client's, or generated)
    "trace_id",  # str | null: 32 hex digits: the trace's (client's traceparent or the router's own); null without either
    "sampled",  # bool: this request's spans were exported
    "route",  # "chat" | "completion"
    "stream",  # bool | null: the client asked for a stream (null: not parsed)
    "tenant",  # str | null: auth's tenant (null without auth)
    "key_id",  # str | null: the id of the API key (never the key)
    "engines",  # [str]: the engines of every leg, in order (prefill, decode, a retry's)
    "class",  # str: the terminal class (completed, rejected, refused, invalid_requests, expired, unavailable, failed, cancelled)
    "row",  # str | null: the row that decided it (R01-R20, E01-E07, H01-H11), null when completed
    "status",  # int | null: the HTTP status sent (null: no response head was sent, e.g. cancelled)
    "ttft_ms",  # float | null: arrival to the first token sent
    "tpot_ms",  # float | null: time per output token, measured from token IDs
    "duration_ms",  # float: arrival to the end
    "queue_ms",  # float | null: admission to the grant (queue wait)
    "projected_ttft_ms",  # float | null: admission's projection (predictive mode)
    "prompt_tokens",  # int | null: the engine's count, else admission's sizing
    "output_tokens",  # int | null: counted from token IDs (or the engine's usage)
    "cached_tokens",  # int | null: usage.prompt_tokens_details.cached_tokens of the phase-1 engine
    "expected_cached_tokens",  # float | null: what admission expected cached
    "finish_reason",  # str | null
    "retries",  # int: decode attempts retried (T05)
    "migrations",  # int: decode legs carried on by another engine after a break (spec/tables/migration.yaml)
    "request_bytes",  # int | null: the request body's size
    "response_bytes",  # int | null: the response body's size (non-streaming answers and refusals); null for a stream
    "events",  # int | null: engine events relayed (streams)
)
# -- the router's own events (`event` values) and their fields
ROUTER_EVENTS = {
    "router_state": ("state", "previous", "by"),  # POST /admin/state (by operator), draining on SIGTERM (by signal)
    "wave_maintenance": ("wave", "maintenance"),  # POST /admin/waves/{wave}/maintenance
    "engine_drain": ("engine", "drain"),  # POST /admin/engines/{name}/drain
    "ha_state": ("name", "previous", "state", "on", "row", "fencing_token"),  # leader election: a transition (spec/tables/leadership.yaml)
    "ha_leader": ("name", "fencing_token"),  # this router won the election and admits
    "engine_joining": ("engine", "source", "role", "dialect"),  # lifecycle: joining (spec/tables/lifecycle.yaml)
    "engine_joined": ("engine",),  # lifecycle: active
    "engine_leaving": ("engine", "drain_timeout_s"),  # lifecycle: draining
    "engine_cut": ("engine",),  # its drain timeout passed: its requests cut
    "engine_gone": ("engine",),  # removed from the fleet
    "fleet_change": ("source", "added", "updated", "replaced", "rejoining", "removed", "refused"),  # one diff from a source (only the non-empty lists)
    "breaker_open": ("engine", "row"),  # the circuit breaker opened
    "config_reload": ("path", "sha256", "changed", "restart_needed"),  # POST /admin/config/reload or SIGHUP
    "config_reload_failed": ("path", "error"),  # nothing changed
    "worker_up": ("worker_index", "pid"),  # a data-plane worker process serves (serving.workers > 1)
    "worker_exit": ("worker_index", "pid", "code", "restart_in_s"),  # one died; restarted
    "serving": ("model", "listen", "engines"),  # narwhal serve starts (engines: the count configured, null: the embedded fleet)
}

_KEY = "narwhal_event"


def event(name: str, /, **fields: Any) -> dict[str, Any]:
    """`extra=` of a log call that is a router event: `log.info("...", extra=event(...))`."""
    return {_KEY: (name, fields)}


class JsonFormatter(logging.Formatter):
    """One JSON object per record (module rules)."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        t = record.created
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"
        out: dict[str, Any] = {TS: ts, LEVEL: record.levelname.lower(), LOGGER: record.name}
        if self.worker is not None:
            out[WORKER] = self.worker
        ev = getattr(record, _KEY, None)
        if ev is not None:
            out[EVENT] = ev[0]
            out.update(ev[1])
        else:
            out[EVENT] = "log"
        if ev is None or ev[0] != REQUEST_END:
            out[MSG] = record.getMessage()
        if record.exc_info:
            out[EXC] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(log_format: str, level: str | int = "INFO", *, worker: int | None = None) -> None:
    """The process's log handler on standard error (replacing any set before)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    h = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        h.setFormatter(JsonFormatter(worker))
    else:
        h.setFormatter(logging.Formatter(_TEXT if worker is None else _TEXT.replace("%(name)s", "%(name)s[worker]")))
    root.addHandler(h)
    root.setLevel(level if isinstance(level, int) else getattr(logging, str(level).upper(), logging.INFO))
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # the OTel SDK's own complaints (an export that failed) are counted on /metrics; one
    # line per failure is enough, none per span
    logging.getLogger("opentelemetry").setLevel(logging.ERROR)


def announce(log_format: str, msg: str, name: str, /, **fields: Any) -> None:
    """A line said whatever the log level (narwhal serve's start-up line): with json, one
    JSON object on standard error like every other line (issue 40 item 8: a JSON log
    pipeline dropped or mis-parsed the plain one); with text, `msg` on standard output
    as before."""
    if log_format != "json":
        print(msg, flush=True)
        return
    rec = logging.LogRecord("narwhal", logging.INFO, __file__, 0, msg, None, None)
    setattr(rec, _KEY, (name, fields))
    sys.stderr.write(JsonFormatter().format(rec) + "\n")
    sys.stderr.flush()


request_log = logging.getLogger("narwhal.request")


class RequestRecord:
    """What one completion request's end record and root span say (REQUEST_FIELDS).
    Made at arrival only when JSON logs or tracing are on; the data plane fills it."""

    __slots__ = ("request_id", "trace", "traceparent", "tracestate", "route", "stream", "tenant", "key_id", "engines",
                 "row", "status", "ttft_s", "tpot_s", "queue_s", "projected_ttft_ms", "prompt_tokens", "output_tokens",
                 "cached_tokens", "expected_cached", "finish_reason", "retries", "migrations", "request_bytes", "response_bytes",
                 "events", "arrival", "log")

    def __init__(self, request_id: str, route: str, arrival: float, *, trace: Any = None, traceparent: bytes | None = None,
                 tracestate: bytes | None = None, log: bool = False) -> None:
        self.request_id = request_id
        self.route = route
        self.arrival = arrival
        self.trace = trace  # tracing.RequestTrace when sampled
        self.traceparent = traceparent  # the client's, as received
        self.tracestate = tracestate
        self.log = log  # write request_end (serving.log_format json)
        self.stream: bool | None = None
        self.tenant: str | None = None
        self.key_id: str | None = None
        self.engines: list[str] = []
        self.row: str | None = None
        self.status: int | None = None
        self.ttft_s: float | None = None
        self.tpot_s: float | None = None
        self.queue_s: float | None = None
        self.projected_ttft_ms: float | None = None
        self.prompt_tokens: int | None = None
        self.output_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.expected_cached: float | None = None
        self.finish_reason: str | None = None
        self.retries = 0
        self.migrations = 0
        self.request_bytes: int | None = None
        self.response_bytes: int | None = None
        self.events: int | None = None

    def trace_id(self) -> str | None:
        if self.trace is not None:
            return str(self.trace.trace_id)
        tp = self.traceparent
        if tp is not None and len(tp) >= 35 and tp[2:3] == b"-":
            from .tracing import parse_traceparent

            p = parse_traceparent(tp)
            return f"{p[0]:032x}" if p is not None else None
        return None

    def refused(self, row: Any) -> None:
        """A refusal row answered (generated errors.ErrorRow)."""
        self.row = row.id
        self.status = row.status

    def fields(self, cls: str, now: float) -> dict[str, Any]:
        ms = _ms
        return {
            "request_id": self.request_id,
            "trace_id": self.trace_id(),
            "sampled": self.trace is not None,
            "route": self.route,
            "stream": self.stream,
            "tenant": self.tenant,
            "key_id": self.key_id,
            "engines": self.engines,
            "class": cls,
            "row": self.row,
            "status": self.status,
            "ttft_ms": ms(self.ttft_s),
            "tpot_ms": ms(self.tpot_s),
            "duration_ms": ms(now - self.arrival),
            "queue_ms": ms(self.queue_s),
            "projected_ttft_ms": None if self.projected_ttft_ms is None else round(self.projected_ttft_ms, 3),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "expected_cached_tokens": self.expected_cached,
            "finish_reason": self.finish_reason,
            "retries": self.retries,
            "migrations": self.migrations,
            "request_bytes": self.request_bytes,
            "response_bytes": self.response_bytes,
            "events": self.events,
        }


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000.0, 3)


def emit_request_end(rec: RequestRecord, cls: str, now: float) -> None:
    """The request ended: its root span (when traced) and its request_end line (json)."""
    t = rec.trace
    if t is None and not rec.log:
        return  # only a client's traceparent was carried
    f = rec.fields(cls, now)
    if t is not None:
        t.end(error=cls == "failed" or (rec.status or 0) >= 500,
              **{"narwhal.class": cls, "narwhal.row": rec.row, "http.response.status_code": rec.status, "narwhal.route": rec.route,
                 "narwhal.stream": rec.stream, "narwhal.tenant": rec.tenant, "narwhal.engines": rec.engines or None,
                 "narwhal.ttft_ms": f["ttft_ms"], "narwhal.tpot_ms": f["tpot_ms"], "narwhal.prompt_tokens": rec.prompt_tokens,
                 "narwhal.output_tokens": rec.output_tokens, "narwhal.cached_tokens": rec.cached_tokens,
                 "narwhal.finish_reason": rec.finish_reason, "narwhal.retries": rec.retries, "narwhal.migrations": rec.migrations})
    if rec.log:
        request_log.info("request %s ended %s", rec.request_id, cls, extra=event(REQUEST_END, **f))
