#!/usr/bin/env bash
# Builds, here (with cargo), everything the GPU suite (scripts/gpu-suite/)
# needs on a GPU machine that has no cargo and no network: the kvtier binary
# (and a second one whose kernels nvcc 13.0 built, for stage 3's comparison),
# the GPU test binary, the library, the Python package with its extension
# module, the Python tests and benchmark, pytest's wheels, and a build of
# SGLang's own HiSparse kernels for the bench to compare with
# (scripts/sglang-kernels.sh), stripped, into gpu-bundle/ (ignored by git; at
# most 64 MiB, the most a device run carries).
# Then dry-runs every stage on this machine's CPU, so the first GPU run does
# not fail on a path or a missing file. Usage: scripts/gpu-bundle.sh [--no-dry-run]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=gpu-bundle
scripts/install-tools.sh
scripts/python-env.sh >/dev/null
scripts/sglang-kernels.sh >/dev/null
export KVTIER_REQUIRE_KERNELS=1
export PYO3_PYTHON="$root/.tools/venv/bin/python"
# The GPU machines are sm_90 (H100, H200): their SASS and PTX only
# (build.rs), a third of the fatbin each of five binaries embeds, so the
# bundle and the quick pass's carry keep room under 64 MiB as the tree's
# results grow. Its own target folder, so the development build keeps every
# architecture (kvtier info says which a build carries).
export KVTIER_ARCHS=90
export CARGO_TARGET_DIR=target/bundle
cargo build --release --locked --workspace
gpu_tests=$(cargo test --release --locked --test gpu --no-run --message-format=json 2>/dev/null |
  "$PYO3_PYTHON" -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
[ -x "$gpu_tests" ] || { echo "gpu-bundle: the GPU test binary was not built" >&2; exit 1; }
# The same commit's kvtier with its kernels built by nvcc 13.0 (the pinned
# wheel's), which stage 3 times beside the NVRTC build: a difference between
# the two is the compiler's, not the code's. Its own target folder, so the
# bundle's other kernels stay NVRTC's.
NVCC="$root/.tools/py/nvidia/cu13/bin/nvcc" CARGO_TARGET_DIR=target/nvcc \
  cargo build --release --locked --bin kvtier

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/python/kvtier" "$out/python/tests" "$out/wheels"
cp target/bundle/release/kvtier "$out/bin/kvtier"
cp "$gpu_tests" "$out/bin/gpu-tests"
cp target/nvcc/release/kvtier "$out/bin/kvtier-nvcc"
cp -r bindings/python/kvtier/. "$out/python/kvtier/"
find "$out/python" -name __pycache__ -prune -exec rm -rf {} +
cp target/bundle/release/libkvtier.so "$out/python/kvtier/libkvtier.so"
cp target/bundle/release/lib_native.so "$out/python/kvtier/_native.abi3.so"
cp bindings/python/tests/*.py "$out/python/tests/"
cp bindings/python/benchmarks/per_call.py bindings/python/benchmarks/engram_triton.py "$out/python/"
# SGLang 0.5.23's Triton Engram gather (torch and triton only), for the
# side-by-side timing of stage 4
cp .tools/sglang/0.5.23/sglang/kernels/ops/embeddings/engram_gather.py "$out/python/sglang_engram_gather.py"
cp .tools/sglang-kernels/libkvt_sglang_kernels.so "$out/lib/"
strip "$out/bin/"* "$out/python/kvtier/"*.so
"$root/.tools/venv/bin/python" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
  --python-version 3.10 --dest "$out/wheels" pytest==8.4.2 >/dev/null
git rev-parse HEAD > "$out/COMMIT"
size=$(du -sb "$out" | cut -f1)
echo "gpu-bundle: $out is $((size / 1048576)) MiB ($(git rev-parse --short HEAD))"
[ "$size" -le $((64 * 1048576)) ] || { echo "gpu-bundle: over the 64 MiB a device run carries" >&2; exit 1; }
# What the quick pass carries (quick-pass.sh: bin, lib and COMMIT) with the
# repository's tracked files must fit the 64 MiB too
tree=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
quick=$(( $(du -cb "$out/bin" "$out/lib" "$out/COMMIT" | tail -1 | cut -f1) + tree ))
echo "gpu-bundle: the quick pass carries $((quick / 1048576)) MiB (gpu-bundle/bin, lib and COMMIT, and the tracked tree)"
[ "$quick" -le $((64 * 1048576)) ] || { echo "gpu-bundle: the quick pass's carry is over 64 MiB" >&2; exit 1; }

if [ "${1:-}" != "--no-dry-run" ]; then
  dry=$(mktemp -d)
  for stage in scripts/gpu-suite/[0-9]-*.sh; do
    echo "gpu-bundle: dry run of $stage"
    GPU_SUITE_DRY_RUN=1 GPU_SUITE_PYTHON="$root/.tools/venv/bin/python" "$stage" "$dry" >/dev/null
    # a step that failed is recorded and the stage goes on: fail here (the
    # selftest's 77 is its "no GPU here", expected on this machine)
    name=$(basename "$stage" .sh)
    failed=$(tar xzf "$dry/$name.tar.gz" -O ./exit-codes.txt 2>/dev/null \
      | awk '$2 != 0 && !($1 == "selftest-no-gpu" && $2 == 77)' || true)
    [ -z "$failed" ] || { echo "gpu-bundle: dry run of $stage failed: $failed" >&2; exit 1; }
  done
  ls -la "$dry"
  rm -rf "$dry"
fi
