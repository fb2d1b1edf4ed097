"""hyper.py item 19: a whole request's cycle in three steps (PreparedH11.next_whole,
send_head, send_end), with h11's own Connection as the oracle: whenever a step answers, the
request and body it reads, the bytes it writes and the state it leaves are h11's; whenever
it declines, it changed nothing. Then the step over real HTTP/1.1: a request read whole
reaches the app as one body message."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from types import FunctionType, SimpleNamespace
from typing import Any

import h11
import hypercorn.protocol.h11 as _h11mod
import orjson
import pytest
from hypercorn.config import Config as HyperConfig
from hypercorn.protocol.h11 import H11Protocol
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.http import hyper
from narwhal.http.h1fast import PreparedH11
from narwhal.http.hyper import HardenedH11Protocol
from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from tests.helpers import running_router

_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def _head(*lines: bytes, length: int | None = len(_BODY), method: bytes = b"POST", version: bytes = b"1.1") -> bytes:
    cl = [b"Content-Length: %d" % length] if length is not None else []
    return b"%s /v1/chat/completions HTTP/%s\r\n" % (method, version) + b"".join(x + b"\r\n" for x in (b"Host: 127.0.0.1:8000", *lines, *cl)) + b"\r\n"


_COMMON = _head(b"Accept: */*", b"Accept-Encoding: gzip, deflate", b"Connection: keep-alive", b"User-Agent: python-httpx/0.28.1", b"Content-Type: application/json")
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-request-id", b"r-1"), (b"date", b"Sat, 05 Dec 2026 05:00:00 GMT"), (b"server", b"hypercorn-h11")]


def _io(x: Any) -> Any:
    """A reader or writer as comparable data: a function itself, an object its type and fields."""
    if x is None or isinstance(x, FunctionType):
        return x
    return type(x), dict(vars(x))  # h11's reader and writer objects keep their fields in __dict__


def _state(c: h11.Connection) -> tuple[Any, ...]:
    cs = c._cstate
    return (
        dict(cs.states), cs.keep_alive, set(cs.pending_switch_proposals), c._request_method, c.their_http_version,
        c.client_is_waiting_for_100_continue, _io(c._reader), _io(c._writer), bytes(c._receive_buffer), c._receive_buffer_closed,
    )


def _pair(data: bytes) -> tuple[PreparedH11, h11.Connection]:
    mine = h11.Connection(h11.SERVER)
    PreparedH11.adopt(mine)
    theirs = h11.Connection(h11.SERVER)
    mine.receive_data(data)
    theirs.receive_data(data)
    assert isinstance(mine, PreparedH11)
    return mine, theirs


def _h11_whole(c: h11.Connection) -> tuple[h11.Request, bytes]:
    """h11's own: the Request, its Data to EndOfMessage."""
    req = c.next_event()
    assert isinstance(req, h11.Request), req
    body = b""
    while True:
        ev = c.next_event()
        if isinstance(ev, h11.EndOfMessage):
            return req, body
        assert isinstance(ev, h11.Data), ev
        body += ev.data


def _same_read(data: bytes) -> tuple[PreparedH11, h11.Connection] | None:
    """next_whole against h11 on `data`: the pair after it answered, or None (it declined,
    and changed nothing)."""
    mine, theirs = _pair(data)
    before = _state(mine)
    got = mine.next_whole()
    if got is None:
        assert _state(mine) == before
        return None
    req, body = got
    if body is None:  # the head alone: the body still coming
        ref = theirs.next_event()
        assert isinstance(ref, h11.Request)
    else:
        ref, ref_body = _h11_whole(theirs)
        assert body == ref_body and type(body) is bytes
    assert (req.method, req.target, req.http_version) == (ref.method, ref.target, ref.http_version)
    assert req.headers._full_items == ref.headers._full_items
    assert _state(mine) == _state(theirs)
    assert mine.next_event() == theirs.next_event()  # what comes after: PAUSED or NEED_DATA
    return mine, theirs


