"""The gRPC shell of the endpoint picker: Envoy's `envoy.service.ext_proc.v3.ExternalProcessor`
(the `Process` bidirectional stream; its messages from narwhal/gateway/protos.py) and
`grpc.health.v1` on `gateway.listen`, over grpcio's asyncio server.

It only translates: an Envoy message becomes a `Heard`, a `Said` becomes Envoy's message;
every decision is narwhal/gateway/exchange.py's over decide.py.

Health: the service `envoy.service.ext_proc.v3.ExternalProcessor` is SERVING while the
router is ready (GET /ready's 200: active, not draining, not fenced, not a standby of an
`ha` pair) and NOT_SERVING otherwise, re-read every gateway.health_interval_ms; the
overall service ("") is SERVING while the process runs (liveness).

Bounds: gateway.max_streams RPCs at once (more are refused RESOURCE_EXHAUSTED, which
Envoy treats as the picker failing: failure_mode_allow decides), gateway.max_message_bytes
per message either way, gateway.stream_idle_ms without a message from Envoy ends a stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..worker.plane import DataPlane
from .decide import (
    SERVED,
    SERVICE,
    SUBSET,
    SUBSET_NAMESPACE,
    Head,
    Immediate,
    Mutation,
    Piece,
    Route,
    subset_of,
)
from .exchange import Exchange, Heard, Said
from .protos import METHOD
from .protos import core as base_pb2
from .protos import ext_proc as pb
from .protos import http_status as http_status_pb2
from .protos import struct as struct_pb2

__all__ = ["GatewayServer", "SERVICE", "to_heard", "to_response"]

log = logging.getLogger("narwhal")



def _head(h: Any) -> Head:
    return Head(tuple((x.key.lower(), x.raw_value or x.value.encode()) for x in h.headers.headers), h.end_of_stream)


def _served(req: Any) -> str | None:
    ns = req.metadata_context.filter_metadata.get("envoy.lb") if req.HasField("metadata_context") else None
    if ns is None or SERVED not in ns.fields:
        return None
    v = ns.fields[SERVED]
    return v.string_value or None


def _subset(req: Any) -> frozenset[str] | None:
    """`envoy.lb.subset_hint` / x-gateway-destination-endpoint-subset, when Envoy sent it."""
    ns = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE) if req.HasField("metadata_context") else None
    if ns is None or SUBSET not in ns.fields:
        return None
    v = ns.fields[SUBSET]
    kind = v.WhichOneof("kind")
    if kind == "list_value":
        return subset_of([x.string_value for x in v.list_value.values])
    return subset_of(v.string_value if kind == "string_value" else "")


def to_heard(req: Any) -> Heard:
    """An Envoy ProcessingRequest as a `Heard`. The served endpoint is read where the
    response begins (its headers, or trailers without them): it is known from then on, and
    a body chunk, the hot path, is not searched for it."""
    kind = req.WhichOneof("request")
    if kind in ("request_body", "response_body"):
        b = getattr(req, kind)
        return Heard(kind, body=b.body, end=b.end_of_stream)
    if kind == "request_headers":
        return Heard(kind, head=_head(req.request_headers), subset=_subset(req))
    if kind == "response_headers":
        return Heard(kind, head=_head(req.response_headers), served=_served(req))
    return Heard(kind or "unknown", served=_served(req))


def _mutation(set_headers: tuple[tuple[str, bytes], ...] | tuple[tuple[bytes, bytes], ...], remove: tuple[str, ...] = ()) -> Any:
    out = []
    for k, v in set_headers:
        key = k.decode("latin-1") if isinstance(k, bytes) else k
        out.append(base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=v), append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD))
    return pb.HeaderMutation(set_headers=out, remove_headers=list(remove))


def to_response(s: Said) -> Any:
    """A `Said` as an Envoy ProcessingResponse."""
    a = s.answer
    if isinstance(a, Immediate):
        return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=a.status), headers=_mutation(a.headers), body=a.body, details=f"narwhal_{a.row}"))
    meta = None
    if s.metadata:
        meta = struct_pb2.Struct()
        meta.update(s.metadata)
    if isinstance(a, Route):
        common = pb.CommonResponse(header_mutation=_mutation(a.set_headers, a.remove_headers))
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta)
    if isinstance(a, Mutation):
        common = pb.CommonResponse(header_mutation=_mutation(a.set_headers, a.remove_headers))
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta)
    if isinstance(a, Piece):
        body = pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=a.body, end_of_stream=a.end))))
        return pb.ProcessingResponse(**{s.kind: body})
    return pb.ProcessingResponse(**{s.kind: pb.TrailersResponse()})


class _Picker:
    def __init__(self, plane: DataPlane, idle_s: float) -> None:
        self.plane = plane
        self.idle_s = idle_s

    def handler(self) -> Any:
        """ExternalProcessor.Process as grpcio's generic handler (no generated stub)."""
        method = grpc.stream_stream_rpc_method_handler(self.process, request_deserializer=pb.ProcessingRequest.FromString,
                                                       response_serializer=pb.ProcessingResponse.SerializeToString)
        return grpc.method_handlers_generic_handler(SERVICE, {METHOD.rsplit("/", 1)[1]: method})

    async def process(self, request_iterator: AsyncIterator[Any], context: Any) -> None:
        async def heard() -> AsyncIterator[Heard]:
            async for req in request_iterator:
                yield to_heard(req)

        async def say(s: Said) -> None:
            await context.write(to_response(s))

        await Exchange(self.plane, heard(), say, idle_s=self.idle_s).run()


class GatewayServer:
    """ext_proc and health on gateway.listen; `start`, then `stop` once."""

    def __init__(self, plane: DataPlane, ready: Callable[[], Awaitable[tuple[int, Any]]], gateway: Any) -> None:
        self.plane = plane
        self.ready = ready
        self.cfg = gateway
        self.port: int | None = None
        self.health = health.aio.HealthServicer()
        n = gateway.max_message_bytes
        self.server = grpc.aio.server(
            maximum_concurrent_rpcs=gateway.max_streams,
            options=[("grpc.max_receive_message_length", n), ("grpc.max_send_message_length", n),
                     ("grpc.max_concurrent_streams", gateway.max_streams), ("grpc.so_reuseport", 0)],
        )
        self.server.add_generic_rpc_handlers((_Picker(plane, gateway.stream_idle_ms / 1000.0).handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.port = self.server.add_insecure_port(self.cfg.listen)
        if not self.port:
            raise OSError(f"gateway.listen {self.cfg.listen}: cannot listen")
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._follow_once()
        await self.server.start()
        self._task = asyncio.create_task(self._follow())
        log.info("narwhal gateway picker (ext_proc) on %s", self.cfg.listen)

    async def _follow_once(self) -> None:
        try:
            status, _ = await self.ready()
        except Exception:  # noqa: BLE001 - unknown readiness is not readiness
            status = 503
        s = health_pb2.HealthCheckResponse.SERVING if status == 200 else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(SERVICE, s)

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_ms / 1000.0)
            await self._follow_once()

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
