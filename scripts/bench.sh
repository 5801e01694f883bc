#!/usr/bin/env bash
# The main job (see README): `kvtier bench`, the top-k fetch microbenchmark,
# built with its CUDA kernels. Installs the pinned CUDA compiler wheels into .tools/
# first (as scripts/test.sh does; no root, no CUDA toolkit), so that on a GPU
# machine the first run measures the GPU. Arguments go to `kvtier bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-tools.sh
# cargo says nothing for minutes on a first build: say what happens, and let
# its progress show
if [ -x target/release/kvtier ]; then
  echo "bench: building kvtier (cargo build --release; seconds when little changed)" >&2
else
  echo "bench: building kvtier and its CUDA kernels for the first time (cargo build --release: about a minute and a half on 2 cores)" >&2
fi
cargo build --release --locked --bin kvtier
echo "bench: running kvtier bench $*" >&2
exec target/release/kvtier bench "$@"
