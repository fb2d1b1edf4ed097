"""auth.keys_file and auth.jwt.jwks_file, watched: the data plane's credentials.

The keys file is a YAML or JSON list of `{id, tenant, sha256, expires_at}` (or a mapping
with the key `keys`); the JWKS file a JSON Web Key Set. Both are read at start (an error
then stops the router, naming file, line and key) and checked every
auth.keys_interval_ms like discovery.file (narwhal/fleet/file.py: a whole, bounded read
of a regular file only, off the event loop in a thread of its own with a timeout, and a
change of inode, size, mtime, ctime or the bytes' hash taken once it is still there one
check later, narwhal/core/settle.py; a file over 1 MiB whose stat is unchanged is hashed
only at every 30th check): a changed file that reads and
validates replaces the table whole; one that does not leaves the table as it was, is
logged once per distinct error with file, line and key, and counted
(narwhal_auth_source_errors_total).

Where: every data-plane process (each worker with serving.workers > 1, the one process
otherwise) reads the files itself: the file is the source of truth, the check needs no
round trip to the authority, and a worker restarted reads what is there now. Workers may
see a change up to one interval apart.

WARNING: an error message names the entry (index, line, id) and the key of the mapping
that is wrong, never a value of `sha256` (a digest is no key, but still not for logs).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Iterable
from typing import Any

import jwt
import yaml
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from narwhal_generated import errors as E
from narwhal_generated.models.config import Auth as AuthConfig

from ..config import ConfigError, FileRead, WatchedFile, read_watched
from ..core.settle import Settle
from .identity import EMPTY, NAME, Identity, JwtSettings, KeyEntry, KeyTable, identify

__all__ = ["Auth", "parse_keys", "parse_jwks"]

log = logging.getLogger("narwhal")

_HEX64 = frozenset("0123456789abcdef")
_FIELDS = frozenset(("id", "tenant", "sha256", "expires_at"))


def _lines(raw: bytes) -> list[int]:
    """The line of each entry of the file's list (YAML or JSON), for error messages."""
    try:
        node = yaml.compose(raw)
    except yaml.YAMLError:
        return []
    if isinstance(node, yaml.MappingNode):
        node = next((v for k, v in node.value if getattr(k, "value", None) == "keys"), node)
    return [n.start_mark.line + 1 for n in node.value] if isinstance(node, yaml.SequenceNode) else []


def _expiry(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError("a time: unix seconds or ISO-8601 with a time zone")
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, dt.datetime):  # YAML reads an unquoted timestamp itself
        t = v
    elif isinstance(v, str):
        t = dt.datetime.fromisoformat(v)
    else:
        raise ValueError("a time: unix seconds or ISO-8601 with a time zone")
    if t.tzinfo is None:
        raise ValueError("an ISO-8601 time needs a time zone (e.g. Z or +00:00)")
    return t.timestamp()


def _entry(x: Any) -> KeyEntry:
    if not isinstance(x, dict):
        raise ValueError("an entry is a mapping {id, tenant, sha256, expires_at}")
    extra = sorted(str(k) for k in x if k not in _FIELDS)
    if extra:
        raise ValueError(f"{extra[0]}: unknown key")
    for k in ("id", "tenant", "sha256"):
        if k not in x:
            raise ValueError(f"{k}: missing")
    for k in ("id", "tenant"):
        if not isinstance(x[k], str) or not NAME.fullmatch(x[k]):
            raise ValueError(f"{k}: 1-128 of A-Z a-z 0-9 . _ : @ -")
    h = x["sha256"]
    if not isinstance(h, str) or len(h) != 64 or not set(h.lower()) <= _HEX64:
        raise ValueError("sha256: the hex SHA-256 of the key (64 hex digits; the key itself goes nowhere)")
    try:
        exp = None if x.get("expires_at") is None else _expiry(x["expires_at"])
    except ValueError as e:
        raise ValueError(f"expires_at: {e}") from None
    return KeyEntry(x["id"], x["tenant"], h.lower(), exp)


def parse_keys(raw: bytes, *, path: str, max_keys: int) -> KeyTable:
    """A keys file's bytes as a KeyTable; ValueError names file, line and key."""
    try:
        data: Any = yaml.safe_load(raw) if raw.strip() else []
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}:" if mark is not None else ""
        raise ValueError(f"{path}:{line} not valid YAML or JSON: {getattr(e, 'problem', None) or 'syntax'}") from None
    if isinstance(data, dict) and set(data) == {"keys"}:
        data = data["keys"]
    if not isinstance(data, list):
        raise ValueError(f"{path}: a list of keys {{id, tenant, sha256, expires_at}} (or a mapping with the key keys)")
    if len(data) > max_keys:
        raise ValueError(f"{path}: {len(data)} keys, over auth.max_keys ({max_keys})")
    entries: list[KeyEntry] = []
    ids: set[str] = set()
    digests: set[str] = set()
    lines: list[int] | None = None
    for i, x in enumerate(data):
        try:
            e = _entry(x)
            if e.id in ids:
                raise ValueError(f"id: {e.id!r} names two keys")
            if e.sha256 in digests:
                raise ValueError("sha256: the same key is listed twice")
        except ValueError as err:
            lines = _lines(raw) if lines is None else lines
            at = f" line {lines[i]}:" if i < len(lines) else ""
            raise ValueError(f"{path}:{at} keys[{i}].{err}") from None
        ids.add(e.id)
        digests.add(e.sha256)
        entries.append(e)
    return KeyTable.of(entries)


