"""`narwhal serve` stops gracefully on SIGTERM (router state S06; narwhal/http/server.py
`Stopping`, narwhal/compose.py `serve`, narwhal/workers.py "Stopping"):

  * /ready 503 draining at once, new completion requests R01 with Retry-After, while the
    listener stays open serving.shutdown_delay_ms;
  * streams running finish whole within serving.shutdown_grace_ms; those still running
    when it runs out end (class cancelled: the books balance), and the process exits 0;
  * a second signal stops at once;
  * with serving.workers 2 the same (the authority takes the signal);
  * an ha leader resigns at once: the standby leads long before the lease TTL.

The routers run as the real command in subprocesses (one in process, for the books), in
front of a mock engine on loopback free ports. Every wait is bounded; every process is
stopped by its PID in a `finally`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from narwhal.http.server import free_port
from narwhal.mock import MockConfig, expected_content, running_fleet
from tests.helpers import accumulate, wait_until

MODEL = "narwhal-demo"
START_S = 45.0  # a router's start on a loaded 2-core machine (workers: three interpreters)
TPOT_MS = 40


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    with running_fleet([MockConfig(dialect="vllm", role="unified", model=MODEL, name="u0")]) as fleet:
        yield fleet[0].url


def _config(engine_url: str, port: int, *, delay_ms: int, grace_ms: int, workers: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "serving": {"model": MODEL, "listen": f"127.0.0.1:{port}", "workers": workers, "shutdown_delay_ms": delay_ms, "shutdown_grace_ms": grace_ms},
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
        "monitoring": {"poll_interval_ms": 200},
        "engines": [{"name": "u0", "url": engine_url, "role": "unified", "dialect": "vllm"}],
        **extra,
    }


def _chat(tokens: int, *, stream: bool = True) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "tell me"}], "stream": stream, "mock": {"tokens": tokens, "tpot_ms": TPOT_MS}}


class Served:
    """`narwhal serve --config FILE` in a subprocess (a session of its own), its output in
    a log file."""

    def __init__(self, tmp: Path, cfg: dict[str, Any], name: str = "router") -> None:
        self.port = int(cfg["serving"]["listen"].rsplit(":", 1)[1])
        self.url = f"http://127.0.0.1:{self.port}"
        path = tmp / f"{name}.yaml"
        path.write_text(json.dumps(cfg))  # JSON is YAML
        self.log = tmp / f"{name}.log"
        with self.log.open("wb") as fh:
            # a session of its own: a test may signal its whole process group, as systemd
            # (KillMode=control-group) or a terminal's Ctrl-C does
            self.proc = subprocess.Popen([sys.executable, "-m", "narwhal.cli", "serve", "--config", str(path), "--log-level", "info"],
                                         stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""

    def ready(self) -> tuple[int, dict[str, Any]] | None:
        try:
            r = httpx.get(self.url + "/ready", timeout=1.0)
            return r.status_code, r.json()
        except httpx.HTTPError:
            return None

    def wait_ready(self) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, f"narwhal serve exited {self.proc.returncode}:\n{self.tail()}"
            got = self.ready()
            return got is not None and got[0] == 200

        wait_until(up, timeout=START_S, interval=0.05, what=f"the router on {self.url} to be ready")

    def books(self) -> dict[str, Any]:
        """The books the router logged as it stopped (compose.serve / workers.supervise)."""
        text = self.log.read_text(errors="replace")
        assert "Traceback" not in text, text
        line = [ln for ln in text.splitlines() if "narwhal stopped; the books: " in ln]
        assert line, self.tail()
        books: dict[str, Any] = json.loads(line[-1].split("the books: ", 1)[1])
        assert books["offered"] == sum(books["terminal"].values()) and books["open"] == 0 and books["double_ends"] == 0, books
        return books

    def children(self) -> list[int]:
        out: list[int] = []
        with contextlib.suppress(OSError):
            for t in os.listdir(f"/proc/{self.proc.pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{self.proc.pid}/task/{t}/children") as f:
                    out.extend(int(x) for x in f.read().split())
        return out

    def stop(self) -> None:
        """By PID: SIGKILL (the tests signal it gracefully themselves), then its children."""
        kids = self.children()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def served(tmp: Path, cfg: dict[str, Any], name: str = "router") -> Iterator[Served]:
    s = Served(tmp, cfg, name)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


class Stream:
    """One streaming completion read in a thread: its events, [DONE], how it ended."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.url = url
        self.body = body
        self.status: int | None = None
        self.chunks: list[dict[str, Any]] = []
        self.errors: list[Any] = []
        self.done = False
        self.error: Exception | None = None
        self.first = threading.Event()
        self.ended = threading.Event()
        self.ended_at: float | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Stream:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(30.0, connect=5.0)) as c, c.stream("POST", self.url + "/v1/chat/completions", json=self.body) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        self.done = True
                        continue
                    ev = orjson.loads(data)
                    (self.errors if "error" in ev else self.chunks).append(ev)
                    self.first.set()
        except Exception as e:  # noqa: BLE001 - how it ended is the result
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.first.set()
            self.ended.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "a stream did not end"

    @property
    def content(self) -> str:
        return accumulate(self.chunks).get("content", "")


