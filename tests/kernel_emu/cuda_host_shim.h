// tests/kernel_emu/cuda_host_shim.h — just enough of CUDA for the kvtier
// kernels to compile as host C++ (force-included by g++ before them). The
// emulator (emulator.cpp) runs each thread of a block as a fiber on one host
// thread and switches fibers only at __syncthreads() and at thread exit. That
// is faithful for these kernels: they use no warp shuffles or votes, threads
// of a block exchange data only through shared memory across barriers, every
// destination byte has one writer, and shared counters (the error word, the
// planning hash table, the speculative swap-in's miss table and CLOCK) change
// only through atomics, which cannot interleave here. The speculative swap-in
// takes unique-miss ordinals and victims in whatever order its threads come
// (as SGLang's kernel does); the emulation runs several orders, the tests
// check what must hold in every one.
#pragma once

#include <stddef.h>
#include <stdint.h>

#define KVT_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)

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

// Fibers switch only at barriers: plain read-modify-writes are atomic.
inline unsigned atomicOr(unsigned* a, unsigned v) {
    unsigned old = *a;
    *a = old | v;
    return old;
}
inline unsigned atomicAdd(unsigned* a, unsigned v) {
    unsigned old = *a;
    *a = old + v;
    return old;
}
inline unsigned long long atomicMin(unsigned long long* a, unsigned long long v) {
    unsigned long long old = *a;
    *a = v < old ? v : old;
    return old;
}
inline unsigned atomicMin(unsigned* a, unsigned v) {
    unsigned old = *a;
    *a = v < old ? v : old;
    return old;
}
inline int atomicMin(int* a, int v) {
    int old = *a;
    *a = v < old ? v : old;
    return old;
}
inline int atomicCAS(int* a, int compare, int v) {
    int old = *a;
    if (old == compare) *a = v;
    return old;
}
inline int atomicExch(int* a, int v) {
    int old = *a;
    *a = v;
    return old;
}
inline int atomicOr(int* a, int v) {
    int old = *a;
    *a = old | v;
    return old;
}
inline unsigned long long atomicCAS(unsigned long long* a, unsigned long long compare, unsigned long long v) {
    unsigned long long old = *a;
    if (old == compare) *a = v;
    return old;
}
inline unsigned long long atomicExch(unsigned long long* a, unsigned long long v) {
    unsigned long long old = *a;
    *a = v;
    return old;
}
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }

// Atomics on global memory ask first: true when the bytes lie inside memory
// the call may write (counted as out of range, and skipped, otherwise).
extern "C" bool kvt_emu_atomic(void* p, unsigned bytes);

// A block-wide barrier: the calling fiber waits until every live thread of
// the block has reached one.
extern "C" void kvt_emu_syncthreads();
#define __syncthreads() kvt_emu_syncthreads()

// The launch's dynamic shared memory (exactly the requested bytes, then a
// guard the emulator checks after each block).
extern thread_local unsigned char* kvt_emu_smem;
#define kvt_dynamic_smem kvt_emu_smem

// Every vector load and store of the kernels goes through these: they check
// alignment and that the bytes lie inside a range the test allowed, count a
// violation (and skip the access) otherwise.
extern "C" void kvt_emu_load(const void* p, void* v, unsigned bytes);
extern "C" void kvt_emu_store(void* p, const void* v, unsigned bytes);
