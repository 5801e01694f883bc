// kernels/swap_in_split.cu — the split planner: the contract of
// kvt_swap_in_plan (abi.h; semantics in src/swap_in/mod.rs) planned for one
// batch row by a thread-block cluster, each block taking a share of the
// row's LRU positions and query entries, and copying its own share of the
// misses (one launch, no copy kernel).
//
// Why: with a few misses a row, the few-miss planner's one block of 1024
// threads spends its time issuing instructions (Nsight Compute on an H100,
// bench/results/h100-2026-11-27/profile-planners: 66.5k warp instructions
// for one row of K 2048 over HOT 4096, no source line above 10 %), and at
// batch 1 to 16 the rest of the GPU idles: on the H200 of 2026-11-28 it was
// 0.91-1.26x SGLang's kernel there, where the issue asks for 1.5x. Most of
// those instructions are per LRU position (the lookups, the evictable ranks,
// the new LRU order) and per query entry (outputs, misses): a cluster of
// KVT_SWAP_CLUSTER blocks does each share on its own SM. What every block
// does whole: the row's checks, loading the slots' tokens and rows, and the
// query's hash table (the lookups of its LRU positions need every entry).
// What crosses blocks, through distributed shared memory: the LRU
// permutation check (a slot's bit lives in one block), a hit's lowest LRU
// position (kept at the entry's block), each block's counts (the prefix of
// every rank), and the m-th usable evictable slot (read by the block of the
// m-th miss from the block that ranked it). Three cluster barriers before
// the first host read (four when the query names a token twice), where the
// few-miss planner has four block barriers.
#include "swap_in.cuh"

namespace kvt {
namespace swap {
namespace split {

constexpr uint32_t kThreads = KVT_SWAP_FEW_MISS_THREADS;
constexpr uint32_t kWarps = kThreads / KVT_WARP;
static_assert(kWarps <= KVT_WARP, "a warp scans one total per warp of the block");
constexpr uint32_t kSpread = 4;  // hash cells per entry, at least: as the few-miss planner
// The counts each block sends every block of its cluster, at [rank * kXchg].
enum : uint32_t { kXHits, kXEvict, kXUsable, kXBad, kXMiss, kXchg };

// A block's shared memory, carved from kvt_dynamic_smem; the host computes
// the same size (split_smem_bytes in src/swap_in/cuda.rs). Every block of a
// cluster has the same carve-up, so an array sits at the same offset in
// each (kvt::cluster_map).
struct Smem {
    uint32_t E, H, hs;

