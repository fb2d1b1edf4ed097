"""Vendor expectation files: known failures and cases that do not apply, as data owned by
the vendor and kept outside the suite (wptrunner's expectation files).

    refusals/R11/1: {status: FAIL, bug: https://tracker.example/123}
    assembly/A07:   {status: FAIL, bug: https://tracker.example/124}    # every case under it
    refusals/R06:   {status: NA, reason: "our router serves n > 1 on purpose"}

FAIL: a listed case that fails is EXPECTED-FAIL and does not fail the run; one that
passes is UNEXPECTED-PASS, which does (the expectation is stale). NA: the case is not
run; it is reported N/A with the vendor's reason. The most specific id wins.
A file that breaks these rules is refused with its line number (exit status 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["ExpectationError", "load_expectations", "expectation_for", "STATUSES"]

STATUSES = ("FAIL", "NA")
_ID = r"^(refusals|failures|assembly|token_identity|router_states|accounting)(/[A-Z][0-9]{2}(/[0-9]+)?)?$"


class ExpectationError(ValueError):
    pass


def load_expectations(path: str | Path) -> dict[str, dict[str, Any]]:
    """case id (or prefix) -> {status: FAIL|NA, bug?, reason?}; ExpectationError naming
    FILE:LINE for anything else."""
    import re

    p = Path(path)
    try:
        text = p.read_text()
        root = yaml.compose(text)
    except OSError as e:
        raise ExpectationError(f"{p}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ExpectationError(f"{p}:{mark.line + 1 if mark else '?'}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if root is None:
        return {}
    if not isinstance(root, yaml.MappingNode):
        raise ExpectationError(f"{p}:{root.start_mark.line + 1}: an expectation file maps case ids to {{status: FAIL|NA, ...}}")
    out: dict[str, dict[str, Any]] = {}
    for knode, vnode in root.value:
        line = knode.start_mark.line + 1
        key = str(knode.value).rstrip("/")
        where = f"{p}:{line}: {key}"
        if not re.match(_ID, key):
            raise ExpectationError(f"{where}: not a case id or id prefix (e.g. refusals/R11/1, assembly/A07)")
        try:
            v = yaml.safe_load(yaml.serialize(vnode))
        except yaml.YAMLError as e:
            raise ExpectationError(f"{where}: {e}") from None
        if not isinstance(v, dict):
            raise ExpectationError(f"{where}: expected {{status: FAIL, bug: URL}} or {{status: NA, reason: TEXT}}")
        status = str(v.get("status", "")).upper()
        if status not in STATUSES:
            raise ExpectationError(f"{where}: status {v.get('status')!r} is not one of {', '.join(STATUSES)}")
        unknown = set(v) - {"status", "bug", "reason"}
        if unknown:
            raise ExpectationError(f"{where}: unknown key(s) {sorted(unknown)} (status, bug, reason)")
        if status == "NA" and not str(v.get("reason", "")).strip():
            raise ExpectationError(f"{where}: status NA needs a reason")
        if key in out:
            raise ExpectationError(f"{where}: listed twice")
        out[key] = {**v, "status": status}
    return out


def expectation_for(case_id: str, exp: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    best: tuple[str, dict[str, Any]] | None = None
    for k, v in exp.items():
        if (case_id == k or case_id.startswith(k + "/")) and (best is None or len(k) > len(best[0])):
            best = (k, v)
    return best[1] if best else None
