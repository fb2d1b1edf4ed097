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


def admin_routes(plane: DataPlane) -> list[Route]:
    controls = plane.controls

    def known_waves() -> set[str | None]:  # the fleet changes at run time
        return {e.wave for e in plane.engines.values()} | {plane.config.serving.wave}

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
        if name not in known_waves():
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

    async def put_engine(request: Request) -> Response:
        if (g := await guard(request)) is not None:
            return g
        name = request.path_params["name"]
        raw = await request.body()
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return row_response(E.H04, param=None, detail="the body is not valid JSON")
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
        return _ok(**await controls.put_engine(engine_spec(entry).as_dict()))

    async def delete_engine(request: Request) -> Response:
        if (g := await guard(request)) is not None:
            return g
        name = request.path_params["name"]
        if name not in plane.engines:
            return row_response(E.H05, param="name", detail=f"no engine named {name!r}")
        got = await controls.delete_engine(name)
        if got.get("lifecycle") is None:
            return row_response(E.H05, param="name", detail=f"no engine named {name!r}")
        return _ok(**got)

    async def reload(request: Request) -> Response:
        if (g := await guard(request)) is not None:
            return g
        got = await controls.reload()
        if not got.pop("ok"):
            return row_response(E.ROWS[got["row"]], param=None, detail=got["detail"])
        return _ok(**got)

    return [
        Route("/admin/config/reload", reload, methods=["POST"]),
        Route("/admin/engines/{name}", put_engine, methods=["PUT"]),
        Route("/admin/engines/{name}", delete_engine, methods=["DELETE"]),
        Route("/admin/state", set_state, methods=["POST"]),
        Route("/admin/waves/{wave}/maintenance", wave, methods=["POST"]),
        Route("/admin/engines/{name}/drain", drain, methods=["POST"]),
        Route("/admin/engines/{name}/profile", profile, methods=["POST"]),
    ]
