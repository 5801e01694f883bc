// kernels/common.cuh — helpers shared by the kvtier kernels: vector loads and
// stores with the cache behaviour each direction wants, a warp-cooperative
// entry copy that picks its access width per entry, and error reporting into
// the device-side error word.
#pragma once

#include "abi.h" // and the fixed-width integer types

// Threads per block for every kvtier kernel; host launchers use the same value
// (BLOCK_THREADS in src/cuda/kernels.rs).
#define KVT_BLOCK_THREADS 256
#define KVT_WARP 32
// 16-byte vectors each lane keeps in flight per pass over an entry: a warp
// issues up to 32 * 4 * 16 = 2 KiB of loads before its first store, which
// covers a 1152-byte entry in one pass.
#define KVT_UNROLL 4

// Dynamic shared memory of the launch; kernels carve it up themselves.
#ifndef KVT_HOST_EMULATION
extern __shared__ __align__(16) unsigned char kvt_dynamic_smem[];
#endif

namespace kvt {

// Vector loads and stores. On the device they are the PTX below. A host build
// with KVT_HOST_EMULATION (tests/kernel_emu: the kernels run one emulated
// thread at a time under g++) routes every access through the emulator, which
// checks alignment and bounds before it touches memory.
//
// The loads are weak `ld.global` with L1::no_allocate (single-use data stays
// out of L1), not `ld.global.nc`: ptxas may move a store above a later .nc
// load (no ordering is owed to the read-only path), and in SASS for sm_90 it
// does, placing the first store of a pass right after its own load; the warp
// then waits one PCIe round trip before issuing the rest of the pass. With
// weak loads every load of a pass is issued before the first store (checked
// with cuobjdump -sass).
#ifndef KVT_HOST_EMULATION
__device__ __forceinline__ uint4 load16(const void* p) {
    uint4 v;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 load8(const void* p) {
    uint2 v;
    asm volatile("ld.global.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
#define KVT_STORE16(qual, p, v)                                                                  \
    asm volatile("st.global." qual ".v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"((v).x), "r"((v).y), \
                 "r"((v).z), "r"((v).w)                                                          \
                 : "memory")
#define KVT_STORE8(qual, p, v) \
    asm volatile("st.global." qual ".v2.u32 [%0], {%1,%2};" ::"l"(p), "r"((v).x), "r"((v).y) : "memory")
#else
__device__ __forceinline__ uint4 load16(const void* p) {
    uint4 v;
    kvt_emu_load(p, &v, 16);
    return v;
}
__device__ __forceinline__ uint2 load8(const void* p) {
    uint2 v;
    kvt_emu_load(p, &v, 8);
    return v;
}
#define KVT_STORE16(qual, p, v) kvt_emu_store((p), &(v), 16)
#define KVT_STORE8(qual, p, v) kvt_emu_store((p), &(v), 8)
#endif

// Scalar global loads and stores of indices and state. Every global access
// the kernels make goes through these or the vector helpers above, so the
// host emulation checks each one against the memory the call may touch.
template <class T>
__device__ __forceinline__ T ld(const T* p) {
#ifdef KVT_HOST_EMULATION
    T v;
    kvt_emu_load(p, &v, sizeof(T));
    return v;
#else
    return *p;
#endif
}
template <class T>
__device__ __forceinline__ void st(T* p, T v) {
#ifdef KVT_HOST_EMULATION
    kvt_emu_store(p, &v, sizeof(T));
#else
    *p = v;
#endif
}

// Atomic exchange of a global word, checked by the host emulation like
// every other global access (a refused one returns the new value and
// changes nothing).
template <class T>
__device__ __forceinline__ T exchange(T* p, T v) {
#ifdef KVT_HOST_EMULATION
    if (!kvt_emu_atomic(p, sizeof(T))) return v;
#endif
    return atomicExch(p, v);
}

// Loads and stores of global words that other threads of the grid update
// with atomics in the same launch, where a stale value is part of the design
// (a CAS that follows decides). Volatile on the device, so each is one
// strong access, never merged or cached in a register; in the host
// emulation an atomic, so the race detector tells them from plain accesses.
template <class T>
__device__ __forceinline__ T ld_racy(const T* p) {
#ifdef KVT_HOST_EMULATION
    T v;
    kvt_emu_load_atomic(p, &v, sizeof(T));
    return v;
#else
    return *reinterpret_cast<const volatile T*>(p);
#endif
}
template <class T>
__device__ __forceinline__ void st_racy(T* p, T v) {
#ifdef KVT_HOST_EMULATION
    kvt_emu_store_atomic(p, &v, sizeof(T));
#else
    *reinterpret_cast<volatile T*>(p) = v;
#endif
}

// Element i of an int32 or int64 (is_i64) index array: SGLang passes
// req_pool_indices and seq_lens as either. I: the caller's index type (its
// width is the address arithmetic's).
template <class I>
__device__ __forceinline__ int64_t load_index(kvt_addr base, I i, bool is_i64) {
    return is_i64 ? ld(reinterpret_cast<const int64_t*>(base) + i)
                  : (int64_t)ld(reinterpret_cast<const int32_t*>(base) + i);
}

// Whether row is one of `rows` rows: every row a kernel follows is checked.
__device__ __forceinline__ bool in_rows(int64_t row, uint64_t rows) { return row >= 0 && (uint64_t)row < rows; }

// The rows below num_real_reqs[0] = given (the rest are CUDA-graph padding):
// a value above the batch makes every row real (a sub-batch of a larger
// step, as SGLang reads it), a negative one none (the caller reports it).
__device__ __forceinline__ uint32_t real_rows_of(int32_t given, uint32_t batch) {
    return given < 0 ? 0u : ((uint32_t)given > batch ? batch : (uint32_t)given);
}

// Gather: loads from the host-mapped pool, stores into HBM with .cg, which
// skips L1 and keeps the lines in L2, where the attention kernel that runs
// next reads them.
struct PoolToDevice {
    static __device__ __forceinline__ uint4 load16(const void* p) { return kvt::load16(p); }
    static __device__ __forceinline__ uint2 load8(const void* p) { return kvt::load8(p); }
    static __device__ __forceinline__ void store16(void* p, uint4 v) { KVT_STORE16("cg", p, v); }
    static __device__ __forceinline__ void store8(void* p, uint2 v) { KVT_STORE8("cg", p, v); }
};

// Writeback: loads from an HBM KV buffer, stores into the host-mapped pool
// with .cs (evict-first): the GPU never reads those lines back.
struct DeviceToPool {
    static __device__ __forceinline__ uint4 load16(const void* p) { return kvt::load16(p); }
    static __device__ __forceinline__ uint2 load8(const void* p) { return kvt::load8(p); }
    static __device__ __forceinline__ void store16(void* p, uint4 v) { KVT_STORE16("cs", p, v); }
    static __device__ __forceinline__ void store8(void* p, uint2 v) { KVT_STORE8("cs", p, v); }
};

// Copies one entry of `bytes` (a multiple of 8) from src to dst with the whole
// warp; every lane must call it with the same arguments. Alignment is decided
// here, per entry: when src and dst sit at the same offset modulo 16 the body
// moves in 16-byte vectors with an 8-byte head and/or tail; otherwise (entry
// sizes such as 584 put every other entry at 8 mod 16) the entry moves in
// 8-byte pieces. All loads of a pass are issued before its stores so that many
// requests are in flight on the link; a pass is U vectors per lane (512 * U
// bytes). With `parts` > 1 the passes are shared among that many warps: this
// one makes passes part, part + parts, ..., and part 0 also the head and tail
// (a kernel held to few registers moves a row in passes of U = 1, one per
// warp, over several warps).
template <class P, uint32_t U = KVT_UNROLL>
__device__ __forceinline__ void warp_copy_entry(const char* __restrict__ src, char* __restrict__ dst,
                                                uint32_t bytes, uint32_t lane, uint32_t part = 0,
                                                uint32_t parts = 1) {
    const uint32_t src_phase = (uint32_t)(uintptr_t)src & 15u;
    const uint32_t dst_phase = (uint32_t)(uintptr_t)dst & 15u;
    if (src_phase == dst_phase) {
        const uint32_t head = src_phase;  // 0 or 8
        const uint32_t body = (bytes - head) & ~15u;
        const uint32_t tail = bytes - head - body;  // 0 or 8
        // The 8-byte head (lane 0) and tail (lane 1), in one register pair.
        const bool edge = part == 0 && ((lane == 0 && head != 0) || (lane == 1 && tail != 0));
        const uint32_t edge_at = lane == 0 ? 0 : head + body;
        uint2 edge_v = make_uint2(0, 0);
        if (edge) edge_v = P::load8(src + edge_at);
        const uint4* s = reinterpret_cast<const uint4*>(src + head);
        uint4* d = reinterpret_cast<uint4*>(dst + head);
        const uint32_t n = body >> 4;
        for (uint32_t base = part * KVT_WARP * U; base < n; base += parts * KVT_WARP * U) {
            uint4 v[U];
#pragma unroll
            for (uint32_t u = 0; u < U; ++u) {
                const uint32_t i = base + u * KVT_WARP + lane;
                if (i < n) v[u] = P::load16(s + i);
            }
#pragma unroll
            for (uint32_t u = 0; u < U; ++u) {
                const uint32_t i = base + u * KVT_WARP + lane;
                if (i < n) P::store16(d + i, v[u]);
            }
        }
        if (edge) P::store8(dst + edge_at, edge_v);
    } else {
        const uint2* s = reinterpret_cast<const uint2*>(src);
        uint2* d = reinterpret_cast<uint2*>(dst);
        const uint32_t n = bytes >> 3;
        for (uint32_t base = part * KVT_WARP * U * 2; base < n; base += parts * KVT_WARP * U * 2) {
            uint2 v[U * 2];
#pragma unroll
            for (uint32_t u = 0; u < U * 2; ++u) {
                const uint32_t i = base + u * KVT_WARP + lane;
                if (i < n) v[u] = P::load8(s + i);
            }
#pragma unroll
            for (uint32_t u = 0; u < U * 2; ++u) {
                const uint32_t i = base + u * KVT_WARP + lane;
                if (i < n) P::store8(d + i, v[u]);
            }
        }
    }
}

// warp_copy_entry with the warp's passes aligned to 128-byte lines of the
// host address (the source of a gather, HostIsDst: the destination of a
// writeback): vector i of the pass covers bytes [16 i, 16 i + 16) from the
// line holding the entry's first byte, so that each load (store) instruction
// of the warp covers whole lines (four of them) and no line is split between
// two instructions; the entry's first and last lines are its only partial
// ones. Today's warp_copy_entry starts its passes at the entry's first byte:
// a 656-byte entry (41 vectors) at 16 mod 128 takes two instructions that
// share a line. For entries of whole 16-byte vectors at 16-byte aligned
// source and destination; others take warp_copy_entry (two vectors a lane a
// pass). Which is faster over
// a host link is the GPU's to say (the gather and writeback benches time
// both).
template <class P, uint32_t U = KVT_UNROLL, bool HostIsDst = false>
__device__ __forceinline__ void warp_copy_entry_lines(const char* __restrict__ src, char* __restrict__ dst,
                                                      uint32_t bytes, uint32_t lane) {
    // (two vectors a lane in flight there, or U where U is 1: with U the
    // kernel's registers would grow from 64 to 80, one block an SM fewer
    // than the default's)
    if ((((uintptr_t)src | (uintptr_t)dst | bytes) & 15u) != 0) {
        warp_copy_entry<P, (U < 2 ? U : 2)>(src, dst, bytes, lane);
        return;
    }
    const uintptr_t host = HostIsDst ? (uintptr_t)dst : (uintptr_t)src;
    const uint32_t lead = (uint32_t)(host & 127u);  // bytes of the line before the entry
    // Byte offsets from the line's start: vector i covers [16 i, 16 i + 16),
    // inside the entry from `lead` to `lead + bytes` (the addresses below are
    // formed only for those).
    const uintptr_t s0 = (uintptr_t)src - lead, d0 = (uintptr_t)dst - lead;
    const uint32_t end = lead + bytes;
    for (uint32_t base = 16 * lane; base < end; base += 16 * KVT_WARP * U) {
        uint4 v[U];
#pragma unroll
        for (uint32_t u = 0; u < U; ++u) {
            const uint32_t at = base + 16 * KVT_WARP * u;
            if (at >= lead && at < end) v[u] = P::load16(reinterpret_cast<const void*>(s0 + at));
        }
#pragma unroll
        for (uint32_t u = 0; u < U; ++u) {
            const uint32_t at = base + 16 * KVT_WARP * u;
            if (at >= lead && at < end) P::store16(reinterpret_cast<void*>(d0 + at), v[u]);
        }
    }
}

// The runs of a group of at most 32 rows, row l held by lane l: `rows` has
// bit l set for each row that moves, `joins` for each row that continues row
// l - 1's run (a subset of rows whose row l - 1 is in rows). Calls
// run(first, count) for each maximal run, lowest first. The masks come from
// ballots, so every lane makes the same calls (warp operations inside run
// meet).
// Rows of more bytes never join a run, so that a run's byte count stays in
// the 32 bits the copy helpers count in (KVT_COPY_RUN_ROWS rows of this size
// are 2^31 bytes).
#define KVT_RUN_MAX_ENTRY ((1u << 31) / KVT_COPY_RUN_ROWS)
// A group's rows are ballot bits below bit 31 (masks of the group's rows
// shift 1 by the count).
static_assert(KVT_COPY_RUN_ROWS >= 1 && KVT_COPY_RUN_ROWS < KVT_WARP, "a group is a warp's lanes");

template <class Run>
__device__ __forceinline__ void for_each_run(uint32_t rows, uint32_t joins, Run run) {
    uint32_t starts = rows & ~joins;
    while (starts != 0) {
        const uint32_t first = (uint32_t)__ffs((int)starts) - 1;
        starts &= starts - 1;
        // the run continues over the joins just above `first`: their count
        // is the trailing ones of the mask shifted past it (two shifts: one
        // of 32 is undefined; the top bit of the result is always clear)
        const uint32_t above = (joins >> first) >> 1;
        run(first, (uint32_t)__ffs((int)~above));
    }
}

// Copies row src_row of the buffer at src_base to row dst_row of the buffer at
// dst_base, both addressed with the item layout L (kvt_item_layout in abi.h),
// with the whole warp (same calling rule as warp_copy_entry). A row is a value
// piece and an optional scale piece of at most 256 bytes; each lane loads its
// 8-byte word of the scale before the value moves and stores it after, so the
// two pieces cost one round trip over the link, not two. `part` of `parts`:
// as warp_copy_entry (part 0 moves the scale). `Lines`: the value piece
// moves as warp_copy_entry_lines (whole passes only: parts must be 1).
template <class P, uint32_t U = KVT_UNROLL, bool Lines = false>
__device__ __forceinline__ void warp_copy_item(const kvt_item_layout& L, kvt_addr src_base, kvt_addr dst_base,
                                               uint64_t src_row, uint64_t dst_row, uint32_t lane,
                                               uint32_t part = 0, uint32_t parts = 1) {
    const uint64_t mask = (1ull << L.page_shift) - 1;
    const char* src = reinterpret_cast<const char*>(src_base) + (src_row >> L.page_shift) * L.page_bytes;
    char* dst = reinterpret_cast<char*>(dst_base) + (dst_row >> L.page_shift) * L.page_bytes;
    const uint64_t src_in_page = src_row & mask, dst_in_page = dst_row & mask;
    const uint64_t scale_run = (uint64_t)L.value_bytes << L.page_shift;
    const bool has_scale_word = lane < (L.scale_bytes >> 3) && part == 0;
    uint2 scale = make_uint2(0, 0);
    if (has_scale_word) scale = P::load8(src + scale_run + src_in_page * L.scale_bytes + 8 * lane);
    if (Lines)
        warp_copy_entry_lines<P, U>(src + src_in_page * L.value_bytes, dst + dst_in_page * L.value_bytes,
                                    L.value_bytes, lane);
    else
        warp_copy_entry<P, U>(src + src_in_page * L.value_bytes, dst + dst_in_page * L.value_bytes, L.value_bytes,
                              lane, part, parts);
    if (has_scale_word) P::store8(dst + scale_run + dst_in_page * L.scale_bytes + 8 * lane, scale);
}

// One piece of warp_copy_item's row, for kernels that spread a row over
// several warps with few registers each: pieces 0 .. parts - 1 are the value
// piece's passes (warp_copy_entry's `part` of `parts`), piece `parts` the
// scale piece (nothing without one). Pieces of one row may run on different
// warps in any order.
template <class P, uint32_t U = 1>
__device__ __forceinline__ void warp_copy_item_piece(const kvt_item_layout& L, kvt_addr src_base, kvt_addr dst_base,
                                                     uint64_t src_row, uint64_t dst_row, uint32_t lane,
                                                     uint32_t piece, uint32_t parts) {
    // A row's place in its page fits 32 bits (page_shift <= 16), and so does
    // its scale's offset in the page's scale run (scale_bytes <= 256).
    const uint32_t mask = (1u << L.page_shift) - 1;
    const uint32_t src_in = (uint32_t)src_row & mask, dst_in = (uint32_t)dst_row & mask;
    const char* src = reinterpret_cast<const char*>(src_base) + (src_row >> L.page_shift) * L.page_bytes;
    char* dst = reinterpret_cast<char*>(dst_base) + (dst_row >> L.page_shift) * L.page_bytes;
    if (piece < parts) {
        warp_copy_entry<P, U>(src + (uint64_t)src_in * L.value_bytes, dst + (uint64_t)dst_in * L.value_bytes,
                              L.value_bytes, lane, piece, parts);
    } else if (lane < (L.scale_bytes >> 3)) {
        const uint64_t scale_run = (uint64_t)L.value_bytes << L.page_shift;
        P::store8(dst + scale_run + dst_in * L.scale_bytes + 8 * lane,
                  P::load8(src + scale_run + src_in * L.scale_bytes + 8 * lane));
    }
}

// Zero-fills one entry with the whole warp (same calling rule as above).
template <class P>
__device__ __forceinline__ void warp_zero_entry(char* __restrict__ dst, uint32_t bytes, uint32_t lane) {
    const uint32_t head = (uint32_t)(uintptr_t)dst & 15u;
    const uint32_t body = (bytes - head) & ~15u;
    const uint32_t tail = bytes - head - body;
    if (head != 0 && lane == 0) P::store8(dst, make_uint2(0, 0));
    if (tail != 0 && lane == 1) P::store8(dst + head + body, make_uint2(0, 0));
    uint4* d = reinterpret_cast<uint4*>(dst + head);
    const uint32_t n = body >> 4;
    for (uint32_t i = lane; i < n; i += KVT_WARP) P::store16(d + i, make_uint4(0, 0, 0, 0));
}

// Records one bad entry in the error word (call from one lane per entry). The
// key orders by position first, so the recorded "first" entry of each kind is
// the same whatever order the warps run in; see kvt_error_word in abi.h.
__device__ __forceinline__ void report(kvt_error_word* e, uint32_t kind, uint32_t position, int64_t value) {
    const int64_t clamped = value < INT32_MIN ? INT32_MIN : (value > INT32_MAX ? INT32_MAX : value);
    const uint32_t biased = (uint32_t)(int32_t)clamped ^ 0x80000000u;
    const unsigned long long key = ((unsigned long long)position << 32) | biased;
    atomicOr(&e->flags, 1u << kind);
    atomicAdd(&e->count, 1u);
    atomicMin(reinterpret_cast<unsigned long long*>(&e->first[kind]), key);
}

// Exclusive prefix sums across the block, in thread order, of N counters per
// thread: on return v[k] holds the sum of v[k] over lower threads and total[k]
// the block's sum. `scratch` holds N * blockDim.x words of shared memory.
// Every thread of the block must call it (it synchronises). A Hillis-Steele
// scan over shared memory with block barriers only: log2(blockDim) rounds,
// which is noise next to the global loads around it.
template <int N>
__device__ __forceinline__ void block_exclusive_scan(uint32_t (&v)[N], uint32_t (&total)[N], uint32_t* scratch) {
    const uint32_t t = threadIdx.x, n = blockDim.x;
#pragma unroll
    for (int k = 0; k < N; ++k) scratch[k * n + t] = v[k];
    __syncthreads();
    for (uint32_t off = 1; off < n; off <<= 1) {
        uint32_t add[N];
#pragma unroll
        for (int k = 0; k < N; ++k) add[k] = t >= off ? scratch[k * n + t - off] : 0;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < N; ++k) scratch[k * n + t] += add[k];
        __syncthreads();
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
        total[k] = scratch[k * n + n - 1];
        v[k] = scratch[k * n + t] - v[k];
    }
    __syncthreads();  // scratch may be reused after this
}

// *a = min(*a, v) for a 16-bit word (shared or global memory), with a CAS on
// the aligned 32-bit word holding it: CUDA has no 16-bit atomicMin. The other half of the word
// is written back as found, so nothing may write that half plainly while
// such updates run (an array updated this way wants an even length and a
// 4-byte aligned start). Checked under the emulator's shuffled schedules
// against a plain read-compare-write (tests/kernel_emu/planted.cu).
__device__ __forceinline__ void atomic_min16(uint16_t* a, uint16_t v) {
    unsigned* word = reinterpret_cast<unsigned*>(reinterpret_cast<uintptr_t>(a) & ~uintptr_t(3));
    const uint32_t shift = (reinterpret_cast<uintptr_t>(a) & 2) * 8;
    unsigned old = 0xffffffffu;  // a guess: a CAS that misses returns the word
    while (true) {
        if (((old >> shift) & 0xffffu) <= v) return;
        const unsigned next = (old & ~(0xffffu << shift)) | ((unsigned)v << shift);
        const unsigned found = atomicCAS(word, old, next);
        if (found == old) return;
        old = found;
    }
}

// This thread's index in its block, read from its special register where
// called. Not `threadIdx.x`, which ptxas reads once and then holds: in a
// kernel at its register cap it spills that value (and reloads it from local
// memory) rather than read the register again.
#ifndef KVT_HOST_EMULATION
__device__ __forceinline__ uint32_t thread_index() {
    uint32_t v;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(v));
    return v;
}
#else
__device__ __forceinline__ uint32_t thread_index() { return threadIdx.x; }
#endif

// Index of this thread's warp in the grid, and the number of warps in the grid.
__device__ __forceinline__ uint32_t global_warp() {
    return (blockIdx.x * blockDim.x + threadIdx.x) / KVT_WARP;
}
__device__ __forceinline__ uint32_t grid_warps() { return gridDim.x * blockDim.x / KVT_WARP; }

// Runs body(i, load(i)) for i = first, first + step, ... below count, with
// the loads of U iterations issued before any of their bodies runs: a
// thread's loop waits one memory latency per U iterations instead of one per
// iteration. For loops whose bodies do not feed the loads of later
// iterations (load(i) may read shared memory that body(i) alone writes).
template <uint32_t U, class Load, class Body>
__device__ __forceinline__ void batched(uint32_t first, uint32_t count, uint32_t step, Load load, Body body) {
    using V = decltype(load(0u));
    for (uint32_t base = first; base < count; base += U * step) {
        V v[U] = {};
#pragma unroll
        for (uint32_t k = 0; k < U; ++k) {
            const uint32_t i = base + k * step;
            if (i < count) v[k] = load(i);
        }
#pragma unroll
        for (uint32_t k = 0; k < U; ++k) {
            const uint32_t i = base + k * step;
            if (i < count) body(i, v[k]);
        }
    }
}

// Warp votes and shuffles over all 32 lanes: every lane of the warp must
// reach each call (loops around them run the same trip count on every lane;
// the host emulation checks that the lanes meet).
constexpr unsigned kFullWarp = 0xffffffffu;
__device__ __forceinline__ uint32_t warp_ballot(bool pred) { return __ballot_sync(kFullWarp, pred); }
// The lanes below `lane`, as a ballot mask: popc(mask & lanes_below(lane)) is
// the lane's rank among the lanes whose bit is set.
__device__ __forceinline__ uint32_t lanes_below(uint32_t lane) { return (1u << lane) - 1u; }
// Inclusive prefix sum of v over the warp's lanes.
__device__ __forceinline__ uint32_t warp_inclusive_sum(uint32_t v, uint32_t lane) {
#pragma unroll
    for (uint32_t d = 1; d < KVT_WARP; d <<= 1) {
        const uint32_t n = __shfl_sync(kFullWarp, v, lane >= d ? lane - d : lane);
        if (lane >= d) v += n;
    }
    return v;
}
// v of lane `src`.
__device__ __forceinline__ uint32_t warp_read(uint32_t v, uint32_t src) { return __shfl_sync(kFullWarp, v, src); }
__device__ __forceinline__ uint64_t warp_read64(uint64_t v, uint32_t src) {
    return (uint64_t)warp_read((uint32_t)(v >> 32), src) << 32 | warp_read((uint32_t)v, src);
}

// Exclusive prefix sum across the block, in thread order, of one count per
// thread: returns the sum over lower threads and sets *total to the block's.
// Warp shuffles and one barrier (the block-scan above takes two per round).
// `scratch`: blockDim.x / 32 words of shared memory, not to be written again
// before the next barrier. Every thread of the block must call it;
// blockDim.x is a multiple of 32.
__device__ __forceinline__ uint32_t block_exclusive_sum(uint32_t v, uint32_t* total, uint32_t* scratch) {
    const uint32_t lane = threadIdx.x % KVT_WARP, warp = threadIdx.x / KVT_WARP;
    const uint32_t warps = blockDim.x / KVT_WARP;
    const uint32_t incl = warp_inclusive_sum(v, lane);
    if (lane == KVT_WARP - 1) scratch[warp] = incl;
    __syncthreads();
    const uint32_t mine = lane < warps ? scratch[lane] : 0;
    const uint32_t warps_incl = warp_inclusive_sum(mine, lane);
    *total = warp_read(warps_incl, KVT_WARP - 1);
    return warp_read(warps_incl - mine, warp) + incl - v;
}

// Programmatic dependent launch (sm_90 and later). The host may launch a
// kernel with programmatic stream serialization, so that it is scheduled
// while the kernel before it on the stream finishes (src/cuda/mod.rs,
// CudaDevice::launch_dependent). Such a kernel calls grid_dependency_wait()
// before it touches anything: the wait returns once the kernel before it has
// completed and its memory operations are visible (at once for a kernel
// launched the ordinary way). allow_dependents() lets the next kernel be
// scheduled once every block of this one has called it or exited; it gives
// no memory guarantee, the wait does. Before sm_90 both are nothing, and the
// host launches the ordinary way.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Call it only where kvtier's own dependent follows: a trigger lets any
// programmatic successor on the stream start, and one of another library's
// that skipped its wait would see this kernel's later writes half done.
__device__ __forceinline__ void allow_dependents() {
#if defined(KVT_HOST_EMULATION)
    kvt_emu_allow_dependents();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Thread-block clusters (sm_90 and later; the host launches a kernel that
// calls these in clusters only there, src/cuda/mod.rs
// CudaDevice::launch_clustered). cluster_sync() is a barrier over every
// thread of every block of the cluster, with release and acquire semantics
// at cluster scope: what any of them wrote before it, global memory
// included, is visible to all of them after it. Every thread of the
// cluster must reach it, so a kernel calls it on a path no thread leaves.
// Before sm_90 the kernels that call them are never launched: they are a
// rank of 0 in a cluster of 1, and no barrier.
__device__ __forceinline__ uint32_t cluster_rank() {
#if defined(KVT_HOST_EMULATION)
    return kvt_emu_cluster_rank();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
#else
    return 0;
#endif
}
__device__ __forceinline__ uint32_t cluster_size() {
#if defined(KVT_HOST_EMULATION)
    return kvt_emu_cluster_size();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t n;
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
#else
    return 1;
#endif
}
// The cluster's index in the grid (blockIdx.x / cluster_size(), read from
// its own register, which the compiler may read again instead of holding).
__device__ __forceinline__ uint32_t cluster_id() {
#if defined(KVT_HOST_EMULATION)
    return blockIdx.x / kvt_emu_cluster_size();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t c;
    asm("mov.u32 %0, %%clusterid.x;" : "=r"(c));
    return c;
#else
    return blockIdx.x;
#endif
}
__device__ __forceinline__ void cluster_sync() {
#if defined(KVT_HOST_EMULATION)
    kvt_emu_cluster_sync();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// cluster_sync() in two halves: a thread that has arrived may go on working
// before it waits, and the wait returns once every thread of the cluster
// has arrived (with what each wrote before arriving visible). Each thread
// alternates arrive and wait (cluster_sync() is both); every thread of the
// cluster reaches each.
__device__ __forceinline__ void cluster_arrive() {
#if defined(KVT_HOST_EMULATION)
    kvt_emu_cluster_arrive();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
// An arrival that orders nothing (barrier.cluster.arrive.relaxed): for a
// barrier that only keeps the cluster's blocks from exiting while others
// may still read their shared memory (reads whose values the arriving
// thread has used are complete), without the release's wait for the
// thread's global stores (on sm_90 the release is a MEMBAR.ALL.GPU).
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(KVT_HOST_EMULATION)
    kvt_emu_cluster_arrive_relaxed();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(KVT_HOST_EMULATION)
    kvt_emu_cluster_wait();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// Distributed shared memory: the address of `p` (this block's shared
// memory) in the shared memory of the cluster's block `rank`, for ordinary
// loads, stores and atomics. Blocks of one kernel carve their shared memory
// the same way, so one array sits at the same offset in each. A block reads
// another's shared memory only between cluster barriers that order the
// owner's writes before it, and never after the owner may have exited: the
// owner waits at a cluster barrier that every reader reaches after its last
// access.
template <class T>
__device__ __forceinline__ T* cluster_map(T* p, uint32_t rank) {
#if defined(KVT_HOST_EMULATION)
    return static_cast<T*>(kvt_emu_cluster_map(p, rank, sizeof(T)));
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint64_t r;
    asm("mapa.u64 %0, %1, %2;" : "=l"(r) : "l"(reinterpret_cast<uint64_t>(p)), "r"(rank));
    return reinterpret_cast<T*>(r);
#else
    return p;
#endif
}

}  // namespace kvt
