from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

# serving.relay_path: the relay's hidden-path tests (token-ID checks, E02 bounds, send
# stall, a client's disconnect cancelling its engine request) run on every path there is.
# "direct" takes the compiled step where the install built it (serving.relay_native, on by
# default); "direct-python" is the direct path with it off, which tests/http/test_relay.py
# runs as well (tests/helpers.py `relay_serving`)
RELAY_PATHS = ("direct", "asgi")


@pytest.fixture(scope="module", params=RELAY_PATHS)
def relay_path(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param

settings.register_profile("ci", deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
