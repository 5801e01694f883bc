#!/usr/bin/env bash
# Installs the pinned build tools kvtier needs into .tools/py (no root, no
# CUDA toolkit): nvcc and its companions from NVIDIA's PyPI wheels (a mixed
# set fails in ptxas, so all five are pinned together), and libclang for the
# bindgen check of bindings/abi.rs. build.rs finds nvcc there by itself.
# Idempotent: does nothing when the pinned set is already installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.tools/py"
pins=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  libclang==18.1.1
)
stamp="$dest/.kvtier-pins"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]}" ] && [ -x "$dest/nvidia/cu13/bin/nvcc" ]; then
  exit 0
fi
python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "install-tools: python3 with pip is needed" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest"
echo "install-tools: installing ${pins[*]} into $dest"
"$python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target "$dest" "${pins[@]}"
echo "${pins[*]}" > "$stamp"
"$dest/nvidia/cu13/bin/nvcc" --version | tail -n 2
