// bench/sglang-kernels/swap_in_harness.cu — a bench-only launcher of SGLang's
// own single-step HiSparse swap-in kernel (its hisparse.cuh, from the pinned
// SGLang wheel, never committed here), so that `kvtier bench` can time it
// beside kvtier's on identical inputs. Built by scripts/sglang-kernels.sh
// into the same library as spec_harness.cu (a translation unit of its own:
// SGLang's two headers define the same helpers).
//
// It takes kvtier's own parameter struct (kernels/abi.h) and launches SGLang's
// kernel as SGLang's host launcher does for each of its three single-step
// paths: one block of `block_size` threads per row with the kernel's
// shared-memory layout, the newest token's slot at `hot`, and the template
// arguments the path's Python entry point picks (hisparse.py):
//   - load_cache_to_device_buffer_mla (DSA decode): MLA, linear items;
//   - load_cache_to_device_buffer_dsv4_mla (DeepSeek-V4): MLA, the
//     page-padded C4 layout, whose row size the kernel fixes;
//   - load_blocks_to_device_buffer_mha (MiniMax-M3): K and V planes of linear
//     items, the query block ids of SPARSE_BLOCK_SIZE tokens.
// Only the bench grid's shapes are instantiated.
#include <kvcacheio/hisparse.cuh>

#include "abi.h"

namespace {

// One instantiation: SGLang's kernel for a path (IS_MLA, DSV4, BLOCKS of
// SPARSE tokens a query column) at TOP_K query columns over HOT slots.
template <int BLOCK, int TOP_K, int HOT, bool IS_MLA, bool DSV4, int SPARSE, bool BLOCKS, typename ReqT>
int launch(const kvt_swap_in_params& p, cudaStream_t stream) {
    using namespace sglang;
    auto kernel =
        load_cache_to_device_buffer_kernel<BLOCK, TOP_K, HOT, IS_MLA, DSV4, SPARSE, BLOCKS, false, false, int32_t, ReqT>;
    // SGLang sizes the shared memory by the entries a row resolves
    constexpr size_t smem = SmemLayout<TOP_K * (BLOCKS ? SPARSE : 1), HOT>::BYTES;
    if constexpr (smem > 48u * 1024u) {
        static const cudaError_t once = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (once != cudaSuccess) return (int)once;
    }
    // the MLA paths' second plane is 0 (kvtier's one-plane parameters): the
    // kernel's null V
    host::LaunchKernel(p.batch, BLOCK, stream, smem)(
        kernel, reinterpret_cast<const int32_t*>(p.top_k_tokens), reinterpret_cast<int32_t*>(p.device_buffer_tokens),
        reinterpret_cast<const int64_t*>(p.host_cache_locs), reinterpret_cast<const int32_t*>(p.device_buffer_locs),
        reinterpret_cast<const void*>(p.host_cache[0]), reinterpret_cast<const void*>(p.host_cache[1]),
        reinterpret_cast<void*>(p.device_buffer[0]), reinterpret_cast<void*>(p.device_buffer[1]),
        reinterpret_cast<int32_t*>(p.top_k_device_locs), reinterpret_cast<const ReqT*>(p.req_pool_indices),
        reinterpret_cast<const int32_t*>(p.seq_lens), reinterpret_cast<int16_t*>(p.lru_slots),
        reinterpret_cast<const int32_t*>(p.num_real_reqs), (int64_t)p.tokens_stride, (int64_t)p.host_stride,
        (int64_t)p.lru_stride, (int64_t)p.top_k_stride, (int64_t)p.out_stride, (int64_t)1,
        (int64_t)(p.items.value_bytes + p.items.scale_bytes), static_cast<int64_t*>(nullptr),
        static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr), (int64_t)0);
    return (int)cudaGetLastError();
}

// The block size and request-index type dispatched at run time; -1 for a
// block size not instantiated.
template <int TOP_K, int HOT, bool IS_MLA, bool DSV4, int SPARSE, bool BLOCKS>
int run(const kvt_swap_in_params& p, uint32_t block_size, cudaStream_t s) {
    const bool i64 = p.flags & KVT_SWAP_REQ_INDICES_I64;
    switch (block_size) {
        case 1024:
            return i64 ? launch<1024, TOP_K, HOT, IS_MLA, DSV4, SPARSE, BLOCKS, int64_t>(p, s)
                       : launch<1024, TOP_K, HOT, IS_MLA, DSV4, SPARSE, BLOCKS, int32_t>(p, s);
        case 960:
            return i64 ? launch<960, TOP_K, HOT, IS_MLA, DSV4, SPARSE, BLOCKS, int64_t>(p, s)
                       : launch<960, TOP_K, HOT, IS_MLA, DSV4, SPARSE, BLOCKS, int32_t>(p, s);
        default:
            return -1;
    }
}

