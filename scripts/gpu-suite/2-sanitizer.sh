#!/usr/bin/env bash
# Stage 2: compute-sanitizer over the GPU tests (H100 machines have it; where
# it is missing the stage says so). memcheck over every kernel test except the
# registration ones (no kernel of their own) and the two largest shapes
# (minutes under memcheck; their kernels are the random cases' at full size);
# racecheck and synccheck, much slower, over the tests of the kernels that use
# shared memory and barriers (swap-in, replay, speculative swap-in) and the
# gather and writeback ones. Each tool fits its own time limit, so the stage
# fits one device command. memcheck ignores API errors: one test makes a
# call fail on purpose (pageable memory has no device address).
source "$(dirname "$0")/common.sh"
if ! command -v compute-sanitizer >/dev/null; then
  log "compute-sanitizer is not on this machine: stage skipped"
  exit 0
fi
tests="$bundle/bin/gpu-tests"
skip=(--skip registration_ --skip largest_shape --skip full_size_batches)
barrier_tests=(swap_in_matches_cpu_on_random_cases replays_match_cpu spec_swap_in_matches gather_matches_cpu writeback_matches_cpu)
if [ "$dry" = 1 ]; then
  for tool in memcheck racecheck synccheck; do
    run "$tool" 60 compute-sanitizer --tool "$tool" --version
  done
  run list 60 "$tests" --list --ignored "${skip[@]}"
elif [ "$quick" = 1 ]; then
  # The quick pass, with what time is left: the kernels never run under a
  # sanitizer (the compact planners, the line-aligned copies), memcheck then
  # racecheck and synccheck over their tests
  changed=(swap_in_matches_cpu_on_random_cases the_compact_planner gather_matches_cpu writeback_matches_cpu)
  run memcheck 120 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 "$tests" --ignored --test-threads=1 "${changed[@]}"
  # racecheck and synccheck did not finish the swap-in test's 320 cases in
  # 120 and 53 s on an H100 (2026-11-27; a whole run took 160 s before the
  # third copy method): 8 seeds of each kind of case
  # (every strategy and copy method on each), so that they finish
  export KVTIER_GPU_TEST_SEEDS=8
  run racecheck 120 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 "$tests" --ignored --test-threads=1 swap_in_matches_cpu_on_random_cases
  run synccheck 90 compute-sanitizer --tool synccheck --error-exitcode 9 "$tests" --ignored --test-threads=1 swap_in_matches_cpu_on_random_cases
  unset KVTIER_GPU_TEST_SEEDS
else
  run memcheck 220 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 "$tests" --ignored --test-threads=1 "${skip[@]}"
  run racecheck 170 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 "$tests" --ignored --test-threads=1 "${barrier_tests[@]}"
  run synccheck 120 compute-sanitizer --tool synccheck --error-exitcode 9 "$tests" --ignored --test-threads=1 "${barrier_tests[@]}"
fi
