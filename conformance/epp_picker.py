"""A minimal endpoint picker: round robin over a fixed pool, no admission of its own
(the `epp` profile's fixture: proof that the profile does not assume the picker is
Narwhal).

    python -m narwhal_conformance.epp_picker --listen 127.0.0.1:18290 --pool 127.0.0.1:18271 --pool 127.0.0.1:18272 [--fallbacks N]

It speaks the endpoint-picker protocol and nothing more: on the request headers it names
the next endpoint (`x-gateway-destination-endpoint` and the same value in dynamic
metadata `envoy.lb`), followed, with `--fallbacks N`, by the N endpoints after it in the
pool's order (a fallback list: `ip:port,ip:port,...`); every body chunk, both ways (FULL_DUPLEX_STREAMED), is answered
unchanged; trailers are passed. gRPC health reports the ext_proc service SERVING.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from narwhal.gateway.protos import METHOD
from narwhal.gateway.protos import core as base_pb2
from narwhal.gateway.protos import ext_proc as pb
from narwhal.gateway.protos import struct as struct_pb2

__all__ = ["RoundRobin", "serve", "main"]

DESTINATION = "x-gateway-destination-endpoint"
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def _echo(kind: str, body: Any) -> Any:
    streamed = pb.StreamedBodyResponse(body=body.body, end_of_stream=body.end_of_stream)
    return pb.ProcessingResponse(**{kind: pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed)))})


class RoundRobin:
    def __init__(self, pool: list[str], fallbacks: int = 0) -> None:
        self._pool = pool
        self._next = itertools.cycle(range(len(pool)))
        self._fallbacks = min(fallbacks, len(pool) - 1)

    def _named(self) -> Any:
        i = next(self._next)
        endpoint = ",".join(self._pool[(i + k) % len(self._pool)] for k in range(self._fallbacks + 1))
        opt = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=DESTINATION, raw_value=endpoint.encode()),
                                         append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
        meta = struct_pb2.Struct()
        meta.update({"envoy.lb": {DESTINATION: endpoint}})
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[opt]))
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta)

    def handler(self) -> Any:
        method = grpc.stream_stream_rpc_method_handler(self.process, request_deserializer=pb.ProcessingRequest.FromString,
                                                       response_serializer=pb.ProcessingResponse.SerializeToString)
        return grpc.method_handlers_generic_handler(SERVICE, {METHOD.rsplit("/", 1)[1]: method})

    async def process(self, request_iterator: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for req in request_iterator:
            kind = req.WhichOneof("request")
            if kind == "request_headers":
                yield self._named()
            elif kind == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif kind in ("request_body", "response_body"):
                yield _echo(kind, getattr(req, kind))
            elif kind in ("request_trailers", "response_trailers"):
                yield pb.ProcessingResponse(**{kind: pb.TrailersResponse()})


async def serve(listen: str, pool: list[str], stop: asyncio.Event, fallbacks: int = 0) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((RoundRobin(pool, fallbacks).handler(),))
    h = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    if not server.add_insecure_port(listen):
        raise OSError(f"cannot listen on {listen}")
    await h.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    await h.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    try:
        await stop.wait()
    finally:
        await server.stop(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="epp_picker", description="A round-robin endpoint picker (the epp profile's fixture).")
    p.add_argument("--listen", required=True)
    p.add_argument("--pool", action="append", required=True, metavar="IP:PORT")
    p.add_argument("--fallbacks", type=int, default=0, metavar="N", help="name the N endpoints after the chosen one as its fallback list (default 0)")
    args = p.parse_args(argv)
    if args.fallbacks < 0:
        p.error("--fallbacks takes 0 or more")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(args.listen, args.pool, stop, args.fallbacks)

    asyncio.run(run())
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
