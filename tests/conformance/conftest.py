from __future__ import annotations

from collections.abc import Iterator

import pytest

from .support import Stack, conformance_stack


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """The mock fleets of every profile and one `narwhal serve` per profile."""
    with conformance_stack() as s:
        yield s
