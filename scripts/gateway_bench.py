"""The gateway bench (issue 41, part 5): streaming requests relayed by Narwhal alone, by
Envoy alone, and by Envoy with Narwhal as its endpoint picker, against the same mock
engine (a separate process); per arm the client's first-token time (p50/p99, and what the
arm adds over the engine direct), and each process's CPU per relayed event (from
/proc/PID/stat: user + system). Then the picker's decisions per CPU-second: ext_proc
streams that end at the grant (request headers and body in, destination out).

    python scripts/gateway_bench.py [--requests 400] [--concurrency 8] [--tokens 64] [--decisions 2000]

Loopback only; every process it starts is stopped by its PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from narwhal.gateway.envoy import bootstrap
from narwhal.http.server import free_port

_TICK = os.sysconf("SC_CLK_TCK")
ENVOY = str(Path(sys.executable).parent / "envoy")


def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / _TICK


def _up(url: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not come up")


@contextlib.contextmanager
def proc(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield p
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def _plain_envoy(listen: str, engine: str, admin: str) -> dict[str, Any]:
    """Envoy alone: the same listener, straight to the engine (no picker)."""
    cfg = bootstrap(epp="127.0.0.1:1", listen=listen, admin=admin, pool=(engine,))
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = hcm["http_filters"][1:]  # the router only
    hcm["route_config"]["virtual_hosts"][0]["routes"] = [{"match": {"prefix": "/"}, "route": {"cluster": "engine", "timeout": "0s"}}]
    host, port = engine.rsplit(":", 1)
    cfg["static_resources"]["clusters"] = [{"name": "engine", "type": "STATIC", "connect_timeout": "5s", "load_assignment": {
        "cluster_name": "engine", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}]}]}}]
    return cfg


async def _one(c: httpx.AsyncClient, url: str, body: bytes) -> tuple[float, int]:
    t0 = time.perf_counter()
    first = None
    events = 0
    async with c.stream("POST", url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}) as r:
        assert r.status_code == 200, r.status_code
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events += 1
                if first is None and '"content":"' in line and '"content":""' not in line:
                    first = time.perf_counter() - t0
    return (first or 0.0), events


async def _load(url: str, n: int, conc: int, tokens: int) -> tuple[list[float], int]:
    body = orjson.dumps({"model": "narwhal-demo", "messages": [{"role": "user", "content": "Hello"}], "stream": True,
                         "max_tokens": tokens, "mock": {"tokens": tokens}})
    sem = asyncio.Semaphore(conc)
    ttft: list[float] = []
    events = 0
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=conc)) as c:
        async def go() -> None:
            nonlocal events
            async with sem:
                t, e = await _one(c, url, body)
                ttft.append(t)
                events += e

        await asyncio.gather(*(go() for _ in range(n)))
    return ttft, events


def arm(name: str, url: str, pids: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    asyncio.run(_load(url, max(20, args.requests // 10), args.concurrency, args.tokens))  # warm-up
    before = {k: cpu_s(p) for k, p in pids.items()}
    t0 = time.monotonic()
    ttft, events = asyncio.run(_load(url, args.requests, args.concurrency, args.tokens))
    wall = time.monotonic() - t0
    cpu = {k: cpu_s(p) - before[k] for k, p in pids.items()}
    q = statistics.quantiles(ttft, n=100)
    return {"arm": name, "events": events, "wall_s": wall, "ttft_p50_ms": q[49] * 1000, "ttft_p99_ms": q[98] * 1000,
            "cpu_us_per_event": {k: v * 1e6 / events for k, v in cpu.items()}}


async def _decisions(epp: str, n: int, conc: int) -> float:
    import grpc

    from narwhal.gateway.protos import METHOD
    from narwhal.gateway.protos import core as base_pb2
    from narwhal.gateway.protos import ext_proc as pb

    raw = orjson.dumps({"model": "narwhal-demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
    hdrs = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in
                                                              ((":path", b"/v1/chat/completions"), (":method", b"POST"), ("content-length", b"%d" % len(raw)))]))
    sem = asyncio.Semaphore(conc)
    async with grpc.aio.insecure_channel(epp) as ch:
        process = ch.stream_stream(METHOD, request_serializer=pb.ProcessingRequest.SerializeToString, response_deserializer=pb.ProcessingResponse.FromString)

        async def one() -> None:
            async with sem:
                call = process()
                await call.write(pb.ProcessingRequest(request_headers=hdrs))
                await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True)))
                head = await call.read()
                assert head.HasField("request_headers"), head
                call.cancel()

        t0 = time.monotonic()
        await asyncio.gather(*(one() for _ in range(n)))
        return time.monotonic() - t0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--decisions", type=int, default=2000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        eng_port, nw_port, epp_port, gw_port, plain_port = (free_port() for _ in range(5))
        engine = f"127.0.0.1:{eng_port}"
        cfg = {"serving": {"listen": f"127.0.0.1:{nw_port}"}, "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
               "engines": [{"name": "e0", "url": f"http://{engine}", "role": "unified", "dialect": "vllm"}],
               "gateway": {"listen": f"127.0.0.1:{epp_port}"}}
        (tmp / "n.yaml").write_text(yaml.safe_dump(cfg))
        (tmp / "gw.yaml").write_text(yaml.safe_dump(bootstrap(epp=f"127.0.0.1:{epp_port}", listen=f"127.0.0.1:{gw_port}", admin=f"127.0.0.1:{free_port()}", pool=(engine,))))
        (tmp / "plain.yaml").write_text(yaml.safe_dump(_plain_envoy(f"127.0.0.1:{plain_port}", engine, f"127.0.0.1:{free_port()}")))
        nw_argv = [sys.executable, "-m", "narwhal.cli", "serve", "--config", str(tmp / "n.yaml")]
        envoy_argv = [ENVOY, "--concurrency", "1", "--disable-hot-restart", "-l", "error", "-c"]
        with proc([sys.executable, "-m", "narwhal.cli", "mock-engine", "--dialect", "vllm", "--role", "unified", "--port", str(eng_port),
                   "--model", "narwhal-demo"], tmp / "e.log") as eng, proc(nw_argv, tmp / "n.log") as nw, \
                proc([*envoy_argv, str(tmp / "gw.yaml")], tmp / "gw.log") as gw, proc([*envoy_argv, str(tmp / "plain.yaml")], tmp / "plain.log") as plain:
            _up(f"http://{engine}/health")
            _up(f"http://127.0.0.1:{nw_port}/ready")
            time.sleep(3)  # Envoy's first health checks of the picker
            rows = [arm("engine direct", f"http://{engine}", {"engine": eng.pid}, args),
                    arm("Narwhal alone", f"http://127.0.0.1:{nw_port}", {"engine": eng.pid, "narwhal": nw.pid}, args),
                    arm("Envoy alone", f"http://127.0.0.1:{plain_port}", {"engine": eng.pid, "envoy": plain.pid}, args),
                    arm("Envoy + Narwhal picker", f"http://127.0.0.1:{gw_port}", {"engine": eng.pid, "envoy": gw.pid, "picker": nw.pid}, args)]
            c0 = cpu_s(nw.pid)
            wall = asyncio.run(_decisions(f"127.0.0.1:{epp_port}", args.decisions, args.concurrency))
            picker_cpu = cpu_s(nw.pid) - c0
    base = rows[0]["ttft_p50_ms"], rows[0]["ttft_p99_ms"]
    print("| arm | events | first token p50 / p99 (ms) | added p50 / p99 (ms) | CPU per event (us) |")
    print("|---|---|---|---|---|")
    for r in rows:
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_us_per_event"].items())
        print(f"| {r['arm']} | {r['events']} | {r['ttft_p50_ms']:.2f} / {r['ttft_p99_ms']:.2f} | "
              f"{r['ttft_p50_ms'] - base[0]:+.2f} / {r['ttft_p99_ms'] - base[1]:+.2f} | {cpu} |")
    print(f"\npicker decisions: {args.decisions} in {wall:.2f} s wall ({args.decisions / wall:.0f}/s), "
          f"{picker_cpu:.2f} CPU-s in the picker: {args.decisions / picker_cpu:.0f} decisions per CPU-second")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
