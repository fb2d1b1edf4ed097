"""Test equipment for the conformance suite: the mock fleets of every profile on a free
port base, and one `narwhal serve` subprocess per profile configured with
`narwhal conformance print-config`'s output, exactly as a vendor sets a router up."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from narwhal_conformance.cli import add_arguments, run_suite
from narwhal_conformance.fleet import running_fleet
from narwhal_conformance.profiles import PROFILES, Profile, get_profile, router_config
from narwhal_conformance.runner import Runner

__all__ = ["Stack", "conformance_stack", "run", "free_port_base", "ADMIN_TOKEN"]

ADMIN_TOKEN = "conformance-test-token"


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


PORT_BASES = (10000, 32000)  # below Linux's ephemeral range (32768-60999 by default)


def _bases() -> tuple[int, int]:
    """This test process's range of port bases: under pytest-xdist (tox.ini runs two
    processes) worker gwI of N takes the I-th of N equal slices, so two processes never
    pick the same base."""
    lo, hi = PORT_BASES
    worker, n = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if worker.startswith("gw") and worker[2:].isdigit() and n > 1:
        i, span = int(worker[2:]) % n, (hi - lo) // n
        lo, hi = lo + i * span, lo + (i + 1) * span
    return lo, hi


def free_port_base(profiles: list[Profile]) -> int:
    """A base whose every port (fleet and routers, offsets under 50) is free now. Never
    in the ephemeral range: there every client connection of every test takes its
    source port, and one taken between this check and the fleet's bind failed a run."""
    lo, hi = _bases()
    for _ in range(200):
        base = random.randrange(lo, hi - 50, 50)
        ports = [int(p.listen(base).rsplit(":", 1)[1]) for p in profiles] + [e.port(base) for p in profiles for e in p.engines]
        if all(_free(p) for p in ports):
            return base
    raise RuntimeError("no free port base found")


@dataclass
class Stack:
    port_base: int
    targets: dict[str, str]
    logs: dict[str, Path] = field(default_factory=dict)

    def log(self, profile: str) -> str:
        p = self.logs.get(profile)
        return p.read_text()[-4000:] if p is not None and p.exists() else ""


def _wait_ready(target: str, profile: Profile, port_base: int, timeout_s: float) -> list[str]:
    """Narwhal is up: it lists the profile's engines and is at rest (its own API)."""
    r = Runner(target, profile, port_base=port_base)
    r.caps.present |= {"ready", "engines-api", "books"}
    want = {e.name for e in profile.engines}
    try:
        end = time.monotonic() + timeout_s
        problems: list[str] = ["not started"]
        while time.monotonic() < end:
            view = r.engines_view()
            problems = list(r.rest_problems().values()) if set(view) == want else [f"engines {sorted(view)}"]
            if not problems:
                return []
            time.sleep(0.1)
        return problems
    finally:
        r.close()


