#!/usr/bin/env bash
# The GPU checks of kvmesh's CUDA backend, in one call on a lent GPU machine
# (DEVELOPERS.md, "GPU machines"). Here first: `bash scripts/gpu/build.sh`.
# Then, on the device machine (the `run` tool):
#   a. with the default model (three calls back to back: the machine stays
#      warm 30 s after each and keeps what earlier calls carried; carry's
#      limit is 64 MiB a call):
#        carry ["target/gpu-model-a"]  command: true
#        carry ["target/gpu-model-b"]  command: true
#        carry ["target/gpu"]          command: bash scripts/gpu/run.sh
#   b. without it: carry ["target/gpu"], command: bash scripts/gpu/run.sh
# Steps (each logged in full to $OUT/gpu.log; the table comes last):
#   1. the compile check with the device machine's own NVRTC (PTX and
#      sm_90 CUBIN, registers, no spills);
#   2. kernel tests: every kernel against the CPU runtime on fresh random
#      inputs with NaN-poisoned outputs, relative error per kernel and
#      dtype; forged tables, stale generations, unwritten slots and write
#      gaps caught on the device; a staged page; checked vs unchecked
#      attention;
#   3. engine tests on cuda:0: batched prefill/decode equal to the CPU
#      engine, an adopted prompt, forged tables failing only their
#      sequence; the golden files' greedy tokens and logits (tiny model and
#      SmolLM2) within the CPU runtime's tolerances of transformers; every
#      tiny family (mistral, qwen2, phi3 run and match; qwen3 and gemma3
#      refused at load, naming the family and what the device lacks);
#   4. `kvmesh generate --device cuda` against `--device cpu` (greedy);
#   5. a mesh on the GPU: `kvmesh serve --device cuda` (prefill and decode
#      engines on cuda:0, the handshake and TCP transfer between them), a
#      greedy completion equal to `kvmesh generate --device cpu`;
#   6. benchmarks, prefill 512 and decode batch 1, 16, 64, each with the
#      device's copy bandwidth measured in the same run: `bench-engine` on
#      SmolLM2 (its GGUF blocks as f16 on the device) --device cuda and
#      --device cpu; `bench-engine --random-weights` on the Llama-3-8B
#      shape in bf16 (scripts/gpu/shapes/llama3-8b.json; goal: decode batch
#      1 streams >= 70% of the copy bandwidth); and PyTorch/transformers on
#      the same GPU, bf16, both shapes (scripts/gpu/torch_bench.py).
# Nothing is skippable (KVMESH_REQUIRE_CUDA=1, KVMESH_REQUIRE_NVRTC=1, and
# KVMESH_REQUIRE_MODEL=1 when the model was carried). Exit status: 0 only
# if every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=$PWD/target/gpu
out="${OUT:-/tmp/kvmesh-gpu}"
mkdir -p "$out"
log="$out/gpu.log"
export KVMESH_REQUIRE_CUDA=1 KVMESH_REQUIRE_NVRTC=1 RUST_BACKTRACE=1
export KVMESH_CUDA_CACHE="$out/cuda-cache" KVMESH_HOME="$out/home" KVMESH_LOG=warn
mkdir -p "$KVMESH_HOME"
[ -x "$bin/device" ] || { echo "no $bin/device: run scripts/gpu/build.sh here and carry target/gpu"; exit 2; }
model=""
if ls target/gpu-model-a/part.* target/gpu-model-b/part.* >/dev/null 2>&1; then
  cat target/gpu-model-a/part.* target/gpu-model-b/part.* > "$KVMESH_HOME/SmolLM2-135M-Instruct.Q4_1.gguf"
  model="$KVMESH_HOME/SmolLM2-135M-Instruct.Q4_1.gguf"
  export KVMESH_REQUIRE_MODEL=1
