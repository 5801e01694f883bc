"""kvtier's HiCache storage backend against SGLang's own ``file`` backend on
``/dev/shm``, side by side in one run on this machine (no GPU involved: the
storage tier moves pages between host memory and the store).

Pages are 64 tokens of a DeepSeek-V3-sized MLA model: 61 layers of 1152 B a
token in bf16 (4,497,408 B a page) and of 576 B in fp8 (2,248,704 B). The
host pool is a page-first buffer of that geometry standing in for SGLang's
``MLATokenToKVPoolHost`` (the same ``get_page_buffer_meta`` and flat-page
methods, one contiguous run a page). Each backend is driven the way SGLang's
cache controller drives it:

- kvtier, with ``interface_v1``: ``batch_set_v1`` / ``batch_get_v1`` (one copy
  between the store and the host page), in a store of 1.25 times the pages
  set in a round;
- the file backend: ``batch_set`` of flat pages / ``batch_get`` into flat
  pages, then ``set_from_flat_data_page`` (the controller's generic path),
  with its metadata cache on and off.

Measured: set time a page (median) and throughput into a fresh store (its
first fill: tmpfs zeroes each page at its first touch) and into a full one
(a second round of new keys: kvtier evicts a page for the last 3/4 of
them); get time a
page and throughput, from 1 process
and from 8 at once; ``batch_exists`` calls a second at batches of 1 to 512
keys, all hits and a first-key miss; the time from a new backend object to
its first prefix hit over a stored prefix (a restart; the median of five).
The limit beside
them: numpy's copy of the same bytes (one memcpy), from 1 and 8 processes.

    python hicache.py --out DIR [--pages 64] [--quick]

Writes DIR/hicache.json (every sample's summary) and prints a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from kvtier.sglang.hicache import KvtierHiCacheStorage

LAYERS, PAGE_TOKENS = 61, 64
DTYPES = {"bf16": 1152, "fp8": 576}
MODEL = "deepseek-ai/DeepSeek-V3"


class PageFirstHostPool:
    """A page-first host buffer with SGLang's MLA host-pool methods that
    storage backends use (one contiguous run a page)."""

    def __init__(self, pages: int, token_bytes: int):
        self.page_size = PAGE_TOKENS
        self.layer_num = LAYERS
        self.layout = "page_first"
        self.dtype = torch.uint8
        self.page_bytes = LAYERS * token_bytes * PAGE_TOKENS
        self.buffer = torch.empty((pages, self.page_bytes), dtype=torch.uint8)
        self.buffer.view(-1)[:].random_(0, 256)
        self.size = pages * PAGE_TOKENS

    def get_page_buffer_meta(self, indices):
        rows = indices[:: self.page_size].tolist()
        return [self.buffer[r // self.page_size].data_ptr() for r in rows], [self.page_bytes] * len(rows)

    def get_dummy_flat_data_page(self):
        return torch.empty(self.page_bytes, dtype=torch.uint8)

    def get_data_page(self, index, flat: bool = True):
        return self.buffer[int(index) // self.page_size]

    def set_from_flat_data_page(self, index, data_page):
        self.buffer[int(index) // self.page_size].copy_(data_page)

    def indices(self, pages):
        return torch.cat([torch.arange(p * PAGE_TOKENS, (p + 1) * PAGE_TOKENS) for p in pages])


def config(extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=MODEL, extra_config=extra,
    )


def make_backend(kind: str, where: str, pool: PageFirstHostPool, pages: int):
    if kind == "kvtier":
        b = KvtierHiCacheStorage(config({
            "directory": where, "capacity": pages * pool.page_bytes * 5 // 4, "interface_v1": 1,
        }))
    else:
        b = HiCacheFile(config({
            "file_storage_path": where, "enable_metadata_cache": kind == "file-metadata-cache",
        }))
    b.register_mem_pool_host(pool)
    return b


def keys_for(tag: str, n: int) -> list:
    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


def set_pages(kind, backend, pool, keys, pages):
    if kind == "kvtier":
        return backend.batch_set_v1(keys, pool.indices(pages))
    return [backend.batch_set(keys, [pool.get_data_page(p * PAGE_TOKENS) for p in pages])]


def get_pages(kind, backend, pool, keys, pages):
    if kind == "kvtier":
        return backend.batch_get_v1(keys, pool.indices(pages))
    got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    for p, g in zip(pages, got):
        if g is not None:
            pool.set_from_flat_data_page(p * PAGE_TOKENS, g)
    return [g is not None for g in got]


def summary(samples: list, bytes_each: int) -> dict:
    med = statistics.median(samples)
    q = statistics.quantiles(samples, n=4) if len(samples) >= 4 else [med, med, med]
    return {
        "samples": len(samples),
        "median_us": med * 1e6,
        "q1_us": q[0] * 1e6,
        "q3_us": q[2] * 1e6,
        "gb_per_s": bytes_each / med / 1e9 if bytes_each else None,
    }


def memcpy_page(page_bytes: int, pages: int, repeats: int) -> list:
    """One page's memcpy, over as many pages as the backends use (so that
    neither side runs from the cache where the other does not)."""
    src = np.random.default_rng(0).integers(0, 256, (pages, page_bytes), dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touched once, as the store's pages are
    out = []
    for r in range(repeats):
        for p in range(pages):
            t = time.perf_counter()
            np.copyto(dst[p], src[p])
            out.append(time.perf_counter() - t)
    return out


def _proc_gets(kind, where, token_bytes, pages, keys, seconds, q):
    torch.set_num_threads(1)  # eight processes on this machine's cores: no thread pool each
    pool = PageFirstHostPool(pages, token_bytes)
    b = make_backend(kind, where, pool, pages) if kind != "memcpy" else None
    rng = np.random.default_rng(os.getpid())
    n, ok, start = 0, True, time.perf_counter()
    if kind == "memcpy":
        src = np.random.default_rng(0).integers(0, 256, (pages, pool.page_bytes), dtype=np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        p = int(rng.integers(pages))
        if kind == "memcpy":
            np.copyto(dst[p], src[p])
        else:
            ok &= all(get_pages(kind, b, pool, [keys[p]], [p]))
        n += 1
    q.put((n, time.perf_counter() - start, ok))


def parallel_gets(kind, where, token_bytes, pages, keys, procs, seconds) -> dict:
    # spawned, not forked: a forked child of a process that ran torch's
    # thread pool can hang in its first parallel op
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_proc_gets, args=(kind, where, token_bytes, pages, keys, seconds, q)) for _ in range(procs)]
    for p in ps:
        p.start()
    res = [q.get() for _ in ps]
    for p in ps:
        p.join()
    page_bytes = LAYERS * token_bytes * PAGE_TOKENS
    total = sum(n for n, _, _ in res)
    wall = max(t for _, t, _ in res)
    return {"processes": procs, "pages": total, "seconds": wall, "gb_per_s": total * page_bytes / wall / 1e9,
            "all_found": all(ok for _, _, ok in res)}


def run(args) -> dict:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    kinds = ["kvtier", "file-metadata-cache", "file"]
    out = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "python": sys.version.split()[0], "torch": torch.__version__, "store_dir": base},
           "geometry": {"layers": LAYERS, "page_tokens": PAGE_TOKENS, "model": MODEL}, "results": []}
    reps = 3 if args.quick else 20
    for dtype, token_bytes in DTYPES.items():
        pages = args.pages
        pool = PageFirstHostPool(pages, token_bytes)
        page_bytes = pool.page_bytes
        row = {"dtype": dtype, "page_bytes": page_bytes, "pages": pages}
        row["memcpy"] = summary(memcpy_page(page_bytes, pages, reps), page_bytes)
        row["memcpy_8_processes"] = parallel_gets("memcpy", None, token_bytes, pages, None, 8, args.seconds)
        for kind in kinds:
            where = tempfile.mkdtemp(prefix=f"kvtier-bench-{kind}-", dir=base)
            try:
                b = make_backend(kind, where, pool, pages)
                r = {}
                # a fresh store's first fill, then a second round of new
                # keys, most of them into a full store (kvtier's holds 1.25
                # rounds: its last 3/4 evict a page each), as a server sees
                for name, tag in (("set_page_first_fill", "first"), ("set_page", dtype)):
                    keys = keys_for(tag, pages)
                    sets = []
                    for p in range(pages):
                        t = time.perf_counter()
                        assert all(set_pages(kind, b, pool, [keys[p]], [p]))
                        sets.append(time.perf_counter() - t)
                    r[name] = summary(sets, page_bytes)
                gets = []
                for _ in range(reps):
                    for p in range(pages):
                        t = time.perf_counter()
                        assert all(get_pages(kind, b, pool, [keys[p]], [p]))
                        gets.append(time.perf_counter() - t)
                r["get_page"] = summary(gets, page_bytes)
                batch = min(pages, 128)
                gets = []
                for _ in range(reps):
                    t = time.perf_counter()
                    assert all(get_pages(kind, b, pool, keys[:batch], list(range(batch))))
                    gets.append(time.perf_counter() - t)
                r[f"get_batch_{batch}"] = summary(gets, page_bytes * batch)
                r["get_8_processes"] = parallel_gets(kind, where, token_bytes, pages, keys, 8, args.seconds)
                exists = {}
                misses = keys_for("absent", 512)
                for n in (1, 8, 64, 512):
                    hit_keys = (keys * (n // pages + 1))[:n]
                    for what, ks in (("hit", hit_keys), ("miss", misses[:n])):
                        calls = max(20, 2000 // n) if not args.quick else 10
                        samples = []
                        for _ in range(calls):
                            t = time.perf_counter()
                            found = b.batch_exists(ks)
                            samples.append(time.perf_counter() - t)
                        assert found == (n if what == "hit" else 0), (kind, what, n, found)
                        med = statistics.median(samples)
                        exists[f"{what}_{n}"] = {"median_us": med * 1e6, "calls_per_s": 1 / med,
                                                 "keys_per_s": (n if what == "hit" else 1) / med}
                r["exists"] = exists
                # a restart: a new backend object, its first hit over the
                # prefix (the median of five: one may meet Python's collector)
                restarts = []
                for _ in range(5):
                    b.close() if hasattr(b, "close") else None
                    t = time.perf_counter()
                    b = make_backend(kind, where, pool, pages)
                    hit = b.batch_exists(keys[:batch])
                    restarts.append(time.perf_counter() - t)
                    assert hit == batch, (kind, hit)
                r["restart_to_first_hit_ms"] = statistics.median(restarts) * 1e3
                r["restart_found_pages"] = hit
                b.close() if hasattr(b, "close") else None
                row[kind] = r
            finally:
                shutil.rmtree(where, ignore_errors=True)
        out["results"].append(row)
    return out


def table(out: dict) -> str:
    lines = []
    for row in out["results"]:
        lines.append(f"\n{row['dtype']}: pages of {row['page_bytes']:,} B; memcpy "
                     f"{row['memcpy']['gb_per_s']:.2f} GB/s (8 processes {row['memcpy_8_processes']['gb_per_s']:.2f})")
        lines.append(f"{'backend':<22}{'fill GB/s':>10}{'set GB/s':>10}{'get GB/s':>10}{'get/memcpy':>11}{'get 8p GB/s':>12}"
                     f"{'exists 64 hit/s':>17}{'exists 512 hit/s':>18}{'restart ms':>11}")
        for kind in ("kvtier", "file-metadata-cache", "file"):
            r = row[kind]
            lines.append(
                f"{kind:<22}{r['set_page_first_fill']['gb_per_s']:>10.2f}{r['set_page']['gb_per_s']:>10.2f}{r['get_page']['gb_per_s']:>10.2f}"
                f"{r['get_page']['gb_per_s'] / row['memcpy']['gb_per_s']:>11.2f}"
                f"{r['get_8_processes']['gb_per_s']:>12.2f}"
                f"{r['exists']['hit_64']['calls_per_s']:>17,.0f}{r['exists']['hit_512']['calls_per_s']:>18,.0f}"
                f"{r['restart_to_first_hit_ms']:>11.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--quick", action="store_true", help="few samples: checks that every step runs")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = run(args)
    out["command"] = " ".join(sys.argv)
    with open(os.path.join(args.out, "hicache.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(table(out))


if __name__ == "__main__":
    main()
