"""The authority's end of one worker's channel (narwhal/ipc.py): each message becomes the
same call on the in-process seam (door.py, service.py) that a one-process router makes.

Invariants
  * Every request the worker offered (Arrive answered "held") has a `LocalEntry` here
    until its End. When the channel is lost (the worker died or was stopped), every such
    entry ends in the class `failed` and frees what its lease held: the books never lose
    a request and no slot stays taken.
  * A grant that must wait (queued, a decode slot, a retry's decode slot) waits in a task
    of its own; End cancels it.
  * Nothing here blocks: a message is handled in the turn it arrives.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from .. import ipc
from ..core.lease import Grant, Order, Outcome
from ..core.tickets import Refuse
from .door import QUEUED, LocalEntry, LocalLease
from .metrics import Family
from .service import LocalControls

__all__ = ["WorkerSession"]

log = logging.getLogger("narwhal")

_OPS = frozenset(("ready", "engines", "metrics", "set_state", "set_wave", "drain", "profile", "put_engine", "delete_engine", "reload"))


def _interned(name: Any) -> Any:
    return sys.intern(name) if type(name) is str else name


class WorkerSession:
    def __init__(self, worker: int, controls: LocalControls, *, on_up: Callable[[WorkerSession, ipc.Up], None],
                 on_penalise: Callable[[WorkerSession, str, float], None], on_lost: Callable[[WorkerSession], None]) -> None:
        self.worker = worker
        self.controls = controls
        self.door = controls.door
        self.channel = ipc.Channel(self._on_message, self._lost)
        self.entries: dict[int, LocalEntry] = {}
        self.waits: dict[int, asyncio.Task[None]] = {}
        self.scrapes: dict[int, asyncio.Future[list[Family]]] = {}
        self._qids = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.up: ipc.Up | None = None
        self._on_up = on_up
        self._on_penalise = on_penalise
        self._on_lost = on_lost
        self._handlers: dict[type[Any], Callable[[Any], None]] = {
            ipc.Arrive: self._arrive, ipc.Admit: self._admit, ipc.WantDecode: self._want_decode, ipc.Retry: self._retry,
            ipc.PrefillDone: self._prefill_done, ipc.FirstToken: self._first_token, ipc.Close: self._close, ipc.End: self._end,
            ipc.Call: self._call, ipc.Families: self._families, ipc.Up: self._up, ipc.Penalise: lambda m: self._on_penalise(self, m.addr, m.seconds),
        }

    def send(self, msg: Any) -> None:
        if not self.channel.closed:
            self.channel.send(msg)

    def _on_message(self, msg: Any) -> None:
        h = self._handlers.get(type(msg))
        if h is None:
            log.warning("worker %d: unexpected message %s", self.worker, type(msg).__name__)
            return
        h(msg)

    def _lease(self, rid: int) -> LocalLease | None:
        e = self.entries.get(rid)
        return e.lease if e is not None else None

    # -- the seam ------------------------------------------------------------------------

    def _arrive(self, m: ipc.Arrive) -> None:
        got = self.door.arrive_now(m.at, m.denied, m.tenant)
        if isinstance(got, Refuse):
            self.send(ipc.Arrived(m.rid, got))
            return
        self.entries[m.rid] = got
        self.send(ipc.Arrived(m.rid, None))

    def _admit(self, m: ipc.Admit) -> None:
        entry = self.entries.get(m.rid)
        if entry is None:
            return  # ended meanwhile
        # a route's, a tenant's and a key's names: one string each for every open request
        order = Order(_interned(m.route), m.prompt_bytes, m.exact_prompt_tokens, m.max_tokens, m.budget_ms, m.arrival, m.deadline_s, tuple(m.prefix),
                      tuple(m.token_prefix), _interned(m.tenant), _interned(m.key_id)) if m.ordered else None
        got = entry.admit_now(order, m.body)
        if isinstance(got, Refuse):
            self.send(ipc.Refused(m.rid, got))
            return
        g = got.granted_now()
        if isinstance(g, Grant):
            self.send(ipc.Admitted(m.rid, got.prompt_tokens, got.projected_ttft_ms, got.expected_cached, g.engine, g.phase))
            return
        self.send(ipc.Admitted(m.rid, got.prompt_tokens, got.projected_ttft_ms, got.expected_cached, None, None))
        self._wait(m.rid, got.wait())

    def _answer(self, rid: int, g: Any) -> None:
        """Send a grant decision; QUEUED: wait for it in a task."""
        if g is QUEUED:
            lease = self._lease(rid)
            if lease is not None:
                self._wait(rid, lease.wait())
        elif isinstance(g, Grant):
            self.send(ipc.Granted(rid, g.engine, g.phase))
        elif isinstance(g, Refuse):
            self.send(ipc.Refused(rid, g))
        else:
            self.send(ipc.NoRetry(rid))

    def _wait(self, rid: int, aw: Awaitable[Grant | Refuse]) -> None:
        async def wait() -> None:
            try:
                self._answer(rid, await aw)
            finally:
                self.waits.pop(rid, None)

        self.waits[rid] = asyncio.ensure_future(wait())

    def _want_decode(self, m: ipc.WantDecode) -> None:
        lease = self._lease(m.rid)
        if lease is not None:
            self._answer(m.rid, lease.decode_now())

    def _retry(self, m: ipc.Retry) -> None:
        lease = self._lease(m.rid)
        if lease is not None:
            self._answer(m.rid, lease.retry_now(m.engine, m.row, m.phase, m.at))

    def _prefill_done(self, m: ipc.PrefillDone) -> None:
        lease = self._lease(m.rid)
        if lease is not None:
            lease.prefill_done(m.at, ok=m.ok)

    def _first_token(self, m: ipc.FirstToken) -> None:
        lease = self._lease(m.rid)
        if lease is not None:
            if m.movable:  # core/preempt.py: a preemption's fact goes to this worker only
                lease.tell = functools.partial(self.send, ipc.Facts("", ["preempt", m.rid]))
            lease.first_token(m.at, m.movable)

    def _close(self, m: ipc.Close) -> None:
        lease = self._lease(m.rid)
        if lease is not None:
            lease.close(Outcome(m.at, m.ok_engine, m.failed_engine, m.failed_row, m.tpot_s, m.tpot_engine, m.output_tokens, m.finish_reason, m.reported_prompt_tokens, m.cached_tokens))

    def _end(self, m: ipc.End) -> None:
        w = self.waits.pop(m.rid, None)
        if w is not None:
            w.cancel()
        entry = self.entries.pop(m.rid, None)
        if entry is not None:
            entry.end(m.cls)

    # -- controls and scrapes -------------------------------------------------------------

    def _call(self, m: ipc.Call) -> None:
        async def run() -> None:
            try:
                if m.op not in _OPS:
                    raise ValueError(f"no operation {m.op!r}")
                v = await getattr(self.controls, m.op)(*m.args)
                if isinstance(v, bytes):
                    v = v.decode()
                self.send(ipc.Answer(m.qid, v, None))
            except Exception as x:  # the worker answers its client with H06
                log.exception("worker %d: %s failed", self.worker, m.op)
                self.send(ipc.Answer(m.qid, None, f"{type(x).__name__}: {x}"))

        t = asyncio.ensure_future(run())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def scrape(self) -> list[Family]:
        """This worker's metric families (worker/telemetry.py families)."""
        if self.channel.closed:
            raise ConnectionError("the worker is gone")
        qid = next(self._qids)
        f: asyncio.Future[list[Family]] = asyncio.get_running_loop().create_future()
        self.scrapes[qid] = f
        try:
            self.channel.send(ipc.Scrape(qid))
            return await f
        finally:
            self.scrapes.pop(qid, None)

    def _families(self, m: ipc.Families) -> None:
        f = self.scrapes.get(m.qid)
        if f is not None and not f.done():
            f.set_result(m.families)

    def _up(self, m: ipc.Up) -> None:
        self.up = m
        self._on_up(self, m)

    # -- loss ----------------------------------------------------------------------------

    def _lost(self, exc: BaseException | None) -> None:
        """The worker is gone: its requests in flight end as failed, their slots freed."""
        if exc is not None:
            log.warning("worker %d: channel broke: %s", self.worker, exc)
        for w in self.waits.values():
            w.cancel()
        self.waits.clear()
        n = len(self.entries)
        for entry in self.entries.values():
            entry.end("failed")
        self.entries.clear()
        for f in self.scrapes.values():
            if not f.done():
                f.set_exception(ConnectionError("the worker is gone"))
        if n:
            log.warning("worker %d: %d requests in flight ended as failed", self.worker, n)
        self._on_lost(self)

    def close(self) -> None:
        self.channel.close()
