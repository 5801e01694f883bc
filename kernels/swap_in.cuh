// kernels/swap_in.cuh — what the swap-in planners (swap_in.cu,
// swap_in_few_miss.cu) and the copy kernel share: the entry classes, the
// planning hash table, reading a row's query, a row's outputs and refusal,
// a request's state rows, the short-sequence row, and the checked row copy.
#pragma once

#include "common.cuh"

namespace kvt {
namespace swap {

constexpr int32_t kEmptyKey = -1;      // hash key of an empty cell (inserted tokens are >= 0)
constexpr int32_t kNone = 0x7fffffff;  // "nothing yet" for min-reductions
// Per entry class; a value >= 0 marks a duplicate of that (canonical) entry.
constexpr int32_t kPad = -1;     // padding (or a block token past the sequence): output -1
constexpr int32_t kBad = -2;     // refused and reported: output -1
constexpr int32_t kNewest = -3;  // the token being decoded: the reserved slot
constexpr int32_t kCand = -4;    // a token of the LRU part, not yet resolved
constexpr int32_t kMiss = -5;    // to be loaded into an evicted slot
constexpr int32_t kDone = -6;    // output decided (in e_val)
// lru_old entries: the slot in the low 14 bits, then two flags.
constexpr uint16_t kSlotMask = 0x3fff;
constexpr uint16_t kUsable = 0x4000;  // not a hit, and its device row is in range
constexpr uint16_t kHit = 0x8000;

// Open-addressing table size for E entries: a power of two >= spread * E
// (kvt_swap_in_plan: 2, at most half full; the few-miss planner: 4). In
// closed form, not a doubling loop: the compact planner recomputes it at
// every shared-memory address (it keeps no offsets in registers), where the
// loop was 56 % of the instructions it executed on an H100 and made it 4.6x
// slower than the few-miss planner (bench/results/h100-2026-11-27/
// profile-planners). spread * E stays far below 2^31 (host-checked shapes).
__device__ __forceinline__ uint32_t hash_size(uint32_t entries, uint32_t spread = 2) {
    const uint32_t n = spread * entries;
    return n <= 1 ? 1u : 1u << (32 - __clz((int)(n - 1)));
}
__device__ __forceinline__ uint32_t hash_of(int32_t key, uint32_t mask) {
    return ((uint32_t)key * 2654435761u) & mask;
}

// Keeps the lower of a hash value and `v`: 32-bit values with atomicMin,
// 16-bit ones with atomic_min16 (common.cuh).
__device__ __forceinline__ void keep_lower(int32_t* a, uint32_t v) { atomicMin(a, (int32_t)v); }
__device__ __forceinline__ void keep_lower(uint16_t* a, uint32_t v) { atomic_min16(a, (uint16_t)v); }

// The planning hash table (shared memory): token -> lowest entry index
// holding it, open addressing over mask + 1 cells. V: the values' type
// (int32_t; uint16_t where shared memory is short: entries < 65535), `none`
// an empty cell's value (above every index).
template <class V, V none>
struct TokenHashOf {
    int32_t* keys;
    V* vals;
    uint32_t mask;

    __device__ __forceinline__ void clear(uint32_t tid, uint32_t nthreads) const {
        for (uint32_t i = tid; i <= mask; i += nthreads) {
            keys[i] = kEmptyKey;
            vals[i] = none;
        }
    }
    // True when another entry inserted the token first (a duplicate).
    __device__ __forceinline__ bool insert(int32_t token, uint32_t index) const {
        uint32_t h = hash_of(token, mask);
        while (true) {
            const int32_t old = atomicCAS(&keys[h], kEmptyKey, token);
            if (old == kEmptyKey || old == token) {
                keep_lower(&vals[h], index);
                return old == token;
            }
            h = (h + 1) & mask;
        }
    }
    // The lowest entry index holding `token`, or -1.
    __device__ __forceinline__ int32_t find(int32_t token) const {
        uint32_t h = hash_of(token, mask);
        while (true) {
            const int32_t k = keys[h];
            if (k == token) return vals[h];
            if (k == kEmptyKey) return -1;
            h = (h + 1) & mask;
        }
    }
};
using TokenHash = TokenHashOf<int32_t, kNone>;

// Where a swap-in reports a bad entry: the engine's error word and, when the
// call is counted, its layer's `bad` counter (one per report, as the word's
// count).
struct Reporter {
    kvt_error_word* word;
    unsigned long long* bad;

