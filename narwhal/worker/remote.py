"""The seam (narwhal/core/lease.py) in a worker process: `RemoteDoor`, `RemoteEntry`,
`RemoteLease` and `RemoteControls` carry each call over the IPC channel (narwhal/ipc.py)
to the authority, whose answers they await. Same calls, same answers as in process.

Invariants
  * Arrive does not wait: the worker reads the body while it is decided, and sends Admit
    behind it (one round trip for both). Its answer, Arrived, is matched by `rid` in
    `arrivals`; every other answer by `rid` in `pending`, where a request has at most one
    call in flight (admit, [wait], [decode slot], [retry]); controls by their `qid`.
  * An arrival the authority refused (R01, R02: its books closed there) ignores the
    Admit behind it; the worker answers with the arrival's row, and its End is ignored.
  * A request whose task is cancelled at any point still ends in the books: the End
    (cancelled) its data plane sends follows its Arrive.
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
    return m.refused


class Link:
    """The worker's end of the channel: sends, and routes each answer to its waiter."""

    def __init__(self) -> None:
        self.channel = ipc.Channel(self._on_message, self._on_lost)
        self.pending: dict[int, asyncio.Future[Any]] = {}  # rid -> the call in flight
        self.arrivals: dict[int, asyncio.Future[ipc.Arrived]] = {}  # rid -> its Arrive
        self.calls: dict[int, asyncio.Future[Any]] = {}  # qid -> a control call
        self.hello: asyncio.Future[ipc.Hello] = asyncio.get_running_loop().create_future()
        self.lost = asyncio.Event()
        self._rids = itertools.count(1)
        self._qids = itertools.count(1)
        # set by the worker process (narwhal/workers.py)
        self.scrape: Callable[[], list[Any]] = list
        self.on_facts: Callable[[str, list[Any]], None] = lambda engine, facts: None
        self.on_penalise: Callable[[str, float], None] = lambda addr, seconds: None
        self.on_reconfigure: Callable[[dict[str, Any]], None] = lambda config: None
        self._handlers: dict[type[Any], Callable[[Any], None]] = {
            ipc.Arrived: self._arrived, ipc.Granted: self._answer, ipc.Refused: self._answer, ipc.NoRetry: self._answer,
            ipc.Admitted: self._admitted, ipc.Answer: self._answered, ipc.Scrape: self._scrape,
            ipc.Facts: lambda m: self.on_facts(m.engine, m.facts), ipc.Penalise: lambda m: self.on_penalise(m.addr, m.seconds),
            ipc.Hello: self._hello, ipc.Reconfigure: lambda m: self.on_reconfigure(m.config),
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

    def _arrived(self, msg: ipc.Arrived) -> None:
        f = self.arrivals.pop(msg.rid, None)
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
        for f in [*self.pending.values(), *self.arrivals.values(), *self.calls.values()]:
            if not f.done():
                f.set_exception(gone)
        self.pending.clear()
        self.arrivals.clear()
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

    @property
    def key(self) -> int:
        """What this worker's plane files the request under for a preemption's fact."""
        return self.rid

    def first_token(self, at: float, movable: bool = False) -> None:
        self.link.send(ipc.FirstToken(self.rid, at, movable))

    async def retry(self, engine: str, row: E.ErrorRow, phase: str, at: float) -> Grant | Refuse | None:
        return self._grant(await self.link.request(self.rid, ipc.Retry(self.rid, engine, row, phase, at)))

    def close(self, o: Outcome) -> None:
        self.link.send(ipc.Close(self.rid, o.at, o.ok_engine, o.failed_engine, o.failed_row, o.tpot_s, o.tpot_engine,
                                 o.output_tokens, o.finish_reason, o.reported_prompt_tokens, o.cached_tokens))


def _unordered(rid: int, body: tuple[Refuse, ...]) -> ipc.Admit:
    """The Admit of a body that could not be parsed: its body rows, no Order."""
    return ipc.Admit(rid, "", 0, None, None, 0.0, 0.0, None, [], [], None, None, body, False)


class RemoteEntry:
    __slots__ = ("link", "rid", "ended", "_arrival")

    def __init__(self, link: Link, rid: int, arrival: asyncio.Future[ipc.Arrived]) -> None:
        self.link = link
        self.rid = rid
        self.ended = False
        self._arrival = arrival

    async def arrived(self) -> Refuse | None:
        return (await self._arrival).refused  # at once when it is in

    async def admit(self, order: Order | None, body: tuple[Refuse, ...] = ()) -> RemoteLease | Refuse:
        o = order
        msg = _unordered(self.rid, body) if o is None else ipc.Admit(
            self.rid, o.route, o.prompt_bytes, o.exact_prompt_tokens, o.max_tokens, o.budget_ms, o.arrival, o.deadline_s,
            list(o.prefix), list(o.token_prefix), o.tenant, o.key_id, body)
        f = self.link.request(self.rid, msg)
        try:
            refused = await self.arrived()
        except BaseException:  # the authority lost, or this request cancelled
            self._drop(f)
            raise
        if refused is not None:  # the authority ignores this Admit (no entry there)
            self._drop(f)
            return refused
        got = await f
        if type(got) is ipc.Refused:
            return _refuse(got)
        msg, follow = got
        return RemoteLease(self.link, self.rid, msg, follow)

    def _drop(self, f: asyncio.Future[Any]) -> None:
        """The Admit's answer will not be awaited: forget it (and any error it holds)."""
        self.link.pending.pop(self.rid, None)
        if f.done():
            if not f.cancelled():
                f.exception()
        else:
            f.cancel()

    def end(self, cls: str) -> None:
        if self.ended:
            return
        self.ended = True
        self.link.pending.pop(self.rid, None)
        self.link.arrivals.pop(self.rid, None)
        self.link.send(ipc.End(self.rid, cls))


class RemoteDoor:
    __slots__ = ("link",)

    def __init__(self, link: Link) -> None:
        self.link = link

    async def arrive(self, at: float, denied: Refuse | None = None, tenant: str | None = None) -> RemoteEntry | Refuse:
        """Sends Arrive and returns at once: its decision is `RemoteEntry.arrived()`
        (with `denied`, R01 or `denied`: core/lease.py)."""
        link = self.link
        if link.channel.closed:
            raise AuthorityLost("the admission authority is gone")
        rid = link.next_rid()
        f: asyncio.Future[ipc.Arrived] = asyncio.get_running_loop().create_future()
        link.arrivals[rid] = f
        # written at the end of this loop turn: when the body is in already, the Admit
        # sent in the same turn leaves with it (one write, one read, one answer)
        link.channel.send(ipc.Arrive(rid, at, denied, tenant))
        return RemoteEntry(link, rid, f)


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

    async def put_engine(self, entry: dict[str, Any]) -> dict[str, Any]:
        return dict(await self.link.call("put_engine", entry))

    async def delete_engine(self, name: str) -> dict[str, Any]:
        return dict(await self.link.call("delete_engine", name))

    async def reload(self) -> dict[str, Any]:
        return dict(await self.link.call("reload"))
