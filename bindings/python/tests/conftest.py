"""Shared helpers: the worked example as numpy arrays, and a stand-in SGLang
package (0.5.23's HiSparse entry points, coordinator and host pools) for the
install tests."""

from __future__ import annotations

import sys
import textwrap

from pathlib import Path

import numpy as np
import pytest

# The repository around these tests, for the tests that check it (its README,
# its C header, its pins) rather than the installed package; skipped where
# the tests run from a copy outside it.
REPOSITORY = Path(__file__).resolve().parents[3]
needs_repository = pytest.mark.skipif(
    not (REPOSITORY / "Cargo.toml").is_file() or not (REPOSITORY / "kernels").is_dir(),
    reason="needs kvtier's repository around the tests",
)

ITEM = 16


class Case:
    """SGLang-shaped swap-in arguments as numpy arrays (one layer)."""

    def __init__(self, *, tokens, locs, lru, host_locs, host_cache, device_buffer, topk, req, seq, hot, k,
                 item=ITEM, num_real=None):
        self.tokens, self.locs, self.lru = tokens, locs, lru
        self.host_locs, self.host_cache, self.device_buffer = host_locs, host_cache, device_buffer
        self.topk, self.req, self.seq = topk, req, seq
        self.hot, self.k, self.item = hot, k, item
        self.num_real = num_real
        self.out = np.full((len(req), k), -7, dtype=np.int32)

    def kwargs(self, **over):
        kw = dict(
            top_k_tokens=self.topk,
            device_buffer_tokens=self.tokens,
            host_cache_locs=self.host_locs,
            device_buffer_locs=self.locs,
            host_cache=self.host_cache,
            device_buffer=self.device_buffer,
            top_k_device_locs=self.out,
            req_pool_indices=self.req,
            seq_lens=self.seq,
            lru_slots=self.lru,
            item_size_bytes=self.item,
            num_top_k=self.k,
            hot_buffer_size=self.hot,
            num_real_reqs=self.num_real,
        )
        kw.update(over)
        return kw


def worked_example(query) -> Case:
    """The worked example: HOT = 4; slots 0..3 hold tokens 1, 4, 2, 5 at device
    rows 9, 7, 3, 5; the newest token 7 in the reserved slot at row 11; LRU
    0, 1, 2, 3; seq_len 8; token t in host row t, whose bytes are all t."""
    return Case(
        tokens=np.array([[1, 4, 2, 5, 7]], dtype=np.int32),
        locs=np.array([[9, 7, 3, 5, 11]], dtype=np.int32),
        lru=np.array([[0, 1, 2, 3]], dtype=np.int16),
        host_locs=np.arange(8, dtype=np.int64).reshape(1, 8),
        host_cache=np.repeat(np.arange(8, dtype=np.uint8), ITEM),
        device_buffer=np.full(12 * ITEM, 0xEE, dtype=np.uint8),
        topk=np.array([query], dtype=np.int32),
        req=np.array([0], dtype=np.int32),
        seq=np.array([8], dtype=np.int64),
        hot=4,
        k=len(query),
    )


# SGLang 0.5.23's five entry points, by signature; calling one says it ran.
FAKE_KERNELS = textwrap.dedent(
    '''
    """A stand-in for sglang.kernels.ops.kvcache.hisparse: SGLang 0.5.23's
    entry points, signatures and defaults as published; each raises."""


    def load_cache_to_device_buffer_mla(top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs,
                                        host_cache, device_buffer, top_k_device_locs, req_pool_indices, seq_lens,
                                        lru_slots, item_size_bytes, num_top_k, hot_buffer_size, page_size=1,
                                        block_size=256, num_real_reqs=None, miss_src=None, miss_dst=None,
                                        miss_count=None, skip_io=False):
        raise RuntimeError("SGLang's own load_cache_to_device_buffer_mla ran")


    def load_cache_to_device_buffer_dsv4_mla(top_k_tokens, device_buffer_tokens, host_cache_locs,
                                             device_buffer_locs, host_cache, device_buffer, top_k_device_locs,
                                             req_pool_indices, seq_lens, lru_slots, item_size_bytes, num_top_k,
                                             hot_buffer_size, page_size=1, block_size=256, num_real_reqs=None,
                                             miss_src=None, miss_dst=None, miss_count=None, skip_io=False):
        raise RuntimeError("SGLang's own load_cache_to_device_buffer_dsv4_mla ran")


    def load_blocks_to_device_buffer_mha(top_k_blocks, device_buffer_tokens, host_cache_locs, device_buffer_locs,
                                         host_cache_k, host_cache_v, device_buffer_k, device_buffer_v,
                                         top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes,
                                         hot_buffer_size, sparse_block_size, page_size=1, block_size=256,
                                         num_real_reqs=None, skip_io=False):
        raise RuntimeError("SGLang's own load_blocks_to_device_buffer_mha ran")


    def copy_cache_planned_mla(*, miss_src, miss_dst, miss_count, num_real_reqs, host_cache, device_buffer,
                               item_size_bytes, num_blocks=4, block_size=1024, is_dsv4_layout=False, skip_io=False):
        raise RuntimeError("SGLang's own copy_cache_planned_mla ran")


    def load_cache_to_device_buffer_spec_mla(*, top_k_tokens, device_buffer_tokens, host_cache_locs,
                                             device_buffer_locs, host_cache, device_buffer, top_k_device_locs,
                                             req_pool_indices, seq_lens, state, num_real_reqs, miss_src=None,
                                             miss_dst=None, miss_count=None):
        raise RuntimeError("SGLang's own load_cache_to_device_buffer_spec_mla ran")
    '''
)

