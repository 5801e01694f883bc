"""Shared helpers: the DESIGN.md section 4 worked example as numpy arrays,
and a fake SGLang package for the install tests."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

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
    """DESIGN.md section 4: HOT = 4; slots 0..3 hold tokens 1, 4, 2, 5 at device
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


FAKE_COORDINATOR = textwrap.dedent(
    '''
    """A stand-in for sglang.srt.managers.hisparse_coordinator: the two
    module-level names kvtier replaces, used the way SGLang uses them."""
    from sglang.srt.mem_cache.pool_host import MLATokenToKVPoolHost


    def load_cache_to_device_buffer_mla(**kwargs):
        raise RuntimeError("SGLang's own swap-in ran")


    class HiSparseCoordinator:
        def __init__(self, layers, rows, kv_dim):
            self.mem_pool_host = MLATokenToKVPoolHost(layers, rows, kv_dim, layout="layer_first")

        def swap_in(self, **kwargs):
            return load_cache_to_device_buffer_mla(**kwargs)
    '''
)

FAKE_POOL_HOST = textwrap.dedent(
    '''
    """A stand-in for SGLang's host pool: the allocator object, then
    init_kv_buffer allocating [layers, rows, 1, kv_dim] through it."""
    import numpy as np


    class HostTensorAllocator:
        def allocate(self, dims, dtype, device):
            return np.zeros(dims, dtype=dtype)


    class MLATokenToKVPoolHost:
        def __init__(self, layers, rows, kv_dim, layout):
            self.layer_num, self.size, self.kv_cache_dim, self.layout = layers, rows, kv_dim, layout
            self.dtype = np.uint8
            self.allocator = HostTensorAllocator()
            self.kv_buffer = self.init_kv_buffer()

        def init_kv_buffer(self):
            dims = (self.layer_num, self.size, 1, self.kv_cache_dim)
            return self.allocator.allocate(dims, dtype=self.dtype, device="cpu")
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


def write_fake_sglang(root) -> None:
    files = {
        "sglang/__init__.py": "",
        "sglang/launch_server.py": FAKE_LAUNCH_SERVER,
        "sglang/srt/__init__.py": "",
        "sglang/srt/managers/__init__.py": "",
        "sglang/srt/managers/hisparse_coordinator.py": FAKE_COORDINATOR,
        "sglang/srt/managers/scheduler.py": FAKE_SCHEDULER,
        "sglang/srt/mem_cache/__init__.py": "",
        "sglang/srt/mem_cache/pool_host.py": FAKE_POOL_HOST,
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

    root = tmp_path / "fake"
    write_fake_sglang(root)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("KVTIER_SGLANG_CONFIG", raising=False)
    yield root
    kvtier.sglang.uninstall()
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]
