#!/usr/bin/env bash
# Prints what each kernel costs an SM, read from the library's own build
# (build.rs keeps ptxas's report and the cubins it packed into the fatbin):
# registers, spills, static shared memory, barriers, and the blocks per SM
# its registers allow at its block size (sm_80 and sm_90: 64 K registers,
# 2048 threads, 32 blocks per SM; registers allocated 256 per warp), and
# its code size in SASS instructions (the cubin's .text.<kernel> section,
# 16 bytes an instruction, read with readelf: the compiler wheels ship no
# cuobjdump). CI runs it, so a change in any of these shows in review. Needs
# the kernels' compiler (scripts/install-tools.sh) and readelf.
set -euo pipefail
cd "$(dirname "$0")/.."
# cargo's own output is kept, and shown if the build fails or names no
# build-script output of this package
log=$(mktemp)
trap 'rm -f "$log"' EXIT
out_dir=$(KVTIER_REQUIRE_KERNELS=1 cargo build --release --locked -p kvtier --lib --message-format=json 2>"$log" |
  python3 "$(pwd)/scripts/cargo-out-dir.py" kvtier) || { cat "$log" >&2; echo "kernel-resources: cargo build failed" >&2; exit 1; }
[ -n "$out_dir" ] || { cat "$log" >&2; echo "kernel-resources: cargo named no build-script output of kvtier" >&2; exit 1; }
[ -f "$out_dir/ptxas.log" ] || { echo "kernel-resources: the library was built without its kernels' report (no $out_dir/ptxas.log)" >&2; exit 1; }
threads_of() {  # the kernel's block size (src/cuda/kernels.rs)
  case "$1" in
    kvt_swap_in_compact_plan) grep -oP 'KVT_SWAP_COMPACT_THREADS \K[0-9]+' kernels/abi.h ;;
    kvt_swap_in_plan) grep -oP 'KVT_SWAP_PLAN_THREADS \K[0-9]+' kernels/abi.h ;;
    kvt_swap_in_few_miss_plan|kvt_swap_in_few_miss_lines_plan|kvt_swap_in_few_miss_k2048_h4096_plan|kvt_swap_in_few_miss_k2048_h8192_plan|kvt_swap_in_few_miss_k2048_h4096_lines_plan|kvt_swap_in_few_miss_k2048_h8192_lines_plan|kvt_swap_in_few_miss_cluster_plan|kvt_swap_in_split_plan) grep -oP 'KVT_SWAP_FEW_MISS_THREADS \K[0-9]+' kernels/abi.h ;;
    kvt_swap_in_few_miss_512_plan) grep -oP 'KVT_SWAP_FEW_MISS_512_THREADS \K[0-9]+' kernels/abi.h ;;
    kvt_spec_swap_in) grep -oP 'KVT_SPEC_THREADS \K[0-9]+' kernels/abi.h ;;
    kvt_error_take) echo 32 ;;
    *) echo 256 ;;
  esac
}
# instructions NAME CUBIN: the size of .text.NAME over 16.
instructions() {
  readelf -SW "$2" 2>/dev/null | python3 -c '
import re, sys
for line in sys.stdin:
    m = re.search(r"\]\s+\.text\.(\w+)\s+PROGBITS\s+[0-9a-f]+\s+[0-9a-f]+\s+([0-9a-f]+)", line)
    if m and m.group(1) == sys.argv[1]:
        print(int(m.group(2), 16) // 16)
        break
' "$1"
}
printf '%-29s %-6s %5s %7s %8s %9s %14s %7s\n' kernel arch regs spills smem_B barriers blocks_per_SM instrs
for arch in 80 90; do
  cubin="$out_dir/kvtier.sm_$arch.cubin"
  python3 -c '
import re, sys
arch, name = sys.argv[1], None
for line in open(sys.argv[2]):
    m = re.search(r"Compiling entry function .(\w+). for .sm_(\d+).", line)
    if m:
        name = m.group(1) if m.group(2) == arch else None
        spill = 0
        continue
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and name:
        spill = int(m.group(1)) + int(m.group(2))
    m = re.search(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?", line)
    if m and name:
        print(name, m.group(1), spill, m.group(3) or 0, m.group(2) or 0)
        name = None
' "$arch" "$out_dir/ptxas.log" | sort | while read -r name regs spill smem barriers; do
    threads=$(threads_of "$name")
    warps=$(( (threads + 31) / 32 ))
    per_warp=$(( (regs * 32 + 255) / 256 * 256 ))
    by_regs=$(( 65536 / (per_warp * warps) ))
    by_threads=$(( 2048 / threads ))
    blocks=$(( by_regs < by_threads ? by_regs : by_threads ))
    blocks=$(( blocks < 32 ? blocks : 32 ))
    instrs=-
    [ -f "$cubin" ] && instrs=$(instructions "$name" "$cubin")
    printf '%-29s sm_%-3s %5s %7s %8s %9s %8s (x%s) %7s\n' "$name" "$arch" "$regs" "$spill" "$smem" "$barriers" \
      "$blocks" "$threads" "$instrs"
  done
done
echo "smem_B is static shared memory; kvt_swap_in_plan, the few-miss planners (kvt_swap_in_few_miss_plan, its _lines_ build, kvt_swap_in_few_miss_512_plan), kvt_swap_in_compact_plan and kvt_swap_in_copy also take dynamic shared memory sized per call (src/swap_in/cuda.rs), kvt_spec_swap_in KVT_SPEC_SMEM_BYTES (kernels/abi.h)."
