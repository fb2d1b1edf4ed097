"""A minimal, fast vLLM-dialect streaming engine for relay-cost benchmarks ("ticker").

Why: the relay benchmark needs 200 streams x one token every 20 ms = 10,000 events/s
from the engine side, on the core the load tool also uses. The simulated engine
(narwhal/mock, Starlette-free but served by hypercorn) spends on the order of 100 us per
event, so it cannot produce that rate on a shared core; this source writes pre-rendered
SSE chunks straight to an asyncio transport (a few us per event).

Rules
  * HTTP/1.1 keep-alive, one request at a time per connection; GET /health, GET
    /v1/models, POST /v1/chat/completions and /v1/completions; request bodies with
    Content-Length or chunked (a relay may stream the body on: SMG with retries off).
  * Output length: `mock.tokens` (body field or `[[mock {"tokens": N}]]` in the prompt
    text), else max_tokens, else --tokens. One token per event, `interval_ms` apart
    (`mock.tpot_ms` overrides), the first after `mock.prefill_ms` (default 0). Every event
    carries `token_ids` (one ID) when the request asks for `return_token_ids`; the usage
    chunk comes when stream_options.include_usage is set. Non-streaming requests get one
    chat.completion / text_completion JSON after the same time.
  * Tokens are due on a fixed schedule (first + i * interval), not interval after the
    previous write, so the offered rate is exact; a late tick is not caught up in a burst.
  * A closed connection cancels its stream's timer at once.
    python -m narwhal_bench.ticker --port 9100 [--interval-ms 20] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import time
from typing import Any

import orjson

__all__ = ["TickerServer", "serve", "main"]

_DIRECTIVE = re.compile(r"\[\[mock\s*(\{.*?\})\s*\]\]")


def _opts(body: dict[str, Any]) -> dict[str, Any]:
    m = body.get("mock")
    if isinstance(m, dict):
        return m
    text = ""
    msgs = body.get("messages")
    if isinstance(msgs, list):
        text = " ".join(str(x.get("content")) for x in msgs if isinstance(x, dict))
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    if "[[mock" in text:
        mm = _DIRECTIVE.search(text)
        if mm:
            try:
                d = orjson.loads(mm.group(1))
                if isinstance(d, dict):
                    return d
            except orjson.JSONDecodeError:
                pass
    return {}


def _dechunk(buf: bytes, i: int) -> tuple[bytes, int] | None:
    """A chunked request body starting at buf[i]: (body, index after it), or None while
    incomplete (trailers are skipped)."""
    parts = []
    while True:
        eol = buf.find(b"\r\n", i)
        if eol < 0:
            return None
        size = int(buf[i:eol].split(b";", 1)[0], 16)
        i = eol + 2
        if size == 0:
            while True:  # trailer lines, up to an empty one
                eol = buf.find(b"\r\n", i)
                if eol < 0:
                    return None
                line, i = buf[i:eol], eol + 2
                if not line:
                    return b"".join(parts), i
        if len(buf) < i + size + 2:
            return None
        parts.append(buf[i:i + size])
        i += size + 2


class _Stream:
    __slots__ = ("conn", "left", "i", "interval", "handle", "chat", "ids", "usage", "head", "tail", "prompt", "total", "stream", "rid", "due")


class _Conn(asyncio.Protocol):
    def __init__(self, srv: TickerServer) -> None:
        self.srv = srv
        self.t: asyncio.Transport | None = None
        self.buf = b""
        self.cur: _Stream | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        s = self.cur
        if s is not None and s.handle is not None:
            s.handle.cancel()
        self.cur = None
        self.t = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.cur is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].split(b"\r\n")
            n = 0
            chunked = False
            for ln in head[1:]:
                k, _, v = ln.partition(b":")
                k = k.strip().lower()
                if k == b"content-length":
                    n = int(v)
                elif k == b"transfer-encoding" and b"chunked" in v.lower():
                    chunked = True
            if chunked:  # a relay that streams the body on (SMG with retries off)
                got = _dechunk(self.buf, end + 4)
                if got is None:
                    return
                body, stop = got
                self.buf = self.buf[stop:]
            else:
                if len(self.buf) < end + 4 + n:
                    return
                body = self.buf[end + 4:end + 4 + n]
                self.buf = self.buf[end + 4 + n:]
            parts = head[0].split(b" ")
            self._handle(parts[0], parts[1].split(b"?")[0] if len(parts) > 1 else b"/", body)

    def _write_json(self, status: int, obj: Any) -> None:
        data = orjson.dumps(obj)
        if self.t is not None:
            self.t.write(b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (status, len(data), data))

    def _handle(self, method: bytes, path: bytes, raw: bytes) -> None:
        srv = self.srv
        if method == b"GET" and path == b"/health":
            self._write_json(200, {"status": "ok"})
            return
        if method == b"GET" and path == b"/v1/models":
            self._write_json(200, {"object": "list", "data": [{"id": srv.model, "object": "model", "created": 0, "owned_by": "vllm", "max_model_len": 131072}]})
            return
        if method != b"POST" or path not in (b"/v1/chat/completions", b"/v1/completions"):
            self._write_json(404, {"error": {"message": "not found", "type": "NotFoundError", "code": 404}})
            return
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self._write_json(400, {"error": {"message": "bad json", "type": "BadRequestError", "code": 400}})
            return
        opts = _opts(body)
        tokens = opts.get("tokens") or body.get("max_tokens") or body.get("max_completion_tokens") or srv.tokens
        mt = body.get("max_tokens") or body.get("max_completion_tokens")
        if isinstance(mt, int):
            tokens = min(int(tokens), mt)
        s = _Stream()
        s.conn = self
        s.total = s.left = max(1, int(tokens))
        s.i = 0
        s.interval = float(opts.get("tpot_ms", srv.interval_ms)) / 1000.0
        s.chat = path == b"/v1/chat/completions"
        s.ids = body.get("return_token_ids") is True
        so = body.get("stream_options")
        s.usage = isinstance(so, dict) and so.get("include_usage") is True
        s.stream = body.get("stream") is True
        s.prompt = 16
        s.handle = None
        srv.seq += 1
        s.rid = b"cmpl-t%d" % srv.seq
        m = srv.model.encode()
        if s.chat:
            s.head = b'{"id":"chat' + s.rid + b'","object":"chat.completion.chunk","created":0,"model":"' + m + b'","choices":[{"index":0,"delta":{"content":"t%d "},"logprobs":null,"finish_reason":'
        else:
            s.head = b'{"id":"' + s.rid + b'","object":"text_completion","created":0,"model":"' + m + b'","choices":[{"index":0,"text":"t%d ","logprobs":null,"finish_reason":'
        s.tail = b',"token_ids":[%d]}]}' if s.ids else b"}]}"
        self.cur = s
        prefill = float(opts.get("prefill_ms", 0.0)) / 1000.0
        loop = asyncio.get_running_loop()
        if s.stream:
            assert self.t is not None
            self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
            if s.chat:
                role = b'{"id":"chat' + s.rid + b'","object":"chat.completion.chunk","created":0,"model":"' + m + b'","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}'
                self._chunk(b"data: " + role + b"\n\n")
            s.due = loop.time() + prefill
            s.handle = loop.call_at(s.due, self._tick)
        else:
            s.handle = loop.call_later(prefill + s.interval * max(0, s.total - 1), self._respond)

    def _chunk(self, ev: bytes) -> None:
        if self.t is not None:
            self.t.write(b"%x\r\n%s\r\n" % (len(ev), ev))

    def _tick(self) -> None:
        s = self.cur
        if s is None or self.t is None:
            return
        s.i += 1
        last = s.i >= s.total
        tid = 100 + s.i % 800
        ev = b"data: " + (s.head % tid) + (b'"length"' if last else b"null") + ((s.tail % tid) if s.ids else s.tail) + b"\n\n"
        if not last:
            self._chunk(ev)
            loop = asyncio.get_running_loop()
            s.due = max(s.due + s.interval, loop.time() - s.interval)  # on schedule; no burst after a stall
            s.handle = loop.call_at(s.due, self._tick)
            return
        out = [ev]
        if s.usage:
            u = b'{"id":"' + s.rid + b'","object":"chat.completion.chunk","created":0,"model":"' + self.srv.model.encode() + b'","choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}' % (s.prompt, s.total, s.prompt + s.total)
            out.append(b"data: " + u + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        data = b"".join(out)
        self.t.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
        self.srv.completed += 1
        self.cur = None
        if self.buf:
            self.data_received(b"")

    def _respond(self) -> None:
        s = self.cur
        if s is None:
            return
        text = "".join(f"t{i} " for i in range(1, s.total + 1))
        usage = {"prompt_tokens": s.prompt, "completion_tokens": s.total, "total_tokens": s.prompt + s.total}
        if s.chat:
            obj = {"id": "chat" + s.rid.decode(), "object": "chat.completion", "created": 0, "model": self.srv.model, "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}], "usage": usage}
        else:
            obj = {"id": s.rid.decode(), "object": "text_completion", "created": 0, "model": self.srv.model, "choices": [{"index": 0, "text": text, "finish_reason": "length"}], "usage": usage}
        self._write_json(200, obj)
        self.srv.completed += 1
        self.cur = None
        if self.buf:
            self.data_received(b"")


class TickerServer:
    def __init__(self, *, model: str = "narwhal-demo", interval_ms: float = 20.0, tokens: int = 64) -> None:
        self.model, self.interval_ms, self.tokens = model, interval_ms, tokens
        self.seq = 0
        self.completed = 0

    def protocol(self) -> _Conn:
        return _Conn(self)


async def serve(host: str, port: int, srv: TickerServer, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(srv.protocol, host, port, backlog=8192, reuse_address=True)
    try:
        await stop.wait()
    finally:
        server.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m narwhal_bench.ticker", description="A fast vLLM-dialect SSE source for relay benchmarks.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="narwhal-demo")
    p.add_argument("--interval-ms", type=float, default=20.0)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(f"ticker on http://{a.host}:{a.port} ({a.interval_ms} ms per token) since {time.time():.0f}", flush=True)
        await serve(a.host, a.port, TickerServer(model=a.model, interval_ms=a.interval_ms, tokens=a.tokens), stop)

    asyncio.run(go())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
