"""The seam (narwhal/core/lease.py) in a worker process: `RemoteDoor`, `RemoteEntry`,
`RemoteLease` and `RemoteControls` carry each call over the IPC channel (narwhal/ipc.py)
to the authority, whose answers they await. Same calls, same answers as in process.

Invariants
  * A request has at most one call in flight to the authority at a time (its own
    sequence: arrive, admit, [wait], [decode slot], [retry]), so answers are matched by
    the request's `rid`; controls by their `qid`.
  * A request whose task is cancelled while its arrival is being decided still ends in
    the books: an End(cancelled) follows its Arrive (the authority ignores an End for a
    request it refused).
  * When the channel is lost (the authority died), every waiting call fails with
    `AuthorityLost` (a ConnectionError: the request ends as the client's connection
    does) and one-way messages are dropped; the worker stops (narwhal/workers.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

from narwhal_generated import errors as E

from .. import ipc
from ..core.lease import Grant, Order, Outcome
from ..core.tickets import Refuse

__all__ = ["Link", "RemoteDoor", "RemoteControls", "AuthorityLost"]

log = logging.getLogger("narwhal")


class AuthorityLost(ConnectionError):
    """The channel to the admission authority is gone."""


def _refuse(m: ipc.Refused) -> Refuse:
    return Refuse(E.ROWS[m.row], overrun_s=m.overrun_s, fields=m.fields)


class Link:
    """The worker's end of the channel: sends, and routes each answer to its waiter."""

    def __init__(self) -> None:
        self.channel = ipc.Channel(self._on_message, self._on_lost)
        self.pending: dict[int, asyncio.Future[Any]] = {}  # rid -> the call in flight
        self.calls: dict[int, asyncio.Future[Any]] = {}  # qid -> a control call
        self.hello: asyncio.Future[ipc.Hello] = asyncio.get_running_loop().create_future()
        self.lost = asyncio.Event()
        self._rids = itertools.count(1)
        self._qids = itertools.count(1)
        # set by the worker process (narwhal/workers.py)
        self.scrape: Callable[[], list[Any]] = list
        self.on_facts: Callable[[str, list[Any]], None] = lambda engine, facts: None
        self.on_penalise: Callable[[str, float], None] = lambda addr, seconds: None
        self._handlers: dict[type[Any], Callable[[Any], None]] = {
            ipc.Arrived: self._answer, ipc.Granted: self._answer, ipc.Refused: self._answer, ipc.NoRetry: self._answer,
            ipc.Admitted: self._admitted, ipc.Answer: self._answered, ipc.Scrape: self._scrape,
            ipc.Facts: lambda m: self.on_facts(m.engine, m.facts), ipc.Penalise: lambda m: self.on_penalise(m.addr, m.seconds),
            ipc.Hello: self._hello,
        }

    # -- sending ---------------------------------------------------------------------------

    def send(self, msg: Any) -> None:
        """A one-way message; dropped when the channel is gone."""
        if not self.channel.closed:
            self.channel.send(msg)

    def request(self, rid: int, msg: Any) -> asyncio.Future[Any]:
        if self.channel.closed:
            raise AuthorityLost("the admission authority is gone")
        f: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending[rid] = f
        self.channel.send_now(msg)  # the request waits for it: no loop turn's delay
        return f

    def next_rid(self) -> int:
        return next(self._rids)

    async def call(self, op: str, *args: Any) -> Any:
        if self.channel.closed:
            raise AuthorityLost("the admission authority is gone")
        qid = next(self._qids)
        f: asyncio.Future[ipc.Answer] = asyncio.get_running_loop().create_future()
        self.calls[qid] = f
        try:
            self.channel.send(ipc.Call(qid, op, list(args)))
            ans = await f
        finally:
            self.calls.pop(qid, None)
        if ans.error is not None:
            raise RuntimeError(f"authority: {op}: {ans.error}")
        return ans.value

    # -- receiving -------------------------------------------------------------------------

    def _on_message(self, msg: Any) -> None:
        h = self._handlers.get(type(msg))
        if h is None:
            log.warning("worker: unexpected message %s from the authority", type(msg).__name__)
            return
        h(msg)

    def _answer(self, msg: Any) -> None:
        f = self.pending.pop(msg.rid, None)
        if f is not None and not f.done():
            f.set_result(msg)

    def _admitted(self, msg: ipc.Admitted) -> None:
        f = self.pending.pop(msg.rid, None)
        if f is None or f.done():
            return
        follow: asyncio.Future[Any] | None = None
        if msg.engine is None:  # queued: the grant (or refusal) follows, maybe in this read
            follow = asyncio.get_running_loop().create_future()
            self.pending[msg.rid] = follow
        f.set_result((msg, follow))

    def _answered(self, msg: ipc.Answer) -> None:
        f = self.calls.get(msg.qid)
        if f is not None and not f.done():
            f.set_result(msg)

    def _scrape(self, msg: ipc.Scrape) -> None:
        self.send(ipc.Families(msg.qid, self.scrape()))

    def _hello(self, msg: ipc.Hello) -> None:
        if not self.hello.done():
            self.hello.set_result(msg)

    def _on_lost(self, exc: BaseException | None) -> None:
        if exc is not None:
            log.warning("worker: the channel to the authority broke: %s", exc)
        gone = AuthorityLost("the admission authority is gone")
        for f in [*self.pending.values(), *self.calls.values()]:
            if not f.done():
                f.set_exception(gone)
        self.pending.clear()
        self.calls.clear()
        if not self.hello.done():
            self.hello.set_exception(gone)
        self.lost.set()


