#!/usr/bin/env bash
# The test command (see README): installs the pinned CUDA compiler wheels and
# libclang into .tools/ (no root, no CUDA toolkit needed), checks that
# bindings/abi.rs matches kernels/abi.h, builds the library with its kernels,
# and runs every test that needs no GPU: the Rust tests, then the Python
# package's tests (installed with pip into .tools/venv, on numpy, without
# torch) and the contract test against SGLang's published source. The GPU
# tests (tests/gpu.rs, and the CUDA half of bindings/python/tests/test_torch.py)
# are skipped here; run them on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-tools.sh
export NVCC="${NVCC:-$PWD/.tools/py/nvidia/cu13/bin/nvcc}"

echo "== bindings/abi.rs is current"
scripts/regen-bindings.sh --check

echo "== what each kernel costs an SM (ptxas)"
scripts/kernel-resources.sh

if cargo fmt --version >/dev/null 2>&1; then
  echo "== cargo fmt --check"
  cargo fmt --all -- --check
fi
if cargo clippy --version >/dev/null 2>&1; then
  echo "== cargo clippy"
  cargo clippy --locked --workspace --all-targets -- -D warnings
fi

echo "== cargo test"
cargo test --locked

echo "== kvtier bench --quick (every scenario and method; JSON lines and a plot)"
cargo run --release --locked --quiet -- bench --quick --json target/bench-quick.jsonl --plot target/bench-quick.png

echo "== kvtier selftest --cpu (a dry run of the GPU selftest on the CPU executor)"
cargo run --release --locked --quiet -- selftest --cpu --cases 8 --json target/selftest-cpu.jsonl

echo "== Python package (bindings/python) with the release library"
scripts/python-env.sh
PYO3_PYTHON="$PWD/.tools/venv/bin/python" cargo build --release --locked -p kvtier --lib -p kvtier-python
.tools/venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation \
  --force-reinstall ./bindings/python
KVTIER_EXPECT_INSTALLED=1 KVTIER_SGLANG_TREES="$PWD/.tools/sglang" KVTIER_REQUIRE_SGLANG_SOURCE=1 \
  .tools/venv/bin/python -m pytest -q -p no:cacheprovider bindings/python/tests

echo "== kvtier info"
cargo run --locked --quiet -- info
