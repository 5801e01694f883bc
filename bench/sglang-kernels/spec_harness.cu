// bench/sglang-kernels/spec_harness.cu — a bench-only launcher of SGLang's
// own speculative HiSparse kernels (its hisparse_spec.cuh, from the pinned
// SGLang wheel, never committed here), so that `kvtier bench` can time them
// beside kvtier's on identical inputs. Built by scripts/sglang-kernels.sh
// into a shared library the bench loads when KVTIER_SGLANG_KERNELS names it.
//
// It takes kvtier's own parameter struct (kernels/abi.h) and launches SGLang's
// two kernels as SGLang's host launcher does: the gather kernel over a
// (batch, tiles) grid of 64-thread blocks, then the commit kernel over
// `batch` blocks of 512 threads with programmatic dependent launch on sm_90
// and newer. Only the shapes of the bench's grid are instantiated.
#include <kvcacheio/hisparse_spec.cuh>

#include "abi.h"

namespace {

constexpr int kGatherBlock = 64;  // SGLang's _GATHER_BLOCK_SIZE

template <int TOP_K, int HOT, int ITEM, int STEPS, bool PLAN>
int launch(const kvt_spec_swap_in_params& p, cudaStream_t stream) {
    using namespace sglang;
    constexpr int64_t total = STEPS * TOP_K;
    int32_t* policy = reinterpret_cast<int32_t*>(p.cache_policy);
    int32_t* state = reinterpret_cast<int32_t*>(p.scratch_state);
    int64_t* index = reinterpret_cast<int64_t*>(p.cache_index);
    const SpecCacheState cache{index,
                               index + p.bank_stride,
                               policy,
                               policy + p.policy_stride,
                               (int64_t)p.index_stride,
                               (int64_t)p.hash_size,
                               (int64_t)p.policy_stride};
    const SpecMissWorkspace work{reinterpret_cast<int32_t*>(p.scratch_locs),
                                 state + p.state_stride,
                                 state,
                                 (int64_t)p.scratch_stride,
                                 (int64_t)p.state_stride,
                                 (int64_t)p.num_requests};
    int64_t* src = PLAN ? reinterpret_cast<int64_t*>(p.plan_src) : nullptr;
    int32_t* dst = PLAN ? reinterpret_cast<int32_t*>(p.plan_dst) : nullptr;
    int32_t* cnt = PLAN ? reinterpret_cast<int32_t*>(p.plan_count) : nullptr;
    const int64_t plan_stride = PLAN ? (int64_t)p.plan_stride : 0;
    int device = 0, major = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    const uint32_t tiles = (uint32_t)((total + kGatherBlock - 1) / kGatherBlock);
    host::LaunchKernel(dim3(p.batch, tiles), kGatherBlock, stream)(
        load_cache_to_device_buffer_spec_gather_kernel<kGatherBlock, TOP_K, HOT, ITEM, STEPS, PLAN>,
        reinterpret_cast<const int32_t*>(p.top_k_tokens), reinterpret_cast<int32_t*>(p.device_buffer_tokens),
        reinterpret_cast<const int64_t*>(p.host_cache_locs), reinterpret_cast<int32_t*>(p.device_buffer_locs),
        reinterpret_cast<const void*>(p.host_cache), reinterpret_cast<void*>(p.device_buffer),
        reinterpret_cast<int32_t*>(p.top_k_device_locs), reinterpret_cast<const int64_t*>(p.req_pool_indices),
        reinterpret_cast<const int32_t*>(p.seq_lens), cache, work, reinterpret_cast<const int32_t*>(p.num_real_reqs),
        src, dst, cnt, (int64_t)p.tokens_stride, (int64_t)p.host_stride, (int64_t)p.top_k_stride,
        (int64_t)p.out_stride, plan_stride, (int64_t)p.page);
    auto commit = [&](auto pdl) {
        host::LaunchKernel(dim3(p.batch), 512, stream)
            .enable_pdl(decltype(pdl)::value)(
                load_cache_to_device_buffer_spec_commit_kernel<TOP_K, HOT, ITEM, STEPS, PLAN, decltype(pdl)::value>,
                reinterpret_cast<const int32_t*>(p.top_k_tokens), reinterpret_cast<int32_t*>(p.top_k_device_locs),
                reinterpret_cast<int32_t*>(p.device_buffer_tokens), reinterpret_cast<int32_t*>(p.device_buffer_locs),
                reinterpret_cast<const int64_t*>(p.host_cache_locs), reinterpret_cast<const void*>(p.host_cache),
                reinterpret_cast<void*>(p.device_buffer), reinterpret_cast<const int64_t*>(p.req_pool_indices),
                cache, work, reinterpret_cast<const int32_t*>(p.num_real_reqs), src, dst, cnt,
                (int64_t)p.top_k_stride, (int64_t)p.out_stride, (int64_t)p.tokens_stride, (int64_t)p.host_stride,
                plan_stride);
    };
    if (major >= 9)
        commit(std::true_type{});
    else
        commit(std::false_type{});
    return (int)cudaGetLastError();
}

template <int TOP_K, int HOT, int ITEM, int STEPS>
int with_plan(const kvt_spec_swap_in_params& p, cudaStream_t s) {
    return p.plan_count != 0 ? launch<TOP_K, HOT, ITEM, STEPS, true>(p, s) : launch<TOP_K, HOT, ITEM, STEPS, false>(p, s);
}

template <int TOP_K, int HOT, int ITEM>
int with_steps(const kvt_spec_swap_in_params& p, cudaStream_t s) {
    switch (p.steps) {
        case 2: return with_plan<TOP_K, HOT, ITEM, 2>(p, s);
        case 4: return with_plan<TOP_K, HOT, ITEM, 4>(p, s);
        default: return -1;
    }
}

}  // namespace

// Runs SGLang's speculative swap-in on `p` (kvtier's checked parameters; its
// layout assumptions, which kvtier's checks do not make, are checked here:
// one row stride for the slot tokens and rows, a contiguous scratch, int64
// request indices and int32 lengths, linear items) on `stream`. Returns 0,
// -1 for a shape this harness does not instantiate (steps 2 or 4, top-k
// 2048, hot 4096, 576- or 656-byte items), -2 for a layout SGLang's kernel
// cannot take, else the CUDA error of the launch (-3: a launch error the
// runtime no longer reports).
extern "C" int kvt_sglang_spec_swap_in(const kvt_spec_swap_in_params* p, void* stream) {
    if (p->tokens_stride != p->locs_stride || p->scratch_stride != p->scratch_capacity ||
        !(p->flags & KVT_SWAP_REQ_INDICES_I64) || (p->flags & KVT_SWAP_SEQ_LENS_I64) || p->items.page_shift != 0 ||
        p->items.scale_bytes != 0)
        return -2;
    if (p->batch == 0) return 0;
    auto s = static_cast<cudaStream_t>(stream);
    if (p->top_k != 2048 || p->hot != 4096) return -1;
    try {  // SGLang's launcher throws on a launch error; nothing may unwind into the caller
        switch (p->items.value_bytes) {
            case 576: return with_steps<2048, 4096, 576>(*p, s);
            case 656: return with_steps<2048, 4096, 656>(*p, s);
            default: return -1;
        }
    } catch (...) {
        const int e = (int)cudaGetLastError();
        return e != 0 ? e : -3;
    }
}
