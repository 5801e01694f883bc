"""The speculative swap-in (MTP/EAGLE verify) through SGLang's entry point
``load_cache_to_device_buffer_spec_mla``, on the CPU executor, with SGLang's
``HiSparseSpecState`` built as SGLang builds it.

SGLang's kernel assigns unique-miss order and CLOCK victims with atomics, so
its state after a call is not deterministic; these tests check what SGLang's
own tests check (its repository's
``test/registered/kernels/ops/kvcache/test_hisparse_spec.py``, every scenario
re-expressed here with the same inputs and expected values), and, after every
call, that the state is one SGLang's next call can work on: every hot token
is found by SGLang's lookup, no device row is lost or doubled between the hot
buffer and the scratch, the counters are reset and the epochs advanced."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest

from kvtier import KvtierError
from kvtier.sglang import copy_cache_planned_mla, load_cache_to_device_buffer_spec_mla

TOKEN_SCALE = 1_000_003
SpecState = namedtuple("SpecState", "cache_index cache_policy scratch_locs scratch_state")
KNUTH = 2654435761
M32 = 0xFFFFFFFF


class Swap:
    """One layer's device buffer, host cache and HiSparseSpecState, laid out
    as SGLang's spec test lays them out: request r owns device rows
    [r × (hot + page + scratch), ...): its hot slots, its extra page, then its
    scratch; the host cache holds token t's `words` int64 as t × TOKEN_SCALE + w;
    the hot buffer starts holding tokens 0..hot-1."""

    def __init__(self, *, num_reqs, hot, page, scratch, seq_len, words, occurrences):
        self.hot, self.page, self.words = hot, page, words
        slots = hot + page
        per_req = slots + scratch
        self.tokens = np.full((num_reqs, slots), -1, dtype=np.int32)
        self.tokens[:, :hot] = np.arange(hot, dtype=np.int32)
        bases = (np.arange(num_reqs, dtype=np.int32) * per_req)[:, None]
        self.locs = (bases + np.arange(slots, dtype=np.int32)[None, :]).astype(np.int32)
        scratch_locs = (bases + slots + np.arange(scratch, dtype=np.int32)[None, :]).astype(np.int32)
        self.host_locs = np.tile(np.arange(seq_len, dtype=np.int64), (num_reqs, 1))
        self.host = (np.arange(seq_len, dtype=np.int64)[:, None] * TOKEN_SCALE
                     + np.arange(words, dtype=np.int64)[None, :])
        self.device = np.full((num_reqs * per_req, words), -1, dtype=np.int64)
        self.device[self.locs[:, :hot].ravel()] = np.tile(self.host[:hot], (num_reqs, 1))
        hash_size = 1 << (2 * hot - 1).bit_length()
        cache_index = np.full((num_reqs, 2, hash_size), -1, dtype=np.int64)
        t = np.arange(hot, dtype=np.int64)
        cache_index[:, 0, (t * KNUTH) & (hash_size - 1)] = (t << 32) | t
        state = np.full((num_reqs + 1, max(4 * num_reqs, 5 * occurrences)), -1, dtype=np.int32)
        state[0] = 0
        self.state = SpecState(cache_index, np.zeros((num_reqs + 1, hot), dtype=np.int32), scratch_locs, state)
        self.all_rows = np.sort(np.concatenate([self.locs[:, :hot].ravel(), scratch_locs.ravel()]))

    def run(self, top_k_tokens, seq_lens, *, out=None, req=None, num_real=None, plan=None):
        bs = top_k_tokens.shape[0]
        if out is None:
            out = np.full(top_k_tokens.shape, -1, dtype=np.int32)
        else:
            out.fill(-1)
        src, dst, cnt = plan if plan is not None else (None, None, None)
        load_cache_to_device_buffer_spec_mla(
            top_k_tokens=np.ascontiguousarray(top_k_tokens, dtype=np.int32),
            device_buffer_tokens=self.tokens,
            host_cache_locs=self.host_locs,
            device_buffer_locs=self.locs,
            host_cache=self.host,
            device_buffer=self.device,
            top_k_device_locs=out,
            req_pool_indices=np.arange(bs, dtype=np.int64) if req is None else req,
            seq_lens=np.asarray(seq_lens, dtype=np.int32),
            state=self.state,
            num_real_reqs=np.array([bs if num_real is None else num_real], dtype=np.int32),
            miss_src=src,
            miss_dst=dst,
            miss_count=cnt,
        )
        return out

    def misses(self, rid=0) -> int:
        """SGLang's unique-miss counter of the last call."""
        return int(self.state.scratch_state[0, rid])

    def assert_outputs_hold(self, out, top_k_tokens):
        """Every output row holds the bytes of the token asked for."""
        want = top_k_tokens.astype(np.int64)[..., None] * TOKEN_SCALE + np.arange(self.words)
        np.testing.assert_array_equal(self.device[out.astype(np.int64)], want)

    # ---- SGLang's lookup, re-implemented to check the state ----------------

    def lookup(self, rid, token) -> int:
        hot, tokens = self.hot, self.tokens[rid]
        if 0 <= token < hot and tokens[token] == token:
            return token
        index = self.state.cache_index[rid]
        size = index.shape[1]
        for bank, pos in ((0, ((token * KNUTH) & M32) & (size - 1)), (1, secondary(token) & (size - 1))):
            e = int(index[bank, pos])
            if e >= 0 and (e & M32) == token:
                slot = e >> 32
                if slot < hot and tokens[slot] == token:
                    return slot
        if int(self.state.scratch_state[0, 3 * self.state.scratch_locs.shape[0] + rid]) & (1 << 31):
            hits = np.flatnonzero(tokens[:hot] == token)
            return int(hits[0]) if len(hits) else -1
        return -1

    def assert_consistent(self):
        """The state SGLang's next call needs: each hot token found by its
        lookup at its own slot and held once, the device rows of the hot
        slots and the scratch a permutation of the rows they started as, the
        per-call counters reset."""
        r = self.state.scratch_locs.shape[0]
        for rid in range(r):
            held = self.tokens[rid, :self.hot]
            live = held[held >= 0]
            assert len(np.unique(live)) == len(live), "a token is held by two hot slots"
            for slot in np.flatnonzero(held >= 0):
                assert self.lookup(rid, int(held[slot])) == slot
        rows = np.sort(np.concatenate([self.locs[:, :self.hot].ravel(), self.state.scratch_locs.ravel()]))
        np.testing.assert_array_equal(rows, self.all_rows)
        counters = self.state.scratch_state[0]
        assert (counters[r:3 * r] == 0).all(), "work and union-hit counters must be reset"


