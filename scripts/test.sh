#!/usr/bin/env bash
# The test command (see README): installs the pinned CUDA compiler wheels and
# libclang into .tools/ (no root, no CUDA toolkit needed), checks that
# bindings/abi.rs matches kernels/abi.h, builds the library with its kernels,
# and runs every test that needs no GPU: the Rust tests, then builds the
# wheel as pip does (scripts/build-wheel.sh) and runs the Python package's
# tests against the installed wheel (in .tools/venv, on numpy, without
# torch) with the contract test against SGLang's published source, then the
# package's tests again with real torch and SGLang's own modules importable,
# once per supported SGLang release (scripts/sglang-env.sh: cached outside
# the clone, about 6 GB and 1.5-2 minutes the first time). The GPU
# tests (tests/gpu.rs, and the CUDA half of bindings/python/tests/test_torch.py)
# are skipped here; run them on a GPU machine. It changes nothing outside the
# checkout and that cache unless asked: KVTIER_TEST_AARCH64=1 (CI sets it)
# also cross-builds the aarch64 wheel, which installs Debian's cross tools
# and a rustup target.
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests that import SGLang's real modules, run against each supported
# release (the newest runs every test of the package).
SGLANG_TESTS=(
  bindings/python/tests/test_real_sglang.py
  bindings/python/tests/test_sglang_kernel_tests.py
  bindings/python/tests/test_sglang_coordinator.py
  bindings/python/tests/test_install.py
  bindings/python/tests/test_engram_sglang.py
  bindings/python/tests/test_hicache_sglang.py
  bindings/python/tests/test_hicache_host_pool.py
)

scripts/install-tools.sh

# What the tests publish beside pools (swap-in counters) goes to a run dir of
# this run's own, which they must leave empty (checked at the end): nothing
# in /dev/shm.
export KVTIER_RUN_DIR="$PWD/target/test-run-dir"
rm -rf "$KVTIER_RUN_DIR"
install -d -m 0755 "$KVTIER_RUN_DIR"   # this mode whatever the umask (a group-writable run dir is refused)

echo "== bindings/abi.rs is current"
scripts/regen-bindings.sh --check

echo "== what each kernel costs an SM (ptxas)"
scripts/kernel-resources.sh
scripts/kernel-resources-in-a-clone.sh

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

echo "== kvtier bench --quick (every scenario and method; JSON lines and the figures)"
KVTIER_COMMIT=$(git rev-parse HEAD 2>/dev/null || true) \
  cargo run --release --locked --quiet -- bench --quick --json target/bench-quick.jsonl --plot target/bench-quick-figures

echo "== kvtier bench --scenario decode-step --replay-only (every committed trace recipe regenerated, each step replayed and every row's misses checked against its recorded outcome; about 4 minutes)"
cargo run --release --locked --quiet -- bench --scenario decode-step --replay-only --executor cpu --pool-memory 512MiB \
  | tee target/decode-step-replay.log
replayed=$(grep -c '^decode-step [^:]*: .*replayed [0-9]* steps' target/decode-step-replay.log || true)
committed=$(ls bench/traces/*.json | wc -l)
if [ "$replayed" != "$committed" ]; then
  echo "decode-step replayed $replayed traces, bench/traces/ holds $committed" >&2
  exit 1
fi

echo "== kvtier selftest --cpu (a dry run of the GPU selftest on the CPU executor)"
cargo run --release --locked --quiet -- selftest --cpu --cases 8 --json target/selftest-cpu.jsonl

# The aarch64 wheel installs Debian's cross tools and a rustup target (as
# root), outside the checkout: only when asked (CI asks).
if [ "${KVTIER_TEST_AARCH64:-0}" = 1 ]; then
  echo "== the wheels: pip's isolated build of bindings/python, auditwheel, an sdist and a wheel built from it, the aarch64 wheel"
  scripts/build-wheel.sh --sdist --aarch64
else
  echo "== the wheels: pip's isolated build of bindings/python, auditwheel, an sdist and a wheel built from it"
  echo "   (not the aarch64 wheel: KVTIER_TEST_AARCH64=1 cross-builds it, installing Debian's cross tools as root)"
  scripts/build-wheel.sh --sdist
fi
wheel=$(ls target/wheelhouse/kvtier-*-manylinux_*_x86_64.whl)

echo "== Python package (the installed wheel) on numpy, without torch"
.tools/venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$wheel"
KVTIER_WHEEL="$wheel" KVTIER_EXPECT_INSTALLED=1 KVTIER_SGLANG_TREES="$PWD/.tools/sglang" KVTIER_REQUIRE_SGLANG_SOURCE=1 \
  .tools/venv/bin/python -m pytest -q -p no:cacheprovider bindings/python/tests

echo "== Python package with real torch, and SGLang's own modules per supported release (scripts/sglang-env.sh)"
scripts/sglang-env.sh
.tools/torch-venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$wheel"
for v in 0.5.23 0.5.22 0.5.21; do
  if [ "$v" = 0.5.23 ]; then
    # every test of the package, with real torch and SGLang importable
    tests=(bindings/python/tests)
  else
    tests=("${SGLANG_TESTS[@]}")
  fi
  echo "-- real torch $(.tools/torch-venv/bin/python -c 'import torch; print(torch.__version__)'), SGLang $v"
  KVTIER_REAL_SGLANG=$v PYTHONPATH="$PWD/.tools/sglang/$v" KVTIER_WHEEL="$wheel" KVTIER_EXPECT_INSTALLED=1 \
    KVTIER_SGLANG_TREES="$PWD/.tools/sglang" KVTIER_REQUIRE_SGLANG_SOURCE=1 \
    .tools/torch-venv/bin/python -m pytest -q -p no:cacheprovider -W ignore::UserWarning -W ignore::DeprecationWarning \
    "${tests[@]}"
done

echo "== kvtier info"
cargo run --locked --quiet -- info

echo "== the tests left nothing in the run dir"
left=$(find "$KVTIER_RUN_DIR" -mindepth 1 | head -20)
if [ -n "$left" ]; then
  echo "the tests left these in $KVTIER_RUN_DIR (a client that closes its pool removes what it published):"
  echo "$left"
  exit 1
fi
