"""kvtier.sglang.load_cache_to_device_buffer_mla on numpy arrays (the CPU
executor): DESIGN.md section 4's worked example, a padded batch, randomized
cases against a reference model written here, and argument checks."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ITEM, Case, worked_example

from kvtier import KvtierError
from kvtier.sglang import load_cache_to_device_buffer_mla as swap


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


# ---- the reference model and random cases -----------------------------------


def reference(case: Case):
    """DESIGN.md section 4, written as its lists (valid input, -1 padding):
    returns (out, tokens, lru, device_buffer) after the swap-in."""
    tokens, lru, dev = case.tokens.copy(), case.lru.copy(), case.device_buffer.copy()
    hot, k, item = case.hot, case.k, case.item
    real = len(case.req) if case.num_real is None else int(case.num_real[0])
    out = np.full((len(case.req), k), -1, dtype=np.int32)
    for b in range(len(case.req)):
        if b >= real:
            continue
        r, s = int(case.req[b]), int(case.seq[b])
        row = [int(t) for t in case.topk[b, :k]]
        locs = case.locs[r]
        if s <= hot:
            out[b] = [locs[t] if t != -1 else -1 for t in row]
            continue
        newest = s - 1
        wanted = []
        for t in row:
            if t not in (-1, newest) and t not in wanted:
                wanted.append(t)
        order = [int(x) for x in lru[r]]
        hits = [slot for slot in order if tokens[r, slot] in wanted]
        evictable = [slot for slot in order if tokens[r, slot] not in wanted]
        where = {int(tokens[r, slot]): slot for slot in hits}
        misses = [t for t in wanted if t not in where]
        for m, t in enumerate(misses):
            slot = evictable[m]
            tokens[r, slot] = t
            src, dst = int(case.host_locs[r, t]), int(locs[slot])
            dev[dst * item : (dst + 1) * item] = case.host_cache[src * item : (src + 1) * item]
            where[t] = slot
        out[b] = [locs[hot] if t == newest else -1 if t == -1 else locs[where[t]] for t in row]
        n = len(misses)
        lru[r] = evictable[n:] + evictable[:n] + hits
    return out, tokens, lru, dev


def random_case(seed: int) -> Case:
    rng = np.random.default_rng(seed)
    hot = int(rng.integers(1, 24))
    k = int(rng.integers(1, hot + 1))
    requests = int(rng.integers(1, 6))
    batch = int(rng.integers(0, requests + 1))
    max_tokens = hot + int(rng.integers(1, 2 * k + 8))
    item = int(rng.choice([8, 16, 24, 656]))
    pad = int(rng.integers(0, 3))
    width = hot + 1 + pad
    # SGLang's layout: [layers, requests, width] state, one layer's view.
    layers = 2
    tokens_all = np.full((layers, requests, width), -1, dtype=np.int32)
    locs_all = np.full((layers, requests, width), -1, dtype=np.int32)
    lru_all = np.zeros((layers, requests, hot), dtype=np.int16)
    host_locs = np.full((requests, max_tokens + pad), -1, dtype=np.int64)
    dev_rows = rng.permutation(requests * (hot + 1) + 3).astype(np.int32)
    host_rows = rng.permutation(requests * max_tokens + 2).astype(np.int64)
    seqs = []
    for r in range(requests):
        s = int(rng.integers(0, hot + 1)) if rng.random() < 0.3 else int(rng.integers(hot + 1, max_tokens + 1))
        seqs.append(s)
        locs_all[1, r, : hot + 1] = dev_rows[r * (hot + 1) : (r + 1) * (hot + 1)]
        host_locs[r, :max_tokens] = host_rows[r * max_tokens : (r + 1) * max_tokens]
        lru_all[1, r] = rng.permutation(hot)
        if s <= hot:
            tokens_all[1, r, :hot] = [t if t < s else -1 for t in range(hot)]
        else:
            resident = rng.permutation(s - 1)[:hot]
            tokens_all[1, r, :hot] = [t if rng.random() > 0.1 else -1 for t in resident]
            tokens_all[1, r, hot] = s - 1
    req = rng.permutation(requests)[:batch]
    topk_all = np.full((batch + 2, k + pad), -9, dtype=np.int32)
    for b, r in enumerate(req):
        s = seqs[r]
        if s <= hot:
            valid = list(rng.permutation(s))
            topk_all[b, :k] = [valid[i] if i < len(valid) else -1 for i in range(k)]
        else:
            pick = list(rng.permutation(s)[:k])
            while len(pick) < k:
                pick.append(-1)
            if rng.random() < 0.2:
                pick[int(rng.integers(0, k))] = -1  # padding inside a long query
            topk_all[b, :k] = pick
    host_cache = rng.integers(0, 256, size=(len(host_rows) * item), dtype=np.uint8)
    device_buffer = rng.integers(0, 256, size=(len(dev_rows) * item), dtype=np.uint8)
    if rng.random() < 0.5:
        # any dtype: rows are addressed by item_size_bytes
        host_cache = host_cache.view(np.float16 if item % 2 == 0 else np.uint8)
        device_buffer = device_buffer.view(np.int32 if item % 4 == 0 else np.uint8)
    num_real = np.array([int(rng.integers(0, batch + 1))], dtype=np.int32) if rng.random() < 0.5 else None
    case = Case(
        tokens=tokens_all[1], locs=locs_all[1], lru=lru_all[1], host_locs=host_locs,
        host_cache=host_cache, device_buffer=device_buffer, topk=topk_all[:batch],
        req=req.astype(np.int64 if rng.random() < 0.5 else np.int32),
        seq=np.array([seqs[r] for r in req], dtype=np.int64 if rng.random() < 0.5 else np.int32),
        hot=hot, k=k, item=item, num_real=num_real,
    )
    # the output: rows of a wider buffer, as SGLang's top_k_device_locs_buffer[:n]
    case.out = np.full((batch + 3, k + pad), -7, dtype=np.int32)[:batch, :k]
    case._all = (tokens_all, locs_all, lru_all)
    return case


def as_bytes(a):
    return a.view(np.uint8).ravel()


@pytest.mark.parametrize("seed", range(300))
def test_random_cases_match_the_reference(seed):
    c = random_case(seed)
    want_out, want_tokens, want_lru, want_dev = reference(
        Case(tokens=c.tokens, locs=c.locs, lru=c.lru, host_locs=c.host_locs, host_cache=as_bytes(c.host_cache),
             device_buffer=as_bytes(c.device_buffer), topk=c.topk, req=c.req, seq=c.seq, hot=c.hot, k=c.k,
             item=c.item, num_real=c.num_real)
    )
    other_layer = [a[0].copy() for a in c._all]
    swap(**c.kwargs())
    assert c.out.tolist() == want_out.tolist()
    assert c.tokens.tolist() == want_tokens.tolist()
    assert c.lru.tolist() == want_lru.tolist()
    assert (as_bytes(c.device_buffer) == want_dev).all()
    for a, before in zip(c._all, other_layer):
        assert (a[0] == before).all(), "the other layer's state is untouched"


@pytest.mark.parametrize("seed", range(60))
def test_random_miss_plans_and_skip_io(seed):
    c = random_case(1000 + seed)
    batch = len(c.req)
    stride = c.k + 5
    src = np.full((batch, stride), -3, dtype=np.int64)
    dst = np.full((batch, stride), -3, dtype=np.int32)
    cnt = np.full(batch, -3, dtype=np.int32)
    before_dev = c.device_buffer.copy()
    skip = seed % 2 == 1
    ref = Case(tokens=c.tokens.copy(), locs=c.locs, lru=c.lru.copy(), host_locs=c.host_locs,
               host_cache=as_bytes(c.host_cache), device_buffer=as_bytes(c.device_buffer).copy(), topk=c.topk,
               req=c.req, seq=c.seq, hot=c.hot, k=c.k, item=c.item, num_real=c.num_real)
    want_out, want_tokens, _, want_dev = reference(ref)
    swap(**c.kwargs(miss_src=src, miss_dst=dst, miss_count=cnt, skip_io=skip))
    assert c.out.tolist() == want_out.tolist()
    assert c.tokens.tolist() == want_tokens.tolist()
    if skip:
        assert (c.device_buffer == before_dev).all(), "skip_io moves no bytes"
    for b in range(batch):
        n = int(cnt[b])
        assert 0 <= n <= c.k
        for m in range(n):
            s, d = int(src[b, m]), int(dst[b, m])
            # each recorded miss is a host row copied (or, under skip_io, to be
            # copied) into a device row the row's output now points at
            assert d in c.out[b].tolist()
            assert (as_bytes(want_dev)[d * c.item : (d + 1) * c.item]
                    == as_bytes(c.host_cache)[s * c.item : (s + 1) * c.item]).all()
    if not skip:
        assert (as_bytes(c.device_buffer) == want_dev).all()


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
    assert "`device_buffer_tokens`: has 4 columns" in refused(c, device_buffer_tokens=c.tokens[:, :4])
    assert "`top_k_tokens`: has shape [3]" in refused(c, top_k_tokens=c.topk[0])
    assert "column stride" in refused(c, top_k_tokens=np.zeros((1, 6), dtype=np.int32)[:, ::2])
    assert "must be contiguous" in refused(c, host_cache=np.zeros(32 * ITEM, dtype=np.uint8)[::2])
    ro = c.out.copy()
    ro.flags.writeable = False
    assert "read-only" in refused(c, top_k_device_locs=ro)
    assert "`page_size`" in refused(c, page_size=64)
    assert "`block_size`" in refused(c, block_size=0)
    assert "together" in refused(c, miss_src=np.zeros((1, 3), dtype=np.int64))
    assert "is a list" in refused(c, seq_lens=[8])
    assert "`num_top_k`" in refused(c, num_top_k=0)
    assert "`num_real_reqs`" in refused(c, num_real_reqs=np.array([1], dtype=np.int64))
    assert "row stride" in refused(c, device_buffer_locs=np.zeros((2, 10), dtype=np.int32)[:, :5],
                                   device_buffer_tokens=np.zeros((2, 5), dtype=np.int32),
                                   lru_slots=np.zeros((2, 4), dtype=np.int16),
                                   host_cache_locs=np.zeros((2, 8), dtype=np.int64))
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
