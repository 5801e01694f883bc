"""Bytes each pool device serves per decode step, by rank count and device count.

    python bindings/python/benchmarks/placement.py [--json FILE]

For R ranks (1, 2, 4, 8) sharing a pool of D shared-file devices (1, 2, 4),
each rank's HiSparse host pool is placed by kvtier's SGLang allocator (per-rank
round-robin: rank r on device r mod D), then one decode step runs: each rank
swaps in, for one request and every layer, a random top-k of its long
sequence through kvtier's entry point on the CPU executor. A miss copies one
656-byte entry out of the rank's region, so a device serves the misses of the
ranks whose regions it holds; the miss counts are the swap-ins' own (their
miss plans). Layers, top-k and the hot buffer are scaled down (4 layers, top-k
512 of 4096 tokens, 1024 hot slots) so the run takes seconds; the shares per
device are what the placement decides.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np

import kvtier
from kvtier.sglang import KvtierConfig, KvtierHostTensorAllocator, load_cache_to_device_buffer_mla

LAYERS, ROWS, ITEM, K, HOT, SEQ = 4, 4096, 656, 512, 1024, 4096


def step(host, rng) -> int:
    """One request's swap-in on every layer of `host` ([layers, rows, 1, ITEM]); the entries copied."""
    copied = 0
    for layer in range(LAYERS):
        tokens = np.full((1, HOT + 1), -1, np.int32)
        locs = np.arange(HOT + 1, dtype=np.int32)[None]
        lru = np.arange(HOT, dtype=np.int16)[None]
        topk = rng.choice(SEQ - 1, size=K, replace=False).astype(np.int32)[None]
        src, dst, cnt = np.zeros((1, K), np.int64), np.zeros((1, K), np.int32), np.zeros(1, np.int32)
        load_cache_to_device_buffer_mla(
            top_k_tokens=topk, device_buffer_tokens=tokens, host_cache_locs=np.arange(ROWS, dtype=np.int64)[None],
            device_buffer_locs=locs, host_cache=host[layer], device_buffer=np.zeros((HOT + 1) * ITEM, np.uint8),
            top_k_device_locs=np.full((1, K), -1, np.int32), req_pool_indices=np.zeros(1, np.int32),
            seq_lens=np.array([SEQ], np.int64), lru_slots=lru, item_size_bytes=ITEM, num_top_k=K,
            hot_buffer_size=HOT, miss_src=src, miss_dst=dst, miss_count=cnt)
        copied += int(cnt[0])
    return copied


def run(ranks: int, devices: int, rng) -> dict:
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        specs = [f"file:{d}/dev{i}:{LAYERS * ROWS * ITEM * ranks + (8 << 20)}" for i in range(devices)]
        served = [0] * devices
        readers = [[] for _ in range(devices)]
        allocators = []
        for r in range(ranks):
            a = KvtierHostTensorAllocator(KvtierConfig(devices=specs, rank=r, ranks=ranks))
            host = a.allocate((LAYERS, ROWS, 1, ITEM), "uint8")
            allocators.append(a)
            dev = a.regions[0].device
            readers[dev].append(r)
            served[dev] += step(host, rng) * ITEM
        total = sum(served)
        return dict(ranks=ranks, devices=devices, bytes_per_device=served, readers=readers,
                    busiest_share=round(max(served) / total, 3), devices_used=sum(1 for b in served if b),
                    layers=LAYERS, top_k=K, hot=HOT, seq=SEQ, item_bytes=ITEM, kvtier=kvtier.version())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write one JSON line per (ranks, devices) to this file")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = [run(r, d, rng) for r in (1, 2, 4, 8) for d in (1, 2, 4)]
    print(f"{'ranks':>5} {'devices':>7}  {'MB per device per step':<40} busiest")
    for row in rows:
        mb = " ".join(f"{b / 1e6:6.2f}" for b in row["bytes_per_device"])
        print(f"{row['ranks']:>5} {row['devices']:>7}  {mb:<40} {row['busiest_share']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
