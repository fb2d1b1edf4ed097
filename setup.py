"""The one build step pyproject.toml cannot state: the relay's C step (issue 25).

`narwhal.core._fastevent` is optional: where no C compiler is found the build goes on
without it and the router relays every event in Python (core/relay.py, the reference),
as `narwhal.core.fastevent.NATIVE` then says.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "narwhal.core._fastevent",
            ["narwhal/core/_fastevent.c"],
            optional=True,
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
)
