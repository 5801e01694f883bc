// kernels/swap_in_few_miss.cu — the few-miss swap-in planner: the contract
// of kvt_swap_in_plan (abi.h; semantics in src/swap_in/mod.rs) planned with
// warp votes by one block of KVT_SWAP_FEW_MISS_THREADS per row, and a row's
// misses copied by its own block when they fit one pass of its warps.
//
// Why a second planner: measured on an H100 (bench/results/h100-2026-11-25),
// kvt_swap_in_plan spends ~35 us planning one row of K 2048 over HOT 4096,
// twice SGLang's whole kernel, in the decode step servers live in (a handful
// of misses per request). ncu: one block of 16 warps issuing ~80k
// instructions, one every 3.8 cycles per scheduler; 47 barriers. This one has
// 32 warps of at most 64 registers, four barriers after the row's checks,
// ranks with ballots and warp shuffles instead of block scans, loads the
// slots' tokens and rows in slot order (coalesced) instead of through the LRU
// permutation, and copies a few misses in the planning block, so the 2-miss
// case pays no second kernel before its first host read.
#include "swap_in.cuh"

namespace kvt {
namespace swap {
namespace few {

// Two builds of one planner (the kernels below): blocks of
// KVT_SWAP_FEW_MISS_THREADS with the hash table at most a quarter full (every
// slot of the hot buffer is looked up, most of them in vain, and a warp waits
// for its longest probe), and blocks of KVT_SWAP_FEW_MISS_512_THREADS with it
// at most half full, whose state lets two blocks share an SM (see
// kvt_swap_in_few_miss_512_plan).
//
// kWarps: warps a block; kSpread: hash cells per entry, at least; kChunks:
// chunks of 32 entries a warp owns at most (a lane keeps its entries' miss
// state in registers across the phases).
template <uint32_t Threads, uint32_t Spread, uint32_t MaxEntries>
struct Build {
    static constexpr uint32_t kWarps = Threads / KVT_WARP;
    static_assert(kWarps <= KVT_WARP, "a warp scans one total per warp of the block");
    static constexpr uint32_t kSpread = Spread;
    static constexpr uint32_t kChunks = (MaxEntries / KVT_WARP + kWarps - 1) / kWarps;
};
using Wide = Build<KVT_SWAP_FEW_MISS_THREADS, 4, KVT_SWAP_MAX_TOP_K>;
using Narrow = Build<KVT_SWAP_FEW_MISS_512_THREADS, 2, KVT_SWAP_FEW_MISS_512_MAX_ENTRIES>;

// The block's shared memory, carved from kvt_dynamic_smem; the host computes
// the same size (few_miss_smem_bytes in src/swap_in/cuda.rs). 8-byte arrays
// first, then 4-byte, then 2-byte. Each array's address is computed where it
// is used, from the two sizes: a struct of thirteen pointers would hold
// thirteen registers through the whole kernel.
template <class B>
struct Smem {
    static constexpr uint32_t kWarps = B::kWarps;
    uint32_t E, H, hs;

    __device__ __forceinline__ Smem(uint32_t entries, uint32_t hot)
        : E(entries), H(hot), hs(hash_size(entries, B::kSpread)) {}
    __device__ __forceinline__ int32_t* words() const {
        return reinterpret_cast<int32_t*>(kvt_dynamic_smem) + 2 * KVT_SWAP_FEW_MISS_INLINE;
    }
    // [INLINE] host row of miss m, for the block's own copy, and its device row
    __device__ __forceinline__ int64_t* copy_src() const { return reinterpret_cast<int64_t*>(kvt_dynamic_smem); }
    __device__ __forceinline__ int32_t* copy_dst() const { return words(); }
    // [kWarps * 3] per warp: hits, evictables, usable evictables; [kWarps] misses
    __device__ __forceinline__ uint32_t* slot_totals() const {
        return reinterpret_cast<uint32_t*>(words() + KVT_SWAP_FEW_MISS_INLINE);
    }
    __device__ __forceinline__ uint32_t* miss_totals() const { return slot_totals() + 3 * kWarps; }
    // [4]: [0] set when the query names a token twice
    __device__ __forceinline__ int32_t* duplicates() const {
        return reinterpret_cast<int32_t*>(miss_totals() + kWarps);
    }
    // [hs] each: the token hash table
    __device__ __forceinline__ int32_t* hash_keys() const {
        return words() + KVT_SWAP_FEW_MISS_INLINE + 4 * kWarps + 4;
    }
    __device__ __forceinline__ int32_t* hash_vals() const { return hash_keys() + hs; }
    // [H] token per slot, in slot order; [H + 1] device row per slot, the
    // reserved slot last (16-byte aligned, so are both when H % 4 == 0)
    __device__ __forceinline__ int32_t* slot_tok() const { return hash_keys() + 2 * hs; }
    __device__ __forceinline__ int32_t* slot_loc() const { return slot_tok() + H; }
    // [E] the entry's token, or kPad / kBad / kNewest
    __device__ __forceinline__ int32_t* e_tok() const { return slot_loc() + H + 1; }
    // [E] lowest LRU position of a hit, then the output
    __device__ __forceinline__ int32_t* e_val() const { return e_tok() + E; }
    // [ceil(H / 32)] slots seen in lru_slots
    __device__ __forceinline__ uint32_t* bitmap() const { return reinterpret_cast<uint32_t*>(e_val() + E); }
    // [H] slot per LRU position, with kHit / kUsable; [E] the first E usable
    // evictable slots, in LRU order
    __device__ __forceinline__ uint16_t* lru_old() const {
        return reinterpret_cast<uint16_t*>(bitmap() + (H + 31) / 32);
    }
    __device__ __forceinline__ uint16_t* usable_slot() const { return lru_old() + H; }
};

}  // namespace few
}  // namespace swap
}  // namespace kvt

