"""The OpenAPI 3.1 document of Narwhal's HTTP surface, built from the schemas and tables.

Error responses are derived from the error rows: each route lists the statuses its rows
can answer with, and each status's envelope restricts `code` to the codes of those rows,
so a fuzzer can check that every non-2xx answer is a row of the table.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from ._load import Spec

__all__ = ["render_openapi"]

_REF = "#/components/schemas/"


def _rewrite_refs(node: Any, prefix: str) -> Any:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k in ("$schema", "$id"):
                continue
            if k == "$ref" and isinstance(v, str) and v.startswith("#/$defs/"):
                out[k] = _REF + prefix + v[len("#/$defs/"):]
            else:
                out[k] = _rewrite_refs(v, prefix)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(x, prefix) for x in node]
    return node


def _embed(schemas: dict[str, Any], schema: dict[str, Any], name: str, def_prefix: str) -> None:
    s = copy.deepcopy(schema)
    defs = s.pop("$defs", {})
    for dname, d in defs.items():
        schemas[def_prefix + dname] = _rewrite_refs(d, def_prefix)
    if name:
        schemas[name] = _rewrite_refs(s, def_prefix)


def _error_responses(rows: list[dict[str, Any]], schemas: dict[str, Any], tag: str) -> dict[str, Any]:
    by_status: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_status.setdefault(r["status"], []).append(r)
    out: dict[str, Any] = {}
    for status in sorted(by_status):
        rs = by_status[status]
        name = f"Error{status}_{tag}"
        schemas[name] = {
            "type": "object",
            "additionalProperties": False,
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["message", "type", "param", "code"],
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"enum": sorted({r["type"] for r in rs})},
                        "param": {"type": ["string", "null"]},
                        "code": {"enum": [r["code"] for r in rs]},
                    },
                }
            },
        }
        resp: dict[str, Any] = {
            "description": "; ".join(f"{r['id']} {r['code']}" for r in rs),
            "content": {"application/json": {"schema": {"$ref": _REF + name}}},
        }
        if any(r["retry_after"] != "none" for r in rs):
            resp["headers"] = {
                "Retry-After": {
                    "description": "Seconds; rows " + ", ".join(r["id"] for r in rs if r["retry_after"] != "none"),
                    "required": all(r["retry_after"] != "none" for r in rs),
                    "schema": {"type": "string", "pattern": "^[0-9]+$"},
                }
            }
        for name in sorted({h for r in rs for h in r.get("headers", {})}):
            resp.setdefault("headers", {})[name] = {
                "description": "; ".join(f"{r['id']}: {r['headers'][name]}" for r in rs if name in r.get("headers", {})),
                "required": all(name in r.get("headers", {}) for r in rs),
                "schema": {"type": "string"},
            }
        out[str(status)] = resp
    return out


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF + ref}}}


# the completion routes' request headers (R13's deadline, the TTFT target, the request ID)
_COMPLETION_HEADERS = [
    {
        "name": "x-narwhal-ttft-target-ms",
        "in": "header",
        "required": False,
        "description": "The client's TTFT target in ms, raising or lowering admission.ttft_budget_ms up to admission.max_ttft_target_ms.",
        "schema": {"type": "string", "pattern": "^[0-9]{1,9}$"},
    },
    {
        "name": "x-narwhal-deadline-ms",
        "in": "header",
        "required": False,
        "description": "The original request deadline in ms, relative to arrival (R13).",
        "schema": {"type": "string", "pattern": "^[0-9]{1,9}$"},
    },
    {
        "name": "x-request-id",
        "in": "header",
        "required": False,
        "description": "Propagated to the engines and echoed; generated when absent.",
        "schema": {"type": "string", "pattern": "^[!-~]{1,128}$"},
    },
]
_RID_HEADER = {"x-request-id": {"description": "The request ID.", "schema": {"type": "string"}}}


def _completion(schemas: dict[str, Any], req: str, resp: str, summary: str, tag: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = {
        "description": "An assembled response (stream false) or an SSE stream of engine chunks (stream true).",
        "headers": _RID_HEADER,
        "content": {
            "application/json": {"schema": {"$ref": _REF + resp}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
    return {
        "post": {
            "summary": summary,
            "operationId": tag,
            "parameters": _COMPLETION_HEADERS,
            "requestBody": {"required": True, "content": _json(req)},
            "responses": {"200": ok, **_error_responses(rows, schemas, tag)},
        }
    }


def _admin(schemas: dict[str, Any], admin_rows: list[dict[str, Any]], op: str, summary: str, body: dict[str, Any] | None, path_params: list[str]) -> dict[str, Any]:
    o: dict[str, Any] = {
        "summary": summary,
        "operationId": op,
        "security": [{"bearer": []}],
        "parameters": [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}}
            for p in path_params
        ],
        "responses": {
            "200": {"description": "Done.", "content": _json("AdminResult")},
            **_error_responses(admin_rows if body else [r for r in admin_rows if r["id"] != "H04"], schemas, op),
        },
    }
    if body is not None:
        o["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return {"post": o}


def _get(op: str, summary: str, ok: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"get": {"summary": summary, "operationId": op, "responses": {"200": ok, **(extra or {})}}}


def _flag(name: str, values: dict[str, Any]) -> dict[str, Any]:
    """An admin body of one required property."""
    return {"type": "object", "additionalProperties": False, "required": [name], "properties": {name: values}}


def _completion_paths(spec: Spec, schemas: dict[str, Any]) -> dict[str, Any]:
    """The two completion routes (every refusal and failure row, H06) and /v1/models."""
    refusals = spec.rows("refusals")
    failures = [r for r in spec.rows("failures") if r["id"].startswith("E")]
    http = {r["id"]: r for r in spec.rows("failures") if r["id"].startswith("H")}
    rows = refusals + failures + [http["H06"]]
    return {
        "/v1/chat/completions": _completion(
            schemas, "ChatCompletionRequest", "ChatCompletion", "Chat completion (one offered arrival).", "chat_completions", rows
        ),
        "/v1/completions": _completion(
            schemas, "CompletionRequest", "Completion", "Text completion (one offered arrival).", "completions", [r for r in rows if r["id"] != "R07"]
        ),
        "/v1/models": _get(
            "list_models",
            "The configured model.",
            {"description": "OpenAI list shape.", "content": _json("ModelList")},
            # with auth configured, the completion routes' identity rows (R15, R16)
            _error_responses([r for r in refusals if r["when"] in ("api_key_missing", "api_key_invalid")], schemas, "list_models"),
        ),
    }


def _read_paths() -> dict[str, Any]:
    return {
        "/health": _get("health", "Liveness.", {"description": "The process serves.", "content": _json("Health")}),
        "/ready": _get(
            "ready",
            "Readiness: state and reason.",
            {"description": "Active.", "content": _json("Ready")},
            {"503": {"description": "Not ready; the reason names the state.", "content": _json("Ready")}},
        ),
        "/v1/engines": _get("list_engines", "Engines, eligibility and learned profiles.", {"description": "Engines.", "content": _json("EngineList")}),
        "/metrics": _get(
            "metrics",
            "Prometheus text exposition.",
            {"description": "Metrics.", "content": {"text/plain": {"schema": {"type": "string"}}}},
        ),
    }


def _admin_paths(spec: Spec, schemas: dict[str, Any]) -> dict[str, Any]:
    http = {r["id"]: r for r in spec.rows("failures") if r["id"].startswith("H")}
    rows = [http["H01"], http["H03"], http["H04"], http["H05"]]
    return {
        "/admin/state": _admin(schemas, rows, "admin_set_state", "Set the router's state.", _flag("state", {"enum": ["active", "standby"]}), []),
        "/admin/waves/{wave}/maintenance": _admin(
            schemas, rows, "admin_wave_maintenance", "A wave enters or leaves maintenance.", _flag("maintenance", {"type": "boolean"}), ["wave"]
        ),
        "/admin/engines/{name}/drain": _admin(
            schemas, rows, "admin_drain_engine", "Drain an engine or end its drain.", _flag("drain", {"type": "boolean"}), ["name"]
        ),
        "/admin/engines/{name}/profile": _admin(schemas, rows, "admin_profile_engine", "Re-profile an engine.", None, ["name"]),
    }


def render_openapi(spec: Spec) -> str:
    schemas: dict[str, Any] = {}
    _embed(schemas, spec.schemas["chat_request.schema.json"], "ChatCompletionRequest", "ChatCompletionRequest_")
    _embed(schemas, spec.schemas["completion_request.schema.json"], "CompletionRequest", "CompletionRequest_")
    _embed(schemas, spec.schemas["responses.schema.json"], "", "")
    _embed(schemas, spec.schemas["error.schema.json"], "ErrorEnvelope", "ErrorEnvelope_")
    paths = {**_completion_paths(spec, schemas), **_read_paths(), **_admin_paths(spec, schemas)}
    doc = {
        "openapi": "3.1.0",
        "info": {
            "title": "Narwhal router",
            "version": "1",
            "description": "GENERATED by narwhal.specgen from spec/; do not edit. Error codes name spec rows.",
        },
        "paths": paths,
        "components": {
            "schemas": dict(sorted(schemas.items())),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
