"""A small etcd v3 client over etcd's JSON gateway (the v3 API at /v3/*, served on every
etcd client URL): exactly the calls leader election (narwhal/authority/ha.py) and the etcd
fleet source (narwhal/fleet/etcd.py) need, each bounded in time and in size.

Why not a gRPC client (aetcd, etcd3): grpcio is a large native dependency whose threads
do not survive fork (the router starts worker processes), and those clients give less
control over per-call deadlines, which fencing depends on. The JSON gateway is etcd's own
(grpc-gateway, part of the server since v3.3), so the semantics are etcd's: leases,
transactions, revisions and watches are the same objects.

Keys and values travel base64-encoded; 64-bit integers travel as JSON strings.

A production etcd: TLS, client certificates, users
  * TLS: give https:// URLs and `ca_file`, the PEM of the CA(s) that sign etcd's server
    certificates (etcd `--cert-file/--key-file`); without `ca_file` the system's trust
    store verifies them. The server certificate must name the host of the URL (an IP SAN
    for https://10.0.0.5:2379).
  * Client certificates (etcd `--client-cert-auth --trusted-ca-file`): `cert_file` and
    `key_file`, a PEM certificate that etcd's trusted CA signed, with its private key.
    etcd does not map a certificate's common name to a user on gateway (HTTP/JSON)
    requests: the certificate only lets the router connect; authorisation is the user's.
  * Users (etcd `auth enable`): `username` and `password`. The client authenticates
    (POST /v3/auth/authenticate) before its first call and sends the token etcd returns as
    the `Authorization` header (the raw token: what etcd's gateway reads) on every call;
    when etcd says the token is no longer valid (gRPC code 16 Unauthenticated, "invalid auth
    token": simple tokens expire after etcd's --auth-token-ttl of disuse, all tokens on an
    etcd restart; or "revision of auth store is old" after a permission change) it
    authenticates once again and repeats the call, within the same time bound. The user
    needs read and write on the election key (ha) and read on the discovery prefix. The
    password is kept out of every repr, log line and exception.

Watches (`watch_delete`, `watch_prefix`) read etcd's streaming answer line by line, each
line bounded; the stream's creation is bounded by the call timeout, its length is the
caller's. A watch that cannot go on raises: `EtcdCompacted` when its start revision was
compacted away (the caller reads again and watches from the new revision), `EtcdError`
when it was cancelled or the stream broke.
"""

from __future__ import annotations

import asyncio
import base64
import os
import ssl
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

__all__ = ["Etcd", "EtcdError", "EtcdCompacted", "Campaign", "KeyValue", "WatchEvent", "prefix_end"]

MAX_ANSWER_BYTES = 1 << 20  # an etcd answer the router reads (a watch event line included)


class EtcdError(Exception):
    """No etcd endpoint answered in time, or it answered with an error."""


class EtcdCompacted(EtcdError):
    """A watch's start revision was compacted away: read again, watch from there."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


@dataclass(frozen=True, slots=True)
class KeyValue:
    value: bytes
    lease: int
    create_revision: int
    mod_revision: int


@dataclass(frozen=True, slots=True)
class Campaign:
    won: bool
    revision: int  # the store revision after the transaction: the key's create_revision when won
    holder: KeyValue | None  # who holds the key when lost


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: str  # "PUT" | "DELETE"
    key: bytes
    kv: KeyValue  # for a DELETE: an empty value, mod_revision the deletion's revision


class _Secret:
    """A password: never shown (repr, str, logs, tracebacks with locals)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "<secret>"

    __str__ = __repr__


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _kv(d: dict[str, Any]) -> KeyValue:
    return KeyValue(base64.b64decode(d.get("value", "")), int(d.get("lease", 0)), int(d.get("create_revision", 0)), int(d.get("mod_revision", 0)))


