#!/usr/bin/env bash
# Build the qo-ops image (the Dockerfile at the repository's root) and print its name and size.
#
#   deploy/image/build.sh [IMAGE]        # default IMAGE: localhost/qo-ops:<git short hash>
#   make image                           # the same, IMAGE=… to name it
#
# The builder: docker where an engine answers, otherwise buildah (no daemon needed:
# `apt-get install buildah podman runc mmdebstrap`).
#
# The base: PYTHON_IMAGE when set (pin a digest: docs/deploy.md), otherwise the Dockerfile's
# python:3.11.14-slim-bookworm when a registry serves it. Where none does (a machine that
# reaches only package registries), a stand-in: Debian bookworm's own Python 3.11 in a root
# filesystem made by mmdebstrap from Debian's packages, imported once as
# localhost/qo-ops-stand-in-base:bookworm (STAND_IN_BASE=1 asks for it directly). The stand-in
# proves the Dockerfile builds and runs; ship images built on the real base.
#
# The host's CA bundle is mounted read-only into the build when it exists, for networks that
# intercept TLS with their own certificate authority.
set -euo pipefail
cd "$(dirname "$0")/../.."

IMAGE=${1:-${IMAGE:-localhost/qo-ops:$(git rev-parse --short HEAD 2>/dev/null || echo dev)}}
REAL_BASE=$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile)
STAND_IN=localhost/qo-ops-stand-in-base:bookworm
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt

die() { echo "image: $*" >&2; exit 1; }

if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    builder=docker
elif command -v buildah >/dev/null; then
    builder=buildah
else
    die "no image builder: install buildah (apt-get install buildah podman runc mmdebstrap) or run a Docker engine"
fi

have_image() {
    if [ "$builder" = docker ]; then docker image inspect "$1" >/dev/null 2>&1
    else buildah inspect --type image "$1" >/dev/null 2>&1; fi
}

pull() {
    if [ "$builder" = docker ]; then docker pull -q "$1" >/dev/null 2>&1
    else buildah pull -q "$1" >/dev/null 2>&1; fi
}

stand_in_base() {
    have_image "$STAND_IN" && return 0
    command -v mmdebstrap >/dev/null || die "no registry serves $REAL_BASE and mmdebstrap is missing (apt-get install mmdebstrap)"
    local rootfs
    rootfs=$(mktemp -d)/rootfs.tar
    echo "image: no registry serves $REAL_BASE; making the stand-in base $STAND_IN (Debian bookworm, mmdebstrap)" >&2
    mmdebstrap --quiet --variant=minbase \
        --include=python3,python3-venv,python-is-python3,ca-certificates bookworm "$rootfs"
    if [ "$builder" = docker ]; then docker import "$rootfs" "$STAND_IN" >/dev/null
    else podman import --quiet "$rootfs" "$STAND_IN" >/dev/null; fi
    rm -rf "$(dirname "$rootfs")"
}

if [ -n "${PYTHON_IMAGE:-}" ]; then
    base=$PYTHON_IMAGE
elif [ "${STAND_IN_BASE:-0}" != 1 ] && { have_image "$REAL_BASE" || pull "$REAL_BASE"; }; then
    base=$REAL_BASE
else
    stand_in_base
    base=$STAND_IN
fi

mounts=()
[ -r "$CA_BUNDLE" ] && mounts=(-v "$CA_BUNDLE:$CA_BUNDLE:ro")
echo "image: building $IMAGE on $base with $builder" >&2
if [ "$builder" = docker ]; then
    docker build --build-arg "PYTHON_IMAGE=$base" -t "$IMAGE" .
else
    # chroot isolation: no OCI runtime needed for RUN steps; docker format: HEALTHCHECK kept
    buildah bud --isolation=chroot --network=host --format docker --layers \
        "${mounts[@]}" --build-arg "PYTHON_IMAGE=$base" -t "$IMAGE" .
fi

if [ "$builder" = docker ]; then size=$(docker image inspect --format '{{.Size}}' "$IMAGE")
else size=$(podman image inspect --format '{{.Size}}' "$IMAGE"); fi
echo "image: $IMAGE ($((size / 1000000)) MB, base $base)"
