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
  # 20 s on the H200 of 2026-11-28; the quick pass cuts a selftest that
  # hangs (a new kernel in its graph check) at 60 s
  run selftest "$([ "$quick" = 1 ] && echo 60 || echo 150)" "$bundle/bin/kvtier" selftest --json "$logs/selftest.jsonl"
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
  # The quick pass gives the tests GPU_SUITE_TESTS_SECONDS in all (150:
  # with the selftest's ~20 s, under three minutes), so that the bench, the
  # copy methods and the decode step always get their turn (stage 1 of the
  # H200 pass of 2026-11-28 took 300 s and left them none), and runs the
  # random-case tests on 10 seeds (every strategy and copy method still runs
  # on each). The tests of the kernels changed since the last GPU run come
  # first (GPU_SUITE_TESTS_FIRST: the default's two sm_90 builds at the
  # production shapes, which the H200 runs of 2026-11-28 chose and no GPU
  # test has yet compared with the CPU executor at their shapes for the
  # fixed-shape build with line-aligned copies; the largest shape is one
  # case, the random cases are small), then the others (kernels that
  # passed on both GPUs since their last change; per-test times are not
  # yet measured), and last the production shapes (GPU_SUITE_TESTS_LAST:
  # cases of up to 258 MB each; still running when the 300 s limit of all
  # the tests ended them on the H200 of 2026-11-28), with what is left. A test runs at
  # most 150 s or what is left of the budget; those that find under 10 s
  # left are skipped, each named in the log. --nocapture: a test cut by its
  # limit still shows the cases it passed (the heavy swap-in tests print
  # one line a case).
  budget_end=
  if [ "$quick" = 1 ]; then
    export KVTIER_GPU_TEST_SEEDS=${KVTIER_GPU_TEST_SEEDS:-10}
    budget_end=$(($(date +%s) + ${GPU_SUITE_TESTS_SECONDS:-150}))
    first=${GPU_SUITE_TESTS_FIRST:-swap_in_default_builds_at_production_shapes swap_in_largest_shape swap_in_matches_cpu_on_random_cases}
    last=${GPU_SUITE_TESTS_LAST:-swap_in_production_shapes}
    # the names of $1 the binary listed (a name it did not list is left out)
    listed() {
      for t in $1; do if printf '%s\n' $tests | grep -x "$t" >/dev/null; then echo "$t"; fi; done
    }
    tests=$(
      listed "$first"
      printf '%s\n' $tests | grep -vxF -f <(printf '%s\n' $first $last) || true
      listed "$last"
    )
  fi
  for t in $tests; do
    secs=150
    if [ -n "$budget_end" ]; then
      left=$((budget_end - $(date +%s)))
      if [ "$left" -lt 10 ]; then
        log "== gpu-test-$t: skipped, the quick pass's ${GPU_SUITE_TESTS_SECONDS:-150} s for the tests are spent"
        echo "gpu-test-$t 124 skipped" >>"$logs/exit-codes.txt"
        continue
      fi
      [ "$left" -lt "$secs" ] && secs=$left
    fi
    run "gpu-test-$t" "$secs" "$bundle/bin/gpu-tests" --ignored --exact "$t" --test-threads=1 --nocapture
  done
  # A pool of tens of GiB, two processes sharing one pool: their figures
  # (registration time) are printed, hence --nocapture. Not in the quick
  # pass: no kernel of their own, and their code has not changed since they
  # passed on both GPUs.
  [ "$quick" = 1 ] || run gpu-registration 100 "$bundle/bin/gpu-tests" registration_ --ignored --test-threads=1 --nocapture
fi