def parse_jwks(raw: bytes, *, path: str) -> Any:
    """A JWKS file's bytes as a jwt.PyJWKSet; ValueError names the file."""
    try:
        return jwt.PyJWKSet.from_json(raw.decode("utf-8"))
    except (jwt.PyJWKSetError, jwt.PyJWKError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a usable JSON Web Key Set ({type(e).__name__}: {e})") from None


class _Watched:
    """One file: its reads (narwhal/config.py WatchedFile: a regular file only, never
    blocking the loop, at most READ_TIMEOUT_S), its settling rule (narwhal/core/settle.py)
    and the last error said (said once)."""

    __slots__ = ("path", "what", "settle", "error", "file")

    def __init__(self, path: str, what: str, max_bytes: int) -> None:
        self.path = path
        self.what = what
        self.settle = Settle()
        self.error: str | None = None
        self.file = WatchedFile(path, max_bytes, setting="auth.max_file_bytes")

    def first(self) -> FileRead:
        """At start: one read, its stamp taken (an error then stops the router)."""
        got = read_watched(self.path, self.file.max_bytes, setting="auth.max_file_bytes")
        self.settle.stamp = got.stamp
        return got

    async def changed(self) -> FileRead | None:
        """The read to take, once per change, when the new stamp was already there one
        check before (core/settle.py): a keys file rewritten in place is not read
        half-way (an empty keys file is valid and revokes every key). The stamp has
        ctime and the bytes' hash: an edit keeping size and mtime is seen. While nothing
        settles, a file over 1 MiB unchanged by its stat is not read (narwhal/config.py
        WatchedFile: hashed whole at every HASH_EVERY-th check)."""
        got = await self.file.read(self.settle.quiet)
        return got if self.settle.changed(got.stamp) else None


class Auth:
    """The data plane's identity check and the files behind it (module docstring).
    `check(headers)` is the request path's whole cost: one SHA-256 and one lookup."""

    def __init__(self, cfg: AuthConfig, *, clock: Any = time.time) -> None:
        if cfg.keys_file is None and cfg.jwt is None:
            raise ConfigError("auth: needs keys_file or jwt (or both)")
        self.cfg = cfg
        self.clock = clock  # wall clock: expires_at and exp are wall-clock times
        self.keys: KeyTable = EMPTY
        self.jwt: JwtSettings | None = None
        self.errors = {"keys_file": 0, "jwks_file": 0}
        self._files: list[_Watched] = []
        if cfg.keys_file is not None:
            self._files.append(_Watched(cfg.keys_file, "keys_file", cfg.max_file_bytes))
        if cfg.jwt is not None:
            self._files.append(_Watched(cfg.jwt.jwks_file, "jwks_file", cfg.max_file_bytes))
        for w in self._files:  # at start an error stops the router
            try:
                self._apply(w, self._load(w, w.first()))
            except ValueError as e:
                raise ConfigError(f"auth.{w.what}: {e}") from None

    def check(self, headers: Iterable[tuple[bytes, bytes]]) -> Identity | E.ErrorRow:
        return identify(headers, self.keys, self.jwt, self.clock())

    # -- the files -----------------------------------------------------------------------

    def _load(self, w: _Watched, got: FileRead) -> Any:
        if got.raw is None:
            raise ValueError(got.error)
        raw = got.raw
        if w.what == "keys_file":
            return parse_keys(raw, path=w.path, max_keys=self.cfg.max_keys)
        return parse_jwks(raw, path=w.path)

    def _apply(self, w: _Watched, got: Any) -> None:
        if w.what == "keys_file":
            self.keys = got
            log.info("auth: %d keys from %s", len(got.by_digest), w.path)
            return
        j = self.cfg.jwt
        assert j is not None
        self.jwt = JwtSettings(got, j.issuer, j.audience, j.tenant_claim, tuple(j.algorithms), j.leeway_ms / 1000.0)
        log.info("auth: %d JWT keys from %s", len(got.keys), w.path)

    async def refresh(self) -> None:
        """One round: every file that changed is read again (off the event loop)."""
        for w in self._files:
            read = await w.changed()
            if read is None:
                continue
            try:
                got = await asyncio.to_thread(self._load, w, read)
            except ValueError as e:
                self.errors[w.what] += 1
                if str(e) != w.error:
                    log.error("auth.%s: %s; the keys stay as they were", w.what, e)
                w.error = str(e)
                continue
            self._apply(w, got)
            w.error = None

    async def run(self) -> None:
        """Check the files every auth.keys_interval_ms until cancelled."""
        interval = self.cfg.keys_interval_ms / 1000.0
        while True:
            await asyncio.sleep(interval)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a bug here must not stop the watching
                log.exception("auth: checking the keys files failed")

    # -- /metrics ------------------------------------------------------------------------

    def collect(self) -> Iterable[Any]:
        """A prometheus_client collector: how many keys are loaded, and the files'
        errors. Never a key, a digest or a tenant (unbounded labels)."""
        g = GaugeMetricFamily("narwhal_auth_keys", "API keys loaded from auth.keys_file (and JWT keys from auth.jwt.jwks_file).", labels=["source"])
        if self.cfg.keys_file is not None:
            g.add_metric(["keys_file"], len(self.keys.by_digest))
        if self.jwt is not None:
            g.add_metric(["jwks_file"], len(self.jwt.keys.keys))
        yield g
        c = CounterMetricFamily("narwhal_auth_source_errors", "Changes of auth.keys_file or auth.jwt.jwks_file that could not be read or validated (the keys stayed as they were).", labels=["source"])
        hung = {w.what: w.file.failures for w in self._files}  # reads that did not return in time
        for k, n in self.errors.items():
            c.add_metric([k], n + hung.get(k, 0))
        yield c