fi
tiny=$PWD/model/tests/data/tiny-llama
status=0
step() { # name, command...
  local name="$1"; shift
  echo "== $name"
  "$@"
  local rc=$?
  echo "$name rc=$rc"
  [ "$rc" = 0 ] || status=1
}
same_text() { # label, model, extra args
  local a b
  a=$("$bin/kvmesh" generate --model "$2" --prompt "The capital of France is" --max-tokens 24 --temperature 0 --device cuda "${@:3}") || return 1
  b=$("$bin/kvmesh" generate --model "$2" --prompt "The capital of France is" --max-tokens 24 --temperature 0 --device cpu "${@:3}") || return 1
  echo "$1 cuda: $a"
  echo "$1 cpu:  $b"
  [ "$a" = "$b" ]
}
mesh_check() {
  "$bin/kvmesh" serve --device cuda --model "$tiny" --http-port 18080 --grpc-port 0 > "$out/serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 120); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:18080/health', timeout=2)" >/dev/null 2>&1 && break
    sleep 0.5
  done
  local got want
  got=$(timeout 90 python3 - <<'PY'
import json, urllib.request
model = json.load(urllib.request.urlopen("http://127.0.0.1:18080/v1/models", timeout=10))["data"][0]["id"]
req = urllib.request.Request("http://127.0.0.1:18080/v1/completions", method="POST",
    headers={"content-type": "application/json"},
    data=json.dumps({"model": model, "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0}).encode())
print(json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["text"], end="")
PY
)
  local rc=$?
  kill -TERM "$pid"; wait "$pid"
  want=$("$bin/kvmesh" generate --model "$tiny" --prompt "The quick brown fox" --max-tokens 16 --temperature 0 --device cpu)
  echo "mesh cuda: $got"
  echo "cpu:       $want"
  [ "$rc" = 0 ] && [ "$got" = "$want" ]
}
{
  echo "== device"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
  step "1 compile" timeout 120 "$bin/compile" --nocapture --test-threads=1
  step "2 kernels" timeout 240 "$bin/device" --include-ignored --nocapture --test-threads=1
  step "3a engine" timeout 120 "$bin/cuda-model" --include-ignored --nocapture --test-threads=1
  step "3b golden" timeout 180 "$bin/golden" --include-ignored --nocapture --test-threads=1 on_cuda
  step "4 generate tiny" same_text tiny "$tiny"
  [ -n "$model" ] && step "4 generate smollm2 exact" same_text smollm2 "$model" --exact
  step "5 mesh" mesh_check
  if [ -n "$model" ]; then
    step "6 bench smollm2 cuda" timeout 90 "$bin/kvmesh" bench-engine --model "$model" --device cuda --prompt-tokens 512 --batch 1,16,64 --decode-tokens 32
    step "6 bench smollm2 cpu" timeout 90 "$bin/kvmesh" bench-engine --model "$model" --device cpu --prompt-tokens 512 --batch 1,16,64 --decode-tokens 8 --repeats 1
  fi
  step "6 torch smollm2 shape bf16" timeout 90 python3 scripts/gpu/torch_bench.py --config scripts/gpu/shapes/smollm2-135m.json
  shape="$out/llama3-8b"
  mkdir -p "$shape"
  cp scripts/gpu/shapes/llama3-8b.json "$shape/config.json"
  cp "$tiny"/tokenizer.json "$tiny"/tokenizer_config.json "$tiny"/special_tokens_map.json "$shape/"
  step "6 bench llama3-8b shape cuda bf16" timeout 240 "$bin/kvmesh" bench-engine --model "$shape" --random-weights 1 --device cuda --device-weights bf16 --kv-cache-dtype f16 --prompt-tokens 512 --batch 1,16,64 --decode-tokens 32 --repeats 2
  step "6 torch llama3-8b shape bf16" timeout 150 python3 scripts/gpu/torch_bench.py --config scripts/gpu/shapes/llama3-8b.json --repeats 2
  echo "== status $status"
} > "$log" 2>&1
echo "== summary (full log: $log)"
grep -E '^NVIDIA|^name|rel err|bit-exact|checked/unchecked|worst|forged table|adopted|cuda: |cpu: |cpu:  |mesh cuda|^kvmesh bench|^transformers|^prefill|^decode|^device |streams|^test .*FAIL|panicked| rc=|^== status' "$log" | tail -120
[ "$status" = 0 ]
