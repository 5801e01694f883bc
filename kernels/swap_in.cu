// kernels/swap_in.cu — LRU device-buffer swap-in with page-table update
// (SGLang HiSparse semantics), split into per-request planning and one wide
// copy over every miss of the batch; the same copy kernel replays a caller's
// miss plan on its own (SGLang's copy_cache_planned_mla).
#include "bulk.cuh"
#include "swap_in.cuh"

namespace kvt {
namespace swap {

// The planning block's shared memory, carved from kvt_dynamic_smem. The
// host computes the same size (plan_smem_bytes in src/swap_in/cuda.rs);
// 4-byte arrays first, then the 2-byte ones.
struct PlanSmem {
    int32_t* scalars;       // [4]: [0] = the LRU row is invalid
    uint32_t* scan;         // [3 * threads] block-scan scratch
    int32_t* hash_keys;     // [hash] token
    int32_t* hash_vals;     // [hash] lowest entry index holding the token
    int32_t* e_class;       // [E]
    int32_t* e_val;         // [E] lowest LRU position of a hit, then the output
    uint32_t* bitmap;       // [ceil(hot / 32)] slots seen in lru_slots
    uint16_t* lru_old;      // [hot] slot per LRU position, with flags
    uint16_t* usable_slot;  // [E] the first E usable evictable slots, in LRU order

    __device__ PlanSmem(uint32_t entries, uint32_t hot, uint32_t threads) {
        int32_t* w = reinterpret_cast<int32_t*>(kvt_dynamic_smem);
        const uint32_t hs = hash_size(entries);
        scalars = w;
        w += 4;
        scan = reinterpret_cast<uint32_t*>(w);
        w += 3 * threads;
        hash_keys = w;
        w += hs;
        hash_vals = w;
        w += hs;
        e_class = w;
        w += entries;
        e_val = w;
        w += entries;
        bitmap = reinterpret_cast<uint32_t*>(w);
        w += (hot + 31) / 32;
        lru_old = reinterpret_cast<uint16_t*>(w);
        usable_slot = lru_old + hot;
    }
};

}  // namespace swap
}  // namespace kvt

