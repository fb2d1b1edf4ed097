"""A router's fleet as a bench changes and reads it: the admin API (Admin), the fleet
file written as editors do (write_atomic), /v1/engines (engines_of, wait_fleet with the
active/gone predicates) and the fleet-change counters of /metrics (fleet_changes).
Every call is bounded (HTTP timeouts; wait_fleet by its timeout_s)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import Engine
from .follow import CLOCK

__all__ = ["Admin", "write_atomic", "engines_of", "wait_fleet", "active", "gone", "fleet_changes"]


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    tmp.rename(path)  # as editors and Kubernetes ConfigMaps do


class Admin:
    def __init__(self, token: str) -> None:
        self.h = {"authorization": f"Bearer {token}"}

    def put(self, url: str, m: Engine) -> dict[str, Any]:
        import httpx

        r = httpx.put(f"{url}/admin/engines/{m.name}", json=m.entry(), headers=self.h, timeout=10.0, trust_env=False)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    def delete(self, url: str, name: str) -> dict[str, Any]:
        import httpx

        r = httpx.delete(f"{url}/admin/engines/{name}", headers=self.h, timeout=10.0, trust_env=False)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    def reload(self, url: str) -> dict[str, Any]:
        import httpx

        r = httpx.post(f"{url}/admin/config/reload", headers=self.h, timeout=10.0, trust_env=False)
        out: dict[str, Any] = r.json()
        out["http_status"] = r.status_code
        return out


def engines_of(url: str) -> dict[str, dict[str, Any]] | None:
    import httpx

    try:
        return {e["name"]: e for e in httpx.get(url + "/v1/engines", timeout=2.0, trust_env=False).json()["data"]}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def wait_fleet(urls: Sequence[str], pred: Callable[[dict[str, dict[str, Any]]], bool], timeout_s: float) -> float | None:
    """The instant pred held on every router's /v1/engines (polled every 50 ms), or None."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        views = [engines_of(u) for u in urls]
        if all(v is not None and pred(v) for v in views):
            return CLOCK()
        time.sleep(0.05)
    return None


def active(name: str) -> Callable[[dict[str, dict[str, Any]]], bool]:
    return lambda es: (es.get(name) or {}).get("lifecycle", {}).get("state") == "active"


def gone(name: str) -> Callable[[dict[str, dict[str, Any]]], bool]:
    return lambda es: name not in es


_CHANGE = re.compile(r'^narwhal_fleet_changes_total\{change="([^"]+)"\} ([0-9.eE+-]+)$')


def fleet_changes(url: str) -> dict[str, int] | None:
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=5.0, trust_env=False).text
    except httpx.HTTPError:
        return None
    out = {}
    for line in text.splitlines():
        m = _CHANGE.match(line)
        if m:
            out[m.group(1)] = int(float(m.group(2)))
    return out
