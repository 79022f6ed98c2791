#!/usr/bin/env bash
# scripts/images.sh (`make images`): build the server, agent and trainer images from
# docker/Dockerfile, then print one line per image: size, the user it runs as, whether torch
# imports in it, and whether its entry point's --help exits 0.
#
# Builder: $IMAGE_BUILDER (buildah, docker or podman) when set; otherwise docker when its daemon
# answers, else buildah, else podman.
#
#   make images                           # tierwatch-{server,agent,trainer}:$IMAGE_TAG (dev)
#   IMAGE_BUILDER=podman make images
#   TORCH_WHEEL=/path/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl make images
#
# buildah (a machine without a daemon or registry access): the base image is made locally with
# debootstrap (Debian bookworm minbase + python3, from the mirror apt already uses) as
# localhost/tierwatch-base:bookworm, once; it stands in for both python:3.11-slim and
# node:20-slim (the Dockerfile installs python3-venv, nodejs and npm where they are missing).
# Builds use --isolation chroot --storage-driver vfs (override with BUILDAH_ISOLATION and
# STORAGE_DRIVER) and --layers, so a rebuild reuses every unchanged step.
#
# torch: the trainer installs torch from the CPU wheel index by default. A local wheel
# (TORCH_WHEEL, or the one in $TORCH_WHEEL_DIR matching the lock's pin) is hard-linked or copied
# into docker/wheels/ (git-ignored) and named with --build-arg TORCH_WHEEL.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"

TAG=${IMAGE_TAG:-dev}
TARGETS=(server agent trainer)
BASE_IMAGE=localhost/tierwatch-base:bookworm
TORCH_PIN=$(sed -n 's/^torch==//p' requirements/train.lock)
TORCH_WHEEL_DIR=${TORCH_WHEEL_DIR:-/opt/wheels}

log() { printf 'images: %s\n' "$*" >&2; }
die() {
    log "$*"
    exit 1
}

pick_builder() {
    if [ -n "${IMAGE_BUILDER:-}" ]; then
        command -v "$IMAGE_BUILDER" >/dev/null || die "IMAGE_BUILDER=$IMAGE_BUILDER is not on PATH"
        echo "$IMAGE_BUILDER"
    elif command -v docker >/dev/null && timeout 10 docker info >/dev/null 2>&1; then
        echo docker
    elif command -v buildah >/dev/null; then
        echo buildah
    elif command -v podman >/dev/null; then
        echo podman
    else
        die "no image builder: install docker, podman or buildah (Debian: apt-get install buildah)"
    fi
}

BUILDER=$(pick_builder)
STORAGE=()
if [ "$BUILDER" = buildah ]; then
    STORAGE=(--storage-driver "${STORAGE_DRIVER:-vfs}")
fi
# the same tool inspects and runs what it built (buildah run for buildah)
bld() { "$BUILDER" "${STORAGE[@]}" "$@"; }

image_exists() {
    case $BUILDER in
        buildah) bld inspect --type image "$1" >/dev/null 2>&1 ;;
        *) "$BUILDER" image inspect "$1" >/dev/null 2>&1 ;;
    esac
}

debian_mirror() {
    # the first Debian archive URI apt uses (deb822 .sources or one-line sources.list)
    local files=(/etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list)
    local uri
    uri=$(cat "${files[@]}" 2>/dev/null |
        sed -n -E 's#^URIs:[[:space:]]*(\S+/debian)/?$#\1#p; s#^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?(\S+/debian)/?[[:space:]].*#\2#p' |
        head -n 1)
    echo "${uri:-http://deb.debian.org/debian}"
}