def _streams(url: str, n: int, tokens: int) -> list[Stream]:
    out = [Stream(url, _chat(tokens)).start() for _ in range(n)]
    for s in out:
        assert s.first.wait(15) and s.status == 200, (s.status, s.error)
    return out


def _until_draining(s: Served, t0: float) -> float:
    """Seconds from t0 until /ready says draining (bounded)."""
    got = wait_until(lambda: (r := s.ready()) is not None and r[0] == 503 and r, timeout=2.0, interval=0.01, what="/ready 503")
    assert got[1]["state"] == "draining" and got[1]["reason"] == "draining" and got[1]["ready"] is False, got
    return time.monotonic() - t0


def _refused_r01(url: str) -> None:
    r = httpx.post(url + "/v1/chat/completions", json=_chat(4, stream=False), timeout=5)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "router_not_ready" and "draining" in r.json()["error"]["message"], r.text
    assert r.headers.get("retry-after") == "1", r.headers


def _exits(s: Served, timeout: float) -> tuple[int, float]:
    try:
        code = s.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the router still runs {timeout} s after the signal:\n{s.tail()}") from None
    return code, time.monotonic()


# -- the stop, one process and two workers -----------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_drains_then_the_running_streams_finish_whole(tmp_path: Path, engine: str, workers: int) -> None:
    delay_s, tokens = 1.5, 60  # answers of 60 tokens at 40 ms: ~2.4 s, well inside the grace
    with served(tmp_path, _config(engine, free_port(), delay_ms=int(delay_s * 1000), grace_ms=8000, workers=workers)) as s:
        kids = s.children()
        assert len(kids) == (workers if workers > 1 else 0), kids
        streams = _streams(s.url, 3, tokens)
        t0 = time.monotonic()
        if workers > 1:  # the whole group, workers included: they leave the stop to the authority
            os.killpg(s.proc.pid, signal.SIGTERM)
        else:
            s.proc.send_signal(signal.SIGTERM)
        took = _until_draining(s, t0)
        print(f"\nworkers {workers}: /ready 503 draining {took * 1000:.0f} ms after SIGTERM")
        _refused_r01(s.url)  # the listener is still open: a new request gets R01 (fresh connection)
        assert time.monotonic() - t0 < delay_s, "the checks above took longer than the delay"
        for st in streams:
            st.join(15)
            assert st.error is None and st.done and not st.errors, (st.error, st.done, st.errors)
            assert st.content == expected_content(tokens)
        code, t_exit = _exits(s, 15)
        assert code == 0, s.tail()
        assert t_exit - t0 >= delay_s * 0.9, "the listener closed before serving.shutdown_delay_ms"
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.url + "/ready", timeout=1)
        wait_until(lambda: not any(os.path.exists(f"/proc/{p}/cmdline") and b"narwhal.workers" in Path(f"/proc/{p}/cmdline").read_bytes() for p in kids),
                   timeout=5, what="the workers to be gone")
        books = s.books()
        assert books["offered"] == 4 and books["terminal"]["completed"] == 3 and books["terminal"]["unavailable"] == 1, books


