// tests/kernel_emu/emulator.cpp — runs the kvtier kernels' own source on the
// host over a real grid, each block's threads as fibers, with every global
// access checked. Built and loaded by tests/kernel_emulation.rs; see
// cuda_host_shim.h for why this computes what the GPU computes.
#include <string.h>
#include <ucontext.h>

#include <vector>

#include "gather.cu"
#include "spec_swap_in.cu"
#include "swap_in.cu"
#include "writeback.cu"

thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;
thread_local unsigned char* kvt_emu_smem;

struct kvt_emu_range {
    uint64_t start, end;  // [start, end)
};

// What the emulated kernels may touch, and what they did wrong.
struct kvt_emu_report {
    uint64_t loads, stores;        // global accesses performed
    uint64_t misaligned;           // accesses not aligned to their width
    uint64_t out_of_range;         // accesses outside every allowed range (not performed)
    uint64_t first_bad_address;    // the first misaligned or out-of-range address
    uint64_t smem_overflow;        // blocks that wrote past their dynamic shared memory
    uint64_t divergent_barrier;    // barriers some live threads of a block never reached
};

// Per host thread: test threads emulate independent launches concurrently.
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

extern "C" bool kvt_emu_atomic(void* p, unsigned bytes) {
    g_report.stores++;
    return check(g_store_ranges, g_n_store, p, bytes);
}

// ---- fibers -----------------------------------------------------------------

namespace {

constexpr size_t kStack = 128 * 1024;
constexpr size_t kSmemGuard = 4096;
constexpr unsigned char kSmemFill = 0xA5;
constexpr unsigned char kGuardFill = 0x5A;

struct Fiber {
    ucontext_t ctx;
    bool done = false;
    bool waiting = false;
};

thread_local std::vector<Fiber>* g_fibers;
// Order in which a round runs the block's live threads: 0 = ascending,
// 1 = descending, anything else seeds a shuffle per round. A kernel that
// misses a barrier reads data another thread has not written yet under some
// order; running each case under several orders exposes it.
thread_local uint64_t g_schedule;
thread_local ucontext_t g_scheduler;
thread_local unsigned g_current;
thread_local void (*g_run_thread)(const void*);
thread_local const void* g_params;

void fiber_entry() {
    g_run_thread(g_params);
    (*g_fibers)[g_current].done = true;
    // returning resumes uc_link, the scheduler
}

}  // namespace

// Prepares a fiber to start the kernel at its first switch. Out of line:
// getcontext returns twice in general, which the compiler must assume of
// the caller's locals otherwise (it is only a template for makecontext here).
__attribute__((noinline)) static void init_fiber(Fiber& f, char* stack) {
    f.done = false;
    f.waiting = false;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stack;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &g_scheduler;
    makecontext(&f.ctx, fiber_entry, 0);
}

extern "C" void kvt_emu_set_schedule(uint64_t schedule) { g_schedule = schedule; }

extern "C" void kvt_emu_syncthreads() {
    Fiber& f = (*g_fibers)[g_current];
    f.waiting = true;
    swapcontext(&f.ctx, &g_scheduler);
}



template <class Params, void (*Kernel)(Params)>
static void call_kernel(const void* p) {
    Kernel(*static_cast<const Params*>(p));
}

