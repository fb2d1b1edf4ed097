"""Profiles of a running router with py-spy (sampling, from outside the process), reduced to
"file:function and share" tables.

Rules
  * `py-spy record --format raw --function --nonblocking` samples on-CPU Python stacks
    (idle threads are left out by default), so a share is a share of the router's CPU
    time as Python sees it.
  * self share: the innermost frame of each sample; inclusive share: every distinct
    function on the stack. Frames are named `path-tail:function` (the last two path parts).
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["pyspy_record", "reduce_raw", "available"]


def available() -> str | None:
    return shutil.which("py-spy")


def pyspy_record(pid: int, seconds: float, out: Path, *, rate: int = 250, subprocesses: bool = False) -> subprocess.Popen[bytes]:
    """Start py-spy on pid for `seconds`; the caller waits on the returned process."""
    exe = available()
    if exe is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy)")
    argv = [exe, "record", "--format", "raw", "--function", "--nonblocking", "--rate", str(rate), "-d", str(int(max(1, seconds))), "-p", str(pid), "-o", str(out)]
    if subprocesses:
        argv.append("--subprocesses")
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _name(frame: str) -> str:
    # "function (path/to/file.py)" or "function (path/to/file.py:123)"
    fn, _, rest = frame.rpartition(" (")
    path = rest.rstrip(")").rsplit(":", 1)[0] if rest else ""
    parts = Path(path).parts
    tail = "/".join(parts[-2:]) if parts else path
    return f"{tail}:{fn or frame}"


def _ours(frame: str) -> bool:
    path = frame.rpartition(" (")[2]
    # the harness is narwhal_bench/, outside narwhal/, so its own frames never match
    return path.startswith("narwhal/") or "/narwhal/" in path


def reduce_raw(path: Path, top: int = 15) -> dict[str, Any]:
    """{samples, self, inclusive, inclusive_narwhal: [(name, share)]} from py-spy raw output
    (inclusive_narwhal: only frames of Narwhal's own modules)."""
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    incl_nw: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        raw = [f for f in stack.split(";") if f]
        frames = [_name(f) for f in raw]
        if not frames:
            continue
        total += n
        self_c[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
        for f in {_name(f) for f in raw if _ours(f)}:
            incl_nw[f] += n
    def share(c: Counter[str]) -> list[tuple[str, float]]:
        return [(k, v / total) for k, v in c.most_common(top)] if total else []

    return {"samples": total, "self": share(self_c), "inclusive": share(incl), "inclusive_narwhal": share(incl_nw)}
