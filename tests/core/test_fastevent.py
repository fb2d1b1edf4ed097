"""The native relay step `narwhal.core._fastevent.event`, checked against the Python path.

The oracle is the pure-Python path the caller falls back to: the upstream's chunked short
path (`_Conn._parse`, one whole chunk a read), the SSE parser's one-event short path, and
`StreamRelay.feed` on a started relay (IDs checked, T10 stripping when the client did not
ask for IDs), framed for the client as `H1Direct.write` frames it. Declining (None) is
always correct; an answer must be byte for byte what the Python path gives, with the
same token count, and must leave no relay state the native step does not carry (usage,
finish reason, engine error). Checked by property tests (generated engine events, their
byte mutations, random bytes), by a table of events that must be taken and one of reads
that must be declined.
"""

from __future__ import annotations

import json
import random
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.core import _fastevent
from narwhal.core.relay import StreamRelay
from narwhal.upstream.http1 import _HEXDIG
from tests.shared import FIXTURES

BIG = 1 << 20


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


def _event(body: bytes | str) -> bytes:
    return _chunk(b"data: " + (body.encode() if isinstance(body, str) else body) + b"\n\n")


def _common_read(data: bytes) -> bytes | None:
    """The chunk's payload when `_Conn._parse` takes `data` by its short path, else None."""
    nl = data.find(b"\r\n")
    size_s = data[:nl]
    if 0 < nl <= 16 and not size_s.lstrip(_HEXDIG):
        end = nl + 2 + int(size_s, 16)
        if end > nl + 2 and len(data) == end + 2 and data.endswith(b"\r\n"):
            return data[nl + 2 : end]
    return None


def _one_event(payload: bytes, limit: int) -> bool:
    """SSEParser's one-event short path (on an idle parser)."""
    return (
        payload.startswith(b"data: ") and payload.endswith(b"\n\n") and payload.find(b"\n", 6) == len(payload) - 2
        and 13 not in payload and len(payload) - 7 <= limit
    )


def _reference(data: bytes, client_ids: bool, limit: int) -> tuple[Any, StreamRelay] | str:
    """The Python path's step on a started relay, or why the read is outside the subset."""
    payload = _common_read(data)
    if payload is None:
        return "not a common read"
    if not _one_event(payload, limit):
        return "not one short-path event"
    relay = StreamRelay(checks_ids=True, client_ids=client_ids, client_usage=False, max_event_bytes=limit)
    relay.started = True
    return relay.feed(payload, 0.0), relay


def check(data: bytes, client_ids: bool, limit: int) -> tuple[bytes, int] | None:
    """The native answer, asserted to be the Python path's whenever there is one."""
    got = _fastevent.event(data, client_ids, limit)
    if got is None:
        return None
    framed, k = got
    assert type(framed) is bytes and type(k) is int and k >= 1, got
    ref = _reference(data, client_ids, limit)
    assert not isinstance(ref, str), f"answered, but {ref}: {data!r}"
    step, relay = ref
    assert step.failure is None and not step.done and not step.first_token, (step, data)
    assert framed == _chunk(step.out), (data, client_ids, limit)
    assert relay.token_count == k, (data, relay.token_count, k)
    assert relay.usage is None and relay.finish_reason is None and relay.engine_error is None, data
    assert not relay.pending and relay.events == 1
    return got


# -- generated engine events ---------------------------------------------------------------

_SPECIAL = '"\\\n\r\t\b\f\x00\x01\x1f\x7f/\u00e9\u2028\u2029\ufeff\U0001f600'
_TEXT = st.text(st.one_of(st.characters(codec="utf-8"), st.sampled_from(_SPECIAL)), max_size=12)
# the names the relay reads at the top and in a choice, also met where it must not read them
_NAMES = ["token_ids", "prompt_token_ids", "choices", "usage", "error", "finish_reason", "delta", "matched_stop", "x"]
_KEY = st.one_of(st.sampled_from(_NAMES), _TEXT)
_OFF = {"usage", "error", "finish_reason", "token_ids", "choices"}  # a top or choice member off the subset
_SAFE = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**17), 10**18 - 1) | _TEXT,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(_KEY, c, max_size=3),
    max_leaves=6,
)
_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | _TEXT | st.floats(allow_nan=False, allow_infinity=False),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(_KEY, c, max_size=3),
    max_leaves=6,
)
_IDS = st.lists(st.integers(0, 200_000), min_size=1, max_size=4)
_ODD_IDS = st.lists(
    st.one_of(st.integers(-3, 3), st.booleans(), st.floats(allow_nan=False), st.integers(10**17, 10**20), st.none(), _TEXT),
    max_size=3,
)


