#!/usr/bin/env bash
# The test command (see README): installs the pinned CUDA compiler wheels and
# libclang into .tools/ (no root, no CUDA toolkit needed), checks that
# bindings/abi.rs matches kernels/abi.h, builds the library with its kernels,
# and runs every test that needs no GPU. The GPU tests (tests/gpu.rs) are
# #[ignore]d here; run them on a GPU machine with `-- --ignored`.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-tools.sh
export NVCC="${NVCC:-$PWD/.tools/py/nvidia/cu13/bin/nvcc}"

echo "== bindings/abi.rs is current"
scripts/regen-bindings.sh --check

if cargo fmt --version >/dev/null 2>&1; then
  echo "== cargo fmt --check"
  cargo fmt --all -- --check
fi
if cargo clippy --version >/dev/null 2>&1; then
  echo "== cargo clippy"
  cargo clippy --locked --all-targets -- -D warnings
fi

echo "== cargo test"
cargo test --locked

echo "== kvtier info"
cargo run --locked --quiet -- info
