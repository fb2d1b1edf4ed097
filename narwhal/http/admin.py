"""The admin API under /admin/ (bearer token from the variable admin.token_env names,
compared in constant time; with no token configured the routes answer 404, H01).

Requests are checked here (H03-H05: engine and wave names are the fleet's; an engine
entry is validated by the configuration's own schema and checks); the operation itself
is the authority's (`plane.controls`), whichever worker took the call.

PUT /admin/engines/{name} (one engines[] entry; `name` may be left out, else it must be
the path's) adds an engine or updates or replaces one; DELETE drains it and removes it
(spec/tables/lifecycle.yaml). Both answer what was done and the engine's lifecycle."""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from narwhal_generated import errors as E

from ..config import ConfigError, parse_engines
from ..upstream.engines import engine_spec
from ..worker.plane import DataPlane
from .errors import row_response

__all__ = ["admin_routes", "admin_token"]


def admin_token(plane: DataPlane) -> str | None:
    """The admin bearer token, from the variable admin.token_env names; None: admin off."""
    return os.environ.get(plane.config.admin.token_env) or None


def _ok(**extra: Any) -> Response:
    return JSONResponse({"ok": True, **extra})


Handler = Callable[[Request], Awaitable[Response]]


class _Admin:
    """The admin operations of one plane. Every route passes `guard` first (`guarded`);
    the steps `json`, `field` and `engine` answer a bad request with its row (H04, H05) as
    a Response, which the operation returns as it is."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.controls = plane.controls

    def guarded(self, op: Handler) -> Handler:
        """`op` behind the bearer token: H01 with admin off, H03 without the token."""

        async def endpoint(request: Request) -> Response:
            want = admin_token(self.plane)
            if want is None:
                return row_response(E.H01, method=request.method, path=request.url.path)
            if len(request.headers.getlist("authorization")) > 1:  # the client identity's rule 1 too (R04)
                return row_response(E.H04, param=None, detail="more than one Authorization header; send one")
            got = request.headers.get("authorization", "")
            scheme, _, value = got.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), want.encode()):
                r = row_response(E.H03)
                r.headers["www-authenticate"] = "Bearer"
                return r
            return await op(request)

        return endpoint

    async def json(self, request: Request) -> Any:
        """The request's body as JSON, or H04."""
        try:
            return orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return row_response(E.H04, param=None, detail="the body is not valid JSON")

    async def field(self, request: Request, key: str, kind: type) -> Any:
        """The value of a body that is an object with exactly `key`, of type `kind`; or H04."""
        obj = await self.json(request)
        if isinstance(obj, Response):
            return obj
        if not isinstance(obj, dict) or set(obj) != {key}:
            return row_response(E.H04, param=key, detail=f"the body must be an object with exactly the key {key!r}")
        v = obj[key]
        if type(v) is not kind:
            return row_response(E.H04, param=key, detail=f"{key} must be a {kind.__name__}")
        return v

    def engine(self, request: Request) -> Any:
        """The fleet's engine the path names, or H05."""
        e = self.plane.engines.get(request.path_params["name"])
        if e is None:
            return row_response(E.H05, param="name", detail=f"no engine named {request.path_params['name']!r}")
        return e

    async def set_state(self, request: Request) -> Response:
        v = await self.field(request, "state", str)
        if isinstance(v, Response):
            return v
        if v not in ("active", "standby"):
            return row_response(E.H04, param="state", detail="state must be 'active' or 'standby'")
        return _ok(state=await self.controls.set_state(v))

    async def wave(self, request: Request) -> Response:
        name = request.path_params["wave"]
        v = await self.field(request, "maintenance", bool)
        if isinstance(v, Response):
            return v
        # the fleet changes at run time: its waves are read now
        if name not in {e.wave for e in self.plane.engines.values()} | {self.plane.config.serving.wave}:
            return row_response(E.H05, param="wave", detail=f"no engine and not this router is in wave {name!r}")
        await self.controls.set_wave(name, v)
        return _ok(wave=name, maintenance=v)

    async def drain(self, request: Request) -> Response:
        e = self.engine(request)
        if isinstance(e, Response):
            return e
        v = await self.field(request, "drain", bool)
        if isinstance(v, Response):
            return v
        await self.controls.drain(e.name, v)
        return _ok(engine=e.name, draining=v)

    async def profile(self, request: Request) -> Response:
        e = self.engine(request)
        if isinstance(e, Response):
            return e
        return _ok(engine=e.name, profile=await self.controls.profile(e.name))

    async def put_engine(self, request: Request) -> Response:
        name = request.path_params["name"]
        obj = await self.json(request)
        if isinstance(obj, Response):
            return obj
        if not isinstance(obj, dict):
            return row_response(E.H04, param=None, detail="the body must be one engines[] entry (an object)")
        if obj.setdefault("name", name) != name:
            return row_response(E.H04, param="name", detail=f"the body's name {obj['name']!r} is not the path's {name!r}")
        try:
            (entry,) = parse_engines([obj], source=f"PUT /admin/engines/{name}", key="engine")
        except ConfigError as x:
            # "engine[0].role: ..." -> param "role": the field, as the other admin rows name it
            msg = str(x).split(": ", 1)[-1]
            field = msg.split(":", 1)[0].removeprefix("engine[0]").lstrip(".") or None
            return row_response(E.H04, param=field, detail=msg.replace("engine[0].", ""))
        got = await self.controls.put_engine(engine_spec(entry).as_dict())
        if "refused" in got:  # the router's own address, discovery.max_engines (authority/membership.py)
            return row_response(E.H04, param="url" if "listen address" in got["refused"] else None, detail=got["refused"])
        return _ok(**got)

    async def delete_engine(self, request: Request) -> Response:
        e = self.engine(request)
        if isinstance(e, Response):
            return e
        got = await self.controls.delete_engine(e.name)
        if got.get("lifecycle") is None:  # gone meanwhile
            return row_response(E.H05, param="name", detail=f"no engine named {e.name!r}")
        return _ok(**got)

    async def reload(self, request: Request) -> Response:
        got = await self.controls.reload()
        if not got.pop("ok"):
            return row_response(E.ROWS[got["row"]], param=None, detail=got["detail"])
        return _ok(**got)


def admin_routes(plane: DataPlane) -> list[Route]:
    """The admin API's routes, every one behind the bearer token."""
    a = _Admin(plane)
    g = a.guarded
    return [
        Route("/admin/config/reload", g(a.reload), methods=["POST"]),
        Route("/admin/engines/{name}", g(a.put_engine), methods=["PUT"]),
        Route("/admin/engines/{name}", g(a.delete_engine), methods=["DELETE"]),
        Route("/admin/state", g(a.set_state), methods=["POST"]),
        Route("/admin/waves/{wave}/maintenance", g(a.wave), methods=["POST"]),
        Route("/admin/engines/{name}/drain", g(a.drain), methods=["POST"]),
        Route("/admin/engines/{name}/profile", g(a.profile), methods=["POST"]),
    ]