    __device__ __forceinline__ explicit Reporter(const kvt_swap_in_params& p)
        : word(reinterpret_cast<kvt_error_word*>(p.error)),
          bad(p.counters != 0 ? reinterpret_cast<unsigned long long*>(&reinterpret_cast<kvt_swap_counters*>(p.counters)->bad)
                              : nullptr) {}
};
// Out of line: reports are rare (bad input only); inlined at each of the
// planners' report sites they cost registers and code on every call (at
// sm_90 the few-miss planner is 5,408 instructions with it out of line,
// 6,816 inlined).
__device__ __noinline__ void report_to(kvt_error_word* word, unsigned long long* bad, uint32_t kind,
                                       uint32_t position, int64_t value) {
    kvt::report(word, kind, position, value);
    if (bad != nullptr) atomicAdd(bad, 1ull);
}
__device__ __forceinline__ void report(const Reporter& r, uint32_t kind, uint32_t position, int64_t value) {
    report_to(r.word, r.bad, kind, position, value);
}

// The call's own counts (block 0, thread 0 of a planner): one call, `real` rows.
__device__ __forceinline__ void count_call(const kvt_swap_in_params& p, uint32_t real) {
    if (p.counters == 0 || blockIdx.x != 0 || threadIdx.x != 0) return;
    kvt_swap_counters* c = reinterpret_cast<kvt_swap_counters*>(p.counters);
    atomicAdd(reinterpret_cast<unsigned long long*>(&c->calls), 1ull);
    atomicAdd(reinterpret_cast<unsigned long long*>(&c->rows), (unsigned long long)real);
}
// A long row's counts (one thread of its planning block): the LRU slots it hit
// and the misses it loads, with their bytes unless no bytes move.
__device__ __forceinline__ void count_row(const kvt_swap_in_params& p, uint32_t hits, uint32_t loads) {
    if (p.counters == 0) return;
    kvt_swap_counters* c = reinterpret_cast<kvt_swap_counters*>(p.counters);
    atomicAdd(reinterpret_cast<unsigned long long*>(&c->hits), (unsigned long long)hits);
    atomicAdd(reinterpret_cast<unsigned long long*>(&c->misses), (unsigned long long)loads);
    if (!(p.flags & KVT_SWAP_SKIP_IO))
        atomicAdd(reinterpret_cast<unsigned long long*>(&c->bytes), (unsigned long long)loads * p.miss_bytes);
}

// real_rows_of num_real_reqs (none given: every row); a negative value is
// reported by thread 0 of block 0 when `report_it` is set.
__device__ __forceinline__ uint32_t real_rows(const kvt_swap_in_params& p, const Reporter& err, bool report_it) {
    if (p.num_real_reqs == 0) return p.batch;
    const int32_t given = ld(reinterpret_cast<const int32_t*>(p.num_real_reqs));
    const uint32_t real = real_rows_of(given, p.batch);
    if (report_it && given < 0 && blockIdx.x == 0 && threadIdx.x == 0)
        report(err, KVT_ERR_SWAP_NUM_REAL, 0, given);
    return real;
}

// An LRU slot's token and device row, loaded together.
struct SlotRow {
    int32_t token;
    int32_t loc;
};

// What entry i of a row's query names: a token position, or -1 for padding.
// With a block query (KVT_SWAP_QUERY_BLOCKS) entry i is token i % block_tokens
// of the block in column i / block_tokens; a block id of -1 is padding, a
// lower one is refused (`bad`, reported once per column by the caller).
struct QueryEntry {
    int64_t token;
    bool bad;
};
// Entry i of a token query.
__device__ __forceinline__ QueryEntry token_entry(const int32_t* q, uint32_t i) {
    const int32_t t = ld(q + i);
    return {t, t < -1};
}
__device__ __forceinline__ QueryEntry query_entry(const kvt_swap_in_params& p, const int32_t* q, uint32_t i) {
    if (!(p.flags & KVT_SWAP_QUERY_BLOCKS)) return token_entry(q, i);
    const uint32_t column = i / p.block_tokens;
    const int32_t block = ld(q + column);
    if (block < 0) return {-1, block < -1};
    return {(int64_t)block * p.block_tokens + (i - column * p.block_tokens), false};
}

// What entry i of a row's query resolves to once checked: its token, -1 for
// padding, -2 for a refused entry (reported: a token query's bad token at
// its column, a block query's bad block once, at its column). A block may
// run past the sequence (its last block, or one the selector padded with):
// those entries are padding; a token query naming a position past the
// sequence is refused. `report_it` unset: the same result, reported by
// another block (the split planner classifies every entry in each block).
__device__ __forceinline__ int64_t classify(const kvt_swap_in_params& p, const Reporter& err, const int32_t* topk,
                                            uint32_t row_pos, int64_t seq, uint32_t i, const QueryEntry& q,
                                            bool report_it = true) {
    const bool blocks = p.flags & KVT_SWAP_QUERY_BLOCKS;
    if (q.bad) {
        if (!report_it) {
        } else if (!blocks) {
            report(err, KVT_ERR_SWAP_TOKEN, row_pos | i, q.token);
        } else if (i % p.block_tokens == 0) {
            report(err, KVT_ERR_SWAP_TOKEN, row_pos | (i / p.block_tokens), ld(topk + i / p.block_tokens));
        }
        return -2;
    }
    if (q.token >= seq) {
        if (blocks) return -1;
        if (report_it) report(err, KVT_ERR_SWAP_TOKEN, row_pos | i, q.token);
        return -2;
    }
    return q.token;
}

// What a planning block writes for batch row b besides its request's state
// (the outputs and the row's plan), and what padding or refusing the row
// writes; every thread of the block calls pad and refuse.
struct PlanRow {
    uint32_t b, entries;
    uint32_t pos;  // error-word position of the row's column 0
    Reporter err;
    int32_t* out;
    int32_t* plan_count;
    int64_t* plan_src;
    int32_t* plan_dst;

