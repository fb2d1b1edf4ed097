"""The ASGI HTTP scope of one request, the same for both of Narwhal's protocols
(`h1/cycle.py` and `h2conn.py`): ASGI 3.0, spec 2.1."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

_ASGI = {"spec_version": "2.1", "version": "3.0"}


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
