// kernels/spec_swap_in.cu — the speculative swap-in (MTP/EAGLE verify) on
// SGLang's HiSparseSpecState: one block per batch row resolves the row's
// steps × top-k occurrences, deduplicates its misses across steps in the
// request's miss table, copies each unique miss once, then runs the request's
// CLOCK (victims, hash, counters). The contract is in src/swap_in/spec/mod.rs;
// the CPU executor there is one of the orders this kernel may take.
#include "common.cuh"

namespace kvt {
namespace spec {

constexpr int64_t kDeleted = -2;                  // a hash bank cell whose entry left
constexpr int32_t kPosMask = (1 << 13) - 1;       // a miss table position (occurrences <= 8192)
constexpr int32_t kClaim = 1 << 29;               // the last step asked for this miss
constexpr int32_t kAdmit = 1 << 30;               // ... and it is admitted into the hot buffer
constexpr uint32_t kDegraded = 1u << 31;          // the hash lost an entry: lookups also scan
constexpr uint32_t kEpochMask = kDegraded - 1;    // the scratch epoch below the flag
constexpr uint32_t kKnuth = 2654435761u;
constexpr int32_t kSamples = 6;                   // CLOCK victims sampled per partition
constexpr uint32_t kCuckooKicks = 64;
constexpr uint32_t kUnplaced = 0xffffffffu;       // a miss past the scratch that found no slot

// The block's shared scalars (dynamic shared memory, KVT_SPEC_SMEM_BYTES).
struct Shared {
    int64_t rid;            // the request; -1: the row is refused
    uint32_t misses;        // unique misses claimed so far (the miss ordinal)
    uint32_t union_hits;    // hot slots this call marked
    uint32_t admitted;      // last-step misses claimed for admission
    uint32_t copies;        // plan entries written
    uint32_t degraded;      // the hash gave up an insertion
    uint32_t dup;           // the row check: an earlier row names the request
    uint32_t bad_step;      // the row check: the first step whose length is bad (steps: none)
};
static_assert(sizeof(Shared) <= KVT_SPEC_SMEM_BYTES, "KVT_SPEC_SMEM_BYTES holds the block's scalars");

// Atomics on global state. The host emulation checks each address against
// the memory the call may write, as it does plain accesses.
__device__ __forceinline__ unsigned long long cas64(int64_t* p, int64_t expected, int64_t desired) {
#ifdef KVT_HOST_EMULATION
    if (!kvt_emu_atomic(p, 8)) return ~(unsigned long long)expected;
#endif
    return atomicCAS(reinterpret_cast<unsigned long long*>(p), (unsigned long long)expected,
                     (unsigned long long)desired);
}
__device__ __forceinline__ int64_t exch64(int64_t* p, int64_t v) {
#ifdef KVT_HOST_EMULATION
    if (!kvt_emu_atomic(p, 8)) return 0;
#endif
    return (int64_t)atomicExch(reinterpret_cast<unsigned long long*>(p), (unsigned long long)v);
}
__device__ __forceinline__ int32_t exch32(int32_t* p, int32_t v) {
#ifdef KVT_HOST_EMULATION
    if (!kvt_emu_atomic(p, 4)) return v;
#endif
    return atomicExch(p, v);
}
__device__ __forceinline__ int32_t cas32(int32_t* p, int32_t expected, int32_t desired) {
#ifdef KVT_HOST_EMULATION
    if (!kvt_emu_atomic(p, 4)) return ~expected;
#endif
    return atomicCAS(p, expected, desired);
}
__device__ __forceinline__ int32_t or32(int32_t* p, int32_t v) {
#ifdef KVT_HOST_EMULATION
    if (!kvt_emu_atomic(p, 4)) return v;
#endif
    return atomicOr(p, v);
}

// SGLang's hashes: the miss table's home position, and the two hash banks'.
__device__ __forceinline__ uint32_t union_slot(int32_t token, uint32_t size) {
    const uint32_t h = (uint32_t)token * kKnuth;
    return (size & (size - 1)) == 0 ? h & (size - 1) : h % size;
}
__device__ __forceinline__ uint32_t bank0_slot(int32_t token, uint64_t size) {
    return ((uint32_t)token * kKnuth) & (uint32_t)(size - 1);
}
__device__ __forceinline__ uint32_t bank1_slot(int32_t token, uint64_t size) {
    uint32_t h = (uint32_t)token;
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x846CA68Bu;
    h ^= h >> 16;
    return h & (uint32_t)(size - 1);
}
__device__ __forceinline__ int64_t entry(int32_t token, int32_t slot) {
    return (int64_t)(((uint64_t)(uint32_t)slot << 32) | (uint32_t)token);
}
__device__ __forceinline__ int32_t entry_token(int64_t e) { return (int32_t)(uint32_t)e; }
__device__ __forceinline__ int32_t entry_slot(int64_t e) { return (int32_t)((uint64_t)e >> 32); }

// One request's view of the state.
struct Request {
    int32_t* tokens;    // [hot + page]
    int32_t* locs;      // [hot + page]
    int32_t* refs;      // [hot] reference epochs
    int64_t* bank0;     // [hash_size]
    int64_t* bank1;     // [hash_size]
    int32_t* scratch;   // [scratch_capacity] scratch device rows
    int32_t* meta;      // [5 * occurrences] the miss table
    const int64_t* hloc;
    uint32_t hot, page, occ;
    uint64_t hash_size;
    bool degraded;
    uint32_t epoch;     // the scratch epoch of this call

