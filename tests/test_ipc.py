"""narwhal/ipc.py: every message round-trips; every malformed frame is a protocol error;
the channel reassembles frames split across reads and coalesces a turn's writes."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from narwhal import ipc
from narwhal.core.tickets import Refuse
from narwhal_generated import errors as E

# one example of every message, with every field set (None where the field allows it)
EXAMPLES: list[Any] = [
    ipc.Hello(0, {"serving": {"model": "m"}}, [{"name": "u0", "url": "http://h:1", "role": "unified", "dialect": "vllm", "wave": None, "model": None, "max_concurrency": None}]),
    ipc.Arrived(7, None),
    ipc.Arrived(8, Refuse(E.R02, fields={"limit": 4})),
    ipc.Admitted(7, 120, 35.5, 64.0, "u0", "unified"),
    ipc.Admitted(9, 120, None, 0.0, None, None),
    ipc.Granted(9, "d0", "decode"),
    ipc.Refused(9, Refuse(E.R12, None, {"waited_ms": 5000, "limit": 5000})),
    ipc.Refused(10, Refuse(E.R10, 1.25, {"projected_ms": 2400, "budget_ms": 1000, "retry_after": 2})),
    ipc.NoRetry(11),
    ipc.Answer(1, [200, {"ready": True}], None),
    ipc.Answer(2, None, "RuntimeError: x"),
    ipc.Scrape(3),
    ipc.Facts("u0", ["tokenize+template", "/extras/tokenize/count", [3, 5, 4, 2, 1]]),
    ipc.Facts("u9", ["spec", {"name": "u9", "url": "http://127.0.0.1:9", "role": "unified", "dialect": "vllm", "wave": None, "model": None,
                              "max_concurrency": None, "kv_events": None, "kv_block_size": 16}]),
    ipc.Facts("u9", ["cut"]),
    ipc.Reconfigure({"admission": {"queue_limit": 20}}),
    ipc.Up(1, 4242),
    ipc.Arrive(7, 1234.5),
    ipc.Arrive(9, 1234.5, Refuse(E.R16)),
    ipc.Arrive(10, 1234.5, None, "acme"),
    ipc.Admit(7, "chat", 2048, None, 64, 1000.0, 1234.5, None, [-3, 99, 1 << 62], [5, -6]),
    ipc.Admit(8, "completion", 10, 3, None, 250.0, 1234.5, 2.5, [], []),
    ipc.Admit(9, "chat", 10, None, None, 250.0, 1234.5, None, [], [], "acme", "k-1"),
    ipc.Admit(10, "chat", 10, None, None, 250.0, 1234.5, None, [], [], None, None,
              (Refuse(E.R05, fields={"model": "x", "configured": "m"}, param="model"), Refuse(E.R06, param="n"))),
    ipc.Admit(11, "", 0, None, None, 0.0, 0.0, None, [], [], None, None, (Refuse(E.R03, fields={"limit": 9}),), False),
    ipc.WantDecode(7),
    ipc.Retry(7, "d0", E.E03, "decode", 1235.0),
    ipc.PrefillDone(7, 1234.6, True),
    ipc.FirstToken(7, 1234.7, True),
    ipc.Close(7, 1236.0, "d1", None, None, 0.012, "d1", 64, "length", 512, 256),
    ipc.Close(8, 1236.0, None, "d0", E.E06, None, None, None, None, None, None),
    ipc.End(7, "completed"),
    ipc.Call(4, "drain", ["u0", True]),
    ipc.Call(5, "put_engine", [{"name": "u9", "url": "http://127.0.0.1:9"}]),
    ipc.Call(6, "reload", []),
    ipc.Families(3, [["narwhal_ttft_seconds", "TTFT", "histogram", "", [["narwhal_ttft_seconds_count", {"route": "chat", "worker": "1"}, 3.0]]]]),
    ipc.Penalise("127.0.0.2", 10.0),
]


def test_every_message_type_has_an_example() -> None:
    assert {type(m) for m in EXAMPLES} == set(ipc.MESSAGES.values())


def test_tags_are_unique_and_stable() -> None:
    assert len(ipc.MESSAGES) == len({c.TAG for c in ipc.MESSAGES.values()})
    # authority -> worker below 20, worker -> authority from 20: a reader sees the direction
    assert all(c.TAG < 20 for c in (ipc.Hello, ipc.Arrived, ipc.Admitted, ipc.Granted, ipc.Refused, ipc.NoRetry, ipc.Answer, ipc.Scrape, ipc.Facts, ipc.Reconfigure))


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: f"{type(m).__name__}-{getattr(m, 'rid', getattr(m, 'qid', ''))}")
def test_a_message_round_trips(msg: Any) -> None:
    frame = ipc.encode(msg)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert ipc.decode(frame[4:]) == msg


@pytest.mark.parametrize("body, why", [
    (b"not json", "not JSON"),
    (b"{}", "not [tag"),
    (b"[]", "not [tag"),
    (b'["2", 1]', "not [tag"),
    (b"[99, 1]", "unknown message tag 99"),
    (b"[21, 7]", "Arrive with 1 fields, not 4"),
    (b"[21, 7, 1.0, null, null, 3]", "Arrive with 5 fields, not 4"),
])
def test_a_malformed_frame_is_a_protocol_error(body: bytes, why: str) -> None:
    with pytest.raises(ipc.ProtocolError, match=why.replace("[", r"\[")):
        ipc.decode(body)


def test_a_frame_over_the_limit_is_refused_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ipc, "MAX_FRAME_BYTES", 64)
    with pytest.raises(ipc.ProtocolError, match="over 64"):
        ipc.encode(ipc.Answer(1, "x" * 100, None))
    got: list[Any] = []
    lost: list[BaseException | None] = []
    ch = ipc.Channel(got.append, lost.append)
    ch.connection_made(_Transport())
    ch.data_received((1000).to_bytes(4, "big") + b"[")
    assert not got and len(lost) == 1 and isinstance(lost[0], ipc.ProtocolError) and ch.closed


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        pass


def test_frames_split_and_joined_across_reads_arrive_whole_and_in_order() -> None:
    stream = b"".join(ipc.encode(m) for m in EXAMPLES)
    for step in (1, 3, 7, 64, len(stream)):
        got: list[Any] = []
        ch = ipc.Channel(got.append, lambda exc: None)
        ch.connection_made(_Transport())
        for i in range(0, len(stream), step):
            ch.data_received(stream[i:i + step])
        assert got == EXAMPLES, step


def test_one_turns_messages_leave_in_one_write() -> None:
    async def main() -> list[bytes]:
        t = _Transport()
        ch = ipc.Channel(lambda m: None, lambda exc: None)
        ch.connection_made(t)
        for m in EXAMPLES[:5]:
            ch.send(m)
        assert t.writes == []  # not yet: at the end of this turn
        await asyncio.sleep(0)
        return t.writes

    writes = asyncio.run(main())
    assert writes == [b"".join(ipc.encode(m) for m in EXAMPLES[:5])]


def test_the_answers_to_one_read_leave_in_one_write_when_it_is_handled() -> None:
    """No loop turn between a read and its answers (issue 13: the decision round trip)."""
    async def main() -> list[bytes]:
        t = _Transport()
        ch: ipc.Channel

        def answer(m: Any) -> None:
            ch.send(ipc.Arrived(m.rid, None))

        ch = ipc.Channel(answer, lambda exc: None)
        ch.connection_made(t)
        ch.data_received(ipc.encode(ipc.Arrive(1, 1.0)) + ipc.encode(ipc.Arrive(2, 1.0)))
        assert t.writes == [ipc.encode(ipc.Arrived(1, None)) + ipc.encode(ipc.Arrived(2, None))]
        await asyncio.sleep(0)
        return t.writes

    assert len(asyncio.run(main())) == 1  # nothing left for the end of the turn


def test_send_now_writes_what_is_pending_with_it_in_order() -> None:
    async def main() -> list[bytes]:
        t = _Transport()
        ch = ipc.Channel(lambda m: None, lambda exc: None)
        ch.connection_made(t)
        ch.send(ipc.End(1, "completed"))
        ch.send_now(ipc.Arrive(2, 1.0))  # a caller waits for its answer
        assert t.writes == [ipc.encode(ipc.End(1, "completed")) + ipc.encode(ipc.Arrive(2, 1.0))]
        await asyncio.sleep(0)
        return t.writes

    assert len(asyncio.run(main())) == 1


def test_the_wire_is_orjson_arrays_in_field_order() -> None:
    m = ipc.Retry(7, "d0", E.E03, "decode", 1.5)
    # a row travels by its ID and comes back as the generated constant
    assert orjson.loads(ipc.encode(m)[4:]) == [m.TAG, 7, "d0", "E03", "decode", 1.5]
    assert ipc.decode(ipc.encode(m)[4:]).row is E.E03
    r = ipc.Refused(3, Refuse(E.R10, 1.5, {"retry_after": 2}))
    assert orjson.loads(ipc.encode(r)[4:]) == [r.TAG, 3, ["R10", 1.5, {"retry_after": 2}, None]]


@pytest.mark.parametrize("frame", [[24, 7, "d0", "X99", "decode", 1.5], [5, 3, ["R99", None, {}, None]], [5, 3, "R10"]])
def test_a_row_that_is_not_a_row_is_a_protocol_error(frame: list[Any]) -> None:
    with pytest.raises(ipc.ProtocolError):
        ipc.decode(orjson.dumps(frame))


def test_a_tag_is_taken_once() -> None:
    with pytest.raises(ValueError, match="taken"):
        @ipc.message(ipc.Retry.TAG)
        class Again(ipc.Message):
            rid: int
