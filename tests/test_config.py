"""narwhal/config.py beyond the schema: defaults that follow other keys, and the checks
that name the key."""

from __future__ import annotations

import pytest

from narwhal.config import ConfigError, parse_config


@pytest.mark.parametrize(("ttl", "renew", "margin"), [(2000, 666, 500), (3000, 1000, 500), (60000, 1000, 500)])
def test_ha_renewal_and_fence_margin_follow_the_ttl_when_not_given(ttl: int, renew: int, margin: int) -> None:
    """Issue 21: `ha.lease_ttl_ms: 2000` alone (the schema's minimum) used to be refused
    with the default renew interval; an operator who sets only the TTL can start."""
    ha = parse_config({"ha": {"etcd": ["http://127.0.0.1:2379"], "lease_ttl_ms": ttl}}).ha
    assert ha is not None and (ha.renew_interval_ms, ha.fence_margin_ms) == (renew, margin)
    assert 3 * ha.renew_interval_ms <= ttl and ha.renew_interval_ms + ha.fence_margin_ms < ttl


def test_given_ha_timings_are_kept_and_still_checked() -> None:
    ha = parse_config({"ha": {"etcd": ["http://127.0.0.1:2379"], "lease_ttl_ms": 6000, "renew_interval_ms": 1500, "fence_margin_ms": 800}}).ha
    assert ha is not None and (ha.renew_interval_ms, ha.fence_margin_ms) == (1500, 800)
    with pytest.raises(ConfigError, match=r"ha.renew_interval_ms: at most a third"):
        parse_config({"ha": {"etcd": ["http://127.0.0.1:2379"], "lease_ttl_ms": 2000, "renew_interval_ms": 1000}})


def test_an_empty_fleet_is_an_error_unless_a_discovery_source_fills_it() -> None:
    with pytest.raises(ConfigError, match="empty fleet"):
        parse_config({"engines": []})
    assert parse_config({"engines": [], "discovery": {"file": "/tmp/fleet.yaml"}}).engines == []
    # a fleet that changes at run time may be P/D-incomplete for a while: R09, not a start-up error
    assert parse_config({"engines": [{"name": "p", "url": "http://127.0.0.1:1", "role": "prefill"}], "discovery": {"dns": {"name": "localhost", "port": 1}}})


def test_migration_is_off_by_default_and_drain_migrate_needs_it() -> None:
    cfg = parse_config({})
    assert cfg.upstream.migration.max_attempts == 0 and cfg.discovery.drain == "wait"
    with pytest.raises(ConfigError, match="discovery.drain: migrate needs upstream.migration.max_attempts"):
        parse_config({"discovery": {"drain": "migrate"}})
    on = parse_config({"discovery": {"drain": "migrate"}, "upstream": {"migration": {"max_attempts": 2}}})
    assert on.upstream.migration.max_attempts == 2 and on.discovery.drain == "migrate"
    with pytest.raises(ConfigError, match="max_attempts"):
        parse_config({"upstream": {"migration": {"max_attempts": 9}}})  # bounded
