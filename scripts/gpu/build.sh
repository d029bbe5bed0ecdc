#!/usr/bin/env bash
# Builds, on this (CPU) machine, what scripts/gpu/run.sh runs on a lent GPU
# machine, into target/gpu/ (carried to the device with the `carry` list
# `["target/gpu"]`; 64 MiB at most):
#   - the kvmesh-cuda test binaries `device` and `compile` (the kernels'
#     CUDA C is embedded in them: NVRTC compiles it there, at start),
# stripped of debug info. The device machine has the NVIDIA driver and, in
# its Python environment, the CUDA 13 wheels (NVRTC, cuBLAS) that
# kvmesh-cuda's toolkit search finds; nothing is installed there.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=target/gpu
rm -rf "$out"
mkdir -p "$out"
echo "==> gpu build: kvmesh-cuda test binaries (release)"
cargo test --release -p kvmesh-cuda --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, shutil, sys
want = {"device", "compile"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want and "test" in m["target"]["kind"]:
        shutil.copy(m["executable"], sys.argv[1] + "/" + m["target"]["name"])
        want.discard(m["target"]["name"])
sys.exit("missing: " + ", ".join(sorted(want)) if want else 0)
' "$out"
strip --strip-debug "$out"/*
du -ch "$out"/* | tail -1
ls -l "$out"
