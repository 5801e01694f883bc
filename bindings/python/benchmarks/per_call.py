"""Per-call cost of kvtier's SGLang entry points, in eager mode.

    python bindings/python/benchmarks/per_call.py [--device cpu|torch-cpu|cuda] [--reader R] [--sglang] [--json FILE]

Each case is one layer's call as SGLang's coordinator makes it: one request,
top-k 4, a hot buffer of 4 slots (the issue's setting; SGLang builds fresh
tensor views for every call, so the arguments are fresh views here too).
`cpu` uses numpy arrays (the CPU executor, whose work for 4 entries is a few
hundred nanoseconds); `torch-cpu` torch CPU tensors (the cost of reading
torch tensors, which SGLang passes, on a machine without a GPU); `cuda`
uses torch CUDA tensors (needs torch and a GPU; the time is the host's:
checks and the kernel launch, not the kernel). Each
case is timed as the median of 7 runs of N calls; `floor` is an empty Python
function call with the same arguments, for scale.

`--reader` picks how kvtier reads plain torch tensors (`auto`: torch's DLPack
C exchange table where torch has one; `to_dlpack`; `methods`). `--sglang`
adds SGLang's own entry point (`sglang.kernels.ops.kvcache.hisparse`, from
whatever SGLang is importable) called the same way: on `cuda` its real JIT
kernel; on `torch-cpu`, where its kernel cannot run, its Python wrapper and
tvm-ffi call with the kernel's function replaced by one of the same
signature, compiled here with g++ against tvm-ffi, that reads the arguments
its host code reads and returns (no CUDA call, no launch: a lower bound of
SGLang's cost on a GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import kvtier
import kvtier._swap_in
from kvtier.sglang import (
    copy_cache_planned_mla,
    load_blocks_to_device_buffer_mha,
    load_cache_to_device_buffer_dsv4_mla,
    load_cache_to_device_buffer_mla,
)

HOT, K, ITEM = 4, 4, 656
DSV4_ITEM, DSV4_PAGE = 584, 37440


def arrays(xp, device):
    """The state of one request whose hot buffer holds tokens 1, 4, 2, 5 and
    the newest token 7, as `xp` arrays (numpy, or torch on `device`)."""
    def a(values, dtype):
        arr = np.array(values, dtype=dtype)
        return arr if xp is None else xp.from_numpy(arr).to(device)

    def zeros(n, dtype):
        return a(np.zeros(n, dtype=dtype), dtype)

    host = a(np.zeros(8 * ITEM, np.uint8), np.uint8)
    if xp is not None and device != "cpu":
        host = xp.zeros(8 * ITEM, dtype=xp.uint8, pin_memory=True)
    return dict(
        tokens=a([[1, 4, 2, 5, 7]], np.int32), locs=a([[9, 7, 3, 5, 11]], np.int32),
        lru=a([[0, 1, 2, 3]], np.int16), host_locs=a(np.arange(8).reshape(1, 8), np.int64),
        host=host, device=zeros(12 * ITEM, np.uint8), topk=a([[4, 2, 7, 6]], np.int32),
        out=a(np.full((1, K), -1), np.int32), req=a([0], np.int32), seq=a([8], np.int64),
        num_real=a([1], np.int32), blocks=a([[1, 0, -1, -1]], np.int32), out_blocks=a(np.full((1, 4 * K), -1), np.int32),
        miss_src=a(np.zeros((1, K)), np.int64), miss_dst=a(np.zeros((1, K)), np.int32), miss_count=a([0], np.int32),
        dsv4_host=zeros(DSV4_PAGE, np.uint8), dsv4_device=zeros(DSV4_PAGE, np.uint8),
    )


def cases(s):
    """(name, call) per entry point; each call passes fresh views, as SGLang does."""
    def mla():
        load_cache_to_device_buffer_mla(
            top_k_tokens=s["topk"][:1], device_buffer_tokens=s["tokens"][:1], host_cache_locs=s["host_locs"][:1],
            device_buffer_locs=s["locs"][:1], host_cache=s["host"], device_buffer=s["device"],
            top_k_device_locs=s["out"][:1, :K], req_pool_indices=s["req"][:1], seq_lens=s["seq"][:1],
            lru_slots=s["lru"][:1], item_size_bytes=ITEM, num_top_k=K, hot_buffer_size=HOT, page_size=1,
            block_size=960, num_real_reqs=s["num_real"], skip_io=False)

    def mla_plan():
        load_cache_to_device_buffer_mla(
            top_k_tokens=s["topk"][:1], device_buffer_tokens=s["tokens"][:1], host_cache_locs=s["host_locs"][:1],
            device_buffer_locs=s["locs"][:1], host_cache=s["host"], device_buffer=s["device"],
            top_k_device_locs=s["out"][:1, :K], req_pool_indices=s["req"][:1], seq_lens=s["seq"][:1],
            lru_slots=s["lru"][:1], item_size_bytes=ITEM, num_top_k=K, hot_buffer_size=HOT, page_size=1,
            block_size=960, num_real_reqs=s["num_real"], skip_io=False, miss_src=s["miss_src"][:1],
            miss_dst=s["miss_dst"][:1], miss_count=s["miss_count"][:1])

    def dsv4():
        load_cache_to_device_buffer_dsv4_mla(
            top_k_tokens=s["topk"][:1], device_buffer_tokens=s["tokens"][:1], host_cache_locs=s["host_locs"][:1],
            device_buffer_locs=s["locs"][:1], host_cache=s["dsv4_host"], device_buffer=s["dsv4_device"],
            top_k_device_locs=s["out"][:1, :K], req_pool_indices=s["req"][:1], seq_lens=s["seq"][:1],
            lru_slots=s["lru"][:1], item_size_bytes=DSV4_ITEM, num_top_k=K, hot_buffer_size=HOT, page_size=1,
            block_size=960, num_real_reqs=s["num_real"], skip_io=False)

    def mha():
        load_blocks_to_device_buffer_mha(
            top_k_blocks=s["blocks"][:1, :1], device_buffer_tokens=s["tokens"][:1], host_cache_locs=s["host_locs"][:1],
            device_buffer_locs=s["locs"][:1], host_cache_k=s["host"], host_cache_v=s["host"],
            device_buffer_k=s["device"], device_buffer_v=s["dsv4_device"], top_k_device_locs=s["out_blocks"][:1],
            req_pool_indices=s["req"][:1], seq_lens=s["seq"][:1], lru_slots=s["lru"][:1], item_size_bytes=ITEM,
            hot_buffer_size=HOT, sparse_block_size=4, page_size=1, block_size=960, num_real_reqs=s["num_real"],
            skip_io=False)

    def replay():
        copy_cache_planned_mla(
            miss_src=s["miss_src"][:1], miss_dst=s["miss_dst"][:1], miss_count=s["miss_count"][:1],
            num_real_reqs=s["num_real"], host_cache=s["host"], device_buffer=s["device"], item_size_bytes=ITEM,
            num_blocks=4, block_size=1024, is_dsv4_layout=False, skip_io=False)

    def empty(**kw):
        return None

    def floor():
        empty(top_k_tokens=s["topk"][:1], device_buffer_tokens=s["tokens"][:1], host_cache_locs=s["host_locs"][:1],
              device_buffer_locs=s["locs"][:1], host_cache=s["host"], device_buffer=s["device"],
              top_k_device_locs=s["out"][:1, :K], req_pool_indices=s["req"][:1], seq_lens=s["seq"][:1],
              lru_slots=s["lru"][:1], item_size_bytes=ITEM, num_top_k=K, hot_buffer_size=HOT, page_size=1,
              block_size=960, num_real_reqs=s["num_real"], skip_io=False)

    return [("load_cache_to_device_buffer_mla", mla), ("load_cache_to_device_buffer_mla+plan", mla_plan),
            ("load_cache_to_device_buffer_dsv4_mla", dsv4), ("load_blocks_to_device_buffer_mha", mha),
            ("copy_cache_planned_mla", replay), ("floor: an empty Python call, same arguments", floor)]


# The host side of SGLang's HiSparse kernel entry (hisparse.cuh's
# load_cache_to_device_buffer: 13 tensors, two ints, three tensors), without
# the kernel: reads what its host code reads (shapes, strides, data pointers,
# two dtypes) and returns.
SGLANG_STUB = r"""
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
using tvm::ffi::TensorView;
static volatile int64_t sink;
static int64_t p(const TensorView& t) { return reinterpret_cast<int64_t>(t.data_ptr()); }
void load_cache_to_device_buffer(TensorView top_k, TensorView tokens, TensorView host_locs, TensorView locs,
    TensorView host_k, TensorView host_v, TensorView device_k, TensorView device_v, TensorView out, TensorView req,
    TensorView seq, TensorView lru, TensorView num_real, int64_t page_size, int64_t item_size_bytes,
    TensorView miss_src, TensorView miss_dst, TensorView miss_count) {
  sink = top_k.shape()[0] + host_locs.shape()[1] + tokens.strides()[0] + lru.strides()[0] + top_k.strides()[0] +
         out.strides()[0] + page_size + item_size_bytes + p(top_k) + p(tokens) + p(host_locs) + p(locs) + p(host_k) +
         p(device_k) + p(out) + p(req) + p(seq) + p(lru) + p(num_real) + seq.dtype().bits + req.dtype().bits +
         host_v.ndim() + device_v.ndim() + miss_src.ndim() + miss_dst.ndim() + miss_count.ndim();
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(load_cache_to_device_buffer, load_cache_to_device_buffer);
"""


def sglang_case(s, device):
    """(name, call) of SGLang's own MLA entry point (see the module doc)."""
    from sglang.kernels.ops.kvcache import hisparse

    name = "sglang: load_cache_to_device_buffer_mla"
    if device != "cuda":
        import tvm_ffi
        from tvm_ffi import libinfo

        build = tempfile.mkdtemp(prefix="kvtier-sglang-stub-")
        src, lib = os.path.join(build, "stub.cc"), os.path.join(build, "stub.so")
        with open(src, "w") as f:
            f.write(SGLANG_STUB)
        libdir = os.path.dirname(libinfo.find_libtvm_ffi())
        subprocess.run(["g++", "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{libinfo.find_include_path()}",
                        f"-I{libinfo.find_dlpack_include_path()}", src, f"-L{libdir}", "-ltvm_ffi",
                        f"-Wl,-rpath,{libdir}", "-o", lib], check=True)
        module = tvm_ffi.load_module(lib)
        # cached as SGLang caches its module, so the lookup costs what SGLang's does
        hisparse._jit_sparse_module = functools.cache(lambda *a, **k: module)
        name += " (its kernel function a no-op stub: no launch)"

    def call():
        hisparse.load_cache_to_device_buffer_mla(
            top_k_tokens=s["topk"][:1], device_buffer_tokens=s["tokens"][:1], host_cache_locs=s["host_locs"][:1],
            device_buffer_locs=s["locs"][:1], host_cache=s["host"], device_buffer=s["device"],
            top_k_device_locs=s["out"][:1, :K], req_pool_indices=s["req"][:1], seq_lens=s["seq"][:1],
            lru_slots=s["lru"][:1], item_size_bytes=ITEM, num_top_k=K, hot_buffer_size=HOT, page_size=1,
            block_size=960, num_real_reqs=s["num_real"], skip_io=False)

    return name, call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "torch-cpu", "cuda"], default="cpu")
    ap.add_argument("--calls", type=int, default=2000, help="calls per run (7 runs per case)")
    ap.add_argument("--reader", choices=["auto", "to_dlpack", "methods"], default="auto",
                    help="how kvtier reads plain torch tensors")
    ap.add_argument("--sglang", action="store_true", help="also time SGLang's own entry point (see above)")
    ap.add_argument("--json", help="also write one JSON line per case to this file")
    a = ap.parse_args()
    if a.device == "cuda":
        import torch

        xp, dev = torch, "cuda"
        sync = torch.cuda.synchronize
    elif a.device == "torch-cpu":
        import torch

        xp, dev, sync = torch, "cpu", (lambda: None)
    else:
        xp, dev, sync = None, "cpu", (lambda: None)
    s = arrays(xp, dev)
    reader = kvtier._swap_in.native().tensor_reader(a.reader) if xp is not None else None
    todo = cases(s)
    if a.sglang:
        if xp is None:
            ap.error("--sglang takes torch tensors (--device torch-cpu or cuda)")
        todo.insert(-1, sglang_case(s, a.device))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                                capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    rows = []
    for name, call in todo:
        for _ in range(50):
            call()
        sync()
        runs = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(a.calls):
                call()
            runs.append((time.perf_counter() - t0) / a.calls * 1e6)
            sync()
        row = dict(case=name, device=a.device, arrays="numpy" if xp is None else "torch", calls=a.calls, runs=7,
                   median_us=round(statistics.median(runs), 3), min_us=round(min(runs), 3),
                   max_us=round(max(runs), 3), kvtier=kvtier.version(), python=platform.python_version(),
                   numpy=np.__version__, machine=platform.machine(), cpu=platform.processor() or "")
        if xp is not None:
            row["torch"], row["reader"] = xp.__version__, reader
        if a.sglang:
            row["sglang"] = sys.modules["sglang"].__version__
        row["commit"] = commit
        rows.append(row)
        print(f"{name:46s} median {row['median_us']:7.2f} us  (min {row['min_us']:.2f}, max {row['max_us']:.2f})")
    if a.json:
        with open(a.json, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
