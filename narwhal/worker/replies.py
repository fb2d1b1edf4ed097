"""What a request's client is told, and the words taken from an engine's answers: the
sink a response goes to, refusals and error events rendered from the generated rows
(generated/errors.py), an engine's error message and parameter as a client may read them
(core/relay.engine_message), and the usage fields the relay does not keep itself."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Protocol

import orjson

from narwhal_generated import errors as E

from ..core import refusals as answers
from ..core.relay import engine_message

__all__ = ["Sink", "ChunkWriter", "DONE", "error_event", "refuse", "engine_error_detail", "err_msg", "cached", "merge_usage"]

DONE = b"data: [DONE]\n\n"


class ChunkWriter(Protocol):
    def write_chunk(self, framed: bytes) -> bool:
        """Synchronous: `framed` (one whole HTTP/1.1 chunk) written now (True), or nothing
        (False), under write_now's guards."""
        ...


class Sink(Protocol):
    """Where the response goes (the HTTP shell implements it over ASGI)."""

    headers_sent: bool
    extra_headers: list[tuple[bytes, bytes]]  # added to the response's headers (x-narwhal-projected-ttft-ms)
    row: str | None  # the row of the refusal or error answered, for the request's record
    # Synchronous, from any callback: write these body bytes of a started stream now and
    # return True, or write nothing and return False (then `write` them). None: the
    # server has no such path (HTTP/2, granian); every body byte goes through `write`.
    write_now: Callable[[bytes], bool] | None
    # Synchronous, likewise: the stream's head and these first body bytes written now (True),
    # or nothing (False: then start_stream and write). None where write_now is None.
    start_now: Callable[[bytes], bool] | None

    # The same for the compiled step (core/fastevent.py): the client's connection, whose
    # write_chunk writes bytes already framed as one HTTP/1.1 chunk; None where write_now is.
    chunk_writer: ChunkWriter | None

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None: ...

    async def start_stream(self) -> None: ...

    def prepare_start(self) -> None:
        """The stream's head may be built now, while the engine works on the first token
        (start_now or start_stream then only writes it); a sink may do nothing here."""
        ...

    async def write(self, data: bytes) -> None: ...

    async def end_stream(self, last: bytes = b"") -> None:
        """The stream's `last` body bytes, then its end (where it can, in one write)."""
        ...


def error_event(row: E.ErrorRow, **fields: object) -> bytes:
    """The error event that ends a stream after response headers."""
    return b"data: " + json.dumps(answers.envelope(row, **fields), separators=(",", ":")).encode() + b"\n\n" + DONE


async def refuse(sink: Sink, row: E.ErrorRow, *, param: str | None = None, overrun_s: float | None = None, **fields: object) -> str:
    status, headers, body = answers.render(row, param=param, overrun_s=overrun_s, **fields)
    sink.row = row.id
    await sink.respond(status, headers, body)
    return row.counter


_PARAM = re.compile(r"^[A-Za-z0-9_.\[\]-]{1,128}$")  # an engine's `param` passed on: a field path


def engine_error_detail(status: int, body: bytes, hosts: tuple[str, ...] = ()) -> tuple[str, str | None]:
    """(message, param) from an engine's HTTP error body, whatever its version's shape.
    The engine's own message (a JSON string) is passed on through `engine_message`; a body
    that is not JSON, or a message that is not a string (FastAPI's `detail` list), is not:
    the message says what it was in words. `param` only when it looks like a field path."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return f"HTTP {status} with a body that is not JSON", None
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            msg = engine_message(err.get("message"), hosts=hosts) or engine_message(err.get("detail"), hosts=hosts)
            param = err.get("param")
            return msg or f"HTTP {status} without a message", (param if isinstance(param, str) and _PARAM.match(param) else None)
        msg = engine_message(err, hosts=hosts)
        if msg is not None:
            return msg, None
    return f"HTTP {status} without a message", None


def err_msg(obj: dict[str, Any], hosts: tuple[str, ...]) -> str:
    """The words of an engine's error event (E04): its message, if a string."""
    err = obj.get("error")
    msg = engine_message(err.get("message") if isinstance(err, dict) else err, hosts=hosts)
    return msg if msg is not None else "an error event without a message"


def cached(usage: Any) -> int | None:
    """usage.prompt_tokens_details.cached_tokens (vLLM with --enable-prompt-tokens-details),
    when an integer."""
    d = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    c = d.get("cached_tokens") if isinstance(d, dict) else None
    return c if type(c) is int and c >= 0 else None


def merge_usage(res: dict[str, Any], prompt_tokens: int) -> None:
    u = res.get("usage")
    if isinstance(u, dict) and isinstance(u.get("completion_tokens"), int):
        u["prompt_tokens"] = prompt_tokens
        u["total_tokens"] = prompt_tokens + u["completion_tokens"]
