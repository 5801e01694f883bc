#!/usr/bin/env bash
# Stage 1, the most valuable: what the GPU is and what kvtier sees of it,
# `kvtier selftest` (every kernel kvtier serves against the CPU executor, the per-layer
# calls in a CUDA graph, the link; its table in selftest.log, one JSON line
# per check in selftest.jsonl), then every GPU test (random and hostile
# inputs, registration of every device kind, the bad-index poll), and the
# registration tests with their timings (a pool of tens of GiB, two
# processes sharing one pool on one GPU). Dry run:
# the selftest says there is no GPU (exit 77) and runs on the CPU executor,
# and the test binary lists its tests.
source "$(dirname "$0")/common.sh"
run info 60 "$bundle/bin/kvtier" info
if [ "$dry" = 1 ]; then
  run selftest-no-gpu 60 "$bundle/bin/kvtier" selftest
  run selftest 300 "$bundle/bin/kvtier" selftest --cpu --cases 4 --json "$logs/selftest.jsonl"
  run gpu-tests-list 60 "$bundle/bin/gpu-tests" --list --ignored
else
  run selftest 150 "$bundle/bin/kvtier" selftest --json "$logs/selftest.jsonl"
  # One command a test, so that the log says what each took and a slow test
  # stops only itself (the H200 pass of 2026-11-28 spent its whole 300 s
  # limit before swap_in_production_shapes had finished). The quick pass
  # runs the random-case tests on fewer seeds (KVTIER_GPU_TEST_SEEDS; every
  # strategy and copy method still runs on each).
  run gpu-tests-list 60 "$bundle/bin/gpu-tests" --list --ignored
  tests=$(sed -n 's/: test$//p' "$logs/gpu-tests-list.log" | grep -v '^registration_' || true)
  if [ -z "$tests" ]; then  # a failure, not a pass of no test
    log "== gpu-tests: the test binary listed no test"
    echo "gpu-tests-list 1 no test listed" >>"$logs/exit-codes.txt"
  fi
  if [ "$quick" = 1 ]; then export KVTIER_GPU_TEST_SEEDS=${KVTIER_GPU_TEST_SEEDS:-25}; fi
  for t in $tests; do
    run "gpu-test-$t" 150 "$bundle/bin/gpu-tests" --ignored --exact "$t" --test-threads=1
  done
  # A pool of tens of GiB, two processes sharing one pool: their figures
  # (registration time) are printed, hence --nocapture. Not in the quick
  # pass: no kernel of their own, and their code has not changed since they
  # passed on both GPUs.
  [ "$quick" = 1 ] || run gpu-registration 100 "$bundle/bin/gpu-tests" registration_ --ignored --test-threads=1 --nocapture
fi
