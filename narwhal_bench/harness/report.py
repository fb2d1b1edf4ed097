"""What a bench prints and saves: a Report (Markdown to stdout as it goes, Markdown and the
raw numbers as JSON at the end), and the facts a report states about its run.

Rules
  * `Report.add` prints at once (a long bench shows its progress); `save(out)` writes
    `<slug>.md` and `<slug>.json` into `out` (nothing when out is None), the slug being the
    title up to its first colon, lower case, spaces as underscores.
  * `commit()`: NARWHAL_BENCH_COMMIT when set (a run from an exported tree: `git archive`,
    so that others' edits to the working tree cannot change the code mid-run), else
    `git rev-parse --short HEAD` plus "+dirty narwhal/" when narwhal/ has uncommitted
    changes; "?" when git cannot answer (bounded: 10 s a call).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Report", "commit", "pinning_note", "run_meta", "save"]

_REPO = Path(__file__).resolve().parents[2]


@dataclass
class Report:
    """What an experiment prints (Markdown) and saves (JSON)."""

    title: str
    markdown: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def add(self, text: str) -> None:
        self.markdown.append(text)
        print(text, flush=True)

    def save(self, out: Path | None) -> None:
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        slug = self.title.split(":")[0].strip().lower().replace(" ", "_")
        (out / f"{slug}.json").write_text(json.dumps(self.data, indent=1, default=str))
        (out / f"{slug}.md").write_text(f"## {self.title}\n\n" + "\n\n".join(self.markdown) + "\n")


def commit() -> str:
    if os.environ.get("NARWHAL_BENCH_COMMIT"):
        return os.environ["NARWHAL_BENCH_COMMIT"]
    try:
        h = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "narwhal"], cwd=_REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        return h + ("+dirty narwhal/" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def pinning_note(rcpu: set[int] | None, lcpu: set[int] | None) -> str:
    if rcpu is None:
        return "Not pinned (one CPU, or NARWHAL_BENCH_NOPIN=1)."
    return f"Router under test pinned to CPU {sorted(rcpu)}; load tool and engines pinned to CPU {sorted(lcpu or ())}."


def run_meta(module: str, rcpu: set[int] | None, lcpu: set[int] | None, others: str) -> dict[str, Any]:
    """When (UTC, to the minute), at which commit, by which command, on how many CPUs and
    how pinned (routers on rcpu; `others`, e.g. "etcd, engines and client", on lcpu)."""
    from .processes import command_line

    return {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(), "command": command_line(module), "cpus": os.cpu_count(),
            "pinning": "not pinned" if rcpu is None else f"routers on CPU {sorted(rcpu)}; {others} on CPU {sorted(lcpu or ())}"}


def save(out: str | Path | None, name: str, md: str, data: Any) -> None:
    """NAME.md (md as given) and NAME.json (indented, str() of what JSON has no type for)
    into the folder out, made when missing; nothing when out is '' or None."""
    if not out:
        return
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.md").write_text(md)
    (folder / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
