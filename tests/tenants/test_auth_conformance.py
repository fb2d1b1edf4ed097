"""Capability `auth` of the conformance suite against Narwhal: set up with the unified
profile's configuration plus an `auth` section, the identity cases pass with the key given
as `Authorization: Bearer` and as `x-api-key`; a run that gives no key gets them N/A; and
against Narwhal without auth, a run that gives a key gets them N/A too (never a Fail)."""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from narwhal_conformance.fleet import running_fleet
from narwhal_conformance.profiles import get_profile, router_config
from tests.conformance.support import free_port_base, parse_results, run, serving

KEY = "sk-conformance-auth-test-2b7e9c"
AUTH_CASES = {"refusals/R15/1", "refusals/R15/2", "refusals/R16/1"}


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[int, dict[str, str]]]:
    """One fleet (profile unified) and two routers on it: with auth, and without."""
    profile = get_profile("unified")
    base = free_port_base([profile])
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-auth-conformance-"))
    keys = tmp / "keys.yaml"
    keys.write_text(yaml.safe_dump([{"id": "conformance", "tenant": "vendor", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]))
    keyed = router_config(profile, base, listen=profile.listen(base))
    keyed["auth"] = {"keys_file": str(keys)}
    configs = {"auth": (profile.listen(base), keyed), "open": (profile.listen(base + 7), router_config(profile, base, listen=profile.listen(base + 7)))}
    with running_fleet([profile], base), serving(profile, base, tmp, configs) as targets:
        yield base, targets


@pytest.mark.parametrize("header", [f"Authorization: Bearer {KEY}", f"x-api-key: {KEY}"], ids=["bearer", "x-api-key"])
def test_identity_cases_pass_with_the_key(stack: tuple[int, dict[str, str]], header: str) -> None:
    base, targets = stack
    code, out = run(targets["auth"], "unified", base, "--case", "refusals/R15", "refusals/R16", "--header", header, "--strict")
    results = parse_results(out)
    assert code == 0 and set(results) == AUTH_CASES and set(results.values()) == {"PASS"}, out
    assert "auth" in out.split("capabilities: ", 1)[1].split(";")[0].split(", ")  # detected


def test_identity_cases_na_without_a_key(stack: tuple[int, dict[str, str]]) -> None:
    base, targets = stack
    code, out = run(targets["open"], "unified", base, "--case", "refusals/R15", "refusals/R16", "--header", f"Authorization: Bearer {KEY}")
    assert code == 0 and set(parse_results(out).values()) == {"N/A"}, out
    code, out = run(targets["open"], "unified", base, "--case", "refusals/R15", "refusals/R16")
    assert code == 0 and set(parse_results(out).values()) == {"N/A"}, out
    assert "no key given" in out
