"""`narwhal bench abuse`: the attacks of tests/abuse against a live router, each for a
bounded time alongside normal traffic, with the router's serving defaults.

Per attack it reports what the normal clients saw (share served, TTFT and end-to-end
p99 against the quiet baseline), the router's peak RSS over its quiet RSS, its open file
descriptors during and after, and whether the books balance and nothing is held once the
attack stops. Targets (issue 11): served >= 99%, p99 <= 2x quiet, RSS <= +64 MiB, books
balanced, nothing held at rest.

Every attacker runs in a thread of its own on loopback and stops when told; every loop is
bounded in time and count.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import h2.config
import h2.connection
import h2.errors
import h2.exceptions
import h2.settings
import httpx
import orjson

from .harness import mock_engine, narwhal_config, start_narwhal
from .harness.client import H1Pool
from .harness.load import RequestShape, fixed_rate, run_open_loop
from .harness.processes import layout, pin_self, rss_bytes
from .harness.stats import markdown_table, summarize

__all__ = ["abuse", "ATTACKS"]

_MIB = 1 << 20


class Stop(Protocol):
    """What an attack waits on: a threading.Event or a multiprocessing one."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


_MP = multiprocessing.get_context("spawn")
ATTACKER = "127.0.0.2"  # the attackers' source address: the normal clients' is 127.0.0.1


def _connect(addr: tuple[str, int], timeout: float) -> socket.socket:
    return socket.create_connection(addr, timeout=timeout, source_address=(ATTACKER, 0))


def _attack(fn: Callable[..., None], addr: tuple[str, int], stop: Stop) -> None:
    """An attacker's process: at the lowest CPU priority, because here it shares a core with
    the normal clients and the engine, which a remote attacker does not; what is left is
    what the attack costs the router."""
    os.nice(19)
    fn(addr, stop)


