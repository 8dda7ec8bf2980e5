#!/usr/bin/env bash
# Builds faultline's image from the repository's own build, pulling nothing from any registry:
#   1. cargo builds the agent and the probe with the `dist` profile (Cargo.toml);
#   2. a root filesystem is assembled in target/image/context/rootfs: in /usr/local/bin,
#      `faultline-agent`, `faultline` and `faultline-coordinator` (symlinks to it: the agent's
#      binary is the CLI and the coordinator when called by those names, which keeps the image
#      under 30 MB; docs/benchmarks.md, "Image size") and `faultline-probe`; exactly the shared libraries they load (read from the
#      binaries with ldd, so the list cannot go stale); /bin/busybox (Debian's busybox-static)
#      as sh, cat, mv and sleep for the job examples' scripts; /tmp; /etc/passwd, /etc/group and
#      /etc/debian_version (where the NVIDIA runtime puts the driver's libraries);
#   3. `docker build` builds manifests/Dockerfile (FROM scratch) from that directory only, so
#      the build context is a few megabytes, never the repository or target/.
#
# Usage: manifests/build-image.sh [TAG]     (default: the manifests' ghcr.io/faultline-io/faultline:0.1.0)
# Needs cargo, ldd (libc-bin), busybox-static, and a docker CLI with a daemon (DOCKER_HOST is
# honoured).
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-ghcr.io/faultline-io/faultline:0.1.0}
bins=(faultline-agent faultline-probe)

# The probe with its GPU backends (`gpu`): cudarc loads the CUDA libraries at run time, so the
# binary runs on every node and a node without them gets a one-line "unavailable" error
# (docs/peer-checks.md, "The probe's GPU backends"; what a GPU check needs from the image:
# docs/kubernetes.md, "The image").
cargo build --profile dist --locked -p faultline -p faultline-probe \
    --features faultline-probe/gpu --bin faultline-agent --bin faultline-probe

ctx=target/image/context
rm -rf "$ctx"
mkdir -p "$ctx/rootfs/usr/local/bin" "$ctx/rootfs/etc"
cp manifests/Dockerfile "$ctx/Dockerfile"
for b in "${bins[@]}"; do
    install -m 0755 "target/dist/$b" "$ctx/rootfs/usr/local/bin/$b"
done
ln -s faultline-agent "$ctx/rootfs/usr/local/bin/faultline"
ln -s faultline-agent "$ctx/rootfs/usr/local/bin/faultline-coordinator"

# Every library the dynamic loader maps for the binaries, at the path it is found at here, and
# the loader itself (the ELF interpreter). ldd lists both; `linux-vdso` is the kernel's.
libs=$(for b in "${bins[@]}"; do ldd "target/dist/$b"; done \
    | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | sort -u)
for lib in $libs; do
    mkdir -p "$ctx/rootfs$(dirname "$lib")"
    # -L: the file itself, not the distribution's symlink to it.
    cp -L "$lib" "$ctx/rootfs$lib"
done

# A shell and the few tools the job examples' scripts call (manifests/examples: the PyTorchJob's
# peer-check init container, the Horovod discovery sidecar): Debian's busybox-static, one
# static file (2 MB). Its shell runs every applet it has by bare name (Debian builds it with
# FEATURE_SH_STANDALONE), whatever the four links: nsenter, mount and the rest are there for
# anyone who can exec into the container, which is privileged anyway. /tmp for those scripts
# (the DaemonSet's root is read-only, and the agent writes only to its mounts).
busybox=/bin/busybox
if [ ! -x "$busybox" ] || ldd "$busybox" >/dev/null 2>&1; then
    echo "build-image: needs a static $busybox: apt-get install busybox-static" >&2
    exit 1
fi
mkdir -p "$ctx/rootfs/bin"
cp -L "$busybox" "$ctx/rootfs/bin/busybox"
for applet in sh cat mv sleep; do
    ln -s busybox "$ctx/rootfs/bin/$applet"
done
mkdir -m 1777 "$ctx/rootfs/tmp"

# Root only: the DaemonSet runs the agent as uid 0 (runAsUser: 0), and the job examples' CLI
# reads the record as whatever user the job runs as; nothing looks names up but tools an
# operator may run with `kubectl exec`.
echo 'root:x:0:0:root:/:/bin/sh' >"$ctx/rootfs/etc/passwd"
echo 'root:x:0:' >"$ctx/rootfs/etc/group"
# The libraries above are Debian's, at Debian's multiarch paths, and the NVIDIA container
# runtime puts the driver's libraries (libnvidia-ml for the NVML source) where the image's
# distribution keeps them: /usr/lib/x86_64-linux-gnu when the image has /etc/debian_version,
# else /usr/lib64 (libnvidia-container, src/nvc_container.c, copy_config), which this loader
# does not search. Without this file NVML could not be loaded on a GPU node.
cp /etc/debian_version "$ctx/rootfs/etc/debian_version"

echo "image contents:"
(cd "$ctx/rootfs" && find . ! -type d -printf '  %10s  /%P %l\n' | sort -k2)
# The legacy builder: BuildKit needs the buildx plugin, which Debian's docker.io does not ship,
# and this Dockerfile uses nothing BuildKit adds (DOCKER_BUILDKIT=0 prints a deprecation notice).
DOCKER_BUILDKIT=0 docker build --quiet -t "$tag" "$ctx" >/dev/null
size=$(docker image inspect --format '{{.Size}}' "$tag")
echo "built $tag: $size bytes ($((size / 1024 / 1024)) MiB)"
