"""discovery.file: engines from a YAML or JSON file, watched.

The file holds a list of engines[] entries (or a mapping with the key `engines`), each
validated by the configuration's own schema and checks (narwhal/config.py
`parse_engines`). It is read at start and checked every discovery.file_interval_ms; a
file is read whole at every check (a regular file only, never blocking the event loop,
at most narwhal/config.py READ_TIMEOUT_S: a FIFO or a hung mount is an error, not a hang;
one over 1 MiB whose stat is still the taken version's only at every 30th check)
and a change of its stamp (inode, size, mtime, ctime, the bytes' SHA-256) is parsed once
it has stood still for one check (narwhal/core/settle.py: a file rewritten in place is not read half-way), and
emitted as one Snapshot when its engines differ: the authority applies it as one diff.

Why polling and not inotify: Kubernetes replaces a mounted ConfigMap by swapping a
symlink to a new directory, editors write a temporary file and rename it, NFS has no
events; a stat a second is cheap, bounded and sees all of them. The read is bounded by
discovery.max_file_bytes.

A file that is missing, too large, not YAML, or not valid leaves the fleet as it was: a
SourceError names the file, the line (YAML) and the key, once per distinct error. An empty
list is valid: every engine the file named leaves.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import yaml

from narwhal_generated.models.config import NarwhalConfig

from ..config import ConfigError, FileRead, WatchedFile, load_yaml, parse_engines, read_watched
from ..core.settle import Settle
from ..upstream.engines import engine_spec
from .source import Emit, Snapshot, Source, SourceError

__all__ = ["file_source", "read_fleet_file", "parse_fleet_file", "FleetFile"]


def read_fleet_file(path: str, max_bytes: int, max_engines: int | None = None) -> Snapshot | SourceError:
    """One read of the file (blocking: off the event loop): its engines, or why not."""
    return parse_fleet_file(path, read_watched(path, max_bytes, setting="discovery.max_file_bytes"), max_engines)


def parse_fleet_file(path: str, got: FileRead, max_engines: int | None = None) -> Snapshot | SourceError:
    """A read of the file: its engines, or why not (more entries than `max_engines`:
    refused before any is validated)."""
    if got.raw is None:
        return SourceError("file", str(got.error))
    raw = got.raw
    try:
        data: Any = load_yaml(raw, json_too=True) if raw.strip() else []
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        return SourceError("file", f"{path}:{line}: not valid YAML or JSON: {getattr(e, 'problem', None) or e}")
    key = "engines"
    if isinstance(data, dict) and set(data) == {"engines"}:
        data = data["engines"]
    if max_engines is not None and isinstance(data, list) and len(data) > max_engines:
        return SourceError("file", f"{path}: {len(data)} engines, over discovery.max_engines ({max_engines})")
    try:
        engines = parse_engines(data, source=path, key=key)
    except ConfigError as e:
        return SourceError("file", _with_line(str(e), raw, data))
    return Snapshot("file", tuple(engine_spec(x) for x in engines), where=path)


def _with_line(msg: str, raw: bytes, data: Any) -> str:
    """The error with the line of the entry it names (`engines[2]...`), when the file is
    YAML whose entries can be found again."""
    import re

    m = re.search(r"engines\[(\d+)\]", msg)
    if m is None or not isinstance(data, list):
        return msg
    try:
        node = yaml.compose(raw)
    except yaml.YAMLError:
        return msg
    if isinstance(node, yaml.MappingNode):
        node = next((v for k, v in node.value if getattr(k, "value", None) == "engines"), node)
    if isinstance(node, yaml.SequenceNode) and int(m.group(1)) < len(node.value):
        line = node.value[int(m.group(1))].start_mark.line + 1
        path, _, rest = msg.partition(": ")
        return f"{path}: line {line}: {rest}"
    return msg


class FleetFile:
    """The watch on one fleet file, sans event loop: the caller reads it (a WatchedFile of
    narwhal/config.py: a regular file only, off the loop, with a timeout) and `due(read)`
    says whether to parse it (True at the first check, then once a change of its stamp,
    inode, size, mtime, ctime and the bytes' hash, has stood still for one check:
    core/settle.py); `take(got)` says what to emit: a snapshot when the engines differ
    from the last emitted (or the last read failed), an error when it is not the one last
    said, else None."""

    __slots__ = ("path", "settle", "started", "digest", "last_error")

    def __init__(self, path: str) -> None:
        self.path = path
        self.settle = Settle()
        self.started = False
        self.digest: bytes | None = None
        self.last_error: str | None = None

    def due(self, read: FileRead) -> bool:
        stamp = read.stamp
        if not self.started:  # read at start at once
            self.started = True
            self.settle.stamp = stamp
            return True
        # a file rewritten in place is not read half-way: an empty list is valid, and
        # read between the truncate and the write it drained every engine it names
        return self.settle.changed(stamp)

    def take(self, got: Snapshot | SourceError) -> Snapshot | SourceError | None:
        if isinstance(got, SourceError):
            said = got.message == self.last_error
            self.last_error, self.digest = got.message, None
            return None if said else got
        h = hashlib.sha256(repr([s.as_dict() for s in got.engines]).encode()).digest()
        out = got if h != self.digest or self.last_error is not None else None
        self.digest, self.last_error = h, None
        return out


def file_source(cfg: NarwhalConfig) -> Source:
    d = cfg.discovery
    path = d.file
    assert path is not None
    interval = d.file_interval_ms / 1000.0
    max_bytes = d.max_file_bytes

    async def run(emit: Emit) -> None:
        watch = FleetFile(path)
        reader = WatchedFile(path, max_bytes, setting="discovery.max_file_bytes")
        while True:
            read = await reader.read(watch.settle.quiet if watch.started else None)
            if watch.due(read):
                got = watch.take(await asyncio.to_thread(parse_fleet_file, path, read, d.max_engines))
                if got is not None:
                    emit(got)
            await asyncio.sleep(interval)

    return run
