"""kvtier's Engram gather against SGLang's own Triton kernel, on one GPU, side
by side in one run: the same table (264 B rows: 256 e4m3 bytes and 8 e8m0
scales, SGLang's layout, in pinned host memory the GPU maps and in GPU
memory), the same ids (24 a token, uniformly drawn: DeepSeek-V4.1-Flash's
rows per token and layer), the same output. Methods, each timed with CUDA
events over repeated calls (median), outputs compared bit for bit:

- SGLang's ``engram_gather`` (its Triton kernel), in the ids' order and with
  ``sort_ids=True`` (its torch.sort included, as SGLang runs it);
- kvtier's ``kvtier.sglang.engram_gather``, both orders likewise;
- the limit: one contiguous copy of the same bytes to the GPU.

SGLang's kernel is loaded from the file ``--sglang-kernel`` names (its
``sglang/kernels/ops/embeddings/engram_gather.py``, which needs only torch
and triton). Without a GPU (the bundle's dry run) it times kvtier's CPU
executor on numpy arrays and says that the GPU rows were not run.

    python engram_triton.py --sglang-kernel engram_gather.py --json out.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

import numpy as np

DIM, BLOCK, ROW_BYTES, IDS_PER_TOKEN = 256, 32, 264, 24


def table_bytes(rows: int, seed: int) -> np.ndarray:
    """[rows × 256 e4m3][rows × 8 e8m0]: no NaN values, no 255 scale, so
    that both kernels' outputs compare bit for bit."""
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, size=rows * DIM, dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0x38
    s = rng.integers(100, 150, size=rows * (DIM // BLOCK), dtype=np.uint8)
    return np.concatenate([w, s])


def load_sglang(path: str):
    spec = importlib.util.spec_from_file_location("sglang_engram_gather", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.engram_gather


def cuda_rows(args, out) -> None:
    import torch

    from kvtier.sglang.engram import engram_gather as kvtier_gather, forget_table, register_table

    try:
        sglang_gather = load_sglang(args.sglang_kernel) if args.sglang_kernel else None
        why_not = None if sglang_gather else "no --sglang-kernel"
    except Exception as e:  # noqa: BLE001 - no triton here: kvtier's rows alone, said
        sglang_gather, why_not = None, f"SGLang's kernel did not load: {e!r}"
    rows = args.rows
    host = torch.from_numpy(table_bytes(rows, 1)).pin_memory()
    tables = {"pinned host": host, "device": host.cuda()}
    w_bytes = rows * DIM
    dev = torch.cuda.get_device_name()
    for where, t in tables.items():
        wp, sp = t.data_ptr(), t.data_ptr() + w_bytes
        register_table(wp, rows)
        try:
            for tokens in args.tokens:
                n = tokens * IDS_PER_TOKEN
                gen = torch.Generator().manual_seed(tokens)
                ids = torch.randint(0, rows, (n,), generator=gen, dtype=torch.int64).cuda()
                methods = {
                    "kvtier": lambda o, s=False: kvtier_gather(wp, sp, ids, o, DIM, BLOCK, sort_ids=s),
                }
                if sglang_gather is not None:
                    methods["SGLang Triton"] = lambda o, s=False: sglang_gather(wp, sp, ids, o, DIM, BLOCK,
                                                                                sort_ids=s)
                outs, times = {}, {}
                for name, fn in methods.items():
                    for sort in (False, True):
                        o = torch.empty(n, DIM, dtype=torch.bfloat16, device="cuda")
                        label = name + (", sorted reads" if sort else "")
                        times[label] = time_cuda(lambda: fn(o, sort), args.reps)
                        outs[label] = o
                dst = torch.empty(n * ROW_BYTES, dtype=torch.uint8, device="cuda")
                src = t[: n * ROW_BYTES]
                times["limit: one contiguous copy of the rows' bytes (from the table's memory)"] = time_cuda(
                    lambda: dst.copy_(src, non_blocking=True), args.reps)
                ref = outs["kvtier"].view(torch.int16)
                for label, us in times.items():
                    same = None if label not in outs else bool(torch.equal(outs[label].view(torch.int16), ref))
                    out.append({"scenario": "engram-gather-vs-triton", "device": dev, "table": where,
                                "tokens": tokens, "ids": n, "rows": rows, "method": label, "median_us": us,
                                "bytes": n * ROW_BYTES, "same_as_kvtier": same, "sglang_kernel": why_not or "loaded"})
                    print(f"{where:<12} tokens {tokens:>5} ids {n:>7}  {label:<48} {us:9.2f} us"
                          + ("" if same is None else f"  same as kvtier: {same}"), flush=True)
        finally:
            forget_table(wp)
    if why_not:
        print(f"SGLang's Triton kernel not timed: {why_not}", flush=True)


def time_cuda(fn, reps: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(samples)


def cpu_rows(args, out) -> None:
    """The dry run: kvtier's CPU executor on numpy (no GPU, no triton)."""
    from kvtier.sglang.engram import engram_gather as kvtier_gather

    rows = min(args.rows, 1 << 16)
    t = table_bytes(rows, 1)
    wp, sp = t.ctypes.data, t.ctypes.data + rows * DIM
    for tokens in args.tokens[:2]:
        n = tokens * IDS_PER_TOKEN
        ids = np.random.default_rng(tokens).integers(0, rows, size=n).astype(np.int64)
        o = np.empty((n, DIM), dtype=np.uint16)
        for sort in (False, True):
            samples = []
            for _ in range(args.reps):
                start = time.perf_counter()
                kvtier_gather(wp, sp, ids, o, DIM, BLOCK, 0, rows, sort_ids=sort)
                samples.append((time.perf_counter() - start) * 1e6)
            label = "kvtier (CPU executor)" + (", sorted reads" if sort else "")
            us = statistics.median(samples)
            out.append({"scenario": "engram-gather-vs-triton", "device": "cpu", "table": "host", "tokens": tokens,
                        "ids": n, "rows": rows, "method": label, "median_us": us, "bytes": n * ROW_BYTES,
                        "same_as_kvtier": None, "sglang_kernel": "not run: no GPU"})
            print(f"cpu tokens {tokens:>5} ids {n:>7}  {label:<40} {us:9.2f} us", flush=True)
    print("no GPU: SGLang's Triton kernel and kvtier's CUDA kernel were not run", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sglang-kernel", help="SGLang's engram_gather.py")
    p.add_argument("--rows", type=int, default=16 << 20, help="table rows (264 B each; default 4 GiB)")
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64, 320, 8192],
                   help="tokens per call (24 ids each): decode 1/8/64, verify 64 × 5, prefill 8192")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json", help="write one JSON line per row here")
    args = p.parse_args()
    out: list = []
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    (cuda_rows if gpu else cpu_rows)(args, out)
    if args.json:
        with open(args.json, "w") as f:
            for row in out:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
