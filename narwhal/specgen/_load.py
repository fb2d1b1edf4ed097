"""Load and check the spec tables (spec/tables/*.yaml) against spec/schema/table.schema.json.

Beyond the schema, the cross-table invariants checked here are:
  * row IDs are unique across all tables;
  * refusal `order` values are exactly 1..N, in file order (the precedence is the file);
  * error codes are unique (a code names one row);
  * every assembly `refusal:` names an existing failure row;
  * every `notes:` key names a row of its table;
  * the leadership and lifecycle tables have exactly one row per (state, event) pair;
  * the migration table names existing failure rows, each reason once, and ends with the
    one row that migrates (`carry_on`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

__all__ = ["with_table", "Spec", "SpecError", "load_spec", "TABLE_FILES", "SCHEMA_FILES"]

TABLE_FILES = (
    "refusals.yaml",
    "failures.yaml",
    "assembly.yaml",
    "token_identity.yaml",
    "accounting.yaml",
    "dialects.yaml",
    "router_states.yaml",
    "leadership.yaml",
    "lifecycle.yaml",
    "migration.yaml",
)

# JSON Schemas turned into pydantic models: (schema file, generated module name).
SCHEMA_FILES = (
    ("config.schema.json", "config"),
    ("chat_request.schema.json", "chat_request"),
    ("completion_request.schema.json", "completion_request"),
    ("error.schema.json", "error"),
    ("responses.schema.json", "responses"),
)


class SpecError(Exception):
    """A spec table is invalid; the message names the file and the row."""


@dataclass(frozen=True, slots=True)
class Spec:
    root: Path
    tables: dict[str, dict[str, Any]]  # table name -> parsed YAML
    schemas: dict[str, dict[str, Any]]  # schema file name -> parsed JSON
    inputs: tuple[Path, ...]  # every file read, repo-relative, sorted

    def rows(self, table: str) -> list[dict[str, Any]]:
        return [r for r in self.tables[table]["rows"] if not r.get("retired")]


def _fail(path: str, msg: str) -> SpecError:
    return SpecError(f"{path}: {msg}")


def _validated(validator: jsonschema.Draft202012Validator, rel: str, data: dict[str, Any]) -> dict[str, Any]:
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        best = jsonschema.exceptions.best_match(errors)
        where = "/".join(str(p) for p in best.absolute_path)
        raise _fail(rel, f"{where}: {best.message}")
    return data


def _validator(root: Path) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads((root / "spec" / "schema" / "table.schema.json").read_text()))


def with_table(spec: Spec, text: str) -> Spec:
    """`spec` with one table's file replaced by `text` (a reordered copy, say), validated
    and cross-checked as `load_spec` does: what `narwhal spec generate` would read."""
    data = yaml.safe_load(text)
    _validated(_validator(spec.root), f"spec/tables/{data['table']}.yaml", data)
    out = Spec(root=spec.root, tables={**spec.tables, data["table"]: data}, schemas=spec.schemas, inputs=spec.inputs)
    _cross_check(out)
    return out


def load_spec(root: Path) -> Spec:
    validator = _validator(root)
    tables: dict[str, dict[str, Any]] = {}
    inputs: list[Path] = [Path("spec/schema/table.schema.json")]
    for name in TABLE_FILES:
        rel = f"spec/tables/{name}"
        data = _validated(validator, rel, yaml.safe_load((root / rel).read_text()))
        tables[data["table"]] = data
        inputs.append(Path(rel))
    schemas: dict[str, dict[str, Any]] = {}
    for fname, _ in SCHEMA_FILES:
        rel = f"spec/schema/{fname}"
        schemas[fname] = json.loads((root / rel).read_text())
        jsonschema.Draft202012Validator.check_schema(schemas[fname])
        inputs.append(Path(rel))
    spec = Spec(root=root, tables=tables, schemas=schemas, inputs=tuple(sorted(inputs)))
    _cross_check(spec)
    return spec


def _check_total(spec: Spec, table: str) -> None:
    """A state machine's table: exactly one row per (state, event) pair."""
    rel = f"spec/tables/{table}.yaml"
    pairs: dict[tuple[str, str], str] = {}
    for r in spec.tables[table]["rows"]:
        key = (r["state"], r["event"])
        if key in pairs:
            raise _fail(rel, f"{r['id']}: ({key[0]}, {key[1]}) already has row {pairs[key]}")
        pairs[key] = r["id"]
    states = {s for s, _ in pairs} | {r["next"] for r in spec.tables[table]["rows"]}
    events = {e for _, e in pairs}
    missing = sorted((s, e) for s in states for e in events if (s, e) not in pairs)
    if missing:
        raise _fail(rel, f"no row for {missing}")


def _cross_check(spec: Spec) -> None:
    seen: dict[str, str] = {}
    for tname, table in spec.tables.items():
        ids = [r["id"] for r in table.get("rows", [])]
        ids += [r["id"] for r in table.get("counters", []) + table.get("terminal_classes", [])]
        for rid in ids:
            if rid in seen:
                raise _fail(f"spec/tables/{tname}", f"row ID {rid} already used in {seen[rid]}")
            seen[rid] = tname
        for key in table.get("notes", {}):
            if key not in ids:
                raise _fail(f"spec/tables/{tname}", f"note {key} names no row of this table")
    orders = [r["order"] for r in spec.tables["refusals"]["rows"]]
    if orders != list(range(1, len(orders) + 1)):
        raise _fail("spec/tables/refusals.yaml", f"order must be 1..N in file order, got {orders}")
    for r in spec.tables["refusals"]["rows"]:
        if "stage" not in r:
            raise _fail("spec/tables/refusals.yaml", f"{r['id']} has no stage")
    for r in spec.tables["failures"]["rows"]:
        if "stage" in r:
            raise _fail("spec/tables/failures.yaml", f"{r['id']}: only refusal rows have a stage")
    codes: dict[str, str] = {}
    for tname in ("refusals", "failures"):
        for r in spec.tables[tname]["rows"]:
            if r["code"] in codes:
                raise _fail(f"spec/tables/{tname}", f"code {r['code']} of {r['id']} already names {codes[r['code']]}")
            codes[r["code"]] = r["id"]
    failure_ids = {r["id"] for r in spec.tables["failures"]["rows"]}
    for r in spec.tables["assembly"]["rows"]:
        if "refusal" in r and r["refusal"] not in failure_ids:
            raise _fail("spec/tables/assembly.yaml", f"{r['id']} refers to unknown failure row {r['refusal']}")
    for machine in ("leadership", "lifecycle"):
        _check_total(spec, machine)
    mig = spec.tables["migration"]
    for f in mig["failures"]:
        if f not in failure_ids:
            raise _fail("spec/tables/migration.yaml", f"failures: {f} is not a failure row")
    reasons = [r["reason"] for r in mig["rows"]]
    if len(set(reasons)) != len(reasons):
        raise _fail("spec/tables/migration.yaml", "a reason appears twice")
    migrating = [r["reason"] for r in mig["rows"] if r["outcome"] == "migrate"]
    if migrating != ["carry_on"] or "placement_refused" not in reasons:
        # once the continuation is placed or refused one of the two holds: every walk ends
        raise _fail("spec/tables/migration.yaml", "one row migrates (reason carry_on), and a placement_refused row does not")
    classes = {k["name"] for k in spec.tables["accounting"]["terminal_classes"]}
    for tname in ("refusals", "failures"):
        for r in spec.tables[tname]["rows"]:
            if r["counter"] != "none" and r["counter"] not in classes:
                raise _fail(f"spec/tables/{tname}", f"{r['id']} counts into unknown class {r['counter']}")
