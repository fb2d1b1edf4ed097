"""The suite passes against Narwhal itself: every case of every profile, over HTTP/1.1 and
HTTP/2 (h2c), against `narwhal serve` set up with `narwhal conformance print-config`,
with zero Fail and zero N/A (Narwhal has every capability its profiles' cases need)
but for the cases that need ha-etcd, which need an etcd the runner starts before the
router (test_ha.py runs them), those that need auth or tenants (print-config without
--capability tenants has neither keys nor tenants, and no key is given here:
tests/tenants/test_auth_conformance.py and test_tenants_conformance.py run them), and
those that need migration (print-config without --capability migration leaves it off:
tests/migration/test_migration_conformance.py runs them); the JUnit report lists every
case with its class, and every books check."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from narwhal_conformance import SUITE_VERSION
from narwhal_conformance.cases import load_cases, select_cases

from .support import Stack, engines_summary, failing_blocks, parse_results, run

EXPECTATIONS = Path(str(resources.files("narwhal_conformance").joinpath("expectations", "narwhal.yaml")))  # empty: no known failure


@pytest.mark.parametrize("protocol", ["http1", "http2"])
@pytest.mark.parametrize("profile", ["reference", "unified", "sglang", "openai"])
def test_the_suite_passes_against_narwhal(stack: Stack, tmp_path: Path, profile: str, protocol: str) -> None:
    out_dir = Path(os.environ.get("NARWHAL_CONFORMANCE_JUNIT_DIR", str(tmp_path)))  # CI keeps the reports
    out_dir.mkdir(parents=True, exist_ok=True)
    junit = out_dir / f"conformance-{profile}-{protocol}.xml"
    extra = ["--junit", str(junit), "--strict", "--expectations", str(EXPECTATIONS)] + (["--http2"] if protocol == "http2" else [])
    code, out = run(stack.targets[profile], profile, stack.port_base, *extra)
    results = parse_results(out)
    ha = {c.id for c in select_cases(load_cases(), None, profile=profile) if "ha-etcd" in c.needs}  # no etcd here: N/A
    # no key given here (the reference config has no auth): N/A; tests/tenants/test_auth_conformance.py runs them
    # and migration off (print-config's default): N/A; tests/migration/test_migration_conformance.py runs them
    auth = {c.id for c in select_cases(load_cases(), None, profile=profile) if {"auth", "tenants", "migration"} & set(c.needs)}
    bad = {k: v for k, v in results.items() if v not in ("PASS", "INFO") and not (k in ha | auth and v == "N/A")}  # no FAIL, no other N/A
    if code != 0 or bad:
        pytest.fail(f"{bad}\n{failing_blocks(out, bad)}\n--- its engines now ---\n{engines_summary(stack.targets[profile])}\n"
                    f"--- the whole run ---\n{out}\n--- router log ---\n{stack.log(profile)}")
    want = {c.id for c in select_cases(load_cases(), None, profile=profile)}
    assert set(results) == want
    assert all(results[k] == "N/A" for k in ha | auth) and out.count("N/A: needs ha-etcd (not detectable") == len(ha), out
    assert "books 0/0" not in out and f" N/A {len(ha) + len(auth)} " in out
    root = ET.parse(junit).getroot()
    suites = {s.get("name", "").split(" [")[0]: s for s in root.findall("testsuite")}
    cases = [tc for name, s in suites.items() if name != "books" for tc in s.findall("testcase")]
    assert {tc.get("name", "").split(" [")[0] for tc in cases} == want
    for tc in cases:
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        assert props["class"] in ("interoperability", "narwhal") and props["rows"] and props["level"], props
    books = suites["books"].findall("testcase")
    with_books = {c.id for c in select_cases(load_cases(), None, profile=profile) if "accounting" in c.data} - ha - auth
    assert {tc.get("name", "").split(" books")[0] for tc in books} == with_books  # every accounting checked
    assert all(s.get("failures") == "0" for s in root.findall("testsuite"))
    assert SUITE_VERSION in (root.get("name") or "")