def prefix_end(prefix: bytes) -> bytes:
    """The range_end of every key that starts with `prefix` (the prefix with its last
    byte that is not 0xff incremented; b"\\0", every key, when there is none)."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"


def ssl_context(ca_file: str | None, cert_file: str | None, key_file: str | None) -> ssl.SSLContext:
    """The TLS context of https:// endpoints: etcd's server certificate verified against
    ca_file (None: the system's trust store), the client certificate when cert_file."""
    if key_file is not None and cert_file is None:
        raise EtcdError("key_file without cert_file")
    for name, path in (("ca_file", ca_file), ("cert_file", cert_file), ("key_file", key_file)):
        if path is not None and not os.access(path, os.R_OK):
            raise EtcdError(f"{name} {path}: not a readable file")
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
        if cert_file is not None:
            ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as x:
        raise EtcdError(f"ca_file {ca_file}, cert_file {cert_file}, key_file {key_file}: not PEM the TLS context can load ({x})") from None
    return ctx


def _auth_stale(obj: Any) -> bool:
    """etcd says the token is not (or no longer) valid."""
    if not isinstance(obj, dict):
        return False
    msg = str(obj.get("message") or obj.get("error") or "")
    return obj.get("code") == 16 or "invalid auth token" in msg or "auth store is old" in msg


class Etcd:
    def __init__(self, urls: list[str], *, timeout_s: float, ca_file: str | None = None, cert_file: str | None = None,
                 key_file: str | None = None, username: str | None = None, password: str | None = None) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.username = username
        self._password = _Secret(password or "")
        self._token: str | None = None
        self._auth_lock = asyncio.Lock()
        self._next = 0  # the endpoint that answered last is tried first
        tls = any(u.startswith("https://") for u in self.urls) or ca_file is not None or cert_file is not None
        verify: ssl.SSLContext | bool = ssl_context(ca_file, cert_file, key_file) if tls else True
        self.client = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=8), verify=verify)

    def __repr__(self) -> str:
        user = f", user {self.username!r}" if self.username is not None else ""
        return f"Etcd({self.urls!r}{user})"

    async def aclose(self) -> None:
        await self.client.aclose()

    # -- calls -------------------------------------------------------------------------------

    async def _post(self, path: str, body: dict[str, Any], headers: dict[str, str], max_bytes: int) -> tuple[int, Any]:
        """POST to the first endpoint that answers: (HTTP status, the JSON answer)."""
        last: BaseException | None = None
        content = orjson.dumps(body)
        for k in range(len(self.urls)):
            i = (self._next + k) % len(self.urls)
            try:
                async with self.client.stream("POST", self.urls[i] + path, content=content, headers=headers) as r:
                    raw = bytearray()
                    async for chunk in r.aiter_bytes():
                        raw += chunk
                        if len(raw) > max_bytes:
                            raise EtcdError(f"{path}: an answer over {max_bytes} bytes")
                    status = r.status_code
            except httpx.HTTPError as x:
                last = x
                continue
            self._next = i
            try:
                return status, orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise EtcdError(f"{path}: HTTP {status} with a body that is not JSON") from None
        raise EtcdError(f"{path}: no endpoint answered ({type(last).__name__}: {last})")

    async def _headers(self) -> dict[str, str]:
        h = {"content-type": "application/json"}
        if self.username is not None:
            h["authorization"] = await self._authenticate()
        return h

    async def _authenticate(self) -> str:
        """The token: the one held, or a new one from etcd (one authentication at a time)."""
        async with self._auth_lock:
            if self._token is not None:
                return self._token
            status, obj = await self._post("/v3/auth/authenticate", {"name": self.username, "password": self._password.reveal()},
                                           {"content-type": "application/json"}, MAX_ANSWER_BYTES)
            token = obj.get("token") if isinstance(obj, dict) else None
            if status != 200 or not isinstance(token, str) or not token:
                why = (obj.get("message") or obj.get("error")) if isinstance(obj, dict) else None
                raise EtcdError(f"authenticate as {self.username!r}: HTTP {status}: {why or 'no token'}")
            self._token = token
            return token

    def _drop_token(self, token: str | None) -> None:
        if token is not None and self._token == token:
            self._token = None

    async def call(self, path: str, body: dict[str, Any], *, timeout_s: float | None = None, ok_codes: tuple[int, ...] = (),
                   max_bytes: int = MAX_ANSWER_BYTES) -> dict[str, Any]:
        """POST to the first endpoint that answers, within timeout_s in all (an
        authentication included). An etcd error answer (HTTP 4xx/5xx with a gRPC code)
        raises, unless its code is in `ok_codes` (then its body is returned)."""
        budget = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(max(0.001, budget)):
                for attempt in (0, 1):
                    headers = await self._headers()
                    status, obj = await self._post(path, body, headers, max_bytes)
                    if status != 200:
                        if self.username is not None and attempt == 0 and _auth_stale(obj):
                            self._drop_token(headers.get("authorization"))
                            continue  # authenticate once again, repeat the call
                        if isinstance(obj, dict) and obj.get("code") in ok_codes:
                            return obj
                        raise EtcdError(f"{path}: HTTP {status}: {obj.get('message') or obj.get('error') if isinstance(obj, dict) else obj}")
                    if not isinstance(obj, dict):
                        raise EtcdError(f"{path}: an answer that is not an object")
                    return obj
        except TimeoutError:
            raise EtcdError(f"{path}: no answer within {budget * 1000:.0f} ms") from None
        raise EtcdError(f"{path}: the token etcd gave was refused")  # pragma: no cover - the loop returns or raises

    # -- leases ------------------------------------------------------------------------------

    async def grant(self, ttl_s: int, *, timeout_s: float | None = None) -> tuple[int, int]:
        """A new lease: (ID, TTL s)."""
        obj = await self.call("/v3/lease/grant", {"TTL": ttl_s}, timeout_s=timeout_s)
        if obj.get("error"):
            raise EtcdError(f"lease grant: {obj['error']}")
        return int(obj["ID"]), int(obj.get("TTL", 0))

    async def keepalive(self, lease: int, *, timeout_s: float | None = None) -> int:
        """Renew `lease`; its TTL in seconds, 0 when etcd no longer has it."""
        obj = await self.call("/v3/lease/keepalive", {"ID": str(lease)}, timeout_s=timeout_s)
        res = obj.get("result", obj)
        return int(res.get("TTL", 0)) if isinstance(res, dict) else 0

    async def revoke(self, lease: int, *, timeout_s: float | None = None) -> None:
        """Revoke `lease` (its keys are deleted); a lease etcd no longer has is fine."""
        await self.call("/v3/lease/revoke", {"ID": str(lease)}, timeout_s=timeout_s, ok_codes=(5,))  # 5: NotFound

    # -- keys --------------------------------------------------------------------------------

    async def campaign(self, key: bytes, value: bytes, lease: int, *, timeout_s: float | None = None) -> Campaign:
        """Create `key` with `lease` if nobody holds it (its create revision is 0)."""
        k = _b64(key)
        obj = await self.call("/v3/kv/txn", {
            "compare": [{"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
            "success": [{"request_put": {"key": k, "value": _b64(value), "lease": str(lease)}}],
            "failure": [{"request_range": {"key": k}}],
        }, timeout_s=timeout_s)
        rev = int(obj.get("header", {}).get("revision", 0))
        if obj.get("succeeded"):
            return Campaign(True, rev, None)
        holder = None
        for r in obj.get("responses", []):
            kvs = r.get("response_range", {}).get("kvs") or []
            if kvs:
                holder = _kv(kvs[0])
        return Campaign(False, rev, holder)

    async def put_if_held(self, guard: bytes, lease: int, key: bytes, value: bytes, *, timeout_s: float | None = None) -> bool:
        """Put `key` (no lease: it outlives its writer) only while `guard` carries
        `lease`, in one transaction: a leader that lost its key writes nothing."""
        obj = await self.call("/v3/kv/txn", {
            "compare": [{"key": _b64(guard), "result": "EQUAL", "target": "LEASE", "lease": str(lease)}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
        }, timeout_s=timeout_s)
        return bool(obj.get("succeeded"))

    async def get(self, key: bytes, *, timeout_s: float | None = None) -> tuple[KeyValue | None, int]:
        """(the key, the store revision)."""
        obj = await self.call("/v3/kv/range", {"key": _b64(key)}, timeout_s=timeout_s)
        kvs = obj.get("kvs") or []
        return (_kv(kvs[0]) if kvs else None), int(obj.get("header", {}).get("revision", 0))

    async def get_prefix(self, prefix: bytes, *, limit: int = 0, timeout_s: float | None = None,
                         max_bytes: int = MAX_ANSWER_BYTES) -> tuple[int, list[tuple[bytes, KeyValue]]]:
        """Every key under `prefix` (at most `limit`, 0: no limit), sorted by key, at one
        revision: (that revision, [(key, KeyValue)])."""
        body: dict[str, Any] = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        if limit:
            body["limit"] = str(limit)
        obj = await self.call("/v3/kv/range", body, timeout_s=timeout_s, max_bytes=max_bytes)
        kvs = obj.get("kvs") or []
        return int(obj.get("header", {}).get("revision", 0)), [(base64.b64decode(d.get("key", "")), _kv(d)) for d in kvs]

    async def count_prefix(self, prefix: bytes, *, timeout_s: float | None = None) -> tuple[int, int]:
        """(the store revision, how many keys are under `prefix`): a cheap liveness read."""
        obj = await self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)), "count_only": True},
                              timeout_s=timeout_s)
        return int(obj.get("header", {}).get("revision", 0)), int(obj.get("count", 0))

    # -- watches -----------------------------------------------------------------------------

    async def _watch(self, create: dict[str, Any], max_line_bytes: int) -> AsyncIterator[dict[str, Any]]:
        """The `result` of every answer of one streaming watch after its creation. The
        creation (connect, authenticate, etcd's `created` answer) is bounded by timeout_s;
        a cancelled watch raises (EtcdCompacted when its start revision was compacted)."""
        body = orjson.dumps({"create_request": create})
        timeout = httpx.Timeout(self.timeout_s, read=None)
        r: httpx.Response | None = None
        lines: AsyncGenerator[bytes, None] | None = None
        headers: dict[str, str] = {}
        try:
            try:
                async with asyncio.timeout(self.timeout_s):
                    headers = await self._headers()
                    last: BaseException | None = None
                    for k in range(len(self.urls)):
                        i = (self._next + k) % len(self.urls)
                        try:
                            req = self.client.build_request("POST", self.urls[i] + "/v3/watch", content=body, headers=headers, timeout=timeout)
                            r = await self.client.send(req, stream=True)
                        except httpx.HTTPError as x:
                            last = x
                            continue
                        self._next = i
                        break
                    if r is None:
                        raise EtcdError(f"watch: no endpoint answered ({type(last).__name__}: {last})")
                    if r.status_code != 200:
                        raw = b""
                        async for chunk in r.aiter_bytes():
                            raw += chunk
                            if len(raw) > MAX_ANSWER_BYTES:
                                break
                        try:
                            obj = orjson.loads(raw)
                        except orjson.JSONDecodeError:
                            obj = None
                        if _auth_stale(obj):
                            self._drop_token(headers.get("authorization"))
                        raise EtcdError(f"watch: HTTP {r.status_code}")
                    lines = _lines(r, max_line_bytes)
                    first = self._result(await anext(lines, b""), headers)
            except TimeoutError:
                raise EtcdError(f"watch: not created within {self.timeout_s * 1000:.0f} ms") from None
            except httpx.HTTPError as x:
                raise EtcdError(f"watch: {type(x).__name__}: {x}") from None
            if not first.get("created") or first.get("events"):
                yield first
            try:
                async for line in lines:
                    yield self._result(line, headers)
            except httpx.HTTPError as x:
                raise EtcdError(f"watch: the stream broke ({type(x).__name__}: {x})") from None
            raise EtcdError("watch: the stream ended")
        finally:
            if lines is not None:
                await lines.aclose()
            if r is not None:
                await r.aclose()

    def _result(self, line: bytes, headers: dict[str, str]) -> dict[str, Any]:
        """One answer line of a watch: its result, or why the watch cannot go on."""
        if not line:
            raise EtcdError("watch: the stream ended before the watch was created")
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise EtcdError("watch: an answer line that is not JSON") from None
        res = obj.get("result") if isinstance(obj, dict) else None
        if not isinstance(res, dict):
            err = obj.get("error") if isinstance(obj, dict) else None
            if _auth_stale(err):
                self._drop_token(headers.get("authorization"))
            raise EtcdError(f"watch: {err.get('message') if isinstance(err, dict) else 'an answer without a result'}")
        if res.get("canceled"):
            compact = int(res.get("compact_revision", 0) or 0)
            reason = str(res.get("cancel_reason", ""))
            if compact:
                raise EtcdCompacted(f"watch: its start revision was compacted (the oldest is {compact})", compact)
            if "permission denied" in reason or "auth" in reason:
                self._drop_token(headers.get("authorization"))  # authenticate again before the next call
            raise EtcdError(f"watch canceled: {reason}")
        return res

    async def watch_delete(self, key: bytes, start_revision: int) -> AsyncIterator[int]:
        """Yield the revision of every DELETE of `key` from `start_revision` on (a
        streaming watch; it raises when the stream ends). No timeout after its creation:
        the caller bounds it."""
        create = {"key": _b64(key), "start_revision": str(start_revision)}
        async for res in self._watch(create, MAX_ANSWER_BYTES):
            for ev in res.get("events") or []:
                if ev.get("type") == "DELETE":
                    yield int(ev.get("kv", {}).get("mod_revision", 0))

    async def watch_prefix(self, prefix: bytes, start_revision: int, *, max_line_bytes: int = MAX_ANSWER_BYTES) -> AsyncIterator[list[WatchEvent]]:
        """Yield the events under `prefix` from `start_revision` on, one list per answer
        of etcd (the events of one revision or more, in order). No timeout after the
        watch's creation: the caller bounds it. Raises EtcdCompacted when start_revision
        was compacted away, EtcdError when the watch is cancelled or the stream ends."""
        create = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)), "start_revision": str(start_revision)}
        async for res in self._watch(create, max_line_bytes):
            batch = []
            for ev in res.get("events") or []:
                kv = ev.get("kv") or {}
                batch.append(WatchEvent("DELETE" if ev.get("type") == "DELETE" else "PUT", base64.b64decode(kv.get("key", "")), _kv(kv)))
            if batch:
                yield batch


async def _lines(r: httpx.Response, limit: int) -> AsyncGenerator[bytes, None]:
    """The non-empty lines of a streaming answer, none (nor the buffer) over `limit` bytes."""
    buf = bytearray()
    async for chunk in r.aiter_bytes():
        buf += chunk
        while True:
            i = buf.find(b"\n")
            if i < 0:
                break
            line = bytes(buf[:i])
            del buf[: i + 1]
            if len(line) > limit:
                raise EtcdError("watch: an event line over the bound")
            if line.strip():
                yield line
        if len(buf) > limit:
            raise EtcdError("watch: an event line over the bound")
    if buf.strip():
        yield bytes(buf)
