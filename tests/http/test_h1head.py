"""The common request head read the short way (narwhal/http/h1/head.py), with h11 as the
oracle: whenever the short way answers, h11 answers the same request and takes the same
bytes (whole connections against h11: tests/http/test_h1conn.py)."""

from __future__ import annotations

from typing import Any

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.http import _fasthead
from narwhal.http.h1.head import HEAD_MAX, SCAN, parse_head, request_of, scan

_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
_COMMON = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept: */*\r\nAccept-Encoding: gzip, deflate\r\n"
    b"Connection: keep-alive\r\nUser-Agent: python-httpx/0.28.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(_BODY)
)


def _h11(data: bytes) -> tuple[Any, bytes]:
    """h11's server connection on `data`: (its Request, or its other event, or the error's
    type; what is left of the bytes once it has read the head)."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    try:
        got: Any = conn.next_event()
    except h11.RemoteProtocolError as e:
        got = type(e)
    return got, conn.trailing_data[0]


def _same_as_h11(data: bytes) -> bool:
    """The short way's answer is h11's, by each scan, the reference in Python and the one
    in C, which answer alike; True when they answered (False: they left it to h11)."""
    compiled = _fasthead.head(data, HEAD_MAX)
    assert compiled == scan(data), data
    assert compiled == scan(bytearray(data)) == _fasthead.head(bytearray(data), HEAD_MAX)  # the receive buffer is a bytearray
    mine = request_of(compiled)
    assert (mine is None) == (parse_head(data) is None)
    if mine is None:
        return False
    req, n = mine
    theirs, rest = _h11(data)
    assert isinstance(theirs, h11.Request), (data, theirs)
    assert (req.method, req.target, req.http_version) == (theirs.method, theirs.target, theirs.http_version)
    assert [(r, v) for r, _, v in req.headers] == list(theirs.headers.raw_items())  # raw names, values
    assert [(n, v) for _, n, v in req.headers] == list(theirs.headers)  # lower names, values
    assert data[n:] == rest
    return True


@pytest.mark.parametrize(
    "data",
    [
        _COMMON + _BODY,
        _COMMON,
        b"GET /ready HTTP/1.1\r\nhost: x\r\n\r\n",
        b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: x\r\nX-Empty:\r\nX-Pad:   a  b\t \r\ncontent-length: 0\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nX-Obs: caf\xc3\xa9 \xff\r\n\r\nPOST / HTTP/1.1\r\n",  # obs-text; a pipelined head after
    ],
    ids=["common_with_body", "common", "get", "empty_and_padded_values", "obs_text_and_pipelined"],
)
def test_the_common_heads_take_the_short_way_and_read_as_h11_reads_them(data: bytes) -> None:
    assert _same_as_h11(data)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"POST / HTTP/1.1\r\nHost: x\r\n", "not whole yet"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * HEAD_MAX + b"\r\n\r\n", "past HEAD_MAX"),
        (b"PUT / HTTP/1.1\r\nHost: x\r\n\r\n", "another method"),
        (b"CONNECT x:1 HTTP/1.1\r\nHost: x\r\n\r\n", "CONNECT"),
        (b"POST / HTTP/1.0\r\n\r\n", "HTTP/1.0"),
        (b"\r\nPOST / HTTP/1.1\r\nHost: x\r\n\r\n", "a blank line first"),
        (b"POST / HTTP/1.1\nHost: x\r\n\r\n", "a bare LF"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n", "obs-fold"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n\r\n", "a control byte h11 takes"),
        (b"POST / HTTP/1.1\r\nHost : x\r\n\r\n", "space before the colon"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", "chunked"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n", "two Content-Lengths"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: +2\r\n\r\n", "a signed length"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"1" * 21 + b"\r\n\r\n", "21 digits"),
        (b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n", "no Host"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", "two Hosts"),
        (b"POST /\x7f HTTP/1.1\r\nHost: x\r\n\r\n", "DEL in the target"),
        (b"POST  / HTTP/1.1\r\nHost: x\r\n\r\n", "two spaces"),
    ],
)
def test_anything_else_is_left_to_h11(data: bytes, why: str) -> None:
    assert parse_head(data) is None, why
    assert not _same_as_h11(data), why


def test_the_router_scans_heads_in_c_where_it_was_built() -> None:
    assert SCAN is _fasthead.head  # the README's install builds it (setup.py)
    assert _fasthead.head(_COMMON[:-1], HEAD_MAX) is None
    assert _fasthead.head(_COMMON, len(_COMMON) - 1) is None and _fasthead.head(_COMMON, len(_COMMON)) is not None  # within head_max, its blank line included
    method, target, fields, n = _fasthead.head(_COMMON + _BODY, HEAD_MAX)
    assert (method, target, n) == (b"POST", b"/v1/chat/completions", len(_COMMON))
    assert fields[0] == (b"Host", b"host", b"127.0.0.1:8000") and fields[-1] == (b"Content-Length", b"content-length", b"%d" % len(_BODY))


_TOKEN = st.text(alphabet="-!#$%&'*+.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=12).map(str.encode)
_MOSTLY = {"method": [b"POST"] * 30 + [b"GET"] * 10 + [b"PUT", b"post", b"CONNECT", b""],
           "target": [b"/v1/chat/completions"] * 30 + [b"/", b"*", b"/a?b=c"] * 3 + [b"", b"/\x80", b"/a b"],
           "version": [b"HTTP/1.1"] * 40 + [b"HTTP/1.0", b"HTTP/2.0", b"http/1.1"],
           "colon": [b": "] * 30 + [b":", b":\t"] * 3 + [b" :", b""],
           "trail": [b""] * 6 + [b" ", b"\t "],
           "eol": [b"\r\n"] * 60 + [b"\n"]}
# values: mostly visible bytes and inner spaces; one in ten anything, CR and LF included
_VISIBLE = st.lists(st.one_of(st.integers(0x21, 0x7E), st.just(0x20)), max_size=16).map(lambda b: bytes(b).strip())
_ANY = st.lists(st.one_of(st.integers(0x21, 0x7E), st.sampled_from([0x20, 0x09, 0x80, 0xFF, 0x00, 0x01, 0x7F, 0x0D, 0x0A])), max_size=16).map(bytes)
_VALUE = st.integers(0, 9).flatmap(lambda k: _ANY if k == 0 else _VISIBLE)
_NAMES = st.sampled_from([b"Transfer-Encoding", b"Expect", b"Connection", b"Host", b"Upgrade"])
_LENGTH = st.tuples(st.sampled_from([b"Content-Length", b"content-length"]), st.just(b": "),
                    st.one_of(st.integers(0, 10**6).map(lambda n: str(n).encode()), _VALUE), st.just(b""))
_FIELD = st.integers(0, 9).flatmap(lambda k: _LENGTH if k == 0 else st.tuples(
    _NAMES if k == 1 else _TOKEN, st.sampled_from(_MOSTLY["colon"]), _VALUE, st.sampled_from(_MOSTLY["trail"])))



@st.composite
def _heads(draw: st.DrawFn) -> bytes:
    """Mostly the common head, each part now and then what the short way leaves to h11."""
    pick = {k: draw(st.sampled_from(v)) for k, v in _MOSTLY.items()}
    fields = draw(st.lists(_FIELD, max_size=6))
    if draw(st.integers(0, 9)):  # nearly always a Host
        fields.insert(draw(st.integers(0, len(fields))), (b"Host", b": ", b"127.0.0.1:8000", b""))
    eol = pick["eol"]
    head = pick["method"] + b" " + pick["target"] + b" " + pick["version"] + eol
    for name, colon, value, trail in fields:
        head += name + colon + value + trail + draw(st.sampled_from(_MOSTLY["eol"]))
    return head + eol + draw(st.sampled_from([b"", b"{}", b"GET / HTTP/1.1\r\n"]))


@given(_heads())
def test_whatever_the_head_the_short_way_answers_only_as_h11_does(data: bytes) -> None:
    _same_as_h11(data)


@given(st.binary(max_size=200))
def test_whatever_the_bytes_the_short_way_answers_only_as_h11_does(data: bytes) -> None:
    _same_as_h11(b"POST / HTTP/1.1\r\nHost: x\r\n" + data)
