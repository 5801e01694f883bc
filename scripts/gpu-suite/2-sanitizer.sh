#!/usr/bin/env bash
# Stage 2: compute-sanitizer memcheck, racecheck and synccheck over the GPU
# tests (H100 machines have it; where it is missing the stage says so).
source "$(dirname "$0")/common.sh"
if ! command -v compute-sanitizer >/dev/null; then
  log "compute-sanitizer is not on this machine: stage skipped"
  exit 0
fi
for tool in memcheck racecheck synccheck; do
  if [ "$dry" = 1 ]; then
    run "$tool" 60 compute-sanitizer --tool "$tool" --version
  else
    run "$tool" 170 compute-sanitizer --tool "$tool" --error-exitcode 9 "$bundle/bin/gpu-tests" --ignored --test-threads=1
  fi
done
