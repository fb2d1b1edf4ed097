"""`narwhal serve --workers N`: one admission authority process (narwhal/workers.py
`supervise`) and N data-plane worker processes on one listening socket, each started here
as the real command in a subprocess, in front of mock engines.

Which worker a connection reached is read from /proc: the router-side socket of a client
connection (its remote port is the client's local port, /proc/net/tcp) is an open file of
exactly one worker process (/proc/<pid>/fd). Every wait is bounded in time and count; the
router is stopped by its PID in a `finally`, and no worker may outlive it.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import http.client
import json
import os
import re
import signal
import socket
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
from prometheus_client.parser import text_string_to_metric_families

from narwhal.http.server import free_port
from narwhal.mock import MockConfig, RunningMock, Timing, expected_content, running_fleet
from tests.helpers import accumulate, sse, wait_until

MODEL = "narwhal-demo"
TOKEN_ENV = "NARWHAL_TEST_WORKERS_TOKEN"
TOKEN = "workers-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
START_S = 45.0  # the router's start on a loaded 2-core machine: three interpreters
STOP_S = 20.0  # SIGTERM -> exit (the supervisor's own bound is 10 s per worker, then SIGKILL)
GONE_S = 15.0  # workers gone after the supervisor


def chat(content: str = "hello", *, stream: bool = False, mock: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}
    if stream:
        b["stream"] = True
    if mock is not None:
        b["mock"] = mock
    return b


# -- processes, from /proc ------------------------------------------------------------------


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def is_worker_alive(pid: int) -> bool:
    """A running `python -m narwhal.workers` with this PID (a zombie is not alive: its
    cmdline is empty; a reused PID running something else is not ours)."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return False
    state = stat.rsplit(b")", 1)[-1].split()[0]
    if state in (b"Z", b"X"):
        return False
    cmd = _read(f"/proc/{pid}/cmdline") or b""
    return b"narwhal.workers" in cmd


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        raw = _read(f"/proc/{pid}/task/{t}/children") or b""
        out.extend(int(x) for x in raw.split())
    return sorted(set(out))