make_base_image() {
    if image_exists "$BASE_IMAGE"; then
        log "base image $BASE_IMAGE exists (remove it to make a new one)"
        return
    fi
    command -v debootstrap >/dev/null || die "debootstrap missing: apt-get install debootstrap"
    local mirror rootfs ctr
    mirror=$(debian_mirror)
    rootfs=$(mktemp -d /var/tmp/tierwatch-base.XXXXXX)
    log "debootstrap bookworm (minbase + python3) from $mirror into $rootfs"
    debootstrap --variant=minbase --include=python3 bookworm "$rootfs" "$mirror" >&2
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    # TLS through this host's proxy: builds on this base trust what the host trusts. The host's
    # bundle goes to a path no Debian package owns (installing ca-certificates rewrites
    # /etc/ssl/certs), and pip and node are pointed at it.
    local ca=${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
    local env=()
    if [ -s "$ca" ]; then
        install -D -m 0644 "$ca" "$rootfs/etc/ssl/host-ca-bundle.crt"
        env=(--env PIP_CERT=/etc/ssl/host-ca-bundle.crt
            --env NODE_EXTRA_CA_CERTS=/etc/ssl/host-ca-bundle.crt)
    fi
    ctr=$(bld from scratch)
    bld copy "$ctr" "$rootfs" / >/dev/null
    bld config "${env[@]}" --env LANG=C.UTF-8 --cmd /bin/bash "$ctr"
    bld commit --rm "$ctr" "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
    log "made $BASE_IMAGE"
}

torch_wheel_arg() {
    local wheel=${TORCH_WHEEL:-}
    if [ -z "$wheel" ]; then
        wheel=$(compgen -G "$TORCH_WHEEL_DIR/torch-${TORCH_PIN}+cpu-cp311-cp311-*.whl" | head -n 1 || true)
    fi
    [ -n "$wheel" ] || return 0
    [ -f "$wheel" ] || die "TORCH_WHEEL=$wheel is not a file"
    local name
    name=$(basename "$wheel")
    if [ ! -f "docker/wheels/$name" ]; then
        ln "$wheel" "docker/wheels/$name" 2>/dev/null || cp "$wheel" "docker/wheels/$name"
    fi
    log "trainer: torch from the local wheel docker/wheels/$name"
    echo "--build-arg=TORCH_WHEEL=$name"
}

build_args=()
if [ "$BUILDER" = buildah ]; then
    make_base_image
    build_args=(--build-arg "PYTHON_IMAGE=$BASE_IMAGE" --build-arg "NODE_IMAGE=$BASE_IMAGE"
        --isolation "${BUILDAH_ISOLATION:-chroot}" --layers --force-rm)
fi
torch_arg=$(torch_wheel_arg)

declare -A seconds
for target in "${TARGETS[@]}"; do
    extra=()
    [ "$target" = trainer ] && [ -n "$torch_arg" ] && extra=("$torch_arg")
    log "building tierwatch-$target:$TAG with $BUILDER"
    start=$SECONDS
    case $BUILDER in
        buildah) bld bud "${build_args[@]}" "${extra[@]}" -f docker/Dockerfile \
            --target "$target" -t "tierwatch-$target:$TAG" . ;;
        *) "$BUILDER" build "${extra[@]}" -f docker/Dockerfile --target "$target" \
            -t "tierwatch-$target:$TAG" . ;;
    esac
    seconds[$target]=$((SECONDS - start))
done

# --- what was built ---------------------------------------------------------------------------

image_size() {
    case $BUILDER in
        buildah) bld images --format '{{.Size}}' "$1" | head -n 1 ;;
        *) "$BUILDER" image inspect --format '{{.Size}}' "$1" |
            awk '{ printf "%.0f MB\n", $1 / 1000000 }' ;;
    esac
}

image_user() {
    case $BUILDER in
        buildah) bld inspect --type image --format '{{.OCIv1.Config.User}}' "$1" ;;
        *) "$BUILDER" image inspect --format '{{.Config.User}}' "$1" ;;
    esac
}

# in_image IMAGE CMD...: run CMD in IMAGE as the image's user. buildah: in one working
# container per image (with vfs, each `buildah from` copies the whole image), made on first use
# and removed at exit; docker/podman: a fresh container each time.
declare -A working
cleanup() { for c in "${working[@]}"; do bld rm "$c" >/dev/null 2>&1 || true; done; }
trap cleanup EXIT
in_image() {
    local image=$1
    shift
    case $BUILDER in
        buildah)
            [ -n "${working[$image]:-}" ] || working[$image]=$(bld from --pull=false "$image")
            bld run --isolation "${BUILDAH_ISOLATION:-chroot}" "${working[$image]}" -- "$@"
            ;;
        *) "$BUILDER" run --rm --network none --entrypoint "$1" "$image" "${@:2}" ;;
    esac
}

yes_no() { if "$@" >/dev/null 2>&1; then echo yes; else echo no; fi; }

problems=0
rows=()
for target in "${TARGETS[@]}"; do
    image="tierwatch-$target:$TAG"
    [ "$BUILDER" = buildah ] && working[$image]=$(bld from --pull=false "$image")
    size=$(image_size "$image")
    user=$(image_user "$image")
    uid=$(in_image "$image" id -u 2>/dev/null || echo "?")
    torch=$(yes_no in_image "$image" python -c "import torch")
    case $target in
        server) help=$(yes_no in_image "$image" tierwatch-server --help) ;;
        agent) help=$(yes_no in_image "$image" tierwatch-agent --help) ;;
        trainer) help=$(yes_no in_image "$image" python examples/train_gpt.py --help) ;;
    esac
    want_torch=no
    [ "$target" = trainer ] && want_torch=yes
    verdict=ok
    if [ "$torch" != "$want_torch" ] || [ "$help" != yes ] || [ "$uid" = 0 ] || [ "$uid" = "?" ]; then
        verdict=FAIL
        problems=$((problems + 1))
    fi
    rows+=("| \`$image\` | $size | \`$user\` (uid $uid) | $torch | $help | ${seconds[$target]} s | $verdict |")
done

echo
echo "builder: $BUILDER ($("$BUILDER" --version | head -n 1)), $(date -u '+%Y-%m-%d %H:%M UTC')"
echo
echo "| image | size | runs as | torch imports | entry point --help exits 0 | build time | check |"
echo "|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
[ "$problems" -eq 0 ] || die "$problems image(s) failed a check"
