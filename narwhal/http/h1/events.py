"""The events of an HTTP/1.1 server connection (narwhal.http.h1), sans-IO, frozen.

A request's fields are kept as h11 keeps them: (name as sent, lower-case name, value)
triples, in order (`Fields`); `pairs(fields)` gives the ASGI scope's (lower-case name,
value) list. A response to send is given its headers as (name, value) pairs; `send`
validates them and frames the body from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "Fields", "Request", "Data", "EndOfMessage", "ConnectionClosed", "Response", "InformationalResponse",
    "NEED_DATA", "PAUSED", "ProtocolError", "RemoteProtocolError", "LocalProtocolError", "pairs",
]

Fields = list[tuple[bytes, bytes, bytes]]  # (name as sent, lower-case name, value)


def pairs(fields: Fields) -> list[tuple[bytes, bytes]]:
    return [(n, v) for _, n, v in fields]


@dataclass(frozen=True, slots=True)
class Request:
    method: bytes
    target: bytes
    headers: Fields
    http_version: bytes = b"1.1"


@dataclass(frozen=True, slots=True)
class Data:
    data: bytes
    chunk_start: bool = False
    chunk_end: bool = False


@dataclass(frozen=True, slots=True)
class EndOfMessage:
    headers: Fields = field(default_factory=list)  # a chunked body's trailer fields


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    pass


@dataclass(frozen=True, slots=True)
class Response:
    status_code: int
    headers: list[tuple[bytes, bytes]]
    reason: bytes = b""
    http_version: bytes = b"1.1"


@dataclass(frozen=True, slots=True)
class InformationalResponse:
    status_code: int
    headers: list[tuple[bytes, bytes]]
    reason: bytes = b""
    http_version: bytes = b"1.1"


class _Signal:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEED_DATA = _Signal("NEED_DATA")  # next_event: nothing whole yet
PAUSED = _Signal("PAUSED")  # next_event: the client's next message waits for start_next_cycle


class ProtocolError(Exception):
    """A request the connection refuses; `status` is the answer h11 would hint (400,
    431 for a head past the limit, 501 for a transfer coding it does not know)."""

    def __init__(self, msg: str, status: int = 400) -> None:
        super().__init__(msg)
        self.status = status


class RemoteProtocolError(ProtocolError):
    """The client broke the protocol (from next_event)."""


class LocalProtocolError(ProtocolError):
    """The server tried to send what the protocol forbids (from send)."""
