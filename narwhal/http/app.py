"""The application factory: one Starlette app over one data plane.

The completion routes run on the data plane; /ready, /v1/engines, /metrics and the admin
API ask the authority (`plane.controls`), so they answer the same from every worker.

Routes (NARWHAL.md "HTTP surface"): the two completion routes (raw ASGI, see
completions.py), /v1/models, /health, /ready, /v1/engines, /metrics, the admin API, and
/openapi.json (the generated document). Unknown paths and methods answer rows H01/H02.
With auth, the completion routes and /v1/models need a valid key (R15/R16); /health,
/ready, /v1/engines, /metrics and /openapi.json do not, the admin API has its own token.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from importlib import resources
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from narwhal_generated import errors as E

from ..tenants import Identity
from ..worker.plane import DataPlane
from . import hyper
from .admin import admin_routes, admin_token
from .completions import CompletionEndpoint
from .errors import RID_OK, drain_request, row_response

__all__ = ["create_app"]

_OPENAPI = resources.files("narwhal_generated").joinpath("openapi.json").read_bytes()


def create_app(plane: DataPlane, *, lifespan_hooks: tuple[Any, Any] | None = None) -> Starlette:
    """The ASGI app. `lifespan_hooks`: (start, stop) coroutines the app's lifespan runs
    (a router's background tasks, when the app owns them)."""
    # client connections are the server's (hyper.py counts them per process)
    plane.telemetry.registry.register(hyper.ConnectionCollector())  # type: ignore[arg-type]
    created = int(time.time())
    controls = plane.controls
    auth = plane.auth
    if auth is not None:  # the keys loaded and the keys files' errors (never a key)
        plane.telemetry.registry.register(auth)  # type: ignore[arg-type]

    async def models(request: Request) -> Response:
        if auth is not None:  # R15, R16 as on the completion routes (not offered: no books)
            who = auth.check(request.scope["headers"])
            if not isinstance(who, Identity):
                return row_response(who)
        return JSONResponse({"object": "list", "data": [{"id": plane.config.serving.model, "object": "model", "created": created, "owned_by": "narwhal"}]})

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(_: Request) -> Response:
        status, body = await controls.ready()
        return JSONResponse(body, status_code=status)

    async def engines(_: Request) -> Response:
        return JSONResponse(await controls.engines(plane.sizing()))

    async def metrics(_: Request) -> Response:
        return Response(await controls.metrics(), media_type=CONTENT_TYPE_LATEST)

    async def openapi(_: Request) -> Response:
        return Response(_OPENAPI, media_type="application/json")

    async def not_found(request: Request, exc: Exception) -> Response:
        # H01 note: with no admin token configured the admin surface is off, every method
        if request.url.path.startswith("/admin/") and admin_token(plane) is None:
            return row_response(E.H01, method=request.method, path=request.url.path)
        if isinstance(exc, HTTPException) and exc.status_code == 405:
            return row_response(E.H02, method=request.method, path=request.url.path)
        return row_response(E.H01, method=request.method, path=request.url.path)

    async def server_error(request: Request, exc: Exception) -> Response:
        return row_response(E.H06, request_id="-")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[dict[str, Any]]:
        # auth.keys_file / jwks_file are watched by every process that serves (keys.py)
        watch = asyncio.ensure_future(auth.run()) if auth is not None else None
        if lifespan_hooks is not None:
            await lifespan_hooks[0]()
        try:
            yield {}
        finally:
            if watch is not None:
                watch.cancel()
            if lifespan_hooks is not None:
                await lifespan_hooks[1]()

    routes = [
        Route("/v1/chat/completions", CompletionEndpoint(plane, "chat")),
        Route("/v1/completions", CompletionEndpoint(plane, "completion")),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/v1/engines", engines, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        *admin_routes(plane),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={404: not_found, 405: not_found, 500: server_error},
        lifespan=lifespan,
    )
    app.state.plane = plane
    # no 307 to a `Location` built from the client's Host for a trailing slash: an unknown
    # path is H01, whatever its slashes
    app.router.redirect_slashes = False
    hot = {"/v1/chat/completions": routes[0].endpoint, "/v1/completions": routes[1].endpoint}
    return _Front(app, hot)  # type: ignore[return-value]


class _Front:
    """The outermost ASGI layer. The completion routes go straight to their raw ASGI
    endpoints (no Starlette routing or middleware on the relay path: every event written
    would otherwise pass two more send wrappers); they set x-request-id themselves. Every
    other response gets x-request-id here (propagated, or generated when absent)."""

    def __init__(self, app: Starlette, hot: dict[str, Any]) -> None:
        self.app = app
        self.state = app.state
        self.hot = hot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.call(scope, receive, send)

    def call(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """The same, not a coroutine itself: a completion route's endpoint coroutine is
        returned as it is, so an open stream holds no frame of this layer (memory per open
        stream; conn.Asgi calls this)."""
        if scope["type"] == "http":
            ep = self.hot.get(scope["path"])
            if ep is not None:
                return ep(scope, receive, send)  # type: ignore[no-any-return]
            return self._with_id(scope, receive, send)
        return self.app(scope, receive, send)

    async def _with_id(self, scope: Scope, receive: Receive, send: Send) -> None:
        rid = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        if rid is None or not RID_OK.fullmatch(rid):
            rid = uuid.uuid4().hex.encode()

        ended = False

        async def recv() -> Message:
            nonlocal ended
            msg = await receive()
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                ended = True
            return msg

        async def send_with_id(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-request-id", rid)]}
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False) and not ended:
                # answer only once the request body is in (see drain_request)
                await drain_request(scope, recv, limit=8 * self.state.plane.config.serving.max_request_bytes)
            await send(msg)

        await self.app(scope, recv, send_with_id)
