#!/usr/bin/env bash
# The UCX data handler's tests under Miri (`ucx/src/sink/tests.rs`): they call
# the handler as UCX does, with a region in plain memory and no FFI, so Miri
# checks its pointer use (Stacked Borrows: the handler's argument outliving
# moves of its owner; copies inside the region). The rest of the UCX crate
# calls libucp and cannot run under Miri. Needs a nightly toolchain with the
# miri component: `rustup toolchain install nightly --component miri`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo +nightly miri test -p kvmesh-ucx --lib sink "$@"
