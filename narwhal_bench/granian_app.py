"""Narwhal as an ASGI app factory, for ASGI servers other than hypercorn (granian).

    NARWHAL_CONFIG=router.yaml granian --interface asgi --factory \
        narwhal_bench.granian_app:app --host 127.0.0.1 --port 8000 --http auto

Rules
  * The config file named by $NARWHAL_CONFIG must list its engines (the embedded
    simulated fleet is served by `narwhal serve` only).
  * The app's lifespan starts and stops the router's background tasks (health polling,
    profiling), as under hypercorn; the server must run the ASGI lifespan (granian does).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["app"]


def app() -> Any:
    from narwhal.compose import build_router, config_engines
    from narwhal.config import load_config
    from narwhal.http.server import settle_heap

    path = os.environ.get("NARWHAL_CONFIG")
    if not path:
        raise SystemExit("narwhal_bench.granian_app: set NARWHAL_CONFIG to a config file with engines")
    cfg = load_config(path)
    if cfg.engines is None:
        raise SystemExit("narwhal_bench.granian_app: the config must list its engines")
    app = build_router(cfg, config_engines(cfg)).app()
    settle_heap()
    return app
