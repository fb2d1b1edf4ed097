"""The microbenchmarks (benchmarks/, `tox -e bench`) are not in the default run; run each
once here with timing off, so that one which no longer fits the code fails the suite
instead of waiting for the next person who times it (test_direct_path_per_event did: the
engine connection and H1Direct had changed under it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_microbenchmark_runs_once() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks", "-q", "-p", "no:cacheprovider", "--benchmark-disable"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and "failed" not in p.stdout and "error" not in p.stdout.lower(), p.stdout[-2000:]
