"""kvtier's SGLang entry points on numpy arrays (the CPU executor): the
worked example, a padded batch, random cases of every path (MLA, DeepSeek-V4,
MiniMax-M3 blocks, shared-index replays, mixed batches) against the reference
model in hisparse_model.py, and argument checks."""

from __future__ import annotations

import hisparse_model as model
import numpy as np
import pytest
from conftest import ITEM, REPOSITORY, Case, needs_repository, worked_example

from kvtier import KvtierError
from kvtier.sglang import (
    copy_cache_planned_mla,
    load_blocks_to_device_buffer_mha,
    load_cache_to_device_buffer_dsv4_mla,
    load_cache_to_device_buffer_mla,
)

swap = load_cache_to_device_buffer_mla


def test_design_worked_example():
    c = worked_example([4, 2, 7])
    swap(**c.kwargs())
    assert c.out.tolist() == [[7, 3, 11]]
    assert c.lru.tolist() == [[0, 3, 1, 2]]
    assert c.tokens.tolist() == [[1, 4, 2, 5, 7]], "hits load nothing"
    assert (c.device_buffer == 0xEE).all()

    # Then [6]: slot 0 is evicted and loaded from host row 6.
    second = c.kwargs(top_k_tokens=np.array([[6]], dtype=np.int32), num_top_k=1)
    out = np.full((1, 1), -7, dtype=np.int32)
    second["top_k_device_locs"] = out
    swap(**second)
    assert out.tolist() == [[9]]
    assert c.tokens.tolist() == [[6, 4, 2, 5, 7]]
    assert c.lru.tolist() == [[3, 1, 2, 0]]
    assert (c.device_buffer[9 * ITEM : 10 * ITEM] == 6).all(), "device row 9 now holds host row 6"
    untouched = np.delete(c.device_buffer.reshape(12, ITEM), 9, axis=0)
    assert (untouched == 0xEE).all()


def test_positional_arguments_and_defaults_as_sglang_calls_them():
    c = worked_example([4, 2, 7])
    k = c.kwargs()
    swap(k["top_k_tokens"], k["device_buffer_tokens"], k["host_cache_locs"], k["device_buffer_locs"],
         k["host_cache"], k["device_buffer"], k["top_k_device_locs"], k["req_pool_indices"], k["seq_lens"],
         k["lru_slots"], ITEM, 3, 4, 1, 960, None)
    assert c.out.tolist() == [[7, 3, 11]]


def three_requests(num_real):
    """Request 0: the worked example. Request 1: a short sequence (5 tokens,
    token t in slot t). Request 2: another long one. Batch rows name
    requests 0, 1, 2; rows at or past num_real are padding."""
    hot, stride = 4, 6  # one more than hot + 1, as SGLang pads its rows
    tokens = np.full((3, stride), -1, dtype=np.int32)
    locs = np.full((3, stride), -1, dtype=np.int32)
    tokens[0, :5] = [1, 4, 2, 5, 7]
    locs[0, :5] = [9, 7, 3, 5, 11]
    tokens[1, :5] = [0, 1, 2, 3, -1]
    locs[1, :5] = [20, 21, 22, 23, 24]
    tokens[2, :5] = [3, 0, 9, 1, 10]
    locs[2, :5] = [30, 31, 32, 33, 34]
    lru = np.array([[0, 1, 2, 3], [0, 1, 2, 3], [2, 0, 3, 1]], dtype=np.int16)
    host_locs = np.full((3, 12), -1, dtype=np.int64)
    host_locs[0, :8] = np.arange(8)
    host_locs[1, :4] = np.arange(100, 104)
    host_locs[2, :11] = np.arange(200, 211)
    host_rows = 211
    host_cache = (np.arange(host_rows, dtype=np.uint32)[:, None] % 251).astype(np.uint8).repeat(ITEM, 1).ravel()
    topk = np.array([[4, 2, 7], [3, 0, -1], [8, 9, 10]], dtype=np.int32)
    return Case(
        tokens=tokens, locs=locs, lru=lru, host_locs=host_locs, host_cache=host_cache,
        device_buffer=np.full(40 * ITEM, 0xEE, dtype=np.uint8), topk=topk,
        req=np.array([0, 1, 2], dtype=np.int64), seq=np.array([8, 4, 11], dtype=np.int32),
        hot=hot, k=3, num_real=None if num_real is None else np.array([num_real], dtype=np.int32),
    )