    __device__ __forceinline__ PlanRow(const kvt_swap_in_params& p, uint32_t row)
        : b(row),
          entries(p.entries),
          pos(row << 16),
          err(p),
          out(reinterpret_cast<int32_t*>(p.top_k_device_locs) + (uint64_t)row * p.out_stride),
          plan_count(reinterpret_cast<int32_t*>(p.plan_count)),
          plan_src(reinterpret_cast<int64_t*>(p.plan_src) + (uint64_t)row * p.plan_stride),
          plan_dst(reinterpret_cast<int32_t*>(p.plan_dst) + (uint64_t)row * p.plan_stride) {}
    // A padding row: every output -1; the state and the plan row stay as
    // they were (SGLang leaves a padding row's miss_count alone too; the copy
    // kernel reads only rows below num_real_reqs).
    __device__ __forceinline__ void pad() const {
        for (uint32_t i = threadIdx.x; i < entries; i += blockDim.x) st(out + i, (int32_t)-1);
    }
    // A refused row (a bad request or length, a broken LRU row): every output
    // -1, no misses, no state change.
    __device__ __forceinline__ void refuse() const {
        pad();
        if (threadIdx.x == 0) st(plan_count + b, (int32_t)0);
    }
    // refuse(), with the reason reported once, at the row's column 0.
    __device__ __forceinline__ void refuse(uint32_t kind, int64_t value) const {
        if (threadIdx.x == 0) report(err, kind, pos, value);
        refuse();
    }
};

// Request rid's state rows, and batch row b's query.
struct RequestRows {
    const int32_t* topk;
    int32_t* btok;
    const int32_t* bloc;
    int16_t* lru;
    const int64_t* hloc;

