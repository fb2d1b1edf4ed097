"""Incremental Server-Sent Events parser (WHATWG HTML, "Parsing an event stream").

Rules
  * Lines end in CRLF, LF or CR. A blank line dispatches the event.
  * `data:` lines of one event join with LF; one leading space after the colon is dropped.
  * Lines starting with `:` are comments; `event:`, `id:` and `retry:` are read and
    ignored (OpenAI-compatible engines send data-only events).
  * An event with no data line dispatches nothing.
Theory of operation: bytes go in through `feed`, complete event payloads come out, in
order, whatever the chunking (whole, one byte at a time). A CR ends its line at once; when
a chunk ends in CR, an LF that starts the next chunk is the rest of that CRLF and dropped.
"""

from __future__ import annotations

__all__ = ["SSEParser", "DONE"]

DONE = b"[DONE]"


class SSEParser:
    __slots__ = ("_buf", "_data", "_skip_lf")

    def __init__(self) -> None:
        self._buf = b""  # an unfinished line
        self._data: list[bytes] | None = None  # data lines of the event being read
        self._skip_lf = False  # the last chunk ended in CR: a leading LF completes a CRLF

    def feed(self, chunk: bytes) -> list[bytes]:
        """Payloads of the events completed by `chunk`."""
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_lf = False
        if b"\r" in chunk:
            self._skip_lf = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf = self._buf + chunk if self._buf else chunk
        out: list[bytes] = []
        start = 0
        data = self._data
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if not line:
                if data is not None:
                    out.append(data[0] if len(data) == 1 else b"\n".join(data))
                    data = None
                continue
            if line.startswith(b"data:"):
                v = line[6:] if line.startswith(b"data: ") else line[5:]
                if data is None:
                    data = [v]
                else:
                    data.append(v)
            # comments and other fields are ignored
        self._data = data
        self._buf = buf[start:]
        return out

    @property
    def pending(self) -> bool:
        """True when bytes of an unfinished event are buffered."""
        return bool(self._buf) or self._data is not None
