"""Configuration: YAML validated by the generated config model (spec/schema/config.schema.json).

Every key has a default; unknown keys are an error at start-up. Errors name the key path
(`admission.queue_limit: Input should be greater than or equal to 0`). Beyond the schema,
`check_fleet` enforces what a schema cannot say:
  * engine names are unique;
  * prefill engines need decode engines and the other way round (vLLM two-phase);
  * sglang and openai engines are unified only (spec/tables/dialects.yaml V02, V03);
  * serving.tls has both certfile and keyfile or neither;
  * observability: traces (sample_ratio > 0) need an otlp_endpoint, a batch fits the
    queue, and protocol grpc its exporter package;
  * upstream.deny_fields names each field once, and none the router cannot do without
    (model, messages, prompt);
  * engines on one host and port carry the same userinfo, if any;
  * no more engines than discovery.max_engines.
The schema admits http:// engine URLs only; an https:// one gets its own words, naming
the engine (the engine client has no TLS).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import os
import stat as _stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import ValidationError

from narwhal_generated.models.config import Engine, NarwhalConfig

__all__ = ["ConfigError", "load_config", "parse_config", "config_from_bytes", "load_yaml", "FileRead", "read_watched", "read_unless", "WatchedFile", "READ_TIMEOUT_S", "FULL_READ_BYTES", "HASH_EVERY", "parse_engines", "has_discovery", "NarwhalConfig", "EMBEDDED_FLEET"]

# docs/contract.md "Commands": with no engines, the embedded simulated fleet (one prefill and one decode
# engine of the vllm dialect) runs in-process on free loopback ports.
EMBEDDED_FLEET = (
    {"name": "p0", "role": "prefill", "dialect": "vllm", "wave": "a"},
    {"name": "d0", "role": "decode", "dialect": "vllm", "wave": "b"},
)


# upstream.deny_fields may not name these: no engine request can go without them
_NEEDED_FIELDS = frozenset(("model", "messages", "prompt"))


class ConfigError(Exception):
    """The configuration is invalid; the message names the key."""


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (("." if out else "") + str(p))
    return out or "(top level)"


def parse_config(data: Any, *, source: str = "config") -> NarwhalConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the configuration must be a mapping of sections")
    try:
        cfg = NarwhalConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors(include_url=False):
            key = _loc(tuple(err["loc"]))
            msg = "unknown key" if err["type"] == "extra_forbidden" else _https_engine(data, err) or err["msg"]
            lines.append(f"{key}: {msg}")
        raise ConfigError(f"{source}: " + "; ".join(lines)) from None
    check_fleet(cfg, source=source)
    return cfg


def _https_engine(data: dict[str, Any], err: Any) -> str | None:
    """The words for an https:// engine URL, which the schema's pattern refuses: the
    engine client speaks cleartext HTTP/1.1 only (narwhal/upstream/http1.py). Names the
    engine; None for any other error."""
    loc = tuple(err["loc"])
    url = err.get("input")
    if len(loc) != 3 or loc[0] != "engines" or loc[2] != "url" or not isinstance(url, str):
        return None
    if not url[:8].lower().startswith("https://"):
        return None
    name = None
    engines = data.get("engines")
    if isinstance(engines, list) and isinstance(loc[1], int) and loc[1] < len(engines) and isinstance(engines[loc[1]], dict):
        name = engines[loc[1]].get("name")
    who = f"engine {name!r}" if isinstance(name, str) else "this engine"
    return (
        f"{who} has an https:// URL, and Narwhal talks to engines over cleartext HTTP/1.1 only "
        "(no TLS to engines); use http:// on a network the router trusts, or a TLS-originating proxy beside the router"
    )


def check_fleet(cfg: NarwhalConfig, *, source: str = "config") -> None:
    if cfg.engines is not None and len(cfg.engines) > cfg.discovery.max_engines:
        raise ConfigError(f"{source}: engines: {len(cfg.engines)} entries, over discovery.max_engines ({cfg.discovery.max_engines})")
    if any(n.root < 1 for n in cfg.admission.prediction.profile_prompt_tokens):
        raise ConfigError(f"{source}: admission.prediction.profile_prompt_tokens: every length must be >= 1")
    tls = cfg.serving.tls
    if (tls.certfile is None) != (tls.keyfile is None):
        raise ConfigError(f"{source}: serving.tls needs both certfile and keyfile")
    deny = [f.root for f in cfg.upstream.deny_fields]
    for i, f in enumerate(deny):
        if not f or f.strip() != f:
            raise ConfigError(f"{source}: upstream.deny_fields[{i}]: {f!r} is not a field name")
        if f in _NEEDED_FIELDS:
            raise ConfigError(f"{source}: upstream.deny_fields[{i}]: the router cannot forward a request without {f!r}")
        if f in deny[:i]:
            raise ConfigError(f"{source}: upstream.deny_fields[{i}]: {f!r} is listed twice")
    obs = cfg.observability
    if obs.sample_ratio > 0 and not obs.otlp_endpoint:
        raise ConfigError(f"{source}: observability.sample_ratio: traces need observability.otlp_endpoint (where to send them)")
    if obs.max_export_batch_size > obs.max_queue_size:
        raise ConfigError(f"{source}: observability.max_export_batch_size: at most observability.max_queue_size ({obs.max_queue_size})")
    if obs.protocol == "grpc" and obs.sample_ratio > 0 and importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is None:
        raise ConfigError(f"{source}: observability.protocol: grpc needs the opentelemetry-exporter-otlp-proto-grpc package (pip install opentelemetry-exporter-otlp-proto-grpc); http/protobuf needs nothing more")
    if cfg.auth is not None and cfg.auth.keys_file is None and cfg.auth.jwt is None:
        raise ConfigError(f"{source}: auth: needs keys_file or jwt (or both)")
    if cfg.discovery.drain == "migrate" and cfg.upstream.migration.max_attempts < 1:
        raise ConfigError(f"{source}: discovery.drain: migrate needs upstream.migration.max_attempts >= 1 (a continuation to move each decode to)")
    ha = cfg.ha
    if ha is not None:
        # renew_interval_ms and fence_margin_ms follow the TTL unless given (an operator
        # who sets only lease_ttl_ms, even the schema's minimum, can start)
        if ha.renew_interval_ms is None:
            ha.renew_interval_ms = min(1000, ha.lease_ttl_ms // 3)
        if ha.fence_margin_ms is None:
            ha.fence_margin_ms = min(500, ha.lease_ttl_ms // 4)
        if 3 * ha.renew_interval_ms > ha.lease_ttl_ms:
            raise ConfigError(f"{source}: ha.renew_interval_ms: at most a third of ha.lease_ttl_ms ({ha.lease_ttl_ms // 3})")
        if ha.fence_margin_ms + ha.renew_interval_ms >= ha.lease_ttl_ms:
            raise ConfigError(f"{source}: ha.fence_margin_ms: with ha.renew_interval_ms it must stay under ha.lease_ttl_ms")
    if cfg.engines is None:
        return
    if not cfg.engines and not has_discovery(cfg):
        raise ConfigError(f"{source}: engines: an empty fleet serves nothing; omit the key for the embedded fleet")
    check_engines(cfg.engines, source=source, key="engines")
    if has_discovery(cfg):
        return  # a fleet that changes at run time may be P/D-incomplete for a while (R09)
    roles = {e.role for e in cfg.engines}
    if ("prefill" in roles) != ("decode" in roles):
        missing = "decode" if "prefill" in roles else "prefill"
        raise ConfigError(f"{source}: engines: prefill and decode engines come together; no {missing} engine is configured")


def has_discovery(cfg: NarwhalConfig) -> bool:
    """A run-time source of engines is configured (discovery.file, .etcd, .dns)."""
    d = cfg.discovery
    return d.file is not None or d.etcd is not None or d.dns is not None


def check_engines(engines: list[Engine], *, source: str, key: str) -> None:
    """What a schema cannot say of a list of engines[] entries: unique names, one
    userinfo per host and port, two-phase roles for the vllm dialect only."""
    seen: set[str] = set()
    userinfo: dict[tuple[str | None, int | None], str] = {}
    for i, e in enumerate(engines):
        if e.name in seen:
            raise ConfigError(f"{source}: {key}[{i}].name: {e.name!r} is used twice")
        seen.add(e.name)
        try:
            u = urlsplit(e.url)
            origin = (u.hostname, u.port)
        except ValueError as x:
            raise ConfigError(f"{source}: {key}[{i}].url: {x}") from None
        info = u.netloc.rpartition("@")[0]
        if userinfo.setdefault(origin, info) != info:
            # the message names no credentials
            raise ConfigError(f"{source}: {key}[{i}].url: engines on one host and port must carry the same userinfo")
        if e.dialect != "vllm" and e.role != "unified":
            raise ConfigError(f"{source}: {key}[{i}].role: the {e.dialect} dialect has no vLLM two-phase protocol; use role unified")


def parse_engines(data: Any, *, source: str, key: str = "engines") -> list[Engine]:
    """engines[] entries from a run-time source (a discovery file, etcd values, the admin
    API's body): validated by the same schema and checks as the configuration's. Errors
    name the source and the key path (`fleet.yaml: engines[2].role: ...`)."""
    if not isinstance(data, list):
        raise ConfigError(f"{source}: {key}: expected a list of engines[] entries")
    out: list[Engine] = []
    for i, item in enumerate(data):
        try:
            out.append(Engine.model_validate(item))
        except ValidationError as e:
            lines = []
            for err in e.errors(include_url=False):
                loc = (key, i, *err["loc"])
                msg = "unknown key" if err["type"] == "extra_forbidden" else _https_engine({key: data, "engines": data}, {**err, "loc": ("engines", i, *err["loc"])}) or err["msg"]
                lines.append(f"{_loc(loc)}: {msg}")
            raise ConfigError(f"{source}: " + "; ".join(lines)) from None
    check_engines(out, source=source, key=key)
    return out


def load_yaml(raw: bytes | str, *, json_too: bool = False) -> Any:
    """YAML through libyaml's C loader when PyYAML has it (several times the pure-Python
    loader's speed); `json_too`: text that starts like JSON is tried as JSON first (JSON
    is YAML, and its parser is faster still). yaml.YAMLError on bad input."""
    if json_too and raw.lstrip()[:1] in (b"[", b"{", "[", "{"):
        try:
            return json.loads(raw)
        except ValueError:
            pass  # YAML flow style is not JSON: the YAML loader says where it is wrong
    return yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 - a safe loader


def config_from_bytes(raw: bytes, *, source: str) -> NarwhalConfig:
    """The configuration from a file's bytes (narwhal serve --config, a reload)."""
    try:
        data = load_yaml(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    return parse_config(data, source=source)


def load_config(path: str | Path | None) -> NarwhalConfig:
    """The configuration from a YAML file, or the embedded default when path is None."""
    if path is None:
        return parse_config({}, source="embedded default")
    got = read_watched(str(path), 1 << 30)
    if got.raw is None:
        raise ConfigError(str(got.error))
    return config_from_bytes(got.raw, source=str(path))


# -- watched files: auth.keys_file, auth.jwt.jwks_file, discovery.file, a reload ---------
#
# Invariants (issue 40 items 2 and 3):
#   * only a regular file is read: opened non-blocking (a FIFO's open would wait for a
#     writer for ever), then fstat'ed; anything else is an error naming the file;
#   * a read runs in a daemon thread of its own and is awaited at most READ_TIMEOUT_S: a
#     hung network mount blocks that thread, never the event loop, and a stop never
#     waits for it (a daemon thread does not hold the interpreter's exit); while it hangs
#     no second read of the same file starts (each check is an error, counted);
#   * the stamp a change is seen by is inode, device, size, mtime_ns, ctime_ns and the
#     SHA-256 of the bytes: an edit that keeps size and modification time (touch -r,
#     rsync --inplace -t) changes ctime and the bytes;
#   * a periodic check that is handed the stamp last taken (`WatchedFile.read(taken)`)
#     stats the file first: a file over FULL_READ_BYTES whose inode, device, size,
#     mtime_ns and ctime_ns are the taken stamp's is not read or hashed (a 32 MiB keys
#     file cost ~60 ms of CPU a check, docs/operations.md), except at every
#     HASH_EVERY-th such check: the kernel's file times tick coarsely (a jiffy, or a
#     second on some file systems), so two writes of one size within one tick keep
#     every stat field, and only the bytes tell; the hash then sees them within
#     HASH_EVERY checks.

READ_TIMEOUT_S = 5.0
FULL_READ_BYTES = 1 << 20  # up to this size a check always reads and hashes (~1 ms)
HASH_EVERY = 30  # a larger file unchanged by stat is still read and hashed at every 30th check


@dataclass(frozen=True, slots=True)
class FileRead:
    """One read: `raw` and its `stamp`, or `error` (then `stamp` is the error's own, so a
    lasting error settles and is said once)."""

    stamp: tuple[Any, ...]
    raw: bytes | None
    error: str | None = None


def read_watched(path: str, max_bytes: int, *, setting: str = "max_file_bytes") -> FileRead:
    """Read `path` whole if it is a regular file of at most `max_bytes` (blocking only
    on the disk: call it off the event loop)."""
    return read_unless(path, max_bytes, None, setting=setting)


def read_unless(path: str, max_bytes: int, taken: tuple[Any, ...] | None, *, setting: str = "max_file_bytes") -> FileRead:
    """`read_watched`, except that a regular file whose stat (inode, device, size,
    mtime_ns, ctime_ns) is that of the stamp `taken` is not read: FileRead(taken, None)
    says so (no error, no bytes: nothing changed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        return FileRead(("error", e.errno), None, f"{path}: {e.strerror or e}")
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            return FileRead(("error", "not regular"), None, f"{path}: not a regular file (a FIFO, device or socket is never read)")
        if taken is not None and taken[:5] == (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns):
            return FileRead(taken, None)
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            b = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not b:
                break
            chunks.append(b)
            size += len(b)
    except OSError as e:
        return FileRead(("error", e.errno), None, f"{path}: {e.strerror or e}")
    finally:
        os.close(fd)
    if size > max_bytes:
        return FileRead(("error", "large", st.st_size), None, f"{path}: larger than {setting} ({max_bytes})")
    raw = b"".join(chunks)
    return FileRead((st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns, hashlib.sha256(raw).digest()), raw)


class WatchedFile:
    """One watched file's reads, each in a daemon thread, awaited at most `timeout` s
    (invariants above). `failures` counts reads that did not return in time; `skipped`
    the checks since the last whole read that the stat alone answered."""

    __slots__ = ("path", "max_bytes", "setting", "timeout", "_busy", "failures", "skipped")

    def __init__(self, path: str, max_bytes: int, *, setting: str = "max_file_bytes", timeout: float = READ_TIMEOUT_S) -> None:
        self.path, self.max_bytes, self.setting, self.timeout = path, max_bytes, setting, timeout
        self._busy = False  # a read's thread has not returned yet
        self.failures = 0
        self.skipped = 0

    def _skippable(self, taken: Any) -> tuple[Any, ...] | None:
        """The stamp a check may be answered by the stat against: `taken` when it is a
        read's stamp of a file over FULL_READ_BYTES and this is not a HASH_EVERY-th check."""
        if not isinstance(taken, tuple) or len(taken) != 6 or taken[0] == "error" or taken[2] <= FULL_READ_BYTES:
            return None
        return taken if self.skipped < HASH_EVERY - 1 else None

    async def read(self, taken: Any = None) -> FileRead:
        """The file's bytes and stamp; with `taken`, the stamp last taken while nothing
        newer settles (core/settle.py `Settle.quiet`), FileRead(taken, None) when the stat
        says the file is still that one (invariants above)."""
        if self._busy:
            self.failures += 1
            return FileRead(("error", "hung"), None, f"{self.path}: an earlier read has not returned yet (a hung mount?)")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[FileRead] = loop.create_future()

        def done(got: FileRead) -> None:
            if not fut.done():
                fut.set_result(got)

        unless = self._skippable(taken)

        def run() -> None:
            if unless is None:
                got = read_watched(self.path, self.max_bytes, setting=self.setting)
            else:
                got = read_unless(self.path, self.max_bytes, unless, setting=self.setting)
            self.skipped = self.skipped + 1 if got.raw is None and got.error is None else 0
            self._busy = False
            try:
                loop.call_soon_threadsafe(done, got)
            except RuntimeError:  # the loop closed while this read hung: nobody waits
                pass

        self._busy = True
        threading.Thread(target=run, name="narwhal-file-read", daemon=True).start()
        try:
            return await asyncio.wait_for(fut, self.timeout)
        except TimeoutError:
            self.failures += 1
            return FileRead(("error", "timeout"), None, f"{self.path}: not read within {self.timeout:g} s (a hung mount?)")
