"""Configuration reload (POST /admin/config/reload, SIGHUP): read the file again, validate
it whole, and change what changes at run time all at once (narwhal/core/reload.py says
which keys; failures.yaml H11 answers an invalid file, and nothing changes then).

What "at once" means: every change below is made in one turn of the authority's loop (no
await between the first and the last), so no admission decision sees half of it; the
data planes get the new configuration in the same turn (in process directly, worker
processes by one message on the channel their grants use).

`/v1/engines` names the configuration's hash (SHA-256 of the file's bytes as last
loaded) and when it was loaded.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from pathlib import Path
from typing import Any

from ..config import (
    ConfigError,
    FileRead,
    WatchedFile,
    config_from_bytes,
    load_config,
    load_yaml,
    parse_config,
)
from ..core.preempt import configured as preempt_configured
from ..core.reload import changed_keys, plan
from ..fleet.sources import configured
from ..telemetry.logs import event as log_event
from ..upstream.engines import config_engines
from .control import ControlPlane

__all__ = ["reload", "apply", "loaded", "attach", "ReloadError"]

log = logging.getLogger("narwhal")


class ReloadError(Exception):
    """The file could not be read or is invalid (H11); `missing`: no file to read (H05)."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


def loaded(control: ControlPlane, raw: bytes | None) -> None:
    """Record the configuration just loaded (at start, or by a reload)."""
    control.config_hash = hashlib.sha256(raw).hexdigest() if raw is not None else None
    control.config_loaded_at = time.time()


def attach(control: ControlPlane, path: str | None) -> None:
    """`narwhal serve --config PATH`: remember the file and what was loaded from it, and
    reload on SIGHUP (the same as POST /admin/config/reload; the outcome is logged)."""
    control.config_path = path
    raw = None
    if path is not None:
        try:
            raw = Path(path).read_bytes()
            as_file = load_config(path).model_dump(mode="json", by_alias=True)
            control.config_overrides = frozenset(changed_keys(as_file, control.config.model_dump(mode="json", by_alias=True)))
        except (OSError, ConfigError):
            raw = None  # read a moment ago by the command
    loaded(control, raw)
    if path is None:
        return
    import signal

    async def on_sighup() -> None:
        try:
            got = await reload(control)
        except ReloadError:
            return  # logged by reload
        except Exception:  # a bug must not stop the router; it is logged
            log.exception("configuration reload on SIGHUP failed")
            return
        log.info("SIGHUP: %s", {k: got[k] for k in ("changed", "restart_needed")})

    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(on_sighup()))
    except (NotImplementedError, RuntimeError):  # pragma: no cover - not on Linux's main thread
        log.warning("SIGHUP reload is not available here; use POST /admin/config/reload")


async def reload(control: ControlPlane) -> dict[str, Any]:
    """Read control.config_path again and apply it; raises ReloadError."""
    path = control.config_path
    if path is None:
        raise ReloadError("the router was started without --config: there is no file to reload", missing=True)
    try:
        raw = await _still(path)
        new = config_from_bytes(raw, source=str(path))
    except ConfigError as e:
        msg = str(e)
        log.error("configuration reload: %s (nothing changed)", msg, extra=log_event("config_reload_failed", path=str(path), error=msg))
        raise ReloadError(msg) from None
    running = control.config.model_dump(mode="json", by_alias=True)
    p = plan(running, new.model_dump(mode="json", by_alias=True))
    # keys the command line set (--workers) are the operator's, not the file's to change
    restart = tuple(k for k in p.restart if k not in control.config_overrides)
    try:
        merged = parse_config(p.merged, source=str(path))
    except ConfigError as e:  # the running restart-only keys and the new run-time ones disagree
        log.error("configuration reload: %s (nothing changed)", e, extra=log_event("config_reload_failed", path=str(path), error=str(e)))
        raise ReloadError(str(e)) from None
    try:
        fleet = apply(control, merged, p.changed)
    except ConfigError as e:  # raised before anything changed (apply's first lines)
        log.error("configuration reload: %s (nothing changed)", e, extra=log_event("config_reload_failed", path=str(path), error=str(e)))
        raise ReloadError(str(e)) from None
    loaded(control, raw)
    if restart:
        log.warning("configuration reload: these keys need a restart and were left as they were: %s", ", ".join(restart))
    log.info("configuration reloaded from %s (sha256 %s): changed %s", path, control.config_hash, ", ".join(p.changed) or "nothing",
             extra=log_event("config_reload", path=str(path), sha256=control.config_hash, changed=list(p.changed), restart_needed=list(restart)))
    return {"changed": list(p.changed), "restart_needed": list(restart), "fleet": fleet,
            "config": {"path": str(path), "sha256": control.config_hash, "loaded_at": control.config_loaded_at}}


