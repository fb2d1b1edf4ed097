"""The pieces of narwhal/telemetry on their own: W3C traceparent parsing, the JSON line,
the request record's fields against the documented names, the client-flag bucket."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import pytest

from narwhal.telemetry.logs import (
    REQUEST_END,
    REQUEST_FIELDS,
    ROUTER_EVENTS,
    JsonFormatter,
    RequestRecord,
    event,
)
from narwhal.telemetry.tracing import _Bucket, parse_traceparent

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"


@pytest.mark.parametrize(("header", "want"), [
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", (0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, True)),
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", (0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, False)),
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03", (0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, True)),
    (b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later", (0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, True)),
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", None),  # version 00 has four fields
    (b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),
    (b"00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),
    (b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", None),  # upper case is invalid
    (b"00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", None),
    (b"garbage", None),
    (b"00-" + b"a" * 600, None),
])
def test_traceparent(header: bytes, want: tuple[int, int, bool] | None) -> None:
    assert parse_traceparent(header) == want


def _line(record: logging.LogRecord, worker: int | None = None) -> dict[str, object]:
    out = JsonFormatter(worker).format(record)
    assert "\n" not in out
    obj = json.loads(out)
    assert isinstance(obj, dict)
    return obj


def test_a_plain_line_is_event_log_with_its_words() -> None:
    rec = logging.LogRecord("narwhal", logging.WARNING, __file__, 1, "engine %s: %s", ("d0", 'a "quoted"\nline'), None)
    obj = _line(rec, worker=3)
    assert obj["event"] == "log" and obj["level"] == "warning" and obj["logger"] == "narwhal" and obj["worker"] == 3
    assert obj["msg"] == 'engine d0: a "quoted"\nline'
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", str(obj["ts"]))


def test_a_router_event_carries_its_fields_and_an_exception_its_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        exc = sys.exc_info()
    rec = logging.LogRecord("narwhal", logging.ERROR, __file__, 1, "reload", (), exc)
    rec.__dict__.update(event("config_reload_failed", path="/x.yaml", error="bad"))
    obj = _line(rec)
    assert obj["event"] == "config_reload_failed" and obj["path"] == "/x.yaml" and obj["error"] == "bad"
    assert "worker" not in obj and "ValueError: boom" in str(obj["exc"])


def test_the_request_record_writes_exactly_the_documented_fields() -> None:
    r = RequestRecord("rid-1", "chat", 10.0, traceparent=b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    f = r.fields("completed", 10.5)
    assert tuple(f) == REQUEST_FIELDS
    assert f["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736" and f["sampled"] is False and f["duration_ms"] == 500.0
    assert RequestRecord("rid-2", "chat", 0.0).fields("cancelled", 0.0)["trace_id"] is None


def test_the_doc_names_every_field_and_event() -> None:
    """docs/observability.md and logs.py name the same fields (the WARNING in logs.py)."""
    doc = DOC.read_text()
    for name in (*REQUEST_FIELDS, REQUEST_END):
        assert f"`{name}`" in doc, name
    for name, fields in ROUTER_EVENTS.items():
        assert f"`{name}`" in doc, name
        for f in fields:
            assert f"`{f}`" in doc, (name, f)


def test_the_client_flag_bucket_bounds_a_burst() -> None:
    b = _Bucket(3.0)
    assert sum(b.take() for _ in range(100)) <= 4  # the burst, and what refilled meanwhile
    assert not _Bucket(0.0).take()
