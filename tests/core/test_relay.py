"""The sans-IO relay step, fed the engine fixtures as SSE bytes whole and one byte at a
time: the same client bytes, the same first-token moment, the same assembly."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from narwhal.core.assembly import Assembler
from narwhal.core.relay import StreamRelay
from tests.shared import FIXTURES

NAMES = sorted(p.stem for p in FIXTURES.glob("*.jsonl"))


def wire(name: str) -> bytes:
    lines = [ln for ln in (FIXTURES / f"{name}.jsonl").read_text().splitlines() if ln.strip()]
    return b"".join(b"data: " + ln.encode() + b"\r\n\r\n" for ln in lines) + b"data: [DONE]\n\n"


def run(data: bytes, chunks: int | None, **kw: Any) -> tuple[bytes, int | None, bool, tuple[str, str] | None, StreamRelay]:
    r = StreamRelay(**kw)
    out, first, done, fail = b"", None, False, None
    pieces = [data] if chunks is None else [data[i : i + chunks] for i in range(0, len(data), chunks)]
    for i, piece in enumerate(pieces):
        step = r.feed(piece, float(i))
        out += step.out
        if step.first_token and first is None:
            first = len(out)
        if step.failure:
            fail = step.failure
            break
        if step.done:
            done = True
            break
    return out, first, done, fail, r


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ids", [True, False])
def test_streaming_whole_equals_byte_by_byte(name: str, ids: bool) -> None:
    data = wire(name)
    checks = "vllm" in name
    a = run(data, None, checks_ids=checks, client_ids=ids, client_usage=True)
    b = run(data, 1, checks_ids=checks, client_ids=ids, client_usage=True)
    assert a[0] == b[0] and a[2] == b[2] and a[3] == b[3]
    assert a[4].token_count == b[4].token_count
    if "error" not in name:
        assert a[2] and a[0].endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("name", [n for n in NAMES if "vllm" in n and "error" not in n])
def test_T10_ids_stripped_unless_asked(name: str) -> None:
    data = wire(name)
    out, *_ = run(data, None, checks_ids=True, client_ids=False, client_usage=True)
    assert b"token_ids" not in out
    out2, *_ = run(data, None, checks_ids=True, client_ids=True, client_usage=True)
    assert b'"token_ids"' in out2
    # events that needed no change go out byte for byte as the engine sent them
    assert out2.count(b"data: ") == data.count(b"data: ")


def test_usage_chunk_dropped_when_the_client_did_not_ask() -> None:
    data = wire("openai_chat_content_usage")
    asked, *_ = run(data, None, checks_ids=False, client_ids=False, client_usage=True)
    unasked, *_ = run(data, None, checks_ids=False, client_ids=False, client_usage=False)
    assert asked.count(b"data: ") == unasked.count(b"data: ") + 1
    assert b'"choices":[]' not in unasked


def test_first_token_is_the_first_event_with_ids() -> None:
    data = wire("constructed_vllm_chat_content")
    out, first, *_ = run(data, 1, checks_ids=True, client_ids=True, client_usage=True)
    first_events = out[:first].count(b"data: ")
    assert first_events == 2  # the role chunk (no IDs) and the first content chunk


def test_engine_error_event_is_forwarded_in_the_engines_shape() -> None:
    data = wire("constructed_vllm_chat_error_midstream")
    out, _, done, fail, r = run(data, 1, checks_ids=True, client_ids=True, client_usage=True)
    assert fail is None and done and r.engine_error is not None
    assert b'"type":"InternalServerError"' in out
    _, _, _, fail2, _ = run(data, None, checks_ids=True, client_ids=True, client_usage=True, assembler=Assembler("chat"))
    assert fail2 is not None and fail2[0] == "E04"


def test_E03_bad_ids_fail_at_the_event() -> None:
    ev = {"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [True]}]}
    data = b"data: " + orjson.dumps(ev) + b"\n\n"
    *_, fail, _ = run(data, 1, checks_ids=True, client_ids=True, client_usage=True)
    assert fail is not None and fail[0] == "E03"


def test_E02_not_json() -> None:
    *_, fail, _ = run(b"data: {oops\n\n", None, checks_ids=False, client_ids=False, client_usage=False)
    assert fail == ("E02", "an engine event is not JSON")


@pytest.mark.parametrize("name", [n for n in NAMES if "error" not in n])
def test_assembly_whole_equals_byte_by_byte(name: str) -> None:
    data = wire(name)
    results = []
    for chunks in (None, 1, 7):
        a = Assembler("completion" if "completion" in name else "chat", include_token_ids=True)
        _, _, done, fail, r = run(data, chunks, checks_ids="vllm" in name, client_ids=True, client_usage=True, assembler=a, normalise_tool_calls=name.startswith(("tgi", "openai")))
        assert done and fail is None
        results.append(json.dumps(a.finish(prompt_tokens=0, completion_tokens=r.token_count if "vllm" in name else None), sort_keys=True))
    assert results[0] == results[1] == results[2]