FAKE_COORDINATOR = textwrap.dedent(
    '''
    """A stand-in for sglang.srt.managers.hisparse_coordinator: the names
    kvtier replaces, bound at module level and called with the keywords
    SGLang 0.5.23's coordinator passes."""
    from sglang.kernels.ops.kvcache.hisparse import (
        copy_cache_planned_mla,
        load_blocks_to_device_buffer_mha,
        load_cache_to_device_buffer_dsv4_mla,
        load_cache_to_device_buffer_mla,
        load_cache_to_device_buffer_spec_mla,
    )
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool
    from sglang.srt.mem_cache.pool_host.mha import HiSparseMHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost


    class HiSparseCoordinator:
        def __init__(self, kind="mla", layers=2, rows=16, dim=16):
            self.kind = kind
            if kind == "dsv4":
                self.mem_pool_host = DeepSeekV4PagedHostPool([None] * layers, dim, rows)
            elif kind == "mha":
                self.mem_pool_host = HiSparseMHATokenToKVPoolHost(layers, rows, 1, dim)
            else:
                self.mem_pool_host = MLATokenToKVPoolHost(layers, rows, dim, layout="layer_first")

        def swap_in(self, a, record_plan=False, skip_io=False):
            plan = dict(miss_src=a["miss_src"], miss_dst=a["miss_dst"], miss_count=a["miss_count"]) if record_plan else {}
            skip_io_kwargs = dict(skip_io=skip_io)
            swap_in_fn = load_cache_to_device_buffer_dsv4_mla if self.kind == "dsv4" else load_cache_to_device_buffer_mla
            swap_in_fn(
                top_k_tokens=a["top_k_tokens"], device_buffer_tokens=a["device_buffer_tokens"],
                host_cache_locs=a["host_cache_locs"], device_buffer_locs=a["device_buffer_locs"],
                host_cache=a["host_cache"], device_buffer=a["device_buffer"],
                top_k_device_locs=a["top_k_device_locs"], req_pool_indices=a["req_pool_indices"],
                seq_lens=a["seq_lens"], lru_slots=a["lru_slots"], item_size_bytes=a["item_size_bytes"],
                num_top_k=a["num_top_k"], hot_buffer_size=a["hot_buffer_size"], page_size=1, block_size=960,
                num_real_reqs=a["num_real_reqs"], **skip_io_kwargs, **plan,
            )

        def replay(self, a):
            copy_cache_planned_mla(
                miss_src=a["miss_src"], miss_dst=a["miss_dst"], miss_count=a["miss_count"],
                num_real_reqs=a["num_real_reqs"], host_cache=a["host_cache"], device_buffer=a["device_buffer"],
                item_size_bytes=a["item_size_bytes"], num_blocks=4, is_dsv4_layout=self.kind == "dsv4",
                skip_io=False,
            )

        def swap_in_selected_blocks(self, a):
            load_blocks_to_device_buffer_mha(
                top_k_blocks=a["top_k_blocks"], device_buffer_tokens=a["device_buffer_tokens"],
                host_cache_locs=a["host_cache_locs"], device_buffer_locs=a["device_buffer_locs"],
                host_cache_k=a["host_cache_k"], host_cache_v=a["host_cache_v"],
                device_buffer_k=a["device_buffer_k"], device_buffer_v=a["device_buffer_v"],
                top_k_device_locs=a["top_k_device_locs"], req_pool_indices=a["req_pool_indices"],
                seq_lens=a["seq_lens"], lru_slots=a["lru_slots"], item_size_bytes=a["item_size_bytes"],
                hot_buffer_size=a["hot_buffer_size"], sparse_block_size=a["sparse_block_size"], page_size=1,
                block_size=960, num_real_reqs=a["num_real_reqs"], skip_io=False,
            )

        def spec_swap_in(self):
            load_cache_to_device_buffer_spec_mla(
                top_k_tokens=None, device_buffer_tokens=None, host_cache_locs=None, device_buffer_locs=None,
                host_cache=None, device_buffer=None, top_k_device_locs=None, req_pool_indices=None, seq_lens=None,
                state=None, num_real_reqs=None,
            )
    '''
)

