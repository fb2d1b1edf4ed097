"""schemathesis over the generated OpenAPI document, in process (from_asgi) against
Narwhal's ASGI app in front of the reference mock fleet, with the suite's custom checks
(narwhal_conformance.fuzz): every non-2xx is the error envelope with a generated code, no
500, a 5xx only with the row that answers it; afterwards the books balance."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from schemathesis.python import asgi

from narwhal.compose import build_router, config_engines
from narwhal.config import parse_config
from narwhal_conformance.fleet import running_fleet
from narwhal_conformance.fuzz import books_balance, fuzz_schema
from narwhal_conformance.profiles import get_profile, router_config

from .support import free_port_base

EXAMPLES = 15  # per operation (x4 on the completion routes), positive and negative data: about 190 requests
TOKEN_ENV = "NARWHAL_FUZZ_TEST_ADMIN_TOKEN"


@pytest.fixture(scope="module")
def app() -> Iterator[Any]:
    profile = get_profile("reference")
    base = free_port_base([profile])
    cfg = router_config(profile, base)
    cfg["admission"].update(mode="open")
    cfg["admission"]["prediction"]["profile_on_start"] = False
    cfg["monitoring"].update(stale_after_ms=60000)
    cfg["admin"] = {"token_env": TOKEN_ENV}
    os.environ[TOKEN_ENV] = "fuzz-token"  # admin routes answer 401 to the fuzzer, not 404
    with running_fleet([profile], base):
        config = parse_config(cfg, source="fuzz config")
        application = build_router(config, config_engines(config)).app()
        try:
            yield application
        finally:
            asgi.shutdown_lifespans()
            os.environ.pop(TOKEN_ENV, None)


def test_fuzzing_the_generated_openapi_in_process(app: Any, record_property: Any) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    report = fuzz_schema(schema, examples=EXAMPLES, call=lambda case: case.call(timeout=10))
    with asgi.get_client(app) as client:
        unbalanced = books_balance(lambda: client.get(f"http://{asgi.HOST}/metrics").text)
    print(report.summary())
    record_property("fuzz_requests", report.requests)
    assert report.requests >= 11 * 10, report.summary()
    assert not report.problems, report.summary()
    assert unbalanced is None, unbalanced
    assert {"invalid_request", "model_not_found"} <= report.codes, report.summary()


def test_the_live_fuzz_mode_after_the_cases(stack: Any) -> None:
    from .support import run

    code, out = run(stack.targets["reference"], "reference", stack.port_base, "--case", "router_states", "--fuzz", "3")
    assert code == 0, out
    assert "fuzz: no problem found" in out and "requests over 11 operations" in out, out
