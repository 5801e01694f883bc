// kernels/swap_in_compact.cu — the compact swap-in planner: the contract of
// kvt_swap_in_plan (abi.h; semantics in src/swap_in/mod.rs) planned by one
// block of KVT_SWAP_COMPACT_THREADS per row whose registers and shared memory
// leave room for a second block on the SM.
//
// Why a third planner: on the first GPU runs (bench/results/h200-2026-11-26)
// the few-miss planner lost to SGLang's kernel at batch 256 (0.72x): its
// 1024-thread block holds 64 registers a thread and 125 KiB of shared memory
// at K 2048 / HOT 4096 (166 KiB at HOT 8192), so an SM runs one block where
// SGLang's runs two, and 256 rows take two waves of 132 SMs where SGLang's
// take one. This planner keeps the few-miss planner's warp-vote ranks and
// coalesced slot loads and cuts its state to what two blocks can hold (57 KiB
// at K 2048 / HOT 4096, 74 KiB at HOT 8192;
// two blocks need <= ~81 KiB on sm_80, ~113 KiB on sm_90):
// - no staged copy of the slots' tokens and rows (64 KiB at HOT 8192): the
//   slots are read once, in slot order, straight into the hit test, which
//   needs each slot's LRU position, so the LRU order is inverted first
//   (pos_of, 2 bytes a slot);
// - a token hash at most half full (keys, and 16-bit entry indices) instead
//   of a quarter full with 32-bit ones;
// - 16-bit LRU positions per entry (e_pos), updated with a 32-bit CAS; the
//   device rows of hits and of the slots misses take are loaded from global
//   memory (L2) when needed instead of kept;
// - 32 registers a thread, and no spill (scripts/kernel-resources.sh): the
//   request's pointers recomputed from a shared copy of its index, the
//   thread index read again where used, error reports made after the loops
//   that find them (a call inside a loop holds the loop's registers across
//   it), and the copy split into work items of one 512-byte pass or one
//   scale piece of one plane of one row, each a warp's, its counts read
//   from shared memory.
// Its misses are copied by the block itself when they are at most
// KVT_SWAP_FEW_MISS_INLINE (the copy kernel follows with
// KVT_SWAP_SKIP_INLINE and moves the other rows'), or all of them with
// KVT_SWAP_COPY_IN_PLAN: one launch a swap-in, no copy kernel, which suits
// batches wide enough that the planning blocks alone keep the link busy.
//
// What the diet costs, read from the source (the order of its loads and
// barriers), not yet measured: before a 2-miss row's first host read a block
// waits on five dependent device round trips, where the few-miss planner
// waits on three: (1) the row's request and length; (2) the LRU order and
// the query; (3) the slots' tokens and rows, which the few-miss planner
// loads in (2) and keeps; (4) the hits' device rows and the misses' host
// rows; (5) the device rows of the slots the misses take, which the
// few-miss planner has kept too. (3) to (5) read what (2) to (4) brought
// into L2. Two blocks an SM instead of one, and no second wave at batch 256,
// are what it buys.
//
// Per architecture: on sm_80 and sm_90 two blocks share an SM at K 2048 /
// HOT 8192 (74 KiB each; sm_80 holds two up to ~81 KiB); sm_86, sm_89 and
// sm_120 hold at most 1536 threads an SM, so one block, as the few-miss
// planner. On an H100 (second run of 2026-11-27) it was slower than the
// few-miss planner at every point, so it is no default anywhere.
#include "swap_in.cuh"

