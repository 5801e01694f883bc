// tests/kernel_emu/cuda_host_shim.h — just enough of CUDA for the kvtier
// kernels to compile as host C++ (force-included by g++ before them). The
// emulator (emulator.cpp) runs each thread of a block as a fiber on one host
// thread. Fibers switch at __syncthreads() (and its voting forms), at warp
// votes and shuffles, where the lanes of a warp meet and exchange values in
// lock step as the hardware's do, and at thread exit; under the shuffled
// schedules also, at random, at every global access and every atomic. So
// an atomic is one indivisible step, as on the hardware, but atomics of
// different threads interleave in many orders between barriers; a kernel
// whose result depends on that order (the planning hash table's insertions,
// the speculative swap-in's miss table and CLOCK, which SGLang's kernel
// orders by thread timing too) is checked by the tests on what must hold in
// every order. Plain shared-memory loads and stores are not switch points;
// races between them (and between plain global accesses) are found by the
// race detector instead, the emulator built with ThreadSanitizer
// (emulator.cpp), which judges orderings, not the order threads ran in.
#pragma once

#include <stddef.h>
#include <stdint.h>

#define KVT_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __noinline__ __attribute__((noinline))

struct dim3 {
    unsigned x, y, z;
};
// The emulated thread's coordinates, set by the emulator before each call
// (thread-local: test threads emulate independent launches concurrently).
extern thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

// A possible switch to another thread (shuffled schedules only): before
// every atomic and every global access.
extern "C" void kvt_emu_maybe_switch();
#define KVT_EMU_ATOMIC_POINT kvt_emu_maybe_switch()

// Atomics: a possible switch, then the read-modify-write, which no other
// fiber can interrupt. They are __atomic builtins so that the race detector
// (emulator.cpp) sees atomics, not plain accesses; relaxed, as CUDA's are.
template <class T>
inline T kvt_emu_fetch_min(T* a, T v) {
    T old = __atomic_load_n(a, __ATOMIC_RELAXED);
    while (v < old && !__atomic_compare_exchange_n(a, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
template <class T>
inline T kvt_emu_cas(T* a, T compare, T v) {
    __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return compare;  // the value found: `compare` when the swap happened
}
inline unsigned atomicOr(unsigned* a, unsigned v) {
    KVT_EMU_ATOMIC_POINT;
    return __atomic_fetch_or(a, v, __ATOMIC_RELAXED);
}
inline unsigned atomicAdd(unsigned* a, unsigned v) {
    KVT_EMU_ATOMIC_POINT;
    return __atomic_fetch_add(a, v, __ATOMIC_RELAXED);
}
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
    KVT_EMU_ATOMIC_POINT;
    return __atomic_fetch_add(a, v, __ATOMIC_RELAXED);
}
inline unsigned long long atomicMin(unsigned long long* a, unsigned long long v) {
    KVT_EMU_ATOMIC_POINT;
    return kvt_emu_fetch_min(a, v);
}
inline unsigned atomicMin(unsigned* a, unsigned v) {
    KVT_EMU_ATOMIC_POINT;
    return kvt_emu_fetch_min(a, v);
}
inline int atomicMin(int* a, int v) {
    KVT_EMU_ATOMIC_POINT;
    return kvt_emu_fetch_min(a, v);
}
inline int atomicCAS(int* a, int compare, int v) {
    KVT_EMU_ATOMIC_POINT;
    return kvt_emu_cas(a, compare, v);
}
inline unsigned atomicCAS(unsigned* a, unsigned compare, unsigned v) {
    KVT_EMU_ATOMIC_POINT;
    return kvt_emu_cas(a, compare, v);
}
inline int atomicExch(int* a, int v) {
    KVT_EMU_ATOMIC_POINT;
    return __atomic_exchange_n(a, v, __ATOMIC_RELAXED);
}
inline unsigned atomicExch(unsigned* a, unsigned v) {
    KVT_EMU_ATOMIC_POINT;
    return __atomic_exchange_n(a, v, __ATOMIC_RELAXED);
}
inline int atomicOr(int* a, int v) {
    KVT_EMU_ATOMIC_POINT;
    return __atomic_fetch_or(a, v, __ATOMIC_RELAXED);
}
inline unsigned long long atomicCAS(unsigned long long* a, unsigned long long compare, unsigned long long v) {
    KVT_EMU_ATOMIC_POINT;
    return kvt_emu_cas(a, compare, v);
}
inline unsigned long long atomicExch(unsigned long long* a, unsigned long long v) {
    KVT_EMU_ATOMIC_POINT;
    return __atomic_exchange_n(a, v, __ATOMIC_RELAXED);
}
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }

// Atomics on global memory ask first: true when the bytes lie inside memory
// the call may write (counted as out of range, and skipped, otherwise).
extern "C" bool kvt_emu_atomic(void* p, unsigned bytes);
// A checked load or store of 4 or 8 bytes as one relaxed atomic (ld_racy, st_racy).
extern "C" void kvt_emu_load_atomic(const void* p, void* v, unsigned bytes);
extern "C" void kvt_emu_store_atomic(void* p, const void* v, unsigned bytes);

// A block-wide barrier: the calling fiber waits until every live thread of
// the block has reached one; kind 1/2/3 returns the OR/AND/count of the
// threads' predicates.
extern "C" int kvt_emu_syncthreads(int kind, int pred);
#define __syncthreads() ((void)kvt_emu_syncthreads(0, 0))
#define __syncthreads_or(pred) kvt_emu_syncthreads(1, (pred))
#define __syncthreads_and(pred) kvt_emu_syncthreads(2, (pred))
#define __syncthreads_count(pred) kvt_emu_syncthreads(3, (pred))

// Warp operations: every lane of `mask` meets at the call (the emulator
// counts a warp operation some lane of the mask never reaches), then each
// gets what the hardware gives it.
#define KVT_EMU_SYNCWARP 0
#define KVT_EMU_BALLOT 1
#define KVT_EMU_ANY 2
#define KVT_EMU_ALL 3
#define KVT_EMU_SHFL 4
extern "C" uint64_t kvt_emu_warp_op(int op, unsigned mask, uint64_t value, unsigned arg);
inline unsigned __ballot_sync(unsigned mask, int pred) {
    return (unsigned)kvt_emu_warp_op(KVT_EMU_BALLOT, mask, pred != 0, 0);
}
inline int __any_sync(unsigned mask, int pred) { return (int)kvt_emu_warp_op(KVT_EMU_ANY, mask, pred != 0, 0); }
inline int __all_sync(unsigned mask, int pred) { return (int)kvt_emu_warp_op(KVT_EMU_ALL, mask, pred != 0, 0); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)kvt_emu_warp_op(KVT_EMU_SYNCWARP, mask, 0, 0); }
inline unsigned __shfl_sync(unsigned mask, unsigned v, int src) {
    return (unsigned)kvt_emu_warp_op(KVT_EMU_SHFL, mask, v, (unsigned)src);
}
inline int __shfl_sync(unsigned mask, int v, int src) {
    return (int)(unsigned)kvt_emu_warp_op(KVT_EMU_SHFL, mask, (unsigned)v, (unsigned)src);
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned)v); }