def secondary(token: int) -> int:
    h = token & M32
    h ^= h >> 16
    h = (h * 0x7FEB352D) & M32
    h ^= h >> 15
    h = (h * 0x846CA68B) & M32
    h ^= h >> 16
    return h


def sglang_state(**kw) -> Swap:
    """SGLang's test state: hot 4096, page 64, 4 steps of 2048."""
    base = dict(num_reqs=1, hot=4096, page=64, scratch=4096, seq_len=16384, words=72, occurrences=4 * 2048)
    base.update(kw)
    return Swap(**base)


def cross_step_misses(hot=4096, top_k=2048, counts=(196, 196, 195, 195)):
    """SGLang's 782-miss query: each step rolls the hot tokens by 137 and
    ends with its own fresh misses."""
    steps, next_miss = [], hot
    for step, n in enumerate(counts):
        hits = np.roll(np.arange(hot, dtype=np.int32), step * 137)[: top_k - n]
        steps.append(np.concatenate([hits, np.arange(next_miss, next_miss + n, dtype=np.int32)]))
        next_miss += n
    return np.stack(steps)[None]


# ---- SGLang's scenarios ---------------------------------------------------


def test_deduplicates_repeated_misses_and_copies_full_items():
    s = sglang_state()
    step = np.concatenate([np.arange(2048 - 196, dtype=np.int32), 4096 + np.arange(196, dtype=np.int32)])
    tk = np.tile(step, (1, 4, 1))
    out = s.run(tk, np.full(4, 16384))
    s.assert_outputs_hold(out, tk)
    assert s.misses() == 196
    repeated = out[0, :, -196:]
    assert (repeated == repeated[0]).all()
    s.assert_consistent()