// kvt_swap_in_few_miss_plan — one block of KVT_SWAP_FEW_MISS_THREADS per batch
// row; the same contract, outputs, state, plan and error reports as
// kvt_swap_in_plan.
// Reads:   as kvt_swap_in_plan; the request's device_buffer_tokens (LRU
//          slots) and device_buffer_locs are read whole, in slot order.
// Writes:  as kvt_swap_in_plan; and unless KVT_SWAP_SKIP_IO, the device rows
//          of a row's misses when it has at most KVT_SWAP_FEW_MISS_INLINE
//          (the copy kernel launched after it with KVT_SWAP_SKIP_INLINE moves
//          the others), or with KVT_SWAP_COPY_IN_PLAN of every miss (no copy
//          kernel follows: one launch a swap-in).
// Assumes: blockDim.x == KVT_SWAP_FEW_MISS_THREADS, gridDim.x == batch,
//          dynamic shared memory of few_miss_smem_bytes (src/swap_in/cuda.rs),
//          the host-checked shapes (entries <= hot <= KVT_SWAP_MAX_HOT,
//          buffers cover their rows).
// Critical path of a 2-miss long row (H 4096, K 2048, int32 indices), read
// from the sm_90 SASS against SGLang 0.5.23's kernel for the same shape
// (scripts/sass.sh disassembles both into target/sass/): the device-memory
// accesses that must complete before the first host-KV read, each needed by
// the next (for its address, or for the branch or shared-memory index that
// leads to it). kvtier, three: the row's request (its length beside it);
// the request's slot tokens, slot rows and LRU order (their values decide
// which entries miss); the misses' host rows, then the host read. SGLang's,
// four: the request; the LRU order; the slots' tokens through it; the
// misses' host and device rows. Counting only addresses computed from the
// previous load's value, both are two (request, then host row, the query
// being addressed from parameters alone). The loads of one link are not all
// in flight at once: kvtier's slots, LRU order and query are three round
// trips one after another (each loop consumes its loads before the next
// issues), so a block waits on 5 (row 0, no num_real_reqs) to 8 device
// round trips before the host read; SGLang's kernel about 18 to 20 (its
// 4096 slots walked in four barrier-separated passes of lru -> token ->
// row). Read from the build of commit a31fdd3, before `report` moved out of
// line (which moved no load). Unmeasured: which of these a GPU overlaps with
// other blocks' work.
namespace kvt {
namespace swap {
namespace few {
// Lines: every miss the block copies moves with its passes aligned to
// 128-byte host lines (KVT_COPY_LINE_ALIGNED), one 16-byte vector a lane in
// flight (a 656-byte row: two passes where warp vectors take one); a kernel
// of its own, since a branch between the two copies in one kernel spilled
// 136 bytes a thread at 64 registers, and two vectors a lane 76 to 124.
// FixedE, FixedH (0: read from p): the row's entries and hot slots as
// constants, with blockDim.x as the build's threads: the shared-memory
// carve-up, the hash table's size, every loop's trip count and chunk range
// fold into the code (kvt_swap_in_few_miss_k2048_h4096_plan and _h8192_).
// b: the batch row (the block's index, but in a cluster a row's).
// Clustered: rank 0 of kvt_swap_in_few_miss_cluster_plan, whose other
// blocks copy a row of more misses than its copy list holds (no copy kernel
// follows, and it never copies from its plan row itself).
template <class B, bool Lines = false, uint32_t FixedE = 0, uint32_t FixedH = 0, bool Clustered = false>
__device__ __forceinline__ bool plan(const kvt_swap_in_params& p, const uint32_t b = blockIdx.x) {
    constexpr uint32_t kWarps = B::kWarps;
    constexpr uint32_t kMaxEntryChunks = B::kChunks;
    // A warp's run of 32-item chunks, over this block's warps.
    using Chunks = WarpChunks<kWarps>;
    const uint32_t tid = threadIdx.x;
    static_assert((FixedE == 0) == (FixedH == 0), "both shapes fixed, or neither");
    const uint32_t nthreads = FixedE ? kWarps * KVT_WARP : blockDim.x;
    const uint32_t warp = tid / KVT_WARP, lane = tid % KVT_WARP, below = lanes_below(lane);
    const uint32_t E = FixedE ? FixedE : p.entries;
    const uint32_t H = FixedH ? FixedH : p.hot;
    const PlanRow row(p, b);
    const Reporter& err = row.err;
    const uint32_t row_pos = row.pos;

    const int64_t rid = load_index(p.req_pool_indices, b, p.flags & KVT_SWAP_REQ_INDICES_I64);
    const int64_t seq = load_index(p.seq_lens, b, p.flags & KVT_SWAP_SEQ_LENS_I64);
    const uint32_t real = real_rows(p, err, true);
    count_call(p, real);
    if (b >= real) {  // padding: outputs -1, state and plan row untouched
        row.pad();
        return false;
    }
    if (rid < 0 || rid >= (int64_t)p.num_requests) {
        row.refuse(KVT_ERR_SWAP_REQ, rid);
        return false;
    }

    const Smem<B> s(E, H);
    const TokenHash hash{s.hash_keys(), s.hash_vals(), s.hs - 1};
    const bool long_row = seq > (int64_t)H && seq <= (int64_t)p.max_tokens;
    // A request an earlier row names is that row's to change: this row is
    // refused. The comparisons are voted on at the first barrier, which also
    // orders the table clears before the inserts.
    bool named = false;
    {
        const bool wide = p.flags & KVT_SWAP_REQ_INDICES_I64;
        for (uint32_t e = tid; e < b; e += nthreads) named |= load_index(p.req_pool_indices, e, wide) == rid;
    }
    if (long_row) {
        hash.clear(tid, nthreads);
        for (uint32_t w = tid; w < (H + 31) / 32; w += nthreads) s.bitmap()[w] = 0;
        if (tid == 0) s.duplicates()[0] = 0;
    }
    if (__syncthreads_or(named)) {
        row.refuse(KVT_ERR_SWAP_DUP_REQ, rid);
        return false;
    }
    if (seq < 0 || seq > (int64_t)p.max_tokens) {
        row.refuse(KVT_ERR_SWAP_SEQ_LEN, seq);
        return false;
    }

    const RequestRows rq(p, b, rid);

    if (!long_row) {
        short_row(p, row, rq, seq);
        return false;
    }

    // Long sequence. The row's slots (in slot order), LRU order and query are
    // loaded together; tokens of the LRU part go into the hash table.
    const int32_t newest = (int32_t)(seq - 1);
    constexpr uint32_t kLoads = 4;
    bool lru_bad = false;
    // An LRU position's slot, checked (a permutation of [0, hot): each slot
    // once), and a query entry classified and its token hashed.
    auto lru_entry = [&](uint32_t pos, int16_t slot) {
        bool ok = slot >= 0 && (uint32_t)slot < H;
        if (ok) {
            const uint32_t bit = 1u << (slot & 31);
            ok = (atomicOr(&s.bitmap()[slot >> 5], bit) & bit) == 0;
        }
        lru_bad |= !ok;
        s.lru_old()[pos] = ok ? (uint16_t)slot : 0;
    };
    auto insert = [&](uint32_t i, const QueryEntry& q) {
        const int64_t t = classify(p, err, rq.topk, row_pos, seq, i, q);
        const int32_t tok = t == -1 ? kPad : t < 0 ? kBad : t == newest ? kNewest : (int32_t)t;
        s.e_tok()[i] = tok;
        s.e_val()[i] = kNone;
        if (tok >= 0 && hash.insert(tok, (int32_t)i)) s.duplicates()[0] = 1;
    };
    if (H % 4 == 0 && aligned16(rq.btok) && aligned16(rq.bloc)) {
        // Four slots a load (SGLang's rows are 16-byte aligned): a quarter
        // of the loads and of their address arithmetic (two in flight: HOT
        // 8192 in one pass; four would spill).
        batched<2>(
            tid, H / 4, nthreads,
            [&](uint32_t q) { return SlotRow4{ld(as_vec(rq.btok) + q), ld(as_vec(rq.bloc) + q)}; },
            [&](uint32_t q, const SlotRow4& r) {
                as_vec(s.slot_tok())[q] = r.tokens;
                as_vec(s.slot_loc())[q] = r.locs;
            });
    } else {
        batched<kLoads>(
            tid, H, nthreads, [&](uint32_t slot) { return SlotRow{ld(rq.btok + slot), ld(rq.bloc + slot)}; },
            [&](uint32_t slot, const SlotRow& r) {
                s.slot_tok()[slot] = r.token;
                s.slot_loc()[slot] = r.loc;
            });
    }
    if (tid == 0) s.slot_loc()[H] = ld(rq.bloc + H);
    batched<kLoads>(tid, H, nthreads, [&](uint32_t pos) { return ld(rq.lru + pos); }, lru_entry);
    {
        // One loop per query kind: in a shared one the compiler computes a
        // block query's division for every entry of a token query too.
        if (p.flags & KVT_SWAP_QUERY_BLOCKS)
            batched<kLoads>(tid, E, nthreads, [&](uint32_t i) { return query_entry(p, rq.topk, i); }, insert);
        else
            batched<kLoads>(tid, E, nthreads, [&](uint32_t i) { return token_entry(rq.topk, i); }, insert);
    }
    if (__syncthreads_or(lru_bad)) {  // lru_slots is not a permutation of [0, hot)
        row.refuse(KVT_ERR_SWAP_LRU, 0);
        return false;
    }

    // Slots in LRU order: a slot whose token is in the query is a hit (the
    // lowest LRU position wins for a token in two slots); the others are
    // evictable, usable when their device row is in range.
    const Chunks pc(H, warp);
    {
        uint32_t n_hit = 0, n_evict = 0, n_usable = 0;
        for (uint32_t c = pc.first; c < pc.end; ++c) {
            const uint32_t pos = c * KVT_WARP + lane;
            bool hit = false, evict = false, usable = false;
            if (pos < H) {
                const uint16_t slot = s.lru_old()[pos];
                const int32_t token = s.slot_tok()[slot];
                const int32_t e = token >= 0 ? hash.find(token) : -1;
                if (e >= 0) {
                    hit = true;
                    atomicMin(&s.e_val()[e], (int32_t)pos);
                } else {
                    evict = true;
                    const int32_t loc = s.slot_loc()[slot];
                    usable = in_rows(loc, p.device_rows);
                    if (!usable) report(err, KVT_ERR_SWAP_SLOT_LOC, row_pos | slot, loc);
                }
                s.lru_old()[pos] = slot | (hit ? kHit : 0) | (usable ? kUsable : 0);
            }
            n_hit += __popc(warp_ballot(hit));
            n_evict += __popc(warp_ballot(evict));
            n_usable += __popc(warp_ballot(usable));
        }
        if (lane == 0) {
            s.slot_totals()[warp * 3 + 0] = n_hit;
            s.slot_totals()[warp * 3 + 1] = n_evict;
            s.slot_totals()[warp * 3 + 2] = n_usable;
        }
    }
    __syncthreads();
    const WarpOffset hits = warp_offset(s.slot_totals() + 0, 3, warp, lane, kWarps);
    const WarpOffset evictables = warp_offset(s.slot_totals() + 1, 3, warp, lane, kWarps);
    const WarpOffset usables = warp_offset(s.slot_totals() + 2, 3, warp, lane, kWarps);
    {  // The first E usable evictables, in LRU order: the m-th miss takes the m-th.
        uint32_t u = usables.before;
        for (uint32_t c = pc.first; c < pc.end; ++c) {
            const uint32_t pos = c * KVT_WARP + lane;
            const uint16_t f = pos < H ? s.lru_old()[pos] : 0;
            const bool usable = pos < H && (f & kUsable);
            const uint32_t votes = warp_ballot(usable);
            const uint32_t r = u + __popc(votes & below);
            if (usable && r < E) s.usable_slot()[r] = f & kSlotMask;
            u += __popc(votes);
        }
    }

    // Entries: the newest token and hits output their device rows; the other
    // tokens are misses when their host row is in range. A lane keeps its
    // entries' misses (bit k of `miss_bits` for chunk first + k) and their
    // host rows in registers; duplicates (`dup_bits`) take their canonical
    // entry's output at the end.
    const Chunks ec(E, warp);
    // Which entries are the canonical (first) occurrence of their token needs
    // a lookup only when some token occurs twice (hostile input).
    const bool dups = s.duplicates()[0] != 0;
    auto canonical = [&](int32_t tok, uint32_t i) { return !dups || hash.find(tok) == (int32_t)i; };
    int64_t host_row[kMaxEntryChunks];
    uint32_t miss_bits = 0, dup_bits = 0, n_miss = 0;
#pragma unroll
    for (uint32_t k = 0; k < kMaxEntryChunks; ++k) {  // the misses' host rows, loaded together
        const uint32_t i = (ec.first + k) * KVT_WARP + lane;
        host_row[k] = -1;
        if (ec.first + k < ec.end && i < E) {
            const int32_t tok = s.e_tok()[i];
            if (tok >= 0 && s.e_val()[i] == kNone && canonical(tok, i)) host_row[k] = ld(rq.hloc + tok);
        }
    }
#pragma unroll
    for (uint32_t k = 0; k < kMaxEntryChunks; ++k) {
        if (ec.first + k >= ec.end) break;  // warp-uniform
        const uint32_t i = (ec.first + k) * KVT_WARP + lane;
        bool miss = false;
        if (i < E) {
            const int32_t tok = s.e_tok()[i];
            int32_t o = -1;
            if (tok == kNewest) {
                const int32_t loc = s.slot_loc()[H];
                if (in_rows(loc, p.device_rows))
                    o = loc;
                else
                    report(err, KVT_ERR_SWAP_DEVICE_LOC, row_pos | i, loc);
            } else if (tok >= 0 && !canonical(tok, i)) {
                dup_bits |= 1u << k;
            } else if (tok >= 0 && s.e_val()[i] != kNone) {
                const int32_t loc = s.slot_loc()[s.lru_old()[s.e_val()[i]] & kSlotMask];
                if (in_rows(loc, p.device_rows))
                    o = loc;
                else
                    report(err, KVT_ERR_SWAP_DEVICE_LOC, row_pos | i, loc);
            } else if (tok >= 0) {
                miss = in_rows(host_row[k], p.host_rows);
                if (!miss) report(err, KVT_ERR_SWAP_HOST_LOC, row_pos | i, host_row[k]);
            }
            s.e_val()[i] = o;
        }
        miss_bits |= (uint32_t)miss << k;
        n_miss += __popc(warp_ballot(miss));
    }
    if (lane == 0) s.miss_totals()[warp] = n_miss;
    __syncthreads();
    const WarpOffset misses = warp_offset(s.miss_totals(), 1, warp, lane, kWarps);
    const uint32_t n_load = min(misses.total, usables.total);
    const bool copy_here = n_load <= KVT_SWAP_FEW_MISS_INLINE && !(p.flags & KVT_SWAP_SKIP_IO);

    // The m-th miss (query order) takes the m-th usable evictable slot; the
    // rest have no slot (reported). Outputs of all but duplicates.
    {
        uint32_t r = misses.before;
#pragma unroll
        for (uint32_t k = 0; k < kMaxEntryChunks; ++k) {
            if (ec.first + k >= ec.end) break;  // warp-uniform
            const uint32_t i = (ec.first + k) * KVT_WARP + lane;
            const bool miss = (miss_bits >> k) & 1u;
            const uint32_t votes = warp_ballot(miss);
            const uint32_t m = r + __popc(votes & below);
            r += __popc(votes);
            if (i >= E || ((dup_bits >> k) & 1u)) continue;
            int32_t o = s.e_val()[i];
            if (miss) {
                if (m < n_load) {
                    const uint16_t slot = s.usable_slot()[m];
                    o = s.slot_loc()[slot];
                    st(rq.btok + slot, s.e_tok()[i]);
                    st(row.plan_src + m, host_row[k]);
                    st(row.plan_dst + m, o);
                    if (copy_here) {
                        s.copy_src()[m] = host_row[k];
                        s.copy_dst()[m] = o;
                    }
                } else {
                    report(err, KVT_ERR_SWAP_DEVICE_LOC, row_pos | i, -1);
                }
                s.e_val()[i] = o;
            }
            st(row.out + i, o);
        }
    }
    if (tid == 0) {
        st(row.plan_count + b, (int32_t)n_load);
        count_row(p, hits.total, n_load);
    }

    // New LRU order: unused evictables (old order), the slots just loaded
    // (miss order), the hits (old order).
    {
        uint32_t hit_r = hits.before, evict_r = evictables.before, usable_r = usables.before;
        for (uint32_t c = pc.first; c < pc.end; ++c) {
            const uint32_t pos = c * KVT_WARP + lane;
            const bool valid = pos < H;
            const uint16_t f = valid ? s.lru_old()[pos] : 0;
            const bool hit = valid && (f & kHit), evict = valid && !hit, usable = valid && (f & kUsable);
            const uint32_t vh = warp_ballot(hit), ve = warp_ballot(evict), vu = warp_ballot(usable);
            const uint32_t hr = hit_r + __popc(vh & below), er = evict_r + __popc(ve & below),
                           ur = usable_r + __popc(vu & below);
            hit_r += __popc(vh);
            evict_r += __popc(ve);
            usable_r += __popc(vu);
            if (!valid) continue;
            uint32_t to;
            if (hit)
                to = evictables.total + hr;
            else if (usable && ur < n_load)
                to = evictables.total - n_load + ur;
            else
                to = er - min(ur, n_load);
            st(rq.lru + to, (int16_t)(f & kSlotMask));
        }
    }

    __syncthreads();  // canonical outputs and the copy list, for other threads
#pragma unroll
    for (uint32_t k = 0; k < kMaxEntryChunks; ++k) {
        if (!((dup_bits >> k) & 1u)) continue;
        const uint32_t i = (ec.first + k) * KVT_WARP + lane;
        st(row.out + i, s.e_val()[hash.find(s.e_tok()[i])]);
    }
    // The copy kernel follows unless no bytes move, this block copies every
    // miss or its cluster does; it waits for this grid to complete before
    // it reads the plan.
    if (!Clustered && !(p.flags & (KVT_SWAP_SKIP_IO | KVT_SWAP_COPY_IN_PLAN))) allow_dependents();
    // Two 16-byte vectors a lane in flight: a row of up to 1 KiB (656-byte DSA
    // items, DeepSeek-V4's 576 + 8) in one pass over the link; three or four
    // would spill at 64 registers. With KVT_SWAP_COPY_IN_PLAN (one launch) a
    // row of more misses than the shared copy list holds is copied from its
    // plan row, which this block wrote before the barrier above: its copy
    // starts as soon as its own plan is done, while other rows still plan.
    const bool copy_all = !Clustered && (p.flags & KVT_SWAP_COPY_IN_PLAN) && !(p.flags & KVT_SWAP_SKIP_IO);
    // (One copy loop for both lists: a second inlined copy_row made the
    // kernel 600 instructions longer.)
    // Clustered: the plan row and count are written (before the barrier
    // above); the cluster's other blocks may read them. (A cluster barrier
    // after this block's copy loop spilled 68 bytes a thread on sm_90.)
    if (Clustered) cluster_sync();
    if (copy_here || copy_all)
        for (uint32_t m = warp; m < n_load; m += kWarps) {
            const int64_t src = copy_here ? s.copy_src()[m] : ld(row.plan_src + m);
            const int32_t dst = copy_here ? s.copy_dst()[m] : ld(row.plan_dst + m);
            copy_row<Lines ? 1 : 2, Lines>(p, err, src, dst, row_pos | m, lane);
        }
    return Clustered;
}
}  // namespace few
}  // namespace swap
}  // namespace kvt

