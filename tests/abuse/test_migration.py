"""The router's threat model, stream migration (issue 40 item 10): what a client asks for,
or when an engine breaks, must not make the router carry a stream on from a sequence no
engine produced, or answer a finished stream with an error.

  * a completions stream with a batch of prompts: its events interleave the choices'
    token IDs, and the migration recorder merged them all, so a break was continued from
    an interleaved sequence (a corrupted answer, spliced). Now never carried on (G12): the
    error event, no second engine asked;
  * an engine that breaks after its last token (the output already holds max_tokens):
    the stream ended in an error event labelled placement_refused. Now a finished answer
    (G13), no second engine asked.

Two mocks answering with `sequence_output`; the fault is on u0 only (see
tests/migration/test_migration_http.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from narwhal.mock import MockConfig, RunningMock, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from tests.helpers import running_router, sse

MODEL = "narwhal-demo"
DROP = {"fault": "drop", "fault_after": 25, "fault_engines": ["u0"], "tpot_ms": 3}


@pytest.fixture(scope="module")
def mocks() -> Iterator[list[RunningMock]]:
    cfg = [MockConfig(dialect="vllm", role="unified", model=MODEL, name=f"u{i}", timing=Timing(time_scale=0.0), sequence_output=True) for i in range(2)]
    with running_fleet(cfg) as ms:
        yield ms


def _router(mocks: list[RunningMock]) -> Any:
    cfg = {"admission": {"mode": "open", "prediction": {"profile_on_start": False}}, "monitoring": {"poll_interval_ms": 100},
           "upstream": {"migration": {"max_attempts": 2}}}
    return running_router(cfg, [EngineSpec(m.config.name or "", m.url, "unified", "vllm", None, None) for m in mocks])


def _decisions(url: str) -> list[str]:
    return [ln.split('decision="')[1].split('"')[0] for ln in httpx.get(url + "/metrics", timeout=5).text.splitlines()
            if ln.startswith("narwhal_migrations_total{") and not ln.endswith(" 0.0")]


def test_a_batch_of_prompts_broken_mid_stream_is_not_spliced_from_interleaved_ids(mocks: list[RunningMock]) -> None:
    with _router(mocks) as rr:
        before = len(mocks[1].requests())
        st = sse(rr.url, {"model": MODEL, "prompt": ["once upon a time a narwhal", "a narwhal sang"], "max_tokens": 40, "ignore_eos": True,
                          "stream": True, "return_token_ids": True, "mock": DROP}, path="/v1/completions")
        assert st.status == 200
        errors = [e for e in st.events if isinstance(e, dict) and "error" in e]
        assert errors and errors[-1]["error"]["code"] == "engine_unreachable", st.body
        assert st.comments == []  # no x-narwhal-migrations: not carried on
        assert len(mocks[1].requests()) == before  # no continuation asked of another engine
        assert _decisions(rr.url) == ["several_prompts"]


def test_a_break_after_the_last_token_is_a_finished_answer_not_an_error(mocks: list[RunningMock]) -> None:
    with _router(mocks) as rr:
        before = len(mocks[1].requests())
        st = sse(rr.url, {"model": MODEL, "messages": [{"role": "user", "content": "a long story"}], "max_tokens": 40, "ignore_eos": True,
                          "stream": True, "return_token_ids": True, "mock": {**DROP, "fault_after": 40}})
        assert st.status == 200 and st.done, st.body
        assert not [e for e in st.events if isinstance(e, dict) and "error" in e]
        finishes = [c["choices"][0]["finish_reason"] for c in st.chunks if c.get("choices") and c["choices"][0].get("finish_reason")]
        assert finishes == ["length"]
        assert len(mocks[1].requests()) == before
        assert _decisions(rr.url) == ["nothing_left"]
