#!/usr/bin/env bash
# Builds, on this (CPU) machine, what scripts/gpu/run.sh runs on a lent GPU
# machine, into target/gpu/ (carried with `carry: ["target/gpu"]`, 64 MiB
# at most):
#   - kvmesh (release, stripped): `generate`, `serve` and `bench-engine`
#     with --device cuda;
#   - the test binaries (release, stripped; kernels' CUDA C embedded, NVRTC
#     compiles it there): kvmesh-cuda's `compile` and `device`,
#     kvmesh-model's `cuda` and `golden` (their data is in the working
#     tree, which the device machine gets);
# (46 MB in all), and, if the default model is in the cache, the model in
# two parts (target/gpu-model-a, target/gpu-model-b: carry's limit is 64
# MiB a call, the model 98 MB), which run.sh joins (see its header).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=target/gpu
rm -rf "$out" target/gpu-model-a target/gpu-model-b
mkdir -p "$out"
echo "==> gpu build: kvmesh and the CUDA test binaries (release; first build takes minutes)"
cargo build --release -p kvmesh-cli --bin kvmesh
cp target/release/kvmesh "$out/kvmesh"
cargo test --release -p kvmesh-cuda -p kvmesh-model --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, shutil, sys
want = {("kvmesh-cuda", "device"), ("kvmesh-cuda", "compile"), ("kvmesh-model", "cuda"), ("kvmesh-model", "golden")}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or "test" not in m["target"]["kind"]:
        continue
    pkg = m["package_id"].split("#")[-1].split("@")[0]
    key = (pkg, m["target"]["name"])
    if key in want:
        shutil.copy(m["executable"], sys.argv[1] + "/" + key[1] + ("-model" if key == ("kvmesh-model", "cuda") else ""))
        want.discard(key)
sys.exit("missing: " + ", ".join(f"{p}/{t}" for p, t in sorted(want)) if want else 0)
' "$out"
strip --strip-all "$out"/*
model="${KVMESH_HOME:-$HOME/.cache/kvmesh}/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -f "$model" ]; then
  echo "==> gpu build: the default model in two parts"
  mkdir -p target/gpu-model-a target/gpu-model-b
  split -b 50M -d "$model" target/gpu-model-a/part.
  mv target/gpu-model-a/part.01 target/gpu-model-b/
else
  echo "==> gpu build: the default model is not cached (kvmesh fetch-model): run.sh will skip the SmolLM2 checks"
fi
du -sh "$out" target/gpu-model-* 2>/dev/null || true
ls -l "$out"
