#!/usr/bin/env bash
# Builds the bench-only library of SGLang's own HiSparse kernels,
# .tools/sglang-kernels/libkvt_sglang_kernels.so: kvtier's launcher
# (bench/sglang-kernels/*.cu) compiled with the pinned nvcc against the
# pinned SGLang wheel's kernel sources and the apache-tvm-ffi wheel's headers,
# both downloaded into .tools/ and never committed. The library needs only
# the CUDA driver at run time (the runtime is linked statically), so it runs
# on the GPU machines, which have no network and no tvm-ffi. `kvtier bench`
# times SGLang's kernels beside kvtier's when KVTIER_SGLANG_KERNELS names it;
# scripts/gpu-bundle.sh carries it. Hopper only (sm_90a): SGLang's kernels
# take their programmatic-dependent-launch path there.
set -euo pipefail
cd "$(dirname "$0")/.."

sglang=0.5.23   # the newest SGLang release kvtier is checked against
tvm_ffi=0.1.11  # the apache-tvm-ffi that release pins
dir=.tools/sglang-kernels
out="$dir/libkvt_sglang_kernels.so"

scripts/install-tools.sh
nvcc="${NVCC:-$PWD/.tools/py/nvidia/cu13/bin/nvcc}"
mkdir -p "$dir/wheels"
for req in "sglang==$sglang" "apache-tvm-ffi==$tvm_ffi"; do
  name="${req%%==*}"
  if ! ls "$dir/wheels/${name//-/_}-${req##*==}-"*.whl >/dev/null 2>&1; then
    echo "sglang-kernels: downloading the $req wheel"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version 3.11 --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 -d "$dir/wheels" "$req"
  fi
done

# Only the headers the kernels include.
python3 - "$dir" <<'PY'
import sys, zipfile, glob, pathlib
dir = pathlib.Path(sys.argv[1])
wanted = {
    "sglang": ("sglang/kernels/jit/csrc/kvcacheio/", "sglang/kernels/jit/include/"),
    "apache_tvm_ffi": ("tvm_ffi/include/",),
}
for prefix, parts in wanted.items():
    wheel = sorted(glob.glob(str(dir / "wheels" / f"{prefix}-*.whl")))[-1]
    with zipfile.ZipFile(wheel) as z:
        for n in z.namelist():
            if n.startswith(parts) and not n.endswith("/"):
                z.extract(n, dir / "src")
PY

jit="$dir/src/sglang/kernels/jit"
# Built already from these sources: nothing to do.
if [[ -f "$out" && -z "$(find bench/sglang-kernels kernels/abi.h scripts/sglang-kernels.sh "$dir/wheels" -newer "$out" -print -quit)" ]]; then
  echo "sglang-kernels: $out is up to date; set KVTIER_SGLANG_KERNELS=$PWD/$out for kvtier bench"
  exit 0
fi
echo "sglang-kernels: compiling SGLang $sglang's HiSparse kernels for sm_90a (a few minutes)"
flags=(-std=c++20 -O3 --expt-relaxed-constexpr -DSGL_CUDA_ARCH=900 -gencode arch=compute_90a,code=sm_90a
  -Xcompiler -fPIC -I "$jit/csrc" -I "$jit/include" -I "$dir/src/tvm_ffi/include" -I kernels)
# one translation unit per SGLang header (they define the same helpers)
objs=() pids=()
for src in bench/sglang-kernels/*.cu; do
  obj="$dir/$(basename "$src" .cu).o"
  "$nvcc" "${flags[@]}" -c "$src" -o "$obj" &
  objs+=("$obj") pids+=($!)
done
# every compile is waited for, so that none outlives a failed one
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
((failed == 0))
"$nvcc" -shared --cudart static -L "$PWD/.tools/py/nvidia/cu13/lib" -o "$out" "${objs[@]}"
strip --strip-unneeded "$out"
echo "sglang-kernels: wrote $out ($(du -h "$out" | cut -f1)); set KVTIER_SGLANG_KERNELS=$PWD/$out for kvtier bench"