// kvt_swap_in_plan — one block per batch row (contract: kvt_swap_in_params in
// abi.h; semantics: src/swap_in/mod.rs).
// Reads:   the row's query, req_pool_indices/seq_lens/num_real_reqs, and the
//          request's device_buffer_tokens (LRU slots only),
//          device_buffer_locs, lru_slots and host_cache_locs, each index
//          range-checked first.
// Writes:  top_k_device_locs (all `entries` columns of the row),
//          device_buffer_tokens of the slots that receive misses, the
//          request's lru_slots, the row's plan (plan_src/plan_dst; plan_count
//          for every row below num_real_reqs), the error word, the call's
//          kvt_swap_counters when `counters` is set (atomics); with
//          KVT_SWAP_COPY_IN_PLAN (and not KVT_SWAP_SKIP_IO) also the device
//          rows of its misses.
// Assumes: blockDim.x == KVT_SWAP_PLAN_THREADS, gridDim.x == batch, dynamic
//          shared memory of plan_smem_bytes (src/swap_in/cuda.rs), and the
//          host-checked shapes (entries <= hot <= KVT_SWAP_MAX_HOT, buffers
//          cover their rows).
extern "C" __global__ void __launch_bounds__(KVT_SWAP_PLAN_THREADS, 1)
    kvt_swap_in_plan(const kvt_swap_in_params p) {
    using namespace kvt;
    using namespace kvt::swap;
    const uint32_t b = blockIdx.x;
    const uint32_t tid = threadIdx.x;
    const uint32_t nthreads = blockDim.x;
    const uint32_t E = p.entries;
    const uint32_t H = p.hot;
    const PlanRow row(p, b);
    const Reporter& err = row.err;
    const uint32_t row_pos = row.pos;

    // The row's request and length, and num_real_reqs, are loaded together,
    // before the checks below decide what to do with them (each address is
    // inside its array whatever they find): one memory latency in front of
    // the checks instead of three in a row.
    const int64_t rid = load_index(p.req_pool_indices, b, p.flags & KVT_SWAP_REQ_INDICES_I64);
    const int64_t seq = load_index(p.seq_lens, b, p.flags & KVT_SWAP_SEQ_LENS_I64);
    const uint32_t real = real_rows(p, err, true);
    count_call(p, real);

    // Padding rows: every output -1; the state and the plan row stay as they
    // were (SGLang leaves a padding row's miss_count alone too; the copy
    // kernel reads only rows below num_real_reqs). Block-uniform, so the
    // early returns below are safe.
    if (b >= real) {
        row.pad();
        return;
    }

    if (rid < 0 || rid >= (int64_t)p.num_requests) {
        row.refuse(KVT_ERR_SWAP_REQ, rid);
        return;
    }
    // A request an earlier row names: its state is that row's to change (two
    // blocks on one request's state would race), so this row is refused. The
    // block's threads scan the earlier rows; scalars[3] of the planning
    // shared memory, not yet in use, holds the answer.
    {
        unsigned* named = reinterpret_cast<unsigned*>(kvt_dynamic_smem) + 3;
        if (tid == 0) *named = 0;
        __syncthreads();
        const bool wide = p.flags & KVT_SWAP_REQ_INDICES_I64;
        for (uint32_t e = tid; e < b; e += nthreads)
            if (load_index(p.req_pool_indices, e, wide) == rid) atomicOr(named, 1u);
        __syncthreads();
        const bool duplicate = *named != 0;
        __syncthreads();
        if (duplicate) {
            row.refuse(KVT_ERR_SWAP_DUP_REQ, rid);
            return;
        }
    }
    if (seq < 0 || seq > (int64_t)p.max_tokens) {
        row.refuse(KVT_ERR_SWAP_SEQ_LEN, seq);
        return;
    }

    const RequestRows rq(p, b, rid);

    auto classify = [&](uint32_t i, const QueryEntry& q) { return swap::classify(p, err, rq.topk, row_pos, seq, i, q); };

    if (seq <= (int64_t)H) {
        short_row(p, row, rq, seq);
        return;
    }

    // Long sequence.
    const PlanSmem s(E, H, nthreads);
    const TokenHash hash{s.hash_keys, s.hash_vals, hash_size(E) - 1};
    const int32_t newest = (int32_t)(seq - 1);

    hash.clear(tid, nthreads);
    for (uint32_t i = tid; i < E; i += nthreads) s.e_val[i] = kNone;
    for (uint32_t w = tid; w < (H + 31) / 32; w += nthreads) s.bitmap[w] = 0;
    if (tid == 0) s.scalars[0] = 0;
    __syncthreads();

    // The loops below load with batched<kLoads>: a thread issues the global
    // loads of several iterations before it uses any, so the row's long
    // phases wait a few memory latencies each, not one per iteration.
    constexpr uint32_t kLoads = 8;

    // Classify the entries; tokens of the LRU part go into the hash table (a
    // token's value is the lowest entry holding it, so duplicates resolve to
    // their first occurrence).
    batched<kLoads>(
        tid, E, nthreads, [&](uint32_t i) { return query_entry(p, rq.topk, i); },
        [&](uint32_t i, const QueryEntry& q) {
            const int64_t t = classify(i, q);
            int32_t cls;
            if (t == -1) {
                cls = kPad;
            } else if (t < 0) {
                cls = kBad;
            } else if (t == newest) {
                cls = kNewest;
            } else {
                cls = kCand;
                hash.insert((int32_t)t, (int32_t)i);
            }
            s.e_class[i] = cls;
        });
    // Check that lru_slots is a permutation of [0, hot) while copying it.
    batched<kLoads>(
        tid, H, nthreads, [&](uint32_t pos) { return ld(rq.lru + pos); },
        [&](uint32_t pos, int16_t slot) {
            bool ok = slot >= 0 && (uint32_t)slot < H;
            if (ok) {
                const uint32_t bit = 1u << (slot & 31);
                ok = (atomicOr(&s.bitmap[slot >> 5], bit) & bit) == 0;
            }
            if (!ok) s.scalars[0] = 1;
            s.lru_old[pos] = ok ? (uint16_t)slot : 0;
        });
    __syncthreads();
    if (s.scalars[0] != 0) {
        row.refuse(KVT_ERR_SWAP_LRU, 0);
        return;
    }

    // Duplicates point at their canonical entry; LRU slots whose token is in
    // the query are hits (the lowest LRU position wins for a token that sits
    // in two slots); the others are evictable, usable when their device row
    // is in range.
    for (uint32_t i = tid; i < E; i += nthreads) {
        if (s.e_class[i] == kCand) {
            const int32_t c = hash.find((int32_t)query_entry(p, rq.topk, i).token);
            if (c != (int32_t)i) s.e_class[i] = c;
        }
    }
    // A slot's token and device row are loaded together (the row is used
    // only when the slot is not a hit; slot < hot, inside the request's rows).
    batched<kLoads>(
        tid, H, nthreads,
        [&](uint32_t pos) {
            const uint16_t slot = s.lru_old[pos];
            return SlotRow{ld(rq.btok + slot), ld(rq.bloc + slot)};
        },
        [&](uint32_t pos, const SlotRow& r) {
            const uint16_t slot = s.lru_old[pos];
            const int32_t token = r.token;
            const int32_t c = token >= 0 ? hash.find(token) : -1;
            if (c >= 0) {
                s.lru_old[pos] = slot | kHit;
                atomicMin(&s.e_val[c], (int32_t)pos);
            } else {
                const int32_t loc = r.loc;
                if (in_rows(loc, p.device_rows))
                    s.lru_old[pos] = slot | kUsable;
                else
                    report(err, KVT_ERR_SWAP_SLOT_LOC, row_pos | slot, loc);
            }
        });
    __syncthreads();

    // Outputs of the newest token and of hits (their device rows); host rows
    // of the misses.
    auto hit_like = [&](int32_t cls, uint32_t i) {
        return cls == kNewest || (cls == kCand && s.e_val[i] != kNone);
    };
    batched<kLoads>(
        tid, E, nthreads,
        [&](uint32_t i) -> int64_t {
            const int32_t cls = s.e_class[i];
            if (hit_like(cls, i)) {
                const uint32_t slot = cls == kNewest ? H : (s.lru_old[s.e_val[i]] & kSlotMask);
                return ld(rq.bloc + slot);
            }
            return cls == kCand ? ld(rq.hloc + query_entry(p, rq.topk, i).token) : 0;
        },
        [&](uint32_t i, int64_t row) {
            const int32_t cls = s.e_class[i];
            int32_t o = -1;
            if (hit_like(cls, i)) {
                if (in_rows(row, p.device_rows))
                    o = (int32_t)row;
                else
                    report(err, KVT_ERR_SWAP_DEVICE_LOC, row_pos | i, row);
            } else if (cls == kCand) {
                if (in_rows(row, p.host_rows)) {
                    s.e_class[i] = kMiss;
                    return;
                }
                report(err, KVT_ERR_SWAP_HOST_LOC, row_pos | i, row);
            }
            if (cls < 0) {
                s.e_class[i] = kDone;
                s.e_val[i] = o;
            }
        });

    // Rank the LRU positions (contiguous chunks per thread keep LRU order):
    // hits, evictables, usable evictables.
    const uint32_t chunk = (H + nthreads - 1) / nthreads;
    const uint32_t lo = min(tid * chunk, H), hi = min(lo + chunk, H);
    uint32_t rank[3] = {0, 0, 0};
    for (uint32_t pos = lo; pos < hi; ++pos) {
        const uint16_t f = s.lru_old[pos];
        if (f & kHit) {
            rank[0]++;
        } else {
            rank[1]++;
            if (f & kUsable) rank[2]++;
        }
    }
    uint32_t totals[3];
    block_exclusive_scan<3>(rank, totals, s.scan);
    const uint32_t n_evict = totals[1], n_usable = totals[2];
    {
        uint32_t u = rank[2];
        for (uint32_t pos = lo; pos < hi; ++pos) {
            const uint16_t f = s.lru_old[pos];
            if (!(f & kHit) && (f & kUsable)) {
                if (u < E) s.usable_slot[u] = f & kSlotMask;
                u++;
            }
        }
    }

    // The m-th miss (query order) takes the m-th usable evictable slot.
    const uint32_t kchunk = (E + nthreads - 1) / nthreads;
    const uint32_t klo = min(tid * kchunk, E), khi = min(klo + kchunk, E);
    uint32_t miss[1] = {0};
    for (uint32_t i = klo; i < khi; ++i) miss[0] += s.e_class[i] == kMiss;
    uint32_t miss_total[1];
    block_exclusive_scan<1>(miss, miss_total, s.scan);  // also orders usable_slot before its reads
    const uint32_t n_load = min(miss_total[0], n_usable);
    {
        uint32_t m = miss[0];
        for (uint32_t i = klo; i < khi; ++i) {
            if (s.e_class[i] != kMiss) continue;
            int32_t o = -1;
            if (m < n_load) {
                const uint16_t slot = s.usable_slot[m];
                const int32_t token = (int32_t)query_entry(p, rq.topk, i).token;
                o = ld(rq.bloc + slot);
                st(rq.btok + slot, token);
                st(row.plan_src + m, ld(rq.hloc + token));
                st(row.plan_dst + m, o);
            } else {
                report(err, KVT_ERR_SWAP_DEVICE_LOC, row_pos | i, -1);
            }
            s.e_val[i] = o;
            s.e_class[i] = kDone;
            m++;
        }
    }
    if (tid == 0) {
        st(row.plan_count + b, (int32_t)n_load);
        count_row(p, totals[0], n_load);
    }
    // The copy kernel may be scheduled now (it waits for this grid to
    // complete before reading the plan): its launch overlaps this block's
    // tail. Only when it follows: with the copy in this kernel, or no bytes
    // moving, nothing of kvtier's does.
    if (!(p.flags & (KVT_SWAP_COPY_IN_PLAN | KVT_SWAP_SKIP_IO))) allow_dependents();
    __syncthreads();

    // Outputs, duplicates taking their canonical entry's.
    for (uint32_t i = tid; i < E; i += nthreads) {
        const int32_t cls = s.e_class[i];
        st(row.out + i, cls >= 0 ? s.e_val[cls] : s.e_val[i]);
    }

    // New LRU order: unused evictables (old order), the slots just loaded
    // (miss order), the hits (old order).
    {
        uint32_t hit_r = rank[0], evict_r = rank[1], usable_r = rank[2];
        for (uint32_t pos = lo; pos < hi; ++pos) {
            const uint16_t f = s.lru_old[pos];
            uint32_t to;
            if (f & kHit) {
                to = n_evict + hit_r++;
            } else {
                const bool used = (f & kUsable) && usable_r < n_load;
                to = used ? n_evict - n_load + usable_r : evict_r - min(usable_r, n_load);
                if (f & kUsable) usable_r++;
                evict_r++;
            }
            st(rq.lru + to, (int16_t)(f & kSlotMask));
        }
    }

    // The one-block-per-request design copies its own misses here.
    if ((p.flags & KVT_SWAP_COPY_IN_PLAN) && !(p.flags & KVT_SWAP_SKIP_IO)) {
        __syncthreads();  // the plan rows above were written by other threads
        const uint32_t lane = tid % KVT_WARP;
        for (uint32_t m = tid / KVT_WARP; m < n_load; m += nthreads / KVT_WARP)
            copy_row(p, err, ld(row.plan_src + m), ld(row.plan_dst + m), row_pos | m, lane);
    }
}