// What every path's kernel assumes that kvtier's checks do not: one row
// stride for the slot tokens and rows, int32 lengths, the whole batch real or
// a num_real_reqs given.
bool sglang_layout(const kvt_swap_in_params& p) {
    return p.tokens_stride == p.locs_stride && !(p.flags & KVT_SWAP_SEQ_LENS_I64) && p.num_real_reqs != 0;
}

bool linear_items(const kvt_swap_in_params& p) { return p.items.page_shift == 0 && p.items.scale_bytes == 0; }

// What every entry point below does around its launch: -2 where the path's
// kernel cannot take the layout (`takes` false, or SGLang's common
// assumptions unmet), nothing for an empty batch, and nothing unwinding into
// the caller (SGLang's launcher throws on a launch error).
template <typename F>
int entry(const kvt_swap_in_params& p, bool takes, F launch) {
    if (!takes || !sglang_layout(p)) return -2;
    if (p.batch == 0) return 0;
    try {
        return launch();
    } catch (...) {
        const int e = (int)cudaGetLastError();
        return e != 0 ? e : -3;
    }
}

}  // namespace

// Each runs SGLang's swap-in for one path on `p` (kvtier's checked
// parameters for a swap-in without a caller's plan; the layout SGLang's
// kernel assumes, which kvtier's checks do not, is checked here) with blocks
// of `block_size` threads (1024, SGLang's benchmark, or 960, its
// coordinator's default), on `stream`. Returns 0, -1 for a shape this harness
// does not instantiate, -2 for a layout the path's kernel cannot take, else
// the CUDA error of the launch (-3: a launch error the runtime no longer
// reports).

// load_cache_to_device_buffer_mla: one plane of linear items, token queries;
// top-k 2048 at hot 4096 or 8192.
extern "C" int kvt_sglang_swap_in(const kvt_swap_in_params* p, uint32_t block_size, void* stream) {
    const bool takes = !(p->flags & KVT_SWAP_QUERY_BLOCKS) && p->host_cache[1] == 0 && linear_items(*p);
    auto s = static_cast<cudaStream_t>(stream);
    return entry(*p, takes, [&] {
        if (p->entries != 2048) return -1;
        switch (p->hot) {
            case 4096: return run<2048, 4096, true, false, 1, false>(*p, block_size, s);
            case 8192: return run<2048, 8192, true, false, 1, false>(*p, block_size, s);
            default: return -1;
        }
    });
}

// load_cache_to_device_buffer_dsv4_mla: one plane in the C4 layout SGLang's
// kernel hard-codes (its deepseek_v4/kvcacheio.cuh: pages of 64 rows, a
// 576-byte value run then an 8-byte scale run, padded to a multiple of 576
// bytes), token queries; top-k 512 or 1024 (DeepSeek-V4-Flash's and -Pro's
// index_topk) at hot 4096.
extern "C" int kvt_sglang_swap_in_dsv4(const kvt_swap_in_params* p, uint32_t block_size, void* stream) {
    namespace c4 = sglang::device::hisparse;
    const bool takes = !(p->flags & KVT_SWAP_QUERY_BLOCKS) && p->host_cache[1] == 0 &&
                       (int64_t)p->items.page_bytes == c4::kPageBytes && p->items.page_shift == c4::kPageBits &&
                       p->items.value_bytes == c4::kValueBytes && p->items.scale_bytes == c4::kScaleBytes;
    auto s = static_cast<cudaStream_t>(stream);
    return entry(*p, takes, [&] {
        if (p->hot != 4096) return -1;
        switch (p->entries) {
            case 512: return run<512, 4096, true, true, 1, false>(*p, block_size, s);
            case 1024: return run<1024, 4096, true, true, 1, false>(*p, block_size, s);
            default: return -1;
        }
    });
}

// load_blocks_to_device_buffer_mha: K and V planes of linear items, block
// queries; MiniMax-M3's 16 blocks of 128 tokens (its topk_blocks and
// sparse_block_size) at hot 4096.
extern "C" int kvt_sglang_swap_in_m3(const kvt_swap_in_params* p, uint32_t block_size, void* stream) {
    const bool takes = (p->flags & KVT_SWAP_QUERY_BLOCKS) && p->host_cache[1] != 0 && p->device_buffer[1] != 0 &&
                       linear_items(*p);
    auto s = static_cast<cudaStream_t>(stream);
    return entry(*p, takes, [&] {
        if (p->top_k != 16 || p->block_tokens != 128 || p->hot != 4096) return -1;
        return run<16, 4096, false, false, 128, true>(*p, block_size, s);
    });
}