def _socket_inodes(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _accepted(port: int) -> dict[int, int]:
    """Established router-side sockets on `port`: the client's port -> the socket's inode."""
    out: dict[int, int] = {}
    for line in (_read("/proc/net/tcp") or b"").decode().splitlines()[1:]:
        f = line.split()
        if len(f) < 10 or f[3] != "01":
            continue
        if int(f[1].rsplit(":", 1)[1], 16) == port:
            out[int(f[2].rsplit(":", 1)[1], 16)] = int(f[9])
    return out


# -- the router under test ------------------------------------------------------------------


class Served:
    """`narwhal serve --workers N` in a subprocess."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.seen: set[int] = set()  # every worker PID seen, for the no-orphan check

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def workers(self) -> list[int]:
        """The live worker processes (the supervisor's children running narwhal.workers)."""
        pids = [p for p in children(self.proc.pid) if is_worker_alive(p)]
        self.seen.update(pids)
        return pids

    def serving(self) -> dict[int, int]:
        """worker index -> PID, from the authority's "worker i serving (pid P)" lines (the
        latest per index), for live workers only."""
        out: dict[int, int] = {}
        for m in re.finditer(r"worker (\d+) serving \(pid (\d+)\)", self.log_text()):
            out[int(m.group(1))] = int(m.group(2))
        self.seen.update(out.values())
        return {i: p for i, p in out.items() if is_worker_alive(p)}

    def owner(self, client_port: int) -> int | None:
        """The worker PID whose process holds the router side of the client's connection."""
        inode = _accepted(self.port).get(client_port)
        if inode is None:
            return None
        for pid in self.workers():
            if inode in _socket_inodes(pid):
                return pid
        return None

    def connections(self) -> dict[int, int]:
        """worker PID -> how many established client connections it holds."""
        inodes = set(_accepted(self.port).values())
        return {pid: len(_socket_inodes(pid) & inodes) for pid in self.workers()}

    @contextlib.contextmanager
    def pinned(self, pid: int) -> Iterator[None]:
        """Only worker `pid` accepts new connections meanwhile: the others are stopped
        (SIGSTOP, by PID) and resumed on the way out. (Left to the kernel, a run of
        one-at-a-time connections on an idle router all went to one worker.)"""
        stopped: list[int] = []
        try:
            for p in self.workers():
                if p != pid:
                    os.kill(p, signal.SIGSTOP)
                    stopped.append(p)
            yield
        finally:
            for p in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGCONT)

    def ask(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, *, on: int | None = None) -> tuple[int, dict[str, str], bytes, int | None]:
        """One request on a new TCP connection: (status, headers, body, the worker PID that
        accepted the connection and answered). `on`: that worker accepts it (`pinned`
        until it has; the others are resumed before the request is sent)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=15)
        try:
            with self.pinned(on) if on is not None else contextlib.nullcontext():
                conn.connect()
                assert conn.sock is not None
                me = conn.sock.getsockname()[1]
                owner = None
                end = time.monotonic() + 5.0
                while owner is None and time.monotonic() < end:  # accepted by then
                    owner = self.owner(me)
                    if owner is None:
                        time.sleep(0.005)
            h = {"content-type": "application/json", **(headers or {})}
            raw = body if body is None or isinstance(body, bytes) else json.dumps(body)
            conn.request(method, path, body=raw, headers=h)
            r = conn.getresponse()
            data = r.read()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, data, owner
        finally:
            conn.close()

    def start_on(self, pid: int, streams: list[Stream]) -> None:
        """Start `streams`, each on a connection of its own, all accepted by worker `pid`."""
        base = self.connections().get(pid, 0)
        with self.pinned(pid):
            for st in streams:
                st.start()
            wait_until(lambda: self.connections().get(pid, 0) >= base + len(streams), timeout=10, interval=0.01,
                       what=f"worker {pid} to accept {len(streams)} connections")

    def stop(self) -> list[int]:
        """SIGTERM by PID, bounded wait, then SIGKILL; then every worker ever seen must be
        gone (bounded): the ones left are killed by PID and returned."""
        self.workers()
        self.serving()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait(10)
        end = time.monotonic() + GONE_S
        while any(is_worker_alive(p) for p in self.seen) and time.monotonic() < end:
            time.sleep(0.05)
        left = sorted(p for p in self.seen if is_worker_alive(p))
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        return left


def _write_config(path: Path, engines: list[RunningMock], **extra: Any) -> None:
    cfg: dict[str, Any] = {
        "engines": [{"name": m.name, "url": m.url, "role": "unified", "dialect": "vllm"} for m in engines],
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
        "monitoring": {"poll_interval_ms": 200},
        "admin": {"token_env": TOKEN_ENV},
        "serving": {"shutdown_delay_ms": 0},  # stopping is tests/ops' subject, not these tests'
        **extra,
    }
    path.write_text(json.dumps(cfg))  # JSON is YAML


@contextlib.contextmanager
def served(tmp_path: Path, engines: list[RunningMock], workers: str = "2", *, expect: int | None = 2, cpus: set[int] | None = None, **config: Any) -> Iterator[Served]:
    """The router with `--workers workers`, ready (/ready 200) and, when `expect`, with
    that many workers serving (each said Up to the authority). `cpus`: the router process
    may run on these only (its affinity, set before it reads its configuration)."""
    cfg = tmp_path / "narwhal.yaml"
    _write_config(cfg, engines, **config)
    port = free_port()
    log = tmp_path / "narwhal.log"
    env = {**os.environ, TOKEN_ENV: TOKEN, "PYTHONUNBUFFERED": "1"}
    pin = f"import os; os.sched_setaffinity(0, {sorted(cpus)!r}); " if cpus else ""
    argv = [sys.executable, "-c", pin + "import sys; from narwhal.cli import main; sys.exit(main())",
            "serve", "--config", str(cfg), "--listen", f"127.0.0.1:{port}", "--workers", workers]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    r = Served(proc, port, log)
    try:
        end = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, f"narwhal serve exited with {proc.returncode}:\n{r.tail()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(r.url + "/ready", timeout=2).status_code == 200 and (expect is None or len(r.serving()) == expect):
                    break
            assert time.monotonic() < end, f"not ready in {START_S} s:\n{r.tail()}"
            time.sleep(0.05)
        yield r
    finally:
        left = r.stop()
    assert not left, f"worker processes {left} outlived the router (killed now):\n{r.tail()}"


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[RunningMock]]:
    t = Timing(prefill_base_ms=2.0, prefill_per_token_ms=0.01, prefill_quadratic_ms=0.0, tpot_base_ms=2.0, tpot_per_seq_ms=0.0)
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0", timing=t),
                        MockConfig(dialect="vllm", role="unified", name="u1", timing=t)]) as mocks:
        yield mocks


# -- reading answers -------------------------------------------------------------------------


def metrics_of(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def books_of_metrics(m: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, Any]:
    terminal = {dict(lb)["class"]: v for (n, lb), v in m.items() if n == "narwhal_requests_terminal_total"}
    return {"offered": m[("narwhal_requests_offered_total", ())], "terminal": terminal, "open": m[("narwhal_requests_open", ())]}


def ttft_workers(m: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> set[str]:
    return {dict(lb)["worker"] for (n, lb), v in m.items() if n == "narwhal_ttft_seconds_count" and v > 0}


def engines(r: Served) -> dict[str, Any]:
    got = httpx.get(r.url + "/v1/engines", timeout=10)
    assert got.status_code == 200, got.text
    return dict(got.json())


def at_rest(r: Served, timeout: float = 15.0) -> dict[str, Any]:
    """The authority's /v1/engines once the books are at rest and balanced and no slot is
    taken."""
    def ok() -> dict[str, Any] | None:
        e = engines(r)
        b = e["router"]["books"]
        loads = [x["load"] for x in e["data"]]
        if b["open"] == 0 and b["offered"] == sum(b["terminal"].values()) and all(ld["prefill_in_use"] == 0 and ld["decode_in_use"] == 0 for ld in loads):
            return e
        return None

    got: dict[str, Any] = wait_until(ok, timeout=timeout, interval=0.1, what="the books to balance at rest with every slot free")
    return got


class Stream(threading.Thread):
    """A streaming chat completion on a connection of its own, read to its end."""

    def __init__(self, url: str, body: dict[str, Any], *, read_timeout: float = 20.0) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.body = body
        self.read_timeout = read_timeout
        self.status: int | None = None
        self.content = ""
        self.chunks = 0
        self.done = False
        self.finish: str | None = None
        self.errors: list[Any] = []
        self.error: BaseException | None = None
        self.first = threading.Event()
        self.ended = threading.Event()
        self.ended_at: float | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(10.0, read=self.read_timeout)) as c, \
                    c.stream("POST", self.url + "/v1/chat/completions", json=self.body) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        self.done = True
                        continue
                    ev = orjson.loads(data)
                    if "error" in ev:
                        self.errors.append(ev["error"])
                        continue
                    for ch in ev.get("choices") or ():
                        self.content += (ch.get("delta") or {}).get("content") or ""
                        self.finish = ch.get("finish_reason") or self.finish
                    self.chunks += 1
                    self.first.set()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.ended.set()


# -- 1 ---------------------------------------------------------------------------------------


def test_both_workers_serve_and_the_books_balance(tmp_path: Path, fleet: list[RunningMock]) -> None:
    with served(tmp_path, fleet) as r:
        assert len(r.workers()) == 2, r.tail()
        h1 = [httpx.Client(timeout=20) for _ in range(8)]
        h2 = [httpx.Client(timeout=20, http1=False, http2=True) for _ in range(2)]
        clients = h1 + h2

        def one(i: int, c: httpx.Client) -> tuple[int, str]:
            n = 3 + i % 9
            want = expected_content(n)
            if i % 2 == 0:
                s = sse(r.url, chat(f"stream {i}", stream=True, mock={"tokens": n}), client=c, timeout=20)
                assert s.status == 200 and s.error is None and s.done, (i, s.status, s.error, s.body[:300])
                got = accumulate(s.chunks)
                assert (got["content"], got["finish_reason"]) == (want, "stop"), (i, got)
                assert s.headers.get("content-type", "").startswith("text/event-stream")
            else:
                resp = c.post(r.url + "/v1/chat/completions", json=chat(f"whole {i}", mock={"tokens": n}))
                assert resp.status_code == 200, (i, resp.text)
                ans = resp.json()
                assert ans["choices"][0]["message"]["content"] == want and ans["choices"][0]["finish_reason"] == "stop", (i, ans)
                assert ans["usage"]["completion_tokens"] == n, ans["usage"]
            return i, ("h2" if c in h2 else "h1")

        try:
            with cf.ThreadPoolExecutor(12) as pool:
                futs = [pool.submit(one, i, clients[i % len(clients)]) for i in range(40)]
                done = [f.result(timeout=60) for f in futs]
            assert len(done) == 40
            assert sum(1 for _, v in done if v == "h2") == 8
            # the h2 clients spoke h2 (prior knowledge), the others HTTP/1.1
            v = h2[0].get(r.url + "/ready")
            assert v.http_version == "HTTP/2" and h1[0].get(r.url + "/ready").http_version == "HTTP/1.1"
        finally:
            for c in clients:
                c.close()
        sent = 40

        # both workers served: each has its own series; when the kernel gave every
        # connection to one worker, more new connections (bounded)
        m = metrics_of(httpx.get(r.url + "/metrics", timeout=10).text)
        rounds = 0
        while ttft_workers(m) != {"0", "1"} and rounds < 8:
            rounds += 1
            with cf.ThreadPoolExecutor(8) as pool:
                more = [pool.submit(sse, r.url, chat("more", stream=True, mock={"tokens": 3}), timeout=20) for _ in range(8)]
                for f in more:
                    got = f.result(timeout=30)
                    assert got.status == 200 and got.done, (got.status, got.error)
            sent += 8
            m = metrics_of(httpx.get(r.url + "/metrics", timeout=10).text)
        assert ttft_workers(m) == {"0", "1"}, (sorted(ttft_workers(m)), r.connections())

        # the books balance, at rest, in /metrics and in /v1/engines alike
        e = at_rest(r)
        m = metrics_of(httpx.get(r.url + "/metrics", timeout=10).text)
        b = books_of_metrics(m)
        assert b["open"] == 0 and b["offered"] == sum(b["terminal"].values()) == sent, b
        assert b["terminal"]["completed"] == sent, b
        assert e["router"]["books"]["offered"] == sent and e["router"]["books"]["double_ends"] == 0, e["router"]["books"]
        # each worker's completions add up to the authority's count
        per_worker = {w: sum(v for (n, lb), v in m.items() if n == "narwhal_request_duration_seconds_count" and dict(lb).get("worker") == w) for w in ("0", "1")}
        assert sum(per_worker.values()) == sent and all(per_worker.values()), per_worker


# -- 2 ---------------------------------------------------------------------------------------


def _authority_view(e: dict[str, Any]) -> dict[str, Any]:
    """The /v1/engines answer without what changes by itself between two reads."""
    data = [{k: v for k, v in x.items() if k != "last_health_age_ms"} for x in e["data"]]
    for x in data:
        x["load"] = {k: v for k, v in x["load"].items() if k != "backlog_ms"}
        x["lifecycle"] = {k: v for k, v in x["lifecycle"].items() if k != "since_s"}
    return {"router": e["router"], "data": data}


def _from_both(r: Served, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, *, per: int = 2) -> dict[int, list[tuple[int, dict[str, str], bytes]]]:
    """The same request on `per` new connections to each worker; answers by worker PID."""
    got: dict[int, list[tuple[int, dict[str, str], bytes]]] = {}
    pids = r.workers()
    assert len(pids) == 2, pids
    for _ in range(per):
        for pid in pids:
            status, hdrs, data, owner = r.ask(method, path, body, headers, on=pid)
            assert owner == pid, (owner, pid)
            got.setdefault(pid, []).append((status, hdrs, data))
    return got


def test_every_worker_gives_the_authoritys_answers(tmp_path: Path, fleet: list[RunningMock]) -> None:
    with served(tmp_path, fleet) as r:
        # some traffic on both workers first, so the books and loads are not all zero
        got = _from_both(r, "POST", "/v1/chat/completions", chat("warm", mock={"tokens": 4}))
        assert all(s == 200 for v in got.values() for s, _, _ in v), got
        at_rest(r)

        views = _from_both(r, "GET", "/v1/engines")
        first = _authority_view(orjson.loads(next(iter(views.values()))[0][2]))
        assert first["router"]["books"]["offered"] >= 2 and first["router"]["books"]["open"] == 0
        for pid, answers in views.items():
            for status, _, data in answers:
                assert status == 200
                assert _authority_view(orjson.loads(data)) == first, pid

        ready = _from_both(r, "GET", "/ready")
        bodies = {(s, data) for v in ready.values() for s, _, data in v}
        assert len(bodies) == 1 and next(iter(bodies))[0] == 200, bodies

        mets = _from_both(r, "GET", "/metrics")
        index = {pid: str(i) for i, pid in r.serving().items()}
        seen = []
        for pid, answers in mets.items():
            for status, _, data in answers:
                assert status == 200
                m = metrics_of(data.decode())
                # the one difference: the connection this scrape came on is busy in the
                # worker that answered it
                busy = {dict(lb)["worker"]: v for (n, lb), v in m.items() if n == "narwhal_client_connections" and dict(lb).get("state") == "busy"}
                assert busy == {w: (1.0 if w == index[pid] else 0.0) for w in index.values()}, (index[pid], busy)
                seen.append({k: v for k, v in m.items() if k[0] != "narwhal_client_connections"})
        assert all(x == seen[0] for x in seen), "the merged /metrics differ between workers at rest"
        assert {dict(lb)["worker"] for (n, lb) in seen[0] if n == "narwhal_ttft_seconds_count"} == {"0", "1"}
        assert books_of_metrics(m)["offered"] == first["router"]["books"]["offered"]

        # an admin call on one worker's connection is the authority's: every worker shows it
        status, _, data, a = r.ask("POST", "/admin/engines/u0/drain", {"drain": True}, AUTH)
        assert (status, orjson.loads(data)) == (200, {"ok": True, "engine": "u0", "draining": True}), data
        try:
            views = _from_both(r, "GET", "/v1/engines")
            assert a in views
            for answers in views.values():
                for _, _, data in answers:
                    by = {x["name"]: x for x in orjson.loads(data)["data"]}
                    assert by["u0"]["draining"] is True and by["u0"]["eligible"] is False, by["u0"]
                    assert by["u1"]["draining"] is False, by["u1"]
            # a drained engine takes no new request, whichever worker admits it
            got = _from_both(r, "POST", "/v1/chat/completions", chat("drained", mock={"tokens": 3}), {"x-request-id": "drained"})
            assert all(s == 200 for v in got.values() for s, _, _ in v), got
            u0, u1 = fleet
            assert [x for x in u0.requests() if x["x_request_id"] == "drained"] == []
            assert len([x for x in u1.requests() if x["x_request_id"] == "drained"]) == 4
        finally:
            status, _, data, _ = r.ask("POST", "/admin/engines/u0/drain", {"drain": False}, AUTH)
            assert status == 200, data
        assert {x["name"]: x["draining"] for x in engines(r)["data"]} == {"u0": False, "u1": False}

        # standby, set on one worker's connection: R01 from every worker
        status, _, data, a = r.ask("POST", "/admin/state", {"state": "standby"}, AUTH)
        assert (status, orjson.loads(data)["state"]) == (200, "standby"), data
        try:
            refused = _from_both(r, "POST", "/v1/chat/completions", chat("standby", mock={"tokens": 3}))
            assert a in refused
            for answers in refused.values():
                for status, hdrs, data in answers:
                    err = orjson.loads(data)["error"]
                    assert (status, err["code"], err["type"], hdrs.get("retry-after")) == (503, "router_not_ready", "unavailable_error", "1"), (status, data)
                    assert "standby" in err["message"], err
            # the arrival is decided while the worker reads the body (remote.py): a body
            # that would be R04 (not JSON) still gets the arrival's R01, as in one process
            bad = _from_both(r, "POST", "/v1/chat/completions", b"{not json")
            for answers in bad.values():
                for status, _, data in answers:
                    assert (status, orjson.loads(data)["error"]["code"]) == (503, "router_not_ready"), (status, data)
            ready = _from_both(r, "GET", "/ready")
            for answers in ready.values():
                for status, _, data in answers:
                    assert (status, orjson.loads(data)["state"]) == (503, "standby"), data
        finally:
            status, _, data, b = r.ask("POST", "/admin/state", {"state": "active"}, AUTH)
            assert status == 200, data
        ok = _from_both(r, "POST", "/v1/chat/completions", chat("active again", mock={"tokens": 3}))
        assert all(s == 200 for v in ok.values() for s, _, _ in v), ok
        e = at_rest(r)
        books = e["router"]["books"]
        assert books["terminal"]["unavailable"] >= 2 and books["offered"] == sum(books["terminal"].values()), books


# -- 3 ---------------------------------------------------------------------------------------


def _kill_one_of_two(r: Served, body: dict[str, Any], *, ready: Any) -> tuple[int, int, list[Stream], list[Stream], dict[str, Any]]:
    """Three streams on each worker; once `ready(/v1/engines)` holds, SIGKILL worker 0.
    Returns (its index, its PID, the streams cut, the streams whole, the books before)."""
    by_index = r.serving()
    victim, other = by_index[0], by_index[1]
    on_victim = [Stream(r.url, body) for _ in range(3)]
    on_other = [Stream(r.url, body) for _ in range(3)]
    r.start_on(victim, on_victim)
    r.start_on(other, on_other)
    streams = on_victim + on_other
    try:
        wait_until(lambda: ready(engines(r)) or any(st.ended.is_set() for st in streams), timeout=15, interval=0.05, what="six requests in flight")
        assert not any(st.ended.is_set() for st in streams), [(st.status, st.error) for st in streams]
        e = engines(r)
        assert e["router"]["books"]["open"] == 6, e["router"]["books"]
        assert r.connections() == {victim: 3, other: 3}, r.connections()
        t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        # the victim's clients see their connections cut at once (not at a timeout), the
        # other worker's clients are served to the end
        for st in on_victim:
            st.join(10)
            assert st.ended.is_set(), "a client of the dead worker hangs"
            assert st.error is not None and not isinstance(st.error, httpx.TimeoutException), (st.status, st.error)
            assert st.ended_at is not None and st.ended_at - t_kill < 5.0, (st.ended_at, t_kill)
            assert not st.done
        for st in on_other:
            st.join(20)
            assert st.ended.is_set(), "a client of the living worker hangs"
    finally:
        for st in streams:
            st.join(20)
    return 0, victim, on_victim, on_other, e["router"]["books"]


def _replaced(r: Served, i: int, victim: int) -> int:
    """A new worker in place of the dead one (same index, a new PID), serving."""
    wait_until(lambda: len(r.workers()) == 2 and victim not in r.workers() and r.serving().get(i) not in (None, victim),
               timeout=20, interval=0.1, what="a new worker in place of the dead one")
    assert not is_worker_alive(victim)
    assert f"worker {i} (pid {victim}) exited" in r.log_text(), r.tail()
    fresh = r.serving()[i]
    # new requests succeed, on the new worker and on the other one
    for pid in r.workers():
        status, _, data, owner = r.ask("POST", "/v1/chat/completions", chat("after", mock={"tokens": 5}), on=pid)
        assert owner == pid and status == 200, (owner, pid, status, data)
        assert orjson.loads(data)["choices"][0]["message"]["content"] == expected_content(5), data
    s = sse(r.url, chat("after, streamed", stream=True, mock={"tokens": 5}), timeout=20)
    assert s.status == 200 and s.done and accumulate(s.chunks)["content"] == expected_content(5)
    m = metrics_of(httpx.get(r.url + "/metrics", timeout=10).text)
    assert any(n == "narwhal_request_duration_seconds_count" and dict(lb).get("worker") == str(i) and v > 0 for (n, lb), v in m.items()), \
        f"no series of the new worker {i} in /metrics"
    return fresh


def test_a_worker_that_dies_is_replaced_and_its_requests_end_failed(tmp_path: Path, fleet: list[RunningMock]) -> None:
    with served(tmp_path, fleet) as r:
        # six streams decoding (150 tokens at 20 ms: 3 s), three on each worker
        body = chat("slow", stream=True, mock={"tokens": 150, "tpot_ms": 20})
        i, victim, cut, whole, before = _kill_one_of_two(r, body, ready=lambda e: e["router"]["books"]["open"] == 6 and sum(x["load"]["decode_in_use"] for x in e["data"]) == 6)
        for st in cut:
            assert st.status == 200 and 0 < st.chunks < 150, (st.status, st.chunks)
        for st in whole:
            assert st.error is None and st.done and st.finish == "stop" and st.content == expected_content(150), (st.error, st.finish, len(st.content))

        # the books at rest: the cut requests ended as failed, every slot is free again
        e = at_rest(r)
        books = e["router"]["books"]
        assert books["terminal"]["failed"] - before["terminal"]["failed"] == len(cut) == 3, books
        assert books["terminal"]["completed"] - before["terminal"]["completed"] == len(whole) == 3, books
        for x in e["data"]:
            assert (x["load"]["prefill_in_use"], x["load"]["decode_in_use"], x["load"]["queued"]) == (0, 0, 0), x

        _replaced(r, i, victim)
        e = at_rest(r)
        assert e["router"]["books"]["terminal"]["failed"] - before["terminal"]["failed"] == 3, e["router"]["books"]


def test_a_worker_that_dies_with_requests_queued_leaves_no_trace_in_the_queue(tmp_path: Path, fleet: list[RunningMock]) -> None:
    # one prefill slot per engine and 800 ms prefills: of six requests two are in prefill
    # and four wait in the authority's admission queue when worker 0 dies
    with served(tmp_path, fleet, admission={"mode": "open", "prediction": {"profile_on_start": False}, "phase_concurrency": {"prefill": 1, "decode": 64}}) as r:
        body = chat("queued", stream=True, mock={"tokens": 3, "prefill_ms": 800})
        i, victim, cut, whole, before = _kill_one_of_two(r, body, ready=lambda e: e["router"]["scheduler"]["queued"] == 4 and sum(x["load"]["prefill_in_use"] for x in e["data"]) == 2)
        for st in whole:
            assert st.status == 200 and st.error is None and st.done and st.content == expected_content(3), (st.status, st.error, st.done)
        e = at_rest(r)
        books = e["router"]["books"]
        assert books["terminal"]["failed"] - before["terminal"]["failed"] == 3, books
        assert books["terminal"]["completed"] - before["terminal"]["completed"] == 3, books
        assert e["router"]["scheduler"]["queued"] == 0 and e["router"]["scheduler"]["decode_queued"] == 0, e["router"]["scheduler"]
        for x in e["data"]:
            assert (x["load"]["prefill_in_use"], x["load"]["decode_in_use"], x["load"]["queued"]) == (0, 0, 0), x
        _replaced(r, i, victim)
        at_rest(r)


# -- 4 ---------------------------------------------------------------------------------------


def test_the_authority_dying_stops_the_workers(tmp_path: Path, fleet: list[RunningMock]) -> None:
    with served(tmp_path, fleet) as r:
        workers = r.workers()
        assert len(workers) == 2
        # a stream in flight (600 tokens at 20 ms: 12 s) and an idle keep-alive connection
        stream = Stream(r.url, chat("long", stream=True, mock={"tokens": 600, "tpot_ms": 20}), read_timeout=30)
        stream.start()
        idle = httpx.Client(timeout=5)
        try:
            assert idle.get(r.url + "/ready").status_code == 200
            assert stream.first.wait(15), (stream.status, stream.error)
            t_kill = time.monotonic()
            r.proc.send_signal(signal.SIGKILL)
            assert r.proc.wait(10) == -signal.SIGKILL

            end = time.monotonic() + GONE_S
            while any(is_worker_alive(p) for p in workers) and time.monotonic() < end:
                time.sleep(0.05)
            alive = [p for p in workers if is_worker_alive(p)]
            assert not alive, f"workers {alive} still run {GONE_S} s after the authority died:\n{r.tail()}"
            gone_after = time.monotonic() - t_kill

            # nothing listens any more
            def refused() -> bool:
                try:
                    with socket.create_connection(("127.0.0.1", r.port), timeout=1):
                        return False
                except ConnectionRefusedError:
                    return True

            wait_until(refused, timeout=5, interval=0.05, what="the port to refuse connections")
            # the stream in flight ended without [DONE] (not at its natural end, 12 s)
            stream.join(10)
            assert stream.ended.is_set() and not stream.done and stream.chunks < 600, (stream.done, stream.chunks, stream.error)
            assert stream.ended_at is not None and stream.ended_at - t_kill < GONE_S
            assert "the authority is gone" in r.log_text(), r.tail()
            assert gone_after < GONE_S
        finally:
            idle.close()
            stream.join(20)


# -- 5 ---------------------------------------------------------------------------------------


def test_a_worker_count_of_auto_uses_the_cores(tmp_path: Path, fleet: list[RunningMock]) -> None:
    mine = sorted(os.sched_getaffinity(0))
    # the cores this process may use (the subprocess inherits them), then one core only
    for cpus in ([*mine], mine[:1]):
        n = len(cpus)
        d = tmp_path / f"cpus-{n}"
        d.mkdir()
        with served(d, fleet, "auto", expect=n if n > 1 else None, cpus=set(cpus)) as r:
            workers = r.workers()
            assert os.sched_getaffinity(r.proc.pid) == set(cpus)
            if n == 1:  # one core: the router is one process, no workers
                assert workers == [] and children(r.proc.pid) == [], (workers, r.tail())
                assert "workers (engines" not in r.log_text() and "narwhal serving" in r.log_text(), r.tail()
            else:
                assert len(workers) == n, (workers, r.tail())
                assert sorted(r.serving()) == list(range(n)), r.tail()
                assert f"with {n} workers" in r.log_text(), r.tail()
            resp = httpx.post(r.url + "/v1/chat/completions", json=chat("auto", mock={"tokens": 3}), timeout=20)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"]["content"] == expected_content(3), resp.text


# -- a fleet that changes (spec/tables/lifecycle.yaml) and a reload, seen by every worker -----


def test_engines_added_and_removed_through_any_worker_reach_every_worker(tmp_path: Path, fleet: list[RunningMock]) -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}
    u0, u1 = fleet
    with served(tmp_path, [u0]) as r:
        # through whichever worker takes the call: the authority owns membership
        p = httpx.put(f"{r.url}/admin/engines/u1", json={"url": u1.url, "role": "unified"}, headers=auth, timeout=10)
        assert p.status_code == 200 and p.json()["change"] == "added", p.text
        def by_name() -> dict[str, Any]:
            return {e["name"]: e for e in engines(r)["data"]}

        wait_until(lambda: by_name()["u1"]["lifecycle"]["state"] == "active", timeout=15, what="u1 active")
        assert httpx.delete(f"{r.url}/admin/engines/u0", headers=auth, timeout=10).json()["lifecycle"] in ("draining", "gone")
        wait_until(lambda: "u0" not in by_name(), timeout=15, what="u0 gone")
        u1.clear_requests()
        got = _from_both(r, "POST", "/v1/chat/completions", chat("after", mock={"tokens": 4}))
        assert {pid: [s for s, _, _ in v] for pid, v in got.items()} == {pid: [200, 200] for pid in got}, got
        assert len(u1.requests()) == 4  # every worker placed on the engine it was told of
        books = at_rest(r)["router"]["books"]
        assert books["terminal"]["completed"] == books["offered"]


def test_a_worker_started_once_the_stop_has_begun_is_cut_and_not_restarted() -> None:
    """A restart that the stop overtakes (the worker died just before the first signal, and
    its replacement is made while stop() runs) must not leave a worker accepting on the
    shared socket after the others stopped: it is cut at once, and not restarted."""
    import asyncio

    from narwhal.authority.control import ControlPlane
    from narwhal.authority.service import LocalControls
    from narwhal.config import parse_config
    from narwhal.upstream.engines import config_engines
    from narwhal.workers import Supervisor, listening_socket

    async def main() -> tuple[int | None, int, int]:
        cfg = parse_config({"engines": [{"name": "e0", "url": "http://127.0.0.1:9"}], "serving": {"workers": 2}})
        engines = config_engines(cfg)
        sock = listening_socket(f"127.0.0.1:{free_port()}")
        control = ControlPlane(cfg, engines)
        sup = Supervisor(cfg, engines, sock, 2, LocalControls(control))
        try:
            sup.stopping = True  # stop() has begun
            await sup.start_worker(0)
            proc = sup.procs[0]
            await asyncio.wait_for(proc.wait(), 20)
            await asyncio.sleep(1.0)  # past RESTART_BACKOFF_S: a restart would have begun
            return proc.returncode, len(sup._watchers), len(sup.procs)
        finally:
            await sup.stop()
            sock.close()

    code, watchers, procs = asyncio.run(main())
    assert code is not None and code != 0, code  # cut (SIGUSR2, or its handler's exit), not left running
    assert (watchers, procs) == (1, 1)  # and never restarted
