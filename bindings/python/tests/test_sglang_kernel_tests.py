"""SGLang's own HiSparse kernel tests, re-expressed, each run twice: on
kvtier's entry points with numpy arrays (the CPU executor), and, where
SGLang's real modules import (the test command's real-torch runs, one per
supported release), after install() through the names SGLang's tests import
from `sglang.kernels.ops.kvcache.hisparse`, on torch CPU tensors. The
scenarios are those of its repository's
`test/registered/kernels/ops/kvcache/test_hisparse.py` and
`test_hisparse_planned_copy.py` (the versions that go with SGLang
0.5.21-0.5.23) that concern the paths kvtier serves, with the same inputs and
expected values. Scenarios SGLang runs on ROCm only are kept where they
exercise one of these paths (their expected values are path facts, not
platform facts).

Not re-expressed: `transfer_cache_dsv4_mla` (a HiCache transfer, not a
HiSparse entry point kvtier replaces); the `device_locs=`/`host_binding=`
pass-through tests of SGLang's main branch (arguments no released SGLang
passes; kvtier refuses to install into an SGLang that does, see
test_contract.py); `test_hisparse_slot_mapping.py` (a Triton translation of
slot locations, not a swap-in path); the speculative tests (a later path).
"""

from __future__ import annotations

import numpy as np
import pytest

import kvtier.sglang
from kvtier import KvtierError
from real_sglang import VERSION, WHY_NOT, install_into_sglang, uninstall_sglang


class Kvtier:
    """kvtier's own entry points on numpy arrays (the CPU executor)."""

    name = "kvtier"
    load_cache_to_device_buffer_mla = staticmethod(kvtier.sglang.load_cache_to_device_buffer_mla)
    load_cache_to_device_buffer_dsv4_mla = staticmethod(kvtier.sglang.load_cache_to_device_buffer_dsv4_mla)
    copy_cache_planned_mla = staticmethod(kvtier.sglang.copy_cache_planned_mla)


