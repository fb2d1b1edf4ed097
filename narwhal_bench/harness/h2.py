"""The load tool's HTTP/2 clients (the rules: client.py's docstring): `H2Pool` drives the
`h2` state machine from an asyncio.Protocol (h2c by prior knowledge, a few connections,
streams spread over them, a large receive window so no per-event WINDOW_UPDATE);
`H2Client` uses httpx (https with ALPN) and costs several times more CPU per event."""

from __future__ import annotations

import asyncio
import time

from .client import SSERecorder, connect, split_url

__all__ = ["H2Pool", "H2Client"]

_clock = time.perf_counter


class _H2Conn(asyncio.Protocol):
    """One HTTP/2 cleartext connection (prior knowledge), many streams, on the `h2` state
    machine directly: no httpx/httpcore layers between the socket and the recorder."""

    def __init__(self, authority: str) -> None:
        import h2.config
        import h2.connection

        self.h2 = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.authority = authority.encode()
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, tuple[SSERecorder, asyncio.Future[bool]]] = {}
        self.closed = False
        self.max_streams = 100
        self.pending: dict[int, bytes] = {}  # request body bytes waiting for send window

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        from h2.settings import SettingCodes

        self.transport = transport  # type: ignore[assignment]
        self.h2.local_settings = type(self.h2.local_settings)(client=True, initial_values={SettingCodes.INITIAL_WINDOW_SIZE: 1 << 24, SettingCodes.ENABLE_PUSH: 0})
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(1 << 28)
        self.transport.write(self.h2.data_to_send())

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        for _, fut in self.streams.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"HTTP/2 connection closed ({exc or 'EOF'})"))
        self.streams.clear()

    def data_received(self, data: bytes) -> None:
        import h2.events as ev

        now = _clock()
        try:
            events = self.h2.receive_data(data)
        except Exception as e:  # protocol error: fail every stream
            self.connection_lost(e)
            if self.transport is not None:
                self.transport.close()
            return
        for e in events:
            if isinstance(e, ev.DataReceived):
                st = self.streams.get(e.stream_id)
                if st is not None:
                    st[0].on_body(e.data, now)
                if e.flow_controlled_length:
                    self.h2.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
            elif isinstance(e, ev.ResponseReceived):
                st = self.streams.get(e.stream_id)
                if st is not None:
                    hd = {bytes(k).lower(): bytes(v) for k, v in e.headers}
                    st[0].on_headers(int(hd.get(b":status", b"0")), hd, now)
            elif isinstance(e, ev.StreamEnded):
                st = self.streams.pop(e.stream_id, None)
                if st is not None:
                    st[0].on_end(now)
                    if not st[1].done():
                        st[1].set_result(True)
            elif isinstance(e, ev.StreamReset):
                st = self.streams.pop(e.stream_id, None)
                if st is not None and not st[1].done():
                    st[1].set_exception(ConnectionError(f"stream reset by the server (error code {e.error_code})"))
            elif isinstance(e, ev.WindowUpdated):
                for sid in list(self.pending) if e.stream_id == 0 else [e.stream_id]:
                    self._flush(sid)
            elif isinstance(e, ev.RemoteSettingsChanged):
                self.max_streams = self.h2.remote_settings.max_concurrent_streams or self.max_streams
            elif isinstance(e, ev.ConnectionTerminated):
                self.closed = True
        out = self.h2.data_to_send()
        if out and self.transport is not None:
            self.transport.write(out)

    def send(self, method: str, path: str, body: bytes | None, headers: dict[str, str], rec: SSERecorder) -> tuple[int, asyncio.Future[bool]]:
        assert self.transport is not None
        sid = self.h2.get_next_available_stream_id()
        hd = [(b":method", method.encode()), (b":path", path.encode()), (b":scheme", b"http"), (b":authority", self.authority)]
        hd += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        if body is not None:
            hd.append((b"content-length", str(len(body)).encode()))
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even when nobody awaits
        self.streams[sid] = (rec, fut)
        rec.r.sent = _clock()
        self.h2.send_headers(sid, hd, end_stream=body is None)
        if body is not None:
            self.pending[sid] = body
            self._flush(sid)
        self.transport.write(self.h2.data_to_send())
        return sid, fut

    def _flush(self, sid: int) -> None:
        """Send what the flow-control windows allow of a request body; the rest waits for
        the server's WINDOW_UPDATE."""
        body = self.pending.get(sid)
        while body is not None:
            n = min(len(body), self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
            if n <= 0:
                self.pending[sid] = body
                return
            self.h2.send_data(sid, body[:n], end_stream=n == len(body))
            body = body[n:] if n < len(body) else None
        self.pending.pop(sid, None)

    def reset(self, sid: int) -> None:
        self.streams.pop(sid, None)
        self.pending.pop(sid, None)
        if self.closed or self.transport is None:
            return
        import h2.errors

        try:
            self.h2.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
            self.transport.write(self.h2.data_to_send())
        except Exception:  # the stream already closed
            pass


class H2Pool:
    """HTTP/2 cleartext by prior knowledge on a few connections (streams spread round-robin,
    a new connection when all are at the server's stream limit)."""

    def __init__(self, url: str, *, headers: dict[str, str] | None = None, connections: int = 4, connect_timeout_s: float = 5.0) -> None:
        scheme, self.host, self.port, self.prefix = split_url(url)
        if scheme != "http":
            raise ValueError("the raw HTTP/2 client speaks h2c (prior knowledge); use H2Client for https")
        self._headers = {"content-type": "application/json", **(headers or {})}
        self.connections = connections
        self.connect_timeout_s = connect_timeout_s
        self._conns: list[_H2Conn] = []
        self._next = 0
        self._lock: asyncio.Lock | None = None
        self.opened = 0

    async def _conn(self) -> _H2Conn:
        self._conns = [c for c in self._conns if not c.closed]
        if len(self._conns) >= self.connections:
            for _ in range(len(self._conns)):
                c = self._conns[self._next % len(self._conns)]
                self._next += 1
                if len(c.streams) < c.max_streams:
                    return c
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            loop = asyncio.get_running_loop()
            _, c = await asyncio.wait_for(loop.create_connection(lambda: _H2Conn(f"{self.host}:{self.port}"), self.host, self.port), self.connect_timeout_s)
            self._conns.append(c)
            self.opened += 1
            return c

    async def request(self, method: str, path: str, body: bytes | None, rec: SSERecorder, *, headers: dict[str, str] | None = None, timeout_s: float = 60.0) -> None:
        c = await connect(self._conn(), rec)
        if c is None:
            return
        h = {**self._headers, **(headers or {})}
        try:
            sid, fut = c.send(method, self.prefix + path, body, h, rec)
        except Exception as e:  # an h2 protocol error on this connection
            rec.r.sent = rec.r.sent or _clock()
            rec.r.error = f"HTTP/2: {type(e).__name__}: {e}"
            return
        try:
            await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            rec.r.error = rec.r.error or f"timeout after {timeout_s:g} s"
            c.reset(sid)
        except ConnectionError as e:
            rec.r.error = rec.r.error or str(e)
        except asyncio.CancelledError:
            c.reset(sid)
            raise

    async def aclose(self) -> None:
        for c in self._conns:
            if c.transport is not None:
                c.transport.close()
        self._conns.clear()
        await asyncio.sleep(0)


class H2Client:
    """HTTP/2 over httpx: h2c by prior knowledge on http://, ALPN h2 on https://."""

    def __init__(self, url: str, *, headers: dict[str, str] | None = None, connect_timeout_s: float = 5.0, verify: bool = False) -> None:
        import httpx

        self.base = url.rstrip("/")
        self._headers = {"content-type": "application/json", **(headers or {})}
        self._c = httpx.AsyncClient(
            http1=False, http2=True, verify=verify, trust_env=False,
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )
        self.opened = 0

    async def request(self, method: str, path: str, body: bytes | None, rec: SSERecorder, *, headers: dict[str, str] | None = None, timeout_s: float = 60.0) -> None:
        import httpx

        h = {**self._headers, **(headers or {})}

        async def go() -> None:
            rec.r.sent = _clock()
            async with self._c.stream(method, self.base + path, content=body, headers=h) as resp:
                rec.on_headers(resp.status_code, {k.encode().lower(): v.encode() for k, v in resp.headers.items()}, _clock())
                async for chunk in resp.aiter_raw():
                    rec.on_body(chunk, _clock())
                rec.on_end(_clock())

        try:
            await asyncio.wait_for(go(), timeout_s)
        except TimeoutError:
            rec.r.error = rec.r.error or f"timeout after {timeout_s:g} s"
        except (httpx.HTTPError, OSError) as e:
            rec.r.error = rec.r.error or f"{type(e).__name__}: {e}"

    async def aclose(self) -> None:
        await self._c.aclose()
