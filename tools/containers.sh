#!/usr/bin/env bash
# Container setup for the container test tier and for `docker compose up` on a host with no
# image registry. Each step is cached: it does nothing when its result is already there.
#
#   tools/containers.sh engine   install Docker Engine and Compose from Debian (root) if absent
#   tools/containers.sh base     a local Debian base image (debootstrap + docker import)
#   tools/containers.sh image    the InferMesh image, built FROM that base
#   tools/containers.sh all      the three, in order (what the container tier's setup runs)
#
# It never starts dockerd: the tests start (and stop) the one they need, and say so. The steps
# that talk to the engine need one running (DOCKER_HOST or /var/run/docker.sock).
#
# Why a local base: this host reaches the package registries (Debian, PyPI) but no container
# registry, so `python:3.11-slim` cannot be pulled. `debootstrap --variant=minbase` makes an
# equivalent Debian bookworm root with its Python 3.11, and `docker import` loads it. Hosts
# with a registry can ignore all this: the Dockerfile's default base is python:3.11-slim.
#
# Why a build secret: pip inside the build must trust the same CA bundle as pip on this host
# (a TLS-inspecting egress proxy here). The bundle is mounted for the pip step only
# (`RUN --mount=type=secret`), so it is in no image layer.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
docker_cli="${INFERMESH_DOCKER:-/usr/bin/docker}"   # Debian's 20.10 CLI: BuildKit built in
base_image="${INFERMESH_BASE_IMAGE:-infermesh-base:bookworm}"
image="${INFERMESH_IMAGE:-infermesh:latest}"
ca_bundle="${INFERMESH_BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}"

say() { echo "containers: $*"; }

engine() {
  if [ -x "$docker_cli" ] && command -v docker-compose >/dev/null 2>&1 \
     && command -v dockerd >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1; then
    return 0
  fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    say "Docker Engine, docker-compose and debootstrap are missing and this is not a root" \
        "Debian host: install them (apt-get install docker.io docker-compose debootstrap)" >&2
    return 1
  fi
  say "installing Debian packages docker.io docker-compose debootstrap"
  local started=$SECONDS
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io docker-compose debootstrap \
    >/dev/null 2>&1 || { apt-get update -q >/dev/null && \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io docker-compose debootstrap \
    >/dev/null; }
  say "engine installed in $((SECONDS - started)) s"
}

have_image() { "$docker_cli" image inspect "$1" >/dev/null 2>&1; }

base() {
  if have_image "$base_image"; then
    say "base $base_image is cached"
    return 0
  fi
  local started=$SECONDS dir
  dir="$(mktemp -d /var/tmp/infermesh-base.XXXXXX)"
  trap 'rm -rf "$dir"' RETURN
  say "debootstrap bookworm (minbase + python3) into $dir"
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates,passwd \
    bookworm "$dir" http://deb.debian.org/debian >"$dir.log" 2>&1 \
    || { tail -20 "$dir.log" >&2; rm -f "$dir.log"; return 1; }
  rm -f "$dir.log"
  # What python:3.11-slim offers that the Dockerfile and tools/install.sh use: `python`.
  ln -sf python3 "$dir/usr/bin/python"
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
  tar -C "$dir" -c . | "$docker_cli" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' - "$base_image" >/dev/null
  say "base $base_image imported in $((SECONDS - started)) s," \
      "$("$docker_cli" image inspect -f '{{.Size}}' "$base_image" | awk '{printf "%d MB", $1/1e6}')"
}

build_image() {
  local variant="${1:-cpu}" tag="${2:-$image}" started=$SECONDS
  local -a secret=()
  if [ -r "$ca_bundle" ]; then
    secret=(--secret "id=pip_ca,src=$ca_bundle")
  fi
  local previous
  previous="$("$docker_cli" image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)"
  say "building $tag ($variant) FROM $base_image"
  DOCKER_BUILDKIT=1 "$docker_cli" build -q \
    --build-arg "PYTHON_IMAGE=$base_image" --build-arg "VARIANT=$variant" \
    "${secret[@]}" -t "$tag" "$root" >/dev/null
  # The image this build replaced, now untagged: removed, so repeated runs do not pile up
  # 900 MB each (kept if a container still uses it).
  if [ -n "$previous" ] && [ "$previous" != "$("$docker_cli" image inspect -f '{{.Id}}' "$tag")" ]; then
    "$docker_cli" rmi "$previous" >/dev/null 2>&1 || true
  fi
  # BuildKit keeps every layer it ever built (each pyproject or source change makes new ones):
  # sessions of this tier had filled the host's disk with 63 GB of it, and the next build
  # failed with "No space left on device". Kept: the newest 12 GB, room for the cpu and gpu
  # images' dependency layers, so the usual rebuild stays cached.
  "$docker_cli" builder prune -f --keep-storage "${INFERMESH_BUILD_CACHE:-12GB}" >/dev/null 2>&1 || true
  say "image $tag built in $((SECONDS - started)) s," \
      "$("$docker_cli" image inspect -f '{{.Size}}' "$tag" | awk '{printf "%d MB", $1/1e6}')"
}

case "${1:-all}" in
  engine) engine ;;
  base) base ;;
  image) build_image "${2:-cpu}" "${3:-$image}" ;;
  all) engine && base && build_image cpu "$image" ;;
  *) echo "usage: $0 engine|base|image [cpu|gpu] [TAG]|all" >&2; exit 2 ;;
esac
