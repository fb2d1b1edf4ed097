"""Incremental Server-Sent Events parser (WHATWG HTML, "Parsing an event stream").

Rules
  * Lines end in CRLF, LF or CR. A blank line dispatches the event.
  * `data:` lines of one event join with LF; one leading space after the colon is dropped.
  * Lines starting with `:` are comments; `event:`, `id:` and `retry:` are read and
    ignored (OpenAI-compatible engines send data-only events).
  * An event with no data line dispatches nothing.
  * Bounded (upstream.max_event_bytes, row E02): an event whose data, or a line, grows
    past `max_event_bytes` stops the parser (`too_large`); the events completed before
    it are still returned. Engine output is not trusted to end its lines.
Theory of operation: bytes go in through `feed`, complete event payloads come out, in
order, whatever the chunking (whole, one byte at a time). A CR ends its line at once; when
a chunk ends in CR, an LF that starts the next chunk is the rest of that CRLF and dropped.
An unfinished line waits in a bytearray that only grows (amortised linear) and is never
scanned again: a new chunk is searched for the line's end, not the buffer, so a long line
costs linear time however it is chunked.
"""

from __future__ import annotations

__all__ = ["SSEParser", "DONE", "DEFAULT_MAX_EVENT_BYTES"]

DONE = b"[DONE]"
DEFAULT_MAX_EVENT_BYTES = 4 << 20  # the default of upstream.max_event_bytes


class SSEParser:
    __slots__ = ("_buf", "_data", "_size", "_skip_lf", "max_event_bytes", "too_large")

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._buf: bytearray | None = None  # an unfinished line (holds no LF)
        self._data: list[bytes] | None = None  # data lines of the event being read
        self._size = 0  # bytes of _data joined (+1 per line)
        self._skip_lf = False  # the last chunk ended in CR: a leading LF completes a CRLF
        self.max_event_bytes = max_event_bytes
        self.too_large = False  # an event or line went past max_event_bytes (E02)

    def feed(self, chunk: bytes) -> list[bytes]:
        """Payloads of the events completed by `chunk`."""
        if self.too_large:
            return []
        if (
            self._buf is None and self._data is None and not self._skip_lf
            and chunk.startswith(b"data: ") and chunk.endswith(b"\n\n") and chunk.find(b"\n", 6) == len(chunk) - 2
            and 13 not in chunk and len(chunk) - 7 <= self.max_event_bytes
        ):
            # the common read: one whole event of one `data: ` line, nothing held before
            # it (what the loop below returns for it, without the loop; 13 is CR)
            return [chunk[6:-2]]
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_lf = False
        if 13 in chunk:  # a CR (an int's membership is a memchr; b"\r" is a substring search)
            self._skip_lf = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        limit = self.max_event_bytes
        pend = self._buf
        if pend is not None:
            if b"\n" not in chunk:  # the line goes on: append, never rescan
                pend += chunk
                if len(pend) + self._size > limit:
                    self._overflow()
                return []
            pend += chunk
            buf = bytes(pend)  # one copy per finished long line, not one per chunk
            self._buf = None
        else:
            buf = chunk
        out: list[bytes] = []
        start = 0
        data = self._data
        size = self._size
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if not line:
                if data is not None:
                    if size > limit:
                        self._overflow()
                        return out
                    out.append(data[0] if len(data) == 1 else b"\n".join(data))
                    data = None
                    size = 0
                continue
            if line.startswith(b"data:"):
                v = line[6:] if line.startswith(b"data: ") else line[5:]
                size += len(v) + 1  # + the LF that joins it: empty data lines count too
                if data is None:
                    data = [v]
                else:
                    data.append(v)
            # comments and other fields are ignored
        self._data = data
        self._size = size
        if start < len(buf):
            if len(buf) - start + size > limit:
                self._overflow()
                return out
            self._buf = bytearray(memoryview(buf)[start:])
        elif size > limit:
            self._overflow()
        return out

    def _overflow(self) -> None:
        self.too_large = True
        self._buf = None
        self._data = None
        self._size = 0

    @property
    def pending(self) -> bool:
        """True when bytes of an unfinished event are buffered."""
        return self._buf is not None or self._data is not None