@pytest.mark.parametrize("workers", [1, 2])
def test_a_grace_shorter_than_the_answers_cuts_them_and_exits_0(tmp_path: Path, engine: str, workers: int) -> None:
    grace_s = 1.5
    with served(tmp_path, _config(engine, free_port(), delay_ms=300, grace_ms=int(grace_s * 1000), workers=workers)) as s:
        streams = _streams(s.url, 3, 250)  # 10 s answers
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        for st in streams:
            st.join(grace_s + 8)
            assert not st.done and len(st.chunks) < 250, (st.done, len(st.chunks))
            assert st.ended_at is not None and st.ended_at - t0 < grace_s + 3, st.ended_at - t0
        code, t_exit = _exits(s, 10)
        assert code == 0, s.tail()
        print(f"\nexit {t_exit - t0:.2f} s after SIGTERM (grace {grace_s} s)")
        assert t_exit - t0 < grace_s + 4
        books = s.books()
        assert books["offered"] == 3 and books["terminal"]["cancelled"] == 3, books


@pytest.mark.parametrize(("workers", "phase"), [(1, "delay"), (1, "grace"), (2, "delay"), (2, "grace")])
def test_a_second_signal_stops_at_once(tmp_path: Path, engine: str, workers: int, phase: str) -> None:
    delay_ms = 5000 if phase == "delay" else 200
    with served(tmp_path, _config(engine, free_port(), delay_ms=delay_ms, grace_ms=20000, workers=workers)) as s:
        kids = s.children()
        streams = _streams(s.url, 2, 250)
        s.proc.send_signal(signal.SIGTERM)
        _until_draining(s, time.monotonic())
        if phase == "grace":  # once the listener has closed: the requests are in their grace
            wait_until(lambda: s.ready() is None, timeout=3, interval=0.01, what="the listener to close")
            assert s.proc.poll() is None and not any(st.ended.is_set() for st in streams)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGINT)  # a second signal, of either kind
        code, t_exit = _exits(s, 8)
        print(f"\nworkers {workers}, in the {phase}: exit {t_exit - t0:.2f} s after the second signal")
        assert code == 0, s.tail()
        assert t_exit - t0 < 4.0, s.tail()
        for st in streams:
            st.join(10)
            assert not st.done, "a stream ran to its end although the router stopped at once"
        books = s.books()
        assert books["offered"] == 2 and books["terminal"]["cancelled"] == 2, books
        wait_until(lambda: not any(os.path.exists(f"/proc/{p}/cmdline") and b"narwhal.workers" in Path(f"/proc/{p}/cmdline").read_bytes() for p in kids),
                   timeout=5, what="the workers to be gone")


# -- the books, in process ---------------------------------------------------------------------


