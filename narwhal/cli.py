"""The `narwhal` command (NARWHAL.md "Commands")."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

__all__ = ["main"]


def _serve(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_config
    from .http.server import serve

    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"narwhal: {e}", file=sys.stderr)
        return 2
    listen = args.listen or cfg.serving.listen
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    scheme = "https" if cfg.serving.tls.certfile else "http"
    fleet = "the embedded simulated fleet" if cfg.engines is None else f"{len(cfg.engines)} configured engines"
    print(f"narwhal: serving model {cfg.serving.model!r} on {scheme}://{listen} (HTTP/1.1 and HTTP/2) in front of {fleet}", flush=True)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(cfg, listen=listen))
    except KeyboardInterrupt:
        pass
    return 0


def _spec(args: argparse.Namespace) -> int:
    from .specgen import SpecError, check, find_root, generate

    try:
        root = Path(args.root).resolve() if args.root else find_root()
        if args.action == "generate":
            files = generate(root)
            print(f"narwhal spec generate: wrote {len(files)} files under {root / 'generated'}")
            return 0
        problems = check(root)
    except (SpecError, RuntimeError) as e:
        print(f"narwhal spec {args.action}: {e}", file=sys.stderr)
        return 2
    if problems:
        print("narwhal spec check: generated/ is not what spec/ generates:", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        print("run `narwhal spec generate` and commit the result (never edit generated/ by hand)", file=sys.stderr)
        return 1
    print("narwhal spec check: generated/ is up to date")
    return 0


def _mock(args: argparse.Namespace) -> int:
    from .mock.cli import run

    return run(args)


def _conformance(args: argparse.Namespace) -> int:
    from narwhal_conformance.cli import run

    return run(args)


def _probe(args: argparse.Namespace) -> int:
    from narwhal_conformance.probe import run

    return run(args)


def _bench(args: argparse.Namespace) -> int:
    from .bench.cli import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="narwhal", description="A reference router for OpenAI-compatible LLM inference engines.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the router (no config: the embedded default)")
    s.add_argument("--config", help="YAML configuration file (keys: NARWHAL.md 'Configuration')")
    s.add_argument("--listen", help="HOST:PORT, overrides serving.listen")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=_serve)

    g = sub.add_parser("spec", help="regenerate generated/ from spec/, or check it is up to date")
    g.add_argument("action", choices=["generate", "check"])
    g.add_argument("--root", help="repository root (default: found from the current directory)")
    g.set_defaults(func=_spec)

    m = sub.add_parser("mock-engine", help="a simulated engine (vllm, sglang, openai dialects)")
    try:
        from .mock.cli import add_arguments as mock_args

        mock_args(m)
    except ImportError:  # pragma: no cover - the mock package is part of the distribution
        pass
    m.set_defaults(func=_mock)

    c = sub.add_parser("conformance", help="run the router conformance suite against a router URL")
    try:
        from narwhal_conformance.cli import add_arguments as conf_args

        conf_args(c)
    except ImportError:
        pass
    c.set_defaults(func=_conformance)

    pe = sub.add_parser("probe-engine", help="check an engine's compatibility with Narwhal")
    try:
        from narwhal_conformance.probe import add_arguments as probe_args

        probe_args(pe)
    except ImportError:
        pass
    pe.set_defaults(func=_probe)

    b = sub.add_parser("bench", help="load generator and experiments")
    try:
        from .bench.cli import add_arguments as bench_args

        bench_args(b)
    except ImportError:
        pass
    b.set_defaults(func=_bench)

    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
