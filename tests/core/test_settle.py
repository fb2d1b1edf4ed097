"""core/settle.py: a watched file's change is taken once it has stood still one check."""

from __future__ import annotations

import pytest

from narwhal.core.settle import Settle

# (stamps seen at successive checks, after a start that took "a") -> changed() at each
SCRIPTS = [
    (["a", "a", "a"], [False, False, False]),  # nothing changed
    (["b", "b", "b"], [False, True, False]),  # a change, taken at the second check
    (["b", "c", "c"], [False, False, True]),  # changed again while settling: the newer one settles
    (["b", "a", "a"], [False, False, False]),  # back as it was before it settled: nothing to take
    (["", "", "full", "full"], [False, True, False, True]),  # truncated, then written at a check's pace
    (["", "full", "full"], [False, False, True]),  # truncated and written within one check: the empty file never taken
    (["b", "c", "d", "e"], [False, False, False, False]),  # rewritten at every check: not read until it stops
    (["missing", "missing", "a", "a"], [False, True, False, True]),  # gone, then back: each taken once settled
]


@pytest.mark.parametrize(("stamps", "want"), SCRIPTS)
def test_a_change_is_taken_once_it_stood_still_one_check(stamps: list[str], want: list[bool]) -> None:
    s = Settle("a")
    assert [s.changed(x) for x in stamps] == want
