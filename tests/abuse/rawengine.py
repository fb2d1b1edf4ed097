"""A hostile engine for the abuse tests: a raw asyncio TCP server on a loopback port, in
its own thread, that records every request head and body and answers with whatever bytes
a test scripts (a line that never ends, garbage, a huge head), or as a well-behaved vLLM
engine would (health 200, a short token stream with token IDs)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import orjson

__all__ = ["Request", "RawEngine", "Answer", "raw_engine", "closed_port", "SSE_HEAD", "chunk", "token_event", "good_stream"]


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> object:
        return orjson.loads(self.body)


Answer = Callable[[Request, asyncio.StreamWriter], Awaitable[None]]

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def token_event(i: int, *, finish: str | None = None) -> bytes:
    """A vLLM chat chunk carrying one token and its ID."""
    ev = {
        "id": "chatcmpl-raw", "object": "chat.completion.chunk", "created": 1, "model": "narwhal-demo",
        "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "token_ids": [100 + i], "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(ev) + b"\n\n"


def good_stream(tokens: int = 3) -> bytes:
    """A whole, well-formed streamed answer (chunked): tokens, usage, [DONE]."""
    usage = {"id": "chatcmpl-raw", "object": "chat.completion.chunk", "created": 1, "model": "narwhal-demo", "choices": [],
             "usage": {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}}
    events = [token_event(i, finish="stop" if i == tokens - 1 else None) for i in range(tokens)]
    events += [b"data: " + orjson.dumps(usage) + b"\n\n", b"data: [DONE]\n\n"]
    return SSE_HEAD + b"".join(chunk(e) for e in events) + b"0\r\n\r\n"


async def _health(req: Request, w: asyncio.StreamWriter) -> None:
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")


async def _good(req: Request, w: asyncio.StreamWriter) -> None:
    w.write(good_stream())


class RawEngine:
    """`answer` handles completion POSTs; GETs (health polls) answer 200 `{}`."""

    def __init__(self, answer: Answer = _good) -> None:
        self.answer = answer
        self.requests: list[Request] = []
        self.port = 0
        self._lock = threading.Lock()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def posts(self) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.method == "POST"]

    def all(self) -> list[Request]:
        with self._lock:
            return list(self.requests)

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self._writers.add(w)
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for ln in lines[1:]:
                    k, sep, v = ln.partition(":")
                    if sep:
                        headers[k.strip().lower()] = v.strip()
                n = int(headers.get("content-length", "0"))
                body = await r.readexactly(n) if n else b""
                req = Request(method, path, headers, body)
                with self._lock:
                    self.requests.append(req)
                await (_health if method == "GET" else self.answer)(req, w)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self._writers.discard(w)
            w.close()


@contextlib.contextmanager
def raw_engine(answer: Answer = _good) -> Iterator[RawEngine]:
    """A RawEngine served on a free loopback port until the block ends."""
    eng = RawEngine(answer)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop: dict[str, asyncio.Event] = {}

    async def main() -> None:
        stop["ev"] = asyncio.Event()
        srv = await asyncio.start_server(eng._conn, "127.0.0.1", 0)
        eng.port = srv.sockets[0].getsockname()[1]
        ready.set()
        await stop["ev"].wait()
        srv.close()
        for w in list(eng._writers):
            w.transport.abort()
        await asyncio.sleep(0.05)  # let the connection handlers end

    th = threading.Thread(target=loop.run_until_complete, args=(main(),), name="raw-engine", daemon=True)
    th.start()
    assert ready.wait(10), "the raw engine did not start"
    try:
        yield eng
    finally:
        loop.call_soon_threadsafe(stop["ev"].set)
        th.join(10)
        if not th.is_alive():
            loop.close()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port
