"""worker/remote.py without sockets: Arrive does not wait, Admit follows it at once, and an
arrival refused meanwhile answers with its own row."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from narwhal import ipc
from narwhal.core.lease import Order
from narwhal.core.tickets import Refuse
from narwhal.worker.remote import AuthorityLost, Link, RemoteDoor, RemoteEntry, RemoteLease
from narwhal_generated import errors as E


class _Transport:
    def __init__(self) -> None:
        self.out = bytearray()
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.out += data
        self.writes += 1

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def _sent(t: _Transport) -> list[Any]:
    out, pos, buf = [], 0, bytes(t.out)
    while pos < len(buf):
        n = int.from_bytes(buf[pos:pos + 4], "big")
        out.append(ipc.decode(buf[pos + 4:pos + 4 + n]))
        pos += 4 + n
    return out


ORDER = Order("chat", 40, None, 4, 3000.0, 0.0, None)


def _admit_of(o: Order) -> ipc.Admit:
    return ipc.Admit(1, o.route, o.prompt_bytes, o.exact_prompt_tokens, o.max_tokens, o.budget_ms, o.arrival, o.deadline_s, [], [])


async def _link() -> tuple[Link, _Transport]:
    link = Link()
    link.hello.cancel()  # a worker awaits its Hello before it serves; not these tests
    t = _Transport()
    link.channel.connection_made(t)  # type: ignore[arg-type]
    return link, t


@pytest.mark.parametrize(("arrived", "admitted", "want"), [
    (ipc.Arrived(1, None), ipc.Admitted(1, 10, None, 0.0, "u0", "unified"), "lease"),
    (ipc.Arrived(1, Refuse(E.R02, fields={"limit": 8})), None, "R02"),
    (ipc.Arrived(1, Refuse(E.R01, fields={"reason": "standby"})), None, "R01"),
    (ipc.Arrived(1, None), ipc.Refused(1, Refuse(E.R10, 1.0, {"projected_ms": 5000, "budget_ms": 3000, "retry_after": 2})), "R10"),
])  # fmt: skip
def test_arrive_and_admit_are_one_round_trip(arrived: ipc.Arrived, admitted: Any, want: str) -> None:
    async def main() -> Any:
        link, t = await _link()
        entries: list[RemoteEntry] = []

        async def request() -> Any:  # a worker's request whose body is in: one turn
            entry = await RemoteDoor(link).arrive(1.0)
            assert isinstance(entry, RemoteEntry)  # at once: nothing answered yet
            entries.append(entry)
            return await entry.admit(ORDER)

        task = asyncio.ensure_future(request())
        await asyncio.sleep(0)
        assert t.out == ipc.encode(ipc.Arrive(1, 1.0)) + ipc.encode(_admit_of(ORDER)) and t.writes == 1  # one write
        # the authority's answers, in its order (a refused arrival ignores the Admit)
        link.channel.data_received(ipc.encode(arrived) + (ipc.encode(admitted) if admitted is not None else b""))
        got = await asyncio.wait_for(task, 1.0)
        entries[0].end("completed")
        assert link.pending == {} and link.arrivals == {}
        return got

    got = asyncio.run(main())
    if want == "lease":
        assert isinstance(got, RemoteLease) and got.prompt_tokens == 10
    else:
        assert isinstance(got, Refuse) and got.row is E.ROWS[want]


def test_a_refused_arrival_is_known_before_the_body_is_answered() -> None:
    async def main() -> Refuse | None:
        link, _ = await _link()
        entry = await RemoteDoor(link).arrive(1.0)
        assert isinstance(entry, RemoteEntry)
        link.channel.data_received(ipc.encode(ipc.Arrived(1, Refuse(E.R01, fields={"reason": "fenced"}))))
        return await entry.arrived()

    got = asyncio.run(main())
    assert got is not None and got.row is E.R01 and got.fields == {"reason": "fenced"}


def test_a_lost_authority_fails_the_waiting_arrival() -> None:
    async def main() -> None:
        link, _ = await _link()
        entry = await RemoteDoor(link).arrive(1.0)
        assert isinstance(entry, RemoteEntry)
        task = asyncio.ensure_future(entry.admit(ORDER))
        await asyncio.sleep(0)
        link.channel.connection_lost(None)
        with pytest.raises(AuthorityLost):
            await task
        with pytest.raises(AuthorityLost):
            await RemoteDoor(link).arrive(2.0)

    asyncio.run(main())