def test_a_batch_with_padding_rows():
    c = three_requests(num_real=2)
    before = (c.tokens.copy(), c.lru.copy(), c.device_buffer.copy())
    swap(**c.kwargs())
    assert c.out.tolist() == [[7, 3, 11], [23, 20, -1], [-1, -1, -1]]
    assert (c.tokens == before[0]).all(), "hits, a short row and a padding row change no slot"
    assert c.lru[0].tolist() == [0, 3, 1, 2]
    assert c.lru[1:].tolist() == before[1][1:].tolist(), "short and padding rows keep their LRU"
    assert (c.device_buffer == before[2]).all()

    # The same batch with every row real: row 2 misses token 8.
    c = three_requests(num_real=3)
    swap(**c.kwargs())
    assert c.out[2].tolist()[2] == 34, "token 10 is the newest: the reserved slot"
    # LRU of request 2 is [2, 0, 3, 1]: slot 2 holds 9 (hit); the first
    # evictable, slot 0, takes token 8.
    assert c.out[2].tolist() == [30, 32, 34]
    assert c.tokens[2, :5].tolist() == [8, 0, 9, 1, 10]
    assert c.lru[2].tolist() == [3, 1, 0, 2]
    assert (c.device_buffer[30 * ITEM : 31 * ITEM] == 208 % 251).all()


# ---- random cases of every path against the reference model ------------------

ENTRY = {
    "mla": load_cache_to_device_buffer_mla,
    "dsv4": load_cache_to_device_buffer_dsv4_mla,
    "mha": load_blocks_to_device_buffer_mha,
}


def check_against_model(c, got_plan=None, want=None):
    want = want or model.reference(c)
    assert c.out.tolist() == want["out"].tolist()
    assert c.tokens.tolist() == want["tokens"].tolist()
    assert c.lru.tolist() == want["lru"].tolist()
    for d, w in zip(c.devices, want["devices"]):
        assert (model.as_bytes(d) == w).all()
    return want


@pytest.mark.parametrize("path", ["mla", "dsv4", "mha"])
@pytest.mark.parametrize("seed", range(120))
def test_random_cases_match_the_reference(path, seed):
    c = model.random_case(seed, path)
    other_layer = [a[0].copy() for a in c.layers]
    want = model.reference(c)
    ENTRY[path](**c.kwargs())
    check_against_model(c, want=want)
    for a, before in zip(c.layers, other_layer):
        assert (a[0] == before).all(), "the other layer's state is untouched"


def recorded(src, dst, cnt, rows):
    return {b: [(int(src[b, m]), int(dst[b, m])) for m in range(int(cnt[b]))] if cnt[b] != -3 else "untouched"
            for b in range(rows)}


@pytest.mark.parametrize("path", ["mla", "dsv4"])
@pytest.mark.parametrize("seed", range(60))
def test_random_miss_plans_and_skip_io(path, seed):
    c = model.random_case(1000 + seed, path)
    batch = len(c.req)
    stride = c.entries + 5
    src = np.full((batch, stride), -3, dtype=np.int64)
    dst = np.full((batch, stride), -3, dtype=np.int32)
    cnt = np.full(batch, -3, dtype=np.int32)
    before = [model.as_bytes(d).copy() for d in c.devices]
    skip = seed % 2 == 1
    want = model.reference(c, plan_rows={b: "untouched" for b in range(batch)})
    ENTRY[path](**c.kwargs(miss_src=src, miss_dst=dst, miss_count=cnt, skip_io=skip))
    if skip:
        want["devices"] = before
    check_against_model(c, want=want)
    assert recorded(src, dst, cnt, batch) == want["plan"], "padding rows keep their count, as in SGLang"


