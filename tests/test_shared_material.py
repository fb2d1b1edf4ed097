"""The shared fixtures the table-driven tests read must be there: a missing folder would
otherwise parametrize zero cases and pass vacuously."""

from tests.shared import FIXTURES, TRACES


def test_engine_stream_fixtures_are_present() -> None:
    assert len(list(FIXTURES.glob("*.jsonl"))) >= 8, f"no engine-stream fixtures under {FIXTURES} (set NARWHAL_SHARED)"
    assert len(list(FIXTURES.glob("*.expected.json"))) >= 7


def test_traces_are_present() -> None:
    assert (TRACES / "azure_llm_2023_conv.csv").is_file(), f"no traces under {TRACES}"