def test_requests_cut_at_the_grace_end_cancelled_and_the_books_balance(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """compose.serve in this process (its Router's books readable): one short stream
    finishes within the grace, three long ones are cut at its end in the class
    `cancelled`, one request during the delay is refused R01; offered == sum of classes."""
    from narwhal.compose import Router, serve
    from narwhal.config import parse_config
    from narwhal.http.server import Stopping

    monkeypatch.setenv("NARWHAL_GC_FREEZE", "0")  # no gc.freeze of the test process
    port = free_port()
    cfg = parse_config(_config(engine, port, delay_ms=400, grace_ms=1500), source="test")
    url = f"http://127.0.0.1:{port}"
    loop = asyncio.new_event_loop()
    routers: list[Router] = []
    up = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        box["stopping"] = st = Stopping.of(cfg)
        await serve(cfg, stopping=st, built=routers.append, ready=lambda _u: up.set())

    def run() -> None:
        try:
            loop.run_until_complete(main())
        except BaseException as e:  # noqa: BLE001 - shown by the test
            box["error"] = e
        finally:
            up.set()

    th = threading.Thread(target=run, daemon=True, name="narwhal-serve")
    th.start()
    try:
        assert up.wait(30) and "error" not in box, box.get("error")
        wait_until(lambda: httpx.get(url + "/ready", timeout=1).status_code == 200, timeout=15, what="/ready 200")
        long = _streams(url, 3, 250)
        short = _streams(url, 1, 20)  # ~0.8 s: ends inside the grace
        loop.call_soon_threadsafe(box["stopping"].signal)
        wait_until(lambda: httpx.get(url + "/ready", timeout=1).status_code == 503, timeout=2, interval=0.01, what="/ready 503")
        _refused_r01(url)
        th.join(15)
        assert not th.is_alive(), "serve did not return"
        assert "error" not in box, box["error"]
        for st in long:
            st.join(5)
            assert not st.done
        short[0].join(5)
        assert short[0].done and short[0].content == expected_content(20)
        books = routers[0].control.books
        snap = books.snapshot()
        print(f"\nbooks: {snap}")
        assert books.offered == 5 and books.terminal["cancelled"] == 3 and books.terminal["completed"] == 1
        assert books.terminal["unavailable"] == 1  # R01 during the delay
        assert books.balanced() and books.double_ends == 0, snap
    finally:
        if th.is_alive():
            loop.call_soon_threadsafe(box["stopping"].signal)
            loop.call_soon_threadsafe(box["stopping"].signal)
            th.join(10)
        if not loop.is_running():
            loop.close()


# -- ha: the leader resigns --------------------------------------------------------------------


def test_an_ha_leader_resigns_at_sigterm_and_the_standby_leads_before_the_ttl(tmp_path: Path, engine: str) -> None:
    from tests.ha.etcd import etcd_server

    ttl_ms, renew_ms = 5000, 500
    ha = {"key": "/narwhal-test/shutdown", "lease_ttl_ms": ttl_ms, "renew_interval_ms": renew_ms, "fence_margin_ms": 400, "request_timeout_ms": 500}
    with etcd_server() as etcd:
        rs = [Served(tmp_path, _config(engine, free_port(), delay_ms=1000, grace_ms=3000, ha={"etcd": [etcd.url], "name": f"r{i}", **ha}), f"r{i}") for i in range(2)]
        try:
            def one_leader() -> list[Served]:
                for r in rs:
                    assert r.proc.poll() is None, r.tail()
                lead = [r for r in rs if (g := r.ready()) is not None and g[0] == 200]
                others = [r for r in rs if (g := r.ready()) is not None and g[0] == 503 and g[1]["state"] == "standby"]
                return lead if len(lead) == 1 and len(others) == 1 else []

            (leader,) = wait_until(one_leader, timeout=START_S, interval=0.05, what="one leader and one standby")
            (standby,) = [r for r in rs if r is not leader]
            t0 = time.monotonic()
            leader.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: (g := standby.ready()) is not None and g[0] == 200, timeout=ttl_ms / 1000.0 + 5, interval=0.01, what="the standby to lead")
            took = time.monotonic() - t0
            print(f"\nthe standby leads {took * 1000:.0f} ms after the leader's SIGTERM (lease TTL {ttl_ms} ms)")
            # the lease, renewed every renew_ms, could not have expired before TTL - renew_ms
            assert took < (ttl_ms - renew_ms) / 1000.0 and took < 2.5, took
            got = leader.ready()  # still within its delay: open, draining
            assert got is not None and got[0] == 503 and got[1]["state"] == "draining", got
            code, _ = _exits(leader, 10)
            assert code == 0, leader.tail()
            leader.books()  # logged as it stopped, no traceback
        finally:
            for r in rs:
                r.stop()
