"""discovery.etcd: engines from the keys under an etcd prefix, watched.

Every key under discovery.etcd.prefix (default /narwhal/engines/) is one engine: its
value is one engines[] entry, JSON or YAML, validated by the configuration's own schema
and checks (narwhal/config.py `parse_engines`). The key is only a label; the entry's
`name` is the engine's. A key written with a lease (an engine's agent that keeps the lease
alive) leaves when the lease expires: etcd deletes the key and the watch says so.

How it runs: read the whole prefix at one revision (bounded: at most max_engines keys,
each call within request_timeout_ms), emit one Snapshot, then watch from the next revision
and emit the whole set again after every answer of the watch (the events of one revision
or more: a transaction that swaps engines is applied as one diff). The watch's liveness is
checked every PROBE_S with a cheap read, so an etcd that stops answering without closing
the connection is noticed too. A watch that breaks, or whose revision was compacted,
is followed by a full read and a new watch, with back-off up to 5 s.

Decisions:
  * An invalid value (not JSON/YAML, not a valid engines[] entry, over MAX_VALUE_BYTES) is
    left out of the snapshot, and a SourceError names its key and the field: the engine
    it named, if any, leaves. One bad writer must not freeze everyone else's changes (the
    file source, one document with one writer, keeps the whole file as it was instead).
  * Two keys naming the same engine: the key created first (lower create_revision) wins;
    a SourceError names the other.
  * More than max_engines keys: a SourceError and no snapshot (the fleet stays as it was)
    until the prefix is back under the bound: a bound on what a writer of the prefix can
    make the router hold.
  * etcd unreachable: a SourceError once per outage (not per retry), retries with back-off
    up to 5 s, a full read when it answers again. The engines stay: an etcd outage must not
    empty the fleet (the engines themselves are most likely fine and serving; removing
    them would turn a control-plane outage into a data-plane one). Engines whose keys
    were deleted during the outage leave at the read after it.

A production etcd (TLS, client certificates, users): narwhal/upstream/etcd.py. The
settings are this section's `endpoints`, `ca_file`, `cert_file`, `key_file`, `username`
and `password_env` (the name of the environment variable that holds the password); with
`endpoints` null the section uses ha.etcd, and, when it sets none of the TLS and user
settings, ha's. The user needs read on the prefix (etcd role with `read` on a prefix
range); the engines' agents need write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any, Protocol

import yaml

from narwhal_generated.models.config import Engine, NarwhalConfig

from ..config import ConfigError, parse_engines
from ..upstream.engines import engine_spec
from ..upstream.etcd import Etcd, EtcdCompacted, EtcdError, KeyValue, WatchEvent, ssl_context
from .source import Emit, Snapshot, Source, SourceError

__all__ = ["etcd_source", "etcd_client", "client_settings", "EtcdFleet"]

log = logging.getLogger("narwhal")

SOURCE = "etcd"
MAX_VALUE_BYTES = 16 * 1024  # one engines[] entry is a few hundred bytes
RETRY_MIN_S = 0.2
RETRY_MAX_S = 5.0
PROBE_S = 10.0  # while watching: is etcd still answering?
_TLS_USER = ("ca_file", "cert_file", "key_file", "username", "password_env")


class _EtcdSettings(Protocol):
    ca_file: str | None
    cert_file: str | None
    key_file: str | None
    username: str | None
    password_env: str | None


def client_settings(s: _EtcdSettings, *, where: str) -> dict[str, Any]:
    """The TLS and user keyword arguments of `Etcd` from a configuration section (ha,
    discovery.etcd). The password comes from the variable password_env names: a username
    without it, or a variable that is not set, is a ConfigError naming the key and the
    variable. The TLS files are loaded once here so a bad file is a start-up error too."""
    password: str | None = None
    if s.username is not None:
        if s.password_env is None:
            raise ConfigError(f"{where}.username: needs {where}.password_env (the environment variable that holds the password)")
        password = os.environ.get(s.password_env)
        if not password:
            raise ConfigError(f"{where}.password_env: the environment variable {s.password_env} is not set (it holds {where}.username's etcd password)")
    if s.ca_file is not None or s.cert_file is not None or s.key_file is not None:
        try:
            ssl_context(s.ca_file, s.cert_file, s.key_file)
        except EtcdError as x:
            raise ConfigError(f"{where}: {x}") from None
    return {"ca_file": s.ca_file, "cert_file": s.cert_file, "key_file": s.key_file, "username": s.username, "password": password}


def etcd_client(urls: list[str], s: _EtcdSettings, *, timeout_s: float, where: str) -> Etcd:
    """An etcd client with a section's TLS and user settings (ha.py, this module)."""
    return Etcd(urls, timeout_s=timeout_s, **client_settings(s, where=where))


