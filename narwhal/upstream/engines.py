"""The fleet as configured: one `EngineSpec` per engine (static identity, shared by the
authority and every data-plane worker), and the engine client built for it."""

from __future__ import annotations

from narwhal_generated.models.config import Engine, NarwhalConfig

from .client import EngineClient, split_userinfo

__all__ = ["EngineSpec", "config_engines", "engine_spec", "engine_client"]


class EngineSpec:
    """An engine to register: config entry plus the resolved URL.

    `url` never carries userinfo: credentials in the configured URL move to
    `authorization` (HTTP Basic), which only the engine client sees."""

    __slots__ = ("name", "url", "role", "dialect", "wave", "model", "authorization", "max_concurrency", "kv_events", "kv_block_size", "_configured")

    def __init__(self, name: str, url: str, role: str, dialect: str, wave: str | None, model: str | None, *, max_concurrency: int | None = None,
                 kv_events: str | None = None, kv_block_size: int = 16) -> None:
        public, self.authorization = split_userinfo(url)
        self._configured = url  # with its credentials: handed to worker processes only
        self.name = name
        self.url = public.rstrip("/")
        self.role = role
        self.dialect = dialect
        self.wave = wave
        self.model = model
        self.max_concurrency = max_concurrency  # engines[].max_concurrency
        self.kv_events = kv_events  # engines[].kv_events: tcp://host:port of its KV-event publisher
        self.kv_block_size = kv_block_size  # engines[].kv_block_size

    def __repr__(self) -> str:
        return f"EngineSpec({self.name!r}, {self.url!r}, {self.role!r}, {self.dialect!r})"

    def as_dict(self) -> dict[str, object]:
        """The spec as configured (credentials back in the URL), for a worker process."""
        return {"name": self.name, "url": self._configured, "role": self.role, "dialect": self.dialect, "wave": self.wave, "model": self.model, "max_concurrency": self.max_concurrency, "kv_events": self.kv_events, "kv_block_size": self.kv_block_size}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> EngineSpec:
        mc = d.get("max_concurrency")
        kv = d.get("kv_events")
        return cls(str(d["name"]), str(d["url"]), str(d["role"]), str(d["dialect"]), d.get("wave") and str(d["wave"]), d.get("model") and str(d["model"]),
                   max_concurrency=int(mc) if isinstance(mc, int) else None, kv_events=str(kv) if kv else None,
                   kv_block_size=int(d.get("kv_block_size") or 16))  # type: ignore[call-overload]


def engine_spec(e: Engine) -> EngineSpec:
    """One validated engines[] entry as the router keeps it."""
    return EngineSpec(e.name, e.url, e.role, e.dialect, e.wave, e.model, max_concurrency=e.max_concurrency,
                      kv_events=e.kv_events.root if e.kv_events is not None else None, kv_block_size=e.kv_block_size)


def config_engines(config: NarwhalConfig) -> list[EngineSpec]:
    return [engine_spec(e) for e in config.engines or ()]


def engine_client(config: NarwhalConfig, engines: list[EngineSpec]) -> EngineClient:
    """The pooled engine client of one process, with every engine's credentials."""
    u = config.upstream
    client = EngineClient(
        connect_timeout_s=u.connect_timeout_ms / 1000.0,
        idle_timeout_s=u.idle_timeout_ms / 1000.0,
        max_connections=u.max_connections,
        max_body_bytes=u.max_event_bytes,
    )
    for s in engines:
        if s.authorization is not None:
            client.authorize(s.url, s.authorization)
    return client