def test_copies_782_cross_step_unique_misses():
    s = sglang_state()
    tk = cross_step_misses()
    out = s.run(tk, np.full(4, 16384))
    s.assert_outputs_hold(out, tk)
    assert s.misses() == 782
    s.assert_consistent()


def test_records_union_plan_for_shared_layer_io():
    s = sglang_state()
    tk = cross_step_misses()
    src = np.full((1, 8192), -1, dtype=np.int64)
    dst = np.full((1, 8192), -1, dtype=np.int32)
    cnt = np.full(1, -1, dtype=np.int32)
    s.run(tk, np.full(4, 16384), plan=(src, dst, cnt))
    shared = np.full_like(s.device, -1)
    copy_cache_planned_mla(miss_src=src, miss_dst=dst, miss_count=cnt, num_real_reqs=np.ones(1, dtype=np.int32),
                           host_cache=s.host, device_buffer=shared, item_size_bytes=s.host.strides[0])
    assert int(cnt[0]) == 782
    n = int(cnt[0])
    np.testing.assert_array_equal(shared[dst[0, :n]], s.host[src[0, :n]])
    np.testing.assert_array_equal(shared[dst[0, :n]], s.device[dst[0, :n]])
    assert len(np.unique(src[0, :n])) == n, "each unique miss is copied once"


def test_padded_request_clears_stale_plan_count():
    s = sglang_state(num_reqs=2, seq_len=8192, words=1)
    tk = np.tile(np.arange(2048, dtype=np.int32), (2, 4, 1))
    src = np.full((2, 8192), -1, dtype=np.int64)
    dst = np.full((2, 8192), -1, dtype=np.int32)
    cnt = np.full(2, 123, dtype=np.int32)
    out = s.run(tk, np.full(8, 8192), num_real=1, plan=(src, dst, cnt))
    assert int(cnt[1]) == 0
    assert (out[1] == 0).all(), "SGLang writes padding rows 0"
    s.assert_outputs_hold(out[:1], tk[:1])


def test_resolves_all_speculative_extra_page_slots_without_host_io():
    seq_len = 8192
    s = sglang_state(seq_len=seq_len)
    draft = np.arange(seq_len - 4, seq_len, dtype=np.int32)
    offsets = np.array([0, 7, 31, 63])
    extra_locs = s.locs[0, 4096 + offsets]
    s.tokens[0, 4096 + offsets] = draft
    s.device[extra_locs] = s.host[draft]
    s.host_locs[0, draft] = -1  # a host read would find nothing
    hits = np.arange(2047, dtype=np.int32)
    tk = np.stack([np.concatenate([hits, draft[i:i + 1]]) for i in range(4)])[None]
    out = s.run(tk, draft + 1)
    s.assert_outputs_hold(out, tk)
    np.testing.assert_array_equal(out[0, :, -1], extra_locs)
    assert s.misses() == 0


def test_full_union_overflow_preserves_all_8192_outputs():
    s = sglang_state(scratch=8192 - 4096)
    tk = (4096 + np.arange(8192, dtype=np.int32)).reshape(1, 4, 2048)
    src = np.full((1, 8192), -1, dtype=np.int64)
    dst = np.full((1, 8192), -1, dtype=np.int32)
    cnt = np.full(1, -1, dtype=np.int32)
    out = s.run(tk, np.full(4, 16384), plan=(src, dst, cnt))
    s.assert_outputs_hold(out, tk)
    assert len(np.unique(out)) == 8192
    assert s.misses() == 8192
    assert int(cnt[0]) == 8192
    assert (src >= 0).all() and (dst >= 0).all()
    s.assert_consistent()


