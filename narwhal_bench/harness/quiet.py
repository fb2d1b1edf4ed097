"""How busy the rest of the machine is: the benches share two cores with other work, and
a measurement taken while something else runs measures that too.

Rules
  * tree_pids / tree_cpu: a process and its live descendants through
    /proc/<pid>/task/*/children (bounded: 4,096 processes); CPU = utime + stime.
  * machine(): (busy CPU-seconds of every CPU: user + nice + system + irq + softirq,
    steal seconds, time.monotonic()) from /proc/stat.
  * Others(roots).cores(): every CPU's busy time over the span minus this process and the
    trees rooted at `roots`, in cores.
  * await_quiet waits (at most max_wait_s, in steps of sample_s) until the others keep
    less than `threshold` cores busy; `check` is called before each step (a bench's way to
    stop at once on SIGTERM).
  * quiet_wait is the coarser wait of the prefix bench: the whole machine's busy time
    (steal included, this process too) over `window_s`, under `threshold` cores.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .processes import cpu_seconds

__all__ = ["QUIET_CORES", "tree_pids", "tree_cpu", "machine", "Others", "await_quiet", "busy_cpu_s", "quiet_wait"]

_TICK = os.sysconf("SC_CLK_TCK")
QUIET_CORES = 0.15


def tree_pids(pid: int) -> list[int]:
    """pid and its live descendants, through /proc/<pid>/task/*/children."""
    out: list[int] = []
    todo = [pid]
    while todo and len(out) < 4096:
        p = todo.pop()
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                todo.extend(int(c) for c in Path(f"/proc/{p}/task/{t}/children").read_text().split())
            except (OSError, ValueError):
                pass
    return out


def tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of every process of the tree rooted at pid."""
    return {p: cpu_seconds(p, tree=False) for p in tree_pids(pid)}


def machine() -> tuple[float, float, float]:
    """(busy CPU-seconds of every CPU, steal seconds, now) from /proc/stat."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
    return (user + nice + system + irq + softirq) / _TICK, steal / _TICK, time.monotonic()


class Others:
    """The rest of the machine's CPU over a span: every CPU's busy time (/proc/stat) minus
    this process and the trees rooted at `roots` (routers, engines), in cores."""

    def __init__(self, roots: Sequence[int]) -> None:
        self.roots = list(roots)
        self.m0 = machine()
        self.c0 = self._ours()

    def _ours(self) -> dict[int, float]:
        out = {os.getpid(): cpu_seconds(os.getpid(), tree=False)}
        for r in self.roots:
            out.update(tree_cpu(r))
        return out

    def cores(self) -> float:
        m1, c1 = machine(), self._ours()
        ours = sum(v - self.c0.get(p, 0.0) for p, v in c1.items())
        return max(0.0, m1[0] - self.m0[0] - ours) / max(1e-9, m1[2] - self.m0[2])


def await_quiet(exclude: Sequence[int] = (), *, max_wait_s: float, sample_s: float = 1.0, threshold: float = QUIET_CORES,
                check: Callable[[], None] | None = None) -> dict[str, float]:
    """Wait (at most max_wait_s) until the rest of the machine - every CPU's busy time minus
    the processes in `exclude` (and this one) - keeps less than `threshold` cores busy over
    `sample_s`. The machine is shared with other engineers' test runs; a measurement taken
    while they run measures them too. Returns what was seen: others' cores, waited seconds."""
    t_start = time.monotonic()
    others = math.inf
    while True:
        if check is not None:
            check()
        pids = [os.getpid(), *exclude]
        c0, m0 = sum(cpu_seconds(p, tree=False) for p in pids), machine()
        time.sleep(sample_s)
        c1, m1 = sum(cpu_seconds(p, tree=False) for p in pids), machine()
        others = max(0.0, m1[0] - m0[0] - (c1 - c0)) / (m1[2] - m0[2])
        waited = time.monotonic() - t_start
        if others < threshold or waited >= max_wait_s:
            return {"others_cores": others, "waited_s": waited}


def busy_cpu_s() -> float:
    """CPU-seconds the whole machine has been busy (all cores, /proc/stat: user + nice +
    system + irq + softirq + steal)."""
    busy, steal, _ = machine()
    return busy + steal


def quiet_wait(max_s: float, *, threshold: float = 0.25, window_s: float = 5.0) -> float:
    """Wait (at most max_s) until the machine is quiet: under `threshold` cores busy over a
    window (other benchmarks share this 2-core machine). Returns the busy cores last seen."""
    end = time.monotonic() + max_s
    while True:
        b0 = busy_cpu_s()
        time.sleep(window_s)
        busy = (busy_cpu_s() - b0) / window_s
        if busy < threshold or time.monotonic() >= end:
            return busy
        print(f"    machine busy ({busy:.2f} cores used by others): waiting", flush=True)