@st.composite
def engine_events(draw: st.DrawFn, clean: bool = False) -> dict[str, Any]:
    """A chunk of the usual shape; unless `clean`, with occasional turns off the subset."""
    odd = (lambda n: False) if clean else (lambda n: draw(st.integers(0, n - 1)) == 0)
    extras = _SAFE if clean else st.one_of(_SAFE, _SAFE, _SAFE, _ANY)
    members = st.dictionaries(_KEY.filter(lambda k: k not in _OFF) if clean else _KEY, extras, max_size=2)
    choices = []
    for i in range(draw(st.integers(1, 3))):
        delta: dict[str, Any] = {"content": draw(_TEXT)}
        if draw(st.booleans()):
            delta = draw(st.sampled_from([{}, {"reasoning_content": draw(_TEXT)}, {"role": "assistant", **delta}]))
        c: dict[str, Any] = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
        if odd(20):
            c["finish_reason"] = draw(st.sampled_from(["stop", "length", 0, ""]))
        if odd(16):
            c.update(draw(st.sampled_from([{}, {"token_ids": None}, {"token_ids": []}, {"token_ids": draw(_ODD_IDS)}])))
        else:
            c["token_ids"] = draw(_IDS)
        if draw(st.integers(0, 3)) == 0:
            c["prompt_token_ids"] = draw(st.one_of(_IDS, st.none(), _SAFE))
        for k, v in draw(members).items():
            c.setdefault(k, v)
        choices.append(c)
    obj: dict[str, Any] = {
        "id": draw(_TEXT), "object": "chat.completion.chunk", "created": draw(st.integers(0, 2**40)),
        "model": draw(_TEXT), "choices": choices,
    }
    if draw(st.integers(0, 3)) == 0:
        obj["prompt_token_ids"] = draw(_IDS)
    if odd(20):
        obj[draw(st.sampled_from(["usage", "error"]))] = draw(st.sampled_from([None, {"message": "x"}, {"prompt_tokens": 1}]))
    for k, v in draw(members).items():
        obj.setdefault(k, v)
    if draw(st.booleans()):
        obj = {k: obj[k] for k in draw(st.permutations(list(obj)))}
    return obj


_WS = ["", " ", "  ", "\t", " \t "]


def _spaced(v: Any, rnd: random.Random, ascii_: bool, odd: bool) -> str:
    """JSON with random insignificant whitespace; with `odd`, also LF/CR and repeated keys."""
    ws = _WS + ["\n", "\r\n"] if odd else _WS

    def w() -> str:
        return rnd.choice(ws) if rnd.random() < 0.3 else ""

    if isinstance(v, dict):
        items = [f"{w()}{json.dumps(k, ensure_ascii=ascii_)}{w()}:{w()}{_spaced(x, rnd, ascii_, odd)}{w()}" for k, x in v.items()]
        if items and odd and rnd.random() < 0.2:
            items.insert(rnd.randrange(len(items)), rnd.choice(items))
        return "{" + (",".join(items) or w()) + "}"
    if isinstance(v, list):
        return "[" + (",".join(f"{w()}{_spaced(x, rnd, ascii_, odd)}{w()}" for x in v) or w()) + "]"
    return json.dumps(v, ensure_ascii=ascii_)


def serialize(obj: dict[str, Any], mode: int, seed: int) -> bytes:
    if mode == 0:
        try:
            return orjson.dumps(obj)
        except TypeError:  # an integer past 64 bits: written as an engine would
            mode = 1
    if mode == 1:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    if mode == 2:  # SGLang's separators
        return json.dumps(obj, separators=(", ", ": "), ensure_ascii=False).encode()
    if mode == 3:
        return json.dumps(obj, ensure_ascii=True).encode()
    return _spaced(obj, random.Random(seed), mode == 4, mode == 5).encode()


_LIMIT = st.sampled_from([None, None, None, 0, 1])  # 0: one byte short of the short path


def _limit(body: bytes, slack: int | None) -> int:
    return BIG if slack is None else len(body) + slack  # the short path takes len(body) + 1