@pytest.mark.parametrize(
    "data",
    [
        _COMMON + _BODY,
        _COMMON + _BODY + b"POST / HTTP/1.1\r\n",  # a pipelined request begins after it
        _COMMON + _BODY + _COMMON + _BODY,  # a whole second one: left for the next cycle
        _head(length=0),
        _head(b"connection: Keep-Alive") + _BODY,
        _head(b"X-Empty:", b"X-Pad:   a  b\t ") + _BODY,
        _head(b"Authorization: Bearer k") + _BODY,
    ],
)
def test_a_whole_request_is_read_as_h11_reads_it(data: bytes) -> None:
    pair = _same_read(data)
    assert pair is not None and pair[0]._cstate.states[h11.CLIENT] is h11.DONE


@pytest.mark.parametrize("cut", [0, 1, len(_BODY) - 1])
@pytest.mark.parametrize("pieces", [1, 2, 3])
def test_a_body_that_comes_after_its_head_is_read_as_h11_reads_it(cut: int, pieces: int) -> None:
    """httpx writes a request's head and its body apart: the head is read in one step (the
    client to SEND_BODY), and the rest of the body, once all of it is in the buffer, in one
    more (next_rest: h11's Data and EndOfMessage); until then next_rest declines and
    changes nothing, and h11 reads what is there."""
    pair = _same_read(_COMMON + _BODY[:cut])
    assert pair is not None
    mine, theirs = pair
    assert mine._cstate.states[h11.CLIENT] is h11.SEND_BODY
    rest = _BODY[cut:]
    step = -(-len(rest) // pieces)
    for i in range(0, len(rest), step):
        piece = rest[i : i + step] + (b"POST / HT" if i + step >= len(rest) else b"")  # a pipelined head after it
        mine.receive_data(piece)
        theirs.receive_data(piece)
        before = _state(mine)
        got = mine.next_rest()
        if got is None:  # not all of it yet: h11 reads what came, on both sides
            assert _state(mine) == before
            assert mine.next_event() == theirs.next_event()
            continue
        data = b""
        while True:
            ev = theirs.next_event()
            if isinstance(ev, h11.EndOfMessage):
                break
            data += ev.data
        assert got == data and type(got) is bytes
        assert _state(mine) == _state(theirs)
        assert mine.next_event() == theirs.next_event() == h11.PAUSED
        break
    else:
        raise AssertionError("the body was never read")


@pytest.mark.parametrize(
    "data",
    [
        _head(b"Expect: 100-continue") + _BODY,  # read by h11, a 100 Continue owed: declined
        _head(b"Transfer-Encoding: chunked", length=None) + b"5\r\nhello\r\n0\r\n\r\n",
        _head(b"Connection: close") + _BODY,
    ],
)
def test_the_rest_of_any_other_body_is_h11s(data: bytes) -> None:
    mine, theirs = _pair(data)
    assert mine.next_whole() is None
    assert isinstance(mine.next_event(), h11.Request) and isinstance(theirs.next_event(), h11.Request)
    before = _state(mine)
    assert mine.next_rest() is None
    assert _state(mine) == before


@pytest.mark.parametrize(
    "data",
    [
        _COMMON[:-2],  # the head not whole
        _head(b"Expect: 100-continue") + _BODY,
        _head(b"Upgrade: h2c", b"Connection: Upgrade, HTTP2-Settings", b"HTTP2-Settings: AAMAAABkAAQAAP__") + _BODY,
        _head(b"Upgrade: websocket") + _BODY,
        _head(b"Connection: close") + _BODY,
        _head(b"Connection: keep-alive, close") + _BODY,
        _head(length=None) + _BODY,  # no Content-Length: h11 reads an empty body
        _head(b"Transfer-Encoding: chunked", length=None) + b"5\r\nhello\r\n0\r\n\r\n",
        _head(method=b"GET", length=None),
        _head(method=b"PUT") + _BODY,
        _head(version=b"1.0") + _BODY,
        _head(b"Content-Length: 3") + _BODY,  # two lengths: h11's error to give
        b"POST / HTTP/1.1\r\nHost: x\r\n folded\r\ncontent-length: 0\r\n\r\n",  # obs-fold
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ],
)
def test_anything_else_is_declined_and_changes_nothing(data: bytes) -> None:
    assert _same_read(data) is None


def test_nothing_is_read_whole_once_a_cycle_has_begun() -> None:
    mine, theirs = _pair(_COMMON + _BODY + _COMMON + _BODY)
    assert mine.next_whole() is not None
    assert mine.next_whole() is None  # the client is DONE: the next cycle is h11's to start
    mine.send(h11.Response(status_code=200, headers=[(b"content-length", b"0")]))
    mine.send(h11.EndOfMessage())
    mine.start_next_cycle()
    got = mine.next_whole()  # a new cycle: the pipelined request, whole
    assert got is not None and got[1] == _BODY


@pytest.mark.parametrize("ahead", [False, True], ids=["send_head", "built_ahead"])
@pytest.mark.parametrize("status", [200, 201, 400, 404, 429, 500, 503])
@pytest.mark.parametrize("headers", [_SSE, [], [(b"X-Mixed-Case", b"v"), (b"x-empty", b"")]])
def test_the_head_and_end_are_written_as_h11_writes_them(status: int, headers: list[tuple[bytes, bytes]], ahead: bool) -> None:
    pair = _same_read(_COMMON + _BODY + b"POST")
    assert pair is not None
    mine, theirs = pair
    if ahead:  # item 21: built whatever the state (head_bytes), written later (send_prepared)
        built = PreparedH11.head_bytes(status, headers)
        assert built is not None
        head = mine.send_prepared(built)
    else:
        head = mine.send_head(status, headers)
    ref = theirs.send(h11.Response(status_code=status, headers=headers))  # h11's clean-up: chunked framing
    assert head == ref
    assert _state(mine) == _state(theirs)
    chunk = mine.send(h11.Data(data=b"data: x\n\n"))
    assert chunk == theirs.send(h11.Data(data=b"data: x\n\n"))
    end = mine.send_end()
    assert end == theirs.send(h11.EndOfMessage()) == b"0\r\n\r\n"
    assert _state(mine) == _state(theirs)
    mine.start_next_cycle()
    theirs.start_next_cycle()
    assert _state(mine) == _state(theirs)


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        (204, _SSE),
        (304, _SSE),
        (101, _SSE),
        (100, []),
        (200, [(b"Host", b"x")]),
        (200, [(b"content-length", b"5")]),
        (200, [(b"Transfer-Encoding", b"chunked")]),
        (200, [(b"connection", b"close")]),
    ],
)
def test_a_head_h11_would_change_is_declined_and_changes_nothing(status: int, headers: list[tuple[bytes, bytes]]) -> None:
    mine, _ = _pair(_COMMON + _BODY)
    assert mine.next_whole() is not None
    before = _state(mine)
    assert mine.send_head(status, headers) is None
    assert PreparedH11.head_bytes(status, headers) is None  # nothing built ahead either
    assert _state(mine) == before


