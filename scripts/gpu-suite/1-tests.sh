#!/usr/bin/env bash
# Stage 1, the most valuable: what the GPU is and what kvtier sees of it, then
# every GPU test (each kernel against the CPU executor on random and hostile
# inputs, registration of every device kind, CUDA-graph-safe calls, the
# bad-index poll). Dry run: the binaries start and list their tests.
source "$(dirname "$0")/common.sh"
run info 60 "$bundle/bin/kvtier" info
if [ "$dry" = 1 ]; then
  run gpu-tests-list 60 "$bundle/bin/gpu-tests" --list --ignored
else
  run gpu-tests 540 "$bundle/bin/gpu-tests" --ignored --test-threads=1
fi
