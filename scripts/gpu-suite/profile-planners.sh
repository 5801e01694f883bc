#!/usr/bin/env bash
# Where the compact planner's time goes: the quick pass of 2026-11-27
# (bench/results/h100-2026-11-27) measured it at 93 us a call at batch 1,
# 2 misses, HOT 4096, against the few-miss planner's 20 us, and its cost
# growing with HOT (131 us at 8192). Nsight Compute on one launch of each
# planner at that point (--set full, clocks as found), with every section's
# tables and the per-instruction SASS page (warp-state samples per
# instruction: which loop stalls), then the few-miss planner at batch 256
# (the point furthest behind SGLang's kernel), then racecheck over the
# swap-in test with what time is left. Usage (on the device, gpu-bundle/
# carried): scripts/gpu-suite/profile-planners.sh OUT_DIR [SECONDS]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out_dir=${1:?usage: $0 OUT_DIR [SECONDS]}
export GPU_SUITE_DEADLINE=$(($(date +%s) + ${2:-240}))
source "$here/common.sh" "$out_dir"
kvtier="$bundle/bin/kvtier"
# profile NAME KERNEL_REGEX BENCH_ARGS...: one launch, a report file, then its
# details and SASS pages as text
profile() {
  local name=$1 kernels=$2; shift 2
  run "$name" 90 ncu --clock-control none --set full --import-source no -k "regex:$kernels" -c 1 \
    -o "$logs/$name" "$kvtier" bench --max-seconds 0.1 "$@"
  [ -f "$logs/$name.ncu-rep" ] || return 0
  run "$name-details" 30 ncu -i "$logs/$name.ncu-rep" --page details --print-details all
  run "$name-sass" 30 ncu -i "$logs/$name.ncu-rep" --page source --print-source sass --csv
  rm -f "$logs/$name.ncu-rep"
}
point=(--scenario swap-in --entry 656 --hot 4096 --misses 2)
profile compact-b1 compact_plan "${point[@]}" --batch 1
profile few-miss-b1 few_miss_plan "${point[@]}" --batch 1
profile few-miss-b256 few_miss_plan "${point[@]}" --batch 256
run racecheck 300 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 \
  "$bundle/bin/gpu-tests" --ignored --test-threads=1 swap_in_matches_cpu_on_random_cases