@given(
    engine_events(), st.sampled_from([0, 0, 1, 2, 3, 4, 4, 5]), st.integers(0, 2**32 - 1), st.booleans(), _LIMIT,
    st.sampled_from([b"%x", b"%X", b"%06x"]),
)
def test_answers_are_the_python_path(
    obj: dict[str, Any], mode: int, seed: int, client_ids: bool, slack: int | None, size: bytes
) -> None:
    body = serialize(obj, mode, seed)
    payload = b"data: " + body + b"\n\n"
    check(size % len(payload) + b"\r\n" + payload + b"\r\n", client_ids, _limit(body, slack))


@given(engine_events(clean=True), st.sampled_from([0, 1, 2]), st.booleans(), st.sampled_from([None, 1, 2]))
def test_clean_events_are_taken(obj: dict[str, Any], mode: int, client_ids: bool, slack: int | None) -> None:
    body = serialize(obj, mode, 0)
    assert check(_event(body), client_ids, _limit(body, slack)) is not None, body


@given(engine_events(), st.booleans(), st.booleans(), st.data())
def test_mutated_reads(obj: dict[str, Any], client_ids: bool, in_payload: bool, data: st.DataObject) -> None:
    buf = bytearray(b"data: " + serialize(obj, 0, 0) + b"\n\n")
    if not in_payload:
        buf = bytearray(_chunk(bytes(buf)))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(buf) - 1))
        op = data.draw(st.sampled_from(["flip", "set", "insert", "delete"]))
        if op == "flip":
            buf[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set":
            buf[i] = data.draw(st.sampled_from(b'"\\{}[],:\r\n 0-.eu\x00\x80\xff'))
        elif op == "insert":
            buf.insert(i, data.draw(st.integers(0, 255)))
        elif len(buf) > 1:
            del buf[i]
    read = _chunk(bytes(buf)) if in_payload else bytes(buf)
    check(read, client_ids, BIG)


@given(st.binary(max_size=300), st.booleans(), st.booleans(), st.integers(0, 400))
def test_random_bytes_never_raise(raw: bytes, framed: bool, client_ids: bool, limit: int) -> None:
    check(_event(raw) if framed else raw, client_ids, limit)


# -- tables --------------------------------------------------------------------------------

BASE = '{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null,"token_ids":[9906]}]}'
_P = b"data: " + BASE.encode() + b"\n\n"
SGLANG = '{"id": "5f2a", "object": "chat.completion.chunk", "created": 1782200500, "model": "Qwen/Qwen3-8B", "choices": [{"index": 0, "delta": {"content": "Paris"}, "logprobs": null, "finish_reason": null, "matched_stop": null, "token_ids": [12095, 13]}], "prompt_token_ids": [1, 2]}'


def _fixture_events() -> list[tuple[str, str]]:
    """Middle events of the fixture streams, made subset-shaped: usage key dropped, token
    IDs added where the fixture has none; events with floats (logprobs) left out."""
    rows = []
    for path in sorted(FIXTURES.glob("*.jsonl")):
        for n, line in enumerate(path.read_text().splitlines()):
            obj = json.loads(line) if line.strip() else None
            if not obj or "error" in obj or not obj.get("choices") or _has_float(obj):
                continue
            if any(c.get("finish_reason") is not None for c in obj["choices"]):
                continue
            obj.pop("usage", None)
            for i, c in enumerate(obj["choices"]):
                c["token_ids"] = c.get("token_ids") or [100 + i]
            rows.append((f"{path.stem}:{n}", orjson.dumps(obj).decode()))
    return rows


def _has_float(v: Any) -> bool:
    if isinstance(v, dict):
        return any(_has_float(x) for x in v.values())
    if isinstance(v, list):
        return any(_has_float(x) for x in v)
    return isinstance(v, float)


FIXTURE_EVENTS = _fixture_events()

TAKEN = [
    ("vllm", BASE),
    ("vllm prompt ids", BASE[:-1] + ',"prompt_token_ids":[1,2,3]}'),
    ("sglang separators", SGLANG),
    ("non-ascii", BASE.replace('"Hi"', '"我是助手 é \U0001f600 \u2028"')),
    ("escapes", BASE.replace('"Hi"', r'"say \"hi\"\n\\ \t\b\f\r \u0000\u001f"')),
    ("tool call arguments", BASE.replace('{"content":"Hi"}', r'{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\": \"Paris\"}"}}]}')),
    ("empty delta", BASE.replace('{"content":"Hi"}', "{}")),
    ("two choices", BASE.replace("]}]}", ']},{"index":1,"delta":{"content":"Yo"},"finish_reason":null,"token_ids":[1,2]}]}')),
    ("whitespace", BASE.replace(",", " ,\t").replace(":", ": ")[:-1] + "  }"),
    ("18 digits", BASE.replace('"created":1', '"created":999999999999999999')),
    ("negative int", BASE.replace('"created":1', '"created":-7')),
    ("past 8 KiB", BASE.replace('"Hi"', '"' + "\u00e9x" * 6000 + '"')),
    ("nested 40 deep", BASE[:-1] + ',"x":' + "[" * 40 + "]" * 40 + "}"),
    ("limit just enough", BASE),
    ("blanks around the object", " \t" + BASE + "\t "),
    ("escaped quote in a key, DEL, U+FFFF", BASE[:-1] + ',"a\\"b":"\x7f\uffff"}'),
    ("T10 names nested", BASE.replace('{"content":"Hi"}', '{"content":"Hi","token_ids":[1],"prompt_token_ids":2}')),
    *FIXTURE_EVENTS,
]


def test_fixture_rows_exist() -> None:
    assert len(FIXTURE_EVENTS) >= 30  # a moved or emptied fixture folder must not pass quietly


@pytest.mark.parametrize("client_ids", [True, False])
@pytest.mark.parametrize(("name", "body"), TAKEN, ids=[r[0] for r in TAKEN])
def test_taken(name: str, body: str, client_ids: bool) -> None:
    limit = len(body.encode()) + 1 if name == "limit just enough" else BIG
    assert check(_event(body), client_ids, limit) is not None


@pytest.mark.parametrize("size", [b"%X", b"%016x"])
def test_taken_any_hex_size(size: bytes) -> None:
    assert check(size % len(_P) + b"\r\n" + _P + b"\r\n", False, BIG) is not None  # the short path's sizes


@pytest.mark.parametrize("n", [63, 64, 65, 66])
def test_bounds_agree(n: int) -> None:
    """Nesting and member counts around the native bounds: taken or not, never different."""
    for body in (
        BASE[:-1] + ',"x":' + "[" * n + "]" * n + "}",
        BASE[:-1] + ',"x":' + '{"a":' * n + "1" + "}" * n + "}",
        BASE[:-1] + "".join(f',"k{i}":{i}' for i in range(n)) + "}",
    ):
        for client_ids in (True, False):
            check(_event(body), client_ids, BIG)


def test_exact_bytes() -> None:
    assert _fastevent.event(_event(BASE), True, BIG) == (
        b'b5\r\ndata: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
        b'"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null,"token_ids":[9906]}]}\n\n\r\n',
        1,
    )
    assert _fastevent.event(_event(BASE), False, BIG) == (
        b'a2\r\ndata: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
        b'"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}]}\n\n\r\n',
        1,
    )
    assert _fastevent.event(_event(SGLANG), False, BIG) == (
        b'd0\r\ndata: {"id":"5f2a","object":"chat.completion.chunk","created":1782200500,"model":"Qwen/Qwen3-8B",'
        b'"choices":[{"index":0,"delta":{"content":"Paris"},"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n\r\n',
        2,
    )


def _b(old: str, new: str) -> bytes:
    assert old in BASE
    return _event(BASE.replace(old, new, 1))


DECLINED = [
    ("[DONE]", _event("[DONE]")),
    ("error", _b('"id"', '"error":{"message":"boom"},"id"')),
    ("error null", _b('"id"', '"error":null,"id"')),
    ("usage", _b('"id"', '"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2},"id"')),
    ("usage null", _b('"id"', '"usage":null,"id"')),
    ("finish_reason", _b('"finish_reason":null', '"finish_reason":"stop"')),
    ("no token_ids", _b(',"token_ids":[9906]', "")),
    ("empty token_ids", _b("[9906]", "[]")),
    ("null token_ids", _b("[9906]", "null")),
    ("second choice without ids", _b("]}]}", ']},{"index":1,"delta":{},"finish_reason":null}]}')),
    ("no choices", _event('{"id":"c1","choices":[]}')),
    ("float", _b('"created":1', '"created":1.5')),
    ("exponent", _b('"created":1', '"created":1e3')),
    ("float id", _b("[9906]", "[9906.0]")),
    ("19 digits", _b('"created":1', '"created":1234567890123456789')),
    ("-0", _b('"created":1', '"created":-0')),
    ("boolean id", _b("[9906]", "[true]")),
    ("negative id", _b("[9906]", "[-1]")),
    ("duplicate top key", _b('"id":"c1"', '"id":"c1","id":"c2"')),
    ("duplicate nested key", _b('{"content":"Hi"}', '{"content":"Hi","content":"Ho"}')),
    ("escape \\/", _b('"Hi"', r'"a\/b"')),
    ("escape \\u0041", _b('"Hi"', r'"\u0041"')),
    ("escape \\u00e9", _b('"Hi"', r'"\u00e9"')),
    ("escape \\u001F", _b('"Hi"', r'"\u001F"')),
    ("escape \\u000a", _b('"Hi"', r'"\u000a"')),
    ("escape \\u0008", _b('"Hi"', r'"\u0008"')),
    ("escape \\u007f", _b('"Hi"', r'"\u007f"')),
    ("escape \\u2028", _b('"Hi"', r'"\u2028"')),
    ("escape surrogate pair", _b('"Hi"', r'"\ud83d\ude00"')),
    ("escape in a key", _b('"model"', r'"mod\u0065l"')),
    ("raw control character", _b('"Hi"', '"a\x01b"')),
    ("invalid UTF-8", _event(BASE.encode().replace(b'"Hi"', b'"a\xffb"'))),
    ("overlong UTF-8", _event(BASE.encode().replace(b'"Hi"', b'"\xc0\xaf"'))),
    ("UTF-8 surrogate", _event(BASE.encode().replace(b'"Hi"', b'"\xed\xa0\x80"'))),
    ("UTF-8 past U+10FFFF", _event(BASE.encode().replace(b'"Hi"', b'"\xf4\x90\x80\x80"'))),
    ("BOM", _event(b"\xef\xbb\xbf" + BASE.encode())),
    ("truncated UTF-8", _event(BASE.encode().replace(b'"Hi"', b'"\xe2\x80"'))),
    ("nested 100 deep", _event(BASE[:-1] + ',"x":' + "[" * 100 + "]" * 100 + "}")),
    ("missing brace", _event(BASE[:-1])),
    ("trailing comma", _b("[9906]", "[9906,]")),
    ("single quotes", _b('"Hi"', "'Hi'")),
    ("leading zero", _b("[9906]", "[09906]")),
    ("plus sign", _b('"created":1', '"created":+1')),
    ("form feed as blank", _b(',"model"', ',\f"model"')),
    ("NaN", _b('"created":1', '"created":NaN')),
    ("bad literal", _b("null", "nul")),
    ("top-level array", _event("[" + BASE + "]")),
    ("trailing garbage", _event(BASE + "x")),
    ("two objects", _event(BASE + BASE)),
    ("two chunks", _chunk(_P) + _chunk(_P)),
    ("chunk extension", b"%x;x=1\r\n%b\r\n" % (len(_P), _P)),
    ("blank after size", b"%x \r\n%b\r\n" % (len(_P), _P)),
    ("size line over 16", b"%017x\r\n%b\r\n" % (len(_P), _P)),
    ("partial chunk", _chunk(_P)[:-1]),
    ("short payload", _chunk(_P)[:-10]),
    ("chunk and last chunk", _chunk(_P) + b"0\r\n\r\n"),
    ("last chunk", b"0\r\n\r\n"),
    ("empty read", b""),
    ("split over two data lines", _chunk(b"data: " + BASE.replace(',"model"', '\ndata: ,"model"').encode() + b"\n\n")),
    ("CRLF event", _chunk(b"data: " + BASE.encode() + b"\r\n\r\n")),
    ("CR as JSON whitespace", _b(',"model"', ',\r"model"')),
    ("no space after colon", _chunk(b"data:" + BASE.encode() + b"\n\n")),
    ("comment first", _chunk(b": ping\n" + _P)),
    ("one LF", _chunk(_P[:-1])),
    ("three LFs", _chunk(_P + b"\n")),
    ("two events", _chunk(_P + _P)),
]


@pytest.mark.parametrize("client_ids", [True, False])
@pytest.mark.parametrize(("name", "read"), DECLINED, ids=[r[0] for r in DECLINED])
def test_declined(name: str, read: bytes, client_ids: bool) -> None:
    assert _fastevent.event(read, client_ids, BIG) is None


@pytest.mark.parametrize("client_ids", [True, False])
def test_declined_past_the_limit(client_ids: bool) -> None:
    n = len(BASE)  # the Python path takes len(json) + 1 <= limit by its short path
    assert _fastevent.event(_event(BASE), client_ids, n) is None
    assert check(_event(BASE), client_ids, n + 1) is not None
