#!/usr/bin/env bash
# Builds the router's image from the Containerfile with podman (or docker), and with
# --check runs it: /health answers 200 within 60 s, then SIGTERM stops it (exit 0).
#
#   bash scripts/ops/build-image.sh [--check] [--tag narwhal:0.1.0]
#
# The base is python:3.11-slim-bookworm from Docker Hub (the Containerfile's BASE);
# override it with BASE=IMAGE in the environment (e.g. a mirror of that image).
set -euo pipefail
cd "$(dirname "$0")/../.."

tag=narwhal:0.1.0
check=0
while [ $# -gt 0 ]; do
    case "$1" in
        --check) check=1 ;;
        --tag) tag="$2"; shift ;;
        *) echo "usage: $0 [--check] [--tag NAME:TAG]" >&2; exit 2 ;;
    esac
    shift
done

if command -v podman >/dev/null 2>&1; then tool=podman
elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then tool=docker
else echo "build-image.sh: neither podman nor a running docker daemon" >&2; exit 1
fi

args=(build -t "$tag" -f Containerfile)
[ -n "${BASE:-}" ] && args+=(--build-arg "BASE=$BASE")
"$tool" "${args[@]}" .

if [ "$check" = 1 ]; then
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    name="narwhal-check-$$"
    "$tool" run -d --rm --name "$name" -p "127.0.0.1:$port:8000" "$tag" >/dev/null
    trap '"$tool" rm -f "$name" >/dev/null 2>&1 || true' EXIT
    for _ in $(seq 1 120); do
        if curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1; then break; fi
        sleep 0.5
    done
    curl -fsS "http://127.0.0.1:$port/health"
    curl -sS "http://127.0.0.1:$port/ready"; echo
    [ "$("$tool" exec "$name" id -u)" != 0 ] || { echo "runs as root" >&2; exit 1; }
    "$tool" stop -t 45 "$name" >/dev/null
    echo "build-image.sh: $tag built, served /health, stopped on SIGTERM"
fi
