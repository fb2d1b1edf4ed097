"""`narwhal bench prediction`: predictive admission checked against a real engine.

Narwhal (predictive mode, profiling on start) is started in front of an engine the caller
runs (llama.cpp, vLLM, ...). Once the profile is in, requests of several prompt lengths
are sent, each with a distinct prompt (a numbered tag first: no prefix-cache hit), alone
and behind a queue (`depth` requests at once). Every answer carries the TTFT admission
projected (`x-narwhal-projected-ttft-ms`, before the confidence margin); the client
measures the TTFT it saw (request sent -> first content byte). The table gives, per prompt
length and condition, the medians and the median relative error, and whether it is within
+-25 %.

Prefix caching: vLLM V1 caches prefixes by default, so a repeated prompt's prefill is
nearly free; the profiler's and this bench's prompts are distinct from their first
characters, so neither measures a cached prefill. Client prompts that hit the cache are
faster than projected (the projection has no cache term: issue 15).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from narwhal.authority.profiler import _prompt

from .harness import start_narwhal
from .harness.stats import markdown_table

__all__ = ["prediction", "table"]


async def _one(client: httpx.AsyncClient, url: str, model: str, tokens: int, tag: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": _prompt(tokens, 4.0, tag)}], "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        proj = r.headers.get("x-narwhal-projected-ttft-ms")
        status = r.status_code
        async for chunk in r.aiter_raw():
            if first is None and b'"content"' in chunk:
                first = time.perf_counter()
    return {"status": status, "projected_ms": float(proj) if proj else None, "measured_ms": (first - t0) * 1000.0 if first else None}


async def _run(url: str, model: str, lengths: list[int], repeats: int, depth: int, max_tokens: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    k = 0
    async with httpx.AsyncClient(timeout=600) as c:
        for n in lengths:
            for _ in range(repeats):  # alone
                k += 1
                out.append({"tokens": n, "condition": "alone", **await _one(c, url, model, n, f"alone-{k}", max_tokens)})
            for _ in range(max(1, repeats // 2)):  # behind a queue: depth at once
                k += 1
                res = await asyncio.gather(*(_one(c, url, model, n, f"q{k}-{i}", max_tokens) for i in range(depth)))
                for i, x in enumerate(res):
                    out.append({"tokens": n, "condition": "alone" if i == 0 else "queued", **x})
    return out


def prediction(*, engine_url: str, dialect: str, model: str, max_concurrency: int | None, lengths: list[int], repeats: int = 4, depth: int = 3,
               max_tokens: int = 8, out: Path | None = None) -> list[dict[str, Any]]:
    eng: dict[str, Any] = {"name": "e0", "url": engine_url, "role": "unified", "dialect": dialect}
    if max_concurrency is not None:
        eng["max_concurrency"] = max_concurrency
    cfg = {
        "serving": {"model": model},
        "admission": {"mode": "predictive", "queue_limit": 256, "max_wait_ms": 600000, "ttft_budget_ms": 600000, "max_ttft_target_ms": 600000,
                      "prediction": {"profile_on_start": True}},
        "engines": [eng],
        "upstream": {"idle_timeout_ms": 600000},
        "monitoring": {"poll_interval_ms": 1000, "stale_after_ms": 60000},
    }
    router = start_narwhal(cfg, name="narwhal-prediction", timeout_s=600)
    try:
        view = httpx.get(router.url + "/v1/engines", timeout=10).json()["data"][0]
        if view["profile"]["status"] != "ok":
            raise SystemExit(f"narwhal bench prediction: the engine's profile {view['profile']['status']}: {view['profile']['error']}")
        samples = asyncio.run(_run(router.url, model, lengths, repeats, depth, max_tokens))
    finally:
        router.stop()
    rows = _rows(samples)
    print(table(rows))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "prediction.json").write_bytes(orjson.dumps({"samples": samples, "rows": rows, "profile": view["profile"]}, option=orjson.OPT_INDENT_2))
        (out / "prediction.md").write_text(table(rows) + "\n")
    return rows


def _rows(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for n in sorted({s["tokens"] for s in samples}):
        for cond in ("alone", "queued"):
            xs = [s for s in samples if s["tokens"] == n and s["condition"] == cond and s["projected_ms"] and s["measured_ms"]]
            if not xs:
                continue
            errs = [(s["projected_ms"] - s["measured_ms"]) / s["measured_ms"] for s in xs]
            rows.append({"tokens": n, "condition": cond, "n": len(xs), "projected_ms": statistics.median(s["projected_ms"] for s in xs),
                         "measured_ms": statistics.median(s["measured_ms"] for s in xs), "median_error": statistics.median(errs)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = [[r["tokens"], r["condition"], r["n"], f"{r['projected_ms']:.0f}", f"{r['measured_ms']:.0f}", f"{r['median_error'] * 100:+.0f}%",
            "yes" if abs(r["median_error"]) <= 0.25 else "NO"] for r in rows]
    return markdown_table(["prompt tokens (content)", "condition", "requests", "projected TTFT ms (median)", "measured TTFT ms (median)",
                           "median error", "within +-25%"], out)