extern "C" __global__ void __launch_bounds__(KVT_SWAP_FEW_MISS_THREADS, 1)
    kvt_swap_in_few_miss_plan(const kvt_swap_in_params p) {
    kvt::swap::few::plan<kvt::swap::few::Wide>(p);
}

// kvt_swap_in_few_miss_512_plan — the same planner in blocks of
// KVT_SWAP_FEW_MISS_512_THREADS with its hash table at most half full, for
// rows of at most KVT_SWAP_FEW_MISS_512_MAX_ENTRIES entries; the same
// contract, reads, writes and reports as kvt_swap_in_few_miss_plan.
// Why: at batch 256 kvt_swap_in_few_miss_plan's blocks (1024 threads of 64
// registers, 125 KiB of shared memory at K 2048 / HOT 4096) fit one an SM,
// so 256 rows take two waves of an H100's or H200's 132 SMs, and SGLang's
// kernel (two blocks an SM) was 1.44x faster there on an H100
// (bench/results/h100-2026-11-27). Blocks of 512 threads at 64 registers
// with ~93 KiB of state (K 2048 / HOT 4096) fit two an sm_90 SM: one wave,
// each thread doing twice the slots' and entries' work. At HOT 8192
// (~133 KiB), or on sm_80 (164 KiB an SM), one block an SM: slower than
// kvt_swap_in_few_miss_plan, so it is a strategy of its own
// (SwapInStrategy::FewMiss512) until a GPU run says where it wins.
// Assumes: blockDim.x == KVT_SWAP_FEW_MISS_512_THREADS, gridDim.x == batch,
//          dynamic shared memory of few_miss_512_smem_bytes, entries <=
//          KVT_SWAP_FEW_MISS_512_MAX_ENTRIES, and as kvt_swap_in_few_miss_plan.
extern "C" __global__ void __launch_bounds__(KVT_SWAP_FEW_MISS_512_THREADS, 2)
    kvt_swap_in_few_miss_512_plan(const kvt_swap_in_params p) {
    kvt::swap::few::plan<kvt::swap::few::Narrow>(p);
}

