#!/usr/bin/env bash
# Builds the router's image from the Containerfile with podman (or docker); with --check
# runs it and asks /health, /ready and a chat completion, as user 10001.
#
#   bash scripts/ops/build-image.sh [--check] [--tag narwhal:0.1.0] [--local-base] [--chroot]
#
#   --local-base  build on a Debian bookworm base made here with debootstrap (python3,
#                 python3-venv, passwd, ca-certificates) and imported as
#                 localhost/narwhal-base:bookworm, for machines that cannot pull
#                 python:3.11-slim-bookworm from Docker Hub (the host's CA bundle is
#                 copied in, for a TLS-inspecting proxy in front of PyPI)
#   --chroot      podman only: build with --isolation chroot and check with buildah's
#                 chroot isolation, for sandboxes whose OCI runtime cannot start a
#                 container (cgroups v1/v2 hybrid, setrlimit refused)
#
# BASE=IMAGE in the environment overrides the Containerfile's base (e.g. a mirror).
set -euo pipefail
cd "$(dirname "$0")/../.."

tag=narwhal:0.1.0
check=0 local_base=0 chroot=0
while [ $# -gt 0 ]; do
    case "$1" in
        --check) check=1 ;;
        --tag) tag="$2"; shift ;;
        --local-base) local_base=1 ;;
        --chroot) chroot=1 ;;
        *) echo "usage: $0 [--check] [--tag NAME:TAG] [--local-base] [--chroot]" >&2; exit 2 ;;
    esac
    shift
done

if command -v podman >/dev/null 2>&1; then tool=podman
elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then tool=docker
else echo "build-image.sh: neither podman nor a running docker daemon" >&2; exit 1
fi

if [ "$local_base" = 1 ]; then
    BASE=localhost/narwhal-base:bookworm
    if ! "$tool" image exists "$BASE" 2>/dev/null; then
        command -v debootstrap >/dev/null || { echo "build-image.sh: --local-base needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
        root="$(mktemp -d)"
        trap 'rm -rf "$root"' EXIT
        debootstrap --variant=minbase --include=python3,python3-venv,passwd,ca-certificates bookworm "$root/fs" http://deb.debian.org/debian >"$root/debootstrap.log" 2>&1 \
            || { tail -20 "$root/debootstrap.log" >&2; exit 1; }
        cp /etc/ssl/certs/ca-certificates.crt "$root/fs/etc/ssl/certs/ca-certificates.crt"
        printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$root/fs/etc/pip.conf"
        tar -C "$root/fs" -c . | "$tool" import - "$BASE" >/dev/null
    fi
fi

args=(build -t "$tag" -f Containerfile)
[ "$tool" = podman ] && args+=(--format docker)          # OCI images drop HEALTHCHECK
[ "$tool" = podman ] && [ "$chroot" = 1 ] && args+=(--isolation chroot --network host)
[ -n "${BASE:-}" ] && args+=(--build-arg "BASE=$BASE")
"$tool" "${args[@]}" .

[ "$check" = 1 ] || exit 0

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url="http://127.0.0.1:$port"
if [ "$chroot" = 1 ]; then
    ctr=$(buildah from "$tag")
    buildah run --isolation chroot --network host "$ctr" -- narwhal serve --listen "127.0.0.1:$port" >/dev/null 2>&1 &
    pid=$!
    stop() {
        kill "$pid" 2>/dev/null || true   # SIGTERM: buildah passes it on, the router drains and exits
        wait "$pid" 2>/dev/null || true
        for _ in 1 2 3 4 5; do buildah rm "$ctr" >/dev/null 2>&1 && break; sleep 1; done
    }
    trap stop EXIT
    inside=(buildah run --isolation chroot --network host "$ctr" --)
else
    name="narwhal-check-$$"
    "$tool" run -d --rm --name "$name" -p "127.0.0.1:$port:8000" "$tag" >/dev/null
    trap '"$tool" rm -f "$name" >/dev/null 2>&1 || true' EXIT
    inside=("$tool" exec "$name")
fi
for _ in $(seq 1 120); do
    curl -fsS "$url/health" >/dev/null 2>&1 && break
    sleep 0.5
done
curl -fsS "$url/health"; echo
curl -fsS "$url/ready"; echo
curl -fsS "$url/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model": "narwhal-demo", "messages": [{"role": "user", "content": "Hello"}]}' | head -c 200; echo
uid=$("${inside[@]}" id -u)
[ "$uid" != 0 ] || { echo "build-image.sh: the image runs as root" >&2; exit 1; }
echo "build-image.sh: $tag built; serves /health, /ready and a completion as uid $uid"