namespace kvt {
namespace swap {
namespace compact {

constexpr uint32_t kWarps = KVT_SWAP_COMPACT_THREADS / KVT_WARP;
static_assert(kWarps == KVT_WARP, "a warp scans one total per warp of the block");
using Chunks = WarpChunks<kWarps>;
// Chunks of 32 entries a warp owns at most: a lane keeps its entries' miss
// bits in registers across two phases (their rows go to shared memory).
constexpr uint32_t kMaxEntryChunks = (KVT_SWAP_COMPACT_MAX_ENTRIES / KVT_WARP + kWarps - 1) / kWarps;
// Hash table at most half full (two cells per entry).
constexpr uint32_t kHashSpread = 2;
// A 16-bit entry index or LRU position not yet set.
constexpr uint16_t kNone16 = 0xffff;
// e_tok of a duplicate entry once found: kDupOf - (its canonical entry).
constexpr int32_t kDupOf = -7;

// Passes of one 16-byte vector a lane (512 bytes) a warp makes over a row's
// value piece (8-byte pieces, where its ends are not 16-byte aligned, take as
// many: two a lane a pass).
__device__ __forceinline__ uint32_t row_passes(const kvt_item_layout& L) {
    const uint32_t passes = (L.value_bytes + KVT_WARP * 16 - 1) / (KVT_WARP * 16);
    return passes > 0 ? passes : 1;
}

// The token hash with 16-bit values (entries <= KVT_SWAP_COMPACT_MAX_ENTRIES).
using Hash16 = TokenHashOf<uint16_t, kNone16>;

// The block's shared memory, carved from kvt_dynamic_smem; the host computes
// the same size (compact_smem_bytes in src/swap_in/cuda.rs). 8-byte arrays
// first, then 4-byte, then 2-byte. Addresses are
// computed where used (a struct of pointers would hold registers).
struct Smem {
    const kvt_swap_in_params& p;

    __device__ __forceinline__ uint32_t hs() const { return hash_size(p.entries, kHashSpread); }
    // [INLINE] host row of miss m, for the block's own copy of few misses
    __device__ __forceinline__ int64_t* copy_src() const { return reinterpret_cast<int64_t*>(kvt_dynamic_smem); }
    // [1] the row's request (see Request)
    __device__ __forceinline__ volatile int64_t* request() const { return copy_src() + KVT_SWAP_FEW_MISS_INLINE; }
    __device__ __forceinline__ int32_t* words() const {
        return reinterpret_cast<int32_t*>(kvt_dynamic_smem) + 2 * (KVT_SWAP_FEW_MISS_INLINE + 1);
    }
    // [INLINE] device row of miss m, for the block's own copy
    __device__ __forceinline__ int32_t* copy_dst() const { return words(); }
    // [kWarps * 3] per warp: hits, evictables, usable evictables; [kWarps] misses
    __device__ __forceinline__ uint32_t* slot_totals() const {
        return reinterpret_cast<uint32_t*>(words() + KVT_SWAP_FEW_MISS_INLINE);
    }
    __device__ __forceinline__ uint32_t* miss_totals() const { return slot_totals() + 3 * kWarps; }
    // [4]: [0] set when the query names a token twice; [1..3] the copy's
    // work (CopyWork)
    __device__ __forceinline__ int32_t* duplicates() const {
        return reinterpret_cast<int32_t*>(miss_totals() + kWarps);
    }
    // The row's copy work, written by thread 0 with the plan count, read by
    // every warp in the copy loop: from shared memory at each iteration, where
    // values held in registers across the loop would spill.
    __device__ __forceinline__ volatile int32_t* copy_work() const { return duplicates() + 1; }
    // [hs] the hash table's keys (8-byte aligned); once the slots are tested
    // and duplicates marked, [E] the row each entry's output or copy needs
    // (hs >= 2E)
    __device__ __forceinline__ int32_t* hash_keys() const { return duplicates() + 4; }
    __device__ __forceinline__ int64_t* entry_row() const { return reinterpret_cast<int64_t*>(hash_keys()); }
    // [E] the entry's token, or kPad / kBad / kNewest; when the query names a
    // token twice, a duplicate's becomes kDupOf - its canonical entry, and
    // the others' their output once decided
    __device__ __forceinline__ int32_t* e_tok() const { return hash_keys() + hs(); }
    // [ceil(H / 32)] slots seen in lru_slots
    __device__ __forceinline__ uint32_t* bitmap() const { return reinterpret_cast<uint32_t*>(e_tok() + p.entries); }
    // [hs] the hash table's values (hs is even, and this array starts
    // 4-byte aligned); [E rounded up to even] lowest LRU position of a hit
    // per entry (kNone16: none); both updated with atomic_min16
    __device__ __forceinline__ uint16_t* hash_vals() const {
        return reinterpret_cast<uint16_t*>(bitmap() + (p.hot + 31) / 32);
    }
    __device__ __forceinline__ uint16_t* e_pos() const { return hash_vals() + hs(); }
    // [H] slot per LRU position, with kHit / kUsable; [H] LRU position of
    // each slot; [E] the first E usable evictable slots, in LRU order
    __device__ __forceinline__ uint16_t* lru_old() const { return e_pos() + ((p.entries + 1) & ~1u); }
    __device__ __forceinline__ uint16_t* pos_of() const { return lru_old() + p.hot; }
    __device__ __forceinline__ uint16_t* usable_slot() const { return pos_of() + p.hot; }
    __device__ __forceinline__ Hash16 hash() const { return Hash16{hash_keys(), hash_vals(), hs() - 1}; }
};

// The row's request state and outputs, addressed at each use from the
// request index kept in shared memory (a volatile read): held in registers
// from the row's checks to its copy, the five state pointers and four output
// pointers alone would take 18 of the 32 registers a thread may have when two
// blocks of 1024 threads share an SM.
struct Request {
    const kvt_swap_in_params& p;
    const Smem& s;

