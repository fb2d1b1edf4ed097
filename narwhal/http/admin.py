"""The admin API under /admin/ (bearer token from the variable admin.token_env names,
compared in constant time; with no token configured the routes answer 404, H01).

Requests are checked here (H03-H05: engine and wave names are the configuration's); the
operation itself is the authority's (`plane.controls`), whichever worker took the call."""

from __future__ import annotations

import hmac
import os
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from narwhal_generated import errors as E

from ..worker.plane import DataPlane
from .errors import row_response

__all__ = ["admin_routes", "admin_token"]


def admin_token(plane: DataPlane) -> str | None:
    """The admin bearer token, from the variable admin.token_env names; None: admin off."""
    return os.environ.get(plane.config.admin.token_env) or None


def _ok(**extra: Any) -> Response:
    return JSONResponse({"ok": True, **extra})


def admin_routes(plane: DataPlane) -> list[Route]:
    controls = plane.controls
    known_waves = {e.wave for e in plane.engines.values()} | {plane.config.serving.wave}

    async def guard(request: Request) -> Response | None:
        want = admin_token(plane)
        if want is None:
            return row_response(E.H01, method=request.method, path=request.url.path)
        got = request.headers.get("authorization", "")
        scheme, _, value = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), want.encode()):
            r = row_response(E.H03)
            r.headers["www-authenticate"] = "Bearer"
            return r
        return None

    async def body(request: Request, key: str, kind: type) -> Any:
        raw = await request.body()
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return row_response(E.H04, param=None, detail="the body is not valid JSON")
        if not isinstance(obj, dict) or set(obj) != {key}:
            return row_response(E.H04, param=key, detail=f"the body must be an object with exactly the key {key!r}")
        v = obj[key]
        if type(v) is not kind:
            return row_response(E.H04, param=key, detail=f"{key} must be a {kind.__name__}")
        return v

    async def set_state(request: Request) -> Response:
        if (g := await guard(request)) is not None:
            return g
        v = await body(request, "state", str)
        if isinstance(v, Response):
            return v
        if v not in ("active", "standby"):
            return row_response(E.H04, param="state", detail="state must be 'active' or 'standby'")
        return _ok(state=await controls.set_state(v))

    async def wave(request: Request) -> Response:
        if (g := await guard(request)) is not None:
            return g
        name = request.path_params["wave"]
        v = await body(request, "maintenance", bool)
        if isinstance(v, Response):
            return v
        if name not in known_waves:
            return row_response(E.H05, param="wave", detail=f"no engine and not this router is in wave {name!r}")
        await controls.set_wave(name, v)
        return _ok(wave=name, maintenance=v)

    async def drain(request: Request) -> Response:
        if (g := await guard(request)) is not None:
            return g
        e = plane.engines.get(request.path_params["name"])
        if e is None:
            return row_response(E.H05, param="name", detail=f"no engine named {request.path_params['name']!r}")
        v = await body(request, "drain", bool)
        if isinstance(v, Response):
            return v
        await controls.drain(e.name, v)
        return _ok(engine=e.name, draining=v)

    async def profile(request: Request) -> Response:
        if (g := await guard(request)) is not None:
            return g
        e = plane.engines.get(request.path_params["name"])
        if e is None:
            return row_response(E.H05, param="name", detail=f"no engine named {request.path_params['name']!r}")
        return _ok(engine=e.name, profile=await controls.profile(e.name))

    return [
        Route("/admin/state", set_state, methods=["POST"]),
        Route("/admin/waves/{wave}/maintenance", wave, methods=["POST"]),
        Route("/admin/engines/{name}/drain", drain, methods=["POST"]),
        Route("/admin/engines/{name}/profile", profile, methods=["POST"]),
    ]