// kvt_swap_in_few_miss_lines_plan — kvt_swap_in_few_miss_plan with every miss
// the block copies moved as KVT_COPY_LINE_ALIGNED: what the launcher runs for
// KVT_SWAP_COPY_IN_PLAN with KVT_SWAP_COPY_LINES on this planner
// (SwapInStrategy::FewMissOneLaunch with CopyMethod::LineAligned; the
// 512-thread planner, slower on an H100, has no such build: each planner
// build adds about 0.7 MB to the wheel). The same contract, reads, writes
// and reports. Why: on an H100 (bench/results/h100-2026-11-27b), with
// 274 or 410 misses of 656 bytes a row at batch 10 to 256, the few-miss
// planner with the line-aligned copy kernel took 1.4-6.5 % less time than
// the one-launch planner copying with warp vectors, and one launch less
// with 2 misses (a launch fewer). Whether these builds keep both, with one
// vector a lane in flight (two passes of a 656-byte row where warp vectors
// take one), is the GPU's to say: they have run only under the kernel
// emulator.
extern "C" __global__ void __launch_bounds__(KVT_SWAP_FEW_MISS_THREADS, 1)
    kvt_swap_in_few_miss_lines_plan(const kvt_swap_in_params p) {
    kvt::swap::few::plan<kvt::swap::few::Wide, true>(p);
}

