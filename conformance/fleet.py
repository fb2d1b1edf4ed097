"""The conformance mock fleet: a profile's mock engines on their documented loopback
ports, each wrapped in a thin control layer that a runner in any language drives over
HTTP.

Control API (on every fleet port; the state is fleet-wide):
  GET  /conformance/fleet                     {"profile", "engines": [{name, role, dialect, port, health}]}
  POST /conformance/control                   {"engine": NAME|"all", "health": "ok"|"fail"|"hang",
                                               "defaults": {mock options}|null}
  GET  /conformance/records?rid=ID            what every engine received for that x-request-id
                                              (or, without the header, for body field mock.rid):
                                              [{engine, role, dialect, path, attempt, body, status, response}]
Everything else reaches the mock engine (narwhal/mock) unchanged, except:
  * health "fail": GET /health (and GET /v1/models, the openai dialect's health path)
    answer 503; "hang": they answer only once the health is set back (or the poller
    gives up), so a router's health data goes stale instead of failing;
  * `defaults` are the `mock` options of a completion request that carries none besides
    `rid` (the router's own profiling traffic included);
  * `mock.fault_attempts: N` keeps the fault on the first N attempts of a request id at
    decode or unified engines only, so "the first decode attempt fails" is data, whatever
    engine a router picks first. Prefill engines never see such a fault.

Rules
  * Records are keyed by x-request-id and bounded (oldest ids dropped first).
  * Non-streaming JSON answers up to 64 KiB are recorded with the request (the prefill
    leg's kv_transfer_params, for the decode-leg check).
  * `running_fleet` binds every port before it yields and stops in bounded time.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import orjson

from narwhal.mock import create_mock_app, serve_apps, serve_in_thread
from narwhal.mock.app import read_body as _read

from .profiles import DEFAULT_PORT_BASE, Profile, mock_configs

__all__ = ["FleetState", "ControlledEngine", "running_fleet", "serve_fleet", "FleetError"]

_RECORD_IDS = 2000
_RESPONSE_LIMIT = 65536
_COMPLETIONS = ("/v1/chat/completions", "/v1/completions")
_JSON = (b"content-type", b"application/json")


class FleetError(RuntimeError):
    pass


@dataclass
class EngineControl:
    name: str
    role: str
    dialect: str
    port: int
    health: str = "ok"
    defaults: dict[str, Any] | None = None
    changed: asyncio.Event | None = None  # created on the fleet's loop


@dataclass
class FleetState:
    profile: str
    engines: dict[str, EngineControl] = field(default_factory=dict)
    records: OrderedDict[str, list[dict[str, Any]]] = field(default_factory=OrderedDict)
    attempts: dict[str, int] = field(default_factory=dict)

    def record(self, rid: str, rec: dict[str, Any]) -> None:
        lst = self.records.get(rid)
        if lst is None:
            lst = self.records[rid] = []
            while len(self.records) > _RECORD_IDS:
                old, _ = self.records.popitem(last=False)
                self.attempts.pop(old, None)
        lst.append(rec)

    def view(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "engines": [{"name": e.name, "role": e.role, "dialect": e.dialect, "port": e.port, "health": e.health, "defaults": e.defaults} for e in self.engines.values()],
        }


async def _send_json(send: Any, status: int, obj: Any) -> None:
    body = orjson.dumps(obj)
    await send({"type": "http.response.start", "status": status, "headers": [_JSON, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class ControlledEngine:
    """ASGI wrapper: the control API, health modes, defaults, attempts and records."""

    def __init__(self, inner: Any, ctl: EngineControl, fleet: FleetState) -> None:
        self.inner, self.ctl, self.fleet = inner, ctl, fleet

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.inner(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if path.startswith("/conformance/"):
            await self._control(scope, receive, send, path, method)
            return
        health = path == "/health" or (path == "/v1/models" and self.ctl.dialect == "openai")
        if method == "GET" and health and await self._health(send):
            return
        if method == "POST" and path in _COMPLETIONS:
            await self._completion(scope, receive, send, path)
            return
        await self.inner(scope, receive, send)

    async def _health(self, send: Any) -> bool:
        """True when the health answer was given here (fail, or hang then fail/ok)."""
        ctl = self.ctl
        while ctl.health == "hang":
            assert ctl.changed is not None
            await ctl.changed.wait()
        if ctl.health == "fail":
            await _send_json(send, 503, {"error": "unhealthy (conformance fleet control)"})
            return True
        return False

    async def _control(self, scope: dict[str, Any], receive: Any, send: Any, path: str, method: str) -> None:
        fleet = self.fleet
        if path == "/conformance/fleet" and method == "GET":
            return await _send_json(send, 200, fleet.view())
        if path == "/conformance/records" and method == "GET":
            q = parse_qs(scope.get("query_string", b"").decode())
            rid = (q.get("rid") or [""])[0]
            return await _send_json(send, 200, fleet.records.get(rid, []))
        if path == "/conformance/control" and method == "POST":
            raw = await _read(receive)
            try:
                obj = orjson.loads(raw or b"{}")
                assert isinstance(obj, dict)
                target = obj.get("engine", "all")
                engines = list(fleet.engines.values()) if target == "all" else [fleet.engines[target]]
                health = obj.get("health")
                assert health in (None, "ok", "fail", "hang")
                defaults = obj.get("defaults", ...)
                assert defaults is ... or defaults is None or isinstance(defaults, dict)
            except (orjson.JSONDecodeError, AssertionError, KeyError):
                return await _send_json(send, 400, {"error": 'expected {"engine": NAME|"all", "health": "ok"|"fail"|"hang", "defaults": {...}|null}'})
            for e in engines:
                if health is not None:
                    e.health = health
                    if e.changed is not None:
                        e.changed.set()
                        e.changed = asyncio.Event()
                if defaults is not ...:
                    e.defaults = defaults
            return await _send_json(send, 200, fleet.view())
        return await _send_json(send, 404, {"error": "unknown conformance control route"})

    async def _completion(self, scope: dict[str, Any], receive: Any, send: Any, path: str) -> None:
        raw = await _read(receive)
        if raw is None:
            return
        ctl, fleet = self.ctl, self.fleet
        rid = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), "")
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        sent = raw
        attempt = 0
        if isinstance(body, dict):
            changed = False
            mock = body.get("mock")
            if isinstance(mock, dict) and isinstance(mock.get("rid"), str):
                rid = rid or mock["rid"]  # engines a router sends no x-request-id
            if (mock is None or (isinstance(mock, dict) and set(mock) <= {"rid"})) and ctl.defaults is not None:
                body = {**body, "mock": ctl.defaults}
                changed = True
            mock = body.get("mock")
            if isinstance(mock, dict) and "fault_attempts" in mock:
                mock = dict(mock)
                n = mock.pop("fault_attempts")
                if ctl.role in ("decode", "unified"):
                    attempt = fleet.attempts.get(rid, 0) + 1
                    fleet.attempts[rid] = attempt
                    keep = isinstance(n, int) and attempt <= n
                else:
                    keep = False
                if not keep:
                    mock.pop("fault", None)
                body = {**body, "mock": mock}
                changed = True
            if changed:
                sent = orjson.dumps(body)
        rec: dict[str, Any] = {"engine": ctl.name, "role": ctl.role, "dialect": ctl.dialect, "path": path, "attempt": attempt,
                               "body": orjson.loads(raw) if isinstance(body, dict) else raw[:2000].decode("utf-8", "replace"),
                               "status": None, "response": None}
        if rid:
            fleet.record(rid, rec)
        delivered = False

        async def inner_receive() -> Any:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": sent, "more_body": False}
            return await receive()

        captured: list[bytes] = []
        is_json = False

        async def inner_send(msg: dict[str, Any]) -> None:
            nonlocal is_json
            if msg["type"] == "http.response.start":
                rec["status"] = msg["status"]
                is_json = any(k == b"content-type" and v.startswith(b"application/json") for k, v in msg.get("headers", ()))
            elif msg["type"] == "http.response.body" and is_json:
                captured.append(msg.get("body", b""))
                if not msg.get("more_body"):
                    data = b"".join(captured)
                    if len(data) <= _RESPONSE_LIMIT:
                        with contextlib.suppress(orjson.JSONDecodeError):
                            rec["response"] = orjson.loads(data)
            await send(msg)

        await self.inner(scope, inner_receive, inner_send)


def _bind(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
    except OSError as e:
        s.close()
        raise FleetError(f"cannot bind the mock fleet's port 127.0.0.1:{port}: {e.strerror} (is another fleet running? use --port-base)") from None
    s.listen(1024)
    return s


def _apps(profile: Profile, port_base: int) -> tuple[FleetState, list[ControlledEngine]]:
    fleet = FleetState(profile.name)
    apps = []
    for e, mc in zip(profile.engines, mock_configs(profile, port_base), strict=True):
        ctl = EngineControl(e.name, e.role, e.dialect, e.port(port_base))
        fleet.engines[e.name] = ctl
        apps.append(ControlledEngine(create_mock_app(mc), ctl, fleet))
    return fleet, apps


async def serve_fleet(profile: Profile, port_base: int = DEFAULT_PORT_BASE, stop: asyncio.Event | None = None) -> None:
    """Serve the profile's fleet on this event loop until `stop` is set."""
    stop = stop or asyncio.Event()
    socks = [_bind(e.port(port_base)) for e in profile.engines]
    fleet, apps = _apps(profile, port_base)
    for ctl in fleet.engines.values():
        ctl.changed = asyncio.Event()
    try:
        await serve_apps(apps, socks, stop)
    finally:
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()


@contextlib.contextmanager
def running_fleet(profiles: list[Profile], port_base: int = DEFAULT_PORT_BASE) -> Iterator[None]:
    """Run the fleets of several profiles in one background thread; stop on exit."""
    socks = [_bind(e.port(port_base)) for p in profiles for e in p.engines]

    def make_apps() -> list[ControlledEngine]:
        apps: list[ControlledEngine] = []
        for p in profiles:
            fleet, papps = _apps(p, port_base)
            for ctl in fleet.engines.values():
                ctl.changed = asyncio.Event()  # bound to the serving loop
            apps += papps
        return apps

    try:
        with serve_in_thread(make_apps, socks, name="narwhal-conformance-fleet"):
            yield
    except RuntimeError as e:
        raise FleetError(str(e)) from e
