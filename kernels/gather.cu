// kernels/gather.cu — top-k sparse gather from the host-mapped pool into HBM.
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
// Two entry points, one per copy method (kvt_gather_line_aligned for
// KVT_COPY_LINE_ALIGNED): in one kernel the second method's registers would
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
}  // namespace kvt

extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS) kvt_gather(const kvt_gather_params p) {
    kvt::gather<false>(p);
}
extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS) kvt_gather_line_aligned(const kvt_gather_params p) {
    kvt::gather<true>(p);
}