// kvt_swap_in_few_miss_k2048_h4096_plan, kvt_swap_in_few_miss_k2048_h8192_plan
// — kvt_swap_in_few_miss_plan built for rows of 2048 entries over 4096 or
// 8192 slots (DeepSeek-V3.2's and GLM-5's top-k over SGLang's hot buffers of
// 2x and 4x top-k), the launcher's choice under KVT_SWAP_FIXED_SHAPE for
// exactly those shapes (the plain build elsewhere). The same contract,
// reads, writes and reports.
// Why: at batch 1 and at batch 256 with 2 misses a row the plain build is
// bound by the instructions it issues (Nsight Compute on an H100,
// bench/results/h100-2026-11-27/profile-planners: 66.5k warp instructions
// for one row, 67.7k a row at batch 256, no source line above 10 %), and
// SGLang's kernel, compiled per top-k and hot size as these are, was faster
// at batch 256 on the H200 of 2026-11-28 (29.5 against 37.7 us at HOT 4096).
// With the shapes and the block's threads constants, the carve-up of shared
// memory, the hash table's size and mask, the chunk ranges and the loops'
// trip counts are no longer computed per thread, and a lane keeps two
// chunks of entries in registers instead of four. Timed beside the plain
// build by the benchmark; no default takes the warp-vector copies' build
// (the line-aligned copies' one below is the default's above batch 10 on
// sm_90: SwapInChoice::default_for).
// Assumes: entries == 2048, hot == 4096 or 8192 (the kernel's name), and as
//          kvt_swap_in_few_miss_plan.
namespace kvt {
namespace swap {
namespace few {
using Fixed2048 = Build<KVT_SWAP_FEW_MISS_THREADS, 4, 2048>;
}  // namespace few
}  // namespace swap
}  // namespace kvt

