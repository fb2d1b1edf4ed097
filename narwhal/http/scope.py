"""The ASGI side of one request, the same for both of Narwhal's protocols (`h1/cycle.py`
and `h2conn.py`): its HTTP scope (ASGI 3.0, spec 2.1), the response head an app sends,
and the http.disconnect a closed stream owes the app."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from .lean import LeanQueue

_ASGI = {"spec_version": "2.1", "version": "3.0"}


class ServerSide:
    """What a protocol's server connection (h1/cycle.py H1Server, h2conn.py H2Server) is
    handed by the connection that read its first bytes: the app and the server's config,
    the task group that runs the app, the lifespan state, and the address facts the scope
    carries; `send` writes to the client (`lean.protocol_send`)."""

    __slots__ = ("app", "config", "context", "group", "state", "ssl", "client", "server", "send")

    def __init__(self, app: Any, config: Any, context: Any, group: Any, state: Any, ssl: bool, client: Any, server: Any, lean: Any) -> None:
        self.app = app
        self.config = config
        self.context = context
        self.group = group
        self.state = state
        self.ssl = ssl
        self.client = client
        self.server = server
        self.send = lean.protocol_send


def http_scope(http_version: str, method: str, target: bytes, headers: list[tuple[bytes, bytes]], proto: Any, config: Any,
               extensions: dict[str, Any]) -> dict[str, Any]:
    """`target` is the request target (path and query); `proto` the connection (its
    ssl, client, server and lifespan state); `config` the server's (its root_path)."""
    path, _, query = target.partition(b"?")
    return {
        "type": "http",
        "http_version": http_version,
        "asgi": _ASGI,
        "method": method,
        "scheme": "https" if proto.ssl else "http",
        "path": unquote(path.decode("ascii")),
        "raw_path": path,
        "query_string": query,
        "root_path": config.root_path,
        "headers": headers,
        "client": proto.client,
        "server": proto.server,
        "state": proto.state.copy(),
        "extensions": extensions,
    }


def response_headers(message: Any) -> list[tuple[bytes, bytes]]:
    """An http.response.start's headers, names lowercased, both sides stripped; a pseudo
    header (":status" and the like) is the app's error."""
    headers = []
    for name, value in message.get("headers", []):
        if name[:1] == b":":
            raise ValueError("Pseudo headers are not valid")
        headers.append((bytes(name).strip().lower(), bytes(value).strip()))
    return headers


async def tell_disconnect(put: Any) -> None:
    """Give the app http.disconnect through its receive queue `put`. A full LeanQueue
    (body the app has not read) is emptied first: the disconnect must never wait behind
    a body nobody will read (HTTP/1.1 rule A5, HTTP/2 D10)."""
    q = getattr(put, "__self__", None)
    if type(q) is LeanQueue and q.full():
        while not q.empty():
            q.get_nowait()
        q.put_nowait({"type": "http.disconnect"})
        return
    await put({"type": "http.disconnect"})
