// kernels/writeback.cu — layer-first writeback from HBM KV buffers into the
// host-mapped pool.
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
        const uint32_t layer_i = (uint32_t)(g / groups_per_layer);
        const uint32_t i0 = (uint32_t)(g - (uint64_t)layer_i * groups_per_layer) * KVT_COPY_RUN_ROWS;
        const uint32_t n = min(KVT_COPY_RUN_ROWS, p.num_items - i0);
        const uint32_t item = i0 + lane;  // lane's item, one of the group's when lane < n
        const bool mine = lane < n;

        // Each lane loads its item's three indices together (each inside its
        // array), then checks and reports them as kvt_writeback does.
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

        // An item joins the run of the item before it when both move to one
        // slot and its token and source row are the next ones (both checked
        // in range: no overflow).
        const uint32_t prev = lane == 0 ? 0 : lane - 1;
        const int32_t slot_before = (int32_t)kvt::warp_read((uint32_t)slot, prev);
        const int32_t token_before = (int32_t)kvt::warp_read((uint32_t)token, prev);
        const int64_t row_before = (int64_t)kvt::warp_read64((uint64_t)src_row, prev);
        const uint32_t rows = kvt::warp_ballot(moves);
        const bool joins = merge && moves && lane > 0 && ((rows >> prev) & 1u) != 0 && slot == slot_before &&
                           token == token_before + 1 && src_row == row_before + 1;
        const uint32_t join_mask = kvt::warp_ballot(joins);
        if (rows == 0) continue;

        // Each lane's row addresses (the indices die here: what the runs
        // need of them is the run's first row's two addresses).
        const uint64_t src_buf = a.src_layer_bases != nullptr ? kvt::ld(a.src_layer_bases + layer_i) : p.src_base;
        const uint64_t src = src_buf + (uint64_t)src_row * p.entry_bytes;
        const uint64_t dst =
            base + (uint64_t)(p.first_layer + layer_i) * p.layer_bytes + (uint64_t)token * p.entry_bytes;
        kvt::for_each_run(rows, join_mask, [&](uint32_t first, uint32_t count) {
            kvt::warp_copy_entry_lines<kvt::DeviceToPool, KVT_UNROLL, true>(
                reinterpret_cast<const char*>(kvt::warp_read64(src, first)),
                reinterpret_cast<char*>(kvt::warp_read64(dst, first)), count * p.entry_bytes, lane);
        });
    }
}
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