extern "C" __global__ void __launch_bounds__(KVT_SWAP_FEW_MISS_THREADS, 1)
    kvt_swap_in_few_miss_k2048_h4096_plan(const kvt_swap_in_params p) {
    kvt::swap::few::plan<kvt::swap::few::Fixed2048, false, 2048, 4096>(p);
}

extern "C" __global__ void __launch_bounds__(KVT_SWAP_FEW_MISS_THREADS, 1)
    kvt_swap_in_few_miss_k2048_h8192_plan(const kvt_swap_in_params p) {
    kvt::swap::few::plan<kvt::swap::few::Fixed2048, false, 2048, 8192>(p);
}

// kvt_swap_in_few_miss_k2048_h4096_lines_plan, _k2048_h8192_lines_plan — the
// fixed-shape builds above with every miss the block copies moved as
// KVT_COPY_LINE_ALIGNED (as kvt_swap_in_few_miss_lines_plan is the plain
// build's): the launcher's choice under KVT_SWAP_FIXED_SHAPE with
// KVT_SWAP_COPY_IN_PLAN and KVT_SWAP_COPY_LINES at those shapes. The same
// contract, reads, writes and reports. Why: on the H200 of 2026-11-28
// (bench/results/h200-2026-11-28b) the fixed-shape build was the fastest
// one-launch planner with 2 misses a row (33.4 against 35.4 us at batch 256,
// HOT 4096) and level with hundreds, where the line-aligned copies were
// 2-5 % faster (batch 64-256, 137-410 misses of 656 bytes) and 2-5 %
// slower with 2 misses; the miss count is the device's to know, so one
// build should keep both. On the next H200 run (h200-2026-11-28c) it was
// 2-8 % faster than the warp-vector copies' fixed-shape build at 10 of 28
// points above batch 10 (hundreds of misses) and 4-7 % slower at 4 (2
// misses): the default above batch 10 on sm_90 (SwapInChoice::default_for).
// Assumes: as the fixed-shape build of its shape.
extern "C" __global__ void __launch_bounds__(KVT_SWAP_FEW_MISS_THREADS, 1)
    kvt_swap_in_few_miss_k2048_h4096_lines_plan(const kvt_swap_in_params p) {
    kvt::swap::few::plan<kvt::swap::few::Fixed2048, true, 2048, 4096>(p);
}

