"""Where the shared material lives: `../shared` beside the repository (as on every
developer machine and CI run), or the folder NARWHAL_SHARED names."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["SHARED", "FIXTURES", "TRACES"]

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("NARWHAL_SHARED", ROOT.parent / "shared")).resolve()
FIXTURES = SHARED / "fixtures" / "engine-streams"
TRACES = SHARED / "data" / "traces"