@contextlib.contextmanager
def conformance_stack(names: tuple[str, ...] = tuple(PROFILES), *, timeout_s: float = 60.0) -> Iterator[Stack]:
    profiles = [get_profile(n) for n in names]
    base = free_port_base(profiles)
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-conformance-"))
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "NARWHAL_ADMIN_TOKEN": ADMIN_TOKEN}
    stack = Stack(base, {})
    with running_fleet(profiles, base):
        try:
            for p in profiles:
                listen = p.listen(base)
                cfg = tmp / f"{p.name}.yaml"
                cfg.write_text(yaml.safe_dump(router_config(p, base, listen=listen), sort_keys=False))
                log = tmp / f"{p.name}.log"
                stack.logs[p.name] = log
                with log.open("wb") as fh:
                    procs.append(subprocess.Popen([sys.executable, "-m", "narwhal.cli", "serve", "--config", str(cfg), "--log-level", "warning"], stdout=fh, stderr=subprocess.STDOUT, env=env))
                stack.targets[p.name] = f"http://{listen}"
            for p in profiles:
                problems = _wait_ready(stack.targets[p.name], p, base, timeout_s)
                if problems:
                    raise RuntimeError(f"router for profile {p.name} not ready: {problems}\n{stack.log(p.name)}")
            yield stack
        finally:
            _stop(procs)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop the routers started here, by PID: terminate twice (the tests are done with them:
    the second signal stops Narwhal at once, not after serving.shutdown_delay_ms, as the
    runner's own --serve does), then kill after 10 s."""
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + 0.3
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def serving(profile: Profile, base: int, tmp: Path, configs: dict[str, tuple[str, dict[str, Any]]], *, timeout_s: float = 60.0) -> Iterator[dict[str, str]]:
    """`narwhal serve` processes on the profile's fleet (already running at `base`):
    configs name -> (listen, configuration); each written to tmp/NAME.yaml and logged to
    tmp/NAME.log; yields name -> target URL once every one is ready; stopped by PID."""
    procs: list[subprocess.Popen[bytes]] = []
    targets: dict[str, str] = {}
    env = {**os.environ, "NARWHAL_ADMIN_TOKEN": ADMIN_TOKEN}
    try:
        for name, (listen, cfg) in configs.items():
            (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
            with (tmp / f"{name}.log").open("wb") as fh:
                procs.append(subprocess.Popen([sys.executable, "-m", "narwhal.cli", "serve", "--config", str(tmp / f"{name}.yaml"), "--log-level", "warning"],
                                              stdout=fh, stderr=subprocess.STDOUT, env=env))
            targets[name] = f"http://{listen}"
        for name, t in targets.items():
            problems = _wait_ready(t, profile, base, timeout_s)
            assert not problems, f"{name}: {problems}\n{(tmp / f'{name}.log').read_text()[-3000:]}"
        yield targets
    finally:
        _stop(procs)


def run(target: str, profile: str, port_base: int, *extra: str) -> tuple[int, str]:
    """`narwhal conformance --target ...` in-process; (exit status, its output)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--target", target, "--profile", profile, "--port-base", str(port_base), "--admin-token", ADMIN_TOKEN, "--ready-timeout", "30", *extra])
    out = io.StringIO()
    code = run_suite(args, get_profile(profile), out=out)
    return code, out.getvalue()


def failing_blocks(output: str, ids: set[str] | dict[str, str]) -> str:
    """The console lines of the cases `ids` (their result line and the indented detail
    under it): a failed assertion quotes them first, so a truncated log still shows why."""
    out: list[str] = []
    keep = False
    for line in output.splitlines():
        if line[:1] not in (" ", ""):
            parts = line.split()
            keep = len(parts) >= 2 and parts[1] in ids
        if keep:
            out.append(line)
    return "\n".join(out)


def engines_summary(target: str) -> str:
    """Narwhal's view of its engines, a line each (profile, decode model and correction,
    load): a failed dogfood run quotes it, for the cases that hang on the learned state."""
    try:
        r = httpx.get(target + "/v1/engines", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5.0)
        lines = []
        for e in r.json()["data"]:
            p, dr = e["profile"], e["drift"]["decode"]
            lines.append(f"{e['name']}: eligible {e['eligible']} profile {p['status']} decode {p['decode']} "
                         f"correction {dr['correction']} (alarms {dr['alarms']}, samples {dr['samples']}) load {e['load']}")
        return "\n".join(lines)
    except Exception as x:  # a report, never a second failure
        return f"/v1/engines not read: {type(x).__name__}: {x}"


def parse_results(output: str) -> dict[str, str]:
    """case id -> verdict label, from the runner's console lines."""
    res: dict[str, Any] = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("PASS", "FAIL", "NON-STRICT", "INFO", "N/A", "EXPECTED-FAIL", "UNEXPECTED-PASS") and "/" in parts[1]:
            res[parts[1]] = parts[0]
    return res
