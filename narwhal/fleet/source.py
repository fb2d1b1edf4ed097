"""The vocabulary of fleet sources: what a source emits, and the provider interface.

A source is an async callable `run(emit)` that runs until cancelled: it reads its place,
calls `emit(Snapshot(...))` with the whole set of engines it names (validated engines[]
entries, as `EngineSpec`), and again after every change; when its place cannot be read
or does not validate it calls `emit(SourceError(...))` and the fleet stays as it was.
Every wait and read of a source is bounded (its own settings say how).

Kubernetes (on paper; no cluster runs here): an EndpointSlice provider would be one more
`run(emit)`: list the slices of a Service by label selector
(`GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=
kubernetes.io/service-name=NAME`), then watch from the list's resourceVersion; every
ready endpoint address becomes an entry `{name: <pod name>, url: http://ADDR:PORT, role,
dialect}` with role and dialect from the Service's annotations; a 410 Gone on the watch
means list again. Pod names are per instance, so a rolling update is an add then a
remove (lifecycle rows M12, M29), never a replace.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..upstream.engines import EngineSpec

__all__ = ["Snapshot", "SourceError", "Emit", "Source"]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The whole set of engines `source` names now."""

    source: str  # "file" | "etcd" | ...: the owner of the engines it names
    engines: tuple[EngineSpec, ...]
    where: str = ""  # the file, or the etcd prefix and revision: for the log


@dataclass(frozen=True, slots=True)
class SourceError:
    """The source's place could not be read or did not validate: nothing changes."""

    source: str
    message: str  # names the file, line and key (or the etcd key) and what is wrong


Emit = Callable[[Snapshot | SourceError], None]
Source = Callable[[Emit], Awaitable[None]]
