"""The common HTTP/1.1 request head read the short way, sans-IO.

Reading a head line by line (a regex and a match per field line, then the field rules
again) costs ~20 us warm. `parse_head` reads the common head -- a whole head in the
buffer, within HEAD_MAX bytes, `POST` or `GET`, HTTP/1.1, plain field lines -- with one
scan, and returns the same `Request` the general reader (parse.read_head's grammar) makes
of those bytes, and how many bytes it took; or None for anything else, which the general
reader then reads (its errors and its limits included). Invariant, tested against h11 as
the oracle (tests/http/test_h1head.py): whenever `parse_head` answers, h11's reader on the
same buffer answers the same request and takes the same bytes.

What it leaves to the general reader (None): a head not yet whole, or past HEAD_MAX; any other method or
version; a blank line before the request line; a bare LF; obs-fold; a header byte h11
takes that this grammar does not (controls, DEL); Transfer-Encoding; a Content-Length that
is not 1-20 digits, or given twice; a head `Request` would refuse (no Host, two of them).

The scan is `scan` in Python, the reference, and `narwhal.http._fasthead.head` in C (the
same answers, ~5x faster), which `parse_head` uses where `pip install` built it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from .events import Request

__all__ = ["HEAD_MAX", "SCAN", "parse_head", "request_of", "scan"]

HEAD_MAX = 16384  # bytes of head read the short way; a longer one is h11's to read

# RFC 9110 field lines as the general reader reads them (token ":" OWS field-content OWS), every byte of a
# value visible ASCII or obs-text -- a subset of h11's field_vchar, which takes controls
_FIELDS = re.compile(rb"(?:[-!#$%&'*+.^_`|~0-9A-Za-z]+:[ \t]*(?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?[ \t]*\r\n)+")
_TARGET = re.compile(rb"[\x21-\x7e]+")  # request-target: visible ASCII
_METHODS = frozenset((b"POST", b"GET"))
_CL_DIGITS = 20  # parse.CL_DIGITS


Fields = list[tuple[bytes, bytes, bytes]]  # (name as sent, lower-case name, value), as h11's Headers keeps them


def scan(data: bytes | bytearray, head_max: int = HEAD_MAX) -> tuple[bytes, bytes, Fields, int] | None:
    """The reference scan: (method, target, fields, the head's length with its blank line)
    of a common head at the start of `data`, or None (see the module's docstring).
    `_fasthead.head` is the same in C (tests/http/test_h1head.py runs both)."""
    end = data.find(b"\r\n\r\n", 0, head_max)
    if end < 0:
        return None
    head = bytes(data[: end + 4])
    if b"\n" in head.replace(b"\r\n", b""):  # a bare LF: the general reader takes it as a line's end
        return None
    line_end = head.find(b"\r\n")
    method, _, rest = head[:line_end].partition(b" ")
    target, _, version = rest.partition(b" ")
    if version != b"HTTP/1.1" or method not in _METHODS or _TARGET.fullmatch(target) is None:
        return None
    block = head[line_end + 2 : end + 2]  # the field lines, each with its CRLF
    if _FIELDS.fullmatch(block) is None:
        return None
    fields = []
    length = None
    for line in block[:-2].split(b"\r\n"):
        name, _, value = line.partition(b":")
        value = value.strip(b" \t")
        lower = name.lower()
        if lower == b"content-length":
            if length is not None or not value.isdigit() or len(value) > _CL_DIGITS:
                return None
            length = value
        elif lower == b"transfer-encoding":
            return None
        fields.append((name, lower, value))
    return method, target, fields, end + 4


try:  # the same scan in C, built by `pip install` where a compiler is (else the reference)
    from .._fasthead import head as _compiled
except ImportError:
    _compiled = None
SCAN: Callable[[bytes | bytearray, int], tuple[bytes, bytes, Fields, int] | None] = _compiled or scan


def parse_head(data: bytes | bytearray) -> tuple[Request, int] | None:
    """The request whose head starts `data`, and the head's length with its blank line;
    None: the general reader reads it (see the module's docstring)."""
    return request_of(SCAN(data, HEAD_MAX))


def request_of(got: tuple[bytes, bytes, Fields, int] | None) -> tuple[Request, int] | None:
    """A scan's answer as parse_head gives it: the Request, or None for a head the field
    rules refuse (no Host, or two): the general reader reads it and says so."""
    if got is None:
        return None
    method, target, fields, n = got
    hosts = 0
    for f in fields:
        if f[1] == b"host":
            hosts += 1
    if hosts != 1:
        return None
    return Request(method, target, fields, b"1.1"), n
