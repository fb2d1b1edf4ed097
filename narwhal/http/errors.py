"""Error rows rendered to ASGI responses. Statuses, types, codes and Retry-After come from
generated/errors.py only; nothing here writes them by hand."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from narwhal_generated import errors as E

from ..core import refusals as answers

__all__ = ["send_row", "row_response", "json_headers", "drain_request", "RID_OK"]

# x-request-id values taken from a client: 1-128 visible ASCII characters, matched whole
# (fullmatch: `$` would let a trailing newline through)
RID_OK = re.compile(rb"[!-~]{1,128}")


def json_headers(rid: str | None, extra: list[tuple[bytes, bytes]] | None = None) -> list[tuple[bytes, bytes]]:
    h = list(extra or [])
    if rid is not None:
        h.append((b"x-request-id", rid.encode()))
    return h


async def send_row(send: Send, row: E.ErrorRow, *, rid: str | None, param: str | None = None, overrun_s: float | None = None, **fields: object) -> None:
    status, headers, body = answers.render(row, param=param, overrun_s=overrun_s, **fields)
    headers = json_headers(rid, headers)
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def row_response(row: E.ErrorRow, *, rid: str | None = None, param: str | None = None, **fields: object) -> Response:
    status, headers, body = answers.render(row, param=param, **fields)
    r = Response(body, status_code=status, media_type="application/json")
    for k, v in headers:
        if k != b"content-type":
            r.headers[k.decode()] = v.decode()
    if rid is not None:
        r.headers["x-request-id"] = rid
    return r


async def drain_request(scope: Scope, receive: Receive, *, limit: int, timeout_s: float = 2.0) -> None:
    """Read and discard what is left of the request body before an early answer
    (R01-R03, H01/H02, ...). HTTP/2: hypercorn 0.18 drops the whole connection, every
    other stream on it included, when DATA arrives for a stream whose response has
    already ended (KeyError in H2Protocol._handle_events). HTTP/1.1: hypercorn closes a
    connection whose request body was not read, and a close with unread bytes in the
    socket makes the kernel send RST, which can destroy the answer before the client
    reads it (seen: a POST to an unknown route answered by a connection reset). So an
    answer sent before the client finished its body waits for that body. Bounded in
    bytes and time; nothing is buffered."""
    seen = 0
    try:
        async with asyncio.timeout(timeout_s):
            while seen <= limit:
                msg: Any = await receive()
                if msg["type"] != "http.request" or not msg.get("more_body", False):
                    return
                seen += len(msg.get("body", b""))
    except TimeoutError:
        return
