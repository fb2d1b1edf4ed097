from __future__ import annotations

from collections.abc import Iterator

import pytest

from narwhal.mock import MockConfig, RunningMock, Timing, running_fleet

FAST = Timing(time_scale=0.01)  # prefill ~0.04 ms, tpot ~0.08 ms


@pytest.fixture(scope="session")
def fleet() -> Iterator[dict[str, RunningMock]]:
    """One unified engine per dialect (fast timing), shared by shape and fault tests.

    Tests that read stats or recorded requests start their own engines."""
    cfgs = [MockConfig(dialect=d, name=f"{d}-0", timing=FAST) for d in ("vllm", "sglang", "openai")]
    cfgs.append(MockConfig(dialect="openai", name="tgi-0", timing=FAST, quirks=frozenset({"tgi_repeat_ids"})))
    with running_fleet(cfgs) as mocks:
        yield {m.name.removesuffix("-0"): m for m in mocks}
