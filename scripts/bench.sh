#!/usr/bin/env bash
# The main job (see README): `kvtier bench`, the top-k fetch microbenchmark,
# built with its CUDA kernels. Installs the pinned CUDA compiler wheels into .tools/
# first (as scripts/test.sh does; no root, no CUDA toolkit), so that on a GPU
# machine the first run measures the GPU. Arguments go to `kvtier bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-tools.sh
exec cargo run --release --locked --quiet -- bench "$@"
