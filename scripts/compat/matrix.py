"""The compatibility matrix: the conformance suite against Narwhal and real peer routers,
on every profile each can serve, written to docs/compatibility.md with the raw JUnit
files beside it.

    python scripts/compat/matrix.py                      # every router, every profile it serves
    python scripts/compat/matrix.py --routers vllm-router --profiles unified
    python scripts/compat/matrix.py --no-install         # peers already in .venvs/peers

Each run: a free port base, the profile's mock fleet in this process, the router started
from `narwhal conformance print-config`'s limits translated into its own flags
(scripts/compat/peers.py), then `narwhal conformance run` against it (HTTP/1.1, a JUnit
file per run). Peers are installed (pinned) into throwaway venvs by
scripts/peers/install.sh. Loopback only; every process is stopped by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree as ET

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

import peers  # noqa: E402  (scripts/compat/peers.py)

from narwhal_conformance import SUITE_VERSION  # noqa: E402
from narwhal_conformance.fleet import running_fleet  # noqa: E402
from narwhal_conformance.profiles import RUN_KEY, get_profile, keys_file_entries, router_config  # noqa: E402

NARWHAL = "narwhal"
_TABLES = ("refusals", "failures", "assembly", "token_identity", "router_states", "accounting")
_ADMIN_TOKEN = "compat-matrix-token"

# Interoperability cases a router fails only because a limit of the profile has no flag
# of that router (the case's premise cannot be set up): listed apart, not as defects.
LIMITS: dict[tuple[str, str], str] = {
    **{(r, c): "no idle timeout: --request-timeout-secs bounds the whole request (10 s here), so the 3 s stall is waited out"
       for r in ("vllm-router", "vllm-router-pd") for c in ("failures/E07/1", "failures/E07/2")},
    ("litellm", "failures/E07/2"): "a non-streaming request's timeout is for the whole request (10 s here; the engine is silent until done), so the 3 s stall is waited out",
    ("litellm", "refusals/R03/1"): "no request-size limit in the open-source proxy (general_settings.max_request_size_mb is enterprise-only)",
    ("xpyd-proxy", "refusals/R03/1"): "no request-size limit",
    **{("xpyd-proxy", c): "no upstream timeout at all" for c in ("failures/E07/1", "failures/E07/2")},
}

# What one reading of a run's output adds (checked by hand in the raw files).
NOTES: dict[tuple[str, str], str] = {
    ("xpyd-proxy", "reference"): "failures/E04/1 and E04/2 get the engine's HTTP 500 relayed as 200 with an empty body (its log: "
    "'Caught handled exception, but response already started'); from failures/E04/3 on, every request that reaches an engine is "
    "answered 503 'No available instance can handle the request' for the rest of the run (its circuit breaker, opened by those "
    "engine errors, does not close again). One defect with many symptoms: the failures after E04/2 are that cascade.",
    ("vllm-router-pd", "reference"): "In P/D mode it rewrites x-request-id (`___prefill_addr_…___decode_addr_…`), which becomes the answer's id; "
    "the suite follows requests by the body's mock.rid, so this costs it nothing.",
    ("litellm", "unified"): "It needs `Authorization: Bearer KEY` (given with --header) and does not forward x-request-id; its /health sends a "
    "completion to every engine, so the run's ready URL is /health/readiness.",
}


@dataclass
class Run:
    router: str
    profile: str
    junit: Path
    seconds: float
    rc: int
    flags_note: str
    props: dict[str, str] = field(default_factory=dict)
    cases: list[dict[str, str]] = field(default_factory=list)  # id, table, class, verdict, evidence


def _free_base() -> int:
    import random
    import socket

    for _ in range(200):
        base = random.randrange(30000, 60000, 50)
        ok = True
        for port in range(base, base + 40):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port base")


@contextlib.contextmanager
def _narwhal(profile: str, base: int, log: Path) -> Iterator[peers.PeerRun]:
    prof = get_profile(profile)
    listen = prof.listen(base)
    cfg = Path(tempfile.mkstemp(suffix=".yaml")[1])
    keys = Path(tempfile.mkstemp(suffix=".yaml")[1])  # Narwhal as it runs: keys and tenants, stream migration on
    keys.write_text(yaml.safe_dump(keys_file_entries(), sort_keys=False))
    cfg.write_text(yaml.safe_dump(router_config(prof, base, keys_file=str(keys), migration=True), sort_keys=False))
    env = {**os.environ, "NARWHAL_ADMIN_TOKEN": _ADMIN_TOKEN}
    with log.open("wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "narwhal.cli", "serve", "--config", str(cfg), "--log-level", "warning"], stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        yield peers.PeerRun(NARWHAL, profile, f"http://{listen}", (f"Authorization: Bearer {RUN_KEY}",), None,
                            "narwhal serve --config <print-config --capability tenants --capability migration>")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        cfg.unlink(missing_ok=True)
        keys.unlink(missing_ok=True)


def _one(router: str, profile: str, raw: Path, timeout_s: float) -> Run:
    base = _free_base()
    junit = raw / f"{router}-{profile}.xml"
    log = raw / f"{router}-{profile}.log"
    started = _narwhal(profile, base, log) if router == NARWHAL else peers.running_peer(router, profile, base, log)
    with running_fleet([get_profile(profile)], base), started as pr:
        t0 = time.monotonic()  # the suite's own time, the router's start-up left out
        argv = [sys.executable, "-m", "narwhal.cli", "conformance", "run", "--profile", profile, "--port-base", str(base), "--target", pr.target,
                "--junit", str(junit), "--ready-timeout", "60"]
        for h in pr.headers:
            argv += ["--header", h]
        if pr.ready_url:
            argv += ["--ready-url", pr.ready_url]
        if router == NARWHAL:
            argv += ["--admin-token", _ADMIN_TOKEN]
        with (raw / f"{router}-{profile}.out").open("w") as out:
            try:
                rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False).returncode
            except subprocess.TimeoutExpired:
                rc = -1
        seconds = time.monotonic() - t0
    run = Run(router, profile, junit, seconds, rc, pr.flags_note)
    if junit.exists():
        _read_junit(run)
    return run


def _read_junit(run: Run) -> None:
    root = ET.parse(run.junit).getroot()
    for suite in root.findall("testsuite"):
        table = suite.get("name", "").split(" [")[0]
        if not run.props:
            run.props = {p.get("name", ""): p.get("value", "") for p in suite.find("properties") or ()}
        if table == "books":
            continue
        for tc in suite.findall("testcase"):
            props = {p.get("name", ""): p.get("value", "") for p in tc.iter("property")}
            fail = tc.find("failure")
            evidence = ""
            if fail is not None and fail.text:
                lines = [ln.strip() for ln in fail.text.splitlines()]
                idx = next((i for i, ln in enumerate(lines) if ln.startswith("- ")), None)
                if idx is not None:
                    exp = next((ln for ln in lines[idx:] if ln.startswith("Expected:")), "")
                    act = next((ln for ln in lines[idx:] if ln.startswith("Actual:")), "")
                    evidence = f"{lines[idx][2:]}: {exp} {act}".strip()
            run.cases.append({"id": tc.get("name", "").split(" [")[0], "table": table, "class": props.get("class", ""),
                              "verdict": props.get("verdict", ""), "evidence": evidence, "title": ""})


def _cell(run: Run, table: str) -> str:
    cs = [c for c in run.cases if c["table"] == table]
    if not cs:
        return "—"
    p = sum(1 for c in cs if c["verdict"] in ("PASS", "INFO"))
    f = sum(1 for c in cs if c["verdict"] in ("FAIL", "NON-STRICT"))
    na = sum(1 for c in cs if c["verdict"] == "N/A")
    return f"{p} / {f} / {na}"


def _titles() -> dict[str, str]:
    from narwhal_conformance.cases import load_cases

    return {c.id: c.title for c in load_cases()}


def write_doc(runs: list[Run], out: Path, raw: Path, argv: list[str]) -> None:
    titles = _titles()
    rel = os.path.relpath(raw, out.parent)
    lines = [
        "# Compatibility matrix",
        "",
        f"The Narwhal conformance suite {SUITE_VERSION} against Narwhal and two real peer routers, on every profile each can",
        "serve, over HTTP/1.1, in front of the suite's scripted mock engines. Reproduce (installs the pinned peers into",
        "throwaway venvs under `.venvs/peers/`, then runs every pair; loopback only):",
        "",
        "    python scripts/compat/matrix.py " + " ".join(argv),
        "",
        f"Raw JUnit files and console output (router logs stay local, git-ignored): [`{rel}/`]({rel}/). Measured {time.strftime('%Y-%m-%d')} on the project's",
        "machine kind (2 cores). Peers: vllm-router 0.1.17, LiteLLM 1.108.7 (`litellm[proxy]`).",
        "",
        "How to read it: **interoperability** is what any OpenAI-compatible router owes its clients (error envelopes and",
        "status codes, `Retry-After` on 429/503, streams that end with an error event and `[DONE]`, the engine's own",
        "answer shape, no token-ID leak, no 500); **Narwhal profile** is Narwhal's own policy and API, which a peer is not",
        "expected to have. Scores are passed / decided; N/A cases need a capability the router lacks (its reason is in",
        "the JUnit file). `books` is the accounting check (Narwhal's `/metrics` counters).",
        "",
        "## Scores",
        "",
        "| router | profile | interoperability | Narwhal profile | N/A | books | capabilities detected | suite time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        p = r.props
        caps = p.get("capabilities", "") or "none"
        if r.rc == -1 or not r.cases:
            lines.append(f"| {r.router} | {r.profile} | did not run (rc {r.rc}; see `{r.router}-{r.profile}.out`) | | | | | {r.seconds:.0f} s |")
            continue
        lines.append(f"| {r.router} | {r.profile} | {p.get('score_interoperability', '?')} | {p.get('score_narwhal', '?')} | {p.get('na', '?')} | "
                     f"{p.get('score_books', '?')} | {caps.replace(',', ', ')} | {r.seconds:.0f} s |")
    lines += ["", "## By table (pass / fail / N/A)", "", "| router | profile | " + " | ".join(_TABLES) + " |", "|---|---|" + "---|" * len(_TABLES)]
    for r in runs:
        if r.cases:
            lines.append(f"| {r.router} | {r.profile} | " + " | ".join(_cell(r, t) for t in _TABLES) + " |")
    lines += ["", "## How each router was set up", ""]
    for r in runs:
        lines.append(f"* **{r.router}**, profile `{r.profile}`: {r.flags_note}")
    lines += ["", "## Interoperability defects found", "",
              "Every interoperability case a router failed, with the first unmet check: differences a client of that router sees.",
              "Each line names the case (`conformance/cases/`) and the evidence; the raw JUnit file has every check. Cases whose",
              "premise the router cannot be set up for (a limit it has no flag for) are listed apart, after the defects.", ""]
    for r in runs:
        bad = [c for c in r.cases if c["class"] == "interoperability" and c["verdict"] in ("FAIL", "NON-STRICT")]
        defects = [c for c in bad if (r.router, c["id"]) not in LIMITS]
        limited = [c for c in bad if (r.router, c["id"]) in LIMITS]
        if not r.cases:
            continue
        lines.append(f"### {r.router} — {r.profile} ({len(defects)} defects" + (f", {len(limited)} not expressible" if limited else "") + ")")
        lines.append("")
        if (r.router, r.profile) in NOTES:
            lines += [f"> {NOTES[(r.router, r.profile)]}", ""]
        for c in defects:
            lines.append(f"* `{c['id']}` {titles.get(c['id'], '')} — {c['evidence'] or 'see the JUnit file'}")
        if not defects:
            lines.append("* none")
        for c in limited:
            lines.append(f"* not expressible: `{c['id']}` — {LIMITS[(r.router, c['id'])]}")
        lines.append("")
    lines += ["## Narwhal-profile differences", "",
              "Cases of Narwhal's own policy a router decided differently (not defects of an OpenAI-compatible router):", ""]
    for r in runs:
        bad = [c["id"] for c in r.cases if c["class"] == "narwhal" and c["verdict"] in ("FAIL", "NON-STRICT")]
        if r.cases and bad:
            lines.append(f"* **{r.router}** ({r.profile}, {len(bad)}): " + ", ".join(f"`{b}`" for b in bad))
    out.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routers", nargs="+", default=[NARWHAL, *peers.PEERS], help=f"routers (default: {NARWHAL} {' '.join(peers.PEERS)})")
    ap.add_argument("--profiles", nargs="+", default=["unified", "reference", "sglang", "openai"], help="profiles to run where a router serves them")
    ap.add_argument("--out", default=str(REPO / "docs" / "compatibility.md"))
    ap.add_argument("--raw", default=str(REPO / "docs" / "compatibility"))
    ap.add_argument("--no-install", action="store_true", help="do not run scripts/peers/install.sh")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run (default 900)")
    args = ap.parse_args()
    raw = Path(args.raw)
    shutil.rmtree(raw, ignore_errors=True)
    raw.mkdir(parents=True)
    wanted = [r for r in args.routers if r != NARWHAL]
    if wanted and not args.no_install:
        pkgs = sorted({peers.PEERS[r].package for r in wanted})
        subprocess.run(["bash", str(REPO / "scripts" / "peers" / "install.sh"), *pkgs], check=True)
    runs = []
    for router in args.routers:
        serves = get_profile_names() if router == NARWHAL else peers.profiles_for(router)
        for profile in [p for p in args.profiles if p in serves]:
            print(f"[matrix] {router} on {profile} ...", flush=True)
            r = _one(router, profile, raw, args.timeout)
            print(f"[matrix] {router} on {profile}: rc {r.rc}, {r.seconds:.0f} s, interop {r.props.get('score_interoperability')}, "
                  f"narwhal {r.props.get('score_narwhal')}, N/A {r.props.get('na')}", flush=True)
            runs.append(r)
    argv = [a for a in sys.argv[1:]]
    write_doc(runs, Path(args.out), raw, argv)
    print(f"[matrix] wrote {args.out} and {raw}/")
    return 0


def get_profile_names() -> list[str]:
    from narwhal_conformance.profiles import PROFILES

    return list(PROFILES)


if __name__ == "__main__":
    sys.exit(main())
