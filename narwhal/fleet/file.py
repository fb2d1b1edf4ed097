"""discovery.file: engines from a YAML or JSON file, watched.

The file holds a list of engines[] entries (or a mapping with the key `engines`), each
validated by the configuration's own schema and checks (narwhal/config.py
`parse_engines`). It is read at start and checked every discovery.file_interval_ms; a
change (its size, modification time, inode, or, when those agree, its bytes) is read
whole and emitted as one Snapshot: the authority applies it as one diff.

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
from ..upstream.engines import engine_spec
from .source import Emit, Snapshot, Source, SourceError

__all__ = ["file_source", "read_fleet_file"]


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


def file_source(cfg: NarwhalConfig) -> Source:
    d = cfg.discovery
    path = d.file
    assert path is not None
    interval = d.file_interval_ms / 1000.0
    max_bytes = d.max_file_bytes

    async def run(emit: Emit) -> None:
        seen: tuple[Any, ...] | None = None
        digest: bytes | None = None
        last_error: str | None = None
        while True:
            try:
                st = os.stat(path)
                stamp: tuple[Any, ...] = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
            except OSError:
                stamp = ("missing",)
            if stamp != seen:
                seen = stamp
                got = await asyncio.to_thread(read_fleet_file, path, max_bytes)
                if isinstance(got, SourceError):
                    if got.message != last_error:
                        emit(got)
                    last_error = got.message
                    digest = None
                else:
                    h = hashlib.sha256(repr([s.as_dict() for s in got.engines]).encode()).digest()
                    if h != digest or last_error is not None:
                        emit(got)
                    digest, last_error = h, None
            await asyncio.sleep(interval)

    return run
