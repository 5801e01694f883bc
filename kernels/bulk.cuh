// kernels/bulk.cuh — the bulk-copy engine (sm_90's `cp.async.bulk`, the
// non-tensor form of the TMA unit) and the shared-memory barriers that count
// its bytes, for kernels that stage rows through shared memory instead of
// moving them through registers.
//
// A load (global -> shared) is one operation of any multiple of 16 bytes at
// 16-byte aligned addresses; the issuing thread names an mbarrier that
// counts the bytes as they land, and a thread that waits on the barrier's
// phase sees them. A store (shared -> global) joins the issuing thread's
// current bulk group; `commit` closes the group, `wait_read<N>` returns once
// all but the newest N groups have read their shared-memory source (so it
// may be written again), `wait_all` once every group's writes are done.
// Shared memory that ordinary stores wrote is seen by the bulk engine (the
// async proxy) only after the writing thread's `fence_async_shared()`.
//
// Only sm_90 and later have these instructions: code that uses them sits
// under KVT_HAS_BULK, which the sm_80 build lacks. The host emulation
// (tests/kernel_emu) defines it and runs every operation through the
// emulator, which performs a load only when a thread waits on its barrier,
// a store's read of shared memory only at a wait_read or wait_all of its
// group, and counts every misuse (a misaligned or out-of-range operation, a
// wait that can never complete, shared memory written without the fence
// before the engine reads it or while a store still reads it, a group never
// waited for before the thread ends): a kernel that skips a wait or a fence
// reads or writes the wrong bytes there, as it may on the GPU.
#pragma once

#include "common.cuh"

namespace kvt {
// The copy-method kernels that stage rows through shared memory
// (kvt_gather_bulk_runs, kvt_writeback_bulk_runs) carve it alike: two
// mbarriers a warp, rounded up so that the stages after them start at a
// 128-byte boundary, then two stages of KVT_COPY_RUN_ROWS entries a warp.
// The launchers size it the same (CopyMethod::bulk_smem_bytes in
// src/copy_method.rs; a test of the emulator holds the two equal).
__device__ __forceinline__ uint32_t bulk_barrier_bytes(uint32_t warps) { return (warps * 16u + 127u) & ~127u; }
__device__ __forceinline__ uint64_t bulk_smem_bytes(uint32_t entry_bytes, uint32_t warps) {
    return bulk_barrier_bytes(warps) + (uint64_t)warps * 2u * KVT_COPY_RUN_ROWS * entry_bytes;
}
}  // namespace kvt

#if defined(KVT_HOST_EMULATION) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900)
#define KVT_HAS_BULK 1
#endif

#ifdef KVT_HAS_BULK
namespace kvt::bulk {

#ifndef KVT_HOST_EMULATION
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// An mbarrier of `count` expected arrivals a phase; before any other thread
// or the bulk engine uses it, fence_barrier_init() and a barrier among the
// threads that use it.
__device__ __forceinline__ void barrier_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival that also expects `bytes` more bytes to land in this phase.
__device__ __forceinline__ void arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}
// Whether the phase of parity `parity` has completed (a bounded wait in the
// hardware; callers loop).
__device__ __forceinline__ bool try_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
    return done != 0;
}
// Global (the host-mapped pool included) -> shared, counted on `bar`.
__device__ __forceinline__ void load(void* smem_dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(smem_dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}
// Shared -> global, in the calling thread's open bulk group.
__device__ __forceinline__ void store(void* dst, const void* smem_src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(smem_src)),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// N is an immediate of the instruction.
template <int N>
__device__ __forceinline__ void wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// An ordinary 16-byte store into shared memory (one the fence above covers).
__device__ __forceinline__ void st_shared16(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }
#else
__device__ __forceinline__ void barrier_init(uint64_t* bar, uint32_t count) { kvt_emu_mbar_init(bar, count); }
__device__ __forceinline__ void fence_barrier_init() {}
__device__ __forceinline__ void arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
    kvt_emu_mbar_arrive_expect_tx(bar, bytes);
}
__device__ __forceinline__ bool try_wait(uint64_t* bar, uint32_t parity) { return kvt_emu_mbar_try_wait(bar, parity); }
__device__ __forceinline__ void load(void* smem_dst, const void* src, uint32_t bytes, uint64_t* bar) {
    kvt_emu_bulk_load(smem_dst, src, bytes, bar);
}
__device__ __forceinline__ void store(void* dst, const void* smem_src, uint32_t bytes) {
    kvt_emu_bulk_store(dst, smem_src, bytes);
}
__device__ __forceinline__ void commit() { kvt_emu_bulk_commit(); }
template <int N>
__device__ __forceinline__ void wait_read() {
    kvt_emu_bulk_wait(N, true);
}
__device__ __forceinline__ void wait_all() { kvt_emu_bulk_wait(0, false); }
__device__ __forceinline__ void fence_async_shared() { kvt_emu_fence_proxy_async(); }
__device__ __forceinline__ void st_shared16(void* p, uint4 v) { kvt_emu_st_shared(p, &v, 16); }
#endif

// Waits for the phase of parity `parity` of `bar`.
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
    while (!try_wait(bar, parity)) {
    }
}

// A warp's two stages of `stage_bytes` and their two barriers, carved from a
// block's area laid out as bulk_smem_bytes sizes it: every warp's two
// barriers first (bulk_barrier_bytes), then every warp's two stages. The
// stages alternate: fill k uses stage k % 2, and its loads complete the
// phase of parity (k / 2) % 2 of that stage's barrier.
struct WarpStages {
    uint64_t* bars;
    char* stages;
    uint32_t stage_bytes;

    __device__ __forceinline__ WarpStages(char* area, uint32_t warp, uint32_t warps, uint32_t bytes)
        : bars(reinterpret_cast<uint64_t*>(area) + 2 * warp),
          stages(area + bulk_barrier_bytes(warps) + (uint64_t)warp * 2u * bytes),
          stage_bytes(bytes) {}
    // By one thread of the warp, before the warp's first use (then a
    // __syncwarp where other lanes touch the stages).
    __device__ __forceinline__ void init() const {
        barrier_init(&bars[0], 1);
        barrier_init(&bars[1], 1);
        fence_barrier_init();
        fence_async_shared();  // the barriers, initialised, as the engine sees them
    }
    // Fill `fill`'s stage and barrier, and the parity its loads complete.
    __device__ __forceinline__ char* stage(uint32_t fill) const { return stages + (fill & 1u) * stage_bytes; }
    __device__ __forceinline__ uint64_t* bar(uint32_t fill) const { return &bars[fill & 1u]; }
    __device__ __forceinline__ void wait_loaded(uint32_t fill) const { wait(bar(fill), (fill >> 1) & 1u); }
};

}  // namespace kvt::bulk
#endif