class SGLangNames:
    """The names SGLang's tests import (`sglang.kernels.ops.kvcache.hisparse`)
    after kvtier is installed into the real SGLang, called on torch CPU
    tensors that share the tests' numpy arrays (so in-place updates show in
    the arrays the assertions read). Each call checks that the name is still
    the function the patched coordinator calls."""

    name = "sglang"

    def __init__(self, installed):
        import torch

        self.installed, self.torch = installed, torch

    def __getattr__(self, name):
        fn = getattr(self.installed.kernels, name)
        assert fn is getattr(self.installed.coordinator, name), f"{name} is not what the coordinator calls"
        assert fn.__module__.startswith("kvtier."), f"{name} is SGLang's own ({fn.__module__})"
        tensor = self.torch.from_numpy

        def call(**kw):
            return fn(**{k: tensor(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()})

        return call


API = Kvtier()


@pytest.fixture(scope="module")
def sglang_names():
    if VERSION is None:
        pytest.skip(WHY_NOT)
    mp = pytest.MonkeyPatch()
    try:
        yield SGLangNames(install_into_sglang(mp))
    finally:
        mp.undo()
        uninstall_sglang()


@pytest.fixture(autouse=True, params=["kvtier", "sglang"])
def api(request):
    """Every scenario twice: on kvtier's functions with numpy arrays, and on
    the real SGLang's kernel-module names with torch tensors."""
    global API
    API = Kvtier() if request.param == "kvtier" else request.getfixturevalue("sglang_names")
    yield API
    API = Kvtier()

DTYPE = np.float32
KV_DIM = 8
HOT = 4
PADDED = HOT + 1
HOST_ROWS = 16
DEVICE_ROWS = 16
ITEM = KV_DIM * 4
DSV4_PAGE_SIZE, DSV4_VALUE, DSV4_SCALE = 64, 576, 8
DSV4_ITEM = DSV4_VALUE + DSV4_SCALE
DSV4_PAGE_BYTES = ((DSV4_ITEM * DSV4_PAGE_SIZE + 575) // 576) * 576
DSV4_SCALE_OFFSET = DSV4_VALUE * DSV4_PAGE_SIZE


def host_cache(kv_dim=KV_DIM, rows=HOST_ROWS):
    return np.arange(rows * kv_dim, dtype=DTYPE).reshape(rows, 1, kv_dim)


def make_state(locs_rows, tokens_rows, newest_tokens):
    """SGLang's `_make_state`: slots 0..3 in LRU order 0..3, host row = token,
    the device rows of resident tokens (and the newest) filled from the host
    cache, every other device row -1."""
    hc = host_cache()
    device_buffer = np.full((DEVICE_ROWS, 1, KV_DIM), -1, dtype=DTYPE)
    locs = np.array(locs_rows, dtype=np.int32)
    tokens = np.array(tokens_rows, dtype=np.int32)
    n = locs.shape[0]
    lru = np.tile(np.arange(HOT, dtype=np.int16), (n, 1))
    host_locs = np.tile(np.arange(HOST_ROWS, dtype=np.int64), (n, 1))
    for rid, newest in enumerate(newest_tokens):
        for slot, token in enumerate(tokens_rows[rid][:HOT]):
            if token >= 0:
                device_buffer[locs[rid, slot]] = hc[token]
        device_buffer[locs[rid, HOT]] = hc[newest]
    return dict(host_cache=hc, device_buffer=device_buffer, device_buffer_locs=locs, device_buffer_tokens=tokens,
                lru_slots=lru, host_cache_locs=host_locs)


def run(*, top_k_tokens, seq_len=None, seq_lens=None, seq_lens_dtype=np.int32, req_pool_indices=None,
        num_real_reqs=None, output_fill_value=-1, **state):
    """SGLang's `_run_kernel`: MLA, page_size 1, block_size 256."""
    top_k_tokens = np.array(top_k_tokens, dtype=np.int32)
    batch = top_k_tokens.shape[0]
    if req_pool_indices is None:
        req_pool_indices = np.arange(batch, dtype=np.int64)
    if seq_lens is None:
        seq_lens = np.full(batch, seq_len, dtype=seq_lens_dtype)
    if num_real_reqs is None:
        num_real_reqs = batch
    out = np.full_like(top_k_tokens, output_fill_value)
    API.load_cache_to_device_buffer_mla(
        top_k_tokens=top_k_tokens, top_k_device_locs=out, req_pool_indices=req_pool_indices, seq_lens=seq_lens,
        item_size_bytes=ITEM, num_top_k=top_k_tokens.shape[1], hot_buffer_size=HOT, page_size=1, block_size=256,
        num_real_reqs=np.array([num_real_reqs], dtype=np.int32), **state,
    )
    return out


def long_case():
    # slots 0..3 hold tokens 1, 4, 2, 5 at rows 9, 7, 3, 5; the newest token
    # 7 sits in the reserved slot at row 11
    return make_state([[9, 7, 3, 5, 11]], [[1, 4, 2, 5, -1]], [7])


@pytest.mark.parametrize("seq_lens_dtype", [np.int32, np.int64])
def test_load_cache_to_device_buffer_fast_path(seq_lens_dtype):
    device_buffer = np.arange(DEVICE_ROWS * KV_DIM, dtype=DTYPE).reshape(DEVICE_ROWS, 1, KV_DIM)
    before = device_buffer.copy()
    tokens = np.array([[10, 11, 12, 13, -1]], dtype=np.int32)
    lru = np.array([[0, 1, 2, 3]], dtype=np.int16)
    tokens_before, lru_before = tokens.copy(), lru.copy()
    out = run(
        top_k_tokens=[[2, 0, 1]], device_buffer_tokens=tokens,
        host_cache_locs=np.arange(HOST_ROWS, dtype=np.int64).reshape(1, -1),
        device_buffer_locs=np.array([[13, 9, 5, 1, 15]], dtype=np.int32), host_cache=host_cache(),
        device_buffer=device_buffer, lru_slots=lru, seq_len=3, seq_lens_dtype=seq_lens_dtype,
    )
    assert out.tolist() == [[5, 13, 9]]
    assert (tokens == tokens_before).all() and (lru == lru_before).all()
    assert (device_buffer == before).all()


def test_load_cache_to_device_buffer_fast_path_overwrites_stale_output():
    state = make_state([[9, 7, 3, 5, 11]], [[0, 1, 2, 3, -1]], [4])
    out = run(top_k_tokens=[[1, -1, 0, 0]], seq_len=2, output_fill_value=123456, **state)
    assert out.tolist() == [[7, -1, -1, -1]]


def test_load_cache_to_device_buffer_hits_newest_and_updates_lru():
    state = long_case()
    out = run(top_k_tokens=[[4, 2, 7]], seq_len=8, **state)
    assert out.tolist() == [[7, 3, 11]]
    assert state["device_buffer_tokens"].tolist() == [[1, 4, 2, 5, -1]]
    assert state["lru_slots"].tolist() == [[0, 3, 1, 2]]


def test_load_cache_to_device_buffer_miss_uses_updated_lru_slot():
    state = long_case()
    run(top_k_tokens=[[4, 2]], seq_len=8, **state)
    out = run(top_k_tokens=[[6]], seq_len=8, **state)
    assert out.tolist() == [[9]]
    assert state["device_buffer_tokens"].tolist() == [[6, 4, 2, 5, -1]]
    assert state["lru_slots"].tolist() == [[3, 1, 2, 0]]
    assert (state["device_buffer"][9] == state["host_cache"][6]).all()


@pytest.mark.parametrize("kv_dim,miss_token", [(256, 4), (257, 4), (258, 4), (260, 4), (257, 5), (5, 4)])
def test_load_cache_to_device_buffer_miss_copy_is_byte_exact(kv_dim, miss_token):
    """Items of 1024, 1028, 1032, 1040 and 20 bytes. kvtier copies whole
    8-byte words, so a 1028- or 20-byte item is refused with a clear error
    (SGLang's CUDA kernel assumes the same and skips the case there)."""
    item = kv_dim * 4
    hc = host_cache(kv_dim)
    device_buffer = np.full((DEVICE_ROWS, 1, kv_dim), -1, dtype=DTYPE)
    device_buffer[:HOT] = hc[:HOT]
    kwargs = dict(
        top_k_tokens=np.array([[miss_token]], dtype=np.int32),
        device_buffer_tokens=np.array([[0, 1, 2, 3, -1]], dtype=np.int32),
        host_cache_locs=np.arange(HOST_ROWS, dtype=np.int64).reshape(1, -1),
        device_buffer_locs=np.array([[0, 1, 2, 3, 4]], dtype=np.int32), host_cache=hc,
        device_buffer=device_buffer, top_k_device_locs=np.full((1, 1), -1, dtype=np.int32),
        req_pool_indices=np.arange(1, dtype=np.int64), seq_lens=np.full(1, 8, dtype=np.int32),
        lru_slots=np.arange(HOT, dtype=np.int16).reshape(1, -1), item_size_bytes=item, num_top_k=1,
        hot_buffer_size=HOT, page_size=1, block_size=256, num_real_reqs=np.array([1], dtype=np.int32),
    )
    if item % 8:
        with pytest.raises(KvtierError, match="item_size_bytes"):
            API.load_cache_to_device_buffer_mla(**kwargs)
        return
    API.load_cache_to_device_buffer_mla(**kwargs)
    assert kwargs["top_k_device_locs"].tolist() == [[0]]
    assert (device_buffer[0] == hc[miss_token]).all()
    for slot in range(1, HOT):
        assert (device_buffer[slot] == hc[slot]).all(), "no over-copy into the neighbours"


def test_load_cache_to_device_buffer_multiple_misses_copy_all_slots():
    state = make_state([[9, 7, 3, 5, 11]], [[0, 1, 2, 3, -1]], [8])
    out = run(top_k_tokens=[[4, 5, 6, 7]], seq_len=9, **state)
    assert out.tolist() == [[9, 7, 3, 5]]
    assert state["device_buffer_tokens"].tolist() == [[4, 5, 6, 7, -1]]
    assert state["lru_slots"].tolist() == [[0, 1, 2, 3]]
    for token, loc in zip([4, 5, 6, 7], [9, 7, 3, 5]):
        assert (state["device_buffer"][loc] == state["host_cache"][token]).all()


def test_load_cache_to_device_buffer_batched_with_padding():
    state = make_state(
        [[9, 7, 3, 5, 11], [12, 10, 8, 6, 14], [15, 4, 2, 1, 13]],
        [[1, 4, 2, 5, -1], [0, 1, 2, 3, -1], [9, 8, 7, 6, -1]],
        [7, 4, 5],
    )
    padded_tokens = state["device_buffer_tokens"][2].copy()
    padded_lru = state["lru_slots"][2].copy()
    out = run(top_k_tokens=[[4, 6, 7], [2, 1, 0], [9, 8, 7]], seq_lens=np.array([8, 3, 8], dtype=np.int32),
              num_real_reqs=2, output_fill_value=123456, **state)
    assert out.tolist() == [[7, 9, 11], [8, 10, 12], [-1, -1, -1]]
    assert state["device_buffer_tokens"][:2].tolist() == [[6, 4, 2, 5, -1], [0, 1, 2, 3, -1]]
    assert state["lru_slots"][:2].tolist() == [[2, 3, 0, 1], [0, 1, 2, 3]]
    assert (state["device_buffer_tokens"][2] == padded_tokens).all()
    assert (state["lru_slots"][2] == padded_lru).all()
    assert (state["device_buffer"][9] == state["host_cache"][6]).all()


# ---- DeepSeek-V4's page-padded C4 layout -------------------------------------


def dsv4_token_pattern(seed):
    value = ((np.arange(DSV4_VALUE, dtype=np.int16) + seed) % 256).astype(np.uint8)
    scale = ((np.arange(DSV4_SCALE, dtype=np.int16) + seed + 17) % 256).astype(np.uint8)
    return value, scale


def write_dsv4_token(cache, loc, seed):
    page, offset = divmod(loc, DSV4_PAGE_SIZE)
    value, scale = dsv4_token_pattern(seed)
    cache[page, offset * DSV4_VALUE : (offset + 1) * DSV4_VALUE] = value
    start = DSV4_SCALE_OFFSET + offset * DSV4_SCALE
    cache[page, start : start + DSV4_SCALE] = scale


def read_dsv4_token(cache, loc):
    page, offset = divmod(loc, DSV4_PAGE_SIZE)
    start = DSV4_SCALE_OFFSET + offset * DSV4_SCALE
    return np.concatenate([cache[page, offset * DSV4_VALUE : (offset + 1) * DSV4_VALUE],
                           cache[page, start : start + DSV4_SCALE]])


def test_dsv4_swap_in_reads_paged_host_layout():
    hc = np.zeros((2, DSV4_PAGE_BYTES), dtype=np.uint8)
    device_buffer = np.zeros((2, DSV4_PAGE_BYTES), dtype=np.uint8)
    host_loc, swap_loc = DSV4_PAGE_SIZE + 1, DSV4_PAGE_SIZE + 12
    write_dsv4_token(hc, host_loc, seed=41)
    host_cache_locs = np.zeros((1, 8), dtype=np.int64)
    host_cache_locs[0, 3] = host_loc
    out = np.full((1, 1), -1, dtype=np.int32)
    API.load_cache_to_device_buffer_dsv4_mla(
        top_k_tokens=np.array([[3]], dtype=np.int32),
        device_buffer_tokens=np.full((1, PADDED), -1, dtype=np.int32), host_cache_locs=host_cache_locs,
        device_buffer_locs=np.array([[swap_loc + i for i in range(5)]], dtype=np.int32), host_cache=hc,
        device_buffer=device_buffer, top_k_device_locs=out, req_pool_indices=np.array([0], dtype=np.int64),
        seq_lens=np.array([8], dtype=np.int32), lru_slots=np.arange(HOT, dtype=np.int16).reshape(1, -1),
        item_size_bytes=DSV4_ITEM, num_top_k=1, hot_buffer_size=HOT, page_size=1, block_size=256,
        num_real_reqs=np.array([1], dtype=np.int32),
    )
    assert out.item() == swap_loc
    assert (read_dsv4_token(device_buffer, swap_loc) == read_dsv4_token(hc, host_loc)).all()


def test_load_cache_to_device_buffer_dsv4_mla_miss_copy_layout():
    num_pages = (HOST_ROWS + DSV4_PAGE_SIZE - 1) // DSV4_PAGE_SIZE
    state = long_case()
    hc = np.zeros((num_pages, DSV4_PAGE_BYTES), dtype=np.uint8)
    for token in range(HOST_ROWS):
        write_dsv4_token(hc, token, seed=token + 1)
    device_buffer = np.full((num_pages, DSV4_PAGE_BYTES), 0xFF, dtype=np.uint8)
    out = np.full((1, 1), -1, dtype=np.int32)
    API.load_cache_to_device_buffer_dsv4_mla(
        top_k_tokens=np.array([[6]], dtype=np.int32), device_buffer_tokens=state["device_buffer_tokens"],
        host_cache_locs=state["host_cache_locs"], device_buffer_locs=state["device_buffer_locs"], host_cache=hc,
        device_buffer=device_buffer, top_k_device_locs=out, req_pool_indices=np.array([0], dtype=np.int64),
        seq_lens=np.array([8], dtype=np.int32), lru_slots=state["lru_slots"], item_size_bytes=DSV4_ITEM,
        num_top_k=1, hot_buffer_size=HOT, page_size=DSV4_PAGE_SIZE, block_size=256,
        num_real_reqs=np.array([1], dtype=np.int32),
    )
    assert out.tolist() == [[9]]
    assert (read_dsv4_token(device_buffer, 9) == read_dsv4_token(hc, 6)).all()


def test_load_cache_to_device_buffer_dsv4_fused_copy_multi_miss():
    seq_len = 16
    host_locs = list(range(seq_len))
    miss_tokens = [4, 5, 6, 7]
    for token, loc in zip(miss_tokens, [10, 63, 64, 127]):
        host_locs[token] = loc
    device_locs = [0, 1, 63, 64, 65]
    hc = np.zeros((2, DSV4_PAGE_BYTES), dtype=np.uint8)
    for loc in host_locs:
        write_dsv4_token(hc, loc, seed=loc + 1)
    device_buffer = np.full((2, DSV4_PAGE_BYTES), 0xFF, dtype=np.uint8)
    out = np.full((1, 4), -1, dtype=np.int32)
    API.load_cache_to_device_buffer_dsv4_mla(
        top_k_tokens=np.array([miss_tokens], dtype=np.int32),
        device_buffer_tokens=np.array([[0, 1, 2, 3, -1]], dtype=np.int32),
        host_cache_locs=np.array([host_locs], dtype=np.int64),
        device_buffer_locs=np.array([device_locs], dtype=np.int32), host_cache=hc, device_buffer=device_buffer,
        top_k_device_locs=out, req_pool_indices=np.array([0], dtype=np.int64),
        seq_lens=np.array([seq_len], dtype=np.int32), lru_slots=np.arange(HOT, dtype=np.int16).reshape(1, -1),
        item_size_bytes=DSV4_ITEM, num_top_k=4, hot_buffer_size=HOT, page_size=DSV4_PAGE_SIZE, block_size=256,
        num_real_reqs=np.array([1], dtype=np.int32),
    )
    landed = out.tolist()[0]
    assert len(set(landed)) == len(landed) and set(landed) <= set(device_locs)
    for token, dst in zip(miss_tokens, landed):
        assert (read_dsv4_token(device_buffer, dst) == read_dsv4_token(hc, host_locs[token])).all()
    for loc in set(device_locs) - set(landed):
        assert (read_dsv4_token(device_buffer, loc) == 0xFF).all(), "no over-copy past the value or the scale"


def test_load_cache_to_device_buffer_large_lru_writeback():
    """device_buffer_tokens with HOT columns (no newest column): only the LRU
    slots are read and written."""
    top_k, hot, seq_len, kv_dim = 2048, 4096, 7299, 4
    top_k_tokens = np.concatenate([np.arange(1000, 2000), np.arange(5000, 6048)]).astype(np.int32).reshape(1, -1)
    lru = np.arange(hot, dtype=np.int16).reshape(1, -1)
    out = np.full_like(top_k_tokens, -1)
    API.load_cache_to_device_buffer_mla(
        top_k_tokens=top_k_tokens, device_buffer_tokens=np.arange(hot, dtype=np.int32).reshape(1, -1),
        host_cache_locs=np.arange(seq_len, dtype=np.int64).reshape(1, -1),
        device_buffer_locs=np.arange(hot + 1, dtype=np.int32).reshape(1, -1),
        host_cache=np.zeros((seq_len, 1, kv_dim), dtype=DTYPE),
        device_buffer=np.empty((hot + 1, 1, kv_dim), dtype=DTYPE), top_k_device_locs=out,
        req_pool_indices=np.array([0], dtype=np.int64), seq_lens=np.array([seq_len], dtype=np.int32),
        lru_slots=lru, item_size_bytes=kv_dim * 4, num_top_k=top_k, hot_buffer_size=hot, page_size=1,
        block_size=1024, num_real_reqs=np.array([1], dtype=np.int32),
    )
    expected = np.concatenate([np.arange(2048, 4096), np.arange(0, 1000), np.arange(2000, 2048),
                               np.arange(1000, 2000)]).astype(np.int16)
    assert (lru.reshape(-1) == expected).all()


# ---- copy_cache_planned_mla (test_hisparse_planned_copy.py) -------------------

NUM_REQS, PLAN_STRIDE, PLAN_HOST_ROWS = 6, 8, 64
DEV_SLOTS = NUM_REQS * PLAN_STRIDE


def planned_buffers(item_bytes):
    host = (np.arange(PLAN_HOST_ROWS * item_bytes, dtype=np.int64) * 37 % 251).astype(np.uint8)
    return host.reshape(PLAN_HOST_ROWS, item_bytes), np.zeros((DEV_SLOTS, item_bytes), dtype=np.uint8)


def plan(counts, num_real):
    g = np.arange(NUM_REQS * PLAN_STRIDE, dtype=np.int64)
    src = (g % PLAN_HOST_ROWS).reshape(NUM_REQS, PLAN_STRIDE)
    dst = g.reshape(NUM_REQS, PLAN_STRIDE).astype(np.int32)
    return src, dst, np.array(counts, dtype=np.int32), np.array([num_real], dtype=np.int32)


def expected(host, src, dst, counts, num_real, item_bytes):
    out = np.zeros((DEV_SLOTS, item_bytes), dtype=np.uint8)
    for r in range(num_real):
        for m in range(counts[r]):
            out[int(dst[r, m])] = host[int(src[r, m])]
    return out


def replay(host, dev, src, dst, cnt, real, item_bytes, skip_io=False):
    API.copy_cache_planned_mla(miss_src=src, miss_dst=dst, miss_count=cnt, num_real_reqs=real, host_cache=host,
                           device_buffer=dev, item_size_bytes=item_bytes, num_blocks=2, block_size=256,
                           skip_io=skip_io)


@pytest.mark.parametrize("item_bytes", [8, 512, 656, 1152])
def test_replay_is_byte_exact_for_ragged_rows(item_bytes):
    counts = [3, 0, PLAN_STRIDE, 1, 5, 2]
    host, dev = planned_buffers(item_bytes)
    src, dst, cnt, real = plan(counts, NUM_REQS)
    replay(host, dev, src, dst, cnt, real, item_bytes)
    assert (dev == expected(host, src, dst, counts, NUM_REQS, item_bytes)).all()


def test_partial_batch_ignores_rows_beyond_num_real_reqs():
    item_bytes, counts, num_real = 656, [4, 2, 7, 3, 1, 5], 3
    host, dev = planned_buffers(item_bytes)
    src, dst, cnt, real = plan(counts, num_real)
    replay(host, dev, src, dst, cnt, real, item_bytes)
    assert (dev == expected(host, src, dst, counts, num_real, item_bytes)).all()
    assert not dev[num_real * PLAN_STRIDE :].any()


def test_skip_io_moves_no_bytes():
    item_bytes = 656
    host, dev = planned_buffers(item_bytes)
    src, dst, cnt, real = plan([PLAN_STRIDE] * NUM_REQS, NUM_REQS)
    replay(host, dev, src, dst, cnt, real, item_bytes, skip_io=True)
    assert not dev.any()