def _addr(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def _body(**kw: Any) -> bytes:
    return orjson.dumps({"model": "narwhal-demo", "messages": [{"role": "user", "content": "hello"}], **kw})


def _h2(addr: tuple[str, int], window: int | None = None) -> tuple[socket.socket, h2.connection.H2Connection]:
    s = _connect(addr, 5)
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    c.initiate_connection()
    if window is not None:
        c.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    s.sendall(c.data_to_send())
    return s, c


def _hdrs() -> list[tuple[str, str]]:
    return [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"), (":authority", "x"), ("content-type", "application/json")]


def _drain(s: socket.socket, c: h2.connection.H2Connection | None = None) -> bool:
    """Read what is there (without blocking); False once the connection is gone."""
    s.settimeout(0.01)
    try:
        data = s.recv(65536)
    except TimeoutError:
        return True
    except OSError:
        return False
    if not data:
        return False
    if c is not None:
        try:
            c.receive_data(data)
            out = c.data_to_send()
            if out:
                s.sendall(out)
        except (h2.exceptions.ProtocolError, OSError):
            return False
    return True


# -- the attacks: each runs until `stop` is set ---------------------------------------


def _uploads(addr: tuple[str, int], stop: Stop, n: int, head: bytes, piece: bytes, every_s: float) -> None:
    """n HTTP/1.1 uploads that send `head`, then `piece` every `every_s`; one that the
    router closes (408, or a reset) is opened again."""
    socks: list[socket.socket | None] = [None] * n
    while not stop.is_set():
        for i in range(n):
            s = socks[i]
            try:
                if s is None:
                    s = _connect(addr, 2)
                    s.sendall(head)
                    socks[i] = s
                s.sendall(piece)
                if not _drain(s):
                    raise OSError
            except OSError:
                if s is not None:
                    s.close()
                socks[i] = None
        stop.wait(every_s)
    for s in socks:
        if s is not None:
            s.close()


def slow_body(addr: tuple[str, int], stop: Stop, n: int = 300) -> None:
    """n HTTP/1.1 clients each sending its body at 1 byte per second (reconnecting)."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(_body())
    _uploads(addr, stop, n, head, b"{", 1.0)


def h2_idle_streams(addr: tuple[str, int], stop: Stop, connections: int = 2, streams: int = 520) -> None:
    """HEADERS and a little DATA, never END_STREAM, on many streams of a few connections."""
    conns: list[tuple[socket.socket, h2.connection.H2Connection] | None] = [None] * connections
    while not stop.is_set():
        for i in range(connections):
            try:
                if conns[i] is None:
                    s, c = _h2(addr)
                    c.remote_settings = h2.settings.Settings(client=False, initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1 << 20})
                    for _ in range(streams):
                        sid = c.get_next_available_stream_id()
                        c.send_headers(sid, _hdrs())
                        c.send_data(sid, b"{")
                    s.sendall(c.data_to_send())
                    conns[i] = (s, c)
                s, c = conns[i]  # type: ignore[misc]
                if not _drain(s, c):
                    raise OSError
            except (OSError, h2.exceptions.ProtocolError):
                if conns[i] is not None:
                    conns[i][0].close()  # type: ignore[index]
                conns[i] = None
        stop.wait(0.5)
    for x in conns:
        if x is not None:
            x[0].close()


def h2_no_read(addr: tuple[str, int], stop: Stop, streams: int = 16) -> None:
    """Long streamed answers on a connection whose flow-control window stays 0."""
    s, c = _h2(addr, window=0)
    for _ in range(streams):
        sid = c.get_next_available_stream_id()
        c.send_headers(sid, _hdrs())
        c.send_data(sid, _body(stream=True, max_tokens=5000, mock={"tokens": 5000}), end_stream=True)
    s.sendall(c.data_to_send())
    while not stop.is_set():
        s.settimeout(0.2)
        try:
            data = s.recv(65536)  # frames, but no WINDOW_UPDATE for what arrives
            if not data:
                break
        except TimeoutError:
            pass
        except OSError:
            break
    s.close()


def h1_no_read(addr: tuple[str, int], stop: Stop, n: int = 16) -> None:
    """Long streamed answers (an engine's pace: 2 ms a token) to HTTP/1.1 clients that never read."""
    body = _body(stream=True, max_tokens=20000, mock={"tokens": 20000, "tpot_ms": 2})
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.bind((ATTACKER, 0))
        s.connect(addr)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        socks.append(s)
    stop.wait()
    for s in socks:
        s.close()


def fin_churn(addr: tuple[str, int], stop: Stop, rate: float = 30.0) -> None:
    """One request per connection, then the client's FIN (the CLOSE-WAIT pattern)."""
    while not stop.is_set():
        try:
            with _connect(addr, 2) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                s.recv(4096)
                s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        stop.wait(1.0 / rate)


def _flood(addr: tuple[str, int], stop: Stop, frame: Callable[[h2.connection.H2Connection, int], None]) -> None:
    i = 0
    while not stop.is_set():
        try:
            s, c = _h2(addr)
            while not stop.is_set():
                for _ in range(100):
                    frame(c, i)
                    i += 1
                s.sendall(c.data_to_send())
                if not _drain(s, c):
                    break
        except (OSError, h2.exceptions.ProtocolError):
            pass
        finally:
            s.close()
        stop.wait(0.05)


def settings_flood(addr: tuple[str, int], stop: Stop) -> None:
    _flood(addr, stop, lambda c, i: c.update_settings({h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 65536 + i % 1000}))


def ping_flood(addr: tuple[str, int], stop: Stop) -> None:
    _flood(addr, stop, lambda c, i: c.ping(i.to_bytes(8, "big")))


def rapid_reset(addr: tuple[str, int], stop: Stop) -> None:
    """HEADERS + DATA + RST_STREAM in one write, again and again (CVE-2023-44487)."""
    body = _body(max_tokens=16)

    def frame(c: h2.connection.H2Connection, i: int) -> None:
        sid = c.get_next_available_stream_id()
        c.send_headers(sid, _hdrs())
        c.send_data(sid, body, end_stream=True)
        c.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)

    _flood(addr, stop, frame)


def chunked_one_byte(addr: tuple[str, int], stop: Stop, n: int = 8) -> None:
    """Chunked uploads in 1-byte chunks, as fast as the socket takes them."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    _uploads(addr, stop, n, head, b"1\r\nx\r\n" * 2000, 0.01)


def no_attack(addr: tuple[str, int], stop: Stop) -> None:
    """Nothing: the quiet window against another quiet window (the noise floor)."""
    stop.wait()


ATTACKS: dict[str, tuple[Callable[..., None], str]] = {
    "none": (no_attack, "no attack (quiet vs quiet: the machine's noise floor)"),
    "slow-body": (slow_body, "300 HTTP/1.1 bodies at 1 byte/s"),
    "h2-idle-streams": (h2_idle_streams, "2 h2 connections x 520 streams, never END_STREAM"),
    "h2-no-read": (h2_no_read, "16 h2 streams, window 0, 5,000-token answers"),
    "h1-no-read": (h1_no_read, "16 HTTP/1.1 clients that never read 20,000-token answers (2 ms/token)"),
    "fin-churn": (fin_churn, "30 one-request connections/s, each ending with the client's FIN"),
    "chunked-1-byte": (chunked_one_byte, "8 chunked uploads in 1-byte chunks"),
    "settings-flood": (settings_flood, "SETTINGS frames as fast as one connection sends them"),
    "ping-flood": (ping_flood, "PING frames as fast as one connection sends them"),
    "rapid-reset": (rapid_reset, "HEADERS+DATA+RST_STREAM, 100 streams a write"),
}


# -- measuring --------------------------------------------------------------------------


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def _books(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    out = {"offered": 0.0, "terminal": 0.0, "open": 0.0}
    for line in text.splitlines():
        if line.startswith("narwhal_requests_offered_total "):
            out["offered"] = float(line.split()[-1])
        elif line.startswith("narwhal_requests_terminal_total{"):
            out["terminal"] += float(line.split()[-1])
        elif line.startswith("narwhal_requests_open "):
            out["open"] = float(line.split()[-1])
    return out


def _normal(url: str, rate: float, duration_s: float) -> dict[str, Any]:
    async def go() -> Any:
        pool = H1Pool(url)
        try:
            shape = RequestShape(stream=True, mock={"tpot_ms": 10}, mock_field=True)
            return await run_open_loop(pool, fixed_rate(rate, duration_s, prompt_tokens=64, output_tokens=16), shape, timeout_s=30.0, drain_s=30.0)
        finally:
            await pool.aclose()

    return summarize(asyncio.run(go()), duration_s=duration_s)


def _at_rest(url: str, pid: int, fds_quiet: int, timeout_s: float = 45.0) -> tuple[bool, int]:
    end = time.monotonic() + timeout_s
    fds = _fds(pid)
    while time.monotonic() < end:
        b = _books(url)
        fds = _fds(pid)
        if b["open"] == 0 and abs(b["offered"] - b["terminal"]) < 0.5 and fds <= fds_quiet + 4:
            return True, fds
        time.sleep(0.5)
    return False, fds


def abuse(*, attacks: list[str] | None = None, duration_s: float = 15.0, rate: float = 20.0, out: Path | None = None) -> list[dict[str, Any]]:
    names = attacks or list(ATTACKS)
    # the router on a core of its own; attackers, normal clients and the mock engine share
    # the other (NARWHAL_BENCH_NOPIN=1 to let them mix)
    router_cpus, client_cpus = layout()
    pin_self(client_cpus)
    engine = mock_engine("u0", timing={"time_scale": 0.25}, output_tokens=16, cpus=client_cpus)
    router = None
    rows: list[dict[str, Any]] = []
    try:
        cfg = narwhal_config([engine], admission={"mode": "open", "http_retention_limit": 1024, "queue_limit": 256,
                                                   "phase_concurrency": {"prefill": 8, "decode": 256}},
                             prediction={"profile_on_start": False})
        router = start_narwhal(cfg, name="narwhal-abuse", cpus=router_cpus)
        pid, url, addr = router.proc.pid, router.url, _addr(router.url)
        _normal(url, rate, 3.0)  # warm
        quiet_rss, quiet_fds = rss_bytes(pid, tree=False), _fds(pid)
        base = _normal(url, rate, duration_s)
        rows.append({"attack": "quiet baseline", "what": "", "normal": base, "rss_mib": quiet_rss / _MIB, "rss_delta_mib": 0.0, "fds_peak": quiet_fds,
                     "fds_after": _fds(pid), "rest": True})
        for name in names:
            fn, what = ATTACKS[name]
            # the attacker and the sampler stop on one event (a process-shared one)
            halt = _MP.Event()
            peak = {"rss": 0, "fds": 0}

            def sample(stop: Stop = halt, peak: dict[str, int] = peak) -> None:
                while not stop.wait(0.25):
                    peak["rss"] = max(peak["rss"], rss_bytes(pid, tree=False))
                    peak["fds"] = max(peak["fds"], _fds(pid))

            # a quiet window right before each attack: the attack's p99 is compared with
            # it (a baseline measured minutes earlier drifts with the machine)
            quiet = _normal(url, rate, duration_s)
            # the attacker in a process of its own: as a thread it would share this
            # process's GIL with the normal clients and inflate their measured TTFT by
            # the interpreter's switch interval (5 ms), which is not the router's doing
            th = _MP.Process(target=_attack, args=(fn, addr, halt), name=f"attack-{name}", daemon=True)
            sm = threading.Thread(target=sample, name="sampler", daemon=True)
            th.start()
            sm.start()
            time.sleep(1.0)  # let the attack take hold
            res = _normal(url, rate, duration_s)
            halt.set()
            th.join(15)
            if th.is_alive():
                th.kill()
                th.join(5)
            sm.join(5)
            rest, fds_after = _at_rest(url, pid, quiet_fds)
            rows.append({"attack": name, "what": what, "normal": res, "quiet": quiet, "rss_mib": peak["rss"] / _MIB, "rss_delta_mib": (peak["rss"] - quiet_rss) / _MIB,
                         "fds_peak": peak["fds"], "fds_after": fds_after, "rest": rest})
            print(f"[abuse] {name}: served {res['ok']}/{res['offered']}, ttft p99 {res['ttft']['p99']}, rss +{(peak['rss'] - quiet_rss) / _MIB:.1f} MiB, "
                  f"fds peak {peak['fds']} after {fds_after}, at rest {rest}", flush=True)
    finally:
        if router is not None:
            router.stop()
        engine.proc.stop()
    print(table(rows))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "abuse.json").write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
        (out / "abuse.md").write_text(table(rows) + "\n")
    return rows


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        n = r["normal"]
        base = r.get("quiet") or n  # the paired quiet window (the baseline row is its own)
        served = n["ok"] / n["offered"] if n["offered"] else 0.0
        p99, q99 = n["ttft"]["p99"], base["ttft"]["p99"]
        ratio = (p99 / q99) if p99 and q99 else None
        e2e_ratio = (n["e2e"]["p99"] / base["e2e"]["p99"]) if n["e2e"]["p99"] and base["e2e"]["p99"] else None
        ok = served >= 0.99 and (ratio is None or ratio <= 2.0) and r["rss_delta_mib"] <= 64 and r["rest"]
        out.append([r["attack"], r["what"], f"{served:.1%} ({n['ok']}/{n['offered']})", _ms(p99), _ms(q99), "—" if ratio is None else f"{ratio:.2f}x",
                    _ms(n["e2e"]["p99"]), "—" if e2e_ratio is None else f"{e2e_ratio:.2f}x", f"{r['rss_mib']:.0f} (+{r['rss_delta_mib']:.1f})",
                    f"{r['fds_peak']} / {r['fds_after']}", "yes" if r["rest"] else "NO", "within" if ok else "MISSED"])
    return markdown_table(["attack", "what", "normal clients served", "TTFT p99 ms", "quiet p99 ms (just before)", "vs quiet", "e2e p99 ms", "e2e vs quiet",
                           "router RSS MiB (peak, +first quiet)", "fds peak / after", "books balanced, nothing held", "target"], out)
