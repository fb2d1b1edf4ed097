"""The fleet sources a configuration names (discovery.file, .etcd, .dns)."""

from __future__ import annotations

from narwhal_generated.models.config import NarwhalConfig

from .source import Source

__all__ = ["configured"]


def configured(cfg: NarwhalConfig) -> dict[str, Source]:
    out: dict[str, Source] = {}
    d = cfg.discovery
    if d.file is not None:
        from .file import file_source

        out["file"] = file_source(cfg)
    if d.dns is not None:
        from .dns import dns_source

        out["dns"] = dns_source(cfg)
    if d.etcd is not None:
        from .etcd import etcd_source  # type: ignore[import-not-found,unused-ignore]

        out["etcd"] = etcd_source(cfg)
    return out
