// bench/sglang-kernels/swap_in_harness.cu — a bench-only launcher of SGLang's
// own single-step HiSparse swap-in kernel (its hisparse.cuh, from the pinned
// SGLang wheel, never committed here), so that `kvtier bench` can time it
// beside kvtier's on identical inputs. Built by scripts/sglang-kernels.sh
// into the same library as spec_harness.cu (a translation unit of its own:
// SGLang's two headers define the same helpers).
//
// It takes kvtier's own parameter struct (kernels/abi.h) and launches SGLang's
// kernel as SGLang's host launcher does for DSA decode (MLA, linear items):
// one block of `block_size` threads per row with the kernel's shared-memory
// layout, the newest token's slot at `hot`. Only the bench grid's shapes are
// instantiated.
#include <kvcacheio/hisparse.cuh>

#include "abi.h"

namespace {

template <int BLOCK, int TOP_K, int HOT, typename ReqT>
int launch(const kvt_swap_in_params& p, cudaStream_t stream) {
    using namespace sglang;
    auto kernel = load_cache_to_device_buffer_kernel<BLOCK, TOP_K, HOT, true, false, 1, false, false, false, int32_t, ReqT>;
    constexpr size_t smem = SmemLayout<TOP_K, HOT>::BYTES;
    if constexpr (smem > 48u * 1024u) {
        static const cudaError_t once = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (once != cudaSuccess) return (int)once;
    }
    host::LaunchKernel(p.batch, BLOCK, stream, smem)(
        kernel, reinterpret_cast<const int32_t*>(p.top_k_tokens), reinterpret_cast<int32_t*>(p.device_buffer_tokens),
        reinterpret_cast<const int64_t*>(p.host_cache_locs), reinterpret_cast<const int32_t*>(p.device_buffer_locs),
        reinterpret_cast<const void*>(p.host_cache[0]), static_cast<const void*>(nullptr),
        reinterpret_cast<void*>(p.device_buffer[0]), static_cast<void*>(nullptr),
        reinterpret_cast<int32_t*>(p.top_k_device_locs), reinterpret_cast<const ReqT*>(p.req_pool_indices),
        reinterpret_cast<const int32_t*>(p.seq_lens), reinterpret_cast<int16_t*>(p.lru_slots),
        reinterpret_cast<const int32_t*>(p.num_real_reqs), (int64_t)p.tokens_stride, (int64_t)p.host_stride,
        (int64_t)p.lru_stride, (int64_t)p.top_k_stride, (int64_t)p.out_stride, (int64_t)1, (int64_t)p.items.value_bytes,
        static_cast<int64_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr), (int64_t)0);
    return (int)cudaGetLastError();
}

template <int BLOCK, int HOT>
int with_req(const kvt_swap_in_params& p, cudaStream_t s) {
    return (p.flags & KVT_SWAP_REQ_INDICES_I64) ? launch<BLOCK, 2048, HOT, int64_t>(p, s)
                                                : launch<BLOCK, 2048, HOT, int32_t>(p, s);
}

template <int BLOCK>
int with_hot(const kvt_swap_in_params& p, cudaStream_t s) {
    switch (p.hot) {
        case 4096: return with_req<BLOCK, 4096>(p, s);
        case 8192: return with_req<BLOCK, 8192>(p, s);
        default: return -1;
    }
}

}  // namespace

// Runs SGLang's swap-in on `p` (kvtier's checked parameters for a token
// query without a caller's plan; the layout SGLang's kernel assumes, which
// kvtier's checks do not, is checked here: one row stride for the slot tokens
// and rows, int32 lengths, linear items, one plane, the whole batch real or a
// num_real_reqs given) with blocks of `block_size` threads (1024, SGLang's
// benchmark, or 960, its coordinator's default), on `stream`. Returns 0, -1
// for a shape this harness does not instantiate (top-k 2048, hot 4096 or
// 8192), -2 for a layout SGLang's kernel cannot take, else the CUDA error of
// the launch (-3: a launch error the runtime no longer reports).
extern "C" int kvt_sglang_swap_in(const kvt_swap_in_params* p, uint32_t block_size, void* stream) {
    if (p->tokens_stride != p->locs_stride || (p->flags & KVT_SWAP_SEQ_LENS_I64) ||
        (p->flags & KVT_SWAP_QUERY_BLOCKS) || p->host_cache[1] != 0 || p->items.page_shift != 0 ||
        p->items.scale_bytes != 0 || p->num_real_reqs == 0)
        return -2;
    if (p->batch == 0) return 0;
    if (p->entries != 2048) return -1;
    auto s = static_cast<cudaStream_t>(stream);
    try {  // SGLang's launcher throws on a launch error; nothing may unwind into the caller
        switch (block_size) {
            case 1024: return with_hot<1024>(*p, s);
            case 960: return with_hot<960>(*p, s);
            default: return -1;
        }
    } catch (...) {
        const int e = (int)cudaGetLastError();
        return e != 0 ? e : -3;
    }
}
