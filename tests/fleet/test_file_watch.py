"""discovery.file's watch (narwhal/fleet/file.py FleetFile), driven check by check with a
real file: a file rewritten in place is not read half-way (an empty list is valid and
drains every engine it names), and what is emitted is what changed."""

from __future__ import annotations

import os
from pathlib import Path

from narwhal.config import read_watched
from narwhal.fleet.file import FleetFile, parse_fleet_file
from narwhal.fleet.source import Snapshot, SourceError

TWO = "- {name: f0, url: 'http://127.0.0.1:9'}\n- {name: f1, url: 'http://127.0.0.1:10'}\n"
ONE = "- {name: f0, url: 'http://127.0.0.1:9'}\n"


def _check(w: FleetFile) -> Snapshot | SourceError | None | bool:
    """One check: False when the file was not read, else what it emits."""
    read = read_watched(w.path, 1 << 20)
    if not w.due(read):
        return False
    return w.take(parse_fleet_file(w.path, read))


def _touch(p: Path, text: str, ns: int) -> None:
    p.write_text(text)
    os.utime(p, ns=(ns, ns))  # a distinct modification time, however fast the test runs


def _names(got: object) -> list[str]:
    assert isinstance(got, Snapshot), got
    return [e.name for e in got.engines]


def test_a_file_rewritten_in_place_is_not_read_half_way(tmp_path: Path) -> None:
    f = tmp_path / "fleet.yaml"
    _touch(f, TWO, 1_000_000_000)
    w = FleetFile(str(f))
    assert _names(_check(w)) == ["f0", "f1"]  # read at start at once
    assert _check(w) is False
    # truncated (a check sees the empty file), then written: the empty list is never taken
    _touch(f, "", 2_000_000_000)
    assert _check(w) is False
    _touch(f, ONE, 3_000_000_000)
    assert _check(w) is False  # a newer stamp: it settles from here
    assert _names(_check(w)) == ["f0"]
    assert _check(w) is False


def test_what_is_emitted_is_what_changed(tmp_path: Path) -> None:
    f = tmp_path / "fleet.yaml"
    _touch(f, ONE, 1_000_000_000)
    w = FleetFile(str(f))
    assert _names(_check(w)) == ["f0"]
    # the same engines written again: read, nothing emitted
    _touch(f, "engines:\n" + "".join("  " + ln + "\n" for ln in ONE.splitlines()), 2_000_000_000)
    assert _check(w) is False
    assert _check(w) is None
    # not valid: the error once, not again for the same error
    _touch(f, "- {name: [unclosed\n", 3_000_000_000)
    assert _check(w) is False
    err = _check(w)
    assert isinstance(err, SourceError) and "line" in err.message
    _touch(f, "- {name: [unclosed\n", 4_000_000_000)  # written again: the same error
    assert _check(w) is False
    assert _check(w) is None
    # valid again, with the same engines as before the error: emitted (the fleet learns the file is good)
    _touch(f, ONE, 5_000_000_000)
    assert _check(w) is False
    assert _names(_check(w)) == ["f0"]
    # gone: an error; the engines stay (the authority keeps the fleet on an error)
    f.unlink()
    assert _check(w) is False
    assert isinstance(_check(w), SourceError)
    # an empty list, written whole and left: taken (every engine it named leaves)
    _touch(f, "[]\n", 6_000_000_000)
    assert _check(w) is False
    assert _names(_check(w)) == []


def test_an_edit_keeping_size_and_mtime_is_seen(tmp_path: Path) -> None:
    """Issue 40 item 3: `touch -r` or `rsync --inplace -t` keep size and mtime; the stamp
    has ctime and the bytes' hash too."""
    f = tmp_path / "fleet.yaml"
    _touch(f, ONE, 1_000_000_000)
    w = FleetFile(str(f))
    assert _names(_check(w)) == ["f0"]
    same = ONE.replace("f0", "g0")
    assert len(same) == len(ONE)
    _touch(f, same, 1_000_000_000)  # the same size and modification time
    assert _check(w) is False
    assert _names(_check(w)) == ["g0"]
