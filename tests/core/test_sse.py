"""SSE parsing, fed whole, one byte at a time, and in random splits (STYLE.md P10)."""

from __future__ import annotations

import random

import pytest

from narwhal.core.sse import SSEParser

CASES = [
    # (wire bytes, payloads)
    (b'data: {"a":1}\n\n', [b'{"a":1}']),
    (b'data: {"a":1}\r\n\r\n', [b'{"a":1}']),
    (b'data: {"a":1}\r\rdata: x\r\r', [b'{"a":1}', b"x"]),
    (b"data:no-space\n\n", [b"no-space"]),
    (b"data: two\ndata: lines\n\n", [b"two\nlines"]),
    (b": comment\nevent: message\nid: 7\nretry: 10\ndata: x\n\n", [b"x"]),
    (b"event: ping\n\n", []),  # no data line: nothing dispatched
    (b"data: [DONE]\n\n", [b"[DONE]"]),
    (b"data: a\n\ndata: b\n\ndata: [DONE]\n\n", [b"a", b"b", b"[DONE]"]),
    (b"data: incomplete\n", []),  # no blank line yet
    (b'data: {"s":"\xc3\xa9"}\n\n', [b'{"s":"\xc3\xa9"}']),
]


@pytest.mark.parametrize(("wire", "want"), CASES)
def test_whole(wire: bytes, want: list[bytes]) -> None:
    assert SSEParser().feed(wire) == want


@pytest.mark.parametrize(("wire", "want"), CASES)
def test_one_byte_at_a_time(wire: bytes, want: list[bytes]) -> None:
    p = SSEParser()
    got: list[bytes] = []
    for i in range(len(wire)):
        got += p.feed(wire[i : i + 1])
    assert got == want


@pytest.mark.parametrize(("wire", "want"), CASES)
def test_random_splits(wire: bytes, want: list[bytes]) -> None:
    rnd = random.Random(len(wire))
    for _ in range(20):
        p = SSEParser()
        got: list[bytes] = []
        i = 0
        while i < len(wire):
            j = min(len(wire), i + rnd.randint(1, 7))
            got += p.feed(wire[i:j])
            i = j
        assert got == want


def test_trailing_garbage_is_held_not_dispatched() -> None:
    p = SSEParser()
    assert p.feed(b"data: a\n\ndata: partial") == [b"a"]
    assert p.pending
    assert p.feed(b"\n\n") == [b"partial"]
    assert not p.pending


def test_crlf_split_across_chunks() -> None:
    p = SSEParser()
    assert p.feed(b"data: a\r") == []
    assert p.feed(b"\n\r") == [b"a"]  # CRLF then CR: the blank line
    assert p.feed(b"\n") == []  # the LF completing that CRLF adds nothing
    assert not p.pending
