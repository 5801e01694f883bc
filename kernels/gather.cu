// kernels/gather.cu — top-k sparse gather from the host-mapped pool into HBM.
#include "bulk.cuh"
#include "common.cuh"

// kvt_gather — one layer, a whole batch, one launch (contract: kvt_gather_params
// in abi.h).
// Reads:   req_slots, seq_lens, topk (every row's, padding rows' too) and
//          slot_bases (device memory); pool entries (host-mapped) only at
//          addresses built from range-checked indices.
// Writes:  out rows [0, batch * k), every one of them (data or zeros); the
//          error word for refused entries.
// Assumes: the host launcher validated the shape (batch < 65536, k <= 65536,
//          topk_stride >= k), that out is 8-byte aligned and entry_bytes a
//          multiple of 8, and that every non-zero slot base is a region of
//          this pool's layout.
// Mapping: one warp per output row, grid-stride over the batch * k rows.
// One entry point per copy method (kvt_gather_line_aligned for
// KVT_COPY_LINE_ALIGNED, kvt_gather_merged_runs below for
// KVT_COPY_MERGED_RUNS): in one kernel the second method's registers would
// cost the first its fourth block an SM.
namespace kvt {
template <bool LineAligned>
__device__ __forceinline__ void gather(const kvt_gather_params& p) {
    const uint32_t lane = threadIdx.x % KVT_WARP;
    const uint32_t rows = p.batch * p.k;
    const int32_t* req_slots = reinterpret_cast<const int32_t*>(p.req_slots);
    const int32_t* seq_lens = reinterpret_cast<const int32_t*>(p.seq_lens);
    const int32_t* topk = reinterpret_cast<const int32_t*>(p.topk);
    const uint64_t* slot_bases = reinterpret_cast<const uint64_t*>(p.slot_bases);
    kvt_error_word* err = reinterpret_cast<kvt_error_word*>(p.error);

    for (uint32_t r = kvt::global_warp(); r < rows; r += kvt::grid_warps()) {
        const uint32_t b = r / p.k;
        const uint32_t j = r - b * p.k;
        const uint32_t position = (b << 16) | j;
        char* dst = reinterpret_cast<char*>(p.out) + (uint64_t)r * p.entry_bytes;

        // The row's three indices are loaded together (each address depends
        // only on r, and every one is inside its array), so the chain in
        // front of the first KV load is two deep: these, then the slot base.
        // Every lane evaluates the same checks (uniform branches); lane 0 reports.
        const char* src = nullptr;
        const int32_t slot = kvt::ld(req_slots + b);
        const int32_t seq_len = kvt::ld(seq_lens + b);
        const int32_t token = kvt::ld(topk + (uint64_t)b * p.topk_stride + j);
        if (slot != -1) {
            const uint64_t base =
                (slot >= 0 && (uint32_t)slot < p.num_slots) ? kvt::ld(slot_bases + slot) : 0;
            if (base == 0) {
                if (lane == 0) kvt::report(err, KVT_ERR_GATHER_SLOT, position, slot);
            } else {
                if (seq_len < 0 || (uint32_t)seq_len > p.tokens_per_region) {
                    if (lane == 0) kvt::report(err, KVT_ERR_GATHER_SEQ_LEN, position, seq_len);
                } else {
                    if (token >= 0 && token < seq_len) {
                        src = reinterpret_cast<const char*>(base + p.layer_offset +
                                                            (uint64_t)token * p.entry_bytes);
                    } else if (token != -1) {
                        if (lane == 0) kvt::report(err, KVT_ERR_GATHER_INDEX, position, token);
                    }
                }
            }
        }

        if (src != nullptr) {
            if (LineAligned)
                kvt::warp_copy_entry_lines<kvt::PoolToDevice>(src, dst, p.entry_bytes, lane);
            else
                kvt::warp_copy_entry<kvt::PoolToDevice>(src, dst, p.entry_bytes, lane);
        } else {
            kvt::warp_zero_entry<kvt::PoolToDevice>(dst, p.entry_bytes, lane);
        }
    }
}

// The gather with CopyMethod::MergedRuns: the same checks, reports and
// outputs, rows taken KVT_COPY_RUN_ROWS at a time. Selected tokens t, t + 1,
// ... in consecutive columns are consecutive pool entries bound for
// consecutive output rows, so such a run moves as one block, its passes
// aligned to the pool's lines: only the run's first and last lines are
// partial, where one row a warp splits a line at every row edge (656 B =
// 5 lines + 16 B), and a pass carries up to 2 KiB of the run where one row
// leaves most of it empty.
// One group of a run-merging gather (gather_merged_runs, gather_bulk_runs):
// group g's batch row, first column and row count, and, from each lane's
// checks of its column (reported as kvt_gather reports them), the rows that
// move, the rows that continue a run, the lane's token and the request's
// region base. Every lane calls it (a shuffle and two ballots).
struct GatherGroup {
    uint32_t b, j0, n;
    uint32_t rows, join_mask;
    int32_t token;
    uint64_t base;
};
__device__ __forceinline__ GatherGroup gather_group(const kvt_gather_params& p, uint32_t g, uint32_t groups_per_row,
                                                   uint32_t lane, bool merge) {
    GatherGroup G;
    G.b = g / groups_per_row;
    G.j0 = (g - G.b * groups_per_row) * KVT_COPY_RUN_ROWS;
    G.n = min(KVT_COPY_RUN_ROWS, p.k - G.j0);
    const uint32_t b = G.b;
    const uint32_t j = G.j0 + lane;  // lane's column, a row of the group when lane < n
    const bool mine = lane < G.n;
    kvt_error_word* err = reinterpret_cast<kvt_error_word*>(p.error);

    // The row's slot and length are the group's; each lane loads its own
    // column's index alongside them, and checks and reports its row as
    // kvt_gather does (positions order the error word, not lanes).
    const int32_t slot = kvt::ld(reinterpret_cast<const int32_t*>(p.req_slots) + b);
    const int32_t seq_len = kvt::ld(reinterpret_cast<const int32_t*>(p.seq_lens) + b);
    const int32_t token =
        mine ? kvt::ld(reinterpret_cast<const int32_t*>(p.topk) + (uint64_t)b * p.topk_stride + j) : -1;
    const uint64_t base = (slot >= 0 && (uint32_t)slot < p.num_slots)
                              ? kvt::ld(reinterpret_cast<const uint64_t*>(p.slot_bases) + slot)
                              : 0;
    bool moves = false;
    if (mine && slot != -1) {
        const uint32_t position = (b << 16) | j;
        if (base == 0) {
            kvt::report(err, KVT_ERR_GATHER_SLOT, position, slot);
        } else if (seq_len < 0 || (uint32_t)seq_len > p.tokens_per_region) {
            kvt::report(err, KVT_ERR_GATHER_SEQ_LEN, position, seq_len);
        } else if (token >= 0 && token < seq_len) {
            moves = true;
        } else if (token != -1) {
            kvt::report(err, KVT_ERR_GATHER_INDEX, position, token);
        }
    }

    // A row joins the run of the row before it when both move and its
    // token is the next one (both below seq_len: no overflow).
    const int32_t before = (int32_t)kvt::warp_read((uint32_t)token, lane == 0 ? 0 : lane - 1);
    G.rows = kvt::warp_ballot(moves);
    const bool joins = merge && moves && lane > 0 && ((G.rows >> (lane - 1)) & 1u) != 0 && token == before + 1;
    G.join_mask = kvt::warp_ballot(joins);
    G.token = token;
    G.base = base;
    return G;
}

__device__ __forceinline__ void gather_merged_runs(const kvt_gather_params& p) {
    const uint32_t lane = threadIdx.x % KVT_WARP;
    // k <= 65536 and batch < 65536: groups < 2^29
    const uint32_t groups_per_row = (p.k + KVT_COPY_RUN_ROWS - 1) / KVT_COPY_RUN_ROWS;
    const uint32_t groups = p.batch * groups_per_row;
    const bool merge = p.entry_bytes <= KVT_RUN_MAX_ENTRY;

    for (uint32_t g = kvt::global_warp(); g < groups; g += kvt::grid_warps()) {
        const GatherGroup G = gather_group(p, g, groups_per_row, lane, merge);
        const uint32_t n = G.n, rows = G.rows, join_mask = G.join_mask;
        const int32_t token = G.token;
        const uint64_t base = G.base;
        char* group_out = reinterpret_cast<char*>(p.out) + ((uint64_t)G.b * p.k + G.j0) * p.entry_bytes;

        kvt::for_each_run(rows, join_mask, [&](uint32_t first, uint32_t count) {
            const uint32_t t = kvt::warp_read((uint32_t)token, first);
            const char* src = reinterpret_cast<const char*>(base + p.layer_offset + (uint64_t)t * p.entry_bytes);
            kvt::warp_copy_entry_lines<kvt::PoolToDevice>(src, group_out + (uint64_t)first * p.entry_bytes,
                                                          count * p.entry_bytes, lane);
        });
        // Padding and refused rows: zeros, neighbours in one block too.
        const uint32_t zeros = ((1u << n) - 1u) & ~rows;
        kvt::for_each_run(zeros, merge ? zeros & (zeros << 1) : 0u, [&](uint32_t first, uint32_t count) {
            kvt::warp_zero_entry<kvt::PoolToDevice>(group_out + (uint64_t)first * p.entry_bytes,
                                                    count * p.entry_bytes, lane);
        });
    }
}

#ifdef KVT_HAS_BULK
// The gather with CopyMethod::BulkRuns: the groups, checks, reports, runs and
// outputs of gather_merged_runs, the bytes moved by the bulk-copy engine
// through shared memory instead of through the warp's registers. A group's
// rows are contiguous in `out`, so the warp assembles the whole group in a
// stage of its own (each run of neighbours one bulk load straight from the
// pool, each padding or refused row zeros written by the lanes) and writes it
// with one bulk store. Each warp owns two stages: the loads of one group are
// issued before the warp waits for the other's, so two groups' reads are in
// flight a warp, with no registers held for them. Where the engine cannot
// take a group (entries not whole 16-byte units, `out` or the region's layer
// not 16-byte aligned), the group moves as gather_merged_runs moves it.
__device__ __forceinline__ void gather_bulk_runs(const kvt_gather_params& p) {
    if ((p.entry_bytes & 15u) != 0 || (p.out & 15u) != 0 || (p.layer_offset & 15u) != 0) {
        gather_merged_runs(p);  // the same for every warp of the grid
        return;
    }
    const uint32_t lane = threadIdx.x % KVT_WARP;
    const uint32_t entry = p.entry_bytes;
    const kvt::bulk::WarpStages st(reinterpret_cast<char*>(kvt_dynamic_smem), threadIdx.x / KVT_WARP,
                                   blockDim.x / KVT_WARP, KVT_COPY_RUN_ROWS * entry);
    if (lane == 0) st.init();
    __syncwarp();

    const uint32_t groups_per_row = (p.k + KVT_COPY_RUN_ROWS - 1) / KVT_COPY_RUN_ROWS;
    const uint32_t groups = p.batch * groups_per_row;
    const bool merge = entry <= KVT_RUN_MAX_ENTRY;

    // Stages filled so far: the next is stage `filled & 1`, the (filled >> 1)th
    // use of its barrier. The group in the other stage, if any, waits there for
    // its store: its output and bytes.
    uint32_t filled = 0;
    char* waiting_out = nullptr;
    uint32_t waiting_bytes = 0;
    // Lane 0 stores the waiting group once its loads have landed.
    auto store_waiting = [&]() {
        if (waiting_out == nullptr) return;
        if (lane == 0) {
            st.wait_loaded(filled - 1);
            kvt::bulk::store(waiting_out, st.stage(filled - 1), waiting_bytes);
            kvt::bulk::commit();
        }
        waiting_out = nullptr;
    };

    for (uint32_t g = kvt::global_warp(); g < groups; g += kvt::grid_warps()) {
        // the checks, reports and runs of gather_merged_runs
        const GatherGroup G = gather_group(p, g, groups_per_row, lane, merge);
        const uint32_t n = G.n, rows = G.rows, join_mask = G.join_mask;
        const int32_t token = G.token;
        const uint64_t base = G.base;
        char* group_out = reinterpret_cast<char*>(p.out) + ((uint64_t)G.b * p.k + G.j0) * entry;
        const uint32_t zeros = ((1u << n) - 1u) & ~rows;
        const char* layer = reinterpret_cast<const char*>(base + p.layer_offset);

        if ((base & 15u) != 0) {
            // A region the engine cannot read from (the contract promises 8
            // bytes of alignment): this group moves as gather_merged_runs.
            kvt::for_each_run(rows, join_mask, [&](uint32_t first, uint32_t count) {
                const uint32_t t = kvt::warp_read((uint32_t)token, first);
                kvt::warp_copy_entry_lines<kvt::PoolToDevice>(layer + (uint64_t)t * entry,
                                                              group_out + (uint64_t)first * entry,
                                                              count * entry, lane);
            });
            kvt::for_each_run(zeros, merge ? zeros & (zeros << 1) : 0u, [&](uint32_t first, uint32_t count) {
                kvt::warp_zero_entry<kvt::PoolToDevice>(group_out + (uint64_t)first * entry, count * entry, lane);
            });
            continue;
        }

        char* stage = st.stage(filled);
        // The store that last read this stage, two groups back, is the
        // newest: it must have read it all before anything is written there.
        if (lane == 0) kvt::bulk::wait_read<0>();
        __syncwarp();
        // Padding and refused rows: zeros, written by the lanes and fenced
        // so the engine's store sees them (`zeros` is the warp's).
        if (zeros != 0) {
            const uint32_t units = entry >> 4;
            for (uint32_t z = zeros; z != 0; z &= z - 1) {
                char* row = stage + (uint32_t)(__ffs((int)z) - 1) * entry;
                for (uint32_t u = lane; u < units; u += KVT_WARP)
                    kvt::bulk::st_shared16(row + 16u * u, make_uint4(0, 0, 0, 0));
            }
            kvt::bulk::fence_async_shared();
            __syncwarp();
        }
        // One bulk load a run of neighbours, counted on the stage's barrier
        // (a group with nothing to load completes its phase on the arrival).
        if (lane == 0) kvt::bulk::arrive_expect_bytes(st.bar(filled), (uint32_t)__popc(rows) * entry);
        kvt::for_each_run(rows, join_mask, [&](uint32_t first, uint32_t count) {
            const uint32_t t = kvt::warp_read((uint32_t)token, first);
            if (lane == 0)
                kvt::bulk::load(stage + first * entry, layer + (uint64_t)t * entry, count * entry, st.bar(filled));
        });
        // This group's loads are in flight: store the other stage's group.
        store_waiting();
        waiting_out = group_out;
        waiting_bytes = n * entry;
        ++filled;
    }
    store_waiting();
    // Every store must have landed before the grid completes and this
    // block's shared memory is freed.
    if (lane == 0) kvt::bulk::wait_all();
}
#endif
}  // namespace kvt

extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS) kvt_gather(const kvt_gather_params p) {
    kvt::gather<false>(p);
}
extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS) kvt_gather_line_aligned(const kvt_gather_params p) {
    kvt::gather<true>(p);
}

// kvt_gather_merged_runs — kvt_gather with the copy method
// KVT_COPY_MERGED_RUNS (contract: kvt_gather_params in abi.h).
// Reads:   as kvt_gather: req_slots, seq_lens, every row's topk, slot_bases
//          (device memory); pool entries (host-mapped) only at addresses
//          built from range-checked indices.
// Writes:  as kvt_gather: out rows [0, batch * k), every one of them (data
//          or zeros); the error word for refused entries.
// Assumes: as kvt_gather.
// Mapping: one warp per group of KVT_COPY_RUN_ROWS consecutive columns of one
//          batch row (fewer at the row's end), grid-stride over
//          batch * ceil(k / KVT_COPY_RUN_ROWS) groups; lane l checks column
//          j0 + l; each run of consecutive tokens moves as one block
//          (warp_copy_entry_lines over the run). A run never crosses a group.
// Held to four blocks an SM, as the other methods' kernels run: left free,
// ptxas gives it more than 64 registers at sm_80 (three blocks); at 64 it
// spills nothing (scripts/kernel-resources.sh).
extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS, 4)
    kvt_gather_merged_runs(const kvt_gather_params p) {
    kvt::gather_merged_runs(p);
}

// kvt_gather_bulk_runs — kvt_gather with the copy method KVT_COPY_BULK_RUNS
// (contract: kvt_gather_params in abi.h), sm_90 and later.
// Reads:   as kvt_gather: req_slots, seq_lens, every row's topk, slot_bases
//          (device memory); pool entries (host-mapped) only at addresses
//          built from range-checked indices, by bulk loads of whole runs.
// Writes:  as kvt_gather: out rows [0, batch * k), every one of them, by one
//          bulk store a group; the error word for refused entries; its own
//          shared memory.
// Assumes: as kvt_gather, and dynamic shared memory of
//          bulk_smem_bytes(entry_bytes, blockDim.x / 32) bytes.
// Mapping: as kvt_gather_merged_runs (a warp a group of KVT_COPY_RUN_ROWS
//          columns, grid-stride); each warp stages its groups in two
//          shared-memory stages of its own.
// Without the bulk engine (the sm_80 build), kvt_gather_merged_runs.
extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS) kvt_gather_bulk_runs(const kvt_gather_params p) {
#ifdef KVT_HAS_BULK
    kvt::gather_bulk_runs(p);
#else
    kvt::gather_merged_runs(p);
#endif
}
