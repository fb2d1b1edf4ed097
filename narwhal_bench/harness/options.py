"""A bench's command-line options as a table: each row one `add_argument` call, the rows
a bench shares with others built once here.

Rules
  * `opt(flag, **kw)` is one row: `parser.add_argument(flag, **kw)`; `add(parser, rows)`
    adds them in order (the order `--help` lists them in).
  * A shared row is a function of what differs between benches (a default, the name of
    the files written), so that two benches with the same flag say the same thing about
    it; a flag whose meaning differs per bench stays in that bench's own table.
  * `main(...)` is the `python -m narwhal_bench.<bench>` entry every bench module ends
    with: a parser of its own, the bench's table, the bench's `run`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["Opt", "opt", "add", "adder", "main", "fill_defaults", "names", "floats", "ints", "drain", "out", "from_json", "quick", "ROUTERS", "SERVERS", "WORKERS", "SAVE"]

Opt = tuple[str, dict[str, Any]]


def opt(flag: str, **kw: Any) -> Opt:
    """One row: the flag and add_argument's keyword arguments."""
    return flag, kw


def add(p: argparse.ArgumentParser, rows: Iterable[Opt]) -> None:
    for flag, kw in rows:
        p.add_argument(flag, **kw)


def adder(*tables: Sequence[Opt]) -> Callable[[argparse.ArgumentParser], None]:
    """A bench's add_arguments: its tables' rows, in order."""

    def add_arguments(p: argparse.ArgumentParser) -> None:
        for rows in tables:
            add(p, rows)

    return add_arguments


def main(prog: str, description: str | None, rows: Callable[[argparse.ArgumentParser], None], run: Callable[[argparse.Namespace], int],
         argv: Sequence[str] | None = None) -> int:
    """`python -m PROG`: parse argv (default sys.argv[1:]) with the bench's options, run it."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    rows(p)
    return run(p.parse_args(sys.argv[1:] if argv is None else list(argv)))


def fill_defaults(args: argparse.Namespace, rows: Iterable[tuple[str, Any, Any]]) -> None:
    """Each (dest, full run's default, --quick's default) left unset (None) on the command
    line gets the default of the kind of run asked for."""
    q = bool(getattr(args, "quick", False))
    for k, full, quick_ in rows:
        if getattr(args, k, None) is None:
            setattr(args, k, quick_ if q else full)


def names(s: str) -> list[str]:
    """A comma-separated list of names, blanks dropped."""
    return [x.strip() for x in s.split(",") if x.strip()]


def floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


# -- rows more than one bench has ----------------------------------------------------------------


def drain(default: float) -> Opt:
    return opt("--drain", type=float, default=default, help=f"wait at most this long for open requests after the last arrival (default {default:g})")


def out(name: str, folder: str | None = None) -> Opt:
    """--out of a bench writing NAME.md and NAME.json (into out/bench/NAME unless told)."""
    folder = folder or f"out/bench/{name}"
    return opt("--out", default=folder, help=f"save {name}.md and {name}.json here (default {folder}; '' to skip)")


def from_json(name: str) -> Opt:
    return opt("--from-json", default=None, help=f"print the tables of a saved {name}.json again (no run)")


def quick(what: str) -> Opt:
    return opt("--quick", action="store_true", help=f"a short run ({what}): a smoke test")


_ROUTERS_HELP = ("routers through the same harness, comma-separated (default narwhal): narwhal (once per --servers), narwhal-granian, smg, "
                 "vllm-router, envoy, litellm, xpyd-proxy")
ROUTERS = opt("--routers", default="narwhal", help=_ROUTERS_HELP)
SERVERS = opt("--servers", default="hypercorn", help="Narwhal's ASGI servers: hypercorn, granian (comma-separated)")
WORKERS = opt("--workers", type=int, default=1, help="Narwhal's serving.workers (default 1)")
SAVE = opt("--out", default="out/bench", help="save Markdown + JSON here (default out/bench; '' to skip)")