    __device__ unsigned long long tagged(uint32_t v) const { return ((unsigned long long)epoch << 32) | v; }
    // The table (positions 0..occ) and the values (occ..2 occ) are int64
    // pairs of the int32 row; then one int32 per miss (its position, flags).
    __device__ int64_t* table(uint32_t pos) const { return reinterpret_cast<int64_t*>(meta) + pos; }
    __device__ int64_t* value(uint32_t pos) const { return reinterpret_cast<int64_t*>(meta) + occ + pos; }
    __device__ int32_t* compact(uint32_t m) const { return meta + 4 * occ + m; }

    // The hot slot holding `token`, or -1 (SGLang's lookup order).
    __device__ int32_t lookup(int32_t token) const {
        if (token < 0) return -1;
        if ((uint32_t)token < hot && ld(tokens + token) == token) return token;
        for (int bank = 0; bank < 2; ++bank) {
            const int64_t e = bank == 0 ? ld(bank0 + bank0_slot(token, hash_size))
                                        : ld(bank1 + bank1_slot(token, hash_size));
            if (e >= 0 && entry_token(e) == token) {
                const int32_t s = entry_slot(e);
                if ((uint32_t)s < hot && ld(tokens + s) == token) return s;
            }
        }
        if (degraded)
            for (uint32_t s = 0; s < hot; ++s)
                if (ld(tokens + s) == token) return (int32_t)s;
        return -1;
    }

    // The ordinal of this call's miss of `token`, or -1.
    __device__ int32_t find_miss(int32_t token) const {
        uint32_t pos = union_slot(token, occ);
        for (uint32_t i = 0; i < occ; ++i) {
            const uint64_t e = (uint64_t)ld(table(pos));
            if ((uint32_t)(e >> 32) != epoch) return -1;
            if ((int32_t)(uint32_t)e == token) return (int32_t)(uint32_t)ld(value(pos));
            pos = pos + 1 == occ ? 0 : pos + 1;
        }
        return -1;
    }

    __device__ void erase(int32_t token, uint32_t slot) const {
        if (token < 0) return;
        const int64_t e = entry(token, (int32_t)slot);
        if ((int64_t)cas64(bank0 + bank0_slot(token, hash_size), e, kDeleted) == e) return;
        cas64(bank1 + bank1_slot(token, hash_size), e, kDeleted);
    }

    // Whether entry `e` names a slot that holds its token.
    __device__ bool live(int64_t e) const {
        const int32_t s = entry_slot(e);
        return e >= 0 && (uint32_t)s < hot && ld(tokens + s) == entry_token(e);
    }

