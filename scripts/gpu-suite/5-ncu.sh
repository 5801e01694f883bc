#!/usr/bin/env bash
# Stage 5: Nsight Compute where kvtier is slower than its yardstick, one
# launch per kernel so the stage stays within a few minutes: the few-miss
# planner and SGLang 0.5.23's swap-in kernel side by side (`--set full`) at
# the swap-in points measured slower than SGLang's (2 misses at batch 1, 100
# and 256; 410 misses at batch 10), then the gather at the points furthest
# from the link (656-byte entries, batch 8 and 64, k 2048; 1152-byte entries,
# batch 1, k 256) and the writeback of a prefill chunk of 8192 tokens. One
# report per point (`ncu-*.txt`: every section's table, what the README of a results
# folder quotes). `--clock-control none` leaves the GPU's clocks as they are
# (ncu's default locks them near the base clock, so the durations of the
# first run's reports are longer than the bench's). Where ncu is missing the
# stage says so.
# Dry run: `ncu --version` where ncu exists, else the same skip.
source "$(dirname "$0")/common.sh"
if ! command -v ncu >/dev/null; then
  log "ncu (Nsight Compute) is not on this machine: stage skipped"
  exit 0
fi
export KVTIER_SGLANG_KERNELS="$bundle/lib/libkvt_sglang_kernels.so"
kvtier="$bundle/bin/kvtier"
if [ "$dry" = 1 ]; then
  run ncu-version 60 ncu --version
  exit 0
fi
# profile NAME SECONDS KERNEL_REGEX BENCH_ARGS...: the first launch of the
# kernels matching KERNEL_REGEX in a short bench run (`details=1`: with the
# tables the plain report leaves out)
profile() {
  local name=$1 secs=$2 kernels=$3; shift 3
  local extra=()
  [ "${details:-0}" = 1 ] && extra=(--print-details all)
  run "$name" "$secs" ncu --clock-control none --set full "${extra[@]}" -k "regex:$kernels" -c 1 \
    "$kvtier" bench --max-seconds 0.1 "$@"
}
for point in "656 256 4096 2" "512 1 4096 2" "512 100 4096 2" "512 10 4096 410"; do
  set -- $point
  for k in few_miss_plan load_cache; do
    profile "ncu-swap-in-$k-e$1-b$2-h$3-m$4" 60 "$k" --scenario swap-in --entry "$1" --batch "$2" --hot "$3" --misses "$4"
  done
done
# The warp-stall sampling and the source counters' tables, which the plain
# report leaves out (the first run's reports have no stall breakdown), at the
# slowest swap-in point only (a separate run: an ncu without the option
# fails this step alone).
details=1 profile ncu-swap-in-few_miss_plan-e656-b256-h4096-m2-details 90 few_miss_plan \
  --scenario swap-in --entry 656 --batch 256 --hot 4096 --misses 2
profile ncu-gather-e656-b8-k2048 60 kvt_gather --scenario gather --entry 656 --batch 8 --k 2048 --context 131072 --indices uniform
profile ncu-gather-e656-b64-k2048 60 kvt_gather --scenario gather --entry 656 --batch 64 --k 2048 --context 131072 --indices uniform
profile ncu-gather-e1152-b1-k256 60 kvt_gather --scenario gather --entry 1152 --batch 1 --k 256 --context 131072 --indices uniform
profile ncu-writeback-prefill-8192 60 kvt_writeback --scenario writeback --prefill-tokens 8192 --entry 656
# The bulk-copy gather (CopyMethod::BulkRuns, first timed by the quick pass):
# one bulk operation a row with uniform indices, runs of neighbours with
# locality, where the engine's per-operation cost shows
profile ncu-gather-bulk-e656-b64-k2048-uniform 60 kvt_gather_bulk_runs --scenario gather --entry 656 --batch 64 \
  --k 2048 --context 131072 --indices uniform
profile ncu-gather-bulk-e656-b64-k2048-locality 60 kvt_gather_bulk_runs --scenario gather --entry 656 --batch 64 \
  --k 2048 --context 131072 --indices locality
