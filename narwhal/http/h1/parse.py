"""Reading a client's bytes (sans-IO): the request head, header fields, bodies.

Grammar (RFC 9112 as h11 0.16 reads it, which the differential tests hold us to):
  request-line  method SP request-target SP "HTTP/" DIGIT "." DIGIT
  field-line    token ":" OWS [ field-content ] OWS, field-content's bytes any but NUL
                and whitespace, single spaces/tabs between them; obs-fold lines join
                the line before with one space
  a head ends at the first empty line (CRLF or a bare LF); a blank line before the
  request line is an error; a buffer whose first byte is below 0x21 is refused at once.
Field rules (`fields_of`): Content-Length all digits (at most 20), repeated only with
the same value (a comma list of one value taken as it); Transfer-Encoding once, and only
"chunked" (else 501); Host exactly once in an HTTP/1.1 request.
The common head (head.SCAN: the C scan or the Python reference) is read first; anything
it declines is read here.
"""

from __future__ import annotations

import re
from typing import Any

from .events import Data, EndOfMessage, Fields, LocalProtocolError, RemoteProtocolError, Request
from .head import HEAD_MAX, SCAN

__all__ = [
    "Buffer", "read_head", "fields_of", "comma_values", "ContentLengthReader", "ChunkedReader", "Http10Reader", "body_framing",
    "FIELD_NAME", "FIELD_VALUE",
]

_TOKEN = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_VCHAR_OBS = rb"[^\x00\s]"
_FIELD_CONTENT = _VCHAR_OBS + rb"+(?:[ \t]+" + _VCHAR_OBS + rb"+)*"
FIELD_NAME = re.compile(_TOKEN)
FIELD_VALUE = re.compile(rb"(?:" + _FIELD_CONTENT + rb")?")
_FIELD_LINE = re.compile(rb"(" + _TOKEN + rb"):[ \t]*((?:" + _FIELD_CONTENT + rb")?)[ \t]*")
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/([0-9]\.[0-9])")
_CHUNK_HEADER = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*\r\n")
_DIGITS = re.compile(rb"[0-9]+")
_BLANK = re.compile(rb"\n\r?\n")
_FOLD = re.compile(rb"[ \t]+")
CL_DIGITS = 20


class Buffer:
    """The bytes received and not yet read (a bytearray; reads take from the front)."""

    __slots__ = ("data", "_line_from", "_lines_from")

    def __init__(self) -> None:
        self.data = bytearray()
        self._line_from = 0  # where the next CRLF search starts (the bytes before were searched)
        self._lines_from = 0

    def __len__(self) -> int:
        return len(self.data)

    def __bool__(self) -> bool:
        return bool(self.data)

    def add(self, data: bytes) -> None:
        self.data += data

    def take(self, n: int) -> bytes:
        d = self.data
        out = bytes(d[:n])
        del d[:n]
        self._line_from = self._lines_from = 0
        return out

    def take_at_most(self, n: int) -> bytes | None:
        if not self.data:
            return None
        return self.take(n)

    def take_line(self) -> bytes | None:
        """The first line with its CRLF, or None while it is not whole."""
        i = self.data.find(b"\r\n", max(0, self._line_from - 1))
        if i < 0:
            self._line_from = len(self.data)
            return None
        return self.take(i + 2)

    def take_lines(self) -> list[bytes] | None:
        """The lines up to the first empty one (its end taken too, the empty line not
        listed), each without its CR/LF; [] when the buffer starts with an empty line;
        None while no empty line is in it."""
        d = self.data
        if d[:1] == b"\n":
            self.take(1)
            return []
        if d[:2] == b"\r\n":
            self.take(2)
            return []
        m = _BLANK.search(d, self._lines_from)
        if m is None:
            self._lines_from = max(0, len(d) - 2)
            return None
        out = self.take(m.end())
        lines = out.split(b"\n")[:-2]
        return [ln[:-1] if ln.endswith(b"\r") else ln for ln in lines]


def _unfold(lines: list[bytes]) -> list[bytes]:
    out: list[bytes] = []
    for line in lines:
        m = _FOLD.match(line)
        if m:
            if not out:
                raise LocalProtocolError("continuation line at start of headers")
            out[-1] = out[-1] + b" " + line[m.end() :]
        else:
            out.append(line)
    return out


def _field_lines(lines: list[bytes]) -> list[tuple[bytes, bytes]]:
    got = []
    for line in _unfold(lines):
        m = _FIELD_LINE.fullmatch(line)
        if m is None:
            raise LocalProtocolError("illegal header line")
        got.append((m.group(1), m.group(2)))
    return got


def fields_of(pairs: list[tuple[bytes, bytes]], *, validate: bool = False) -> Fields:
    """Fields from (name, value) pairs under the field rules (module docstring); `validate`:
    check each name and value's bytes too (what a parsed line already matched)."""
    out: Fields = []
    length: bytes | None = None
    chunked = False
    for name, value in pairs:
        if validate:
            if FIELD_NAME.fullmatch(name) is None:
                raise LocalProtocolError("illegal header name")
            if FIELD_VALUE.fullmatch(value) is None:
                raise LocalProtocolError("illegal header value")
        lower = name.lower()
        if lower == b"content-length":
            values = {v.strip() for v in value.split(b",")}
            if len(values) != 1:
                raise LocalProtocolError("conflicting Content-Length headers")
            value = values.pop()
            if _DIGITS.fullmatch(value) is None or len(value) > CL_DIGITS:
                raise LocalProtocolError("bad Content-Length")
            if length is None:
                length = value
                out.append((name, lower, value))
            elif length != value:
                raise LocalProtocolError("conflicting Content-Length headers")
        elif lower == b"transfer-encoding":
            if chunked:
                raise LocalProtocolError("multiple Transfer-Encoding headers", 501)
            value = value.lower()
            if value != b"chunked":
                raise LocalProtocolError("only Transfer-Encoding: chunked is supported", 501)
            chunked = True
            out.append((name, lower, value))
        else:
            out.append((name, lower, value))
    return out


