#!/usr/bin/env bash
# Stage 6: what a decode step costs in swap-ins (kvtier bench --scenario
# decode-step): every layer's swap-in of each step of a trace captured in a
# CUDA graph at SGLang's padded batch and replayed, beside SGLang 0.5.23's
# own kernel in a graph of its own and the link's floor, each row's misses
# checked against the trace's recorded outcome first. The committed
# synthetic traces (bench/traces/, selections calibrated to the published
# miss rate for a 4096-slot buffer): DeepSeek-V3.2 at 128K for batch 8 to
# 128, DeepSeek-V4-Flash's C4 layers and MiniMax-M3 at batch 64; then a
# trace with shared-index layers (SGLang's index_topk_freq 4 on
# DeepSeek-V3.2's shape, a synthetic configuration), whose replays are timed
# on a second stream against in order, a 100 us compute stand-in after every
# layer. Its own stage (its own device command): each trace is synthesized
# on the host, a step at a time (about 3 s a step at batch 128 on this
# machine's CPU), before the GPU replays it; the stage is estimated at 3 to
# 5 minutes, not yet measured. Dry run: the quick grid on the CPU executor.
source "$(dirname "$0")/common.sh"
export KVTIER_SGLANG_KERNELS="$bundle/lib/libkvt_sglang_kernels.so"
bench() {
  local name=$1 secs=$2; shift 2
  run "$name" "$secs" "$bundle/bin/kvtier" bench "$@" --json "$logs/$name.jsonl"
}
if [ "$dry" = 1 ]; then
  bench decode-step-quick 120 --quick --scenario decode-step --trace dsv32-32k-b8
  run synth-shared 60 "$bundle/bin/kvtier" trace synth --model deepseek-v3.2 --requests 5 --context 8192 \
    --hot 4096 --steps 2 --warmup-steps 1 --miss-rate published --index-topk-freq 4 \
    --recipe "$logs/dsv32-shared4-8k-b5.json"
  bench decode-step-quick-shared4 120 --quick --scenario decode-step --trace "$logs/dsv32-shared4-8k-b5.json"
else
  # The full set, or the quick pass's: one batch of each model, DeepSeek-V3.2
  # at batch 8 too; then the shared-index trace
  if [ "$quick" = 1 ]; then
    traces="dsv32-128k-b64 dsv4flash-128k-b64 m3-128k-b64 dsv32-128k-b8" secs=100 max=0.5 pool=8GiB
  else
    traces="dsv32-128k-b64 dsv32-128k-b8 dsv32-128k-b32 dsv32-128k-b128 dsv4flash-128k-b64 m3-128k-b64"
    secs=150 max=1 pool=12GiB
  fi
  for t in $traces; do
    bench "decode-step-$t" "$secs" --scenario decode-step --trace "$t" --max-seconds "$max" --pool-memory "$pool"
  done
  run synth-shared 120 "$bundle/bin/kvtier" trace synth --model deepseek-v3.2 --requests 64 --context 131072 \
    --hot 4096 --steps 3 --warmup-steps 2 --miss-rate published --index-topk-freq 4 \
    --recipe "$logs/dsv32-shared4-128k-b64.json"
  bench decode-step-shared4 "$secs" --scenario decode-step --trace "$logs/dsv32-shared4-128k-b64.json" \
    --max-seconds "$max" --pool-memory "$pool" --compute-us 100
fi
