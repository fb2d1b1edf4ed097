#!/usr/bin/env bash
# Installs Debian's Prometheus (the `prometheus` server and `promtool`) for the tests of
# deploy/prometheus/ and deploy/grafana/ (tests/deploy/), without touching the system:
# the .deb is fetched with `apt-get download` and unpacked with `dpkg-deb -x` into DEST,
# so no service is started, no user is created and nothing of dpkg's state changes.
#
#   bash scripts/ops/prometheus.sh [DEST]     # prints the promtool path on its last line
#
# DEST defaults to ${XDG_CACHE_HOME:-$HOME/.cache}/narwhal/prometheus. Idempotent: when
# DEST already holds a working promtool it only prints the path (a few ms). Needs Debian
# (or a derivative with the `prometheus` package: bookworm has 2.42.0+ds) and, when the
# package lists are empty, root for `apt-get update`. Exit 1 with the reason otherwise;
# tests/deploy fails in CI (CI=true, or NARWHAL_REQUIRE_PROMETHEUS=1 as tox sets) and skips
# with that reason elsewhere.
set -euo pipefail

DEST="${1:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/narwhal/prometheus}"
PROMTOOL="$DEST/usr/bin/promtool"

if [ -x "$PROMTOOL" ] && "$PROMTOOL" --version >/dev/null 2>&1 && [ -x "$DEST/usr/bin/prometheus" ]; then
    echo "$PROMTOOL"
    exit 0
fi

for tool in apt-get dpkg-deb; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "prometheus.sh: $tool not found: this installer needs Debian's package tools" >&2
        exit 1
    fi
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# apt-get download writes into the current directory; _apt cannot write into a root-owned
# mktemp directory, which only costs a warning ("Download is performed unsandboxed")
cd "$work"
if ! apt-get download -q prometheus >"$work/download.log" 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        # a fresh machine has no package lists yet
        apt-get update -q >"$work/update.log" 2>&1 || { cat "$work/update.log" >&2; exit 1; }
        apt-get download -q prometheus >"$work/download.log" 2>&1 || { cat "$work/download.log" >&2; exit 1; }
    else
        cat "$work/download.log" >&2
        echo "prometheus.sh: apt-get download prometheus failed and 'apt-get update' needs root" >&2
        exit 1
    fi
fi

deb="$(ls "$work"/prometheus_*.deb)"
rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp"
dpkg-deb -x "$deb" "$DEST.tmp"
"$DEST.tmp/usr/bin/promtool" --version >/dev/null
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
echo "prometheus.sh: installed $(basename "$deb") into $DEST" >&2
echo "$PROMTOOL"