    __device__ __forceinline__ int64_t rid() const { return *s.request(); }
    __device__ __forceinline__ int32_t* btok() const {
        return reinterpret_cast<int32_t*>(p.device_buffer_tokens) + (uint64_t)rid() * p.tokens_stride;
    }
    __device__ __forceinline__ const int32_t* bloc() const {
        return reinterpret_cast<const int32_t*>(p.device_buffer_locs) + (uint64_t)rid() * p.locs_stride;
    }
    __device__ __forceinline__ int16_t* lru() const {
        return reinterpret_cast<int16_t*>(p.lru_slots) + (uint64_t)rid() * p.lru_stride;
    }
    __device__ __forceinline__ const int64_t* hloc() const {
        return reinterpret_cast<const int64_t*>(p.host_cache_locs) + (uint64_t)rid() * p.host_stride;
    }
    __device__ __forceinline__ const int32_t* topk() const {
        return reinterpret_cast<const int32_t*>(p.top_k_tokens) + (uint64_t)blockIdx.x * p.top_k_stride;
    }
    __device__ __forceinline__ int32_t* out() const {
        return reinterpret_cast<int32_t*>(p.top_k_device_locs) + (uint64_t)blockIdx.x * p.out_stride;
    }
    __device__ __forceinline__ int64_t* plan_src() const {
        return reinterpret_cast<int64_t*>(p.plan_src) + (uint64_t)blockIdx.x * p.plan_stride;
    }
    __device__ __forceinline__ int32_t* plan_dst() const {
        return reinterpret_cast<int32_t*>(p.plan_dst) + (uint64_t)blockIdx.x * p.plan_stride;
    }
};

}  // namespace compact
}  // namespace swap
}  // namespace kvt

