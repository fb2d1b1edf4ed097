"""Configuration reload, planned (sans-IO): which keys changed, which of them change at
run time, which need a restart (POST /admin/config/reload, SIGHUP).

Rules
  * The whole new file is validated first (narwhal/config.py); an invalid one changes
    nothing (the caller answers with its errors).
  * Changed at run time, all at once: `admission` (limits, budgets, phase concurrency,
    mode; of `admission.prediction` only tpot_budget_ms: the learned models and indexes
    are built for the others), `monitoring`, `upstream` (but max_connections: the pool
    is built with it), `engines` (applied as one diff through the lifecycle table) and
    `discovery` (its sources restart when they changed).
  * Everything else (serving: listen, tls, workers, server, the HTTP bounds; ha; admin;
    the prediction's model settings) needs a restart: named in the answer, left as it was.
  * `plan` returns the merged configuration as a mapping: the new file's run-time keys
    over the running configuration (so --listen and --workers given on the command line
    stay), to be validated again by the caller.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

__all__ = ["Plan", "plan", "runtime_key", "changed_keys"]

_RUNTIME_SECTIONS = ("admission.", "monitoring.", "upstream.", "discovery.")
_RESTART_ONLY = ("upstream.max_connections",)
_RUNTIME_PREDICTION = ("admission.prediction.tpot_budget_ms",)


def runtime_key(path: str) -> bool:
    """Whether the dotted key `path` changes at run time (module rules)."""
    if path == "engines" or path in _RUNTIME_PREDICTION:
        return True
    if path.startswith("admission.prediction.") or path in _RESTART_ONLY:
        return False
    return path.startswith(_RUNTIME_SECTIONS)


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the leaves that differ; `engines` is one leaf (a list of entries)."""
    if prefix == "engines" or not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [prefix or "(top level)"]
    out: list[str] = []
    for k in sorted(set(old) | set(new)):
        out += changed_keys(old.get(k), new.get(k), f"{prefix}.{k}" if prefix else k)
    return out


@dataclass(frozen=True, slots=True)
class Plan:
    merged: dict[str, Any]  # the configuration to run with, as a mapping
    changed: tuple[str, ...]  # keys changed now
    restart: tuple[str, ...]  # keys that differ but need a restart (left as they were)


def _set(d: dict[str, Any], path: str, value: Any) -> None:
    keys = path.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
    d[keys[-1]] = copy.deepcopy(value)


def _get(d: Any, path: str) -> Any:
    for k in path.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def plan(running: dict[str, Any], new: dict[str, Any]) -> Plan:
    """running, new: whole configurations as JSON mappings (model_dump(mode="json"))."""
    merged = copy.deepcopy(running)
    changed: list[str] = []
    restart: list[str] = []
    for path in changed_keys(running, new):
        if runtime_key(path):
            _set(merged, path, _get(new, path))
            changed.append(path)
        else:
            restart.append(path)
    return Plan(merged, tuple(changed), tuple(restart))
