#!/usr/bin/env bash
# Stage 3: the bench on the GPU, swap-in first (the figure kvtier is judged
# by): SGLang's own benchmark grid (512-byte items, batch 1/10/100, HOT
# 4096/8192, 2 and 410 misses of K 2048) and the production rows (656-byte
# fp8 DSA items, batch up to 256) and the realistic-miss rows, each with
# SGLang's own kernel beside kvtier's strategies, and the production rows
# again with the same commit's
# kernels built by nvcc 13.0; then the speculative swap-in beside SGLang's
# speculative kernels, the gather (128K context) and the writeback against the
# link, and the Engram gather (an 8 GiB table in mapped host memory). One
# JSON-lines file and log per scenario; the figures are drawn where cargo is,
# from the JSON (kvtier bench --from-json ... --plot DIR), since the GPU
# machines have no fonts. Stages 1, 3 and 4 took 4.4 minutes together on an
# H200 (2026-11-26), stage 3 about 3 of them (the JSON lines' timestamps:
# 1.5 s a swap-in point of 8 methods). Since then each swap-in point has 12
# methods (the compact strategies and two floor lines), the gather and the
# writeback one more, and the realistic-miss and host-pages runs are new:
# stage 3 is estimated at 6 to 8 minutes, not yet measured.
# The quick pass also times the swap-in on DeepSeek-V4-Flash's C4 rows and
# MiniMax-M3's K and V (--swap-path), each beside SGLang's kernel for that
# path, at batch 1, 32 and 128 (about 13 methods a point, 6 points; the
# per-miss copies at batch 128 take the longest: estimated at under half a
# minute for both, not yet measured).
# Dry run: the quick grid on the CPU executor (the swap-in's also with the
# nvcc build, and on the other two paths).
source "$(dirname "$0")/common.sh"
export KVTIER_SGLANG_KERNELS="$bundle/lib/libkvt_sglang_kernels.so"
# bench NAME SECONDS ARGS...: with the bundle's kvtier, or the one `bin=` names;
# each point's lines reach NAME.jsonl as it completes, and a swap-in build no
# GPU had run before that hangs is named in $hung_builds and skipped by the
# benches after (see common.sh)
bench() {
  local name=$1 secs=$2; shift 2
  run "$name" "$secs" "${bin:-$bundle/bin/kvtier}" bench "$@" --json "$logs/$name.jsonl" \
    --hung-builds "$hung_builds"
}
nvcc_build=$bundle/bin/kvtier-nvcc
# DeepSeek-V4-Flash's C4 layers (top-k 512 C4 entries, HOT 4096: 8x top-k)
# at the miss rate published for 4x top-k, 6.7 % (34 of 512; a larger buffer
# misses less), and MiniMax-M3's sparse layers (16 blocks of 128 tokens, HOT
# 4096: 2x the 2048 tokens) at 13.4 % (274 of 2048), bf16 K and V of a
# rank's one head (256 B each)
dsv4_c4=(--scenario swap-in --swap-path dsv4-c4 --hot 4096 --misses 34)
m3_kv=(--scenario swap-in --swap-path m3-kv --hot 4096 --misses 274)
# The quick pass's swap-in grids (GPU_SUITE_QUICK=1 and 3): SGLang's grid,
# the production rows, the realistic-miss rows at HOT 4096 and 8192, batch 2
# and 4 (with "mid-batch", batch 16 and 32 too), DeepSeek-V4's C4 path and
# MiniMax-M3's K/V path.
quick_swap_in_grids() {
  bench swap-in-sglang-grid 120 --scenario swap-in --entry 512 --batch 1,10,100 --max-seconds 1
  bench swap-in-production 120 --scenario swap-in --max-seconds 1
  for hm in 4096:274 8192:137; do
    bench "swap-in-realistic-h${hm%%:*}" 120 --scenario swap-in --entry 656 --hot "${hm%%:*}" \
      --misses "${hm##*:}" --batch 1,8,64,256 --max-seconds 1
  done
  # batch 2 and 4, between the batch-1 rows (where one launch was up to 1.9x
  # slower with hundreds of misses) and batch 8, where the default turned to
  # it until the H200 runs of 2026-11-28 (SwapInChoice::default_for)
  bench swap-in-small-batch 45 --scenario swap-in --entry 656 --hot 4096 --misses 2,274 --batch 2,4 \
    --max-seconds 0.5
  if [ "${1:-}" = mid-batch ]; then
    bench swap-in-mid-batch 60 --scenario swap-in --entry 656 --hot 4096,8192 --misses 2,274 \
      --batch 16,32 --max-seconds 0.5
  fi
  bench swap-in-dsv4-c4 60 "${dsv4_c4[@]}" --batch 1,32,128 --max-seconds 0.5
  bench swap-in-m3-kv 60 "${m3_kv[@]}" --batch 1,32,128 --max-seconds 0.5
}
# whether transparent huge pages can be had here (the gather's --host-pages)
{ echo "transparent_hugepage/enabled: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>&1)"
  grep -i huge /proc/meminfo; } > "$logs/host-pages.txt" 2>&1 || true