    __device__ __forceinline__ Smem(uint32_t entries, uint32_t hot)
        : E(entries), H(hot), hs(hash_size(entries, kSpread)) {}
    // [H] token per slot, [H + 4] device row per slot, the reserved slot at
    // H (both 16-byte aligned when H % 4 == 0)
    __device__ __forceinline__ int32_t* slot_tok() const { return reinterpret_cast<int32_t*>(kvt_dynamic_smem); }
    __device__ __forceinline__ int32_t* slot_loc() const { return slot_tok() + H; }
    // [E] host row and device row of this block's misses, for its copy
    __device__ __forceinline__ int64_t* copy_src() const {
        return reinterpret_cast<int64_t*>(slot_loc() + H + 4);
    }
    __device__ __forceinline__ int32_t* copy_dst() const { return reinterpret_cast<int32_t*>(copy_src() + E); }
    // [KVT_SWAP_CLUSTER * kXchg] the cluster's blocks' counts, by rank
    __device__ __forceinline__ uint32_t* xchg() const { return reinterpret_cast<uint32_t*>(copy_dst() + E); }
    // [kWarps * 3] per warp: hits, evictables, usable evictables; [kWarps] misses
    __device__ __forceinline__ uint32_t* slot_totals() const { return xchg() + KVT_SWAP_CLUSTER * kXchg; }
    __device__ __forceinline__ uint32_t* miss_totals() const { return slot_totals() + 3 * kWarps; }
    // [4]: [0] set when the query names a token twice
    __device__ __forceinline__ int32_t* duplicates() const {
        return reinterpret_cast<int32_t*>(miss_totals() + kWarps);
    }
    // [hs] each: the query's hash table (every block holds all of it)
    __device__ __forceinline__ int32_t* hash_keys() const { return duplicates() + 4; }
    __device__ __forceinline__ int32_t* hash_vals() const { return hash_keys() + hs; }
    // [E] the entry's token, or kPad / kBad / kNewest
    __device__ __forceinline__ int32_t* e_tok() const { return hash_vals() + hs; }
    // [E] of this block's entries: the lowest (LRU position << 14 | slot) of
    // a hit, then the output
    __device__ __forceinline__ int32_t* e_val() const { return e_tok() + E; }
    // [ceil(H / 32)] slots seen in lru_slots: word w in block w % size
    __device__ __forceinline__ uint32_t* bitmap() const { return reinterpret_cast<uint32_t*>(e_val() + E); }
    // [H] of this block's LRU positions: the slot, with kHit / kUsable; [E]
    // this block's usable evictable slots of rank below E, from its first
    __device__ __forceinline__ uint16_t* lru_old() const {
        return reinterpret_cast<uint16_t*>(bitmap() + (H + 31) / 32);
    }
    __device__ __forceinline__ uint16_t* usable_slot() const { return lru_old() + H; }
};

// A row's `count` items in chunks of 32: block `rank` of a cluster of `size`
// owns a contiguous run of chunks, and its warps split that run as
// WarpChunks does a block's.
// (Only the warp's run is held: the block's run and an item's block are
// recomputed where used, from values the block reads again cheaply, since
// registers held across the whole planner spilled.)
__device__ __forceinline__ uint32_t chunks_a_block(uint32_t count, uint32_t size) {
    return ((count + KVT_WARP - 1) / KVT_WARP + size - 1) / size;
}
// This block's items [first, end).
struct BlockItems {
    uint32_t first, end;
    __device__ __forceinline__ BlockItems(uint32_t count, uint32_t rank, uint32_t size) {
        const uint32_t chunks = (count + KVT_WARP - 1) / KVT_WARP, per = chunks_a_block(count, size);
        const uint32_t bf = min(rank * per, chunks);
        first = bf * KVT_WARP;
        end = min(min(bf + per, chunks) * KVT_WARP, count);
    }
};
// The block that owns item i of `count`.
__device__ __forceinline__ uint32_t owner_of(uint32_t i, uint32_t count, uint32_t size) {
    return i / KVT_WARP / chunks_a_block(count, size);
}
struct SplitChunks {
    uint32_t first, end;  // this warp's chunks
    __device__ __forceinline__ SplitChunks(uint32_t count, uint32_t rank, uint32_t size, uint32_t warp) {
        const uint32_t chunks = (count + KVT_WARP - 1) / KVT_WARP, per_block = chunks_a_block(count, size);
        const uint32_t bf = min(rank * per_block, chunks), be = min(bf + per_block, chunks);
        const uint32_t per = (be - bf + kWarps - 1) / kWarps;
        first = bf + min(warp * per, be - bf);
        end = min(first + per, be);
    }
};

// The cluster's counts of kind k: the sum over the blocks below `rank`, and
// over all.
struct ClusterCount {
    uint32_t before, total;
};
__device__ __forceinline__ ClusterCount cluster_count(const uint32_t* xchg, uint32_t k, uint32_t rank,
                                                      uint32_t size) {
    uint32_t before = 0, total = 0;
    for (uint32_t q = 0; q < size; ++q) {
        const uint32_t v = xchg[q * kXchg + k];
        before += q < rank ? v : 0;
        total += v;
    }
    return {before, total};
}

// Sends this block's count of kind k (`v`) to every block of the cluster
// (lanes below `size` of one warp).
__device__ __forceinline__ void send_count(const Smem& s, uint32_t k, uint32_t v, uint32_t rank, uint32_t size,
                                           uint32_t lane) {
    if (lane < size) cluster_map(s.xchg(), lane)[rank * kXchg + k] = v;
}

// kSize: blocks a row, a constant of the build (KVT_SWAP_CLUSTER; the
// kernel emulator's race detector, which tracks at most 8128 threads, also
// builds 2), so that a block's share of the row, an item's block and the
// sums of the exchanged counts fold into the code, and a warp holds one
// chunk of entries (with the cluster's size read at run time, registers
// held across the planner spilled 188 bytes a thread on sm_90).
template <uint32_t kSize>
__device__ __forceinline__ void plan(const kvt_swap_in_params& p) {
    using Chunks = SplitChunks;
    // Chunks of 32 entries a warp owns at most.
    constexpr uint32_t kChunks = ((KVT_SWAP_MAX_TOP_K / KVT_WARP + kSize - 1) / kSize + kWarps - 1) / kWarps;
    const uint32_t tid = threadIdx.x;
    const uint32_t warp = tid / KVT_WARP, lane = tid % KVT_WARP, below = lanes_below(lane);
    constexpr uint32_t size = kSize;
    const uint32_t rank = cluster_rank(), b = cluster_id();
    // Rank 0 writes what a row writes once: a padding, refused or short
    // row's outputs, the plan count, the counters.
    const bool lead = rank == 0;
    const uint32_t E = p.entries, H = p.hot;
    // The row's output and plan pointers (PlanRow) are built where they are
    // used: held from here to the end they spilled 88 bytes a thread on sm_90.
    const Reporter err(p);
    const uint32_t row_pos = b << 16;  // PlanRow::pos
    // The launcher's clusters (src/swap_in/cuda.rs): any other size would
    // leave entries unresolved.
    if (cluster_size() != kSize) return;

    // Every block of the row takes the same branches up to the long row's
    // state: each reads the same inputs, and only rank 0 writes.
    const int64_t rid = load_index(p.req_pool_indices, b, p.flags & KVT_SWAP_REQ_INDICES_I64);
    const int64_t seq = load_index(p.seq_lens, b, p.flags & KVT_SWAP_SEQ_LENS_I64);
    const uint32_t real = real_rows(p, err, true);
    count_call(p, real);
    if (b >= real) {  // padding: outputs -1, state and plan row untouched
        if (lead) PlanRow(p, b).pad();
        return;
    }
    if (rid < 0 || rid >= (int64_t)p.num_requests) {
        if (lead) PlanRow(p, b).refuse(KVT_ERR_SWAP_REQ, rid);
        return;
    }

    const Smem s(E, H);
    const TokenHash hash{s.hash_keys(), s.hash_vals(), s.hs - 1};
    const bool long_row = seq > (int64_t)H && seq <= (int64_t)p.max_tokens;
    bool named = false;  // an earlier row names the request: that row's to change
    {
        const bool wide = p.flags & KVT_SWAP_REQ_INDICES_I64;
        for (uint32_t e = tid; e < b; e += kThreads) named |= load_index(p.req_pool_indices, e, wide) == rid;
    }
    if (long_row) {
        hash.clear(tid, kThreads);
        for (uint32_t w = tid; w < (H + 31) / 32; w += kThreads) s.bitmap()[w] = 0;
        if (tid == 0) s.duplicates()[0] = 0;
    }
    if (__syncthreads_or(named)) {
        if (lead) PlanRow(p, b).refuse(KVT_ERR_SWAP_DUP_REQ, rid);
        return;
    }
    if (seq < 0 || seq > (int64_t)p.max_tokens) {
        if (lead) PlanRow(p, b).refuse(KVT_ERR_SWAP_SEQ_LEN, seq);
        return;
    }
    const RequestRows rq(p, b, rid);
    if (!long_row) {
        if (lead) short_row(p, PlanRow(p, b), rq, seq);
        return;
    }

    // Long sequence. Every block loads every slot's token and row and the
    // whole query (hashing its tokens), and its own LRU positions; it
    // reports only its own entries' bad tokens.
    const int32_t newest = (int32_t)(seq - 1);
    const Chunks pc(H, rank, size, warp), ec(E, rank, size, warp);
    constexpr uint32_t kLoads = 4;
    const BlockItems my_entries(E, rank, size);
    auto insert = [&](uint32_t i, const QueryEntry& q) {
        const bool mine = i >= my_entries.first && i < my_entries.end;
        const int64_t t = classify(p, err, rq.topk, row_pos, seq, i, q, mine);
        const int32_t tok = t == -1 ? kPad : t < 0 ? kBad : t == newest ? kNewest : (int32_t)t;
        s.e_tok()[i] = tok;
        s.e_val()[i] = kNone;
        if (tok >= 0 && hash.insert(tok, (int32_t)i)) s.duplicates()[0] = 1;
    };
    if (H % 4 == 0 && aligned16(rq.btok) && aligned16(rq.bloc)) {
        batched<2>(
            tid, H / 4, kThreads,
            [&](uint32_t q) { return SlotRow4{ld(as_vec(rq.btok) + q), ld(as_vec(rq.bloc) + q)}; },
            [&](uint32_t q, const SlotRow4& r) {
                as_vec(s.slot_tok())[q] = r.tokens;
                as_vec(s.slot_loc())[q] = r.locs;
            });
    } else {
        batched<kLoads>(
            tid, H, kThreads, [&](uint32_t slot) { return SlotRow{ld(rq.btok + slot), ld(rq.bloc + slot)}; },
            [&](uint32_t slot, const SlotRow& r) {
                s.slot_tok()[slot] = r.token;
                s.slot_loc()[slot] = r.loc;
            });
    }
    if (tid == 0) s.slot_loc()[H] = ld(rq.bloc + H);
    // This block's LRU positions, as read (a bad slot is >= H as uint16_t:
    // H <= KVT_SWAP_MAX_HOT < 0x8000).
    {
        const BlockItems my_pos(H, rank, size);
        batched<kLoads>(
            my_pos.first + tid, my_pos.end, kThreads, [&](uint32_t pos) { return ld(rq.lru + pos); },
            [&](uint32_t pos, int16_t slot) { s.lru_old()[pos] = (uint16_t)slot; });
    }
    if (p.flags & KVT_SWAP_QUERY_BLOCKS)
        batched<kLoads>(tid, E, kThreads, [&](uint32_t i) { return query_entry(p, rq.topk, i); }, insert);
    else
        batched<kLoads>(tid, E, kThreads, [&](uint32_t i) { return token_entry(rq.topk, i); }, insert);
    // Every block's table, entry values and slot bits are set before any
    // block looks up, lowers an entry's value or sets a slot's bit.
    cluster_sync();

    // This block's LRU positions: each slot once (its bit, in the block of
    // its bitmap word); a hit lowers its entry's value in the entry's block;
    // the others are evictable, usable when their device row is in range.
    bool lru_bad = false;
    {
        uint32_t n_hit = 0, n_evict = 0, n_usable = 0;
        for (uint32_t c = pc.first; c < pc.end; ++c) {
            const uint32_t pos = c * KVT_WARP + lane;
            bool hit = false, evict = false, usable = false;
            if (pos < H) {
                const uint16_t slot = s.lru_old()[pos];
                bool ok = slot < H;
                if (ok) {
                    const uint32_t word = slot >> 5, bit = 1u << (slot & 31);
                    ok = (atomicOr(cluster_map(s.bitmap() + word, word % size), bit) & bit) == 0;
                }
                if (ok) {
                    const int32_t token = s.slot_tok()[slot];
                    const int32_t e = token >= 0 ? hash.find(token) : -1;
                    if (e >= 0) {
                        hit = true;
                        atomicMin(cluster_map(s.e_val() + e, owner_of((uint32_t)e, E, size)),
                                  (int32_t)(pos << 14 | slot));
                    } else {
                        evict = true;
                        usable = in_rows(s.slot_loc()[slot], p.device_rows);
                    }
                }
                lru_bad |= !ok;
                s.lru_old()[pos] = (ok ? slot : 0) | (hit ? kHit : 0) | (usable ? kUsable : 0);
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
    const bool block_bad = __syncthreads_or(lru_bad);
    const WarpOffset hits = warp_offset(s.slot_totals() + 0, 3, warp, lane, kWarps);
    const WarpOffset evictables = warp_offset(s.slot_totals() + 1, 3, warp, lane, kWarps);
    const WarpOffset usables = warp_offset(s.slot_totals() + 2, 3, warp, lane, kWarps);
    if (warp == 0) {
        send_count(s, kXHits, hits.total, rank, size, lane);
        send_count(s, kXEvict, evictables.total, rank, size, lane);
        send_count(s, kXUsable, usables.total, rank, size, lane);
        send_count(s, kXBad, block_bad, rank, size, lane);
    }
    // Every block's counts, slot bits and hits' values are in place.
    cluster_sync();
    if (cluster_count(s.xchg(), kXBad, rank, size).total != 0) {  // lru_slots is not a permutation of [0, hot)
        if (lead) PlanRow(p, b).refuse(KVT_ERR_SWAP_LRU, 0);
        return;
    }
    // This warp's first ranks in the row: of its hits, evictables and
    // usable evictables.
    const uint32_t hit_base = cluster_count(s.xchg(), kXHits, rank, size).before + hits.before;
    const uint32_t evict_base = cluster_count(s.xchg(), kXEvict, rank, size).before + evictables.before;
    const uint32_t usable_block = cluster_count(s.xchg(), kXUsable, rank, size).before;
    const uint32_t usable_base = usable_block + usables.before;
    {  // This block's usable evictables of row rank below E, in LRU order.
        uint32_t u = usable_base;
        for (uint32_t c = pc.first; c < pc.end; ++c) {
            const uint32_t pos = c * KVT_WARP + lane;
            const uint16_t f = pos < H ? s.lru_old()[pos] : 0;
            const bool usable = pos < H && (f & kUsable);
            if (pos < H && !(f & (kHit | kUsable))) {
                const uint32_t slot = f & kSlotMask;
                report(err, KVT_ERR_SWAP_SLOT_LOC, row_pos | slot, s.slot_loc()[slot]);
            }
            const uint32_t votes = warp_ballot(usable);
            const uint32_t r = u + __popc(votes & below);
            if (usable && r < E) s.usable_slot()[r - usable_block] = f & kSlotMask;
            u += __popc(votes);
        }
    }

    // This block's entries, as the few-miss planner resolves a row's: the
    // newest token and hits output their device rows; the other tokens are
    // misses when their host row is in range.
    const bool dups = s.duplicates()[0] != 0;
    auto canonical = [&](int32_t tok, uint32_t i) { return !dups || hash.find(tok) == (int32_t)i; };
    int64_t host_row[kChunks];
    uint32_t miss_bits = 0, dup_bits = 0, n_miss = 0;
#pragma unroll
    for (uint32_t k = 0; k < kChunks; ++k) {  // the misses' host rows, loaded together
        const uint32_t i = (ec.first + k) * KVT_WARP + lane;
        host_row[k] = -1;
        if (ec.first + k < ec.end && i < E) {
            const int32_t tok = s.e_tok()[i];
            if (tok >= 0 && s.e_val()[i] == kNone && canonical(tok, i)) host_row[k] = ld(rq.hloc + tok);
        }
    }
#pragma unroll
    for (uint32_t k = 0; k < kChunks; ++k) {
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
                const int32_t loc = s.slot_loc()[s.e_val()[i] & kSlotMask];
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
    if (warp == 0) send_count(s, kXMiss, misses.total, rank, size, lane);
    // Every block's miss count and usable slots are in place.
    cluster_sync();
    const ClusterCount row_miss = cluster_count(s.xchg(), kXMiss, rank, size);
    const uint32_t n_load = min(row_miss.total, cluster_count(s.xchg(), kXUsable, rank, size).total);
    const bool skip_io = p.flags & KVT_SWAP_SKIP_IO;

    const PlanRow row(p, b);
    // The m-th miss (query order) takes the m-th usable evictable slot, read
    // from the block that ranked it; the rest have no slot (reported).
    // Outputs of all but duplicates.
    {
        uint32_t r = row_miss.before + misses.before;
#pragma unroll
        for (uint32_t k = 0; k < kChunks; ++k) {
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
                    uint32_t owner = 0, owner_before = 0, seen = 0;
                    for (uint32_t q = 0; q < size; ++q) {
                        const uint32_t n = s.xchg()[q * kXchg + kXUsable];
                        if (m >= seen && m < seen + n) {
                            owner = q;
                            owner_before = seen;
                        }
                        seen += n;
                    }
                    const uint16_t slot = *cluster_map(s.usable_slot() + (m - owner_before), owner);
                    o = s.slot_loc()[slot];
                    st(rq.btok + slot, s.e_tok()[i]);
                    st(row.plan_src + m, host_row[k]);
                    st(row.plan_dst + m, o);
                    if (!skip_io) {
                        s.copy_src()[m - row_miss.before] = host_row[k];
                        s.copy_dst()[m - row_miss.before] = o;
                    }
                } else {
                    report(err, KVT_ERR_SWAP_DEVICE_LOC, row_pos | i, -1);
                }
                s.e_val()[i] = o;
            }
            st(row.out + i, o);
        }
    }
    if (lead && tid == 0) {
        st(row.plan_count + b, (int32_t)n_load);
        count_row(p, cluster_count(s.xchg(), kXHits, rank, size).total, n_load);
    }

    // New LRU order of this block's positions: unused evictables (old
    // order), the slots just loaded (miss order), the hits (old order).
    {
        const uint32_t evict_total = cluster_count(s.xchg(), kXEvict, rank, size).total;
        uint32_t hit_r = hit_base, evict_r = evict_base, usable_r = usable_base;
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
                to = evict_total + hr;
            else if (usable && ur < n_load)
                to = evict_total - n_load + ur;
            else
                to = er - min(ur, n_load);
            st(rq.lru + to, (int16_t)(f & kSlotMask));
        }
    }

    if (dups) {  // the same in every block: each hashed the whole query
        // Every block's canonical outputs are in place.
        cluster_sync();
#pragma unroll
        for (uint32_t k = 0; k < kChunks; ++k) {
            if (!((dup_bits >> k) & 1u)) continue;
            const uint32_t i = (ec.first + k) * KVT_WARP + lane;
            const uint32_t c = (uint32_t)hash.find(s.e_tok()[i]);
            st(row.out + i, *cluster_map(s.e_val() + c, owner_of(c, E, size)));
        }
    }
    __syncthreads();  // the copy list, for the block's other warps
    // This block reads no other block's shared memory from here on (the
    // values it read are used, so the reads are complete): a relaxed
    // arrival, which does not wait for its global stores as a release does.
    // It waits for the others' last reads of its own before it exits.
    cluster_arrive_relaxed();
    const uint32_t n_copy = skip_io || n_load <= row_miss.before ? 0 : min(n_load - row_miss.before, misses.total);
    for (uint32_t j = warp; j < n_copy; j += kWarps)
        copy_row<2>(p, err, s.copy_src()[j], s.copy_dst()[j], row_pos | (row_miss.before + j), lane);
    cluster_wait();
}

}  // namespace split
}  // namespace swap
}  // namespace kvt

// kvt_swap_in_split_plan — a thread-block cluster a batch row
// (gridDim.x == batch * cluster size): the same contract, outputs, state,
// plan and error reports as kvt_swap_in_few_miss_plan followed by
// kvt_swap_in_copy, in one launch. Block `rank` of the cluster resolves the
// rank-th share of the row's LRU positions and of its query entries (runs
// of 32, see SplitChunks) and copies the misses among its entries; rank 0
// writes what a row writes once.
// Reads:   as kvt_swap_in_few_miss_plan (every block reads the row's slot
//          tokens and rows, and its query, whole), and the host rows of its
//          misses.
// Writes:  as kvt_swap_in_few_miss_plan, and the device rows of its misses
//          unless KVT_SWAP_SKIP_IO; other blocks' shared memory of the
//          cluster (slot bits, hits' values, counts), read from theirs (the
//          usable slots, a duplicate's canonical output).
// Assumes: a cluster launch (src/cuda/mod.rs CudaDevice::launch_clustered)
//          in clusters of KVT_SWAP_CLUSTER blocks (the kernel does nothing
//          in others) of
//          KVT_SWAP_FEW_MISS_THREADS threads, dynamic shared memory of
//          split_smem_bytes (src/swap_in/cuda.rs), the host-checked shapes
//          (entries <= hot <= KVT_SWAP_MAX_HOT, buffers cover their rows).
extern "C" __global__ void __launch_bounds__(KVT_SWAP_FEW_MISS_THREADS, 1)
    kvt_swap_in_split_plan(const kvt_swap_in_params p) {
    kvt::swap::split::plan<KVT_SWAP_CLUSTER>(p);
}
