#!/usr/bin/env bash
# The GPU truth pass in one device command: stage 1 (the selftest and every
# GPU test), then each stage's quick grid (GPU_SUITE_QUICK=1): the swap-in
# and the copy methods (3), the decode step (6), and with what is left the
# rest of stage 3 (GPU_SUITE_QUICK=2: the gather at rows of 640, 656 and 768
# bytes, the nvcc build, a buffer of 1x top-k, 32K contexts, 2 MiB pool
# pages) and the sanitizers over the kernels that never ran
# under them (2). Every command
# is cut to end before the deadline, so every stage packs its archive into
# OUT_DIR even when time runs short. It needs gpu-bundle/bin, lib and
# COMMIT only (carry those three: the whole bundle and the tree are over
# the 64 MiB a run carries). Usage (on the device, those carried):
# scripts/gpu-suite/quick-pass.sh OUT_DIR [SECONDS] (default 540:
# a device command may run 600).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out_dir=${1:?usage: $0 OUT_DIR [SECONDS]}
export GPU_SUITE_DEADLINE=$(($(date +%s) + ${2:-540}))
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current \
  --format=csv >"$out_dir/machine.txt" 2>&1 || true
# GPU_SUITE_STAGES: another list of stages (STAGE or STAGE:PART), for a
# follow-up pass, e.g. "1-tests 3-bench:3 6-decode-step": the swap-in grids
# alone, then the decode step
for stage in ${GPU_SUITE_STAGES:-1-tests 3-bench 6-decode-step 3-bench:2 2-sanitizer}; do
  echo "quick-pass: $stage at $(date -u +%H:%M:%S)"
  part=${stage#*:}; [ "$part" = "$stage" ] && part=1
  GPU_SUITE_QUICK=$part "$here/${stage%:*}.sh" "$out_dir" || echo "quick-pass: $stage exited $?"
done
echo "quick-pass: done at $(date -u +%H:%M:%S)"
