"""discovery.file: engines from a YAML or JSON file, watched.

The file holds a list of engines[] entries (or a mapping with the key `engines`), each
validated by the configuration's own schema and checks (narwhal/config.py
`parse_engines`). It is read at start and checked every discovery.file_interval_ms; a
change (its size, modification time or inode) is read whole once it has stood still for
one check (narwhal/core/settle.py: a file rewritten in place is not read half-way), and
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
import os
from typing import Any

import yaml

from narwhal_generated.models.config import NarwhalConfig

from ..config import ConfigError, parse_engines
from ..core.settle import Settle
from ..upstream.engines import engine_spec
from .source import Emit, Snapshot, Source, SourceError

__all__ = ["file_source", "read_fleet_file", "FleetFile"]


def read_fleet_file(path: str, max_bytes: int) -> Snapshot | SourceError:
    """One read of the file: its engines, or why not."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        return SourceError("file", f"{path}: {e.strerror or e}")
    if len(raw) > max_bytes:
        return SourceError("file", f"{path}: larger than discovery.max_file_bytes ({max_bytes})")
    try:
        data: Any = yaml.safe_load(raw) if raw.strip() else []
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        return SourceError("file", f"{path}:{line}: not valid YAML or JSON: {getattr(e, 'problem', None) or e}")
    key = "engines"
    if isinstance(data, dict) and set(data) == {"engines"}:
        data = data["engines"]
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
    """The watch on one fleet file, sans event loop: `due()` stats it (True at the first
    check, then once a change has stood still for one check: core/settle.py); the caller
    then reads it (read_fleet_file, off the loop) and `take(got)` says what to emit: a
    snapshot when the engines differ from the last emitted (or the last read failed), an
    error when it is not the one last said, else None."""

    __slots__ = ("path", "settle", "started", "digest", "last_error")

    def __init__(self, path: str) -> None:
        self.path = path
        self.settle = Settle()
        self.started = False
        self.digest: bytes | None = None
        self.last_error: str | None = None

    def due(self) -> bool:
        try:
            st = os.stat(self.path)
            stamp: tuple[Any, ...] = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
        except OSError:
            stamp = ("missing",)
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
        while True:
            if watch.due():
                got = watch.take(await asyncio.to_thread(read_fleet_file, path, max_bytes))
                if got is not None:
                    emit(got)
            await asyncio.sleep(interval)

    return run
