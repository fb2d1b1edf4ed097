"""High availability (`ha`): this router as a candidate in a leader election on etcd.

The state machine is spec/tables/leadership.yaml (core/leadership.py applies it); this
module talks to etcd and carries out each row's action:

  * campaign — grant a lease (ha.lease_ttl_ms) and, in one transaction, create the key
    with it if nobody holds it. Won: leader (L01), the transaction's revision is the
    fencing token. Lost: revoke the lease, watch the key until it is deleted (L02, L06).
  * take_over (L01) — before the first admission: a fresh health poll of every engine and
    the engines' own load (authority.take_over); until it is done the router is standby.
  * extend (L13) — the leader renews every ha.renew_interval_ms, each call bounded by the
    fence deadline, and checks the key still carries its lease; then it hands on the
    tenants' bucket levels (core/quota_state.py) at `{ha.key}/tenants`, put only while the
    key carries its lease, which a new leader restores before its take-over.
  * fence (L12, L14-L16) — no admission from the fence deadline on (core/leadership.py:
    every decision checks it); requests waiting in the queues are refused with R01
    (fenced); streams already running finish (the engine slots they hold are real).
  * resign (L19) — the operator made this router not ready, or it is stopping (SIGTERM,
    `resign`): stop admitting, revoke the lease so another candidate leads at once.
  * recover (L28) — a fenced router that reaches etcd again revokes its old lease and
    campaigns as a new candidate.
Every state change is logged at WARNING with the fencing token and shown on
/v1/engines (`router.ha`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import Any

from narwhal_generated.models.config import Ha

from ..core import quota_state
from ..core.leadership import Leadership
from ..fleet.etcd import etcd_client
from ..telemetry.logs import event as log_event
from ..upstream.etcd import EtcdError
from .authority import Authority

__all__ = ["Elector"]

log = logging.getLogger("narwhal")

RETRY_S = 0.25  # the first retry after etcd failed a candidate's call ...
RETRY_MAX_S = 2.0  # ... doubling up to this
OPERATOR_POLL_S = 0.1  # how often a paused router looks at its operator state
RESTORE_ATTEMPTS = 3  # reads of the tenants' buckets at a take-over before they start full


class Elector:
    def __init__(self, a: Authority, cfg: Ha) -> None:
        self.a = a
        self.cfg = cfg
        self.key = cfg.key.encode()
        self.name = cfg.name.root if cfg.name is not None else f"{socket.gethostname()}:{os.getpid()}"
        self.ttl_s = cfg.lease_ttl_ms // 1000
        self.leadership = Leadership(margin_s=cfg.fence_margin_ms / 1000.0)
        # TLS and user from the ha section (password from password_env: unset is a start-up error)
        self.etcd = etcd_client([u.root for u in cfg.etcd], cfg, timeout_s=cfg.request_timeout_ms / 1000.0, where="ha")
        self._wake = asyncio.Event()  # the operator state changed
        self._campaigned = asyncio.Event()  # set after each campaign's outcome (won, lost, unreachable)
        self._retry = RETRY_S
        self._task: asyncio.Task[None] | None = None
        self.take_over: Any = None  # async () -> None, set by the control plane
        self.tenants_key = self.key + b"/tenants"  # the tenants' bucket levels a leader hands on
        self._carried: bytes | None = None  # the levels last put (a put only when they change)
        self._carried_levels: dict[str, list[float | None]] = {}

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="narwhal-ha")

    async def resign(self) -> None:
        """This router is stopping (SIGTERM: router state S06): it campaigns no more, and
        a leader hands the key on at once (L19: waiting requests refused, its lease
        revoked, so the key is deleted and a standby's watch sees it within one round
        trip), not after the TTL. Idempotent; `stop` ends with it."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        lease = self.leadership.lease
        if self.leadership.state == "leader" and lease is not None:
            self._event("operator_off", why="stopping")
            with contextlib.suppress(EtcdError):
                await self.etcd.revoke(lease, timeout_s=1.0)

    async def stop(self) -> None:
        await self.resign()
        await self.etcd.aclose()

    def operator_changed(self) -> None:
        self._wake.set()

    async def settled(self, timeout_s: float) -> None:
        """Until the next campaign has an outcome (bounded): an operator who sets this
        router active gets an answer that says whether it leads."""
        self._campaigned.clear()
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._campaigned.wait(), timeout_s)

    # -- the machine ---------------------------------------------------------------------

    def _event(self, event: str, *, why: str | None = None, **kw: Any) -> str:
        le = self.leadership
        before = le.state
        row = le.on(event, self.a.clock.now(), **kw)
        if row.next != before:
            log.log(logging.INFO if why == "stopping" else logging.WARNING, "ha %s: %s -> %s on %s (%s)%s; fencing token %s, lease %s",
                    self.name, before, row.next, event, row.id, f", {why}" if why else "", le.token, le.lease,
                    extra=log_event("ha_state", name=self.name, previous=before, state=row.next, on=event, row=row.id, fencing_token=le.token))
        if event in ("won", "lost", "unreachable") and le.state != "leader":
            self._campaigned.set()
        if row.action in ("fence", "resign"):
            self.a.refuse_waiting()
        return row.action

    async def _run(self) -> None:
        while True:
            try:
                st = self.leadership.state
                if st == "paused" or not self.a.state.operator_ready():
                    await self._paused()
                elif st == "candidate":
                    await self._campaign()
                elif st == "leader":
                    await self._lead()
                else:
                    await self._recover()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: log it, keep the machine running (fenced if leader)
                log.exception("ha %s: election loop", self.name)
                if self.leadership.state == "leader":
                    self._event("deadline")
                await asyncio.sleep(RETRY_MAX_S)

    async def _backoff(self) -> None:
        await asyncio.sleep(self._retry)
        self._retry = min(RETRY_MAX_S, self._retry * 2)

    async def _paused(self) -> None:
        le = self.leadership
        if le.state != "paused":
            lease = le.lease if le.state == "leader" else None
            self._event("operator_off")
            if lease is not None:  # resign: hand the key on at once
                with contextlib.suppress(EtcdError):
                    await self.etcd.revoke(lease)
            return
        while not self.a.state.operator_ready():
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), OPERATOR_POLL_S)
        self._event("operator_on")

    async def _campaign(self) -> None:
        clock = self.a.clock
        sent = clock.now()
        try:
            lease, ttl = await self.etcd.grant(self.ttl_s)
            c = await self.etcd.campaign(self.key, self.name.encode(), lease)
        except EtcdError as x:
            log.info("ha %s: campaign: %s", self.name, x)
            self._event("unreachable")
            await self._backoff()
            return
        self._retry = RETRY_S
        if c.won:
            self._event("won", token=c.revision, lease=lease, sent_at=sent, ttl_s=float(ttl))
            await self._restore_tenants()
            if self.take_over is not None:
                await self.take_over()
            if self.leadership.state == "leader":
                self.leadership.took_over()
                log.warning("ha %s: leader, admitting (fencing token %d)", self.name, c.revision, extra=log_event("ha_leader", name=self.name, fencing_token=c.revision))
            self._campaigned.set()
            return
        self._event("lost")
        with contextlib.suppress(EtcdError):
            await self.etcd.revoke(lease)
        await self._watch(c.revision + 1)

    async def _watch(self, start: int) -> None:
        """Until the key is deleted (or etcd fails, or the operator pauses this router)."""
        watch = asyncio.ensure_future(self._next_delete(start))
        wake = asyncio.ensure_future(self._operator_off())
        try:
            await asyncio.wait((watch, wake), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (watch, wake):
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
        if watch.done() and not watch.cancelled():
            if watch.exception() is not None:
                log.info("ha %s: watch: %s", self.name, watch.exception())
                self._event("unreachable")
                await self._backoff()
            else:
                self._event("key_deleted")

    async def _next_delete(self, start: int) -> None:
        # the key may be gone already (deleted between the transaction and the watch)
        kv, _ = await self.etcd.get(self.key)
        if kv is None:
            return
        try:
            async for _ in self.etcd.watch_delete(self.key, start):
                return
        except Exception as x:  # noqa: BLE001 - the stream broke: etcd is unreachable
            raise EtcdError(f"watch: {x}") from x
        raise EtcdError("watch: the stream ended")

    async def _operator_off(self) -> None:
        while self.a.state.operator_ready():
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), OPERATOR_POLL_S)

    async def _lead(self) -> None:
        le = self.leadership
        clock = self.a.clock
        renew_s = self.cfg.renew_interval_ms / 1000.0
        next_renew = clock.now() + renew_s
        while le.state == "leader":
            if not self.a.state.operator_ready():
                return  # _run pauses (resign)
            now = clock.now()
            fence_at = le.fence_at if le.fence_at is not None else now
            if now >= fence_at:
                self._event("deadline")
                return
            wait = min(next_renew, fence_at) - now
            if wait > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
                continue
            sent = clock.now()
            budget = min(self.cfg.request_timeout_ms / 1000.0, fence_at - sent)
            lease = le.lease
            assert lease is not None
            try:
                ttl = await self.etcd.keepalive(lease, timeout_s=budget)
                if ttl <= 0:
                    self._event("lease_gone")
                    return
                kv, _ = await self.etcd.get(self.key, timeout_s=max(0.001, fence_at - clock.now()))
            except EtcdError as x:
                log.info("ha %s: renewal: %s", self.name, x)
                self._event("unreachable")
                next_renew = clock.now() + min(RETRY_S, renew_s)
                continue
            if kv is None:
                self._event("key_deleted")
                return
            if kv.lease != lease:
                self._event("lost")
                return
            self._event("renewed", sent_at=sent, ttl_s=float(ttl))
            next_renew = sent + renew_s
            await self._carry_tenants(lease, fence_at)

    # -- the tenants' buckets across a take-over (core/quota_state.py) -----------------------

    async def _carry_tenants(self, lease: int, fence_at: float) -> None:
        """After a renewal: put the tenants' bucket levels when they changed, bounded by
        the fence deadline; a failed put is retried at the next renewal (never fences)."""
        q = self.a.quotas
        if q is None:
            return
        clock = self.a.clock
        levels = quota_state.levels(q, clock.now())
        if self._carried is not None and levels == self._carried_levels:
            return
        budget = min(self.cfg.request_timeout_ms / 1000.0, fence_at - clock.now())
        if budget <= 0:
            return
        data = quota_state.encode(levels, time.time())
        try:
            if await self.etcd.put_if_held(self.key, lease, self.tenants_key, data, timeout_s=budget):
                self._carried, self._carried_levels = data, levels
        except EtcdError as x:
            log.info("ha %s: tenants' buckets not handed on: %s", self.name, x)

    async def _restore_tenants(self) -> None:
        """Won (L01), before the take-over: the levels the last leader handed on. etcd
        failing here RESTORE_ATTEMPTS times costs the buckets (they stay as they are: full
        on a fresh router), never the take-over."""
        q = self.a.quotas
        if q is None:
            return
        for attempt in range(RESTORE_ATTEMPTS):  # each bounded by ha.request_timeout_ms
            try:
                kv, _ = await self.etcd.get(self.tenants_key)
                break
            except EtcdError as x:
                if attempt + 1 == RESTORE_ATTEMPTS:
                    log.warning("ha %s: tenants' buckets not restored (they start full): %s", self.name, x)
                    return
        self._carried = None
        if kv is not None:
            n = quota_state.restore(q, kv.value, self.a.clock.now(), time.time())
            log.info("ha %s: restored %d tenants' buckets from the last leader%s", self.name, max(n, 0), "" if n >= 0 else " (unreadable: none)")

    async def _recover(self) -> None:
        """Fenced: once etcd answers again, revoke the old lease and be a candidate."""
        lease = self.leadership.lease
        try:
            if lease is not None:
                await self.etcd.revoke(lease)
            else:
                await self.etcd.get(self.key)
        except EtcdError as x:
            log.info("ha %s: fenced, etcd still unreachable: %s", self.name, x)
            self._event("unreachable")
            await self._backoff()
            return
        self._retry = RETRY_S
        self._event("reconnected")
