"""The conformance mock fleet: a profile's mock engines on their documented loopback
ports, each wrapped in a thin control layer that a runner in any language drives over
HTTP.

Control API (on every fleet port; the state is fleet-wide):
  GET  /conformance/fleet                     {"profile", "engines": [{name, role, dialect, port, health}]}
  POST /conformance/control                   {"engine": NAME|"all", "health": "ok"|"fail"|"hang",
                                               "defaults": {mock options}|null, "abort": true}
  GET  /conformance/records?rid=ID            what every engine received for that request id (the
                                              body field mock.rid, else the x-request-id header):
                                              [{engine, role, dialect, path, attempt, body, status,
                                                response, stream}]
Everything else reaches the mock engine (narwhal/mock) unchanged, except:
  * health "fail": GET /health (and GET /v1/models, the openai dialect's health path)
    answer 503; "hang": they answer only once the health is set back (or the poller
    gives up), so a router's health data goes stale instead of failing;
  * `defaults` are the `mock` options of a completion request that carries none besides
    `rid` (the router's own profiling traffic included);
  * `mock.fault_attempts: N` keeps the fault on the first N attempts of a request id at
    decode or unified engines only, so "the first decode attempt fails" is data, whatever
    engine a router picks first. Prefill engines never see such a fault.
  * `mock.fault_roles: [ROLE...]` keeps the fault only on engines of these roles
    (`output` = decode and unified: the engine that generates the client's output), so
    one script fires on whichever engine a P/D or a unified router picks.
  * `abort: true` ends every engine request in flight (the runner's last resort after a
    case whose router left engine requests running; the case has failed by then).

Rules
  * Records are keyed by the body's mock.rid first (a router may rewrite x-request-id;
    the body field passes through), else x-request-id, and bounded (oldest ids first).
  * Non-streaming JSON answers up to 64 KiB are recorded with the request (the prefill
    leg's kv_transfer_params, for the decode-leg check); `meta` holds the answer's id,
    created and model (of its first chunk when it streamed).
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
    serving: set[asyncio.Task[Any]] = field(default_factory=set)  # engine requests in flight
    aborted: set[asyncio.Task[Any]] = field(default_factory=set)

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
                assert obj.get("abort", False) in (True, False)
            except (orjson.JSONDecodeError, AssertionError, KeyError):
                return await _send_json(send, 400, {"error": 'expected {"engine": NAME|"all", "health": "ok"|"fail"|"hang", "defaults": {...}|null, "abort": true}'})
            if obj.get("abort"):
                for t in list(fleet.serving):
                    fleet.aborted.add(t)
                    t.cancel()
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
        """A completion request: its `mock` options made this engine's (`_rewrite`), recorded
        under its request id with what the engine answers (`_Capture`), then served by the
        mock engine; an abort through the control API cuts it."""
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
            rid, attempt, rewritten = self._rewrite(body, rid)
            if rewritten is not None:
                sent = orjson.dumps(rewritten)
        rec: dict[str, Any] = {"engine": ctl.name, "role": ctl.role, "dialect": ctl.dialect, "path": path, "attempt": attempt,
                               "body": orjson.loads(raw) if isinstance(body, dict) else raw[:2000].decode("utf-8", "replace"),
                               "status": None, "response": None, "meta": None}
        if rid:
            fleet.record(rid, rec)
        delivered = False

        async def inner_receive() -> Any:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": sent, "more_body": False}
            return await receive()

        task = asyncio.current_task()
        assert task is not None
        fleet.serving.add(task)
        try:
            await self.inner(scope, inner_receive, _Capture(rec, send))
        except asyncio.CancelledError:
            if task not in fleet.aborted:
                raise
            task.uncancel()  # aborted through the control API: the answer ends here, cut
        finally:
            fleet.serving.discard(task)
            fleet.aborted.discard(task)

    def _rewrite(self, body: dict[str, Any], rid: str) -> tuple[str, int, dict[str, Any] | None]:
        """The body's `mock` options as this engine is to see them (module docstring): the
        runner's mock.rid names the request (it survives a router that rewrites
        x-request-id); the fleet's defaults stand in for options with none besides rid;
        fault_attempts and fault_roles decide whether the fault stays, and go. Returns (the
        request id, the attempt counted at a decode or unified engine or 0, the body to
        send, or None: the one received)."""
        ctl, fleet = self.ctl, self.fleet
        attempt = 0
        changed = False
        mock = body.get("mock")
        if isinstance(mock, dict) and isinstance(mock.get("rid"), str):
            rid = mock["rid"]
        if (mock is None or (isinstance(mock, dict) and set(mock) <= {"rid"})) and ctl.defaults is not None:
            body = {**body, "mock": ctl.defaults}
            changed = True
        mock = body.get("mock")
        if isinstance(mock, dict) and ("fault_attempts" in mock or "fault_roles" in mock):
            mock = dict(mock)
            keep = True
            if "fault_roles" in mock:
                roles = mock.pop("fault_roles")
                roles = {r for x in roles for r in (("decode", "unified") if x == "output" else (x,))} if isinstance(roles, list) else set()
                keep = ctl.role in roles
            if "fault_attempts" in mock:
                n = mock.pop("fault_attempts")
                if ctl.role in ("decode", "unified"):
                    attempt = fleet.attempts.get(rid, 0) + 1
                    fleet.attempts[rid] = attempt
                    keep = keep and isinstance(n, int) and attempt <= n
                else:
                    keep = False
            if not keep:
                mock.pop("fault", None)
            body = {**body, "mock": mock}
            changed = True
        return rid, attempt, body if changed else None


class _Capture:
    """The ASGI `send` of one recorded request: every message passes on to the client;
    `rec` gets the status, a JSON answer up to _RESPONSE_LIMIT bytes (with its id, created
    and model as `meta`), or a streamed answer's first chunk's meta."""

    __slots__ = ("rec", "send", "kind", "captured")

    def __init__(self, rec: dict[str, Any], send: Any) -> None:
        self.rec = rec
        self.send = send
        self.kind = ""
        self.captured: list[bytes] = []

    async def __call__(self, msg: dict[str, Any]) -> None:
        rec = self.rec
        if msg["type"] == "http.response.start":
            rec["status"] = msg["status"]
            ctype = next((v for k, v in msg.get("headers", ()) if k == b"content-type"), b"")
            self.kind = "json" if ctype.startswith(b"application/json") else "sse" if ctype.startswith(b"text/event-stream") else ""
        elif msg["type"] == "http.response.body" and self.kind == "json":
            self.captured.append(msg.get("body", b""))
            if not msg.get("more_body"):
                data = b"".join(self.captured)
                if len(data) <= _RESPONSE_LIMIT:
                    with contextlib.suppress(orjson.JSONDecodeError):
                        rec["response"] = orjson.loads(data)
                        if isinstance(rec["response"], dict):
                            rec["meta"] = {k: rec["response"].get(k) for k in ("id", "created", "model")}
        elif msg["type"] == "http.response.body" and self.kind == "sse" and rec["meta"] is None:
            rec["meta"] = _first_chunk(msg.get("body", b""))
        await self.send(msg)


def _first_chunk(data: bytes) -> dict[str, Any] | None:
    """id, created and model of the first data event of a streamed answer."""
    for line in data.split(b"\n"):
        if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
            try:
                obj = orjson.loads(line[5:].strip())
            except orjson.JSONDecodeError:
                return None
            return {k: obj.get(k) for k in ("id", "created", "model")} if isinstance(obj, dict) else None
    return None


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
