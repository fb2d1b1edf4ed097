"""The application factory: one Starlette app over one data plane.

The completion routes run on the data plane; /ready, /v1/engines, /metrics and the admin
API ask the authority (`plane.controls`), so they answer the same from every worker.

Routes (docs/contract.md "HTTP surface"): the two completion routes (raw ASGI, see
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
from collections.abc import AsyncIterator, Awaitable, Callable
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
    if plane.auth is not None:  # the keys loaded and the keys files' errors (never a key)
        plane.telemetry.registry.register(plane.auth)  # type: ignore[arg-type]
    ep = _Endpoints(plane)
    routes = [
        Route("/v1/chat/completions", CompletionEndpoint(plane, "chat")),
        Route("/v1/completions", CompletionEndpoint(plane, "completion")),
        Route("/v1/models", ep.models, methods=["GET"]),
        Route("/health", ep.health, methods=["GET"]),
        Route("/ready", ep.ready, methods=["GET"]),
        Route("/v1/engines", ep.engines, methods=["GET"]),
        Route("/metrics", ep.metrics, methods=["GET"]),
        Route("/openapi.json", ep.openapi, methods=["GET"]),
        *admin_routes(plane),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={404: ep.not_found, 405: ep.not_found, 500: ep.server_error},
        lifespan=_lifespan(plane, lifespan_hooks),
    )
    app.state.plane = plane
    # no 307 to a `Location` built from the client's Host for a trailing slash: an unknown
    # path is H01, whatever its slashes
    app.router.redirect_slashes = False
    hot = {"/v1/chat/completions": routes[0].endpoint, "/v1/completions": routes[1].endpoint}
    return _Front(app, hot)  # type: ignore[return-value]


class _Endpoints:
    """The routes besides completions and admin, and the answers to unknown paths and
    methods (H01, H02) and to a bug (H06)."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.controls = plane.controls
        self.auth = plane.auth
        self.created = int(time.time())

    async def models(self, request: Request) -> Response:
        if self.auth is not None:  # R15, R16 as on the completion routes (not offered: no books)
            who = self.auth.check(request.scope["headers"])
            if not isinstance(who, Identity):
                return row_response(who)
        model = {"id": self.plane.config.serving.model, "object": "model", "created": self.created, "owned_by": "narwhal"}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, _: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, _: Request) -> Response:
        status, body = await self.controls.ready()
        return JSONResponse(body, status_code=status)

    async def engines(self, _: Request) -> Response:
        return JSONResponse(await self.controls.engines(self.plane.sizing()))

    async def metrics(self, _: Request) -> Response:
        return Response(await self.controls.metrics(), media_type=CONTENT_TYPE_LATEST)

    async def openapi(self, _: Request) -> Response:
        return Response(_OPENAPI, media_type="application/json")

    async def not_found(self, request: Request, exc: Exception) -> Response:
        # H01 note: with no admin token configured the admin surface is off, every method
        if request.url.path.startswith("/admin/") and admin_token(self.plane) is None:
            return row_response(E.H01, method=request.method, path=request.url.path)
        if isinstance(exc, HTTPException) and exc.status_code == 405:
            return row_response(E.H02, method=request.method, path=request.url.path)
        return row_response(E.H01, method=request.method, path=request.url.path)

    async def server_error(self, request: Request, exc: Exception) -> Response:
        return row_response(E.H06, request_id="-")


def _lifespan(plane: DataPlane, hooks: tuple[Any, Any] | None) -> Callable[[Starlette], Any]:
    """The app's lifespan: the keys files watched (auth.keys_file / jwks_file, by every
    process that serves: keys.py) and the router's `hooks` (start, stop) run."""
    auth = plane.auth

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[dict[str, Any]]:
        watch = asyncio.ensure_future(auth.run()) if auth is not None else None
        if hooks is not None:
            await hooks[0]()
        try:
            yield {}
        finally:
            if watch is not None:
                watch.cancel()
            if hooks is not None:
                await hooks[1]()

    return lifespan


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
