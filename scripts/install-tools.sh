#!/usr/bin/env bash
# Installs the pinned build tools kvtier needs into .tools/py (no root, no
# CUDA toolkit), from PyPI:
# - the kernels' compiler, CUDA 12.9: NVRTC and nvFatbin (NVIDIA publishes
#   no CUDA 12 nvcc on PyPI; its 12.x nvcc wheels hold only ptxas). Their
#   SASS loads on every driver from R525 on. build.rs finds them here.
# - nvcc 13.0 and its companions, only for the SGLang kernels the GPU bench
#   compares against (scripts/sglang-kernels.sh: host code too, which NVRTC
#   cannot build). Each set stays in one release series: a mixed set fails
#   in ptxas.
# - libclang for the bindgen check of bindings/abi.rs.
# Idempotent: does nothing when the pinned set is already installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.tools/py"
pins=(
  nvidia-cuda-nvrtc-cu12==12.9.86
  nvidia-nvfatbin-cu12==12.9.82
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  libclang==18.1.1
)
stamp="$dest/.kvtier-pins"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]}" ] && [ -x "$dest/nvidia/cu13/bin/nvcc" ] \
  && [ -f "$dest/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ]; then
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
echo "install-tools: the kernels compile with ${pins[0]} and ${pins[1]}"