@pytest.mark.parametrize("path", ["mla", "dsv4"])
@pytest.mark.parametrize("seed", range(40))
def test_shared_index_layers_replay_the_anchors_plan(path, seed):
    """A shared-index group: the anchor layer swaps in and records its plan;
    each skip layer (its own KV bytes, the anchor's slot table) replays it.
    Every layer ends with what a swap-in on it would have given."""
    c = model.random_case(2000 + seed, path)
    batch = len(c.req)
    skip_host = [np.random.default_rng(seed).integers(0, 256, size=model.as_bytes(h).size, dtype=np.uint8)
                 for h in c.hosts]
    skip_dev = [model.as_bytes(d).copy() for d in c.devices]
    skip_case = model.Case(path, tokens=c.tokens.copy(), locs=c.locs, lru=c.lru.copy(), host_locs=c.host_locs,
                           hosts=skip_host, devices=[d.copy() for d in skip_dev], query=c.query, req=c.req,
                           seq=c.seq, hot=c.hot, k=c.k, rows=c.rows, block=c.block, num_real=c.num_real)
    want_skip = model.reference(skip_case)
    cap = c.entries + 2
    src = np.zeros((batch + 4, cap), dtype=np.int64)[:batch]
    dst = np.zeros((batch + 4, cap), dtype=np.int32)[:batch]
    cnt = np.zeros(batch + 4, dtype=np.int32)[:batch]
    ENTRY[path](**c.kwargs(miss_src=src, miss_dst=dst, miss_count=cnt))
    check_against_model(c)
    real = np.array([batch if c.num_real is None else int(c.num_real[0])], dtype=np.int32)
    copy_cache_planned_mla(miss_src=src, miss_dst=dst, miss_count=cnt, num_real_reqs=real,
                           host_cache=skip_host[0].reshape(c.hosts[0].shape) if path == "dsv4" else skip_host[0],
                           device_buffer=skip_dev[0], item_size_bytes=c.rows.item, is_dsv4_layout=path == "dsv4")
    assert (skip_dev[0] == want_skip["devices"][0]).all()


@pytest.mark.parametrize("seed", range(60))
def test_mixed_batches_of_short_long_and_padding_rows(seed):
    """Mostly short rows mixed with long ones and padding, on every path."""
    for path in ENTRY:
        c = model.random_case(3000 + seed, path, short_share=0.6)
        want = model.reference(c)
        ENTRY[path](**c.kwargs())
        check_against_model(c, want=want)


# ---- refused arguments and bad indices --------------------------------------


def refused(c: Case, **over) -> str:
    snapshot = [a.copy() for a in (c.tokens, c.lru, c.device_buffer, c.out)]
    with pytest.raises(KvtierError) as e:
        swap(**c.kwargs(**over))
    for a, b in zip((c.tokens, c.lru, c.device_buffer, c.out), snapshot):
        assert (a == b).all(), "a refused call changes nothing"
    return str(e.value)


