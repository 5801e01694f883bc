// kernels/writeback.cu — layer-first writeback from HBM KV buffers into the
// host-mapped pool.
#include "bulk.cuh"
#include "common.cuh"

// kvt_writeback — one or more layers, many items, one launch (contract:
// kvt_writeback_params in abi.h).
// Reads:   slot_bases, item_slots, item_tokens, item_src_rows, src_layer_bases
//          (device memory); source rows only at range-checked row indices.
// Writes:  pool entries (host-mapped) only at range-checked (slot, token)
//          addresses; the error word for refused items.
// Assumes: the host launcher validated that first_layer + num_layers fits the
//          layout, that src_layer_bases (when set) holds num_layers buffers of
//          src_rows rows each, that every non-zero slot base is a region of
//          this pool's layout, and that entry_bytes is a multiple of 8.
// Mapping: one warp per (layer, item) copy, grid-stride; consecutive warps take
//          consecutive items of the same layer.
// One entry point per copy method (kvt_writeback_line_aligned for
// KVT_COPY_LINE_ALIGNED, kvt_writeback_merged_runs below for
// KVT_COPY_MERGED_RUNS), as the gather has.
namespace kvt {
// The parameters' arrays, typed (both kernels read the same ones).
struct WritebackArrays {
    const int32_t* item_slots;
    const int32_t* item_tokens;
    const int64_t* item_src_rows;
    const uint64_t* slot_bases;
    const uint64_t* src_layer_bases;
    kvt_error_word* err;
    __device__ __forceinline__ explicit WritebackArrays(const kvt_writeback_params& p)
        : item_slots(reinterpret_cast<const int32_t*>(p.item_slots)),
          item_tokens(reinterpret_cast<const int32_t*>(p.item_tokens)),
          item_src_rows(reinterpret_cast<const int64_t*>(p.item_src_rows)),
          slot_bases(reinterpret_cast<const uint64_t*>(p.slot_bases)),
          src_layer_bases(reinterpret_cast<const uint64_t*>(p.src_layer_bases)),
          err(reinterpret_cast<kvt_error_word*>(p.error)) {}
};

template <bool LineAligned>
__device__ __forceinline__ void writeback(const kvt_writeback_params& p) {
    const uint32_t lane = threadIdx.x % KVT_WARP;
    const uint64_t rows = (uint64_t)p.num_layers * p.num_items;
    const WritebackArrays a(p);
    const int32_t* item_slots = a.item_slots;
    const int32_t* item_tokens = a.item_tokens;
    const int64_t* item_src_rows = a.item_src_rows;
    const uint64_t* slot_bases = a.slot_bases;
    const uint64_t* src_layer_bases = a.src_layer_bases;
    kvt_error_word* err = a.err;

    for (uint64_t r = kvt::global_warp(); r < rows; r += kvt::grid_warps()) {
        const uint32_t layer_i = (uint32_t)(r / p.num_items);
        const uint32_t item = (uint32_t)(r - (uint64_t)layer_i * p.num_items);

        const int32_t slot = kvt::ld(item_slots + item);
        if (slot == -1) continue;
        const uint64_t base = (slot >= 0 && (uint32_t)slot < p.num_slots) ? kvt::ld(slot_bases + slot) : 0;
        if (base == 0) {
            if (lane == 0) kvt::report(err, KVT_ERR_WRITEBACK_SLOT, item, slot);
            continue;
        }
        const int32_t token = kvt::ld(item_tokens + item);
        if (token < 0 || (uint32_t)token >= p.tokens_per_region) {
            if (lane == 0) kvt::report(err, KVT_ERR_WRITEBACK_TOKEN, item, token);
            continue;
        }
        const int64_t src_row = kvt::ld(item_src_rows + item);
        if (src_row < 0 || (uint64_t)src_row >= p.src_rows) {
            if (lane == 0) kvt::report(err, KVT_ERR_WRITEBACK_SRC_ROW, item, src_row);
            continue;
        }

        const uint64_t src_buf = src_layer_bases != nullptr ? kvt::ld(src_layer_bases + layer_i) : p.src_base;
        const char* src = reinterpret_cast<const char*>(src_buf + (uint64_t)src_row * p.entry_bytes);
        char* dst = reinterpret_cast<char*>(base + (uint64_t)(p.first_layer + layer_i) * p.layer_bytes +
                                            (uint64_t)token * p.entry_bytes);
        if (LineAligned)
            kvt::warp_copy_entry_lines<kvt::DeviceToPool, KVT_UNROLL, true>(src, dst, p.entry_bytes, lane);
        else
            kvt::warp_copy_entry<kvt::DeviceToPool>(src, dst, p.entry_bytes, lane);
    }
}

// One warp's group of KVT_COPY_RUN_ROWS consecutive items of one layer, as
// the run-merging writebacks (merged runs, bulk runs) see it: which lanes'
// items move (`rows`), which join the run of the item before (`join_mask`),
// and each lane's source and pool row addresses (valid where its item moves).
struct WritebackGroup {
    uint32_t rows, join_mask;
    uint64_t src, dst;
};

// Group g (of groups_per_layer a layer): lane l loads item i0 + l's three
// indices together (each inside its array), then checks and reports them
// as kvt_writeback does. An item joins the run of the item before it when
// both move to one slot and its token and source row are the next ones
// (both checked in range: no overflow). The indices die here: what the runs
// need of them is each row's two addresses.
__device__ __forceinline__ WritebackGroup writeback_group(const kvt_writeback_params& p, const WritebackArrays& a,
                                                         uint64_t g, uint32_t groups_per_layer, uint32_t lane,
                                                         bool merge) {
    const uint32_t layer_i = (uint32_t)(g / groups_per_layer);
    const uint32_t i0 = (uint32_t)(g - (uint64_t)layer_i * groups_per_layer) * KVT_COPY_RUN_ROWS;
    const uint32_t n = min(KVT_COPY_RUN_ROWS, p.num_items - i0);
    const uint32_t item = i0 + lane;  // lane's item, one of the group's when lane < n
    const bool mine = lane < n;

    int32_t slot = -1, token = 0;
    int64_t src_row = 0;
    if (mine) {
        slot = kvt::ld(a.item_slots + item);
        token = kvt::ld(a.item_tokens + item);
        src_row = kvt::ld(a.item_src_rows + item);
    }
    uint64_t base = 0;
    bool moves = false;
    if (slot != -1) {
        base = (slot >= 0 && (uint32_t)slot < p.num_slots) ? kvt::ld(a.slot_bases + slot) : 0;
        if (base == 0) {
            kvt::report(a.err, KVT_ERR_WRITEBACK_SLOT, item, slot);
        } else if (token < 0 || (uint32_t)token >= p.tokens_per_region) {
            kvt::report(a.err, KVT_ERR_WRITEBACK_TOKEN, item, token);
        } else if (src_row < 0 || (uint64_t)src_row >= p.src_rows) {
            kvt::report(a.err, KVT_ERR_WRITEBACK_SRC_ROW, item, src_row);
        } else {
            moves = true;
        }
    }

    const uint32_t prev = lane == 0 ? 0 : lane - 1;
    const int32_t slot_before = (int32_t)kvt::warp_read((uint32_t)slot, prev);
    const int32_t token_before = (int32_t)kvt::warp_read((uint32_t)token, prev);
    const int64_t row_before = (int64_t)kvt::warp_read64((uint64_t)src_row, prev);
    WritebackGroup G;
    G.rows = kvt::warp_ballot(moves);
    const bool joins = merge && moves && lane > 0 && ((G.rows >> prev) & 1u) != 0 && slot == slot_before &&
                       token == token_before + 1 && src_row == row_before + 1;
    G.join_mask = kvt::warp_ballot(joins);
    G.src = G.dst = 0;
    if (G.rows == 0) return G;
    const uint64_t src_buf = a.src_layer_bases != nullptr ? kvt::ld(a.src_layer_bases + layer_i) : p.src_base;
    G.src = src_buf + (uint64_t)src_row * p.entry_bytes;
    G.dst = base + (uint64_t)(p.first_layer + layer_i) * p.layer_bytes + (uint64_t)token * p.entry_bytes;
    return G;
}

// A group's runs, moved by the warp with its passes aligned to the pool's
// lines (whole lines inside a run, partial ones only at its ends).
__device__ __forceinline__ void writeback_group_runs(const WritebackGroup& G, uint32_t entry, uint32_t lane) {
    kvt::for_each_run(G.rows, G.join_mask, [&](uint32_t first, uint32_t count) {
        kvt::warp_copy_entry_lines<kvt::DeviceToPool, KVT_UNROLL, true>(
            reinterpret_cast<const char*>(kvt::warp_read64(G.src, first)),
            reinterpret_cast<char*>(kvt::warp_read64(G.dst, first)), count * entry, lane);
    });
}

// The writeback with CopyMethod::MergedRuns: the same checks, reports and
// pool contents, items taken KVT_COPY_RUN_ROWS at a time from one layer.
// Consecutive items of one slot with consecutive tokens and consecutive
// source rows (a prefill's chunk, written in order) read one contiguous
// block and write one, so such a run moves as one block, its passes aligned
// to the pool's lines (whole lines inside the run, partial ones only at its
// ends).
__device__ __forceinline__ void writeback_merged_runs(const kvt_writeback_params& p) {
    const uint32_t lane = threadIdx.x % KVT_WARP;
    const uint32_t groups_per_layer =
        p.num_items / KVT_COPY_RUN_ROWS + (p.num_items % KVT_COPY_RUN_ROWS != 0 ? 1u : 0u);
    const uint64_t groups = (uint64_t)p.num_layers * groups_per_layer;
    const WritebackArrays a(p);
    const bool merge = p.entry_bytes <= KVT_RUN_MAX_ENTRY;

    for (uint64_t g = kvt::global_warp(); g < groups; g += kvt::grid_warps()) {
        const WritebackGroup G = writeback_group(p, a, g, groups_per_layer, lane, merge);
        if (G.rows != 0) writeback_group_runs(G, p.entry_bytes, lane);
    }
}

#ifdef KVT_HAS_BULK
// The writeback with CopyMethod::BulkRuns: the groups, checks, reports, runs
// and pool contents of writeback_merged_runs, each run moved by the
// bulk-copy engine: one bulk load of its source rows from HBM into a stage
// of the warp's shared memory, one bulk store from there into the pool. Each
// warp owns two stages: a group's loads are issued before the warp stores the
// other stage's group, so the stores into the pool of one group overlap the
// loads of the next, with no registers held for the bytes. Where the engine
// cannot take a group (entries not whole 16-byte units, a source or pool row
// not 16-byte aligned), the group moves as writeback_merged_runs moves it.
__device__ __forceinline__ void writeback_bulk_runs(const kvt_writeback_params& p) {
    if ((p.entry_bytes & 15u) != 0) {
        writeback_merged_runs(p);  // the same for every warp of the grid
        return;
    }
    const uint32_t lane = threadIdx.x % KVT_WARP;
    const uint32_t entry = p.entry_bytes;
    const kvt::bulk::WarpStages st(reinterpret_cast<char*>(kvt_dynamic_smem), threadIdx.x / KVT_WARP,
                                   blockDim.x / KVT_WARP, KVT_COPY_RUN_ROWS * entry);
    if (lane == 0) st.init();
    __syncwarp();

    const uint32_t groups_per_layer =
        p.num_items / KVT_COPY_RUN_ROWS + (p.num_items % KVT_COPY_RUN_ROWS != 0 ? 1u : 0u);
    const uint64_t groups = (uint64_t)p.num_layers * groups_per_layer;
    const WritebackArrays a(p);
    const bool merge = entry <= KVT_RUN_MAX_ENTRY;

    // Stages filled so far (as in gather_bulk_runs), and the group waiting in
    // the other stage for its stores: its runs and each lane's pool row.
    uint32_t filled = 0;
    uint32_t waiting_rows = 0, waiting_joins = 0;
    uint64_t waiting_dst = 0;
    auto store_waiting = [&]() {
        if (waiting_rows == 0) return;
        char* stage = st.stage(filled - 1);
        if (lane == 0) st.wait_loaded(filled - 1);
        kvt::for_each_run(waiting_rows, waiting_joins, [&](uint32_t first, uint32_t count) {
            const uint64_t dst = kvt::warp_read64(waiting_dst, first);
            if (lane == 0) kvt::bulk::store(reinterpret_cast<char*>(dst), stage + first * entry, count * entry);
        });
        if (lane == 0) kvt::bulk::commit();
        waiting_rows = 0;
    };

    for (uint64_t g = kvt::global_warp(); g < groups; g += kvt::grid_warps()) {
        // The checks, reports and runs of writeback_merged_runs.
        const WritebackGroup G = writeback_group(p, a, g, groups_per_layer, lane, merge);
        const uint32_t rows = G.rows, join_mask = G.join_mask;
        if (rows == 0) continue;
        const uint64_t src = G.src, dst = G.dst;
        if (kvt::warp_ballot(((rows >> lane) & 1u) != 0 && ((src | dst) & 15u) != 0) != 0) {
            // A row the engine cannot move (the contract promises 8 bytes
            // of alignment): this group moves as writeback_merged_runs.
            writeback_group_runs(G, entry, lane);
            continue;
        }

        char* stage = st.stage(filled);
        // The stores that last read this stage, two groups back, are the
        // newest group: they must have read it all before it is loaded again.
        if (lane == 0) {
            kvt::bulk::wait_read<0>();
            kvt::bulk::arrive_expect_bytes(st.bar(filled), (uint32_t)__popc(rows) * entry);
        }
        __syncwarp();
        kvt::for_each_run(rows, join_mask, [&](uint32_t first, uint32_t count) {
            const uint64_t from = kvt::warp_read64(src, first);
            if (lane == 0)
                kvt::bulk::load(stage + first * entry, reinterpret_cast<const char*>(from), count * entry,
                                st.bar(filled));
        });
        // This group's loads are in flight: store the other stage's group.
        store_waiting();
        waiting_rows = rows;
        waiting_joins = join_mask;
        waiting_dst = dst;
        ++filled;
    }
    store_waiting();
    // Every store must have landed before the grid completes and this
    // block's shared memory is freed.
    if (lane == 0) kvt::bulk::wait_all();
}
#endif
}  // namespace kvt

extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS) kvt_writeback(const kvt_writeback_params p) {
    kvt::writeback<false>(p);
}
extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS)
    kvt_writeback_line_aligned(const kvt_writeback_params p) {
    kvt::writeback<true>(p);
}

// kvt_writeback_merged_runs — kvt_writeback with the copy method
// KVT_COPY_MERGED_RUNS (contract: kvt_writeback_params in abi.h).
// Reads:   as kvt_writeback: slot_bases, item_slots, item_tokens,
//          item_src_rows, src_layer_bases (device memory); source rows only
//          at range-checked row indices.
// Writes:  as kvt_writeback: pool entries (host-mapped) only at
//          range-checked (slot, token) addresses; the error word for
//          refused items.
// Assumes: as kvt_writeback.
// Mapping: one warp per group of KVT_COPY_RUN_ROWS consecutive items of one
//          layer (fewer at the list's end), grid-stride over
//          num_layers * ceil(num_items / KVT_COPY_RUN_ROWS) groups; lane l
//          checks item i0 + l; each run of items contiguous in both source
//          and pool moves as one block (warp_copy_entry_lines over the run).
//          A run never crosses a group.
// Held to four blocks an SM, as the other methods' kernels run: left free,
// ptxas gives it more than 64 registers at sm_80 (three blocks); at 64 it
// spills nothing (scripts/kernel-resources.sh).
extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS, 4)
    kvt_writeback_merged_runs(const kvt_writeback_params p) {
    kvt::writeback_merged_runs(p);
}

// kvt_writeback_bulk_runs — kvt_writeback with the copy method
// KVT_COPY_BULK_RUNS (contract: kvt_writeback_params in abi.h), sm_90 and
// later.
// Reads:   as kvt_writeback; source rows by bulk loads of whole runs.
// Writes:  as kvt_writeback, pool entries by bulk stores of whole runs; its
//          own shared memory.
// Assumes: as kvt_writeback, and dynamic shared memory of
//          bulk_smem_bytes(entry_bytes, blockDim.x / 32) bytes.
// Mapping: as kvt_writeback_merged_runs; each warp stages its groups in two
//          shared-memory stages of its own.
// Without the bulk engine (the sm_80 build), kvt_writeback_merged_runs.
extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS)
    kvt_writeback_bulk_runs(const kvt_writeback_params p) {
#ifdef KVT_HAS_BULK
    kvt::writeback_bulk_runs(p);
#else
    kvt::writeback_merged_runs(p);
#endif
}
