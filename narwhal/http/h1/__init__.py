"""Narwhal's own HTTP/1.1 server connection, sans-IO (events, states table, parsing,
framing), and the ASGI cycle over it (`cycle`: asyncio, the only part that is not
sans-IO). h11 is its test oracle, never its implementation."""

from .connection import MAX_INCOMPLETE, Connection
from .events import (
    NEED_DATA,
    PAUSED,
    ConnectionClosed,
    Data,
    EndOfMessage,
    InformationalResponse,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    Request,
    Response,
)
from .states import (
    CLIENT,
    CLOSED,
    DONE,
    ERROR,
    IDLE,
    MIGHT_SWITCH_PROTOCOL,
    MUST_CLOSE,
    SEND_BODY,
    SEND_RESPONSE,
    SERVER,
    SWITCHED_PROTOCOL,
)

__all__ = [
    "Connection", "MAX_INCOMPLETE", "Request", "Data", "EndOfMessage", "ConnectionClosed", "Response", "InformationalResponse",
    "NEED_DATA", "PAUSED", "ProtocolError", "RemoteProtocolError", "LocalProtocolError",
    "CLIENT", "SERVER", "IDLE", "SEND_RESPONSE", "SEND_BODY", "DONE", "MUST_CLOSE", "CLOSED", "ERROR", "MIGHT_SWITCH_PROTOCOL", "SWITCHED_PROTOCOL",
]
