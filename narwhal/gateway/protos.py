"""Envoy's ext_proc messages without the `xds-protos` package at run time.

`xds-protos` installs, besides Envoy's stubs, its own copy of the `opentelemetry/proto`
modules over `opentelemetry-proto`'s (an older schema): installed beside Narwhal's
tracing it breaks the OTLP exporter. So the picker carries what it needs instead: the
descriptors of `envoy/service/ext_proc/v3/external_processor.proto` and the 23 files it
imports (a FileDescriptorSet, `ext_proc.binpb`, 42 KB), built into message classes in a
pool of their own (no clash with any other copy of those files in the default pool).

`ext_proc.binpb` is written from xds-protos 1.85.0 by
`python -m narwhal.gateway.protos --write` (in an environment that has xds-protos);
`tests/gateway/test_protos.py` checks it against that package when it is installed.
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = ["BINPB", "SERVICE", "METHOD", "messages", "Package", "ext_proc", "core", "http_status", "struct", "descriptor_set", "write"]

BINPB = Path(__file__).with_name("ext_proc.binpb")
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
METHOD = f"/{SERVICE}/Process"
ROOT = "envoy/service/ext_proc/v3/external_processor.proto"


@cache
def messages() -> dict[str, Any]:
    """Full message name -> class, for every message of the carried files."""
    fds = descriptor_pb2.FileDescriptorSet.FromString(BINPB.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for f in fds.file:  # dependencies first (as written)
        pool.Add(f)
    return dict(message_factory.GetMessages(list(fds.file), pool=pool))


class Package:
    """The message classes of one proto package as attributes (`ext_proc.ProcessingRequest`)."""

    __slots__ = ("_prefix",)

    def __init__(self, package: str) -> None:
        self._prefix = package + "."

    def __getattr__(self, name: str) -> Any:
        try:
            return messages()[self._prefix + name]
        except KeyError:
            raise AttributeError(name) from None


ext_proc = Package("envoy.service.ext_proc.v3")
core = Package("envoy.config.core.v3")
http_status = Package("envoy.type.v3")
struct = Package("google.protobuf")


def descriptor_set() -> bytes:
    """The FileDescriptorSet of ROOT and its imports, dependencies first, from xds-protos."""
    from envoy.service.ext_proc.v3 import external_processor_pb2

    seen: dict[str, descriptor_pb2.FileDescriptorProto] = {}

    def add(fd: Any) -> None:
        if fd.name in seen:
            return
        for dep in fd.dependencies:
            add(dep)
        p = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(p)
        seen[fd.name] = p

    add(external_processor_pb2.DESCRIPTOR)
    return descriptor_pb2.FileDescriptorSet(file=list(seen.values())).SerializeToString(deterministic=True)


def write() -> int:
    BINPB.write_bytes(descriptor_set())
    print(f"wrote {BINPB} ({BINPB.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(write() if sys.argv[1:] == ["--write"] else 2)