    // Cuckoo insertion; false when it gave up (the hash degrades). Runs a
    // barrier after every erase and slot change of its round, so `live` tells
    // a stale entry (dropped when met) from one a slot still holds (carried
    // on, never lost).
    __device__ bool insert(int32_t token, uint32_t slot) const {
        int64_t current = entry(token, (int32_t)slot);
        for (int bank = 0; bank < 2; ++bank) {
            int64_t* c = bank == 0 ? bank0 + bank0_slot(token, hash_size) : bank1 + bank1_slot(token, hash_size);
            const int64_t old = ld_racy(c);
            // an empty cell, a deleted one, or a stale entry: take it; if
            // another thread changed it meanwhile, the kicks below carry on
            // whatever it put there
            if ((old < 0 || !live(old)) && (int64_t)cas64(c, old, current) == old) return true;
        }
        bool second = false;
        for (uint32_t kick = 0; kick < kCuckooKicks; ++kick) {
            const int32_t t = entry_token(current);
            int64_t* c = second ? bank1 + bank1_slot(t, hash_size) : bank0 + bank0_slot(t, hash_size);
            const int64_t displaced = exch64(c, current);
            if (displaced < 0 || !live(displaced)) return true;
            current = displaced;
            second = !second;
        }
        return false;
    }
};

// The packed CLOCK word: an epoch above a cursor of ceil(log2(hot)) bits.
struct Clock {
    uint32_t cursor_bits, epoch_mask, hot;
    __device__ explicit Clock(uint32_t h) : hot(h) {
        cursor_bits = 0;
        while ((1u << cursor_bits) < h) ++cursor_bits;
        const uint32_t epoch_bits = 32 - cursor_bits < 23 ? 32 - cursor_bits : 23;
        epoch_mask = (1u << epoch_bits) - 1;
    }
    __device__ int32_t next_epoch(int32_t packed) const {
        const int32_t e = (int32_t)((((uint32_t)packed >> cursor_bits) + 1) & epoch_mask);
        return e == 0 ? 1 : e;
    }
    __device__ uint32_t cursor(int32_t packed) const { return ((uint32_t)packed & ((1u << cursor_bits) - 1)) % hot; }
    __device__ int32_t pack(int32_t epoch, uint32_t cursor) const {
        return (int32_t)(((uint32_t)epoch << cursor_bits) | (cursor & ((1u << cursor_bits) - 1)));
    }
};

}  // namespace spec
}  // namespace kvt