FAKE_ALLOCATOR = textwrap.dedent(
    '''
    """A stand-in for SGLang's host-tensor allocator."""
    import numpy as np


    class HostTensorAllocator:
        def allocate(self, dims, dtype, device):
            return np.zeros(dims, dtype=dtype)
    '''
)

# SGLang's host-memory budget: a context-variable scope, else the host's DRAM
# (here FAKE_HOST_DRAM_BYTES), booked as SGLang 0.5.21-0.5.23 book it.
FAKE_BUDGET = textwrap.dedent(
    '''
    import contextlib
    import os
    from contextvars import ContextVar

    _budget = ContextVar("budget", default=None)


    @contextlib.contextmanager
    def host_memory_budget_scope(budget_bytes):
        token = _budget.set(budget_bytes)
        try:
            yield
        finally:
            _budget.reset(token)


    def host_memory_budget_bytes(requested_bytes=0):
        available = _budget.get()
        if available is not None:
            if requested_bytes <= available:
                _budget.set(available - requested_bytes)
            return available
        return int(os.environ.get("FAKE_HOST_DRAM_BYTES", 1 << 40))


    def check(requested_bytes):
        available = host_memory_budget_bytes(requested_bytes)
        if requested_bytes > available:
            raise ValueError(
                f"Not enough host memory available. Requesting {requested_bytes / 1e9:.2f} GB but only have "
                f"{available / 1e9:.2f} GB free."
            )
    '''
)

# The three host pools, checking the budget and allocating as SGLang's do:
# the allocator is set in the constructor, then the buffers go through it.
FAKE_MLA_POOL = textwrap.dedent(
    '''
    import numpy as np

    from sglang.srt.mem_cache.pool_host.base import check
    from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator


    class MLATokenToKVPoolHost:
        def __init__(self, layers, rows, kv_dim, layout, device_capacity_tokens=None):
            self.layer_num, self.size, self.kv_cache_dim, self.layout = layers, rows, kv_dim, layout
            self.device_capacity_tokens = device_capacity_tokens or rows // 2
            self.page_size = 1
            self.dtype = np.uint8
            self.allocator = HostTensorAllocator()
            check(layers * rows * kv_dim)
            self.kv_buffer = self.init_kv_buffer()

        def init_kv_buffer(self):
            dims = (self.layer_num, self.size, 1, self.kv_cache_dim)
            return self.allocator.allocate(dims, dtype=self.dtype, device="cpu")

        def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend="kernel"):
            self.backups = getattr(self, "backups", 0) + 1
    '''
)

FAKE_MHA_POOL = textwrap.dedent(
    '''
    import numpy as np

    from sglang.srt.mem_cache.pool_host.base import check
    from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator


    class HiSparseMHATokenToKVPoolHost:
        def __init__(self, layers, rows, heads, head_dim):
            self.layer_num, self.size, self.head_num, self.head_dim = layers, rows, heads, head_dim
            self.layout = "layer_first"
            self.dtype = np.uint8
            self.allocator = HostTensorAllocator()
            check(2 * layers * rows * heads * head_dim)
            self.kv_buffer = self.init_kv_buffer()
            self.k_buffer, self.v_buffer = self.kv_buffer[0], self.kv_buffer[1]

        def init_kv_buffer(self):
            dims = (2, self.layer_num, self.size, self.head_num, self.head_dim)
            return self.allocator.allocate(dims, dtype=self.dtype, device="cpu")
    '''
)

