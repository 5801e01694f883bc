// tests/kernel_emu/cuda_host_shim.h — just enough of CUDA for the kvtier
// kernels to compile as host C++ (force-included by g++ before them). The
// kernels then run one emulated thread at a time (emulator.cpp). That is
// faithful for these kernels: lanes never communicate (no shuffles, no shared
// memory, no barriers), every destination byte has one writer, and the only
// shared state, the error word, is updated with commutative atomics.
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

// One thread at a time: plain read-modify-writes are atomic.
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

// Every vector load and store of the kernels goes through these: they check
// alignment and that the bytes lie inside a range the test allowed, count a
// violation (and skip the access) otherwise.
extern "C" void kvt_emu_load(const void* p, void* v, unsigned bytes);
extern "C" void kvt_emu_store(void* p, const void* v, unsigned bytes);
