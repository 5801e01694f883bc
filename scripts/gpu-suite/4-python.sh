#!/usr/bin/env bash
# Stage 4: the Python package on torch CUDA tensors (test_torch.py and
# test_engram_gather.py, whose CUDA halves have never run), the per-call
# cost of the SGLang entry points on CUDA tensors (plain tensors read the
# fastest way this torch allows, then through to_dlpack), and kvtier's Engram
# gather against SGLang's own Triton kernel (engram_triton.py; its rows say
# so where triton is missing). Needs python3 with torch and numpy (pytest comes from the
# bundle's wheels). Dry run: the same on numpy, without torch.
source "$(dirname "$0")/common.sh"
# The device's python3; the bundle's dry run passes one with numpy.
py=${GPU_SUITE_PYTHON:-python3}
site=$(mktemp -d)
"$py" -m pip install --quiet --no-index --find-links "$bundle/wheels" --target "$site" pytest >/dev/null
export PYTHONPATH="$bundle/python:$bundle/python/tests:$site"
if [ "$dry" = 1 ]; then
  run pytest 300 "$py" -m pytest -q -p no:cacheprovider "$bundle/python/tests/test_swap_in.py" \
    "$bundle/python/tests/test_engram_gather.py"
  run per-call 120 "$py" "$bundle/python/per_call.py" --device cpu --calls 200 --json "$logs/per-call.jsonl"
  run engram-triton 60 "$py" "$bundle/python/engram_triton.py" --reps 3 --json "$logs/engram-triton.jsonl"
else
  run pytest 400 "$py" -m pytest -q -p no:cacheprovider "$bundle/python/tests/test_torch.py" \
    "$bundle/python/tests/test_engram_gather.py"
  run per-call 120 "$py" "$bundle/python/per_call.py" --device cuda --json "$logs/per-call-cuda.jsonl"
  # the same through to_dlpack: what reading torch's exchange table (the
  # first run's reader where this torch has one) saves on a GPU
  run per-call-to_dlpack 120 "$py" "$bundle/python/per_call.py" --device cuda --reader to_dlpack \
    --json "$logs/per-call-cuda-to_dlpack.jsonl"
  run engram-triton 150 "$py" "$bundle/python/engram_triton.py" --rows 8388608 --reps 30 \
    --sglang-kernel "$bundle/python/sglang_engram_gather.py" --json "$logs/engram-triton.jsonl"
fi
