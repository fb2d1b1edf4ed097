"""Error rows rendered to ASGI responses. Statuses, types, codes and Retry-After come from
generated/errors.py only; nothing here writes them by hand."""

from __future__ import annotations

from starlette.responses import Response
from starlette.types import Send

from narwhal_generated import errors as E

__all__ = ["send_row", "row_response", "json_headers"]


def json_headers(rid: str | None, extra: list[tuple[bytes, bytes]] | None = None) -> list[tuple[bytes, bytes]]:
    h = list(extra or [])
    if rid is not None:
        h.append((b"x-request-id", rid.encode()))
    return h


async def send_row(send: Send, row: E.ErrorRow, *, rid: str | None, param: str | None = None, overrun_s: float | None = None, **fields: object) -> None:
    status, headers, body = E.render(row, param=param, overrun_s=overrun_s, **fields)
    headers = json_headers(rid, headers)
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def row_response(row: E.ErrorRow, *, rid: str | None = None, param: str | None = None, **fields: object) -> Response:
    status, headers, body = E.render(row, param=param, **fields)
    r = Response(body, status_code=status, media_type="application/json")
    for k, v in headers:
        if k != b"content-type":
            r.headers[k.decode()] = v.decode()
    if rid is not None:
        r.headers["x-request-id"] = rid
    return r
