// tests/kernel_emu/emulator.cpp — runs the kvtier kernels' own source on the
// host, thread by thread over a grid, with checked memory accesses. Built and
// loaded by tests/kernel_emulation.rs; see cuda_host_shim.h for why a serial
// run computes what the GPU computes for these kernels.
#include <string.h>

#include "gather.cu"
#include "writeback.cu"

thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

struct kvt_emu_range {
    uint64_t start, end;  // [start, end)
};

// What the emulated kernels may touch, and what they did wrong.
struct kvt_emu_report {
    uint64_t loads, stores;        // accesses performed
    uint64_t misaligned;           // accesses not aligned to their width
    uint64_t out_of_range;         // accesses outside every allowed range (not performed)
    uint64_t first_bad_address;    // the first misaligned or out-of-range address
};

// Per calling thread, like the coordinates.
static thread_local const kvt_emu_range* g_load_ranges;
static thread_local size_t g_n_load;
static thread_local const kvt_emu_range* g_store_ranges;
static thread_local size_t g_n_store;
static thread_local kvt_emu_report g_report;

static bool inside(const kvt_emu_range* r, size_t n, uint64_t a, unsigned bytes) {
    for (size_t i = 0; i < n; ++i)
        if (a >= r[i].start && a + bytes <= r[i].end) return true;
    return false;
}

static bool check(const kvt_emu_range* r, size_t n, const void* p, unsigned bytes) {
    const uint64_t a = (uint64_t)(uintptr_t)p;
    const bool aligned = a % bytes == 0;
    const bool ok = inside(r, n, a, bytes);
    if (!aligned) g_report.misaligned++;
    if (!ok) g_report.out_of_range++;
    if ((!aligned || !ok) && g_report.first_bad_address == 0) g_report.first_bad_address = a;
    return ok;
}

extern "C" void kvt_emu_load(const void* p, void* v, unsigned bytes) {
    g_report.loads++;
    if (check(g_load_ranges, g_n_load, p, bytes)) {
        memcpy(v, p, bytes);
    } else {
        memset(v, 0xEE, bytes);
    }
}

extern "C" void kvt_emu_store(void* p, const void* v, unsigned bytes) {
    g_report.stores++;
    if (check(g_store_ranges, g_n_store, p, bytes)) memcpy(p, v, bytes);
}

template <class Params>
static kvt_emu_report run(void (*kernel)(Params), const Params* p, unsigned grid, unsigned block,
                          const kvt_emu_range* loads, size_t n_loads, const kvt_emu_range* stores,
                          size_t n_stores) {
    g_load_ranges = loads;
    g_n_load = n_loads;
    g_store_ranges = stores;
    g_n_store = n_stores;
    g_report = kvt_emu_report{};
    gridDim = dim3{grid, 1, 1};
    blockDim = dim3{block, 1, 1};
    for (unsigned b = 0; b < grid; ++b) {
        for (unsigned t = 0; t < block; ++t) {
            blockIdx = dim3{b, 0, 0};
            threadIdx = dim3{t, 0, 0};
            kernel(*p);
        }
    }
    return g_report;
}

extern "C" kvt_emu_report kvt_emu_gather(const kvt_gather_params* p, unsigned grid, unsigned block,
                                         const kvt_emu_range* loads, size_t n_loads,
                                         const kvt_emu_range* stores, size_t n_stores) {
    return run(kvt_gather, p, grid, block, loads, n_loads, stores, n_stores);
}

extern "C" kvt_emu_report kvt_emu_writeback(const kvt_writeback_params* p, unsigned grid,
                                            unsigned block, const kvt_emu_range* loads,
                                            size_t n_loads, const kvt_emu_range* stores,
                                            size_t n_stores) {
    return run(kvt_writeback, p, grid, block, loads, n_loads, stores, n_stores);
}
