"""The router's threat model, its JSON log (issue 40 item 8): under `--log-format json` a
log pipeline parses every line; a line it cannot parse is dropped or mis-read, and a line
a client could shape would be a forged event. As found: the start-up line ("narwhal:
serving model ... on ...") was plain text.

The attack here: clients send what reaches the log (a request ID of quotes, braces and
a forged event; a model name with a newline and a forged event; a path of escapes; a body
that is not JSON) to `narwhal serve --log-format json --log-level info` in front of a
mock engine. Every line the process writes is one JSON object; the one `serving` event is
the router's; no forged event appears; a request ID that is not plain is replaced by the
router's own."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from narwhal.mock import MockConfig, running_fleet
from tests.helpers import serve_logging

FORGED = '{"event": "config_reload", "path": "/etc/evil", "changed": ["auth"]}'


def test_no_client_shapes_a_line_of_the_json_log(tmp_path: Path) -> None:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0")]) as (m,), serve_logging(tmp_path, m.url, "json", "info") as (url, out, err):
        chat = {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        with httpx.Client(base_url=url, timeout=10) as c:
            sent = [
                c.post("/v1/chat/completions", json=chat, headers={"x-request-id": 'a"}\\' + FORGED}),
                c.post("/v1/chat/completions", json={**chat, "model": "m\n" + FORGED}),
                c.post("/v1/chat/completions", content=b'{"model": "\\u0000' + FORGED.encode() + b"\n"),
                c.post("/v1/completions%0a%22%7d", json=chat),
                c.post("/v1/chat/completions", json=chat, headers={"x-request-id": "plain-id-1"}),
            ]
        assert [r.status_code for r in sent] == [200, 404, 400, 404, 200], [r.text for r in sent]
    lines = [ln for ln in (out.read_text() + err.read_text()).splitlines() if ln.strip()]
    objs = [json.loads(ln) for ln in lines]  # every line: one JSON object (a plain line raises here)
    assert all(isinstance(x, dict) for x in objs), lines
    events = [x.get("event") for x in objs]
    assert events.count("serving") == 1 and "config_reload" not in events, events
    ends = [x for x in objs if x.get("event") == "request_end"]
    ids = [x["request_id"] for x in ends]
    assert "plain-id-1" in ids and not any(FORGED in i or '"' in i for i in ids), ids
    assert sent[0].headers["x-request-id"] in ids and sent[0].headers["x-request-id"] != 'a"}\\' + FORGED