def _settings(cfg: NarwhalConfig) -> tuple[list[str], dict[str, Any]]:
    """discovery.etcd's endpoints and client settings, falling back to ha's."""
    d = cfg.discovery.etcd
    assert d is not None
    if d.endpoints is not None:
        return [u.root for u in d.endpoints], client_settings(d, where="discovery.etcd")
    if cfg.ha is None:
        raise ConfigError("discovery.etcd.endpoints: needed when there is no ha section to take ha.etcd from")
    own = any(getattr(d, k) is not None for k in _TLS_USER)
    return [u.root for u in cfg.ha.etcd], client_settings(d, where="discovery.etcd") if own else client_settings(cfg.ha, where="ha")


def _key(k: bytes) -> str:
    return k.decode("utf-8", "backslashreplace")


def _parse(key: bytes, kv: KeyValue) -> Engine | str:
    """One value: its engines[] entry, or why not (naming the key and the field)."""
    where = f"etcd key {_key(key)}"
    if len(kv.value) > MAX_VALUE_BYTES:
        return f"{where}: a value of {len(kv.value)} bytes (at most {MAX_VALUE_BYTES})"
    try:
        data = yaml.safe_load(kv.value) if kv.value.strip() else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        return f"{where}:{line}: not valid JSON or YAML: {getattr(e, 'problem', None) or e}"
    if data is None:
        return f"{where}: empty; expected one engines[] entry"
    try:
        (entry,) = parse_engines([data], source=where)
    except ConfigError as e:
        return str(e)
    return entry


class EtcdFleet:
    """The keys under the prefix as this source last read and watched them: the whole
    set it emits, and the errors of that set. Pure (no I/O): the tests drive it too."""

    def __init__(self, prefix: str, max_engines: int) -> None:
        self.prefix = prefix
        self.max_engines = max_engines
        self.keys: dict[bytes, tuple[KeyValue, Engine | str]] = {}
        self.revision = 0

    def reset(self, revision: int, items: list[tuple[bytes, KeyValue]]) -> None:
        self.revision = revision
        self.keys = {k: (kv, _parse(k, kv)) for k, kv in items}

    def apply(self, events: list[WatchEvent]) -> None:
        for ev in events:
            if ev.type == "DELETE":
                self.keys.pop(ev.key, None)
            else:
                self.keys[ev.key] = (ev.kv, _parse(ev.key, ev.kv))
            self.revision = max(self.revision, ev.kv.mod_revision)

    def too_many(self) -> SourceError | None:
        if len(self.keys) > self.max_engines:
            return SourceError(SOURCE, f"etcd prefix {self.prefix}: more than discovery.etcd.max_engines ({self.max_engines}) keys; "
                                       "the fleet stays as it was")
        return None

    def state(self) -> tuple[Snapshot, list[SourceError]]:
        """The whole set (invalid values and the later of two keys naming one engine left
        out) and the errors that say what was left out."""
        errors: list[SourceError] = []
        by_name: dict[str, tuple[int, bytes, Engine]] = {}
        for key, (kv, got) in sorted(self.keys.items(), key=lambda x: (x[1][0].create_revision, x[0])):
            if isinstance(got, str):
                errors.append(SourceError(SOURCE, got))
                continue
            first = by_name.get(got.name)
            if first is not None:
                errors.append(SourceError(SOURCE, f"etcd key {_key(key)}: name: engine {got.name!r} is already named by etcd key "
                                                  f"{_key(first[1])} (created first); this key is left out"))
                continue
            by_name[got.name] = (kv.create_revision, key, got)
        engines = tuple(engine_spec(e) for _, _, e in sorted(by_name.values(), key=lambda x: x[1]))
        return Snapshot(SOURCE, engines, where=f"{self.prefix}@{self.revision}"), errors