// The launch's dynamic shared memory (exactly the requested bytes, then a
// guard the emulator checks after each block).
extern thread_local unsigned char* kvt_emu_smem;
#define kvt_dynamic_smem kvt_emu_smem

// Every vector load and store of the kernels goes through these: they check
// alignment and that the bytes lie inside a range the test allowed, count a
// violation (and skip the access) otherwise.
extern "C" void kvt_emu_load(const void* p, void* v, unsigned bytes);
extern "C" void kvt_emu_store(void* p, const void* v, unsigned bytes);

// griddepcontrol.launch_dependents: counted, so the tests see which launches
// let a programmatic successor start.
extern "C" void kvt_emu_allow_dependents();
extern "C" void kvt_emu_cluster_sync();
extern "C" unsigned kvt_emu_cluster_rank();
extern "C" unsigned kvt_emu_cluster_size();
extern "C" void kvt_emu_cluster_arrive();
extern "C" void kvt_emu_cluster_arrive_relaxed();
extern "C" void kvt_emu_cluster_wait();
extern "C" void* kvt_emu_cluster_map(const void* p, unsigned rank, unsigned bytes);

// The bulk-copy engine and its barriers (kernels/bulk.cuh). A bulk load is
// performed when a thread waits on its barrier's phase, a bulk store's read
// of shared memory at a wait for its group; every misuse is counted (the
// report's bulk_misuse). st_shared is an ordinary shared store the emulator
// tracks until the writing thread's fence_proxy_async.
extern "C" void kvt_emu_mbar_init(void* bar, unsigned count);
extern "C" void kvt_emu_mbar_arrive_expect_tx(void* bar, unsigned bytes);
extern "C" bool kvt_emu_mbar_try_wait(void* bar, unsigned parity);
extern "C" void kvt_emu_bulk_load(void* smem_dst, const void* src, unsigned bytes, void* bar);
extern "C" void kvt_emu_bulk_store(void* dst, const void* smem_src, unsigned bytes);
extern "C" void kvt_emu_bulk_commit();
extern "C" void kvt_emu_bulk_wait(unsigned newest_pending, bool read_only);
extern "C" void kvt_emu_fence_proxy_async();
extern "C" void kvt_emu_st_shared(void* p, const void* v, unsigned bytes);
