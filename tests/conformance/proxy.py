"""Deliberately wrong routers: a small mutating HTTP/1.1 proxy in front of a correct
Narwhal. A `Mutation` rewrites requests, response headers, JSON bodies or SSE events;
everything else passes through (request bodies stream, so a stalled upload stays
stalled; a client that goes away cancels the upstream request)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx

from narwhal.http.server import free_port

__all__ = ["Mutation", "running_proxy", "DropRetryAfter", "ReverseToolCalls", "LeakTokenIds", "Answer500", "RenameCode", "ForeignFace", "DropUsage"]

_HOP = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive"}


class Mutation:
    rewrites_request = False

    def local(self, path: str) -> tuple[int, Any] | None:
        """Answer here instead of forwarding (status, JSON body); None forwards."""
        return None

    def request_headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        return headers

    def request(self, path: str, body: Any) -> Any:
        return body

    def headers(self, status: int, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        return headers

    def json(self, path: str, status: int, obj: Any) -> tuple[int, Any]:
        return status, obj

    def event(self, path: str, obj: Any) -> Any:
        return obj


class DropRetryAfter(Mutation):
    """Forgets Retry-After on every answer."""

    def headers(self, status: int, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        return [(k, v) for k, v in headers if k.lower() != b"retry-after"]


class ReverseToolCalls(Mutation):
    """Returns assembled tool calls in reverse index order."""

    def json(self, path: str, status: int, obj: Any) -> tuple[int, Any]:
        for c in obj.get("choices") or () if isinstance(obj, dict) else ():
            tcs = (c.get("message") or {}).get("tool_calls")
            if isinstance(tcs, list):
                tcs.reverse()
        return status, obj


class LeakTokenIds(Mutation):
    """Asks the router for token IDs on every request and hands them to every client."""

    rewrites_request = True

    def request(self, path: str, body: Any) -> Any:
        if isinstance(body, dict) and path.endswith("completions"):
            body["return_token_ids"] = True
        return body


class Answer500(Mutation):
    """Answers 500 where the router answers row R06 (invalid_sampling_width)."""

    def json(self, path: str, status: int, obj: Any) -> tuple[int, Any]:
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict) and obj["error"].get("code") == "invalid_sampling_width":
            return 500, {"error": {"message": "Internal router error", "type": "server_error", "param": None, "code": "internal_error"}}
        return status, obj


class DropUsage(Mutation):
    """Drops usage from assembled answers and from every streamed chunk."""

    def json(self, path: str, status: int, obj: Any) -> tuple[int, Any]:
        if isinstance(obj, dict):
            obj.pop("usage", None)
        return status, obj

    def event(self, path: str, obj: Any) -> Any:
        if isinstance(obj, dict):
            obj.pop("usage", None)
        return obj


class RenameCode(Mutation):
    """Renames one row's error code (in error answers and error events)."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def _rename(self, obj: Any) -> Any:
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict) and obj["error"].get("code") == self.old:
            obj["error"]["code"] = self.new
        return obj

    def json(self, path: str, status: int, obj: Any) -> tuple[int, Any]:
        return status, self._rename(obj)

    def event(self, path: str, obj: Any) -> Any:
        return self._rename(obj)


class ForeignFace(Mutation):
    """Narwhal behind the face of a router that is not Narwhal: no /ready, /v1/engines,
    /metrics, admin API or OpenAPI document; x-narwhal-* headers dropped; its own
    x-request-id upstream; error codes of its own (null). What any OpenAI-compatible
    router owes its clients is unchanged."""

    _HIDDEN = ("/ready", "/v1/engines", "/metrics", "/openapi.json")

    def local(self, path: str) -> tuple[int, Any] | None:
        if path in self._HIDDEN or path.startswith("/admin"):
            return 404, {"detail": "Not Found"}
        return None

    def request_headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        out = [(k, v) for k, v in headers if not k.lower().startswith(b"x-narwhal-") and k.lower() != b"x-request-id"]
        return [*out, (b"x-request-id", b"foreign-" + str(id(out)).encode())]

    def _generic(self, obj: Any) -> Any:
        # its own codes for its own errors; an engine's error event (an integer code) passes on
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict) and isinstance(obj["error"].get("code"), str):
            obj["error"]["code"] = None
        return obj

    def json(self, path: str, status: int, obj: Any) -> tuple[int, Any]:
        return status, self._generic(obj)

    def event(self, path: str, obj: Any) -> Any:
        return self._generic(obj)