# a reload reads the file only once it has stood still (as the keys file and
# discovery.file are): two reads STILL_S apart with the same stamp (inode, size, mtime,
# ctime, the bytes' hash); a file still changing after STILL_TRIES reads is refused (H11)
STILL_S = 0.2
STILL_TRIES = 25
MAX_CONFIG_BYTES = 1 << 24


def _blank(raw: bytes) -> bool:
    """No configuration at all: no bytes, only white space or comments."""
    try:
        return not raw.strip() or load_yaml(raw) is None
    except Exception:  # noqa: BLE001 - not YAML: the parse names the error
        return False


async def _still(path: str) -> bytes:
    """The file's bytes once two reads agree; ConfigError (H11, nothing changed) if it
    cannot be read (a regular file only, never blocking the loop, with a timeout), is
    empty (a truncated write, or an empty file: never "every key to its default"), or
    does not stand still."""
    f = WatchedFile(path, MAX_CONFIG_BYTES)
    last: FileRead | None = None
    for _ in range(STILL_TRIES):
        got = await f.read()
        if got.raw is None:
            raise ConfigError(str(got.error))
        if last is not None and last.stamp == got.stamp:
            if _blank(got.raw):  # judged once it stood still: a write under way is empty for a moment
                raise ConfigError(f"{path}: the file is empty (a reload never turns every key back to its default; nothing changed)")
            return got.raw
        last = got
        await asyncio.sleep(STILL_S)
    raise ConfigError(f"{path}: the file kept changing for {STILL_S * STILL_TRIES:g} s; nothing changed")


def apply(control: ControlPlane, cfg: Any, changed: tuple[str, ...]) -> dict[str, list[str]] | None:
    """Make `cfg` the running configuration (no await inside: one turn of the loop)."""
    c = control
    # whatever can still fail is done before the first change (a discovery.etcd naming a
    # password variable that is not set): the swap below is all or nothing
    restart = any(k.startswith("discovery.") and k not in ("discovery.drain_timeout_ms", "discovery.drain") for k in changed)
    sources = configured(cfg) if restart else None
    c.config = cfg
    a, m = cfg.admission, cfg.monitoring
    s = c.scheduler
    s.mode, s.queue_limit, s.tpot_budget_ms = a.mode, a.queue_limit, a.prediction.tpot_budget_ms
    if s.fair is not None:
        s.fair.fraction = a.fair_reserve
        s.fair.preempt = preempt_configured(cfg)
    for e in c.engines.values():
        e.prefill_slots = _cap(a.phase_concurrency.prefill, e.max_concurrency)
        e.decode_slots = _cap(a.phase_concurrency.decode, e.max_concurrency)
        e.breaker.threshold, e.breaker.cooldown = m.breaker_failures, m.breaker_cooldown_ms / 1000.0
    c.state.stale_after = m.stale_after_ms / 1000.0
    u = cfg.upstream
    c.client.reconfigure(connect_timeout_s=u.connect_timeout_ms / 1000.0, idle_timeout_s=u.idle_timeout_ms / 1000.0, max_body_bytes=u.max_event_bytes)
    c.membership.drain_timeout_s = cfg.discovery.drain_timeout_ms / 1000.0
    c.membership.max_engines = cfg.discovery.max_engines
    c.tell_config(cfg)
    fleet = None
    if "engines" in changed and cfg.engines is not None:
        fleet = c.membership.apply("config", config_engines(cfg))
    if sources is not None:
        c.restart_sources(sources)
    c.reconcile()
    return fleet


def _cap(slots: int, limit: int | None) -> int:
    return slots if limit is None else min(slots, limit)