def etcd_source(cfg: NarwhalConfig) -> Source:
    d = cfg.discovery.etcd
    assert d is not None
    urls, settings = _settings(cfg)  # a start-up error when the password's variable is missing
    prefix = d.prefix
    timeout_s = d.request_timeout_ms / 1000.0
    max_engines = d.max_engines
    # a read of max_engines + 1 keys, each value at most MAX_VALUE_BYTES (base64: 4/3)
    max_bytes = max(1 << 20, (max_engines + 1) * (MAX_VALUE_BYTES * 4 // 3 + 1024))

    async def run(emit: Emit) -> None:
        while True:
            try:
                etcd = Etcd(urls, timeout_s=timeout_s, **settings)
                break
            except EtcdError as x:  # a TLS file went away or went bad since the start
                emit(SourceError(SOURCE, f"discovery.etcd: {x}"))
                await asyncio.sleep(RETRY_MAX_S)
        fleet = EtcdFleet(prefix, max_engines)
        down = False  # an outage was reported (once per outage)
        reported: set[str] = set()  # the value errors emitted since the last full read
        retry = RETRY_MIN_S

        def publish() -> None:
            nonlocal reported
            over = fleet.too_many()
            if over is not None:
                if over.message not in reported:
                    emit(over)
                reported = {over.message}
                return
            snap, errors = fleet.state()
            emit(snap)
            now = {e.message for e in errors}
            for e in errors:
                if e.message not in reported:
                    emit(e)
            reported = now

        try:
            while True:
                try:
                    rev, items = await etcd.get_prefix(prefix.encode(), limit=max_engines + 1, max_bytes=max_bytes)
                except EtcdCompacted:  # pragma: no cover - a range at the current revision is never compacted
                    continue
                except EtcdError as x:
                    if not down:
                        emit(SourceError(SOURCE, f"etcd {', '.join(urls)}: unreachable ({x}); the fleet stays as it was until etcd answers"))
                        down = True
                    await asyncio.sleep(retry)
                    retry = min(RETRY_MAX_S, retry * 2)
                    continue
                if down:
                    log.warning("fleet source etcd: etcd answers again; read %s at revision %d", prefix, rev)
                    down = False
                fleet.reset(rev, items)
                reported = set()
                publish()
                started = time.monotonic()
                try:
                    await _watch(etcd, fleet, publish, max_bytes)
                except EtcdCompacted as x:
                    log.info("fleet source etcd: %s; reading %s again", x, prefix)
                    continue
                except EtcdError as x:
                    log.info("fleet source etcd: %s; reading %s again", x, prefix)
                    if time.monotonic() - started > 2 * RETRY_MAX_S:
                        retry = RETRY_MIN_S  # the watch worked for a while: this is a new failure
                    await asyncio.sleep(retry)
                    retry = min(RETRY_MAX_S, retry * 2)
        finally:
            await etcd.aclose()

    return run


async def _watch(etcd: Etcd, fleet: EtcdFleet, publish: Any, max_bytes: int) -> None:
    """Watch from the revision after the read; publish after each answer. Every PROBE_S a
    cheap read checks that etcd still answers (EtcdError when it does not)."""
    prefix = fleet.prefix.encode()

    async def consume() -> None:
        async for batch in etcd.watch_prefix(prefix, fleet.revision + 1, max_line_bytes=max_bytes):
            fleet.apply(batch)
            if len(fleet.keys) > 2 * fleet.max_engines:
                publish()  # the error
                raise EtcdError(f"more than twice discovery.etcd.max_engines keys under {fleet.prefix}: reading again later")
            publish()

    w = asyncio.ensure_future(consume())
    try:
        while True:
            done, _ = await asyncio.wait({w}, timeout=PROBE_S)
            if done:
                w.result()  # raises why the watch ended
                raise EtcdError("watch: the stream ended")
            await etcd.count_prefix(prefix)
    finally:
        w.cancel()
        with contextlib.suppress(BaseException):
            await w