def test_packed_ring_supports_glm52_native_context_length():
    seq_len = 1_048_648
    s = sglang_state(seq_len=seq_len, words=1)
    tk = np.tile(np.arange(2048, dtype=np.int32), (1, 4, 1))
    tk[:, :, -1] = seq_len - 1
    seq = np.full(4, seq_len)
    out = s.run(tk, seq)
    s.assert_outputs_hold(out, tk)
    assert (out >= 0).all()
    # the high token entered the packed hash: the second call is all hits
    out = s.run(tk, seq)
    s.assert_outputs_hold(out, tk)
    assert s.misses() == 0
    s.assert_consistent()


def test_repeated_calls_preserve_valid_locations():
    """SGLang's CUDA-graph replay scenario on the CPU executor: the same
    inputs four more times into one output buffer."""
    s = sglang_state(seq_len=65536)
    tk = np.tile(np.arange(2048, dtype=np.int32), (4, 1))
    for step, n in enumerate((164, 102, 61, 20)):
        tk[step, -n:] = np.arange(8192 + step * 2048, 8192 + step * 2048 + n, dtype=np.int32)
    tk = tk[None]
    seq = np.array([65533, 65534, 65535, 65536])
    s.run(tk, seq)
    out = np.full(tk.shape, -1, dtype=np.int32)
    for _ in range(4):
        s.run(tk, seq, out=out)
        s.assert_outputs_hold(out, tk)
        assert (out >= 0).all()
        s.assert_consistent()


def test_rejects_invalid_step_shape():
    s = sglang_state(seq_len=8192, words=1)
    with pytest.raises(KvtierError, match="2-4 steps"):
        s.run(np.zeros((1, 1, 2048), dtype=np.int32), np.array([8192]))


# ---- invariants on random and adversarial queries -------------------------


def test_a_second_identical_call_is_all_hits():
    s = sglang_state()
    tk = cross_step_misses()
    src = np.full((1, 8192), -1, dtype=np.int64)
    dst = np.full((1, 8192), -1, dtype=np.int32)
    cnt = np.full(1, -1, dtype=np.int32)
    s.run(tk, np.full(4, 16384))
    out = s.run(tk, np.full(4, 16384), plan=(src, dst, cnt))
    s.assert_outputs_hold(out, tk)
    assert s.misses() == 0 and int(cnt[0]) == 0


