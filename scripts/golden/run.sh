#!/usr/bin/env bash
# Create (or reuse) a Python venv outside the repository with the pinned reference
# stack, then run make_golden.py. Extra arguments are passed to the script.
#
#   KVMESH_REF_VENV   venv location (default: $HOME/.cache/kvmesh/ref-venv)
#   PYTHON            interpreter used to create the venv (default: python3)
#   TORCH_INDEX_URL   optional pip index for torch, e.g. https://download.pytorch.org/whl/cpu
#                     (smaller CPU-only wheel; the committed data was made with the PyPI build)
#   KVMESH_GGUF       SmolLM2 GGUF (default: $HOME/.cache/kvmesh/SmolLM2-135M-Instruct.Q4_1.gguf)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${KVMESH_REF_VENV:-$HOME/.cache/kvmesh/ref-venv}"
python="${PYTHON:-python3}"

case "$venv" in
  "$(cd "$here/../.." && pwd)"/*) echo "refusing to create the venv inside the repository: $venv" >&2; exit 1 ;;
esac

if [ ! -x "$venv/bin/python" ]; then
  echo "==> creating venv $venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
else
  echo "==> reusing venv $venv"
fi

echo "==> installing pinned packages (scripts/golden/requirements.txt)"
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  "$venv/bin/python" -m pip install --index-url "$TORCH_INDEX_URL" \
    "$(grep '^torch==' "$here/requirements.txt")"
fi
"$venv/bin/python" -m pip install -r "$here/requirements.txt"

echo "==> running make_golden.py $*"
exec "$venv/bin/python" "$here/make_golden.py" "$@"
