#!/usr/bin/env bash
# Stage 3: the bench's whole grid on the GPU, with JSON lines and a plot;
# the speculative swap-in also times SGLang's own kernels (the bundle's
# build of them). Dry run: the quick grid on the CPU executor.
source "$(dirname "$0")/common.sh"
export KVTIER_SGLANG_KERNELS="$bundle/lib/libkvt_sglang_kernels.so"
if [ "$dry" = 1 ]; then
  run bench 120 "$bundle/bin/kvtier" bench --quick --json "$logs/bench.jsonl" --plot "$logs/bench.png"
else
  run bench 560 "$bundle/bin/kvtier" bench --full --json "$logs/bench.jsonl" --plot "$logs/bench.png"
fi