def test_head_and_end_decline_outside_their_state() -> None:
    mine, _ = _pair(_COMMON)  # the body not read: the client is still sending it
    assert mine.next_whole() is not None
    before = _state(mine)
    assert mine.send_head(200, _SSE) is None and mine.send_end() is None
    assert mine.send_prepared(PreparedH11.head_bytes(200, _SSE) or b"") is None  # a head built ahead: declined alike
    assert _state(mine) == before
    # read by h11 event by event (not next_whole): the head is still written the short way
    mine, theirs = _pair(_COMMON + _BODY)
    _h11_whole(mine)
    _h11_whole(theirs)
    assert mine.send_head(200, _SSE) == theirs.send(h11.Response(status_code=200, headers=_SSE))
    before = _state(mine)
    assert mine.send_head(200, _SSE) is None  # once only
    assert mine.send_prepared(PreparedH11.head_bytes(200, _SSE) or b"") is None
    assert _state(mine) == before
    # a body not chunked (h11's own Response with a length): send_end declines
    mine, _ = _pair(_COMMON + _BODY)
    mine.next_whole()
    mine.send(h11.Response(status_code=200, headers=[(b"content-length", b"2")]))
    mine.send(h11.Data(data=b"ok"))
    before = _state(mine)
    assert mine.send_end() is None
    assert _state(mine) == before


_NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.!#$%&'*+^`|~", min_size=1, max_size=12)
_VALUE = st.binary(min_size=0, max_size=24).map(lambda b: bytes(c for c in b if 0x21 <= c <= 0x7E or c >= 0x80))


