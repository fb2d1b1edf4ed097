"""spec/tables/lifecycle.yaml through narwhal/core/lifecycle.py: the table is total, each
row moves the machine where it says, and only `active` is placeable."""

from __future__ import annotations

import pytest

from narwhal.core.lifecycle import EVENTS, STATES, Lifecycle, identity
from narwhal.upstream.engines import EngineSpec
from narwhal_generated import lifecycle as M


def test_the_table_is_total_and_names_every_state_and_event() -> None:
    assert set(STATES) == {"joining", "active", "paused", "draining", "gone"}
    assert {(s, e) for s in STATES for e in EVENTS} == set(M.TRANSITIONS)
    assert len(M.ROWS) == len(STATES) * len(EVENTS)


@pytest.mark.parametrize("row", M.ROWS, ids=lambda r: r.id)
def test_each_row_moves_the_machine_to_its_next_state(row: M.Transition) -> None:
    lc = Lifecycle(row.state, 1.0)
    got = lc.on(row.event, 2.0)
    assert got is row
    assert lc.state == row.next
    assert lc.since == (2.0 if row.next != row.state else 1.0)
    assert lc.placeable == (row.next == "active")


def test_gone_is_final() -> None:
    lc = Lifecycle("gone", 0.0)
    for ev in EVENTS:
        assert lc.on(ev, 1.0).next == "gone"


def test_a_leaving_engine_is_not_kept_by_undraining_it() -> None:
    lc = Lifecycle("active", 0.0)
    assert lc.on("remove", 1.0).action == "leave"
    assert lc.on("drain_off", 2.0).next == "draining"
    assert lc.on("drain_timeout", 3.0).action == "cut"
    assert lc.on("idle", 4.0).action == "release"
    assert lc.state == "gone"
    assert [h["row"] for h in lc.history] == ["M12", "M29"]


def test_an_unknown_pair_is_a_bug() -> None:
    with pytest.raises(KeyError):
        Lifecycle("active", 0.0).on("reboot", 1.0)
    with pytest.raises(ValueError):
        Lifecycle("limbo", 0.0)


def test_identity_is_url_role_dialect_model_and_kv_events() -> None:
    a = EngineSpec("e", "http://h:1", "unified", "vllm", "a", None, max_concurrency=2)
    assert identity(a) == identity(EngineSpec("e", "http://h:1", "unified", "vllm", "b", None, max_concurrency=9))
    for other in (EngineSpec("e", "http://h:2", "unified", "vllm", "a", None), EngineSpec("e", "http://h:1", "unified", "sglang", "a", None),
                  EngineSpec("e", "http://h:1", "unified", "vllm", "a", "m2"), EngineSpec("e", "http://h:1", "unified", "vllm", "a", None, kv_events="tcp://h:5")):
        assert identity(a) != identity(other)