    __device__ __forceinline__ RequestRows(const kvt_swap_in_params& p, uint32_t b, int64_t rid)
        : topk(reinterpret_cast<const int32_t*>(p.top_k_tokens) + (uint64_t)b * p.top_k_stride),
          btok(reinterpret_cast<int32_t*>(p.device_buffer_tokens) + (uint64_t)rid * p.tokens_stride),
          bloc(reinterpret_cast<const int32_t*>(p.device_buffer_locs) + (uint64_t)rid * p.locs_stride),
          lru(reinterpret_cast<int16_t*>(p.lru_slots) + (uint64_t)rid * p.lru_stride),
          hloc(reinterpret_cast<const int64_t*>(p.host_cache_locs) + (uint64_t)rid * p.host_stride) {}
};

// A short sequence's row (seq_len <= hot): token t lives in slot t; no
// copies, no state change, an empty plan row. A token query resolves only
// its first min(seq_len, top_k) entries (the others are -1 whatever they
// hold); a block query resolves every entry. Every thread of the block calls
// it. A token query's loop is its own: in a shared one the compiler computes
// a block query's division for every entry.
__device__ __forceinline__ void short_row(const kvt_swap_in_params& p, const PlanRow& row, const RequestRows& rq,
                                          int64_t seq) {
    const uint32_t E = p.entries;
    const Reporter& err = row.err;
    const uint32_t row_pos = row.pos;
    const bool blocks = p.flags & KVT_SWAP_QUERY_BLOCKS;
    const uint32_t count = blocks || seq >= (int64_t)E ? E : (uint32_t)seq;
    for (uint32_t i = threadIdx.x; i < E; i += blockDim.x) {
        int32_t o = -1;
        if (i < count) {
            const QueryEntry q = blocks ? query_entry(p, rq.topk, i) : token_entry(rq.topk, i);
            const int64_t t = classify(p, err, rq.topk, row_pos, seq, i, q);
            if (t >= 0) {
                const int32_t loc = ld(rq.bloc + t);
                if (in_rows(loc, p.device_rows))
                    o = loc;
                else
                    report(err, KVT_ERR_SWAP_DEVICE_LOC, row_pos | i, loc);
            }
        }
        st(row.out + i, o);
    }
    if (threadIdx.x == 0) st(row.plan_count + row.b, (int32_t)0);
}

// Four slots' tokens or rows, as one 16-byte vector.
struct SlotRow4 {
    uint4 tokens, locs;
};
__device__ __forceinline__ bool aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }
__device__ __forceinline__ const uint4* as_vec(const int32_t* p) { return reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ uint4* as_vec(int32_t* p) { return reinterpret_cast<uint4*>(p); }

// The chunks of 32 items (one per lane) warp `warp` of a block of `Warps`
// warps owns of `count`: a contiguous run, so that ranks in item order are
// this warp's offset plus its running count plus the lane's rank in the
// chunk's ballot. Every lane of a warp gets the same run, so loops over it
// may vote.
template <uint32_t Warps>
struct WarpChunks {
    uint32_t first, end;
    __device__ __forceinline__ WarpChunks(uint32_t count, uint32_t warp) {
        const uint32_t chunks = (count + KVT_WARP - 1) / KVT_WARP;
        const uint32_t per = (chunks + Warps - 1) / Warps;
        first = min(warp * per, chunks);
        end = min(first + per, chunks);
    }
};

// Exclusive prefix (this warp's offset) and total over a block of `warps`
// (at most 32) warps of one per-warp count in shared memory (`stride` words
// between warps).
struct WarpOffset {
    uint32_t before, total;
};
__device__ __forceinline__ WarpOffset warp_offset(const uint32_t* totals, uint32_t stride, uint32_t warp,
                                                  uint32_t lane, uint32_t warps = KVT_WARP) {
    const uint32_t mine = lane < warps ? totals[lane * stride] : 0;
    const uint32_t incl = warp_inclusive_sum(mine, lane);
    return {warp_read(incl - mine, warp), warp_read(incl, KVT_WARP - 1)};
}

// Copies host row `src` to device row `dst` of every KV plane with the calling
// warp, after checking both rows (the plan already did; a replayed plan is the
// caller's, so the copy stays safe on its own). U: vectors per lane a pass
// keeps in flight; `part` of `parts`: this warp's share of the passes
// (warp_copy_entry; part 0 reports a bad row). `Lines`: the copy method
// KVT_COPY_LINE_ALIGNED (warp_copy_item's; whole passes only).
template <uint32_t U = KVT_UNROLL, bool Lines = false>
__device__ __forceinline__ void copy_row(const kvt_swap_in_params& p, const Reporter& err, int64_t src, int64_t dst,
                                         uint32_t position, uint32_t lane, uint32_t part = 0, uint32_t parts = 1) {
    if (!in_rows(src, p.host_rows) || !in_rows(dst, p.device_rows)) {
        if (lane == 0 && part == 0)
            report(err, in_rows(src, p.host_rows) ? KVT_ERR_SWAP_DEVICE_LOC : KVT_ERR_SWAP_HOST_LOC, position,
                   in_rows(src, p.host_rows) ? dst : src);
        return;
    }
    warp_copy_item<PoolToDevice, U, Lines>(p.items, p.host_cache[0], p.device_buffer[0], (uint64_t)src,
                                           (uint64_t)dst, lane, part, parts);
    if (p.host_cache[1] != 0)
        warp_copy_item<PoolToDevice, U, Lines>(p.items, p.host_cache[1], p.device_buffer[1], (uint64_t)src,
                                               (uint64_t)dst, lane, part, parts);
}

}  // namespace swap
}  // namespace kvt