@settings(max_examples=300, deadline=None)
@given(
    fields=st.lists(st.tuples(_NAME, _VALUE, st.sampled_from([b"", b" ", b"\t", b"  "])), max_size=8),
    body=st.binary(max_size=64),
    short=st.integers(min_value=0, max_value=3),
    after=st.sampled_from([b"", b"P", b"POST / HTTP/1.1\r\n", b"\r\n"]),
    status=st.sampled_from([200, 204, 400, 503]),
    resp=st.lists(st.tuples(_NAME, _VALUE), max_size=5),
)
def test_any_request_and_head_is_as_h11_reads_and_writes_it(
    fields: list[tuple[str, bytes, bytes]], body: bytes, short: int, after: bytes, status: int, resp: list[tuple[str, bytes]]
) -> None:
    lines = [b"%s:%s%s%s" % (n.encode(), ws, v, ws) for n, v, ws in fields]
    data = _head(*lines, length=len(body)) + body
    data = data[: len(data) - short] if short else data + after
    pair = _same_read(data)
    if pair is None:
        return
    mine, theirs = pair
    headers = [(n.encode(), v) for n, v in resp]
    head = mine.send_head(status, headers)
    if head is None:
        return
    assert head == theirs.send(h11.Response(status_code=status, headers=headers))
    assert _state(mine) == _state(theirs)
    assert mine.send_end() == theirs.send(h11.EndOfMessage())
    assert _state(mine) == _state(theirs)


@pytest.mark.parametrize("names", [[], ["127.0.0.1:8000"]], ids=["start_whole", "server-names"])
@pytest.mark.parametrize("raw", [False, True], ids=["lower", "raw-names"])
@pytest.mark.parametrize("data", [
    _COMMON + _BODY,
    _head(b"X-Mixed: A", b"connection: Keep-Alive", length=0),
    _head(length=0).replace(b"/v1/chat/completions", b"/v1/chat%2Fcompletions?x=1&y=%20"),
])
def test_the_stream_is_made_as_hypercorn_makes_it(monkeypatch: pytest.MonkeyPatch, data: bytes, raw: bool, names: list[str]) -> None:
    """HardenedH11Protocol._create_whole makes the stream hypercorn's _create_stream would
    (the server's stream class, installed by hyper.install): the same scope handed to the
    app, and the request counted as it counts it -- by HardenedHTTPStream.start_whole
    (item 22), or, with server names to check, by hypercorn's own handle."""
    monkeypatch.setattr(_h11mod, "HTTPStream", hyper.HardenedHTTPStream)  # as hyper.install() leaves it
    lean: list[int] = []
    start_whole = hyper.HardenedHTTPStream.start_whole

    async def counted(self: Any, *args: Any) -> None:
        lean.append(1)
        await start_whole(self, *args)

    monkeypatch.setattr(hyper.HardenedHTTPStream, "start_whole", counted)

    def run(method: Any) -> tuple[Any, ...]:
        spawned: list[Any] = []
        marked: list[int] = []

        async def spawn_app(app: Any, config: Any, scope: Any, send: Any) -> Any:
            spawned.append((app, scope))
            return None

        async def mark() -> None:
            marked.append(1)

        config = HyperConfig()
        config.h11_pass_raw_headers = raw
        config.server_names = names
        conn, _ = _pair(data)
        got = conn.next_whole()
        assert got is not None
        proto = SimpleNamespace(app="app", config=config, context=SimpleNamespace(mark_request=mark), task_group=SimpleNamespace(spawn_app=spawn_app),
                                ssl=False, client=("10.0.0.1", 1), server=("10.0.0.2", 2), stream_send="send", connection_state={"k": 1},
                                keep_alive_requests=3, stream=None, connection=conn)
        asyncio.run(method(proto, got[0]))
        st = proto.stream
        assert type(st) is hyper.HardenedHTTPStream and len(spawned) == 1
        app, scope = spawned[0]
        ext = dict(scope["extensions"])
        assert isinstance(ext.pop(hyper.CLOSE), hyper.CloseHook)
        return app, {**scope, "extensions": ext}, st.state, st.closed, st.stream_id, proto.keep_alive_requests, marked

    assert run(HardenedH11Protocol._create_whole) == run(H11Protocol._create_stream)
    assert lean == ([] if names else [1])  # hypercorn's _create_stream never takes it


