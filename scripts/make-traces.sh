#!/usr/bin/env bash
# Writes the committed decode-step trace recipes (bench/traces/*.json): the
# synthetic traces `kvtier bench --scenario decode-step` replays by default.
# Each is DeepSeek-V3.2, DeepSeek-V4-Flash (its C4 layers) or MiniMax-M3 as
# `kvtier plan` describes it, at batch 8, 32, 64 and 128 and contexts of 32K
# and 128K tokens, at SGLang's default hot buffer (4096 slots), its
# selections calibrated to HiSparse's published GLM-5.1 miss rate for that
# buffer (`--miss-rate published`): synthetic selections, an assumption of
# step-to-step locality, never measured traffic. Two warm-up steps (the
# first starts from an empty buffer, as SGLang's direct-to-host admission
# leaves a long request) and three measured ones. A recipe records its
# replay's misses per step and layer; CI regenerates every recipe and checks
# them (scripts/test.sh).
#
#   scripts/make-traces.sh            all of them (a few minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --quiet
kvtier=target/release/kvtier
out=bench/traces
mkdir -p "$out"
for ctx in 32 128; do
  for batch in 8 32 64 128; do
    tokens=$((ctx * 1024))
    "$kvtier" trace synth --model deepseek-v3.2 --requests "$batch" --context "$tokens" --hot 4096 \
      --steps 3 --warmup-steps 2 --miss-rate published --seed 1 --recipe "$out/dsv32-${ctx}k-b${batch}.json"
    # positions are C4 entries: 4 tokens each
    "$kvtier" trace synth --model deepseek-v4-flash --requests "$batch" --context $((tokens / 4)) --hot 4096 \
      --steps 3 --warmup-steps 2 --miss-rate published --seed 1 --recipe "$out/dsv4flash-${ctx}k-b${batch}.json"
    # block queries: 16 blocks of 128 tokens, the newest block always, runs of 2
    "$kvtier" trace synth --model minimax-m3 --requests "$batch" --context "$tokens" --hot 4096 \
      --steps 3 --warmup-steps 2 --miss-rate published --seed 1 --recent 1 --run-len 2 \
      --recipe "$out/m3-${ctx}k-b${batch}.json"
  done
done
