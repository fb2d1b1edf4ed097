"""A small etcd v3 client over etcd's JSON gateway (the v3 API at /v3/*, served on every
etcd client URL): exactly the calls leader election needs, each bounded in time.

Why not a gRPC client (aetcd, etcd3): grpcio is a large native dependency whose threads
do not survive fork (the router starts worker processes), and those clients give less
control over per-call deadlines, which fencing depends on. The JSON gateway is etcd's own
(grpc-gateway, part of the server since v3.3), so the semantics are etcd's: leases,
transactions, revisions and watches are the same objects.

Keys and values travel base64-encoded; 64-bit integers travel as JSON strings.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

__all__ = ["Etcd", "EtcdError", "Campaign", "KeyValue"]

MAX_ANSWER_BYTES = 1 << 20  # an etcd answer the router reads (a watch event line included)


class EtcdError(Exception):
    """No etcd endpoint answered in time, or it answered with an error."""


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


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _kv(d: dict[str, Any]) -> KeyValue:
    return KeyValue(base64.b64decode(d.get("value", "")), int(d.get("lease", 0)), int(d.get("create_revision", 0)), int(d.get("mod_revision", 0)))


class Etcd:
    def __init__(self, urls: list[str], *, timeout_s: float) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self._next = 0  # the endpoint that answered last is tried first
        self.client = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=8))

    async def aclose(self) -> None:
        await self.client.aclose()

    async def call(self, path: str, body: dict[str, Any], *, timeout_s: float | None = None, ok_codes: tuple[int, ...] = ()) -> dict[str, Any]:
        """POST to the first endpoint that answers, within timeout_s in all. An etcd
        error answer (HTTP 4xx/5xx with a gRPC code) raises, unless its code is in
        `ok_codes` (then its body is returned)."""
        budget = self.timeout_s if timeout_s is None else timeout_s
        last: BaseException | None = None
        try:
            async with asyncio.timeout(max(0.001, budget)):
                for k in range(len(self.urls)):
                    i = (self._next + k) % len(self.urls)
                    try:
                        r = await self.client.post(self.urls[i] + path, content=orjson.dumps(body), headers={"content-type": "application/json"})
                    except httpx.HTTPError as x:
                        last = x
                        continue
                    self._next = i
                    if len(r.content) > MAX_ANSWER_BYTES:
                        raise EtcdError(f"{path}: an answer of {len(r.content)} bytes")
                    try:
                        obj = orjson.loads(r.content)
                    except orjson.JSONDecodeError:
                        raise EtcdError(f"{path}: HTTP {r.status_code} with a body that is not JSON") from None
                    if r.status_code != 200:
                        if isinstance(obj, dict) and obj.get("code") in ok_codes:
                            return obj
                        raise EtcdError(f"{path}: HTTP {r.status_code}: {obj.get('message') or obj.get('error') if isinstance(obj, dict) else obj}")
                    if not isinstance(obj, dict):
                        raise EtcdError(f"{path}: an answer that is not an object")
                    return obj
        except TimeoutError:
            raise EtcdError(f"{path}: no answer within {budget * 1000:.0f} ms") from None
        raise EtcdError(f"{path}: no endpoint answered ({last})")

    # -- leases --------------------------------------------------------------------------

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

    # -- keys ----------------------------------------------------------------------------

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

    async def get(self, key: bytes, *, timeout_s: float | None = None) -> tuple[KeyValue | None, int]:
        """(the key, the store revision)."""
        obj = await self.call("/v3/kv/range", {"key": _b64(key)}, timeout_s=timeout_s)
        kvs = obj.get("kvs") or []
        return (_kv(kvs[0]) if kvs else None), int(obj.get("header", {}).get("revision", 0))

    async def watch_delete(self, key: bytes, start_revision: int) -> AsyncIterator[int]:
        """Yield the revision of every DELETE of `key` from `start_revision` on (a
        streaming watch; it ends when the stream does). No timeout: the caller bounds it."""
        body = {"create_request": {"key": _b64(key), "start_revision": str(start_revision)}}
        url = self.urls[self._next]
        async with self.client.stream("POST", url + "/v3/watch", content=orjson.dumps(body), timeout=httpx.Timeout(self.timeout_s, read=None)) as r:
            if r.status_code != 200:
                raise EtcdError(f"watch: HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if len(line) > MAX_ANSWER_BYTES:
                    raise EtcdError("watch: an event line over the bound")
                if not line.strip():
                    continue
                obj = orjson.loads(line)
                res = obj.get("result", {}) if isinstance(obj, dict) else {}
                if res.get("canceled"):
                    raise EtcdError(f"watch canceled: {res.get('cancel_reason', '')}")
                for ev in res.get("events") or []:
                    if ev.get("type") == "DELETE":
                        yield int(ev.get("kv", {}).get("mod_revision", 0))