// One block of KVT_SPEC_THREADS threads per batch row.
// Reads:   the row's occurrences and step lengths, req_pool_indices (this row
//          and the earlier ones, for the duplicate check), num_real_reqs, the
//          request's state (tokens, rows, epochs, hash banks, scratch rows,
//          counters), host_cache_locs of its miss tokens, their host rows.
// Writes:  the row's outputs and plan row; the request's state; device rows
//          of scratch and of victims (misses past the scratch); the error word.
// Assumes: blockDim.x == KVT_SPEC_THREADS, gridDim.x == batch, dynamic shared
//          memory of KVT_SPEC_SMEM_BYTES, and the host-checked shapes (spec/mod.rs
//          `check`: 2 <= steps <= 4, steps × top_k <= 8192, hot <= 32768, every
//          buffer covers its rows, the written ones pairwise disjoint).
// Order:   unique-miss ordinals and victims race through atomics as in SGLang's
//          kernel: the state after a call depends on thread timing, its
//          invariants do not.
extern "C" __global__ void __launch_bounds__(KVT_SPEC_THREADS, 1) kvt_spec_swap_in(const kvt_spec_swap_in_params p) {
    using namespace kvt;
    using namespace kvt::spec;
    const uint32_t b = blockIdx.x, tid = threadIdx.x, nthreads = blockDim.x;
    const uint32_t lane = tid % KVT_WARP, warp = tid / KVT_WARP, warps = nthreads / KVT_WARP;
    const uint32_t K = p.top_k, S = p.steps, T = S * K, H = p.hot;
    const bool seq_i64 = p.flags & KVT_SWAP_SEQ_LENS_I64, req_i64 = p.flags & KVT_SWAP_REQ_INDICES_I64;
    kvt_error_word* err = reinterpret_cast<kvt_error_word*>(p.error);
    Shared& sh = *reinterpret_cast<Shared*>(kvt_dynamic_smem);
    int32_t* out = reinterpret_cast<int32_t*>(p.top_k_device_locs) + (uint64_t)b * p.out_stride;
    const int32_t* topk = reinterpret_cast<const int32_t*>(p.top_k_tokens) + (uint64_t)b * p.top_k_stride;
    int32_t* plan_count = reinterpret_cast<int32_t*>(p.plan_count);
    int64_t* plan_src = reinterpret_cast<int64_t*>(p.plan_src) + (uint64_t)b * p.plan_stride;
    int32_t* plan_dst = reinterpret_cast<int32_t*>(p.plan_dst) + (uint64_t)b * p.plan_stride;
    const uint32_t row_pos = b << 16;

    // Padding rows: every output 0 (as SGLang writes them), a plan count of 0.
    const int32_t given = ld(reinterpret_cast<const int32_t*>(p.num_real_reqs));
    if (given < 0 && b == 0 && tid == 0) report(err, KVT_ERR_SWAP_NUM_REAL, 0, given);
    const uint32_t real = real_rows_of(given, p.batch);
    if (b >= real) {
        for (uint32_t i = tid; i < T; i += nthreads) st(out + i, (int32_t)0);
        if (tid == 0 && p.plan_count != 0) st(plan_count + b, (int32_t)0);
        return;
    }
    // The row's request, checked once: a bad request, one an earlier row
    // names, or a step length past the host table refuses the row (one
    // report, in that order of precedence). The block's threads scan the
    // earlier rows and the steps' lengths together: one memory latency, not
    // one per earlier row.
    const int64_t asked = load_index(p.req_pool_indices, b, req_i64);
    const bool in_range = asked >= 0 && asked < (int64_t)p.num_requests;
    if (tid == 0) {
        sh.misses = sh.union_hits = sh.admitted = sh.copies = sh.degraded = 0;
        sh.dup = 0;
        sh.bad_step = S;
    }
    __syncthreads();
    if (in_range) {
        for (uint32_t e = tid; e < b; e += nthreads)
            if (load_index(p.req_pool_indices, e, req_i64) == asked) atomicOr(&sh.dup, 1u);
        for (uint32_t s = tid; s < S; s += nthreads) {
            const int64_t n = load_index(p.seq_lens, (uint64_t)b * S + s, seq_i64);
            if (n < 0 || n > (int64_t)p.max_tokens) atomicMin(&sh.bad_step, s);
        }
    }
    __syncthreads();
    if (tid == 0) {
        int64_t ok = asked;
        if (!in_range) {
            report(err, KVT_ERR_SWAP_REQ, row_pos, asked);
            ok = -1;
        } else if (sh.dup != 0) {
            report(err, KVT_ERR_SWAP_DUP_REQ, row_pos, asked);
            ok = -1;
        } else if (sh.bad_step < S) {
            report(err, KVT_ERR_SWAP_SEQ_LEN, row_pos,
                   load_index(p.seq_lens, (uint64_t)b * S + sh.bad_step, seq_i64));
            ok = -1;
        }
        sh.rid = ok;
    }
    __syncthreads();
    const int64_t rid = sh.rid;
    if (rid < 0) {
        for (uint32_t i = tid; i < T; i += nthreads) st(out + i, (int32_t)-1);
        if (tid == 0 && p.plan_count != 0) st(plan_count + b, (int32_t)0);
        return;
    }
    int32_t* counters = reinterpret_cast<int32_t*>(p.scratch_state);
    const uint32_t R = p.num_requests;
    int32_t* ring = reinterpret_cast<int32_t*>(p.cache_policy) + rid;
    const uint32_t generation = (uint32_t)ld(counters + 3 * (uint64_t)R + rid);
    uint32_t scratch_epoch = (generation & kEpochMask) + 1;
    if (scratch_epoch > kEpochMask) scratch_epoch = 1;
    const Clock clock(H);
    const int32_t packed_ring = ld(ring);
    const int32_t epoch = clock.next_epoch(packed_ring);
    const uint32_t cursor = clock.cursor(packed_ring);
    int64_t* banks = reinterpret_cast<int64_t*>(p.cache_index) + rid * p.index_stride;
    const Request q{
        reinterpret_cast<int32_t*>(p.device_buffer_tokens) + rid * p.tokens_stride,
        reinterpret_cast<int32_t*>(p.device_buffer_locs) + rid * p.locs_stride,
        reinterpret_cast<int32_t*>(p.cache_policy) + (rid + 1) * p.policy_stride,
        banks,
        banks + p.bank_stride,
        reinterpret_cast<int32_t*>(p.scratch_locs) + rid * p.scratch_stride,
        reinterpret_cast<int32_t*>(p.scratch_state) + (rid + 1) * p.state_stride,
        reinterpret_cast<const int64_t*>(p.host_cache_locs) + rid * p.host_stride,
        H,
        p.page,
        T,
        p.hash_size,
        (generation & kDegraded) != 0,
        scratch_epoch,
    };
    const uint32_t cap = p.scratch_capacity < T ? (uint32_t)p.scratch_capacity : T;  // ordinals stay below T
    auto seq_of = [&](uint32_t step) { return load_index(p.seq_lens, (uint64_t)b * S + step, seq_i64); };

    // 0. Cells that already carry this call's epoch (a wrapped epoch, or a
    //    state written by someone else) are emptied: the values of this
    //    call's cells are trusted as miss ordinals below.
    for (uint32_t pos = tid; pos < T; pos += nthreads)
        if ((uint32_t)((uint64_t)ld(q.table(pos)) >> 32) == scratch_epoch) st(q.table(pos), (int64_t)0);
    __syncthreads();

    // 1. Every occurrence: padding, refused, a draft token on the extra page,
    //    a hit (marks its slot), or a miss, whose token is claimed once in the
    //    miss table; a miss's output holds -2 - its table position for now.
    for (uint32_t i = tid; i < T; i += nthreads) {
        const int32_t token = ld(topk + i);
        const int64_t seq = seq_of(i / K);
        int32_t o = -1;
        if (token < -1 || (token >= 0 && token >= seq)) {
            report(err, KVT_ERR_SWAP_TOKEN, row_pos | i, token);
        } else if (token >= 0) {
            int32_t slot = -1;
            if (token >= seq - (int64_t)q.page)
                for (uint32_t s = H; s < H + q.page; ++s)
                    if (ld(q.tokens + s) == token) {
                        if (ld(q.locs + s) >= 0) slot = (int32_t)s;  // else not a draft: looked up below
                        break;
                    }
            const bool draft = slot >= 0;
            if (!draft) slot = q.lookup(token);
            if (slot >= 0) {
                const int32_t loc = ld(q.locs + slot);
                if (in_rows(loc, p.device_rows))
                    o = loc;
                else
                    report(err, KVT_ERR_SWAP_DEVICE_LOC, row_pos | i, loc);
                if (!draft && exch32(q.refs + slot, epoch) != epoch) atomicAdd(&sh.union_hits, 1u);
            } else {
                const int64_t src = ld(q.hloc + token);
                if (src >= 0 && !in_rows(src, p.host_rows)) {
                    report(err, KVT_ERR_SWAP_HOST_LOC, row_pos | i, src);
                } else if (src >= 0) {
                    // Cells only fill during this pass, so a cell seen taken
                    // stays taken; one seen free is claimed by a CAS, whose
                    // result (not a second load, which may be stale) tells
                    // who took it.
                    uint32_t pos = union_slot(token, T);
                    int64_t cell = ld_racy(q.table(pos));
                    for (uint32_t attempt = 0; attempt < 2 * T; ++attempt) {
                        if ((uint32_t)((uint64_t)cell >> 32) != scratch_epoch) {
                            const int64_t seen =
                                (int64_t)cas64(q.table(pos), cell, (int64_t)q.tagged((uint32_t)token));
                            if (seen != cell) {
                                cell = seen;  // another thread took the cell: look at what it holds
                                continue;
                            }
                            const uint32_t m = atomicAdd(&sh.misses, 1u);
                            st(q.compact(m), (int32_t)pos);
                            st(q.value(pos), (int64_t)q.tagged(m));
                            o = -2 - (int32_t)pos;
                            break;
                        }
                        if ((int32_t)(uint32_t)cell == token) {
                            o = -2 - (int32_t)pos;
                            break;
                        }
                        pos = pos + 1 == T ? 0 : pos + 1;
                        cell = ld_racy(q.table(pos));
                    }
                }
            }
        }
        st(out + i, o);
    }
    __syncthreads();
    const uint32_t misses = sh.misses;

    // 2. Misses' outputs: their scratch row, or (past the scratch) -2 - the
    //    miss ordinal until the CLOCK places them; then each unique miss in
    //    the scratch is copied once, a warp per miss.
    for (uint32_t i = tid; i < T; i += nthreads) {
        const int32_t o = ld(out + i);
        if (o > -2) continue;
        const uint32_t m = (uint32_t)ld(q.value((uint32_t)(-2 - o)));
        if (m >= cap) {
            st(out + i, -2 - (int32_t)m);
            continue;
        }
        const int32_t loc = ld(q.scratch + m);
        if (!in_rows(loc, p.device_rows)) report(err, KVT_ERR_SWAP_DEVICE_LOC, row_pos | i, loc);
        st(out + i, in_rows(loc, p.device_rows) ? loc : (int32_t)-1);
    }
    const uint32_t in_scratch = misses < cap ? misses : cap;
    for (uint32_t m = warp; m < in_scratch; m += warps) {
        const int32_t loc = ld(q.scratch + m);
        if (!in_rows(loc, p.device_rows)) continue;
        const int32_t token = (int32_t)(uint32_t)ld(q.table((uint32_t)ld(q.compact(m)) & kPosMask));
        const int64_t src = ld(q.hloc + token);
        warp_copy_item<PoolToDevice>(p.items, p.host_cache, p.device_buffer, (uint64_t)src, (uint64_t)loc, lane);
        if (lane == 0 && p.plan_count != 0) {
            const uint32_t c = atomicAdd(&sh.copies, 1u);
            st(plan_src + c, src);
            st(plan_dst + c, loc);
        }
    }
    __syncthreads();

    // 3. The CLOCK. When hits and misses fit the hot buffer every miss swaps
    //    its scratch row with a victim sampled from its partition of the ring;
    //    otherwise the last step's misses are admitted (up to a budget) and
    //    misses past the scratch go straight into a victim's row.
    const uint32_t union_hits = sh.union_hits;
    const bool overflow = misses > cap;
    const bool union_clock = misses + union_hits <= H;
    const uint32_t direct_total = overflow ? misses - cap : 0;
    const uint32_t budget =
        union_clock ? 0 : (overflow ? (H > union_hits + direct_total ? H - union_hits - direct_total : 0) : H);
    if (!union_clock) {
        if (!overflow)
            for (uint32_t s = tid; s < H; s += nthreads) st(q.refs + s, (int32_t)0);
        __syncthreads();
        const int64_t seq = seq_of(S - 1);
        for (uint32_t i = (S - 1) * K + tid; i < T; i += nthreads) {
            const int32_t token = ld(topk + i);
            if (token < 0 || token >= seq) continue;
            const int32_t slot = q.lookup(token);
            if (slot >= 0) {
                st(q.refs + slot, epoch);
                continue;
            }
            const int32_t m = q.find_miss(token);
            if (m < 0 || (uint32_t)m >= cap) continue;
            if ((or32(q.compact(m), kClaim) & kClaim) == 0 && atomicAdd(&sh.admitted, 1u) < budget)
                or32(q.compact(m), kAdmit);
        }
        __syncthreads();
    }
    for (uint32_t start = 0; start < misses; start += nthreads) {
        const uint32_t m = start + tid;
        bool direct = false, rotate = false;
        uint32_t pos = 0;
        int32_t token = -1, victim = -1;
        if (m < misses) {
            const int32_t c = ld(q.compact(m));
            pos = (uint32_t)c & kPosMask;
            token = (int32_t)(uint32_t)ld(q.table(pos));
            direct = overflow && m >= cap;
            rotate = m < cap && (union_clock || (c & kAdmit) != 0);
        }
        if ((direct || rotate) && union_clock) {
            // the oldest of up to six samples of this miss's partition
            const uint32_t part = (H - 1 - m) / misses + 1;
            const uint32_t samples = part < (uint32_t)kSamples ? part : (uint32_t)kSamples;
            uint32_t oldest = 0;
            for (uint32_t s = 0; s < samples; ++s) {
                const uint32_t cand = (cursor + m + s * part / samples * misses) % H;
                const int32_t seen = ld(q.refs + cand);
                if (seen == epoch) continue;
                const uint32_t age = ((uint32_t)epoch - (uint32_t)seen) & clock.epoch_mask;
                if (victim < 0 || age > oldest) {
                    victim = (int32_t)cand;
                    oldest = age;
                }
            }
            if (victim >= 0) st(q.refs + victim, epoch);
        } else if (direct || rotate) {
            const uint32_t count = direct ? misses - cap : misses, ordinal = direct ? m - cap : m;
            for (uint32_t linear = ordinal; linear < H; linear += count) {
                const uint32_t cand = (linear * kKnuth + (uint32_t)epoch) % H;
                const int32_t seen = ld(q.refs + cand);
                if (seen == epoch) continue;
                // always a CAS (SGLang stores plainly in a single round): a
                // direct and a rotating miss may walk onto one slot
                if (cas32(q.refs + cand, seen, epoch) == seen) {
                    victim = (int32_t)cand;
                    break;
                }
            }
        }
        // Partitions are disjoint: mark their choices before the rare probe
        // of the whole ring.
        __syncthreads();
        if ((direct || rotate) && victim < 0) {
            const uint32_t begin = (cursor + m * kKnuth) % H;
            for (uint32_t a = 0; a < H && victim < 0; ++a) {
                const uint32_t cand = (begin + a * kKnuth) % H;
                const int32_t seen = ld_racy(q.refs + cand);
                if (seen != epoch && cas32(q.refs + cand, seen, epoch) == seen) victim = (int32_t)cand;
            }
        }
        bool placed = false;
        if (direct || rotate) {
            const int32_t old_loc = victim >= 0 ? ld(q.locs + victim) : -1;
            const int32_t new_loc = direct ? old_loc : ld(q.scratch + m);
            if (victim >= 0 && !in_rows(old_loc, p.device_rows))
                report(err, KVT_ERR_SWAP_SLOT_LOC, row_pos | (uint32_t)victim, old_loc);
            if (victim >= 0 && in_rows(old_loc, p.device_rows) && in_rows(new_loc, p.device_rows)) {
                const int32_t old_token = ld(q.tokens + victim);
                st(q.tokens + victim, token);
                st_racy(q.refs + victim, epoch);
                if (rotate) {
                    st(q.locs + victim, new_loc);
                    st(q.scratch + m, old_loc);
                } else {
                    st(q.value(pos), (int64_t)q.tagged((uint32_t)old_loc));
                }
                q.erase(old_token, (uint32_t)victim);
                placed = true;
            } else if (direct) {
                st(q.value(pos), (int64_t)q.tagged(kUnplaced));
            }
        }
        // Every erase and slot change of the round before any insertion, so
        // that an insertion's kicks can tell stale entries from live ones.
        __syncthreads();
        if (placed && !q.insert(token, (uint32_t)victim)) sh.degraded = 1;
        __syncthreads();
        // This round's misses placed straight into a victim's row, a warp each.
        const uint32_t round = misses - start < nthreads ? misses - start : nthreads;
        for (uint32_t r = warp; r < round; r += warps) {
            const uint32_t mm = start + r;
            if (!overflow || mm < cap) continue;
            const uint32_t pp = (uint32_t)ld(q.compact(mm)) & kPosMask;
            const uint32_t dst = (uint32_t)ld(q.value(pp));
            if (dst == kUnplaced) continue;
            const int32_t t = (int32_t)(uint32_t)ld(q.table(pp));
            const int64_t src = ld(q.hloc + t);
            warp_copy_item<PoolToDevice>(p.items, p.host_cache, p.device_buffer, (uint64_t)src, (uint64_t)dst,
                                         lane);
            if (lane == 0 && p.plan_count != 0) {
                const uint32_t c = atomicAdd(&sh.copies, 1u);
                st(plan_src + c, src);
                st(plan_dst + c, (int32_t)dst);
            }
        }
        __syncthreads();
    }

    // 4. Outputs of misses past the scratch, now that their rows are known.
    if (overflow)
        for (uint32_t i = tid; i < T; i += nthreads) {
            const int32_t o = ld(out + i);
            if (o > -2) continue;
            const uint32_t m = (uint32_t)(-2 - o);
            const uint32_t v = (uint32_t)ld(q.value((uint32_t)ld(q.compact(m)) & kPosMask));
            if (v == kUnplaced) report(err, KVT_ERR_SWAP_DEVICE_LOC, row_pos | i, ld(topk + i));
            st(out + i, v == kUnplaced ? (int32_t)-1 : (int32_t)v);
        }
    __syncthreads();
    if (tid == 0) {
        st(counters + rid, (int32_t)misses);
        st(counters + R + rid, (int32_t)0);
        st(counters + 2 * (uint64_t)R + rid, (int32_t)0);
        const bool degraded = q.degraded || sh.degraded;
        st(counters + 3 * (uint64_t)R + rid, (int32_t)(scratch_epoch | (degraded ? kDegraded : 0u)));
        const uint32_t moved = misses < H ? misses : H;
        st(ring, clock.pack(epoch, misses > 0 ? (cursor + moved) % H : cursor));
        if (p.plan_count != 0) st(plan_count + b, (int32_t)sh.copies);
    }
}
