"""Dialect adapters, the sans-IO half: upstream request bodies and stream normalisation.

Rules
  * T01: the vllm dialect's decode stream is asked for generated/dialects.py's
    request_fields ({"return_token_ids": true, "stream_interval": 1}).
  * T08/T10: other dialects are never sent those fields, even when a client sent them.
  * The router always streams from the engine and always asks for usage
    (stream_options.include_usage), which it needs for accounting and sizing; what the
    client did not ask for is stripped on the way back (see narwhal/core/relay.py).
  * The vLLM two-phase protocol (docs/engines.md section 11): the prefill leg is
    non-streaming with max_tokens 1 and kv_transfer_params {"do_remote_decode": true};
    the decode leg carries the kv_transfer_params the prefill answer returned, unchanged
    (an object, or null: connectors that locate the KV themselves return null).
  * D01 (openai dialect): a tool-call delta repeating the id, type or function name
    already seen for its index has the repeat removed before assembly (TGI sends id "0"
    on every chunk).
"""

from __future__ import annotations

from typing import Any

from narwhal_generated import dialects as _d

__all__ = [
    "DIALECTS",
    "token_accounting",
    "decode_body",
    "prefill_body",
    "ToolCallNormaliser",
    "PREFILL_KV_REQUEST",
]

DIALECTS = _d.BY_NAME
_VLLM_ONLY: tuple[str, ...] = tuple(_d.V01.request_fields)  # return_token_ids, stream_interval

# docs/engines.md section 11, step 1.
PREFILL_KV_REQUEST: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def token_accounting(dialect: str) -> str:
    """T12: what /v1/engines reports for an engine of this dialect."""
    return DIALECTS[dialect].token_accounting


def decode_body(
    client: dict[str, Any],
    *,
    dialect: str,
    model: str | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    disaggregated: bool = False,
) -> dict[str, Any]:
    """The streaming request for a unified or decode engine, from the client's body."""
    body = dict(client)
    body["stream"] = True
    so = client.get("stream_options")
    so = dict(so) if isinstance(so, dict) else {}
    so["include_usage"] = True
    body["stream_options"] = so
    d = DIALECTS[dialect]
    if d.request_fields:  # T01
        body.update(d.request_fields)
    else:  # T08
        for k in _VLLM_ONLY:
            body.pop(k, None)
    if model is not None:
        body["model"] = model
    if disaggregated:
        # forwarded as the prefill answer had it, null included (vLLM's ExampleConnector
        # returns null and finds the KV by prompt on the decode side)
        body["kv_transfer_params"] = kv_transfer_params
    return body


def prefill_body(client: dict[str, Any], *, route: str, model: str | None = None) -> dict[str, Any]:
    """The non-streaming prefill leg of the vLLM two-phase protocol."""
    body = dict(client)
    body["stream"] = False
    body["max_tokens"] = 1
    if route == "chat":
        body["max_completion_tokens"] = 1
    for k in ("stream_options", "min_tokens", *_VLLM_ONLY):
        body.pop(k, None)
    body["kv_transfer_params"] = dict(PREFILL_KV_REQUEST)
    if model is not None:
        body["model"] = model
    return body


class ToolCallNormaliser:
    """D01: removes repeated tool-call id/type/name fragments, per (choice, index)."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], dict[str, Any]] = {}

    def __call__(self, chunk: Any) -> None:
        if type(chunk) is not dict:
            return
        choices = chunk.get("choices")
        if type(choices) is not list:
            return
        for c in choices:
            if type(c) is not dict:
                continue
            delta = c.get("delta")
            if type(delta) is not dict:
                continue
            tcs = delta.get("tool_calls")
            if type(tcs) is not list:
                continue
            for tc in tcs:
                if type(tc) is not dict:
                    continue
                key = (c.get("index", 0), tc.get("index", 0))
                seen = self._seen.get(key)
                fn = tc.get("function")
                name = fn.get("name") if type(fn) is dict else None
                if seen is None:
                    self._seen[key] = {"id": tc.get("id"), "type": tc.get("type"), "name": name}
                    continue
                for k in ("id", "type"):
                    v = tc.get(k)
                    if v is not None:
                        if seen[k] is None:
                            seen[k] = v
                        elif v == seen[k]:
                            del tc[k]
                if name is not None and type(fn) is dict:
                    if seen["name"] is None:
                        seen["name"] = name
                    elif name == seen["name"]:
                        del fn["name"]
