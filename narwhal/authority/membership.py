"""Fleet membership at run time: engines join, are updated or replaced, drain and leave
(spec/tables/lifecycle.yaml, one row per state x event; narwhal/core/lifecycle.py holds
the state, this module carries out each row's action on the authority).

Sources of change, one lifecycle for all of them:
  * the admin API: `put` (PUT /admin/engines/{name}), `remove` (DELETE), `drain`;
  * discovery (narwhal/fleet: a file, etcd) and a configuration reload's `engines`:
    `apply(source, specs)`, the whole set one source names, applied as one diff against
    the engines that source owns;
  * health polls and profiling (`observed`: M01 ready), the requests themselves (`idle`:
    M29, checked when a lease closes while some engine is leaving) and the drain timer
    (M30).

Ownership: every engine remembers the source that named it (`EngineState.source`). A
source's diff adds, updates, replaces and removes only its own engines; a name another
source owns is refused (logged, counted as that source's error), except a leaving one,
which the new spec rejoins (M31). The admin API may act on any engine and takes it over.

Bounds (issue 40 items 4 and 10)
  * discovery.max_engines: no change takes the fleet past it. A PUT of a new name at the
    limit is refused; a source's set (or a reload's engines) that would is refused whole
    (logged and counted as that source's error; the fleet stays as it was), naming the
    key. Leaving engines count until they are gone.
  * The router's own listen address is no engine (every request placed there would come
    back to the router): a PUT naming it is refused, a source's entry naming it refused.

Invariants
  * An engine is released (M04, M29) only when it holds nothing: no slot, no queue, so
    no ticket names it; releasing drops it from the scheduler, the prefix index, health
    polls, profiling, the KV-event subscription and every data plane (its pooled
    connections), in one turn of the loop.
  * Data planes hear of an engine (fact ["spec", ...]) before it can be placed, and of
    its end (["gone"]) after the last lease on it closed; over IPC both travel on the
    channel the grants do, so a grant never names an engine its worker does not know.
  * A leaving engine's requests are cut (M30) by the data planes (["cut"]): the attempt
    fails E06, retried before response headers, after them carried on by another engine
    when upstream.migration allows (spec/tables/migration.yaml), else an error event.
  * discovery.drain: migrate: when the engine starts leaving, the data planes cut at once
    every decode leg on it that can be carried on (["migrate"]); the rest run on until
    they end or the drain timeout, as with `wait`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from ..core.fleet import EngineState
from ..core.lifecycle import identity
from ..telemetry.logs import event as log_event
from ..upstream.engines import EngineSpec
from .authority import Authority

__all__ = ["Membership"]

log = logging.getLogger("narwhal")



class Membership:
    def __init__(self, a: Authority, *, drain_timeout_s: float,
                 subscribe: Callable[[EngineState, EngineSpec], None] = lambda e, s: None,
                 unsubscribe: Callable[[str], None] = lambda name: None,
                 poll: Callable[[EngineState], None] = lambda e: None) -> None:
        self.a = a
        self.drain_timeout_s = drain_timeout_s
        self._subscribe, self._unsubscribe, self._poll = subscribe, unsubscribe, poll
        self.changes: Counter[str] = Counter()
        self.source_errors: Counter[str] = Counter()  # by source: snapshots that changed nothing
        self.last_error: dict[str, str] = {}
        self._pending_source: dict[str, str] = {}  # M31: the source of a rejoining spec
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.max_engines: int = a.config.discovery.max_engines  # a reload sets it again
        self.listen: str | None = None  # the router's own host:port (narwhal serve sets it)

    # -- what the sources and the admin API call ----------------------------------------

    def refusal(self, spec: EngineSpec) -> str | None:
        """Why `spec` may not be put (module bounds), or None."""
        if self.listen is not None and is_self(spec.url, self.listen):
            return f"engine {spec.name!r}: {spec.url} is this router's own listen address ({self.listen}), not an engine"
        if spec.name not in self.a.engines and len(self.a.engines) >= self.max_engines:
            return f"engine {spec.name!r}: the fleet holds {len(self.a.engines)} engines, discovery.max_engines ({self.max_engines})"
        return None

    def put(self, spec: EngineSpec, *, source: str = "admin") -> str:
        """Add an engine, or update or replace one (M07/M15/M16...). Returns what was
        done: added, updated, replaced (the new spec joins once the old one is gone),
        unchanged. The caller checked `refusal(spec)` first."""
        e = self.a.engines.get(spec.name)
        if e is None:
            self.join(spec, source=source)
            return "added"
        e.source = source
        old = self.a.specs[spec.name]
        if identity(old) != identity(spec):
            self._pending_source[spec.name] = source
            self.event(e, "replace", spec)
            return "replaced"
        if _settings(old) == _settings(spec) and e.lifecycle.state != "draining":
            return "unchanged"
        self._pending_source[spec.name] = source
        self.event(e, "update", spec)
        return "rejoining" if e.lifecycle.state == "draining" else "updated"

    def remove(self, name: str) -> str:
        """DELETE /admin/engines/{name} or a source that no longer names it (M04, M12,
        M20). Returns the lifecycle state after it: draining, or gone."""
        e = self.a.engines[name]
        e.pending = None  # a removal wins over a rejoin waiting behind the drain
        self.event(e, "remove")
        return "gone" if name not in self.a.engines else e.lifecycle.state

    def drain(self, name: str, on: bool) -> None:
        """POST /admin/engines/{name}/drain: the operator's drain (M02, M10, M19)."""
        self.event(self.a.engines[name], "drain_on" if on else "drain_off")

    def apply(self, source: str, specs: Iterable[EngineSpec]) -> dict[str, list[str]]:
        """One source's whole set, applied as one diff against the engines it owns."""
        out: dict[str, list[str]] = {"added": [], "updated": [], "replaced": [], "rejoining": [], "removed": [], "refused": []}
        want = {s.name: s for s in specs}
        total = len(want) + sum(1 for e in self.a.engines.values() if e.source != source or e.name not in want and e.lifecycle.state == "draining")
        if total > self.max_engines:  # refused whole (module bounds)
            self.error(source, f"{total} engines with this change, over discovery.max_engines ({self.max_engines})")
            out["refused"] = sorted(want)
            return out
        for name, s in want.items():
            e = self.a.engines.get(name)
            if e is not None and e.source != source and e.lifecycle.state != "draining":
                msg = f"engine {name!r} is already named by {e.source}; {source} cannot change it"
                self.error(source, msg)
                out["refused"].append(name)
                continue
            if self.listen is not None and is_self(s.url, self.listen):
                self.error(source, f"engine {name!r}: {s.url} is this router's own listen address ({self.listen}), not an engine")
                out["refused"].append(name)
                continue
            what = self.put(s, source=source)
            if what != "unchanged":
                out[what].append(name)
        for name, e in list(self.a.engines.items()):
            if e.source == source and name not in want and e.lifecycle.state not in ("draining", "gone"):
                self.remove(name)
                out["removed"].append(name)
        if any(out[k] for k in ("added", "updated", "replaced", "rejoining", "removed")):
            log.info("fleet from %s: %s", source, "; ".join(f"{k} {', '.join(v)}" for k, v in out.items() if v),
                     extra=log_event("fleet_change", source=source, **{k: v for k, v in out.items() if v}))
        return out

    def error(self, source: str, message: str) -> None:
        """A source could not say (unreadable, invalid): the fleet stays as it was."""
        self.source_errors[source] += 1
        if self.last_error.get(source) != message:
            log.error("fleet source %s: %s (the fleet is unchanged)", source, message)
        self.last_error[source] = message

    def source_ok(self, source: str) -> None:
        self.last_error.pop(source, None)

    # -- events from the authority's own observations -------------------------------------

    def observed(self, e: EngineState) -> None:
        """After a health poll or a profile's outcome: M01 when a joining engine is ready."""
        if e.lifecycle.state == "joining" and self._ready(e):
            self.event(e, "ready")

    def check_idle(self) -> None:
        """A lease closed while some engine is leaving: M29 for those that hold nothing."""
        for name in list(self.a.leaving):
            e = self.a.engines.get(name)
            if e is not None and e.holds_nothing():
                self.event(e, "idle")

    def _ready(self, e: EngineState) -> bool:
        if not e.healthy:
            return False
        if self.a.config.admission.prediction.profile_on_start:
            # the profile has an outcome (failed: default models, as at start); it also
            # settles how the engine's prompts are counted (upstream/usage.py), so its
            # first answers carry the engine's own prompt count, in open mode too
            return e.profile_status in ("ok", "failed")
        return True

    # -- the table ----------------------------------------------------------------------

    def event(self, e: EngineState, event: str, spec: EngineSpec | None = None) -> None:
        now = self.a.clock.now()
        row = e.lifecycle.on(event, now)
        e.draining = not e.lifecycle.placeable
        if event in ("drain_on", "drain_off") and row.next != row.state:
            self.changes[event] += 1  # the operator's drain (M02, M10, M19)
        getattr(self, "_" + row.action)(e, spec)

    def _none(self, e: EngineState, spec: EngineSpec | None) -> None:
        self.a.reconcile()  # an operator's drain_on (M02, M10) moves its waiters

    def _admit(self, e: EngineState, spec: EngineSpec | None) -> None:
        self.changes["ready"] += 1
        log.info("engine %s: joined (lifecycle active, %s)", e.name, _why_ready(e), extra=log_event("engine_joined", engine=e.name))
        self.a.reconcile()

    def _check(self, e: EngineState, spec: EngineSpec | None) -> None:
        self.observed(e)

    def _apply(self, e: EngineState, spec: EngineSpec | None) -> None:
        assert spec is not None
        a = self.a
        self.changes["update"] += 1
        a.specs[e.name] = spec
        e.wave = spec.wave
        e.max_concurrency = spec.max_concurrency
        c = a.config.admission.phase_concurrency
        e.prefill_slots = _cap(c.prefill, spec.max_concurrency)
        e.decode_slots = _cap(c.decode, spec.max_concurrency)
        a._tell(e.name, ["spec", spec.as_dict()])
        a.reconcile()

    def _leave(self, e: EngineState, spec: EngineSpec | None) -> None:
        a = self.a
        self.changes["leave"] += 1
        if spec is not None:  # M16/M24: replaced; the new spec joins once this one is gone
            self._rejoin(e, spec)
        a.leaving.add(e.name)
        e.leave_by = a.clock.now() + self.drain_timeout_s
        task = a.profiling.get(e.name)
        if task is not None and not task.done():
            task.cancel()  # its measurement slot, if any, frees as the task unwinds
        log.info("engine %s: leaving (draining, at most %.1f s)", e.name, self.drain_timeout_s,
                 extra=log_event("engine_leaving", engine=e.name, drain_timeout_s=self.drain_timeout_s))
        a.reconcile()  # its queued waiters move to other engines, or R09
        if e.holds_nothing():
            self.event(e, "idle")
            return
        if a.config.discovery.drain == "migrate":  # its decodes that can move, now (worker/plane.py)
            a._tell(e.name, ["migrate"])
        if self.drain_timeout_s <= 0:
            self.event(e, "drain_timeout")
            return
        lc = e.lifecycle
        self._timers[e.name] = asyncio.get_running_loop().call_later(self.drain_timeout_s, self._timed_out, e.name, lc)

    def _timed_out(self, name: str, lc: object) -> None:
        self._timers.pop(name, None)
        e = self.a.engines.get(name)
        if e is not None and e.lifecycle is lc:
            self.event(e, "drain_timeout")

    def _cut(self, e: EngineState, spec: EngineSpec | None) -> None:
        self.changes["cut"] += 1
        log.warning("engine %s: drain timeout (discovery.drain_timeout_ms): cutting its requests", e.name, extra=log_event("engine_cut", engine=e.name))
        self.a._tell(e.name, ["cut"])

    def _rejoin(self, e: EngineState, spec: EngineSpec | None) -> None:
        e.pending = spec

    def _release(self, e: EngineState, spec: EngineSpec | None) -> None:
        a = self.a
        name = e.name
        t = self._timers.pop(name, None)
        if t is not None:
            t.cancel()
        a.leaving.discard(name)
        a.scheduler.remove(name)
        del a.engines[name]
        old = a.specs.pop(name)
        a.prompt_counters.pop(name, None)
        a.kv_block_sizes.pop(name, None)
        task = a.profiling.pop(name, None)
        if task is not None:
            task.cancel()
        self._unsubscribe(name)
        if not any(_origin(s.url) == _origin(old.url) for s in a.specs.values()):
            a.client.forget(old.url)
        a.health_observed()
        self.changes["gone"] += 1
        log.info("engine %s: gone", name, extra=log_event("engine_gone", engine=name))
        a._tell(name, ["gone"])
        pending = e.pending
        if isinstance(pending, EngineSpec):
            self.join(pending, source=self._pending_source.pop(name, e.source))
        a.reconcile()

    # -- joining --------------------------------------------------------------------------

    def join(self, spec: EngineSpec, *, source: str) -> EngineState:
        """A new engine at joining (M01 admits it once ready): every data plane hears of
        it first, then the scheduler holds it (not placeable), then it is polled."""
        a = self.a
        if spec.authorization is not None:
            a.client.authorize(spec.url, spec.authorization)
        a._tell(spec.name, ["spec", spec.as_dict()])
        e = a.engine_state(spec, lifecycle="joining", source=source)
        e.healthy = False  # until its first poll answers
        a.specs[spec.name] = spec
        a.engines[spec.name] = e
        a.scheduler.add(e, a.prefix_index(spec))
        self.changes["join"] += 1
        log.info("engine %s: joining from %s (%s, %s, %s)", spec.name, source, spec.url, spec.role, spec.dialect,
                 extra=log_event("engine_joining", engine=spec.name, source=source, role=spec.role, dialect=spec.dialect))
        self._subscribe(e, spec)
        self._poll(e)
        return e

    def snapshot(self) -> dict[str, Any]:
        return {
            "changes": dict(self.changes),
            "source_errors": dict(self.source_errors),
            "last_errors": dict(self.last_error),
            "drain_timeout_ms": round(self.drain_timeout_s * 1000),
        }