def random_query(rng, bs, steps, k, hot, seq_len, page):
    """Per row: a mix of hot tokens, fresh misses shared across steps and
    fresh ones per step, -1 padding, and the verify tokens at the end."""
    tk = np.empty((bs, steps, k), dtype=np.int32)
    for b in range(bs):
        shared = rng.choice(np.arange(hot, seq_len - page), size=k // 4, replace=False)
        for s in range(steps):
            pool = np.concatenate([rng.choice(hot, size=k, replace=False), shared,
                                   rng.choice(np.arange(hot, seq_len - page), size=k // 8, replace=False)])
            row = rng.choice(np.unique(pool), size=k, replace=False).astype(np.int32)
            row[rng.random(k) < 0.02] = -1
            tk[b, s] = row
    return tk


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_keep_every_invariant(seed):
    rng = np.random.default_rng(seed)
    steps = int(rng.integers(2, 5))
    k = int(rng.choice([1024, 2048])) if steps * 2048 <= 8192 else 1024
    hot = int(rng.choice([k + 512, 2 * k, 4096]))
    bs, seq_len, page = int(rng.integers(1, 4)), 20000, 8
    # SGLang's sizing (min(T, max(1024, T - hot))): every miss finds a row
    t = steps * k
    scratch = int(rng.choice([min(t, max(1024, t - hot)), t]))
    s = Swap(num_reqs=bs + 1, hot=hot, page=page, scratch=scratch, seq_len=seq_len, words=2,
             occurrences=steps * k)
    req = rng.permutation(bs + 1)[:bs].astype(np.int64)
    for call in range(4):
        tk = random_query(rng, bs, steps, k, hot, seq_len, page)
        plan = (np.full((bs, steps * k), -1, dtype=np.int64), np.full((bs, steps * k), -1, dtype=np.int32),
                np.full(bs, -1, dtype=np.int32))
        valid = tk >= 0
        # no token is on the extra page, so every token not resident before
        # the call is one unique miss
        asked = [np.unique(tk[b][valid[b]]) for b in range(bs)]
        resident = [sum(s.lookup(int(req[b]), int(t)) >= 0 for t in asked[b]) for b in range(bs)]
        out = s.run(tk, np.full(bs * steps, seq_len), req=req, plan=plan)
        s.assert_outputs_hold(out[valid], tk[valid])
        assert (out[~valid] == -1).all()
        for b in range(bs):
            assert s.misses(int(req[b])) == len(asked[b]) - resident[b]
            assert int(plan[2][b]) == s.misses(int(req[b]))
            n = int(plan[2][b])
            np.testing.assert_array_equal(s.device[plan[1][b, :n]], s.host[plan[0][b, :n]])
        s.assert_consistent()
        # the same query again: nothing to load
        again = s.run(tk, np.full(bs * steps, seq_len), req=req)
        s.assert_outputs_hold(again[valid], tk[valid])
        if hot >= steps * k:
            assert all(s.misses(int(r)) == 0 for r in req), "a union that fits the hot buffer stays"
        s.assert_consistent()


@pytest.mark.parametrize("shape", ["identical", "disjoint", "duplicates"])
def test_adversarial_queries(shape):
    s = sglang_state()
    rng = np.random.default_rng(7)
    if shape == "identical":
        step = rng.choice(np.arange(4096, 16384), size=2048, replace=False).astype(np.int32)
        tk = np.tile(step, (1, 4, 1))
        want = 2048
    elif shape == "disjoint":
        tk = rng.choice(np.arange(4096, 16384), size=8192, replace=False).astype(np.int32).reshape(1, 4, 2048)
        want = 8192
    else:  # every token twice within its step
        half = rng.choice(np.arange(4096, 16384), size=(4, 1024), replace=False).astype(np.int32)
        tk = np.concatenate([half, half], axis=1)[None]
        want = len(np.unique(half))
    src = np.full((1, 8192), -1, dtype=np.int64)
    dst = np.full((1, 8192), -1, dtype=np.int32)
    cnt = np.full(1, -1, dtype=np.int32)
    out = s.run(tk, np.full(4, 16384), plan=(src, dst, cnt))
    s.assert_outputs_hold(out, tk)
    assert s.misses() == want
    assert int(cnt[0]) == want, "each unique miss copied once, also past the scratch"
    assert len(np.unique(src[0, :want])) == want
    s.assert_consistent()


def test_a_union_past_scratch_and_hot_buffer_is_reported():
    """8192 misses, 1024 scratch rows and 4096 hot slots (below SGLang's
    sizing): 3072 misses have no row to go to. SGLang's kernel outputs -1 for
    them silently; kvtier outputs -1 and reports each."""
    s = sglang_state(scratch=1024)
    tk = (4096 + np.arange(8192, dtype=np.int32)).reshape(1, 4, 2048)
    out = np.full(tk.shape, 9, dtype=np.int32)
    with pytest.raises(KvtierError, match="3072 entries") as e:
        s.run(tk, np.full(4, 16384), out=out)
    assert e.value.status == "BAD_INDICES"
    placed = out >= 0
    assert placed.sum() == 8192 - 3072
    assert (out[~placed] == -1).all()
    s.assert_outputs_hold(out[placed], tk[placed])
    assert s.misses() == 8192
    s.assert_consistent()


def test_tokens_out_of_range_are_counted_never_read():
    s = sglang_state(seq_len=8192, words=2)
    tk = np.tile(np.arange(2048, dtype=np.int32), (1, 4, 1))
    tk[0, 0, 5] = 8000   # past this step's sequence (7000)
    tk[0, 1, 6] = 1 << 30  # far past the host table
    tk[0, 2, 7] = -5
    before = s.device.copy()
    with pytest.raises(KvtierError, match="3 entries") as e:
        s.run(tk, np.array([7000, 8192, 8192, 8192]))
    assert e.value.status == "BAD_INDICES"
    # the call finished: refused entries output -1, the rest as usual
    out = np.full(tk.shape, -1, dtype=np.int32)
    with pytest.raises(KvtierError):
        s.run(tk, np.array([7000, 8192, 8192, 8192]), out=out)
    bad = np.zeros(tk.shape, dtype=bool)
    bad[0, 0, 5] = bad[0, 1, 6] = bad[0, 2, 7] = True
    assert (out[bad] == -1).all()
    s.assert_outputs_hold(out[~bad], tk[~bad])
    np.testing.assert_array_equal(s.device, before)  # all hits: nothing loaded
    s.assert_consistent()


def test_bad_requests_and_lengths_refuse_their_row_only():
    s = sglang_state(num_reqs=3, seq_len=8192, words=1)
    tk = np.tile(np.arange(2048, dtype=np.int32), (3, 4, 1))
    tk[:, :, -1] = 5000
    with pytest.raises(KvtierError, match="BAD|entries|request"):
        out = np.full(tk.shape, 9, dtype=np.int32)
        s.run(tk, np.full(12, 8192), req=np.array([0, 0, 7]), out=out)
    out = np.full(tk.shape, 9, dtype=np.int32)
    with pytest.raises(KvtierError):
        s.run(tk, np.full(12, 8192), req=np.array([0, 0, 7]), out=out)
    assert (out[1:] == -1).all(), "a duplicated and an out-of-range request output -1"
    s.assert_outputs_hold(out[:1], tk[:1])
    seq = np.full(12, 8192)
    seq[5] = 9000  # past the host table
    out = np.full(tk.shape, 9, dtype=np.int32)
    with pytest.raises(KvtierError):
        s.run(tk, seq, req=np.array([2, 1, 0]), out=out)
    assert (out[1] == -1).all()
    s.assert_consistent()


def test_arguments_are_checked_before_anything_runs():
    s = sglang_state(seq_len=8192, words=1)
    tk = np.tile(np.arange(2048, dtype=np.int32), (1, 4, 1))
    seq = np.full(4, 8192, dtype=np.int32)
    kw = dict(top_k_tokens=tk, device_buffer_tokens=s.tokens, host_cache_locs=s.host_locs,
              device_buffer_locs=s.locs, host_cache=s.host, device_buffer=s.device,
              top_k_device_locs=np.zeros(tk.shape, dtype=np.int32), req_pool_indices=np.zeros(1, dtype=np.int64),
              seq_lens=seq, state=s.state, num_real_reqs=np.ones(1, dtype=np.int32))
    before = [a.copy() for a in (s.tokens, s.locs, *s.state)]

    def refused(match, **over):
        with pytest.raises(KvtierError, match=match):
            load_cache_to_device_buffer_spec_mla(**{**kw, **over})

    refused("seq_lens", seq_lens=seq[:3])
    refused("top_k_tokens", top_k_tokens=np.zeros((1, 4, 512), dtype=np.int32))
    refused("top_k_device_locs", top_k_device_locs=np.zeros((1, 4, 2047), dtype=np.int32))
    refused("scratch_state", state=s.state._replace(scratch_state=s.state.scratch_state[:, :100]))
    refused("cache_index", state=s.state._replace(cache_index=s.state.cache_index[:, :, :1000]))
    refused("cache_index", state=s.state._replace(cache_index=s.state.cache_index[:, :1]))
    refused("state", state=(1, 2))
    refused("shares memory", top_k_device_locs=s.state.scratch_state[1, :8192].reshape(1, 4, 2048))
    refused("int32", seq_lens=seq.astype(np.float32))
    refused("miss_src", miss_src=np.zeros((1, 8192), dtype=np.int64))
    refused("num_real_reqs", num_real_reqs=None)
    for a, b in zip(before, (s.tokens, s.locs, *s.state)):
        np.testing.assert_array_equal(a, b)