if [ "$dry" = 1 ]; then
  bench bench-quick 120 --quick
  bin=$nvcc_build bench bench-quick-nvcc 120 --quick --scenario swap-in
  bench bench-quick-host-pages 60 --quick --scenario gather --host-pages base,transparent
  bench bench-quick-dsv4-c4 60 --quick "${dsv4_c4[@]}"
  bench bench-quick-m3-kv 60 --quick "${m3_kv[@]}"
elif [ "$quick" = 1 ]; then
  # The quick pass (quick-pass.sh): every swap-in strategy beside SGLang's
  # kernel and the floor lines at SGLang's grid, the production rows and the
  # realistic-miss rows at the HOT sizes SGLang's kernel serves, DeepSeek-V4's
  # C4 path and MiniMax-M3's K/V path at their realistic misses; every copy
  # method of the gather at the points of the copy-path goals, and the
  # writeback; the rest (GPU_SUITE_QUICK=2) after the decode step.
  quick_swap_in_grids
  bench gather 120 --scenario gather --context 131072 --batch 1,8,64 --k 256,2048 --max-seconds 0.5
  # 65536 rows of 656 bytes, between the sizes where the H100 run of
  # 2026-11-27 (8f21590) found MergedRuns ahead (16384) and far behind with
  # uniform indices (131072): the copy method table's calls in between
  bench gather-65536 45 --scenario gather --context 131072 --entry fp8-dsa --batch 32 --k 2048 --max-seconds 0.5
  # the prefill at the copy-path goal's 8192 tokens only, from scattered and
  # from in-order source rows (MergedRuns' runs), as many points as before
  bench writeback 60 --scenario writeback --prefill-tokens 8192 --max-seconds 0.5
elif [ "$quick" = 2 ]; then
  # The quick pass's second part, after the decode step: the uniform gather
  # at rows of 640, 656 and 768 bytes, the nvcc build, the realistic rows at
  # a buffer of 1x top-k, the gather at 32K tokens of context, 2 MiB pool
  # pages (twice measured on the H100: no gain).
  # Whether a scattered 656-byte row (5 x 128 + 16) costs the link six
  # 128-byte lines, as a 768-byte one does: at batch 64 x k 2048, uniform,
  # the best kvtier 656-byte gather's share of the link was 0.79-0.93 of
  # the best 1152-byte one's in the five committed GPU runs of it, and
  # 656 / 768 = 0.854. Same rows a call (131072), same spread.
  bench gather-entry-sizes 60 --scenario gather --context 32768 --entry 640,656,768 --batch 64 \
    --k 2048 --indices uniform --max-seconds 0.5
  bin=$nvcc_build bench swap-in-production-nvcc 100 --scenario swap-in --max-seconds 1
  bench swap-in-realistic-h2048 100 --scenario swap-in --entry 656 --hot 2048 --misses 614 \
    --batch 1,8,64,256 --max-seconds 1
  # the 32K-context half of the gather grid, which no GPU has run (each copy
  # method, the bulk-copy one included, at the production batch sizes)
  bench gather-32k 60 --scenario gather --context 32768 --entry fp8-dsa --batch 8,64 --k 2048 --max-seconds 0.5
  bench gather-host-pages 100 --scenario gather --context 131072 --entry fp8-dsa --batch 64 \
    --k 2048 --indices uniform --host-pages base,transparent --pool-memory 8GiB --max-seconds 0.5