def _settings(s: EngineSpec) -> tuple[Any, ...]:
    return (s.wave, s.max_concurrency, s.kv_block_size, s.authorization)


def _cap(slots: int, limit: int | None) -> int:
    return slots if limit is None else min(slots, limit)


_LOOPBACK = frozenset(("localhost", "::1", "ip6-localhost"))
_ANY = frozenset(("", "0.0.0.0", "::", "*"))


def _loopback(host: str) -> bool:
    return host in _LOOPBACK or host.startswith("127.") or host.endswith(".localhost")


def is_self(url: str, listen: str) -> bool:
    """Whether `url` names the router listening on `listen` (host:port): the same port,
    and the same host, a loopback name for a loopback or wildcard listen address, or any
    of this host's own names for a wildcard one. Without DNS: a name that resolves to
    this host under another spelling is not seen."""
    import socket
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        host, port = (u.hostname or "").lower(), u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        return False
    lhost, _, lport = listen.rpartition(":")
    lhost = lhost.strip("[]").lower()
    if not lport.isdigit() or int(lport) != port:
        return False
    if host == lhost:
        return True
    if lhost in _ANY:
        return _loopback(host) or host in (socket.gethostname().lower(), socket.getfqdn().lower())
    return _loopback(lhost) and _loopback(host)


def _origin(url: str) -> str:
    return url.split("://", 1)[-1].split("/", 1)[0]


def _why_ready(e: EngineState) -> str:
    return f"healthy, profile {e.profile_status}"
