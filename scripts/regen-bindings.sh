#!/usr/bin/env bash
# Regenerates bindings/abi.rs from kernels/abi.h with bindgen (pinned, with the
# pinned libclang from install-tools.sh). `--check` writes nothing and fails
# when the checked-in file is stale.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-tools.sh"
export LIBCLANG_PATH="$root/.tools/py/clang/native"
CARGO_TARGET_DIR="$root/target/abi-bindgen" cargo run --quiet --locked \
  --manifest-path "$root/scripts/abi-bindgen/Cargo.toml" -- "$root" "$@"