FAKE_DSV4_POOL = textwrap.dedent(
    '''
    import numpy as np

    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_bytes
    from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator


    class DeepSeekV4PagedHostPool:
        def __init__(self, device_buffers, item_bytes, num_host_pages, layout="layer_first"):
            self.layer_num = len(device_buffers)
            self.item_bytes, self.num_host_pages = item_bytes, num_host_pages
            self.allocator = HostTensorAllocator()
            self.layout = layout
            requested = self.layer_num * num_host_pages * item_bytes
            available = host_memory_budget_bytes()
            if requested > available:
                raise ValueError(f"Not enough host memory for V4 paged pool. Requesting {requested} B")
            self.kv_buffer = [
                self.allocator.allocate((num_host_pages, item_bytes), dtype=np.uint8, device="cpu")
                for _ in range(self.layer_num)
            ]

        def backup_tokens_from_device_all_layer(self, host_indices, device_indices):
            self.backups = getattr(self, "backups", 0) + 1
    '''
)

FAKE_SCHEDULER = textwrap.dedent(
    '''
    """A stand-in for SGLang's scheduler process entry point."""


    def report(tag):
        import sglang.srt.managers.hisparse_coordinator as c
        fn = c.load_cache_to_device_buffer_mla
        print(tag, "swap-in from", fn.__module__, "host pool", c.MLATokenToKVPoolHost.__qualname__, flush=True)
    '''
)

FAKE_LAUNCH_SERVER = textwrap.dedent(
    '''
    """A stand-in for sglang.launch_server: prints its arguments and starts a
    scheduler-like child with multiprocessing's spawn, as SGLang does."""
    import multiprocessing as mp
    import sys

    from sglang.srt.managers.scheduler import report

    if __name__ == "__main__":
        print("argv", " ".join(sys.argv[1:]), flush=True)
        report("parent")
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=report, args=("child",))
        p.start()
        p.join()
        sys.exit(p.exitcode)
    '''
)


FAKE_CLI = textwrap.dedent(
    '''
    """A stand-in for sglang.cli.main, the `sglang` command: `sglang serve`
    behaves as the stand-in launch_server does."""
    import multiprocessing as mp
    import sys

    from sglang.srt.managers.scheduler import report


    def main():
        assert sys.argv[1] == "serve", sys.argv
        print("serve argv", " ".join(sys.argv[2:]), flush=True)
        report("parent")
        p = mp.get_context("spawn").Process(target=report, args=("child",))
        p.start()
        p.join()
        sys.exit(p.exitcode)
    '''
)


def write_fake_sglang(root) -> None:
    files = {
        "sglang/__init__.py": "",
        "sglang/_version.py": "__version__ = version = '0.5.23'\n",
        "sglang/launch_server.py": FAKE_LAUNCH_SERVER,
        "sglang/cli/__init__.py": "",
        "sglang/cli/main.py": FAKE_CLI,
        "sglang/kernels/__init__.py": "",
        "sglang/kernels/ops/__init__.py": "",
        "sglang/kernels/ops/kvcache/__init__.py": "",
        "sglang/kernels/ops/kvcache/hisparse.py": FAKE_KERNELS,
        "sglang/srt/__init__.py": "",
        "sglang/srt/managers/__init__.py": "",
        "sglang/srt/managers/hisparse_coordinator.py": FAKE_COORDINATOR,
        "sglang/srt/managers/scheduler.py": FAKE_SCHEDULER,
        "sglang/srt/mem_cache/__init__.py": "",
        "sglang/srt/mem_cache/memory_pool_host.py": FAKE_DSV4_POOL,
        "sglang/srt/mem_cache/pool_host/__init__.py": "",
        "sglang/srt/mem_cache/pool_host/base.py": FAKE_BUDGET,
        "sglang/srt/mem_cache/pool_host/common.py": FAKE_ALLOCATOR,
        "sglang/srt/mem_cache/pool_host/mla.py": FAKE_MLA_POOL,
        "sglang/srt/mem_cache/pool_host/mha.py": FAKE_MHA_POOL,
    }
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    """A fake `sglang` package on sys.path; the shim uninstalled and the fake
    modules forgotten afterwards."""
    import kvtier.sglang

    # the real SGLang may be importable (and imported) here too: the fake
    # shadows it, first on the path and with none of its modules loaded
    kvtier.sglang.uninstall()
    forget_sglang()
    root = tmp_path / "fake"
    write_fake_sglang(root)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("KVTIER_SGLANG_CONFIG", raising=False)
    yield root
    kvtier.sglang.uninstall()
    forget_sglang()


def forget_sglang() -> None:
    """Drops every sglang module from sys.modules (the next import is fresh)."""
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]
