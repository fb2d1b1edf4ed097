"""Stream migration of a request's decode leg (G01-G10, spec/tables/migration.yaml): after
response headers, a failed leg is carried on by another eligible engine when no obstacle
holds (core/migration.obstacle), else the client gets the error event. A mixin of the
request's run (worker/legs.py `Run`): it reads the run's state, named below, and keeps none
of its own."""

from __future__ import annotations

import logging
from typing import Any

import orjson

from narwhal_generated.migration import MigrationRow

from ..core.dialects import DIALECTS
from ..core.lease import Grant, Lease, Order
from ..core.migration import FINISH, MIGRATE, Recorder, obstacle, placed
from ..core.relay import StreamRelay
from ..core.requests import ParsedRequest
from ..telemetry.logs import RequestRecord
from . import migrate
from .failures import Ended, Failed
from .migrate import Cont
from .plane import DataPlane
from .replies import DONE as _DONE
from .replies import Sink

__all__ = ["Migrating"]

log = logging.getLogger("narwhal")


class Migrating:
    """The migration steps of a request's run; the run holds the state they read."""

    __slots__ = ()
    # the run's state these steps read (worker/legs.py Run sets every one)
    r: DataPlane
    req: ParsedRequest
    order: Order
    lease: Lease
    sink: Sink
    rid: str
    rec: RequestRecord | None
    body: dict[str, Any]
    relay: StreamRelay | None
    cached_tokens: int | None
    migrations: int
    max_migrations: int

    async def _migrate(self, f: Failed, phase: str) -> tuple[Grant, Cont] | None:
        """A decode leg failed after response headers (f.row in spec/tables/migration.yaml's
        failures): the continuation's grant and body, or None: the error event (G01-G10).
        Counted on /metrics by cause (the failure row) and decision (the row's reason)."""
        r, req = self.r, self.req
        assert f.engine is not None
        rec = self.relay.recorder if self.relay is not None else None
        now = r.clock.now()
        why = self._obstacle(rec, now)  # a G row that holds before placement, or None: place it
        if why is not None and why.outcome == FINISH:  # G13: nothing left to generate
            assert rec is not None
            r.telemetry.migrations.labels(f.row.id, why.reason).inc()
            prompt = rec.valid_prompt()
            await self.sink.write(migrate.finish(req, rec, r.config.serving.model, prompt_tokens=len(prompt) if prompt is not None else self.lease.prompt_tokens,
                                                 finish_sent=self.relay is not None and self.relay.finish_reason is not None))
            await self.sink.end_stream()
            log.info("request %s: %s on %s after all %d tokens: finished (%s)", self.rid, f.row.id, f.engine.name, len(rec.output_ids), why.reason)
            raise Ended("completed", f)
        cont = nxt = None
        if why is None:
            assert rec is not None
            f.reported = True  # Lease.retry tells the engine's breaker
            nxt = await self.lease.retry(f.engine.name, f.row, phase, now)  # placed like a retry: another eligible engine
            if isinstance(nxt, Grant) and DIALECTS[r.engines[nxt.engine].dialect].token_accounting == "token_ids":
                e2 = r.engines[nxt.engine]
                model = e2.model or r.config.serving.model
                mig = r.config.upstream.migration
                prompt = await migrate.prompt_ids(r.client, e2, req, rec, model, mig.tokenize_timeout_ms / 1000.0)
                if prompt is not None:
                    cont = migrate.prepare(req, self.body, e2, model, rec, prompt, prompt_tokens=len(prompt),
                                           cached_tokens=self.cached_tokens, max_event_bytes=r.config.upstream.max_event_bytes)
            why = self._placed(rec, now, ok=cont is not None)  # the rest of the table's walk (G10, G11)
        r.telemetry.migrations.labels(f.row.id, why.reason).inc()
        if why.outcome != MIGRATE or cont is None or not isinstance(nxt, Grant):
            log.info("request %s: %s on %s after response headers: not migrated (%s)", self.rid, f.row.id, f.engine.name, why.reason)
            if f.event is not None:  # the engine's error event held back: the client gets it now
                await self.sink.write(b"data: " + orjson.dumps(f.event) + b"\n\n" + _DONE)
                await self.sink.end_stream()
                raise Ended("failed", f)
            return None
        self.migrations += 1  # type: ignore[misc]  # a slot of Run (the mixin has none of its own)
        if self.rec is not None:
            self.rec.migrations += 1
        log.info("request %s: %s on %s after %d tokens: carried on by %s (migration %d)", self.rid, f.row.id, f.engine.name, len(rec.output_ids), nxt.engine, self.migrations)
        return nxt, cont

    def _movable(self) -> bool:
        """Could this request's decode leg be carried on now (G01-G09 hold none)? Asked
        by a drain with discovery.drain: migrate before it cuts the leg."""
        rec = self.relay.recorder if self.relay is not None else None
        if not self.sink.headers_sent or rec is None:
            return False
        return self._obstacle(rec, self.r.clock.now()) is None

    def _obstacle(self, rec: Recorder | None, now: float, ok: bool | None = None) -> MigrationRow | None:
        """The migration table's walk for this request now (core/migration.py): the first
        G row that holds before the continuation is placed, or None; with `ok` (placed
        and takeable), the row the whole walk ends in."""
        left = None if self.order.deadline_s is None else (self.order.deadline_s - (now - self.order.arrival)) * 1000.0
        p = migrate.progress(rec, attempts=self.migrations, deadline_left_ms=left, max_tokens=self.req.max_tokens)
        token_ids = rec is not None and not rec.overflow
        ttft = self.lease.projected_ttft_ms or 0.0
        if ok is None:
            return obstacle(self.req.route, self.body, p, max_attempts=self.max_migrations, token_ids=token_ids, projected_ttft_ms=ttft)
        return placed(self.req.route, self.body, p, ok=ok, max_attempts=self.max_migrations, token_ids=token_ids, projected_ttft_ms=ttft)

    def _placed(self, rec: Recorder | None, now: float, *, ok: bool) -> MigrationRow:
        row = self._obstacle(rec, now, ok)
        assert row is not None
        return row

    def _marked(self, out: bytes) -> bytes:
        """The stream's last bytes with the migrations it took (an SSE comment before
        `data: [DONE]`: clients ignore comments)."""
        if out.endswith(_DONE):
            return out[: -len(_DONE)] + migrate.MIGRATIONS_COMMENT % self.migrations + _DONE
        return out