def test_arguments_are_checked_before_anything_runs():
    c = worked_example([4, 2, 7])
    assert "`top_k_tokens`: is int64" in refused(c, top_k_tokens=c.topk.astype(np.int64))
    assert "`lru_slots`: is int32" in refused(c, lru_slots=c.lru.astype(np.int32))
    assert "`host_cache_locs`: is int32" in refused(c, host_cache_locs=c.host_locs.astype(np.int32))
    assert "`device_buffer_tokens`: has 3 columns" in refused(c, device_buffer_tokens=c.tokens[:, :3])
    assert "`device_buffer_locs`: has 4 columns" in refused(c, device_buffer_locs=c.locs[:, :4])
    assert "`top_k_tokens`: has shape [3]" in refused(c, top_k_tokens=c.topk[0])
    assert "column stride" in refused(c, top_k_tokens=np.zeros((1, 6), dtype=np.int32)[:, ::2])
    assert "must be contiguous" in refused(c, host_cache=np.zeros(32 * ITEM, dtype=np.uint8)[::2])
    ro = c.out.copy()
    ro.flags.writeable = False
    assert "read-only" in refused(c, top_k_device_locs=ro)
    assert "`page_size`" in refused(c, page_size=0)
    assert "`block_size`" in refused(c, block_size=0)
    assert "together" in refused(c, miss_src=np.zeros((1, 3), dtype=np.int64))
    assert "is a list" in refused(c, seq_lens=[8])
    assert "`num_top_k`" in refused(c, num_top_k=0)
    assert "`num_real_reqs`" in refused(c, num_real_reqs=np.array([1], dtype=np.int64))
    assert "row stride" in refused(c, miss_src=np.zeros((2, 3), dtype=np.int64),
                                   miss_dst=np.zeros((2, 6), dtype=np.int32)[:, :3],
                                   miss_count=np.zeros(2, dtype=np.int32), req_pool_indices=np.zeros(2, np.int32),
                                   seq_lens=np.full(2, 8, np.int32), top_k_tokens=np.zeros((2, 3), np.int32),
                                   top_k_device_locs=np.zeros((2, 3), np.int32))
    assert "`item_size_bytes`" in refused(c, item_size_bytes=0)
    assert "`item_size_bytes`: True is not a positive int" in refused(c, item_size_bytes=True)
    assert "`item_size_bytes`: 4294967296 is outside 1..=4294967295" in refused(c, item_size_bytes=2**32)
    # the library's own checks come back with its message
    msg = refused(c, num_top_k=3, hot_buffer_size=2)
    assert "hot_buffer_size" in msg, msg
    msg = refused(c, item_size_bytes=12)
    assert "item_size_bytes" in msg and "multiple of 8" in msg, msg


def test_bad_indices_are_refused_entry_by_entry_and_reported():
    c = worked_example([4, 9, 7])  # token 9 is not below seq_len 8
    with pytest.raises(KvtierError) as e:
        swap(**c.kwargs())
    assert e.value.status == "BAD_INDICES"
    assert "top_k_tokens[0][1] = 9" in str(e.value), str(e.value)
    assert c.out.tolist() == [[7, -1, 11]], "the rest of the row is served"
    assert (c.device_buffer == 0xEE).all()


def test_a_bad_host_row_is_never_read():
    c = worked_example([6])
    c.host_locs[0, 6] = 10**9
    with pytest.raises(KvtierError) as e:
        swap(**c.kwargs())
    assert e.value.status == "BAD_INDICES"
    assert "host" in str(e.value)
    assert c.out.tolist() == [[-1]]
    assert (c.device_buffer == 0xEE).all()


# ---- MiniMax-M3 blocks, DeepSeek-V4 pages and replays: bad input ----------------


def block_case():
    """The worked example's state with K and V planes; blocks of 2 tokens."""
    c = worked_example([0])
    hosts = [c.host_cache, (c.host_cache + 100).astype(np.uint8)]
    devices = [c.device_buffer, np.full_like(c.device_buffer, 0xDD)]
    return model.Case("mha", tokens=c.tokens, locs=c.locs, lru=c.lru, host_locs=c.host_locs, hosts=hosts,
                      devices=devices, query=np.array([[2, 3]], dtype=np.int32), req=c.req, seq=c.seq, hot=4,
                      k=2, rows=model.Rows(ITEM), block=2)


def test_block_query_loads_k_and_v_together():
    c = block_case()
    load_blocks_to_device_buffer_mha(**c.kwargs())
    # block 2 = tokens 4 (slot 1), 5 (slot 3); block 3 = token 6 (a miss into
    # slot 0, row 9) and 7 (the newest)
    assert c.out.tolist() == [[7, 5, 9, 11]]
    assert (c.devices[0][9 * ITEM : 10 * ITEM] == 6).all() and (c.devices[1][9 * ITEM : 10 * ITEM] == 106).all()
    assert c.lru.tolist() == [[2, 0, 1, 3]]


