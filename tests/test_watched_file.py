"""narwhal/config.py WatchedFile: what one periodic check of a watched file costs (the keys
file may be 32 MiB, auth.max_file_bytes). A file over FULL_READ_BYTES whose stat (inode,
device, size, mtime_ns, ctime_ns) is the taken stamp's is not read or hashed, except at
every HASH_EVERY-th check; a smaller file is read and hashed at every check; a change
that keeps size and mtime (touch -r: ctime moves) is read at the next check; a change
that keeps every stat field (two writes within one tick of the file clock) is seen by
the periodic hash; a change that settles is read whole until it is taken."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from narwhal.config import FULL_READ_BYTES, HASH_EVERY, FileRead, WatchedFile, read_watched
from narwhal.core.settle import Settle
from narwhal.tenants.keys import _Watched

BIG = FULL_READ_BYTES + 1


def _checks(w: WatchedFile, taken: object, n: int) -> list[FileRead]:
    async def go() -> list[FileRead]:
        return [await w.read(taken) for _ in range(n)]

    return asyncio.run(go())


def _read(got: FileRead) -> bool:
    return got.raw is not None


@pytest.mark.parametrize(("size", "reads"), [
    (BIG, [False] * (HASH_EVERY - 1) + [True] + [False] * (HASH_EVERY - 1) + [True]),  # by stat, hashed every HASH_EVERY-th
    (FULL_READ_BYTES, [True] * (2 * HASH_EVERY)),  # small: read and hashed at every check
])
def test_an_unchanged_file_is_read_whole_only_when_small_or_at_every_nth_check(tmp_path: Path, size: int, reads: list[bool]) -> None:
    f = tmp_path / "keys.yaml"
    f.write_bytes(b"#" * size)
    taken = read_watched(str(f), 1 << 26).stamp
    got = _checks(WatchedFile(str(f), 1 << 26), taken, len(reads))
    assert [_read(g) for g in got] == reads
    assert all(g.stamp == taken and g.error is None for g in got)


def test_an_edit_keeping_size_and_mtime_is_read_at_the_next_check(tmp_path: Path) -> None:
    """Issue 40 item 3 (touch -r, rsync --inplace -t): ctime moves, so the stat differs."""
    f = tmp_path / "keys.yaml"
    f.write_bytes(b"a" * BIG)
    first = read_watched(str(f), 1 << 26)
    st = f.stat()
    w = WatchedFile(str(f), 1 << 26)
    assert not _read(_checks(w, first.stamp, 1)[0])
    with f.open("r+b") as fh:
        fh.write(b"b")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    got = _checks(w, first.stamp, 1)[0]
    assert _read(got) and got.stamp != first.stamp and got.stamp[5] == hashlib.sha256(b"b" + b"a" * (BIG - 1)).digest()


def test_bytes_changed_under_the_same_stat_are_seen_by_the_periodic_hash(tmp_path: Path) -> None:
    """Two writes of one size within one tick of the file clock keep every stat field:
    taken here as a stamp with the file's stat and other bytes' hash."""
    f = tmp_path / "keys.yaml"
    f.write_bytes(b"a" * BIG)
    stamp = read_watched(str(f), 1 << 26).stamp
    taken = (*stamp[:5], hashlib.sha256(b"what was there before").digest())
    got = _checks(WatchedFile(str(f), 1 << 26), taken, HASH_EVERY)
    assert [g.stamp == taken for g in got] == [True] * (HASH_EVERY - 1) + [False]
    assert got[-1].stamp == stamp


def test_a_change_is_read_whole_while_it_settles(tmp_path: Path) -> None:
    f = tmp_path / "keys.json"
    big = "[" + ",".join(f'{{"id": "k{i}", "tenant": "t", "sha256": "{hashlib.sha256(b"%d" % i).hexdigest()}"}}' for i in range(12_000)) + "]"
    assert len(big) > FULL_READ_BYTES
    f.write_text(big)
    w = _Watched(str(f), "keys_file", 1 << 26)
    w.first()
    assert w.settle.quiet == w.settle.stamp
    f.write_text(big.replace('"k0"', '"j0"'))  # seen, settling: no stat shortcut until taken

    async def go() -> list[FileRead | None]:
        return [await w.changed(), await w.changed(), await w.changed()]

    seen, taken, after = asyncio.run(go())
    assert seen is None and taken is not None and taken.raw is not None and b'"j0"' in taken.raw and after is None
    assert w.settle.quiet == taken.stamp


def test_settle_quiet_is_the_taken_stamp_only_while_nothing_settles() -> None:
    s = Settle("a")
    assert s.quiet == "a"
    assert not s.changed("b") and s.quiet is None
    assert s.changed("b") and s.quiet == "b"
