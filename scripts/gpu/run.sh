#!/usr/bin/env bash
# The GPU checks of kvmesh's CUDA backend, in one call on a lent GPU machine
# (see DEVELOPERS.md, "GPU machines"). Built here first:
#   bash scripts/gpu/build.sh
# then run there with `carry: ["target/gpu"]`:
#   bash scripts/gpu/run.sh
# It prints the device, then runs
#   1. the compile check with the device machine's own NVRTC (every kernel
#      to PTX and sm_90 CUBIN, registers, no spills),
#   2. every device test (cuda/tests/device.rs), none skippable
#      (KVMESH_REQUIRE_CUDA=1): each kernel against the CPU runtime on fresh
#      random inputs with NaN-poisoned outputs, relative errors printed per
#      kernel and dtype; forged tables, stale generations, unwritten slots
#      and write gaps caught on the device and decoded as the CPU pool's
#      errors; a page staged out and back; checked vs unchecked attention,
# and writes the full log to $OUT/gpu.log. Exit status: the first failure.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=target/gpu
out="${OUT:-/tmp/kvmesh-gpu}"
mkdir -p "$out"
log="$out/gpu.log"
export KVMESH_REQUIRE_CUDA=1 KVMESH_REQUIRE_NVRTC=1
export KVMESH_CUDA_CACHE="$out/cuda-cache"
export RUST_BACKTRACE=1
[ -x "$bin/device" ] || { echo "no $bin/device: run scripts/gpu/build.sh here and carry target/gpu"; exit 2; }
{
  echo "== device"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
  echo "== 1. compile (this machine's NVRTC)"
  timeout 120 "$bin/compile" --nocapture --test-threads=1
  echo "compile rc=$?"
  echo "== 2. device tests"
  timeout 300 "$bin/device" --include-ignored --nocapture --test-threads=1
  echo "device rc=$?"
} > "$log" 2>&1
# The reply carries the end of the output: the table last.
echo "== summary (full log: $log)"
grep -E '^NVIDIA|^name|rel err|bit-exact|checked/unchecked|device |cpu  |^test |panicked|rc=' "$log" | tail -80
grep -q '^compile rc=0$' "$log" && grep -q '^device rc=0$' "$log"