extern "C" __global__ void __launch_bounds__(KVT_SWAP_FEW_MISS_THREADS, 1)
    kvt_swap_in_few_miss_k2048_h8192_lines_plan(const kvt_swap_in_params p) {
    kvt::swap::few::plan<kvt::swap::few::Fixed2048, true, 2048, 8192>(p);
}

namespace kvt {
namespace swap {
namespace few {
// The share of row b's misses of a block of rank 1 or more of its cluster,
// once rank 0 has planned the row (kvt_swap_in_few_miss_cluster_plan): miss
// m goes to warp m % ((size - 1) * warps) of those blocks, read from the
// plan row as the copy kernel reads it. Rows rank 0 copies itself (at most
// KVT_SWAP_FEW_MISS_INLINE misses), padding, refused and short rows, and
// probes move nothing here.
template <class B>
__device__ __forceinline__ void cluster_copy(const kvt_swap_in_params& p) {
    const uint32_t rank = cluster_rank() - 1, size = cluster_size() - 1, b = cluster_id();
    if (p.flags & KVT_SWAP_SKIP_IO) return;
    const PlanRow row(p, b);
    if (b >= real_rows(p, row.err, false)) return;  // padding: the plan row is not this call's
    // Rank 0 wrote n, at most the row's entries (the plan capacity): the
    // copy kernel's report of a count past it (a caller's replayed plan)
    // has nothing to catch here, and such a count only copies nothing.
    const int32_t n = ld(row.plan_count + b);
    if (n <= (int32_t)KVT_SWAP_FEW_MISS_INLINE || (uint32_t)n > p.plan_capacity) return;
    const uint32_t warp = threadIdx.x / KVT_WARP, lane = threadIdx.x % KVT_WARP;
    for (uint32_t m = rank * B::kWarps + warp; m < (uint32_t)n; m += size * B::kWarps)
        copy_row<2>(p, row.err, ld(row.plan_src + m), ld(row.plan_dst + m), row.pos | m, lane);
}
}  // namespace few
}  // namespace swap
}  // namespace kvt

