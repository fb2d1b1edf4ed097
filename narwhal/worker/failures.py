"""How a leg of a request fails, as values the request's run passes up: `Failed` (a row,
words for the client, the engine to blame) and `Ended` (the stream already closed with its
class). worker/request.py maps them to a refusal or an error event."""

from __future__ import annotations

from typing import Any

from narwhal_generated import errors as E

from ..upstream.engines import EngineSpec

__all__ = ["Failed", "Ended"]


class Failed(Exception):
    """A leg's failure: its row (the generated row, E02-E07; a row ID from a sans-IO step
    is looked up in `E.ROWS` where it is raised), words for the client (`detail`), the
    engine to blame, and an engine error event held back for migration (E04 after
    response headers)."""

    def __init__(self, row: E.ErrorRow, detail: str, *, param: str | None = None, engine: EngineSpec | None = None, event: dict[str, Any] | None = None) -> None:
        super().__init__(detail)
        self.row = row
        self.detail = detail
        self.param = param
        self.engine = engine
        self.event = event  # an engine's error event held back for migration (E04 after headers)
        self.reported = False  # the engine's breaker has been told (Lease.retry)


class Ended(Exception):
    """The request ended with its class after the stream was closed (an engine's error
    event relayed to a streaming client); `failure` is the engine's, for its breaker."""

    def __init__(self, cls: str, failure: Failed) -> None:
        super().__init__(cls)
        self.cls = cls
        self.failure = failure