class _Proxy:
    def __init__(self, upstream: str, mutation: Mutation) -> None:
        self.upstream = upstream.rstrip("/")
        self.m = mutation
        self.client: httpx.AsyncClient | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    self.client = httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=httpx.Limits(max_connections=64, max_keepalive_connections=0))
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    if self.client is not None:
                        await self.client.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        answer = self.m.local(scope["path"])
        if answer is not None:
            body = json.dumps(answer[1]).encode()
            await send({"type": "http.response.start", "status": answer[0], "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        task = asyncio.ensure_future(self._forward(scope, queue, send))

        async def pump() -> None:
            # hypercorn reports a client that went away only through receive()
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    task.cancel()
                    return
                await queue.put(msg)

        pumping = asyncio.ensure_future(pump())
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            pumping.cancel()

    async def _forward(self, scope: dict[str, Any], queue: asyncio.Queue[dict[str, Any]], send: Any) -> None:
        assert self.client is not None
        path = scope["path"]
        url = self.upstream + (scope.get("raw_path") or path.encode()).decode()
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode()
        headers = self.m.request_headers([(k, v) for k, v in scope["headers"] if k not in _HOP and k != b"host"])

        first = await queue.get()

        async def body_iter() -> Any:
            msg = first
            while True:
                yield msg.get("body", b"")
                if not msg.get("more_body"):
                    return
                msg = await queue.get()

        content: Any
        if self.m.rewrites_request or not first.get("more_body"):
            # the whole body at once (no chunked upload for a body that has arrived)
            raw = b"".join([c async for c in body_iter()])
            content = raw
            if self.m.rewrites_request:
                try:
                    content = json.dumps(self.m.request(path, json.loads(raw))).encode()
                except ValueError:
                    pass
        else:
            content = body_iter()  # a body still arriving streams on (a stalled upload stays stalled)
        req = self.client.build_request(scope["method"], url, headers=headers, content=content)
        up = await self.client.send(req, stream=True)
        try:
            hdrs = [(k.lower(), v) for k, v in up.headers.raw if k.lower() not in _HOP]
            ctype = up.headers.get("content-type", "")
            status = up.status_code
            if ctype.startswith("application/json"):
                data = await up.aread()
                try:
                    status, obj = self.m.json(path, status, json.loads(data))
                    data = json.dumps(obj).encode()
                except ValueError:
                    pass
                hdrs = self.m.headers(status, hdrs)
                await send({"type": "http.response.start", "status": status, "headers": hdrs})
                await send({"type": "http.response.body", "body": data})
                return
            await send({"type": "http.response.start", "status": status, "headers": self.m.headers(status, hdrs)})
            buf = b""
            async for chunk in up.aiter_raw():
                buf += chunk
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    await send({"type": "http.response.body", "body": self._event(path, ev) + b"\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": buf})
        finally:
            await up.aclose()

    def _event(self, path: str, ev: bytes) -> bytes:
        if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
            return ev
        try:
            obj = json.loads(ev[6:])
        except ValueError:
            return ev
        return b"data: " + json.dumps(self.m.event(path, obj)).encode()


@contextlib.contextmanager
def running_proxy(upstream: str, mutation: Mutation) -> Iterator[str]:
    """Serve the mutating proxy on a free loopback port; yields its URL."""
    from hypercorn.config import Config

    from narwhal.http import hyper
    from narwhal.http.conn import (
        serve,  # the proxy's HTTP server is Narwhal's: it answers as Narwhal does (H08, H09)
    )

    hyper.install(hyper.Limits())
    port = free_port()
    cfg = Config()
    cfg.bind = [f"127.0.0.1:{port}"]
    cfg.accesslog = None
    cfg.graceful_timeout = 0.5
    loop = asyncio.new_event_loop()
    stop: asyncio.Event | None = None
    ready = threading.Event()

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        task = asyncio.ensure_future(serve(_Proxy(upstream, mutation), cfg, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
        for _ in range(200):
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            except OSError:
                await asyncio.sleep(0.01)
        ready.set()
        await task

    th = threading.Thread(target=lambda: loop.run_until_complete(main()), name="wrong-router-proxy", daemon=True)
    th.start()
    ready.wait(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        if stop is not None:
            loop.call_soon_threadsafe(stop.set)
        th.join(10)