def test_block_query_bad_input_is_refused_or_reported():
    c = block_case()
    c.query = np.array([[3, -4]], dtype=np.int32)
    c.seq = np.array([7], dtype=np.int64)
    with pytest.raises(KvtierError) as e:
        load_blocks_to_device_buffer_mha(**c.kwargs())
    assert e.value.status == "BAD_INDICES" and "top_k_tokens[0][1] = -4" in str(e.value)
    assert c.out.tolist() == [[11, -1, -1, -1]], "block 3: the newest token, then one past the sequence"
    c = block_case()
    assert "`host_cache_v`" in str(pytest.raises(KvtierError, load_blocks_to_device_buffer_mha,
                                                 **c.kwargs(device_buffer_v=None)).value)
    msg = str(pytest.raises(KvtierError, load_blocks_to_device_buffer_mha,
                            **c.kwargs(sparse_block_size=3, top_k_device_locs=np.zeros((1, 6), np.int32))).value)
    assert "hot_buffer_size" in msg, "2 blocks of 3 tokens do not fit 4 slots: " + msg
    msg = str(pytest.raises(KvtierError, load_blocks_to_device_buffer_mha,
                            **c.kwargs(top_k_device_locs=np.zeros((1, 3), np.int32))).value)
    assert "`top_k_device_locs`: has 3 columns" in msg, msg


def test_dsv4_bad_input_is_refused_or_reported():
    c = model.random_case(7, "dsv4", short_share=0.0)
    while len(c.req) == 0:
        c = model.random_case(c.hot + 100, "dsv4", short_share=0.0)
    msg = str(pytest.raises(KvtierError, load_cache_to_device_buffer_dsv4_mla, **c.kwargs(item_size_bytes=576)).value)
    assert "584" in msg, msg
    c.host_locs[:, :] = 10**6  # every host row outside the C4 host cache
    c.num_real = None
    with pytest.raises(KvtierError) as e:
        load_cache_to_device_buffer_dsv4_mla(**c.kwargs())
    assert e.value.status == "BAD_INDICES" and "outside the host cache" in str(e.value), str(e.value)


def test_replay_bad_counts_and_rows_are_refused_and_reported():
    host = np.arange(8 * 16, dtype=np.uint8)
    dev = np.zeros(8 * 16, dtype=np.uint8)
    src = np.array([[1, 99], [2, 3]], dtype=np.int64)
    dst = np.array([[0, 1], [2, 3]], dtype=np.int32)
    cnt = np.array([2, 5], dtype=np.int32)
    with pytest.raises(KvtierError) as e:
        copy_cache_planned_mla(miss_src=src, miss_dst=dst, miss_count=cnt, num_real_reqs=np.array([2], np.int32),
                               host_cache=host, device_buffer=dev, item_size_bytes=16)
    text = str(e.value)
    assert e.value.status == "BAD_INDICES" and "miss_count[1] = 5" in text and "host row 99" in text, text
    assert (dev[:16] == host[16:32]).all(), "the good entry of row 0 is copied"
    assert not dev[16:].any(), "nothing else: the bad entry and the bad row are skipped"
    with pytest.raises(KvtierError, match="`miss_count`: is int64"):
        copy_cache_planned_mla(miss_src=src, miss_dst=dst, miss_count=cnt.astype(np.int64),
                               num_real_reqs=np.array([2], np.int32), host_cache=host, device_buffer=dev,
                               item_size_bytes=16)
    with pytest.raises(TypeError):
        copy_cache_planned_mla(src, dst, cnt, np.array([2], np.int32), host, dev, 16)  # keyword-only, as SGLang's


@needs_repository
def test_every_strategy_is_the_headers_and_gives_the_same_result():
    """kvtier.swap_in's strategy names map to the C header's KVT_SWAP_IN_*
    values, and each runs (the CPU executor has one way: the same result)."""
    import re

    from kvtier import _lib
    from kvtier._swap_in import STRATEGIES, swap_in

    header = (REPOSITORY / "bindings" / "kvtier.h").read_text()
    defined = {m[1].lower(): int(m[2]) for m in re.finditer(r"#define KVT_SWAP_IN_(\w+) (\d+)", header)}
    assert STRATEGIES == defined
    for name in STRATEGIES:
        c = worked_example([4, 2, 7])
        k = c.kwargs()
        k["items"] = _lib.linear_items(k.pop("item_size_bytes"))
        swap_in(**k, strategy=name)
        assert c.out.tolist() == [[7, 3, 11]], name
        assert c.lru.tolist() == [[0, 3, 1, 2]], name