// kvt_swap_in_compact_plan — one block of KVT_SWAP_COMPACT_THREADS per batch
// row; the same contract, outputs, state, plan and error reports as
// kvt_swap_in_plan.
// Reads:   as kvt_swap_in_plan; the request's device_buffer_tokens and
//          device_buffer_locs (LRU slots) are read whole, in slot order, and
//          device_buffer_locs again for the slots hits and misses take.
// Writes:  as kvt_swap_in_plan; and unless KVT_SWAP_SKIP_IO, the device rows
//          of a row's misses: all of them with KVT_SWAP_COPY_IN_PLAN, else
//          when it has at most KVT_SWAP_FEW_MISS_INLINE (the copy kernel
//          launched after it with KVT_SWAP_SKIP_INLINE moves the others).
// Assumes: blockDim.x == KVT_SWAP_COMPACT_THREADS, gridDim.x == batch,
//          dynamic shared memory of compact_smem_bytes (src/swap_in/cuda.rs),
//          the host-checked shapes (entries <= KVT_SWAP_COMPACT_MAX_ENTRIES,
//          entries <= hot <= KVT_SWAP_MAX_HOT, buffers cover their rows).
// Barriers of a long row: six (request checked; LRU order inverted and query
// hashed; slots tested; slot ranks counted; misses counted; canonical
// outputs and copy list written), one more than the few-miss planner, whose
// slot test ran in LRU order and counted in the same pass.
extern "C" __global__ void __launch_bounds__(KVT_SWAP_COMPACT_THREADS, 2)
    kvt_swap_in_compact_plan(const kvt_swap_in_params p) {
    using namespace kvt;
    using namespace kvt::swap;
    using namespace kvt::swap::compact;
    // The thread's index is read again at each use: ptxas keeps a special
    // register's value in a register (or spills it) rather than reading it
    // again, and 32 registers leave none to hold it through the kernel.
    auto tid = [] { return thread_index(); };
    auto warp = [] { return thread_index() / KVT_WARP; };
    auto lane = [] { return thread_index() % KVT_WARP; };
    const uint32_t nthreads = blockDim.x;
    const Smem s{p};
    const Request rq{p, s};
    const PlanRow row(p, blockIdx.x);

    const uint32_t real = real_rows(p, Reporter(p), true);
    count_call(p, real);
    if (blockIdx.x >= real) {  // padding: outputs -1, state and plan row untouched
        row.pad();
        return;
    }
    const int64_t seq = load_index(p.seq_lens, blockIdx.x, p.flags & KVT_SWAP_SEQ_LENS_I64);
    const bool long_row = seq > (int64_t)p.hot && seq <= (int64_t)p.max_tokens;
    {
        const int64_t rid = load_index(p.req_pool_indices, blockIdx.x, p.flags & KVT_SWAP_REQ_INDICES_I64);
        if (rid < 0 || rid >= (int64_t)p.num_requests) {
            row.refuse(KVT_ERR_SWAP_REQ, rid);
            return;
        }
        // A request an earlier row names is that row's to change: this row
        // is refused. The comparisons are voted on at the first barrier,
        // which also orders the clears before the inserts.
        bool named = false;
        const bool wide = p.flags & KVT_SWAP_REQ_INDICES_I64;
        for (uint32_t e = tid(); e < blockIdx.x; e += nthreads) named |= load_index(p.req_pool_indices, e, wide) == rid;
        if (long_row) {
            s.hash().clear(tid(), nthreads);
            unsigned* pos_words = reinterpret_cast<unsigned*>(s.e_pos());
            for (uint32_t w = tid(); w < (p.entries + 1) / 2; w += nthreads) pos_words[w] = 0xffffffffu;
            for (uint32_t w = tid(); w < (p.hot + 31) / 32; w += nthreads) s.bitmap()[w] = 0;
            if (tid() == 0) s.duplicates()[0] = 0;
        }
        if (tid() == 0) *s.request() = rid;
        if (__syncthreads_or(named)) {
            row.refuse(KVT_ERR_SWAP_DUP_REQ, rid);
            return;
        }
    }
    if (seq < 0 || seq > (int64_t)p.max_tokens) {
        row.refuse(KVT_ERR_SWAP_SEQ_LEN, seq);
        return;
    }
    if (!long_row) {
        short_row(p, row, RequestRows(p, blockIdx.x, rq.rid()), seq);
        return;
    }

    // Long sequence. The LRU order is checked to be a permutation and
    // inverted; the query's tokens of the LRU part go into the hash table.
    bool lru_bad = false;
    batched<2>(
        tid(), p.hot, nthreads, [&](uint32_t pos) { return ld(rq.lru() + pos); },
        [&](uint32_t pos, int16_t slot) {
            bool ok = slot >= 0 && (uint32_t)slot < p.hot;
            if (ok) {
                const uint32_t bit = 1u << (slot & 31);
                ok = (atomicOr(&s.bitmap()[slot >> 5], bit) & bit) == 0;
            }
            lru_bad |= !ok;
            s.lru_old()[pos] = ok ? (uint16_t)slot : 0;
            if (ok) s.pos_of()[slot] = (uint16_t)pos;
        });
    {
        auto insert = [&](uint32_t i, const QueryEntry& q) {
            const int64_t t = classify(p, Reporter(p), rq.topk(), blockIdx.x << 16, seq, i, q);
            const int32_t tok = t == -1 ? kPad : t < 0 ? kBad : t == seq - 1 ? kNewest : (int32_t)t;
            s.e_tok()[i] = tok;
            if (tok >= 0 && s.hash().insert(tok, i)) s.duplicates()[0] = 1;
        };
        // One loop per query kind: in a shared one the compiler computes a
        // block query's division for every entry of a token query too.
        if (p.flags & KVT_SWAP_QUERY_BLOCKS)
            batched<2>(tid(), p.entries, nthreads, [&](uint32_t i) { return query_entry(p, rq.topk(), i); }, insert);
        else
            batched<2>(
                tid(), p.entries, nthreads, [&](uint32_t i) { return ld(rq.topk() + i); },
                [&](uint32_t i, int32_t t) { insert(i, QueryEntry{t, t < -1}); });
    }
    if (__syncthreads_or(lru_bad)) {  // lru_slots is not a permutation of [0, hot)
        row.refuse(KVT_ERR_SWAP_LRU, 0);
        return;
    }

    // Slots in slot order (coalesced): a slot whose token is in the query is
    // a hit (the lowest LRU position wins for a token in two slots); the
    // others are evictable, usable when their device row is in range. Each
    // slot's flags go to its LRU position.
    batched<2>(
        tid(), p.hot, nthreads, [&](uint32_t slot) { return SlotRow{ld(rq.btok() + slot), ld(rq.bloc() + slot)}; },
        [&](uint32_t slot, const SlotRow& r) {
            const uint16_t pos = s.pos_of()[slot];
            const int32_t e = r.token >= 0 ? s.hash().find(r.token) : -1;
            uint16_t flags;
            if (e >= 0) {
                flags = kHit;
                atomic_min16(&s.e_pos()[e], pos);
            } else {
                const bool usable = in_rows(r.loc, p.device_rows);
                if (!usable) report(Reporter(p), KVT_ERR_SWAP_SLOT_LOC, (blockIdx.x << 16) | slot, r.loc);
                flags = usable ? kUsable : 0;
            }
            s.lru_old()[pos] = (uint16_t)slot | flags;
        });
    __syncthreads();

    // A duplicate entry is marked with its canonical one (after this the hash
    // table is done with: its space holds the entries' rows below).
    if (s.duplicates()[0] != 0) {
        for (uint32_t i = tid(); i < p.entries; i += nthreads) {
            const int32_t tok = s.e_tok()[i];
            if (tok < 0) continue;
            const int32_t c = s.hash().find(tok);
            if (c != (int32_t)i) s.e_tok()[i] = kDupOf - c;
        }
    }
    // Per warp, in LRU order: hits, evictables, usable evictables.
    {
        const Chunks pc(p.hot, warp());
        uint32_t n_hit = 0, n_usable = 0, n_valid = 0;
        for (uint32_t c = pc.first; c < pc.end; ++c) {
            const uint32_t pos = c * KVT_WARP + lane();
            const uint16_t f = pos < p.hot ? s.lru_old()[pos] : 0;
            n_valid += __popc(warp_ballot(pos < p.hot));
            n_hit += __popc(warp_ballot(pos < p.hot && (f & kHit)));
            n_usable += __popc(warp_ballot(pos < p.hot && (f & kUsable)));
        }
        if (lane() == 0) {
            s.slot_totals()[warp() * 3 + 0] = n_hit;
            s.slot_totals()[warp() * 3 + 1] = n_valid - n_hit;
            s.slot_totals()[warp() * 3 + 2] = n_usable;
        }
    }
    __syncthreads();

    // The first E usable evictables, in LRU order: the m-th miss takes the m-th.
    {
        const Chunks pc(p.hot, warp());
        uint32_t u = warp_offset(s.slot_totals() + 2, 3, warp(), lane()).before;
        for (uint32_t c = pc.first; c < pc.end; ++c) {
            const uint32_t pos = c * KVT_WARP + lane();
            const uint16_t f = pos < p.hot ? s.lru_old()[pos] : 0;
            const bool usable = pos < p.hot && (f & kUsable);
            const uint32_t votes = warp_ballot(usable);
            const uint32_t r = u + __popc(votes & lanes_below(lane()));
            if (usable && r < p.entries) s.usable_slot()[r] = f & kSlotMask;
            u += __popc(votes);
        }
    }

    // Entries: the newest token and hits output their device rows; the
    // other tokens are misses when their host row is in range. Every row an
    // entry needs is loaded before any output is stored (a store between two
    // loads would hold the second behind the first's round trip). A lane
    // keeps its entries' misses in `miss_bits` (bit k for chunk first + k),
    // their host rows in entry_row; duplicates, marked in e_tok, take their
    // canonical entry's output at the end.
    const Chunks ec(p.entries, warp());
    int64_t row_of[kMaxEntryChunks];
    uint32_t hit_bits = 0, cand_bits = 0;
#pragma unroll
    for (uint32_t k = 0; k < kMaxEntryChunks; ++k) {
        row_of[k] = -1;
        const uint32_t i = (ec.first + k) * KVT_WARP + lane();
        if (ec.first + k >= ec.end || i >= p.entries) continue;
        const int32_t tok = s.e_tok()[i];
        if (tok == kNewest || (tok >= 0 && s.e_pos()[i] != kNone16)) {
            // The newest token's reserved slot, or the hit's slot.
            const uint32_t slot = tok == kNewest ? p.hot : (s.lru_old()[s.e_pos()[i]] & kSlotMask);
            row_of[k] = ld(rq.bloc() + slot);
            hit_bits |= 1u << k;
        } else if (tok >= 0) {
            row_of[k] = ld(rq.hloc() + tok);
            cand_bits |= 1u << k;
        }
    }
    // A row out of range is reported after the loop (`bad_bits`), from
    // entry_row: a call inside it would hold its registers across the call.
    uint32_t miss_bits = 0, bad_bits = 0;
    {
        uint32_t n_miss = 0;
#pragma unroll
        for (uint32_t k = 0; k < kMaxEntryChunks; ++k) {
            if (ec.first + k >= ec.end) break;  // warp-uniform
            const uint32_t i = (ec.first + k) * KVT_WARP + lane();
            bool miss = false;
            if (i < p.entries && s.e_tok()[i] > kDupOf) {
                int32_t o = -1;
                bool bad = false;
                if ((hit_bits >> k) & 1u) {
                    bad = !in_rows(row_of[k], p.device_rows);
                    if (!bad) o = (int32_t)row_of[k];
                } else if ((cand_bits >> k) & 1u) {
                    miss = in_rows(row_of[k], p.host_rows);
                    bad = !miss;
                }
                s.entry_row()[i] = row_of[k];  // a miss's output waits for its slot
                if (!miss) {
                    st(rq.out() + i, o);
                    if (s.duplicates()[0] != 0) s.e_tok()[i] = o;  // for its duplicates
                }
                bad_bits |= (uint32_t)bad << k;
            }
            miss_bits |= (uint32_t)miss << k;
            n_miss += __popc(warp_ballot(miss));
        }
        if (lane() == 0) s.miss_totals()[warp()] = n_miss;
    }
#pragma unroll 1
    for (uint32_t k = 0; bad_bits >> k; ++k) {
        if (!((bad_bits >> k) & 1u)) continue;
        const uint32_t i = (ec.first + k) * KVT_WARP + lane();
        report(Reporter(p), (hit_bits >> k) & 1u ? KVT_ERR_SWAP_DEVICE_LOC : KVT_ERR_SWAP_HOST_LOC,
               (blockIdx.x << 16) | i, s.entry_row()[i]);
    }
    __syncthreads();
    // Recomputed where used (from the per-warp totals; every lane votes)
    // rather than held through the phases below.
    auto loads = [&] {
        return min(warp_offset(s.miss_totals(), 1, warp(), lane()).total,
                   warp_offset(s.slot_totals() + 2, 3, warp(), lane()).total);
    };
    auto copies_few = [&](uint32_t n_load) {
        return !(p.flags & (KVT_SWAP_COPY_IN_PLAN | KVT_SWAP_SKIP_IO)) && n_load <= KVT_SWAP_FEW_MISS_INLINE;
    };

    // The m-th miss (query order) takes the m-th usable evictable slot; the
    // rest have no slot (reported).
    {
        const uint32_t n_load = loads();
        const bool copy_few = copies_few(n_load);
        uint32_t r = warp_offset(s.miss_totals(), 1, warp(), lane()).before;
#pragma unroll
        for (uint32_t k = 0; k < kMaxEntryChunks; ++k) {
            if (ec.first + k >= ec.end) break;  // warp-uniform
            const uint32_t i = (ec.first + k) * KVT_WARP + lane();
            const bool miss = (miss_bits >> k) & 1u;
            const uint32_t votes = warp_ballot(miss);
            const uint32_t m = r + __popc(votes & lanes_below(lane()));
            r += __popc(votes);
            if (!miss) continue;
            int32_t o = -1;
            if (m < n_load) {
                const uint16_t slot = s.usable_slot()[m];
                o = ld(rq.bloc() + slot);
                st(rq.btok() + slot, s.e_tok()[i]);
                const int64_t src = s.entry_row()[i];
                st(rq.plan_src() + m, src);
                st(rq.plan_dst() + m, o);
                if (copy_few) {
                    s.copy_src()[m] = src;
                    s.copy_dst()[m] = o;
                }
            } else {
                report(Reporter(p), KVT_ERR_SWAP_DEVICE_LOC, (blockIdx.x << 16) | i, -1);
            }
            st(rq.out() + i, o);
            if (s.duplicates()[0] != 0) s.e_tok()[i] = o;  // for its duplicates
        }
    }
    {
        const uint32_t n_hits = warp_offset(s.slot_totals(), 3, warp(), lane()).total;  // every lane votes
        const uint32_t n_load = loads();
        if (tid() == 0) {
            st(row.plan_count + blockIdx.x, (int32_t)n_load);
            // Misses to copy; work items of one row (pieces of each plane:
            // the value's 512-byte passes, then the scale, if any); pieces.
            const uint32_t pieces = row_passes(p.items) + (p.items.scale_bytes != 0 ? 1 : 0);
            s.copy_work()[0] = (int32_t)n_load;
            s.copy_work()[1] = (int32_t)(pieces * (p.host_cache[1] != 0 ? 2 : 1));
            s.copy_work()[2] = (int32_t)pieces;
            count_row(p, n_hits, n_load);
        }
    }

    // New LRU order: unused evictables (old order), the slots just loaded
    // (miss order), the hits (old order).
    {
        const uint32_t n_load = loads();
        const Chunks pc(p.hot, warp());
        const WarpOffset hits = warp_offset(s.slot_totals() + 0, 3, warp(), lane());
        const WarpOffset evictables = warp_offset(s.slot_totals() + 1, 3, warp(), lane());
        uint32_t hit_r = hits.before, evict_r = evictables.before;
        uint32_t usable_r = warp_offset(s.slot_totals() + 2, 3, warp(), lane()).before;
        const uint32_t below = lanes_below(lane());
        for (uint32_t c = pc.first; c < pc.end; ++c) {
            const uint32_t pos = c * KVT_WARP + lane();
            const bool valid = pos < p.hot;
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
            st(rq.lru() + to, (int16_t)(f & kSlotMask));
        }
    }

    __syncthreads();  // canonical outputs, the plan and the copy list, for other threads
    if (s.duplicates()[0] != 0) {
        for (uint32_t i = tid(); i < p.entries; i += nthreads) {
            const int32_t tok = s.e_tok()[i];
            if (tok <= kDupOf) st(rq.out() + i, s.e_tok()[kDupOf - tok]);
        }
    }
    if (p.flags & KVT_SWAP_SKIP_IO) return;
    const uint32_t n_load = loads();
    const bool copy_few = copies_few(n_load);
    const bool copy_all = p.flags & KVT_SWAP_COPY_IN_PLAN;
    // Without KVT_SWAP_COPY_IN_PLAN the copy kernel follows, for rows of
    // more misses; it waits for this grid to complete before it reads the plan.
    if (!copy_all) allow_dependents();
    if (!copy_all && !copy_few) return;
    // One copy loop for both lists, of work items of one piece of one plane
    // of one row: a pass of one 16-byte vector a lane over its value piece,
    // or its scale piece (warp_copy_item_piece). A row of more than 512
    // bytes, with a scale piece, or of two planes is shared by several warps,
    // so that a few misses still cost one round trip. (Two inlined copies,
    // two vectors a lane, or a whole row in one item would not fit the
    // registers two blocks an SM leave.)
    // Every row is checked again before it is followed: the plan may be the
    // caller's memory (a recorded miss plan), which another stream could
    // change. A bad one is skipped, and reported after the loop (a call
    // inside it would hold the loop's registers across the call).
    // The flag, and every count of the work (copy_work), are read again
    // where used rather than held through the loop.
    auto row_at = [&](uint32_t m) -> int64_t {
        return (p.flags & KVT_SWAP_COPY_IN_PLAN) ? ld(rq.plan_src() + m) : s.copy_src()[m];
    };
    auto loc_at = [&](uint32_t m) -> int32_t {
        return (p.flags & KVT_SWAP_COPY_IN_PLAN) ? ld(rq.plan_dst() + m) : s.copy_dst()[m];
    };
    auto work_items = [&] { return (uint32_t)s.copy_work()[0] * (uint32_t)s.copy_work()[1]; };
    bool skipped = false;
    for (uint32_t g = warp(); g < work_items(); g += kWarps) {
        const uint32_t per_row = s.copy_work()[1], pieces = s.copy_work()[2];
        const uint32_t m = g / per_row, item = g - m * per_row, plane = item / pieces;
        const int64_t src = row_at(m);
        const int32_t dst = loc_at(m);
        if (!in_rows(src, p.host_rows) || !in_rows(dst, p.device_rows)) {
            skipped = true;
            continue;
        }
        warp_copy_item_piece<PoolToDevice>(p.items, plane ? p.host_cache[1] : p.host_cache[0],
                                           plane ? p.device_buffer[1] : p.device_buffer[0], (uint64_t)src,
                                           (uint64_t)dst, lane(), item - plane * pieces, row_passes(p.items));
    }
    if (skipped && lane() == 0) {
        for (uint32_t g = warp(); g < work_items(); g += kWarps) {
            const uint32_t per_row = s.copy_work()[1];
            const uint32_t m = g / per_row;
            const int64_t src = row_at(m);
            const int32_t dst = loc_at(m);
            const bool src_ok = in_rows(src, p.host_rows);
            if (g == m * per_row && !(src_ok && in_rows(dst, p.device_rows)))
                report(Reporter(p), src_ok ? KVT_ERR_SWAP_DEVICE_LOC : KVT_ERR_SWAP_HOST_LOC, (blockIdx.x << 16) | m,
                       src_ok ? dst : src);
        }
    }
}
