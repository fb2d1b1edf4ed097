"""The `narwhal` command (docs/contract.md "Commands")."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from pathlib import Path

__all__ = ["main"]


def _serve(args: argparse.Namespace) -> int:
    from .compose import serve
    from .config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"narwhal: {e}", file=sys.stderr)
        return 2
    listen = args.listen or cfg.serving.listen
    if args.workers is not None:  # overrides serving.workers
        w = args.workers
        if w != "auto" and not (w.isdigit() and 1 <= int(w) <= 256):
            print(f"narwhal: --workers must be a number from 1 to 256 or auto, not {w!r}", file=sys.stderr)
            return 2
        from narwhal_generated.models.config import Workers

        value = "auto" if w == "auto" else Workers(int(w))
        cfg = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"workers": value})})
    if args.log_format is not None:  # overrides serving.log_format
        cfg = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"log_format": args.log_format})})
    from .telemetry.logs import announce, configure

    configure(cfg.serving.log_format, args.log_level)
    scheme = "https" if cfg.serving.tls.certfile else "http"
    fleet = "the embedded simulated fleet" if cfg.engines is None else f"{len(cfg.engines)} configured engines"
    announce(cfg.serving.log_format, f"narwhal: serving model {cfg.serving.model!r} on {scheme}://{listen} (HTTP/1.1 and HTTP/2) in front of {fleet}",
             "serving", model=cfg.serving.model, listen=f"{scheme}://{listen}", engines=None if cfg.engines is None else len(cfg.engines))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(cfg, listen=listen, config_path=args.config))
    except KeyboardInterrupt:
        pass
    except ConfigError as e:  # found while starting (a password variable not set, a file unreadable)
        print(f"narwhal: {e}", file=sys.stderr)
        return 2
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


_SUBCOMMANDS = {
    "mock-engine": ("narwhal.mock.cli", "a simulated engine (vllm, sglang, openai dialects)"),
    "conformance": ("narwhal_conformance.cli", "run the router conformance suite against a router URL"),
    "probe-engine": ("narwhal_conformance.probe", "check an engine's compatibility with Narwhal"),
    "bench": ("narwhal_bench.cli", "load generator and experiments"),
    "gateway": ("narwhal.gateway.cli", "Narwhal as an Envoy gateway's endpoint picker: envoy-config prints the reference bootstrap"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="narwhal", description="A reference router for OpenAI-compatible LLM inference engines.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the router (no config: the embedded default)")
    s.add_argument("--config", help="YAML configuration file (keys: generated/CONFIG.md)")
    s.add_argument("--listen", help="HOST:PORT, overrides serving.listen")
    s.add_argument("--workers", help="N or auto: data-plane worker processes (overrides serving.workers)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--log-format", choices=["text", "json"], help="text or json (one JSON object per line; docs/observability.md): overrides serving.log_format")
    s.set_defaults(func=_serve)

    g = sub.add_parser("spec", help="regenerate generated/ from spec/, or check it is up to date")
    g.add_argument("action", choices=["generate", "check"])
    g.add_argument("--root", help="repository root (default: found from the current directory)")
    g.set_defaults(func=_spec)

    # The other subcommands live in their own modules, imported only when chosen (so
    # `narwhal serve` does not pay for the conformance suite or the load generator).
    chosen = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    for name, (module, help_) in _SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_)
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(sp)
            sp.set_defaults(func=mod.run)

    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