// Runs `grid` blocks of `block` threads; each block's threads are fibers.
template <class Params, void (*Kernel)(Params)>
static kvt_emu_report run(const Params* p, unsigned grid, unsigned block, size_t smem_bytes,
                          const kvt_emu_range* loads, size_t n_loads, const kvt_emu_range* stores,
                          size_t n_stores) {
    g_load_ranges = loads;
    g_n_load = n_loads;
    g_store_ranges = stores;
    g_n_store = n_stores;
    g_report = kvt_emu_report{};
    gridDim = dim3{grid, 1, 1};
    blockDim = dim3{block, 1, 1};

    std::vector<unsigned char> smem(smem_bytes + kSmemGuard);
    std::vector<std::vector<char>> stacks(block, std::vector<char>(kStack));
    std::vector<Fiber> fibers(block);
    g_fibers = &fibers;
    g_run_thread = call_kernel<Params, Kernel>;
    g_params = p;
    kvt_emu_smem = smem.data();

        std::vector<unsigned> order(block);
    uint64_t rng = g_schedule * 0x9E3779B97F4A7C15ull + 1;
    for (unsigned b = 0; b < grid; ++b) {
        blockIdx = dim3{b, 0, 0};
        memset(smem.data(), kSmemFill, smem_bytes);
        memset(smem.data() + smem_bytes, kGuardFill, kSmemGuard);
                for (unsigned t = 0; t < block; ++t) init_fiber(fibers[t], stacks[t].data());
        while (true) {
                        // Run every live thread up to its next barrier (or its end).
            for (unsigned i = 0; i < block; ++i) order[i] = g_schedule == 1 ? block - 1 - i : i;
            if (g_schedule > 1) {
                for (unsigned i = block - 1; i > 0; --i) {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    const unsigned j = (unsigned)(rng % (i + 1));
                    const unsigned tmp = order[i];
                    order[i] = order[j];
                    order[j] = tmp;
                }
            }
            for (unsigned i = 0; i < block; ++i) {
                const unsigned t = order[i];
                Fiber& f = fibers[t];
                if (f.done || f.waiting) continue;
                g_current = t;
                threadIdx = dim3{t, 0, 0};
                swapcontext(&g_scheduler, &f.ctx);
            }
            unsigned done = 0, waiting = 0;
            for (const Fiber& f : fibers) {
                done += f.done;
                waiting += f.waiting;
            }
            if (done == block) break;
            // Some threads ended while others wait at a barrier: the kernel
            // left a barrier under a condition that was not block-uniform.
            if (done != 0) g_report.divergent_barrier++;
            for (Fiber& f : fibers) f.waiting = false;
        }
        for (size_t i = 0; i < kSmemGuard; ++i) {
            if (smem[smem_bytes + i] != kGuardFill) {
                g_report.smem_overflow++;
                break;
            }
        }
    }
    g_fibers = nullptr;
    return g_report;
}

extern "C" kvt_emu_report kvt_emu_gather(const kvt_gather_params* p, unsigned grid, unsigned block,
                                         const kvt_emu_range* loads, size_t n_loads,
                                         const kvt_emu_range* stores, size_t n_stores) {
    return run<kvt_gather_params, kvt_gather>(p, grid, block, 0, loads, n_loads, stores, n_stores);
}

extern "C" kvt_emu_report kvt_emu_writeback(const kvt_writeback_params* p, unsigned grid,
                                            unsigned block, const kvt_emu_range* loads,
                                            size_t n_loads, const kvt_emu_range* stores,
                                            size_t n_stores) {
    return run<kvt_writeback_params, kvt_writeback>(p, grid, block, 0, loads, n_loads, stores, n_stores);
}

extern "C" kvt_emu_report kvt_emu_swap_in_plan(const kvt_swap_in_params* p, unsigned grid, unsigned block,
                                               size_t smem_bytes, const kvt_emu_range* loads, size_t n_loads,
                                               const kvt_emu_range* stores, size_t n_stores) {
    return run<kvt_swap_in_params, kvt_swap_in_plan>(p, grid, block, smem_bytes, loads, n_loads, stores,
                                                     n_stores);
}

extern "C" kvt_emu_report kvt_emu_swap_in_copy(const kvt_swap_in_params* p, unsigned grid, unsigned block,
                                               size_t smem_bytes, const kvt_emu_range* loads, size_t n_loads,
                                               const kvt_emu_range* stores, size_t n_stores) {
    return run<kvt_swap_in_params, kvt_swap_in_copy>(p, grid, block, smem_bytes, loads, n_loads, stores,
                                                     n_stores);
}

extern "C" kvt_emu_report kvt_emu_spec_swap_in(const kvt_spec_swap_in_params* p, unsigned grid, unsigned block,
                                               size_t smem_bytes, const kvt_emu_range* loads, size_t n_loads,
                                               const kvt_emu_range* stores, size_t n_stores) {
    return run<kvt_spec_swap_in_params, kvt_spec_swap_in>(p, grid, block, smem_bytes, loads, n_loads, stores,
                                                          n_stores);
}
