"""What a completion request's response goes out through, and how it is cut short.

`AsgiSink` is the data plane's Sink over ASGI send (straight to an HTTP/1.1 connection
where hyper.py allows); `Stalls` drops clients that accept no bytes for
serving.send_stall_ms; `until_disconnect` runs a request and cancels it when its client
goes away (class `cancelled`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from starlette.types import Receive, Send

from . import hyper
from .h1fast import PreparedHead

__all__ = ["AsgiSink", "Stalls", "until_disconnect"]

log = logging.getLogger("narwhal")
_monotonic = time.monotonic

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
]


class AsgiSink:
    """pipeline.Sink over ASGI send. Every send is bounded by serving.send_stall_ms: a
    client that accepts no bytes for that long (HTTP/1.1: the TCP window; HTTP/2: the
    flow-control window, see hyper.py defect 1) is dropped by `Stalls`, which
    cancels the request (its engine request is cancelled, its slots freed; class
    cancelled). A send only notes when it began (no timer per event: an asyncio.timeout
    around every write cost ~8 us an event on the relay path)."""

    __slots__ = ("_send", "rid", "headers_sent", "finished", "stall_s", "sending_since", "extra_headers", "row", "status", "body_bytes", "ending", "_direct", "_prepared")

    def __init__(self, send: Send, rid: str, stall_s: float, direct: hyper.H1Direct | None = None) -> None:
        self._send = send
        # HTTP/1.1 under hypercorn: body bytes straight to the transport while that is what
        # ASGI would do (hyper.py item 11); the relay writes from the engine's reads with it
        self._direct = direct
        self._prepared: PreparedHead | None = None  # the stream's head, built ahead (prepare_start)
        self.ending = False  # the response's last message is being sent: its stream closing is its end
        self.rid = rid
        self.headers_sent = False
        self.finished = False
        self.stall_s = stall_s
        self.sending_since = 0.0  # monotonic time the pending send began; 0: none pending
        self.extra_headers: list[tuple[bytes, bytes]] = []
        # for the request's record (per response, never per event)
        self.row: str | None = None
        self.status: int | None = None
        self.body_bytes: int | None = None

    async def _out(self, msg: dict[str, Any]) -> None:
        self.sending_since = _monotonic()
        await self._send(msg)
        self.sending_since = 0.0

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        h = [*headers, *self.extra_headers, (b"x-request-id", self.rid.encode()), (b"content-length", str(len(body)).encode())]
        self.headers_sent = True
        self.status = status
        self.body_bytes = len(body)
        await self._out({"type": "http.response.start", "status": status, "headers": h})
        self.ending = True
        await self._out({"type": "http.response.body", "body": body, "more_body": False})
        self.finished = True

    def _head(self) -> list[tuple[bytes, bytes]]:
        return [*_SSE_HEADERS, *self.extra_headers, (b"x-request-id", self.rid.encode())]

    # write_now and start_now (replies.Sink): made when read, not kept (two bound methods
    # per open stream); the relay reads write_now once per event (~0.1 us)
    @property
    def write_now(self) -> Callable[[bytes], bool] | None:
        d = self._direct
        return d.write if d is not None else None

    @property
    def chunk_writer(self) -> hyper.H1Direct | None:
        return self._direct

    @property
    def start_now(self) -> Callable[[bytes], bool] | None:
        return self._start_now if self._direct is not None else None

    def prepare_start(self) -> None:
        """The stream's head built now, while the engine works on the first token (item
        21: H1Direct.prepare), so that _start_now only writes it; nothing where the head is
        not written straight to the connection."""
        if self._direct is not None and not self.headers_sent:
            self._prepared = self._direct.prepare(200, self._head())

    def _start_now(self, first: bytes) -> bool:
        """The stream's head and its first bytes written now (hyper.py items 11, 15), or
        nothing (False)."""
        assert self._direct is not None
        prepared, self._prepared = self._prepared, None
        if not self._direct.start(200, self._head(), first, prepared):
            return False
        self.headers_sent = True
        self.status = 200
        return True

    async def start_stream(self) -> None:
        if self._direct is not None and self._start_now(b""):  # HTTP/1.1: straight out (hyper.py item 11)
            return
        self.headers_sent = True
        self.status = 200
        await self._out({"type": "http.response.start", "status": 200, "headers": self._head()})

    async def write(self, data: bytes) -> None:
        await self._out({"type": "http.response.body", "body": data, "more_body": True})

    async def end_stream(self, last: bytes = b"") -> None:
        d = self._direct
        if d is not None and d.end(last):  # HTTP/1.1: one write, the last chunk in it (hyper.py item 17)
            self.ending = True
            await d.closed()
        else:
            if last:
                await self.write(last)
            self.ending = True
            await self._out({"type": "http.response.body", "body": b"", "more_body": False})
        self.finished = True


class _Disconnected(Exception):
    pass


class _Cancellable(Protocol):
    def cancel(self) -> object: ...


class Stalls:
    """serving.send_stall_ms for every request of an endpoint: one task, waking every
    stall_s / 4 while any request is watched, cancels each request whose pending send
    began more than stall_s ago (a task per request cost 1.4 KiB per open stream)."""

    __slots__ = ("watched", "_task")

    def __init__(self) -> None:
        self.watched: dict[AsgiSink, _Cancellable] = {}
        self._task: asyncio.Task[None] | None = None

    def watch(self, sink: AsgiSink, task: _Cancellable) -> None:
        self.watched[sink] = task
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    def unwatch(self, sink: AsgiSink) -> None:
        self.watched.pop(sink, None)
        if not self.watched and self._task is not None:  # nothing left: no task outlives the requests
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while self.watched:
            await asyncio.sleep(min(4.0, next(iter(self.watched)).stall_s / 4))
            now = _monotonic()
            for sink, task in list(self.watched.items()):
                since = sink.sending_since
                if since and now - since > sink.stall_s:
                    log.info("request %s: the client accepted no bytes for %.0f ms; dropped", sink.rid, sink.stall_s * 1000)
                    del self.watched[sink]
                    task.cancel()


class _Cut:
    """Cancels the request's own task for its client (gone, or stalled) and remembers it
    did: that cancellation is the class `cancelled`, any other one goes on up."""

    __slots__ = ("task", "sink", "fired")

    def __init__(self, task: asyncio.Task[Any], sink: AsgiSink) -> None:
        self.task = task
        self.sink = sink
        self.fired = False

    def cancel(self) -> None:  # Stalls: the client accepted nothing for send_stall_ms
        if not self.fired:
            self.fired = True
            self.task.cancel()

    def gone(self) -> None:  # the stream closed: the client went away, unless it was the answer's end
        if not self.sink.ending:
            self.cancel()


async def until_disconnect(work: Coroutine[Any, Any, str], receive: Receive, sink: AsgiSink, hook: hyper.CloseHook | None, stalls: Stalls) -> str:
    """Run the request; if the client disconnects first, or stops reading for
    serving.send_stall_ms, cancel it (which closes the engine connections and frees
    every slot) and report the class `cancelled`.

    hypercorn reports a disconnect only through receive(), and a send() to a gone client
    is silently dropped: without a watcher a stream would run on to its end. Under
    hypercorn the stream's CloseHook (hyper.py) cancels the request -- run here, in the
    app's own task (a task of its own cost a loop turn before the engine saw the request,
    and memory per open stream) -- when the stream closes; under any other server a task
    waits on receive()."""
    if hook is None:
        return await _until_received_disconnect(work, receive, sink, stalls)
    if hook.closed:  # reset right after it was sent (HTTP/2 rapid reset): no engine sees it
        work.close()
        return "cancelled"
    me = asyncio.current_task()
    assert me is not None
    cut = _Cut(me, sink)
    hook.cb = cut.gone
    stalls.watch(sink, cut)
    try:
        got = await work
    except asyncio.CancelledError:
        if cut.fired and me.uncancel() == 0:  # only the client's cut: the request's end
            return "cancelled"
        raise
    except BaseException:
        if cut.fired:  # cut, and the work ended with an error of its own: that goes on up alone
            me.uncancel()
        raise
    finally:
        hook.cb = None
        stalls.unwatch(sink)
    if cut.fired:  # cut as it ended, and the work let the cancellation pass: it is not pending
        me.uncancel()
    return got


async def _until_received_disconnect(work: Coroutine[Any, Any, str], receive: Receive, sink: AsgiSink, stalls: Stalls) -> str:
    """_until_disconnect for a server without CloseHooks: a task waits on receive()."""
    watch = asyncio.ensure_future(receive())
    # a client that reset its stream right after sending it (HTTP/2 rapid reset) has its
    # disconnect queued already: one turn of the loop lets the watcher see it, and the
    # request never reaches an engine
    await asyncio.sleep(0)
    if watch.done() and watch.result().get("type") == "http.disconnect":
        work.close()
        return "cancelled"
    task = asyncio.ensure_future(work)
    stalls.watch(sink, task)
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return "cancelled" if task.cancelled() else task.result()
        msg = watch.result()
        if msg.get("type") != "http.disconnect":  # not expected after the whole body
            try:
                return await task
            except asyncio.CancelledError:
                if task.cancelled() and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
                    return "cancelled"  # dropped by the stall watcher
                raise
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return "cancelled"
    finally:
        stalls.unwatch(sink)
        if not watch.done():
            watch.cancel()
        if not task.done():
            task.cancel()
