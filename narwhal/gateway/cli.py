"""`narwhal gateway envoy-config`: the reference Envoy bootstrap for Narwhal as endpoint
picker, printed (YAML; `--format json` for JSON). Check it with the real Envoy:
`envoy --mode validate -c FILE`."""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from .envoy import bootstrap, host_port

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    e = sub.add_parser("envoy-config", help="print a bootstrap for Envoy 1.40 with Narwhal as its endpoint picker")
    e.add_argument("--epp", required=True, help="HOST:PORT of the picker (Narwhal's gateway.listen)")
    e.add_argument("--listen", required=True, help="HOST:PORT Envoy listens on for clients")
    e.add_argument("--failure-mode-allow", action="store_true",
                   help="FailOpen: when the picker is down, requests go round robin to the --pool endpoints (default FailClose: 500/503 from Envoy)")
    e.add_argument("--pool", action="append", default=[], metavar="IP:PORT",
                   help="an engine's IP:PORT, as Narwhal names it (repeat for each engine): the endpoints the picker may name, "
                        "tried in the picker's order (override-host). Without it: an ORIGINAL_DST cluster on the picker's header, "
                        "one endpoint (set gateway.max_fallbacks: 0)")
    e.add_argument("--max-fallbacks", type=int, default=None,
                   help="retries of a connect failure on the picker's next endpoint (default 2 with --pool: Narwhal's "
                        "gateway.max_fallbacks; 0 without)")
    e.add_argument("--message-timeout-s", type=int, default=1000, help="ext_proc message_timeout in seconds (default 1000, the protocol's reference)")
    e.add_argument("--health-interval-ms", type=int, default=1000, help="how often Envoy checks the picker's gRPC health (default 1000)")
    e.add_argument("--admin", metavar="HOST:PORT", help="Envoy's admin listener (off by default)")
    e.add_argument("--format", choices=["yaml", "json"], default="yaml")


def run(args: argparse.Namespace) -> int:
    try:
        for v in (args.epp, args.listen, *args.pool, *([args.admin] if args.admin else [])):
            host_port(v)
        if not 1 <= args.message_timeout_s <= 3600 or not 10 <= args.health_interval_ms <= 60000:
            raise ValueError("--message-timeout-s takes 1..3600, --health-interval-ms 10..60000")
        cfg = bootstrap(epp=args.epp, listen=args.listen, failure_mode_allow=args.failure_mode_allow, pool=tuple(args.pool),
                        message_timeout_s=args.message_timeout_s, health_interval_ms=args.health_interval_ms, admin=args.admin,
                        max_fallbacks=args.max_fallbacks)
    except ValueError as e:
        print(f"narwhal gateway envoy-config: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps(cfg, indent=2) + "\n" if args.format == "json" else yaml.safe_dump(cfg, sort_keys=False))
    return 0