// kvt_swap_in_few_miss_cluster_plan — kvt_swap_in_few_miss_plan and the copy
// kernel after it in one launch, for small batches (sm_90 and later): a
// thread-block cluster a batch row (gridDim.x == batch * cluster size). Its
// rank 0 plans the row as kvt_swap_in_few_miss_plan does and passes a
// cluster barrier once the row's plan is written, then copies the row's
// misses itself when they are at most KVT_SWAP_FEW_MISS_INLINE; the other
// blocks of the cluster wait at the barrier and copy a share each of a row
// of more, from the plan row rank 0 wrote. The same contract, outputs,
// state, plan and reports as kvt_swap_in_few_miss_plan followed by
// kvt_swap_in_copy with KVT_SWAP_SKIP_INLINE.
// Why: below batch 8 the few-miss planner hands a row of more than 32 misses
// to the copy kernel, which costs a launch even when no row has that many
// (FewMiss against FewMissOneLaunch on the H200 of 2026-11-28, 2 misses at
// batch 1: 21.1 against 19.1 us), while one block copying a row's hundreds
// of misses alone is latency-bound (410 misses at batch 1: 42.4 us one
// launch, 27.5 with the copy kernel). A cluster is scheduled whole, so its
// blocks may wait for their rank 0 (blocks of one grid may not wait for each
// other), and its barrier orders rank 0's plan before their reads: the miss
// copy spreads over the cluster's SMs without a second launch, and a row of
// a few misses leaves the cluster's other blocks idle for the time of a
// plan. 64 registers, no spill (sm_80, sm_90).
// Reads:   as kvt_swap_in_few_miss_plan and kvt_swap_in_copy.
// Writes:  as kvt_swap_in_few_miss_plan and kvt_swap_in_copy.
// Assumes: a cluster launch (src/cuda/mod.rs CudaDevice::launch_clustered)
//          in clusters of at least 2 blocks (KVT_SWAP_CLUSTER on a GPU) of
//          KVT_SWAP_FEW_MISS_THREADS threads, dynamic shared memory of
//          few_miss_smem_bytes, KVT_SWAP_SKIP_INLINE and
//          KVT_SWAP_CLUSTER_COPY set, KVT_SWAP_COPY_IN_PLAN not, and as
//          kvt_swap_in_few_miss_plan.
extern "C" __global__ void __launch_bounds__(KVT_SWAP_FEW_MISS_THREADS, 1)
    kvt_swap_in_few_miss_cluster_plan(const kvt_swap_in_params p) {
    using namespace kvt::swap::few;
    // Rank 0 plans, passing the cluster barrier once the plan row is
    // written (and copying a row of few misses itself after it), or after
    // it left the plan early (padding, refused and short rows); the others
    // copy a row of more misses after the barrier.
    if (kvt::cluster_rank() == 0) {
        if (!plan<Wide, false, 0, 0, true>(p, kvt::cluster_id())) kvt::cluster_sync();
        return;
    }
    kvt::cluster_sync();
    cluster_copy<Wide>(p);
}