def comma_values(fields: Fields, name: bytes) -> list[bytes]:
    """The comma-separated values of every `name` field, lower-cased, stripped, none empty."""
    out = []
    for _, n, v in fields:
        if n == name:
            for part in v.lower().split(b","):
                part = part.strip()
                if part:
                    out.append(part)
    return out


def _host_rule(fields: Fields, version: bytes) -> None:
    hosts = 0
    for f in fields:
        if f[1] == b"host":
            hosts += 1
    if version == b"1.1" and hosts == 0:
        raise LocalProtocolError("missing mandatory Host header")
    if hosts > 1:
        raise LocalProtocolError("multiple Host headers")


def read_head(buf: Buffer) -> Request | None:
    """The request whose head starts the buffer (taken), or None while it is not whole.
    Raises LocalProtocolError for a head the grammar refuses."""
    got: Any = SCAN(buf.data, HEAD_MAX)  # the common head, scanned whole
    if got is not None:
        method, target, fields, n = got
        hosts = 0
        for f in fields:
            if f[1] == b"host":
                hosts += 1
        if hosts == 1:
            buf.take(n)
            return Request(method, target, fields, b"1.1")
    lines = buf.take_lines()
    if lines is None:
        if buf.data and buf.data[0] < 0x21:
            raise LocalProtocolError("illegal request line")
        return None
    if not lines:
        raise LocalProtocolError("no request line received")
    m = _REQUEST_LINE.fullmatch(lines[0])
    if m is None:
        raise LocalProtocolError("illegal request line")
    fields = fields_of(_field_lines(lines[1:]))
    version = m.group(3)
    _host_rule(fields, version)
    return Request(m.group(1), m.group(2), fields, version)


class ContentLengthReader:
    __slots__ = ("remaining", "length")

    def __init__(self, length: int) -> None:
        self.length = length
        self.remaining = length

    def __call__(self, buf: Buffer) -> Data | EndOfMessage | None:
        if self.remaining == 0:
            return EndOfMessage()
        data = buf.take_at_most(self.remaining)
        if data is None:
            return None
        self.remaining -= len(data)
        return Data(data)

    def read_eof(self) -> Any:
        raise RemoteProtocolError(f"peer closed connection without sending complete message body: received {self.length - self.remaining} bytes, expected {self.length}")


class ChunkedReader:
    __slots__ = ("_in_chunk", "_discard", "_trailer")

    def __init__(self) -> None:
        self._in_chunk = 0
        self._discard = b""  # the CRLF after a chunk's data still to take
        self._trailer = False

    def __call__(self, buf: Buffer) -> Data | EndOfMessage | None:
        if self._trailer:
            lines = buf.take_lines()
            if lines is None:
                return None
            return EndOfMessage(fields_of(_field_lines(lines), validate=True))
        if self._discard:
            data = buf.take_at_most(len(self._discard))
            if data is None:
                return None
            if data != self._discard[: len(data)]:
                raise LocalProtocolError("malformed chunk footer")
            self._discard = self._discard[len(data) :]
            if self._discard:
                return None
        if self._in_chunk == 0:
            line = buf.take_line()
            if line is None:
                return None
            m = _CHUNK_HEADER.fullmatch(line)
            if m is None:
                raise LocalProtocolError("illegal chunk header")
            self._in_chunk = int(m.group(1), 16)
            if self._in_chunk == 0:
                self._trailer = True
                return self(buf)
            start = True
        else:
            start = False
        data = buf.take_at_most(self._in_chunk)
        if data is None:
            return None
        self._in_chunk -= len(data)
        end = self._in_chunk == 0
        if end:
            self._discard = b"\r\n"
        return Data(data, start, end)

    def read_eof(self) -> Any:
        raise RemoteProtocolError("peer closed connection without sending complete message body (incomplete chunked read)")


class Http10Reader:
    """A body delimited by the connection's close (never a request's: table completeness)."""

    __slots__ = ()

    def __call__(self, buf: Buffer) -> Data | None:
        data = buf.take_at_most(len(buf.data))
        return None if data is None else Data(data)

    def read_eof(self) -> EndOfMessage:
        return EndOfMessage()


def body_framing(method: bytes | None, kind: str, status: int, fields: Fields) -> tuple[str, int]:
    """How a message's body is framed: ("content-length", n), ("chunked", 0) or
    ("http/1.0", 0: until close). `kind` "request" or "response" (to `method`)."""
    if kind == "response" and (status in (204, 304) or method == b"HEAD" or (method == b"CONNECT" and 200 <= status < 300)):
        return "content-length", 0
    if comma_values(fields, b"transfer-encoding"):
        return "chunked", 0
    lengths = comma_values(fields, b"content-length")
    if lengths:
        return "content-length", int(lengths[0])
    return ("content-length", 0) if kind == "request" else ("http/1.0", 0)
