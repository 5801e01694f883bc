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
// Two entry points, one per copy method (kvt_writeback_line_aligned for
// KVT_COPY_LINE_ALIGNED), as the gather has.
namespace kvt {
template <bool LineAligned>
__device__ __forceinline__ void writeback(const kvt_writeback_params& p) {
    const uint32_t lane = threadIdx.x % KVT_WARP;
    const uint64_t rows = (uint64_t)p.num_layers * p.num_items;
    const int32_t* item_slots = reinterpret_cast<const int32_t*>(p.item_slots);
    const int32_t* item_tokens = reinterpret_cast<const int32_t*>(p.item_tokens);
    const int64_t* item_src_rows = reinterpret_cast<const int64_t*>(p.item_src_rows);
    const uint64_t* slot_bases = reinterpret_cast<const uint64_t*>(p.slot_bases);
    const uint64_t* src_layer_bases = reinterpret_cast<const uint64_t*>(p.src_layer_bases);
    kvt_error_word* err = reinterpret_cast<kvt_error_word*>(p.error);

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
}  // namespace kvt

extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS) kvt_writeback(const kvt_writeback_params p) {
    kvt::writeback<false>(p);
}
extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS)
    kvt_writeback_line_aligned(const kvt_writeback_params p) {
    kvt::writeback<true>(p);
}
