"""What one periodic check of a watched file costs (auth.keys_file, auth.jwt.jwks_file,
discovery.file): a file of each size is written to a temporary folder and checked as the
keys watcher checks it (narwhal/tenants/keys.py `_Watched.changed`, unchanged file, no
change to take), CHECKS times in a row; printed per size: wall and process CPU per check
(median, mean, max). docs/operations.md "Watched files" quotes its output.

    python scripts/watched_cost.py [--sizes 10000,1000000,33554432] [--checks 60]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from narwhal.tenants.keys import _Watched


async def _run(w: _Watched, checks: int) -> tuple[list[float], list[float]]:
    walls, cpus = [], []
    for _ in range(checks):
        t, c = time.perf_counter(), time.process_time()
        got = await w.changed()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
        assert got is None, "the file did not change: nothing to take"
    return walls, cpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,1000000,33554432", help="file sizes in bytes, comma-separated")
    ap.add_argument("--checks", type=int, default=60)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for size in (int(s) for s in a.sizes.split(",")):
            path = os.path.join(tmp, f"keys-{size}.yaml")
            with open(path, "wb") as f:
                f.write((b"# " + os.urandom(48).hex().encode() + b"\n") * (size // 99) + b"#" * (size % 99))
            w = _Watched(path, "keys_file", 1 << 28)
            w.first()
            walls, cpus = asyncio.run(_run(w, a.checks))
            ms = [x * 1e3 for x in walls]
            cs = [x * 1e3 for x in cpus]
            print(f"{size:>10} bytes, {a.checks} checks: wall median {statistics.median(ms):.3f} ms, mean {statistics.mean(ms):.3f}, max {max(ms):.1f}; "
                  f"CPU median {statistics.median(cs):.3f} ms, mean {statistics.mean(cs):.3f}")


if __name__ == "__main__":
    main()
