"""The one build step pyproject.toml cannot state: the C steps of issue 25.

Both are optional: where no C compiler is found the build goes on without them.
`narwhal.core._fastevent` (the relay's common event): the router relays every event in
Python (core/relay.py, the reference), and `narwhal.core.fastevent.event` is None.
`narwhal.http._fasthead` (a common request head's scan): narwhal/http/h1/head.py's `scan`
reads every head, and `head.SCAN is head.scan`.
"""

from setuptools import Extension, setup

_OPTIONAL_C = {"optional": True, "extra_compile_args": ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]}

setup(
    ext_modules=[
        Extension("narwhal.core._fastevent", ["narwhal/core/_fastevent.c"], **_OPTIONAL_C),
        Extension("narwhal.http._fasthead", ["narwhal/http/_fasthead.c"], **_OPTIONAL_C),
    ]
)
