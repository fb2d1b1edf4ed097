"""Containerfile, checked statically (no hadolint here): a slim Python base, a non-root
USER, `narwhal serve` as the entry point, a HEALTHCHECK on /health, SIGTERM as the stop
signal, and a build context (.containerignore, .dockerignore: identical) holding what
pyproject.toml packages. Building and running the image is scripts/ops/build-image.sh
(opt-in test: NARWHAL_BUILD_IMAGE=1, with NARWHAL_BUILD_IMAGE_ARGS="--local-base --chroot"
on a machine that cannot pull the base or start containers, as the project's)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tomllib

import pytest

from tests.deploy.promql import ROOT

CF = ROOT / "Containerfile"


def _instructions() -> list[tuple[str, str]]:
    text = CF.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_final_stage_runs_narwhal_serve_as_non_root_with_a_health_check() -> None:
    ins = _instructions()
    froms = [i for i, (w, _) in enumerate(ins) if w == "FROM"]
    final = ins[froms[-1]:]
    base = [r for w, r in ins if w == "ARG" and r.startswith("BASE=")]
    assert base and "python:3.11-slim" in base[0]
    assert all(r.split()[0] == "${BASE}" for w, r in ins if w == "FROM")
    users = [r for w, r in final if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert json.loads(next(r for w, r in final if w == "ENTRYPOINT")) == ["narwhal", "serve"]
    hc = next(r for w, r in final if w == "HEALTHCHECK")
    assert "CMD" in hc and "NARWHAL_HEALTH_URL" in hc
    assert "NARWHAL_HEALTH_URL=http://127.0.0.1:8000/health" in " ".join(r for w, r in final if w == "ENV")
    assert ("STOPSIGNAL", "SIGTERM") in final
    assert json.loads(next(r for w, r in final if w == "CMD")) == ["--listen", "0.0.0.0:8000"]
    assert ("EXPOSE", "8000") in final


def test_the_build_context_has_what_the_package_needs() -> None:
    assert (ROOT / ".containerignore").read_text() == (ROOT / ".dockerignore").read_text()
    kept = {ln[1:].rstrip("/") for ln in (ROOT / ".containerignore").read_text().splitlines() if ln.startswith("!")}
    pp = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = {d.split("/")[0] for d in pp["tool"]["setuptools"]["package-dir"].values()} | {"narwhal_bench"}
    assert dirs | {"pyproject.toml", pp["project"]["readme"]} <= kept
    copied = {src.rstrip("/") for w, r in _instructions() if w == "COPY" and not r.startswith("--from") for src in shlex.split(r)[:-1]}
    assert copied == kept, (copied, kept)


@pytest.mark.skipif(os.environ.get("NARWHAL_BUILD_IMAGE") != "1", reason="opt-in: NARWHAL_BUILD_IMAGE=1 builds and runs the image (podman or docker; minutes)")
def test_the_image_builds_and_serves(tmp_path: object) -> None:
    assert shutil.which("podman") or shutil.which("docker"), "no podman or docker"
    extra = os.environ.get("NARWHAL_BUILD_IMAGE_ARGS", "").split()  # e.g. "--local-base --chroot" in a sandbox
    r = subprocess.run(["bash", str(ROOT / "scripts" / "ops" / "build-image.sh"), "--check", *extra], capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