# -- over real HTTP/1.1 ------------------------------------------------------------------


@pytest.fixture(scope="module")
def router() -> Iterator[str]:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0", timing=Timing(time_scale=0.25))]) as mocks:
        specs = [EngineSpec(m.name, m.url, "unified", "vllm", None, None) for m in mocks]
        cfg = {"admission": {"mode": "open", "prediction": {"profile_on_start": False}}}
        with running_router(cfg, specs) as rr:
            yield rr.url


def test_over_http1_requests_are_read_whole_answered_and_the_connection_reused(router: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A keep-alive client sends streaming and non-streaming requests, a refused one, and
    one whose head and body it writes apart, on one connection: each is read the short
    way, the streams' heads and ends are written the short way, and the connection goes on
    to the next request."""
    n = {"whole": 0, "head": 0, "end": 0, "rest": 0, "ahead": 0}
    whole, head, end, rest = PreparedH11.next_whole, PreparedH11.send_head, PreparedH11.send_end, PreparedH11.next_rest
    ahead = PreparedH11.send_prepared
    host = router.removeprefix("http://").encode()
    mine: set[int] = set()  # the router's client connections (the mock engine serves with them too)

    def counting(key: str, f: Any) -> Any:
        def g(self: PreparedH11, *a: Any) -> Any:
            got = f(self, *a)
            if key == "whole" and got is not None and (b"host", host) in {(k, v) for _, k, v in got[0].headers._full_items}:  # type: ignore[union-attr]
                mine.add(id(self))
            n[key] += got is not None and id(self) in mine
            return got

        return g

    monkeypatch.setattr(PreparedH11, "next_whole", counting("whole", whole))
    monkeypatch.setattr(PreparedH11, "send_head", counting("head", head))
    monkeypatch.setattr(PreparedH11, "send_end", counting("end", end))
    monkeypatch.setattr(PreparedH11, "next_rest", counting("rest", rest))
    monkeypatch.setattr(PreparedH11, "send_prepared", counting("ahead", ahead))
    body = {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    port = int(router.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        client = h11.Connection(h11.CLIENT)
        for req, status, apart in (({**body, "stream": True}, 200, False), ({**body, "stream": False}, 200, False), ({**body, "stream": True}, 200, False),
                                   ({**body, "max_tokens": -1}, 400, False), ({**body, "stream": True}, 200, True), ({**body, "stream": True}, 200, False)):
            raw = orjson.dumps(req)
            head = [(b"host", host), (b"content-type", b"application/json"), (b"content-length", b"%d" % len(raw)), (b"connection", b"keep-alive")]
            wire = client.send(h11.Request(method="POST", target="/v1/chat/completions", headers=head))
            if apart:  # the head, then the body: as httpx writes them
                sock.sendall(wire)
                time.sleep(0.1)
                wire = b""
            # else the head and body in one write, as the bench's client sends them
            sock.sendall(wire + client.send(h11.Data(data=raw)) + client.send(h11.EndOfMessage()))
            resp, got = None, b""
            for _ in range(1000):
                ev = client.next_event()
                if ev is h11.NEED_DATA:
                    client.receive_data(sock.recv(65536))
                elif isinstance(ev, h11.Response):
                    resp = ev
                elif isinstance(ev, h11.Data):
                    got += ev.data
                elif isinstance(ev, h11.EndOfMessage):
                    break
            assert resp is not None and resp.status_code == status
            if status == 400:
                assert orjson.loads(got)["error"]["code"]
            elif req["stream"]:
                assert got.rstrip().endswith(b"data: [DONE]")
            else:
                assert orjson.loads(got)["choices"][0]["finish_reason"] == "length"
            client.start_next_cycle()  # the same connection goes on
    assert n["whole"] == 6 and n["rest"] == 1  # every head, and the body that came apart
    # the four streams' heads, each built while its engine worked (item 21; at start
    # instead where a second ended in between: hypercorn's Date), and their ends
    assert n["ahead"] + n["head"] == 4 and n["ahead"] >= 1 and n["end"] == 4
