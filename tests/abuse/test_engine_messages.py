"""Attack: an engine (broken, or hostile, or merely chatty) writes into the router's
client-facing failure messages. The E03 message quoted the offending token ID and the
engine's choice index verbatim (`choice 'x' token_ids holds '10.9.8.7:5555'`, of any
length); E01 quoted a field name the engine made up; E04 passed an error event's message
whatever it was (an object's repr, 4 MiB of text, a peer's address) and E04/E05 the
message of an error body (FastAPI's `detail` list as a Python repr, URLs of the fleet).
Defence: failure messages say what is wrong in words and name the engine; an engine's
own error message is passed on only as a JSON string, shortened, with addresses replaced
by `<address>`; the log keeps the values under the request ID."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from narwhal.core.relay import MAX_ENGINE_MESSAGE, engine_message
from narwhal.upstream.engines import EngineSpec
from narwhal_generated import errors as E
from tests.abuse.rawengine import SSE_HEAD, Answer, Request, chunk, raw_engine, token_event
from tests.helpers import running_router, sse

ADDR = "10.9.8.7"  # an internal address an engine may name
LEAKS = (ADDR, "5555", "424242", "987654321", "idx-", "ZZZZ", "x_secret")


def base() -> dict[str, Any]:
    return {
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
        "monitoring": {"poll_interval_ms": 100, "stale_after_ms": 60000, "breaker_failures": 1000},
        "upstream": {"idle_timeout_ms": 3000},
    }


def chat(stream: bool) -> dict[str, Any]:
    return {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": stream}


@pytest.fixture
def engine_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.INFO, logger="narwhal")
    yield caplog


def event(choice: dict[str, Any] | None = None, **top: Any) -> bytes:
    ev: dict[str, Any] = {"id": "chatcmpl-raw", "object": "chat.completion.chunk", "created": 1, "model": "narwhal-demo", **top}
    if choice is not None:
        ev["choices"] = [{"index": 0, "finish_reason": None, **choice}]
    return b"data: " + orjson.dumps(ev) + b"\n\n"


def stream_of(*events: bytes, first_token: bool = False) -> Answer:
    """A chunked SSE answer of `events` then [DONE]; first_token: a valid token first, on
    its own (the router sends response headers with it)."""

    async def answer(req: Request, w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD)
        if first_token:
            w.write(chunk(token_event(0)))
            await w.drain()
            await asyncio.sleep(0.1)
        w.write(b"".join(chunk(e) for e in events) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    return answer


def http_error(status: int, body: Any) -> Answer:
    async def answer(req: Request, w: asyncio.StreamWriter) -> None:
        raw = orjson.dumps(body)
        w.write(b"HTTP/1.1 %d Oops\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (status, len(raw), raw))

    return answer


def ask(answer: Answer, stream: bool, rid: str) -> tuple[int, dict[str, Any]]:
    """One request to a router in front of one raw engine u0: (status, the error object);
    the books balance after it."""
    with raw_engine(answer) as eng, running_router(base(), [EngineSpec("u0", eng.url, "unified", "vllm", None, None)], start=False) as rr:
        if stream:
            s = sse(rr.url, chat(True), headers={"x-request-id": rid})
            status = s.status
            err = s.errors[-1] if s.errors else httpx.Response(status, content=s.body).json()["error"]
        else:
            r = rr.post("/v1/chat/completions", json=chat(False), headers={"x-request-id": rid})
            status, err = r.status_code, r.json()["error"]
        rr.balanced()
    return status, err


def logged(caplog: pytest.LogCaptureFixture, rid: str) -> str:
    return "\n".join(rec.getMessage() for rec in caplog.records if rid in rec.getMessage())


def clean(err: dict[str, Any]) -> None:
    text = orjson.dumps(err).decode()
    assert not any(x in text for x in LEAKS), err


# -- E03: token identity -------------------------------------------------------------

# (case, the bad choice, what the log keeps)
BAD_IDS = [
    ("string-id", {"delta": {"content": "a"}, "token_ids": [f"{ADDR}:5555"]}, f"{ADDR}:5555"),
    ("negative-id", {"delta": {"content": "a"}, "token_ids": [-424242]}, "-424242"),
    ("boolean-id", {"delta": {"content": "a"}, "token_ids": [7, True], "index": "idx-bool"}, "True"),
    ("not-a-list", {"delta": {"content": "a"}, "token_ids": 987654321}, "987654321"),
    ("hostile-index", {"delta": {"content": "a"}, "index": f"idx-{ADDR}"}, f"idx-{ADDR}"),
    ("huge-id", {"delta": {"content": "a"}, "token_ids": ["Z" * 100_000]}, "ZZZZ"),
]
WORDS = {
    "string-id": "a token ID that is a string",
    "negative-id": "a negative token ID",
    "boolean-id": "a token ID that is a Boolean",
    "not-a-list": "token_ids that is an integer, not a list",
    "hostile-index": "carries output without token_ids",
    "huge-id": "a token ID that is a string",
}
MODES = ["json", "stream-before-headers", "stream-after-headers"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("case", "choice", "raw"), BAD_IDS, ids=[c[0] for c in BAD_IDS])
def test_E03_messages_carry_no_engine_values(engine_log: pytest.LogCaptureFixture, case: str, choice: dict[str, Any], raw: str, mode: str) -> None:
    rid = f"e03-{case}-{mode}"
    status, err = ask(stream_of(event(choice), first_token=mode == "stream-after-headers"), mode != "json", rid)
    assert status == (200 if mode == "stream-after-headers" else E.E03.status)
    assert err["code"] == E.E03.code and "u0" in err["message"] and WORDS[case] in err["message"], err
    assert len(err["message"]) < 300, err
    clean(err)
    assert raw in logged(engine_log, rid), "the log keeps the engine's value under the request ID"


def test_profiling_errors_on_v1_engines_carry_no_token_ids(engine_log: pytest.LogCaptureFixture) -> None:
    """T07: a profile that fails the ID check is published on the unauthenticated
    /v1/engines with the words only."""
    cfg = base()
    cfg["admission"]["prediction"] = {"profile_on_start": True, "profile_prompt_tokens": [16, 32, 64], "profile_repeats": 1, "profile_output_tokens": 2}
    bad = stream_of(event({"delta": {"content": "a"}, "token_ids": [f"{ADDR}:5555"]}))
    with raw_engine(bad) as eng, running_router(cfg, [EngineSpec("u0", eng.url, "unified", "vllm", None, None)]) as rr:
        (view,) = rr.get("/v1/engines").json()["data"]
    assert view["profile"]["status"] == "failed"
    assert "E03" in view["profile"]["error"] and "a string" in view["profile"]["error"], view["profile"]
    assert ADDR not in view["profile"]["error"] and "5555" not in view["profile"]["error"]
    assert any(ADDR in rec.getMessage() for rec in engine_log.records)


# -- E01, E04, E05: what else an engine says --------------------------------------------

HUGE = "overloaded " * 20_000 + f"at {ADDR}:5555"
# (case, engine answer, row, words the client reads, what the log keeps)
OTHERS: list[tuple[str, Answer, E.ErrorRow, str, str]] = [
    ("E01-made-up-field", stream_of(event({"delta": {"content": "a", "x_secret_10_9_8_7": {"k": 1}}, "token_ids": [1]})), E.E01,
     "a delta field the assembly table does not name", "x_secret_10_9_8_7"),
    ("E04-event-address", stream_of(event(error={"message": f"KV pull from {ADDR}:5555 failed", "type": "x", "code": 500})), E.E04,
     "KV pull from <address> failed", f"{ADDR}:5555"),
    ("E04-event-url", stream_of(event(error={"message": f"see http://{ADDR}:5555/metrics?x=1 now"})), E.E04,
     "see <address> now", f"http://{ADDR}:5555"),
    ("E04-event-object", stream_of(event(error={"message": {"peer": ADDR, "idx-": 1}})), E.E04,
     "an error event without a message", ADDR),
    ("E04-event-huge", stream_of(event(error={"message": HUGE})), E.E04, "overloaded overloaded", "overloaded"),
    ("E05-http-400", http_error(400, {"error": {"message": f"bad prompt; see http://{ADDR}:5555/docs", "param": f"x {ADDR}"}}), E.E05,
     "bad prompt; see <address>", f"http://{ADDR}:5555/docs"),
    ("E04-http-500-detail-list", http_error(500, {"detail": [{"loc": ["body"], "msg": f"idx-{ADDR}"}]}), E.E04,
     "HTTP 500 without a message", f"idx-{ADDR}"),
    ("E04-http-500-address", http_error(500, {"error": {"message": f"prefill [fd00::7]:5555 unreachable, fd00::8 too; {ADDR}"}}), E.E04,
     "prefill <address> unreachable, <address> too; <address>", "fd00::7"),
]


@pytest.mark.parametrize(("case", "answer", "row", "words", "raw"), OTHERS, ids=[c[0] for c in OTHERS])
def test_engine_messages_are_words_without_addresses(engine_log: pytest.LogCaptureFixture, case: str, answer: Answer, row: E.ErrorRow, words: str, raw: str) -> None:
    rid = f"msg-{case}"
    status, err = ask(answer, False, rid)
    assert status == row.status and err["code"] == row.code, err
    assert "u0" in err["message"] and words in err["message"], err
    assert err["param"] is None, err  # E05: an engine's param that is no field path stays out
    assert len(err["message"]) <= MAX_ENGINE_MESSAGE + 200, len(err["message"])
    clean(err)
    assert raw in logged(engine_log, rid), "the log keeps the engine's words under the request ID"


@pytest.mark.parametrize("case", ["E05-http-400", "E04-http-500-detail-list"])
def test_engine_error_bodies_before_the_stream_are_words_for_streaming_clients_too(case: str) -> None:
    _, answer, row, words, _ = next(c for c in OTHERS if c[0] == case)
    status, err = ask(answer, True, f"msg-stream-{case}")
    assert status == row.status and err["code"] == row.code and words in err["message"], err
    clean(err)


def test_engine_message_passes_words_and_replaces_addresses() -> None:
    hosts = ("engine-3.internal", "decode")
    assert engine_message("max_tokens must be at most 4096 (got 5000) at 12:30:45") == "max_tokens must be at most 4096 (got 5000) at 12:30:45"
    assert engine_message("no peer engine-3.internal:8000, Engine-3.Internal or decode:9000; decode failed", hosts=hosts) == (
        "no peer <address>, <address> or <address>; decode failed"
    )
    assert engine_message("peers localhost:8000 and [::1]:7 and 2001:db8::1") == "peers <address> and <address> and <address>"
    for not_words in (None, 5, {"message": "x"}, ["x"], "   "):
        assert engine_message(not_words) is None
    cut = engine_message("a" * (MAX_ENGINE_MESSAGE - 4) + f" {ADDR}:5555 tail")
    assert cut is not None and ADDR[:4] not in cut and cut.endswith(" ...") and len(cut) <= MAX_ENGINE_MESSAGE + 4
