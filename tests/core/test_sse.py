"""SSE parsing, fed whole, one byte at a time, and in random splits (docs/style.md P10)."""

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


# The common read (one whole event of one `data: ` line, nothing held) takes a shorter
# path in `feed`; each of these must come out exactly as the general loop gives it: the
# same read preceded by an empty read that sets no state is not the shortcut's business,
# so the oracle is the same bytes fed as two pieces (which always takes the loop).
SHORTCUT_EDGES = [
    b"data: x\n\n",  # the shortcut
    b"data: \n\n",  # an empty payload
    b"data:x\n\n",  # no space: the loop
    b"data: a\ndata: b\n\n",  # two lines: the loop
    b"data: a\n\ndata: b\n\n",  # two events: the loop
    b"data: a\r\n\r\n",  # CR: the loop
    b"data: a\rb\n\n",  # a CR inside: the loop (CR ends the line)
    b"data: a\n",  # unfinished
    b": c\ndata: a\n\n",  # a comment first
    b"data: " + b"y" * 16 + b"\n\n",  # at the bound below (16 bytes + its LF = 17)
    b"data: " + b"y" * 17 + b"\n\n",  # one past it: too large
]


@pytest.mark.parametrize("wire", SHORTCUT_EDGES)
@pytest.mark.parametrize("before", [b"", b"data: held\n", b"data: held", b"\r"])
def test_the_common_read_shortcut_is_the_loop(wire: bytes, before: bytes) -> None:
    fast, slow = SSEParser(max_event_bytes=17), SSEParser(max_event_bytes=17)
    got_fast = fast.feed(before) + fast.feed(wire) if before else fast.feed(wire)
    got_slow = slow.feed(before) + slow.feed(wire[:1]) + slow.feed(wire[1:])
    assert (got_fast, fast.too_large, fast.pending) == (got_slow, slow.too_large, slow.pending)
