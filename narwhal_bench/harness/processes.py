"""Processes the benchmarks start: mock engines, routers, peers. Each one runs in its own
session (process group), pinned to given CPUs, logs to a file, and is stopped by its own
pid/process group only (SIGTERM, then SIGKILL after a bounded wait).

CPU time and memory are read from /proc (no psutil): utime + stime of the process and
every descendant (peers such as LiteLLM run worker processes), in seconds; RSS in bytes.

Core layout on the 2-core machine (`layout()`): the router under test gets CPU 0 alone;
the load tool and the mock engines share CPU 1. With one core (or NARWHAL_BENCH_NOPIN=1)
nothing is pinned.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["run_bench", "Proc", "cpu_seconds", "rss_bytes", "descendants", "layout", "pin_self", "free_port", "wait_http", "log_dir", "raise_nofile"]

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def log_dir() -> Path:
    d = Path(os.environ.get("NARWHAL_BENCH_LOGS") or (Path(tempfile.gettempdir()) / "narwhal-bench"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def layout() -> tuple[set[int] | None, set[int] | None]:
    """(router CPUs, load-tool-and-mocks CPUs), or (None, None) when not pinning."""
    if os.environ.get("NARWHAL_BENCH_NOPIN") == "1":
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return {cpus[0]}, set(cpus[1:])


def raise_nofile() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (a process may; raising
    the hard limit needs CAP_SYS_RESOURCE); (soft, hard) after. Every Proc child does the
    same before it starts, so a router or engine holding many connections gets the most
    descriptors the machine grants."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:  # soft is never above hard
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def pin_self(cpus: set[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


def command_line(module: str) -> str:
    """How this experiment was started, as a reader would type it again: `narwhal bench
    ...` when run through the command, else `python -m MODULE ...`."""
    if sys.argv and Path(sys.argv[0]).name == "narwhal":
        return " ".join(["narwhal", *sys.argv[1:]])
    return " ".join([f"python -m {module}", *sys.argv[1:]])


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name is in parentheses and may hold spaces
    return raw[raw.rfind(")") + 2:].split()


def descendants(pid: int) -> list[int]:
    """pid and every live descendant."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        st = _stat(int(d))
        if st is None:
            continue
        children.setdefault(int(st[1]), []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def cpu_seconds(pid: int, *, tree: bool = True) -> float:
    """User + system CPU seconds of pid (all threads), plus its descendants when tree."""
    total = 0
    for p in descendants(pid) if tree else [pid]:
        st = _stat(p)
        if st is not None:
            total += int(st[11]) + int(st[12])  # utime, stime (fields 14, 15)
    return total / _TICK


def rss_bytes(pid: int, *, tree: bool = True) -> int:
    total = 0
    for p in descendants(pid) if tree else [pid]:
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            pass
    return total


def wait_http(url: str, *, timeout_s: float = 30.0, ok: Sequence[int] = (200,), headers: dict[str, str] | None = None, proc: Proc | None = None) -> int:
    """Poll GET url until its status is in ok; raise after timeout_s (or when proc died)."""
    import httpx

    end = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.poll()} before it was ready; log: {proc.log_path}\n{proc.tail()}")
        try:
            r = httpx.get(url, timeout=2.0, headers=headers, trust_env=False)
            if r.status_code in ok:
                return r.status_code
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}"
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout_s:g} s ({last})" + (f"; log: {proc.log_path}\n{proc.tail()}" if proc else ""))


class Proc:
    """A child process in its own session, stopped through its own process group."""

    def __init__(self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None, cpus: set[int] | None = None, cwd: str | Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = {**os.environ, **(env or {})}
        self.cpus = cpus
        self.cwd = cwd
        self.log_path = log_dir() / f"{name}.log"
        self.p: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        cpus = self.cpus
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child

        def pre() -> None:
            raise_nofile()
            if cpus:
                os.sched_setaffinity(0, cpus)

        self.p = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd, preexec_fn=pre, start_new_session=True)
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.p is not None
        return self.p.pid

    def poll(self) -> int | None:
        return None if self.p is None else self.p.poll()

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 8.0) -> None:
        if self.p is None or self.p.poll() is not None:
            return
        pgid = self.p.pid  # start_new_session: the child leads its own process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.p.wait(5)
        # descendants that left the group (rare) are left alone: we only end our own group


@contextlib.contextmanager
def running(procs: Sequence[Proc]) -> Iterator[Sequence[Proc]]:
    """Start procs (in order) and stop them all (in reverse) on exit."""
    started: list[Proc] = []
    try:
        for p in procs:
            started.append(p.start())
        yield procs
    finally:
        for p in reversed(started):
            p.stop()


def python() -> str:
    return sys.executable


def run_bench(name: str, work: Callable[[], Any]) -> tuple[int, Any]:
    """Run a whole bench: SIGTERM (on the main thread) unwinds it like ^C (every process it started is stopped
    by its own cleanup); (0, work's result), or (130, None) when interrupted, or (1, None)
    with the reason printed when it could not run."""

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    import threading

    main = threading.current_thread() is threading.main_thread()  # signal handlers: the main thread's only
    previous = signal.signal(signal.SIGTERM, on_term) if main else None
    try:
        return 0, work()
    except KeyboardInterrupt:
        print(f"narwhal bench {name}: interrupted", file=sys.stderr)
        return 130, None
    except (RuntimeError, TimeoutError, OSError, ValueError) as e:
        print(f"narwhal bench {name}: {e}", file=sys.stderr)
        return 1, None
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