class RemoteLease:
    __slots__ = ("link", "rid", "prompt_tokens", "projected_ttft_ms", "expected_cached", "_first")

    def __init__(self, link: Link, rid: int, msg: ipc.Admitted, follow: asyncio.Future[Any] | None) -> None:
        self.link = link
        self.rid = rid
        self.prompt_tokens = msg.prompt_tokens
        self.projected_ttft_ms = msg.projected_ttft_ms
        self.expected_cached = msg.expected_cached
        self._first: Grant | asyncio.Future[Any] = Grant(msg.engine, msg.phase or "") if msg.engine is not None else follow  # type: ignore[assignment]

    @staticmethod
    def _grant(m: Any) -> Grant | Refuse | None:
        if type(m) is ipc.Granted:
            return Grant(m.engine, m.phase)
        if type(m) is ipc.Refused:
            return _refuse(m)
        return None  # NoRetry

    async def granted(self) -> Grant | Refuse:
        first = self._first
        if isinstance(first, Grant):
            return first
        g = self._grant(await first)
        assert g is not None
        return g

    def prefill_done(self, at: float, *, ok: bool) -> None:
        self.link.send(ipc.PrefillDone(self.rid, at, ok))

    async def decode_slot(self) -> Grant | Refuse:
        g = self._grant(await self.link.request(self.rid, ipc.WantDecode(self.rid)))
        assert g is not None
        return g

    def first_token(self, at: float) -> None:
        self.link.send(ipc.FirstToken(self.rid, at))

    async def retry(self, engine: str, row: str, phase: str, at: float) -> Grant | Refuse | None:
        return self._grant(await self.link.request(self.rid, ipc.Retry(self.rid, engine, row, phase, at)))

    def close(self, o: Outcome) -> None:
        self.link.send(ipc.Close(self.rid, o.at, o.ok_engine, o.failed_engine, o.failed_row, o.tpot_s, o.tpot_engine,
                                 o.output_tokens, o.finish_reason, o.reported_prompt_tokens, o.cached_tokens))


class RemoteEntry:
    __slots__ = ("link", "rid", "ended")

    def __init__(self, link: Link, rid: int) -> None:
        self.link = link
        self.rid = rid
        self.ended = False

    async def admit(self, order: Order) -> RemoteLease | Refuse:
        o = order
        got = await self.link.request(self.rid, ipc.Admit(self.rid, o.route, o.prompt_bytes, o.exact_prompt_tokens, o.max_tokens, o.budget_ms, o.arrival, o.deadline_s, list(o.prefix), list(o.token_prefix)))
        if type(got) is ipc.Refused:
            return _refuse(got)
        msg, follow = got
        return RemoteLease(self.link, self.rid, msg, follow)

    def end(self, cls: str) -> None:
        if self.ended:
            return
        self.ended = True
        self.link.pending.pop(self.rid, None)
        self.link.send(ipc.End(self.rid, cls))


class RemoteDoor:
    __slots__ = ("link",)

    def __init__(self, link: Link) -> None:
        self.link = link

    async def arrive(self, at: float) -> RemoteEntry | Refuse:
        link = self.link
        rid = link.next_rid()
        try:
            got: ipc.Arrived = await link.request(rid, ipc.Arrive(rid, at))
        except asyncio.CancelledError:
            link.pending.pop(rid, None)
            link.send(ipc.End(rid, "cancelled"))  # the arrival may have been offered
            raise
        if got.row is not None:
            return Refuse(E.ROWS[got.row], fields=got.fields)
        return RemoteEntry(link, rid)


class RemoteControls:
    """core/lease.py Controls over the channel."""

    __slots__ = ("link",)

    def __init__(self, link: Link) -> None:
        self.link = link

    async def ready(self) -> tuple[int, dict[str, Any]]:
        status, body = await self.link.call("ready")
        return int(status), body

    async def engines(self, sizing: dict[str, Any]) -> dict[str, Any]:
        return dict(await self.link.call("engines", sizing))

    async def metrics(self) -> bytes:
        return str(await self.link.call("metrics")).encode()

    async def set_state(self, state: str) -> str:
        return str(await self.link.call("set_state", state))

    async def set_wave(self, wave: str, on: bool) -> None:
        await self.link.call("set_wave", wave, on)

    async def drain(self, engine: str, on: bool) -> None:
        await self.link.call("drain", engine, on)

    async def profile(self, engine: str) -> str:
        return str(await self.link.call("profile", engine))
