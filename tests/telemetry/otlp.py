"""An OTLP/HTTP receiver for tests: a tiny HTTP server on a free loopback port that takes
POST /v1/traces (protobuf ExportTraceServiceRequest, decoded with opentelemetry-proto)
and keeps the spans. `hang` makes it never answer (until it stops): the exporter then
times out and the router's queue fills."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

__all__ = ["Span", "Receiver", "receiver"]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attrs: dict[str, Any]
    events: list[str]
    status: int  # 0 unset, 1 ok, 2 error
    resource: dict[str, Any] = field(default_factory=dict)


class Receiver:
    def __init__(self, hang: bool = False) -> None:
        self.hang = hang
        self.spans: list[Span] = []
        self.requests = 0
        self.paths: list[str] = []
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, path: str, body: bytes) -> None:
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        out = []
        for rs in req.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                                    {a.key: _value(a.value) for a in s.attributes}, [e.name for e in s.events], s.status.code, res))
        with self.lock:
            self.requests += 1
            self.paths.append(path)
            self.spans.extend(out)

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)

    def wait_spans(self, pred: Any, timeout: float = 20.0) -> list[Span]:
        """The spans once `pred(spans)` holds (bounded)."""
        end = time.monotonic() + timeout
        while True:
            got = self.snapshot()
            if pred(got):
                return got
            if time.monotonic() > end:
                raise AssertionError(f"the receiver did not get the spans within {timeout} s: {[(s.name, s.attrs.get('narwhal.request_id')) for s in got]}")
            time.sleep(0.05)


@contextlib.contextmanager
def receiver(hang: bool = False) -> Iterator[Receiver]:
    rec = Receiver(hang)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            n = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(n)
            if rec.hang:
                rec.release.wait(30)  # never answers while the test runs (bounded)
                return
            rec.add(self.path, body)
            out = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    rec.server = srv
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True, name="otlp-receiver")
    t.start()
    try:
        yield rec
    finally:
        rec.release.set()
        srv.shutdown()
        srv.server_close()
        t.join(10)
