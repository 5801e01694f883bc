#!/usr/bin/env bash
# Disassembles the swap-in planners kvtier builds and SGLang's own swap-in
# kernel into target/sass/, for reading the SASS (the access chains counted
# in kernels/swap_in_few_miss.cu's doc comment). cuobjdump and nvdisasm come
# from PyPI into .tools/sass/ (their own pin: NVIDIA publishes them there
# only from 13.2 on, so they cannot share the 13.0 set of install-tools.sh;
# a disassembler reads older cubins). Needs a release build (cargo build
# --release: its cubins stay in OUT_DIR) and, for SGLang's kernel,
# scripts/sglang-kernels.sh's library. Not part of the test command.
set -euo pipefail
cd "$(dirname "$0")/.."
pins=(nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37)
tools=.tools/sass
if [ "$(cat "$tools/.kvtier-pins" 2>/dev/null)" != "${pins[*]}" ]; then
  rm -rf "$tools"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$tools" "${pins[@]}"
  echo "${pins[*]}" > "$tools/.kvtier-pins"
fi
export PATH="$PWD/$tools/nvidia/cu13/bin:$PATH"
out=target/sass
mkdir -p "$out"
cubin=$(ls -t target/release/build/kvtier-*/out/kvtier.sm_90.cubin 2>/dev/null | head -1 || true)
[ -n "$cubin" ] || { echo "sass: no sm_90 cubin; run cargo build --release first" >&2; exit 1; }
for k in kvt_swap_in_compact_plan kvt_swap_in_few_miss_plan kvt_swap_in_plan kvt_swap_in_copy; do
  cuobjdump -sass -fun "$k" "$cubin" > "$out/$k.sm_90.sass"
  echo "sass: $out/$k.sm_90.sass ($(grep -c '^        /\*[0-9a-f]*\*/' "$out/$k.sm_90.sass") instructions)"
done
lib=.tools/sglang-kernels/libkvt_sglang_kernels.so
if [ -f "$lib" ]; then
  # SGLang 0.5.23's load_cache_to_device_buffer_kernel: 1024 threads, top-k 2048, HOT 4096, int32 indices
  fn='_ZN6sglang34load_cache_to_device_buffer_kernelILi1024ELi2048ELi4096ELb1ELb0ELi1ELb0ELb0ELb0EiiEEvPKiPiPKlS2_PKvS7_PvS8_S3_PKT9_PKT8_PsS2_lllllllPlS3_S3_l'
  # (cuobjdump's -fun does not find it in the library: cut its block from the whole listing)
  cuobjdump -sass "$lib" | awk -v fn="$fn" '
    /Function : / { on = ($3 == fn) }
    on' > "$out/sglang_load_cache_to_device_buffer_kernel.sm_90a.sass"
  [ -s "$out/sglang_load_cache_to_device_buffer_kernel.sm_90a.sass" ] || { echo "sass: $fn not in $lib" >&2; exit 1; }
  echo "sass: $out/sglang_load_cache_to_device_buffer_kernel.sm_90a.sass"
else
  echo "sass: $lib is missing (scripts/sglang-kernels.sh builds it); SGLang's kernel skipped"
fi