// kvt_swap_in_copy — every planned miss of the rows below num_real_reqs, a
// warp per miss over one grid (contract: kvt_swap_in_params in abi.h); with
// KVT_SWAP_SKIP_INLINE only those of rows with more than
// KVT_SWAP_FEW_MISS_INLINE misses (the few-miss planner copied the others).
// Reads:   num_real_reqs, plan_count of those rows, their plan rows, host
//          rows of every plane (host-mapped).
// Writes:  device rows of every plane; the error word for a planned row out
//          of range and (block 0 only, so each is counted once) a count
//          outside [0, plan_capacity], and with KVT_SWAP_REPLAY a negative
//          num_real_reqs.
// Assumes: kvt_swap_in_plan ran on the same stream for the same params (on
//          sm_90 this kernel is launched as its programmatic dependent and
//          waits for it first), or (KVT_SWAP_REPLAY) the plan is the caller's; plan rows of
//          plan_stride >= plan_capacity elements; dynamic shared memory of
//          (batch + 1 + blockDim.x / 32) words.
// Mapping: each block computes the prefix sums of the counts (deterministic,
//          no atomics, nothing to reset between launches), then its warps take
//          miss g, g + grid_warps, ... and find the row by binary search.
// kvt_swap_in_copy_line_aligned is the same with each row's passes aligned
// to 128-byte lines of its host address (the copy method
// KVT_COPY_LINE_ALIGNED, warp_copy_entry_lines): a kernel of its own so that
// the default keeps its registers, as the gather's and writeback's methods.
namespace kvt {
namespace swap {
// Whether the bulk-copy engine can move every miss of `p` whole: rows of one
// value piece (no scale piece) of whole 16-byte units, pages and buffers
// 16-byte aligned. The same on the host (swap_in::cuda::bulk_rows).
__device__ __forceinline__ bool bulk_rows(const kvt_swap_in_params& p) {
    const kvt_item_layout& L = p.items;
    const uint64_t bases = p.host_cache[0] | p.device_buffer[0] | p.host_cache[1] | p.device_buffer[1];
    return L.scale_bytes == 0 && (L.value_bytes & 15u) == 0 && (L.page_bytes & 15u) == 0 && (bases & 15u) == 0;
}
// Shared memory of kvt_swap_in_copy_bulk past the prefix sums (its first
// bulk_copy_at bytes): two barriers a warp, rounded to 128 bytes, then two
// stages a warp of one value piece a plane.
__device__ __forceinline__ uint32_t bulk_copy_at(uint32_t batch, uint32_t warps) {
    return (4u * (batch + 1u + warps) + 127u) & ~127u;
}
// A row's value piece in a buffer of layout L.
__device__ __forceinline__ uint64_t value_at(const kvt_item_layout& L, uint64_t base, uint64_t row) {
    return base + (row >> L.page_shift) * L.page_bytes + (row & ((1ull << L.page_shift) - 1)) * L.value_bytes;
}

// The row r of miss g: prefix[r] <= g < prefix[r + 1] (prefix holds the
// rows' exclusive sums of misses, B of them).
__device__ __forceinline__ uint32_t row_of(const uint32_t* prefix, uint32_t B, uint32_t g) {
    uint32_t lo = 0, hi = B;
    while (hi - lo > 1) {
        const uint32_t mid = (lo + hi) / 2;
        if (prefix[mid] <= g)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

template <bool Lines, bool Bulk = false>
__device__ __forceinline__ void copy_planned(const kvt_swap_in_params& p) {
    // Launched as a dependent of the plan kernel on sm_90: nothing is read
    // before the plan kernel has completed.
    grid_dependency_wait();
    const swap::Reporter err(p);
    const uint32_t B = swap::real_rows(p, err, p.flags & KVT_SWAP_REPLAY);
    if (p.flags & KVT_SWAP_SKIP_IO) return;  // after the num_real_reqs check: a probe still validates
    const uint32_t tid = threadIdx.x, nthreads = blockDim.x, cap = p.plan_capacity;
    uint32_t* prefix = reinterpret_cast<uint32_t*>(kvt_dynamic_smem);  // [B + 1]
    uint32_t* scan = prefix + B + 1;                                    // [nthreads / 32]
    const int32_t* plan_count = reinterpret_cast<const int32_t*>(p.plan_count);
    // A count outside [0, cap] copies nothing (reported by block 0).
    auto count_of = [&](uint32_t r, bool report_it) -> uint32_t {
        const int32_t c = ld(plan_count + r);
        if (c >= 0 && (uint32_t)c <= cap) {
            // The few-miss planner copied a row this small itself.
            const bool copied = (p.flags & KVT_SWAP_SKIP_INLINE) && c <= KVT_SWAP_FEW_MISS_INLINE;
            return copied ? 0u : (uint32_t)c;
        }
        if (report_it && blockIdx.x == 0) report(err, KVT_ERR_SWAP_PLAN_COUNT, r << 16, c);
        return 0;
    };

    const uint32_t chunk = (B + nthreads - 1) / nthreads;
    const uint32_t lo = min(tid * chunk, B), hi = min(lo + chunk, B);
    uint32_t sum = 0;
    for (uint32_t r = lo; r < hi; ++r) sum += count_of(r, true);
    uint32_t total;
    {
        uint32_t acc = block_exclusive_sum(sum, &total, scan);
        for (uint32_t r = lo; r < hi; ++r) {
            prefix[r] = acc;
            acc += count_of(r, false);
        }
    }
    if (tid == 0) prefix[B] = total;
    __syncthreads();

    const uint32_t lane = tid % KVT_WARP;
#ifdef KVT_HAS_BULK
    // The bulk copy: lane 0 of each warp moves its misses with the engine,
    // a bulk load a plane from the host row into a stage of the warp's, then
    // a bulk store from there into the device row; the next miss's loads are
    // issued before the warp waits for this one's, so two misses are in
    // flight a warp, with no registers held for the bytes.
    if (Bulk && bulk_rows(p)) {
        if (lane != 0) return;
        const kvt_item_layout& L = p.items;
        const uint32_t planes = p.host_cache[1] != 0 ? 2u : 1u;
        const uint32_t warp = tid / KVT_WARP, warps = nthreads / KVT_WARP;
        const uint32_t stage_bytes = planes * L.value_bytes;
        const bulk::WarpStages st(reinterpret_cast<char*>(kvt_dynamic_smem) + bulk_copy_at(B, warps), warp, warps,
                                  stage_bytes);
        st.init();
        uint32_t filled = 0;
        int64_t waiting = -1;  // the device row of the miss whose loads are in flight
        auto store_waiting = [&]() {
            if (waiting < 0) return;
            st.wait_loaded(filled - 1);
            for (uint32_t k = 0; k < planes; ++k)
                bulk::store(reinterpret_cast<char*>(value_at(L, p.device_buffer[k], (uint64_t)waiting)),
                            st.stage(filled - 1) + k * L.value_bytes, L.value_bytes);
            bulk::commit();
            waiting = -1;
        };
        for (uint32_t g = global_warp(); g < total; g += grid_warps()) {
            const uint32_t lo_r = row_of(prefix, B, g);
            const uint32_t m = g - prefix[lo_r];
            const uint64_t at = (uint64_t)lo_r * p.plan_stride + m;
            const int64_t src = ld(reinterpret_cast<const int64_t*>(p.plan_src) + at);
            const int64_t dst = ld(reinterpret_cast<const int32_t*>(p.plan_dst) + at);
            if (!in_rows(src, p.host_rows) || !in_rows(dst, p.device_rows)) {
                report(err, in_rows(src, p.host_rows) ? KVT_ERR_SWAP_DEVICE_LOC : KVT_ERR_SWAP_HOST_LOC,
                       (lo_r << 16) | m, in_rows(src, p.host_rows) ? dst : src);
                continue;
            }
            // the store that last read this stage, two misses back, is the newest
            bulk::wait_read<0>();
            bulk::arrive_expect_bytes(st.bar(filled), stage_bytes);
            for (uint32_t k = 0; k < planes; ++k)
                bulk::load(st.stage(filled) + k * L.value_bytes,
                           reinterpret_cast<const char*>(value_at(L, p.host_cache[k], (uint64_t)src)), L.value_bytes,
                           st.bar(filled));
            store_waiting();
            waiting = dst;
            ++filled;
        }
        store_waiting();
        bulk::wait_all();
        return;
    }
#endif
    for (uint32_t g = global_warp(); g < total; g += grid_warps()) {
        const uint32_t lo_r = row_of(prefix, B, g);
        const uint32_t m = g - prefix[lo_r];
        const uint64_t at = (uint64_t)lo_r * p.plan_stride + m;
        copy_row<KVT_UNROLL, Lines>(p, err, ld(reinterpret_cast<const int64_t*>(p.plan_src) + at),
                                    ld(reinterpret_cast<const int32_t*>(p.plan_dst) + at), (lo_r << 16) | m, lane);
    }
}
}  // namespace swap
}  // namespace kvt

extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS) kvt_swap_in_copy(const kvt_swap_in_params p) {
    kvt::swap::copy_planned<false>(p);
}
extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS)
    kvt_swap_in_copy_line_aligned(const kvt_swap_in_params p) {
    kvt::swap::copy_planned<true>(p);
}
// kvt_swap_in_copy_bulk — kvt_swap_in_copy with the copy method
// KVT_COPY_BULK_RUNS (KVT_SWAP_COPY_BULK), sm_90 and later: the same reads,
// writes, reports and mapping, each miss moved by lane 0 of its warp with
// the bulk-copy engine (a bulk load a plane into the warp's shared memory,
// then a bulk store) where every row is one value piece of whole 16-byte
// units at 16-byte aligned addresses (bulk_rows), else as
// kvt_swap_in_copy_line_aligned.
// Assumes: as kvt_swap_in_copy, with dynamic shared memory of
//          bulk_copy_at(batch, warps) + bulk_barrier_bytes(warps) +
//          warps * 2 * planes * value_bytes bytes (swap_in::copy_smem_bytes_for).
// Without the bulk engine (the sm_80 build), kvt_swap_in_copy_line_aligned.
extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS) kvt_swap_in_copy_bulk(const kvt_swap_in_params p) {
    kvt::swap::copy_planned<true, true>(p);
}
