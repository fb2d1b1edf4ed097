"""What a fleet change and a scrape cost at N engines (issue 40 item 4), measured on a real
`narwhal serve` over HTTP (docs/operations.md publishes the numbers at 1,000 engines).

    python scripts/fleet_cost.py [--engines 1000] [--rounds 30]

Starts one mock engine and a router whose discovery.file names N engines (all the same
mock, distinct names; health polls every 10 s), then measures, each while a probe asks
GET /health every 5 ms (the probe's worst wait is how long the event loop was held):
  * PUT /admin/engines/{name} of a new engine, and its DELETE (drain_timeout_ms 0);
  * a discovery.file change (one engine's URL changed): until /v1/engines shows it;
  * GET /metrics: its time and size.
Bounded: every wait has a timeout; both processes are stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

TOKEN = "fleet-cost-token"
ADM = {"authorization": f"Bearer {TOKEN}"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(httpx.HTTPError):
            got = pred()
            if got:
                return got
        time.sleep(0.02)
    raise SystemExit(f"timed out waiting for {what}")


@contextlib.contextmanager
def process(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as fh:
        p = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})})
    try:
        yield p
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


class Probe:
    """GET /health every 5 ms in a thread; `worst()` since `reset()`."""

    def __init__(self, url: str) -> None:
        self.url, self.times, self.stop = url, [0.0], threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                with contextlib.suppress(httpx.HTTPError):
                    c.get(self.url + "/health")
                self.times.append(time.perf_counter() - t0)
                time.sleep(0.005)

    def reset(self) -> None:
        self.times = [0.0]

    def worst(self) -> float:
        return max(self.times) * 1000


def fleet(n: int, url: str, moved: int | None = None) -> str:
    return json.dumps([{"name": f"e{i}", "url": url + ("/moved" if i == moved else ""), "role": "unified", "dialect": "vllm"} for i in range(n)])


def ms(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"median {statistics.median(xs):.1f} ms, p90 {xs[int(0.9 * (len(xs) - 1))]:.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    n = args.engines
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-fleet-cost-"))
    mport, rport = free_port(), free_port()
    murl, rurl = f"http://127.0.0.1:{mport}", f"http://127.0.0.1:{rport}"
    ff = tmp / "fleet.json"
    ff.write_text(fleet(n, murl))
    cfg = {"serving": {"listen": f"127.0.0.1:{rport}", "shutdown_delay_ms": 0, "shutdown_grace_ms": 1000},
           "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
           "monitoring": {"poll_interval_ms": 10000, "stale_after_ms": 600000},
           "discovery": {"file": str(ff), "file_interval_ms": 100, "drain_timeout_ms": 0}}
    if n + 10 > 1024:  # discovery.max_engines: its default, 1,024, is below
        cfg["discovery"]["max_engines"] = n + 10
    (tmp / "narwhal.json").write_text(json.dumps(cfg))
    py = sys.executable
    with process([py, "-m", "narwhal.cli", "mock-engine", "--dialect", "vllm", "--role", "unified", "--port", str(mport), "--model", "narwhal-demo"], tmp / "mock.log"), \
         process([py, "-m", "narwhal.cli", "serve", "--config", str(tmp / "narwhal.json")], tmp / "router.log", {"NARWHAL_ADMIN_TOKEN": TOKEN}):
        wait(lambda: len(httpx.get(rurl + "/v1/engines", timeout=30).json()["data"]) == n, 120, f"{n} engines")
        probe = Probe(rurl)
        time.sleep(1.0)
        probe.reset()
        time.sleep(12.0)  # at rest: one health-poll round of the whole fleet included
        worst_idle = probe.worst()
        entry = {"url": murl, "role": "unified", "dialect": "vllm"}
        puts, dels, worst_put = [], [], 0.0
        with httpx.Client(timeout=30, headers=ADM) as c:
            for i in range(args.rounds):
                probe.reset()
                t0 = time.perf_counter()
                assert c.put(f"{rurl}/admin/engines/x{i}", json=entry).status_code == 200
                puts.append((time.perf_counter() - t0) * 1000)
                t0 = time.perf_counter()
                assert c.delete(f"{rurl}/admin/engines/x{i}").status_code == 200
                dels.append((time.perf_counter() - t0) * 1000)
                worst_put = max(worst_put, probe.worst())
            scrapes, sizes, worst_scrape = [], [], 0.0
            for _ in range(min(args.rounds, 10)):
                probe.reset()
                t0 = time.perf_counter()
                r = c.get(rurl + "/metrics")
                scrapes.append((time.perf_counter() - t0) * 1000)
                sizes.append(len(r.content))
                time.sleep(0.05)
                worst_scrape = max(worst_scrape, probe.worst())
            files, worst_file = [], 0.0
            for k in range(min(args.rounds, 5)):
                probe.reset()
                ff.write_text(fleet(n, murl, moved=k))
                t0 = time.perf_counter()
                # the router's own line (a read of /v1/engines would cost what it measures)
                line = f"fleet from file: replaced e{k}"
                wait(lambda: line in (tmp / "router.log").read_text(), 30, "the file change")  # noqa: B023 - waited for here
                files.append((time.perf_counter() - t0) * 1000)
                worst_file = max(worst_file, probe.worst())
                ff.write_text(fleet(n, murl))
                time.sleep(1.0)
        probe.stop.set()
    print(f"engines: {n}; at rest (12 s, a health-poll round included) the /health probe's worst wait {worst_idle:.1f} ms")
    print(f"PUT (new engine): {ms(puts)}; DELETE: {ms(dels)}; /health probe's worst wait meanwhile {worst_put:.1f} ms")
    print(f"GET /metrics: {ms(scrapes)}, {statistics.median(sizes) / 1024:.0f} KiB; probe's worst wait meanwhile {worst_scrape:.1f} ms")
    print(f"discovery.file change (1 engine): applied after {ms(files)} (the router's log line; two 100 ms checks to settle); probe's worst wait {worst_file:.1f} ms")


if __name__ == "__main__":
    main()
