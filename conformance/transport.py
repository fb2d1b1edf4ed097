"""HTTP for the runner: probes over HTTP/1.1 or HTTP/2 (httpx), background requests over
their own HTTP/1.1 connection (a raw socket with h11, so that "the client goes away"
is a real connection close on both protocols), and the response document the case
assertions read.

Response document (what `json.`, `sse.`, `headers.` paths in a case refer to):
  status        the HTTP status (null when the request failed at the transport)
  headers       lower-cased names; repeated headers joined with ", "
  json          the body parsed as JSON, when it is JSON
  text          the body as text, when it is not JSON and not an event stream
  sse           for text/event-stream bodies: events (every data payload, JSON-parsed
                when it parses), chunks (events that are objects without "error"),
                errors (the "error" objects of error events), done ([DONE] seen),
                after_done (payloads after [DONE]), accumulated (see `accumulate`),
                comments (the text of each SSE comment line, ": x" -> "x", in order)
  transport_error   why the exchange failed or was cut, else null
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11
import httpx

__all__ = ["Exchange", "RequestData", "RouterClient", "Background", "document", "parse_sse", "accumulate", "COMPLETION_ROUTES", "raw_exchange"]

COMPLETION_ROUTES = ("/v1/chat/completions", "/v1/completions")


@dataclass
class RequestData:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes | None
    timeout_s: float = 15.0


@dataclass
class Exchange:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str | None = None
    elapsed_ms: float = 0.0
    http_version: str | None = None


def _headers(pairs: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in pairs:
        k = (k.decode("latin-1") if isinstance(k, bytes) else k).lower()
        v = v.decode("latin-1") if isinstance(v, bytes) else v
        out[k] = f"{out[k]}, {v}" if k in out else v
    return out


class RouterClient:
    """The HTTP client to the router under test, in the run's protocol: one pooled httpx
    client per run."""

    def __init__(self, base_url: str, *, http2: bool = False) -> None:
        self.base_url = base_url.rstrip("/")
        self.http2 = http2
        self.client = httpx.Client(http1=not http2, http2=http2, timeout=httpx.Timeout(15.0), limits=httpx.Limits(max_connections=32))

    def close(self) -> None:
        self.client.close()

    def send(self, req: RequestData) -> Exchange:
        t0 = time.monotonic()
        ex = Exchange()
        try:
            with self.client.stream(req.method, self.base_url + req.path, headers=req.headers, content=req.body, timeout=req.timeout_s) as r:
                ex.status = r.status_code
                ex.headers = _headers(r.headers.raw)
                ex.http_version = r.http_version
                parts = []
                try:
                    for b in r.iter_raw():
                        parts.append(b)
                except httpx.HTTPError as e:
                    ex.error = f"{type(e).__name__}: {e}"
                ex.body = b"".join(parts)
        except httpx.HTTPError as e:
            ex.error = f"{type(e).__name__}: {e}"
        ex.elapsed_ms = (time.monotonic() - t0) * 1000.0
        return ex

    def get(self, path: str, timeout_s: float = 5.0) -> Exchange:
        return self.send(RequestData("GET", path, {}, None, timeout_s))


class Background:
    """A request on its own HTTP/1.1 connection, read by a thread. `partial` sends the
    headers and half the body and then nothing (a client still uploading). `release`
    closes the connection: the client goes away."""

    def __init__(self, base_url: str, req: RequestData, *, partial: bool = False) -> None:
        u = urlsplit(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.req, self.partial = req, partial
        self.exchange = Exchange()
        self.events = 0  # SSE events received so far
        self.released = False
        self._sock: socket.socket | None = None
        self._done = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="conformance-background", daemon=True)
        self._thread.start()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def _run(self) -> None:
        ex = self.exchange
        try:
            s = socket.create_connection((self.host, self.port), timeout=self.req.timeout_s)
            self._sock = s
            if self.released:
                raise OSError("released")
            conn = h11.Connection(h11.CLIENT)
            body = self.req.body or b""
            hdrs = [("host", f"{self.host}:{self.port}"), *self.req.headers.items(), ("content-length", str(len(body)))]
            s.sendall(conn.send(h11.Request(method=self.req.method, target=self.req.path, headers=hdrs)))
            if self.partial:
                s.sendall(conn.send(h11.Data(data=body[: max(1, len(body) // 2)])))
            else:
                if body:
                    s.sendall(conn.send(h11.Data(data=body)))
                s.sendall(conn.send(h11.EndOfMessage()))
            parts: list[bytes] = []
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    data = s.recv(65536)
                    conn.receive_data(data)
                    if not data and conn.their_state is not h11.DONE:
                        ex.error = "connection closed before the response ended"
                        break
                    continue
                if isinstance(ev, h11.Response):
                    ex.status = ev.status_code
                    ex.headers = _headers(ev.headers)
                elif isinstance(ev, h11.Data):
                    parts.append(bytes(ev.data))
                    self.events += bytes(ev.data).count(b"\n\n")
                elif isinstance(ev, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
            ex.body = b"".join(parts)
        except (OSError, h11.ProtocolError) as e:
            ex.error = "released by the runner" if self.released else f"{type(e).__name__}: {e}"
        finally:
            ex.elapsed_ms = (time.monotonic() - self._t0) * 1000.0
            self.close_socket()
            self._done.set()

    def close_socket(self) -> None:
        s = self._sock
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def release(self) -> None:
        self.released = True
        self.close_socket()

    def wait(self, timeout_s: float) -> Exchange:
        if not self._done.wait(timeout_s):
            self.release()
            self._done.wait(2.0)
            self.exchange.error = (self.exchange.error or "") + f" (no answer within {timeout_s:g} s)"
        return self.exchange


def raw_exchange(base_url: str, data: bytes, timeout_s: float = 5.0) -> Exchange:
    """Bytes that need not be HTTP, on a connection of their own; the answer read until
    the router closes (or timeout_s), its head parsed by hand (h11 would refuse to send
    what is being tested)."""
    u = urlsplit(base_url)
    ex = Exchange()
    t0 = time.monotonic()
    out = b""
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 80), timeout=timeout_s) as s:
            s.sendall(data)
            end = t0 + timeout_s
            while time.monotonic() < end:
                d = s.recv(65536)
                if not d:
                    break
                out += d
                head, sep, body = out.partition(b"\r\n\r\n")
                if sep:
                    hs = _raw_headers(head)
                    if "content-length" in hs and len(body) >= int(hs["content-length"]):
                        break
    except OSError as e:
        ex.error = f"{type(e).__name__}: {e}"
    head, sep, body = out.partition(b"\r\n\r\n")
    first = head.split(b"\r\n", 1)[0].split()
    if len(first) >= 2 and first[0].startswith(b"HTTP/") and first[1].isdigit():
        ex.status = int(first[1])
        ex.headers = _raw_headers(head)
        ex.body = body
    elif ex.error is None:
        ex.error = f"not an HTTP response: {out[:80]!r}"
    ex.elapsed_ms = (time.monotonic() - t0) * 1000.0
    return ex


def _raw_headers(head: bytes) -> dict[str, str]:
    pairs = []
    for line in head.split(b"\r\n")[1:]:
        k, sep, v = line.partition(b":")
        if sep:
            pairs.append((k.strip(), v.strip()))
    return _headers(pairs)


def parse_sse(body: bytes) -> dict[str, Any]:
    events: list[Any] = []
    after: list[Any] = []
    comments: list[str] = []
    done = False
    text = body.decode("utf-8", "replace").replace("\r\n", "\n")
    for block in text.split("\n\n"):
        comments += [line[2:] if line.startswith(": ") else line[1:] for line in block.split("\n") if line.startswith(":")]
        data = [line[5:].lstrip(" ") if line.startswith("data:") else None for line in block.split("\n") if line and not line.startswith(":")]
        payloads = [d for d in data if d is not None]
        if not payloads:
            continue
        payload = "\n".join(payloads)
        if payload == "[DONE]":
            if done:
                after.append(payload)
            done = True
            continue
        try:
            v: Any = json.loads(payload)
        except ValueError:
            v = payload
        (after if done else events).append(v)
    chunks = [e for e in events if isinstance(e, dict) and "error" not in e]
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    return {"events": events, "chunks": chunks, "errors": errors, "done": done, "after_done": after, "accumulated": accumulate(chunks), "comments": comments}


def accumulate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client builds from streamed chunks of choice 0: strings joined by field, tool
    calls by index (each field joined), token IDs flattened, the last non-null
    finish_reason and usage. Keys appear only when some chunk carried them."""
    acc: dict[str, Any] = {}
    calls: dict[int, dict[str, Any]] = {}
    for ch in chunks:
        if ch.get("usage") is not None:
            acc["usage"] = ch["usage"]
        if "prompt_token_ids" in ch:
            acc["prompt_token_ids"] = ch["prompt_token_ids"]
        for c in ch.get("choices") or ():
            if not isinstance(c, dict) or c.get("index", 0) != 0:
                continue
            delta = c.get("delta")
            d: dict[str, Any] = delta if isinstance(delta, dict) else {}
            for k in ("content", "reasoning", "reasoning_content", "refusal"):
                if isinstance(d.get(k), str):
                    acc[k] = acc.get(k, "") + d[k]
            if isinstance(d.get("role"), str):
                acc.setdefault("role", d["role"])
            if isinstance(c.get("text"), str):
                acc["text"] = acc.get("text", "") + c["text"]
            for tc in d.get("tool_calls") or ():
                if not isinstance(tc, dict):
                    continue
                a = calls.setdefault(tc.get("index", 0), {"index": tc.get("index", 0), "id": "", "type": None, "name": "", "arguments": ""})
                a["id"] += tc.get("id") or ""
                a["type"] = a["type"] or tc.get("type")
                fnv = tc.get("function")
                fn: dict[str, Any] = fnv if isinstance(fnv, dict) else {}
                a["name"] += fn.get("name") or ""
                a["arguments"] += fn.get("arguments") or ""
            fc = d.get("function_call")
            if isinstance(fc, dict):
                f = acc.setdefault("function_call", {"name": "", "arguments": ""})
                f["name"] += fc.get("name") or ""
                f["arguments"] += fc.get("arguments") or ""
            if isinstance(c.get("token_ids"), list):
                acc.setdefault("token_ids", []).extend(c["token_ids"])
            if c.get("prompt_token_ids") is not None:
                acc["prompt_token_ids"] = c["prompt_token_ids"]
            lp = c.get("logprobs")
            if isinstance(lp, dict):
                for k, v in lp.items():
                    if isinstance(v, list):
                        acc.setdefault("logprobs", {}).setdefault(k, []).extend(v)
            if c.get("finish_reason") is not None:
                acc["finish_reason"] = c["finish_reason"]
    if calls:
        acc["tool_calls"] = [calls[i] for i in sorted(calls)]
    return acc


def document(ex: Exchange) -> dict[str, Any]:
    doc: dict[str, Any] = {"status": ex.status, "headers": ex.headers, "transport_error": ex.error}
    ctype = ex.headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        doc["sse"] = parse_sse(ex.body)
        return doc
    try:
        doc["json"] = json.loads(ex.body) if ex.body else None
        if not ex.body:
            doc["text"] = ""
    except ValueError:
        doc["text"] = ex.body.decode("utf-8", "replace")
    return doc
