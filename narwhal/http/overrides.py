"""What the server uses of hypercorn and h2, and why -- the one list (tests/http/test_pins.py
holds the code to it and the installed versions to the checked ranges).

HTTP/1.1 is Narwhal's own (narwhal/http/h1/); h11 is only its test oracle. HTTP/2 is served
over h2's public API (narwhal/http/h2conn.py). Nothing imports a private name of h11,
hypercorn or h2, writes their private attributes, swaps a class on a live object or
replaces a module global of theirs.

hypercorn (public modules, public names):
  * hypercorn.config.Config: the server's settings (bind, TLS, keep-alive, graceful
    timeout, h2 limits, logging). `hyper.ServerConfig` subclasses it and overrides the
    public `response_headers(protocol)` to compute the Date header once per second.
  * hypercorn.asyncio.lifespan.Lifespan: the ASGI lifespan protocol (startup, shutdown).
  * hypercorn.asyncio.worker_context.WorkerContext: the stop signal and request counting;
    `conn.LeanContext` subclasses it, setting its public class attribute `event_class`
    to lean.LeanEvent (memory per connection).
  * hypercorn.asyncio.statsd.StatsdLogger, hypercorn.utils (parse_socket_addr,
    repr_socket_addr, raise_shutdown, ShutdownError), hypercorn.typing.ConnectionState,
    hypercorn.events (RawData, Closed, Updated: the currency between conn.py and the
    protocols): what conn.serve needs of hypercorn's serving loop.
h2 (public API):
  * H2Connection, H2Configuration, Settings, events, errors, exceptions: the whole HTTP/2
    state machine, framing and HPACK.
  * One override, `h2conn._Connection.open_inbound_streams` (a public property): it
    answers 0 so that h2 never raises TooManyStreamsError for a stream past
    SETTINGS_MAX_CONCURRENT_STREAMS -- raised before the headers are decoded, it leaves
    HPACK out of step and the whole connection lost. H2Server refuses such a stream
    itself (RST_STREAM REFUSED_STREAM) once h2 has decoded it (RFC 9113 5.1.2).

CHECKED: the version ranges these were checked against; pyproject.toml pins the same.
Upgrading one: widen its range here and in pyproject.toml, install it, run the tests.
"""

from __future__ import annotations

__all__ = ["CHECKED", "outside"]

CHECKED: dict[str, str] = {
    "hypercorn": ">=0.18,<0.19",
    "h2": ">=4.4,<4.5",
    "h11": ">=0.16,<0.17",  # the test oracle of narwhal/http/h1 (and hypercorn's own dependency)
}


def outside() -> dict[str, str]:
    """The checked packages whose installed version is outside its range: name -> version."""
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    out = {}
    for name, spec in CHECKED.items():
        v = version(name)
        if v not in SpecifierSet(spec):
            out[name] = v
    return out