elif [ "$quick" = 3 ]; then
  # A follow-up of the quick pass (GPU_SUITE_STAGES="1-tests 3-bench:3
  # 6-decode-step"): its swap-in grids alone, for a change of the swap-in's
  # default or a new build, and batch 16 and 32 at the production shapes,
  # between the batches where the split planner was ahead (up to 10) and
  # where it was behind (32 on DeepSeek-V4's C4 path, 100)
  quick_swap_in_grids mid-batch
else
  bench swap-in-sglang-grid 120 --scenario swap-in --entry 512 --batch 1,10,100 --max-seconds 2
  bench swap-in-production 120 --scenario swap-in --max-seconds 2
  # the regime servers live in: the HiSparse paper's GLM-5.1 misses (30 %,
  # 13.4 % and 6.7 % of top-k 2048 with a hot buffer of 1x, 2x and 4x top-k),
  # 656-byte items, batch 1 to 256, every strategy beside SGLang's kernel
  for hm in 2048:614 4096:274 8192:137; do
    bench "swap-in-realistic-h${hm%%:*}" 150 --scenario swap-in --entry 656 --hot "${hm%%:*}" \
      --misses "${hm##*:}" --batch 1,8,32,64,128,256 --max-seconds 1
  done
  # the same rows with the same commit's kernels built by nvcc 13.0 instead of
  # NVRTC 12.9 (each JSON line's "kernels" names its build), right after the
  # NVRTC build's, so that a compiler's difference shows in one run
  bin=$nvcc_build bench swap-in-production-nvcc 120 --scenario swap-in --max-seconds 2
  bench spec-swap-in 100 --scenario spec-swap-in --max-seconds 1
  bench gather 150 --scenario gather --context 131072 --max-seconds 1
  # 4 KiB against 2 MiB pages (transparent huge pages) under the pool at
  # uniform indices over about 8 GiB: whether the GPU's translation of host
  # pages is what caps the uniform gather (the log says how much of each pool
  # the kernel gave huge pages)
  bench gather-host-pages 150 --scenario gather --context 131072 --entry fp8-dsa,bf16-mla --batch 64 \
    --k 1024,2048 --indices uniform --host-pages base,transparent --pool-memory 8GiB --max-seconds 1
  bench writeback 60 --scenario writeback --max-seconds 1
  bench engram-gather 120 --scenario engram-gather --max-seconds 1
fi
# The copy method table this run's gather and writeback rows decide (the
# library embeds the committed runs'; see kvtier bench --copy-choice).
# (An empty file is a bench stopped in its first point: left out.)
nonempty() { for f in "$@"; do if [ -s "$f" ]; then echo "$f"; fi; done; }
rows=$(nonempty "$logs"/*.jsonl | paste -sd, -)
if [ -n "$rows" ]; then
  run copy-choice 30 "$bundle/bin/kvtier" bench --from-json "$rows" --copy-choice "$logs/copy-choice.json"
fi
# Where the swap-in rows leave the swap-in's goals (the default and every
# build against SGLang's kernel, by the quartile rule): on a GPU only, where
# SGLang's kernel is timed beside kvtier's; the NVRTC build's rows only (the
# report takes one build's files at a time).
swap_rows=$(nonempty "$logs"/swap-in-*.jsonl | grep -v -- '-nvcc\.jsonl$' | paste -sd, - || true)
if [ -n "$swap_rows" ] && [ "$dry" != 1 ]; then
  run swap-in-report 30 "$bundle/bin/kvtier" bench --from-json "$swap_rows" --swap-in-report
fi
