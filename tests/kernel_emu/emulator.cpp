// tests/kernel_emu/emulator.cpp — runs the kvtier kernels' own source on the
// host over a real grid, each block's threads as fibers, with every global
// access checked. Built and loaded by tests/kernel_emulation.rs; see
// cuda_host_shim.h for why this computes what the GPU computes.
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <deque>
#include <vector>

#include "gather.cu"
#include "spec_swap_in.cu"
#include "swap_in.cu"
#include "swap_in_few_miss.cu"
#include "swap_in_compact.cu"
#include "swap_in_split.cu"
#include "writeback.cu"
#include "error_word.cu"
#include "engram.cu"
#include "planted.cu"

struct BlockState;  // one block of the cluster being run (below)
static void thread_ended();

// ---- the race detector -----------------------------------------------------
// Built with -fsanitize=thread (tests/kernel_emulation.rs, KVT_EMU_RACES=1),
// each emulated thread is a ThreadSanitizer fiber. Switching between them
// carries no ordering, so ThreadSanitizer sees two threads' accesses to one
// address (shared or global memory), at least one a plain write, as a race
// unless the CUDA rules order them: a block barrier orders everything before
// it for everything after it (each arriving thread releases one sync object
// per barrier, each leaving thread acquires it), __syncwarp does the same
// for its lanes, and an atomic is an atomic (the shim's use __atomic
// builtins). Votes and shuffles order no memory, as on the hardware. A
// cluster barrier orders everything before it for everything after it in
// every block of the cluster, the same way. Clusters (single blocks, for a
// launch without clusters) are ordered one after another (the scheduler
// acquires every thread's end and each thread of the next acquires the
// scheduler's start), so races between blocks are looked for only within
// a cluster; launches are ordered the same way. The emulator's own state (the report, the fibers' records, the
// schedule's generator) is excluded from checking.
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);
namespace {
struct Bookkeeping {
    Bookkeeping() {
        AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
        AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
    }
    ~Bookkeeping() {
        AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
        AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
    }
};
void* race_new_fiber() { return __tsan_create_fiber(0); }
void race_free_fiber(void* f) { __tsan_destroy_fiber(f); }
void* race_this_fiber() { return __tsan_get_current_fiber(); }
// Not instrumented: ThreadSanitizer records function entries and exits per
// fiber, and this function is entered on one fiber and left on another.
__attribute__((no_sanitize_thread)) void race_enter(void* f) {
    __tsan_switch_to_fiber(f, __tsan_switch_to_fiber_no_sync);
}
void race_release(void* sync) { __tsan_release(sync); }
void race_acquire(void* sync) { __tsan_acquire(sync); }
}  // namespace
#else
namespace {
struct Bookkeeping {
    Bookkeeping() {}
    ~Bookkeeping() {}  // user-provided: a scope guard, not an unused variable
};
void* race_new_fiber() { return nullptr; }
void race_free_fiber(void*) {}
void* race_this_fiber() { return nullptr; }
void race_enter(void*) {}
void race_release(void*) {}
void race_acquire(void*) {}
}  // namespace
#endif

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
    uint64_t divergent_warp;       // warp operations some lane of their mask never reached
    uint64_t barriers;             // block barriers passed, summed over blocks
    uint64_t warp_ops;             // warp votes and shuffles completed, summed over warps
    uint64_t dependents_allowed;   // threads that let a programmatic successor start
    uint64_t bulk_loads;           // bulk loads (global -> shared) issued
    uint64_t bulk_stores;          // bulk stores (shared -> global) issued
    uint64_t bulk_misuse;          // misuses of the bulk engine or its barriers (kernels/bulk.cuh)
    uint64_t cluster_barriers;     // cluster barriers passed, summed over clusters
    uint64_t cluster_misuse;       // cluster waits without an arrival, arrivals twice without a wait,
                                   // mappings of another block's shared memory that is not shared
                                   // memory, of a rank outside the cluster or of a block that exited
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

// A possible switch, then the access counted and checked (the emulator's
// bookkeeping, hidden from the race detector); true when it may be made.
static bool admit_load(const void* p, unsigned bytes) {
    kvt_emu_maybe_switch();
    Bookkeeping b;
    g_report.loads++;
    return check(g_load_ranges, g_n_load, p, bytes);
}
static bool admit_store(const void* p, unsigned bytes) {
    kvt_emu_maybe_switch();
    Bookkeeping b;
    g_report.stores++;
    return check(g_store_ranges, g_n_store, p, bytes);
}

// The kernel's own accesses, which the race detector checks.
extern "C" void kvt_emu_load(const void* p, void* v, unsigned bytes) {
    if (admit_load(p, bytes)) {
        memcpy(v, p, bytes);
    } else {
        memset(v, 0xEE, bytes);
    }
}

extern "C" void kvt_emu_store(void* p, const void* v, unsigned bytes) {
    if (admit_store(p, bytes)) memcpy(p, v, bytes);
}

// ld_racy and st_racy: checked like the plain ones, performed as relaxed
// atomics (4 or 8 bytes: the kernels' words).
extern "C" void kvt_emu_load_atomic(const void* p, void* v, unsigned bytes) {
    if (!admit_load(p, bytes) || (bytes != 4 && bytes != 8)) {
        memset(v, 0xEE, bytes);
    } else if (bytes == 4) {
        const uint32_t x = __atomic_load_n(static_cast<const uint32_t*>(p), __ATOMIC_RELAXED);
        memcpy(v, &x, 4);
    } else {
        const uint64_t x = __atomic_load_n(static_cast<const uint64_t*>(p), __ATOMIC_RELAXED);
        memcpy(v, &x, 8);
    }
}

extern "C" void kvt_emu_store_atomic(void* p, const void* v, unsigned bytes) {
    if (!admit_store(p, bytes)) return;
    if (bytes == 4) {
        uint32_t x;
        memcpy(&x, v, 4);
        __atomic_store_n(static_cast<uint32_t*>(p), x, __ATOMIC_RELAXED);
    } else if (bytes == 8) {
        uint64_t x;
        memcpy(&x, v, 8);
        __atomic_store_n(static_cast<uint64_t*>(p), x, __ATOMIC_RELAXED);
    }
}

extern "C" void kvt_emu_allow_dependents() {
    Bookkeeping b;
    g_report.dependents_allowed++;
}

extern "C" bool kvt_emu_atomic(void* p, unsigned bytes) {
    Bookkeeping b;
    g_report.stores++;
    return check(g_store_ranges, g_n_store, p, bytes);
}

// ---- fibers -----------------------------------------------------------------

namespace {

constexpr size_t kStack = 128 * 1024;
constexpr size_t kSmemGuard = 4096;
constexpr unsigned char kSmemFill = 0xA5;
constexpr unsigned char kGuardFill = 0x5A;
constexpr unsigned char kExitedFill = 0xC3;  // shared memory of a block that exited
constexpr unsigned kWarp = 32;

// Where a fiber stands between switches.
enum class At { Ready, Barrier, ClusterWait, WarpOp, Done };

// A bulk load waiting on its barrier, and a bulk store waiting in its
// thread's bulk group (with the shared bytes it read, once it has).
// Each keeps the shared bytes it found at issue: shared memory that changes
// under an operation before it lands (a load) or reads it (a store) was
// written by some thread while the engine owned it, by whatever store.
struct BulkLoad {
    unsigned char* dst;
    const unsigned char* src;
    unsigned bytes;
    std::vector<unsigned char> at_issue;
};
struct BulkStore {
    unsigned char* dst;
    const unsigned char* src;
    unsigned bytes;
    bool read = false;
    std::vector<unsigned char> data;
    std::vector<unsigned char> at_issue;
};
// An mbarrier: arrivals a phase, arrivals still owed, bytes expected and not
// yet landed (expect_tx adds, landing loads subtract), completed phases.
struct MBar {
    uintptr_t addr;
    unsigned expected, pending;
    int64_t tx;
    unsigned phase;
    std::vector<BulkLoad> loads;
    char race;  // the race detector's sync object of the barrier's phases
};

struct Fiber {
    ucontext_t ctx;
    At at = At::Ready;
    int vote = 0;        // its predicate at a voting barrier
    int op = 0;          // the warp operation it waits in (kvt_emu_warp_op)
    unsigned mask = 0;   // the lanes that operation names
    uint64_t value = 0;  // its operand
    unsigned arg = 0;    // a shuffle's source lane
    uint64_t result = 0; // the barrier's or the operation's result for it
    void* race = nullptr; // its race-detector fiber
    std::vector<BulkStore> open_group;           // bulk stores since its last commit
    std::deque<std::vector<BulkStore>> groups;   // committed bulk groups, oldest first
    std::vector<std::pair<uintptr_t, uintptr_t>> unfenced;  // its shared stores since its last proxy fence
    unsigned spins = 0;  // failed barrier waits in a row
    unsigned arrivals = 0, waits = 0;  // its cluster arrivals and waits so far
};

// The sync objects of the race detector: two per barrier kind, alternated by
// generation (a thread cannot be two barriers ahead of another, so one
// generation's releases never reach a thread still leaving the previous).
struct RaceSync {
    char block_start, block_end;
    char barrier[2];
    std::vector<char> warp;              // [warp][2]
    unsigned barrier_gen = 0;
    std::vector<unsigned> warp_gen;      // per warp
};

thread_local std::vector<Fiber>* g_fibers;
thread_local std::deque<MBar>* g_mbars;  // a deque: barriers keep their addresses
thread_local size_t g_smem_bytes;
thread_local RaceSync* g_race;
thread_local void* g_scheduler_race;
// Order in which a pass runs the block's ready threads: 0 = ascending,
// 1 = descending, anything else seeds a shuffle per pass and, at every
// global access and atomic, a switch to another thread with probability 1/4.
// A kernel that misses a barrier, or whose atomics are not ordered the way it
// assumes, then reads data another thread has not written yet under some
// order; running each case under several orders exposes it.
thread_local uint64_t g_schedule;
thread_local uint64_t g_rng;
thread_local ucontext_t g_scheduler;
thread_local unsigned g_current;
thread_local void (*g_run_thread)(const void*);
thread_local const void* g_params;
// The cluster the scheduler runs (blocks of one cluster run together, their
// threads' fibers interleaved): this fiber's rank in it, its size, and the
// race detector's sync objects of its barrier (two, alternated by
// generation, as a block's).
thread_local unsigned g_cluster_rank, g_cluster_size;
thread_local char g_cluster_sync[2];
// Cluster barriers completed (every thread of the cluster arrived that many
// times), and the cluster's blocks (for mapping another's shared memory).
thread_local unsigned g_cluster_done;
thread_local std::vector<::BlockState>* g_blocks;

// Not instrumented either: it returns (to the scheduler) after switching to
// the scheduler's fiber. The kernel it calls is.
#if defined(__SANITIZE_THREAD__)
__attribute__((no_sanitize_thread))
#endif
void fiber_entry() {
    race_acquire(&g_race->block_start);
    g_run_thread(g_params);
    race_release(&g_race->block_end);
    {
        Bookkeeping b;
        Fiber& f = (*g_fibers)[g_current];
        // bulk stores the thread never waited for: the kernel may end (and
        // its shared memory be freed) before they read it
        if (!f.open_group.empty() || !f.groups.empty()) g_report.bulk_misuse++;
        f.at = At::Done;
        thread_ended();
    }
    // returning resumes uc_link, the scheduler
    race_enter(g_scheduler_race);
}

uint64_t next_random() {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}

// Gives the host thread back to the scheduler; the fiber resumes in a later
// pass (Ready) or once its barrier or warp operation completes.
void switch_out() {
    Fiber& f = (*g_fibers)[g_current];
    race_enter(g_scheduler_race);
    swapcontext(&f.ctx, &g_scheduler);
}

}  // namespace

// Prepares a fiber to start the kernel at its first switch. Out of line:
// getcontext returns twice in general, which the compiler must assume of
// the caller's locals otherwise (it is only a template for makecontext here).
__attribute__((noinline)) static void init_fiber(Fiber& f, char* stack) {
    f = Fiber{};
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stack;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &g_scheduler;
    makecontext(&f.ctx, fiber_entry, 0);
}

extern "C" void kvt_emu_set_schedule(uint64_t schedule) { g_schedule = schedule; }

extern "C" void kvt_emu_maybe_switch() {
    Bookkeeping b;
    if (g_fibers != nullptr && g_schedule > 1 && next_random() % 4 == 0) switch_out();
}

// A block-wide barrier; `kind` 0 returns nothing, 1 the OR, 2 the AND and 3
// the count of the waiting threads' predicates (__syncthreads_or/_and/_count).
extern "C" int kvt_emu_syncthreads(int kind, int pred) {
    Bookkeeping b;
    Fiber& f = (*g_fibers)[g_current];
    f.at = At::Barrier;
    f.vote = pred != 0;
    f.op = kind;
    void* sync = &g_race->barrier[g_race->barrier_gen & 1];
    race_release(sync);
    switch_out();
    race_acquire(sync);
    return (int)f.result;
}

// The cluster barrier (barrier.cluster.arrive.release, then
// wait.acquire): an arrival releases what the thread did before it; a wait
// returns once every thread of the cluster has arrived as often as the
// waiter has, and acquires what they released. The race detector's sync
// objects alternate by arrival (a thread cannot arrive twice more than
// another has waited).
static void cluster_arrive(bool release) {
    Bookkeeping b;
    Fiber& f = (*g_fibers)[g_current];
    if (f.arrivals != f.waits) {  // arrived twice without a wait
        g_report.cluster_misuse++;
        return;
    }
    f.arrivals++;
    if (release) race_release(&g_cluster_sync[f.arrivals & 1]);
}
extern "C" void kvt_emu_cluster_arrive() { cluster_arrive(true); }
// barrier.cluster.arrive.relaxed: an arrival that releases nothing
extern "C" void kvt_emu_cluster_arrive_relaxed() { cluster_arrive(false); }
extern "C" void kvt_emu_cluster_wait() {
    Bookkeeping b;
    Fiber& f = (*g_fibers)[g_current];
    if (f.waits == f.arrivals) {  // a wait without an arrival
        g_report.cluster_misuse++;
        return;
    }
    f.waits++;
    f.at = At::ClusterWait;
    void* sync = &g_cluster_sync[f.waits & 1];
    switch_out();
    race_acquire(sync);
}
extern "C" void kvt_emu_cluster_sync() {
    kvt_emu_cluster_arrive();
    kvt_emu_cluster_wait();
}
extern "C" unsigned kvt_emu_cluster_rank() { return g_cluster_rank; }
extern "C" unsigned kvt_emu_cluster_size() { return g_cluster_size; }

// A warp operation: the calling lane waits until every lane of `mask` (of its
// warp) has reached one, then gets its result as the hardware computes it.
extern "C" uint64_t kvt_emu_warp_op(int op, unsigned mask, uint64_t value, unsigned arg) {
    Bookkeeping b;
    Fiber& f = (*g_fibers)[g_current];
    f.at = At::WarpOp;
    f.op = op;
    f.mask = mask;
    f.value = value;
    f.arg = arg;
    // only __syncwarp orders memory among its lanes
    const unsigned w = g_current / kWarp;
    void* sync = op == KVT_EMU_SYNCWARP ? &g_race->warp[2 * w + (g_race->warp_gen[w] & 1)] : nullptr;
    if (sync) race_release(sync);
    switch_out();
    if (sync) race_acquire(sync);
    return f.result;
}

// ---- the bulk-copy engine (kernels/bulk.cuh) ---------------------------------

namespace {

constexpr unsigned kMaxSpins = 10000;

bool in_smem(const void* p, unsigned bytes) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    return c >= kvt_emu_smem && c + bytes <= kvt_emu_smem + g_smem_bytes;
}

bool overlaps(uintptr_t a, uintptr_t a_end, uintptr_t b, uintptr_t b_end) { return a < b_end && b < a_end; }

// Whether [p, p + bytes) of shared memory holds a store of some thread not
// yet covered by that thread's proxy fence.
bool unfenced(const void* p, unsigned bytes) {
    const uintptr_t a = (uintptr_t)p;
    for (const Fiber& f : *g_fibers)
        for (const auto& r : f.unfenced)
            if (overlaps(a, a + bytes, r.first, r.second)) return true;
    return false;
}

// Whether [p, p + bytes) of shared memory is the source of a bulk store that
// has not read it yet (writing there changes what the store writes).
bool being_stored(const void* p, unsigned bytes) {
    const uintptr_t a = (uintptr_t)p;
    auto hits = [&](const std::vector<BulkStore>& g) {
        for (const BulkStore& s : g)
            if (!s.read && overlaps(a, a + bytes, (uintptr_t)s.src, (uintptr_t)s.src + s.bytes)) return true;
        return false;
    };
    for (const Fiber& f : *g_fibers) {
        if (hits(f.open_group)) return true;
        for (const auto& g : f.groups)
            if (hits(g)) return true;
    }
    return false;
}

// Whether [p, p + bytes) of shared memory is the destination of a bulk load
// that has not landed (its bytes are not there yet, and will overwrite).
bool being_loaded(const void* p, unsigned bytes) {
    const uintptr_t a = (uintptr_t)p;
    for (const MBar& m : *g_mbars)
        for (const BulkLoad& l : m.loads)
            if (overlaps(a, a + bytes, (uintptr_t)l.dst, (uintptr_t)l.dst + l.bytes)) return true;
    return false;
}

MBar* find_mbar(const void* bar) {
    for (MBar& m : *g_mbars)
        if (m.addr == (uintptr_t)bar) return &m;
    g_report.bulk_misuse++;  // a barrier never initialised
    return nullptr;
}

// A bulk operation's shape: whole 16-byte units at 16-byte aligned addresses.
bool bulk_shape(const void* a, const void* b, unsigned bytes) {
    return bytes != 0 && bytes % 16 == 0 && (uintptr_t)a % 16 == 0 && (uintptr_t)b % 16 == 0;
}

// Whether the allowed ranges cover [a, a + bytes), one or several of them
// (a bulk operation spans neighbouring entries, each allowed on its own).
bool covered(const kvt_emu_range* r, size_t n, uint64_t a, uint64_t bytes) {
    const uint64_t end = a + bytes;
    while (a < end) {
        uint64_t reach = a;
        for (size_t i = 0; i < n; ++i)
            if (a >= r[i].start && a < r[i].end) reach = std::max(reach, r[i].end);
        if (reach == a) return false;
        a = reach;
    }
    return true;
}

// The global side of a bulk operation, counted as the plain accesses are.
bool bulk_global(const kvt_emu_range* r, size_t n, const void* p, unsigned bytes) {
    const uint64_t a = (uint64_t)(uintptr_t)p;
    if (covered(r, n, a, bytes)) return true;
    g_report.out_of_range++;
    if (g_report.first_bad_address == 0) g_report.first_bad_address = a;
    return false;
}

}  // namespace

extern "C" void kvt_emu_mbar_init(void* bar, unsigned count) {
    Bookkeeping b;
    if (!in_smem(bar, 8) || (uintptr_t)bar % 8 != 0 || count == 0) {
        g_report.bulk_misuse++;
        return;
    }
    for (MBar& m : *g_mbars) {
        if (m.addr != (uintptr_t)bar) continue;
        if (!m.loads.empty()) g_report.bulk_misuse++;  // initialised again with loads in flight
        m = MBar{m.addr, count, count, 0, 0, {}, 0};
        return;
    }
    g_mbars->push_back(MBar{(uintptr_t)bar, count, count, 0, 0, {}, 0});
}

extern "C" void kvt_emu_mbar_arrive_expect_tx(void* bar, unsigned bytes) {
    Bookkeeping b;
    MBar* m = find_mbar(bar);
    if (m == nullptr) return;
    if (m->pending == 0) {
        g_report.bulk_misuse++;  // more arrivals than the phase expects
        return;
    }
    m->tx += bytes;
    m->pending--;
}

extern "C" bool kvt_emu_mbar_try_wait(void* bar, unsigned parity) {
    MBar* m;
    std::vector<BulkLoad> landing;
    {
        Bookkeeping b;
        Fiber& f = (*g_fibers)[g_current];
        m = find_mbar(bar);
        if (m == nullptr) return true;
        if ((m->phase & 1) == (parity & 1)) {
            // The phase waited for is the current one: it completes once
            // every arrival is in and its loads carry the bytes expected.
            int64_t bytes = 0;
            for (const BulkLoad& l : m->loads) bytes += l.bytes;
            if (m->pending != 0 || bytes != m->tx) {
                if (++f.spins > kMaxSpins) {
                    g_report.bulk_misuse++;  // a wait that can never complete
                    f.spins = 0;
                    return true;
                }
                switch_out();
                return false;
            }
            landing.swap(m->loads);
            for (const BulkLoad& l : landing)
                if (memcmp(l.dst, l.at_issue.data(), l.bytes) != 0) g_report.bulk_misuse++;
            m->tx = 0;
            m->pending = m->expected;
            m->phase++;
        }
        f.spins = 0;
    }
    // The loads land now, as this thread's writes (the race detector then
    // orders them before every thread that sees the phase complete).
    for (const BulkLoad& l : landing) memcpy(l.dst, l.src, l.bytes);
    if (!landing.empty()) race_release(&m->race);
    race_acquire(&m->race);
    return true;
}

extern "C" void kvt_emu_bulk_load(void* smem_dst, const void* src, unsigned bytes, void* bar) {
    kvt_emu_maybe_switch();
    Bookkeeping b;
    g_report.bulk_loads++;
    MBar* m = find_mbar(bar);
    const bool shape = bulk_shape(smem_dst, src, bytes) && in_smem(smem_dst, bytes);
    if (!shape || unfenced(smem_dst, bytes) || being_stored(smem_dst, bytes) || being_loaded(smem_dst, bytes))
        g_report.bulk_misuse++;
    if (!shape || m == nullptr || !bulk_global(g_load_ranges, g_n_load, src, bytes)) return;
    unsigned char* dst = static_cast<unsigned char*>(smem_dst);
    m->loads.push_back(
        BulkLoad{dst, static_cast<const unsigned char*>(src), bytes, std::vector<unsigned char>(dst, dst + bytes)});
}

extern "C" void kvt_emu_bulk_store(void* dst, const void* smem_src, unsigned bytes) {
    kvt_emu_maybe_switch();
    Bookkeeping b;
    g_report.bulk_stores++;
    const bool shape = bulk_shape(dst, smem_src, bytes) && in_smem(smem_src, bytes);
    // (a store of bytes whose load has not landed: issued before the wait)
    if (!shape || unfenced(smem_src, bytes) || being_loaded(smem_src, bytes)) g_report.bulk_misuse++;
    if (!shape || !bulk_global(g_store_ranges, g_n_store, dst, bytes)) return;
    const unsigned char* src = static_cast<const unsigned char*>(smem_src);
    (*g_fibers)[g_current].open_group.push_back(BulkStore{static_cast<unsigned char*>(dst), src, bytes, false, {},
                                                          std::vector<unsigned char>(src, src + bytes)});
}

extern "C" void kvt_emu_bulk_commit() {
    Bookkeeping b;
    Fiber& f = (*g_fibers)[g_current];
    f.groups.push_back(std::move(f.open_group));
    f.open_group.clear();
}

extern "C" void kvt_emu_bulk_wait(unsigned newest_pending, bool read_only) {
    std::vector<BulkStore*> reads;
    std::vector<std::vector<BulkStore>> done;
    {
        Bookkeeping b;
        Fiber& f = (*g_fibers)[g_current];
        const size_t older = f.groups.size() > newest_pending ? f.groups.size() - newest_pending : 0;
        for (size_t i = 0; i < older; ++i)
            for (BulkStore& s : f.groups[i])
                if (!s.read) reads.push_back(&s);
    }
    // The stores read their shared bytes now, as this thread's reads.
    for (BulkStore* s : reads) {
        s->data.assign(s->src, s->src + s->bytes);
        s->read = true;
    }
    {
        Bookkeeping b;
        for (BulkStore* s : reads)
            if (s->data != s->at_issue) g_report.bulk_misuse++;  // written while the store owned it
    }
    if (read_only) return;
    {
        Bookkeeping b;
        Fiber& f = (*g_fibers)[g_current];
        while (f.groups.size() > newest_pending) {
            done.push_back(std::move(f.groups.front()));
            f.groups.pop_front();
        }
    }
    for (const auto& g : done)
        for (const BulkStore& s : g) memcpy(s.dst, s.data.data(), s.bytes);
}

extern "C" void kvt_emu_fence_proxy_async() {
    Bookkeeping b;
    (*g_fibers)[g_current].unfenced.clear();
}

extern "C" void kvt_emu_st_shared(void* p, const void* v, unsigned bytes) {
    {
        Bookkeeping b;
        if (!in_smem(p, bytes) || (uintptr_t)p % bytes != 0) {
            g_report.bulk_misuse++;
            return;
        }
        if (being_stored(p, bytes) || being_loaded(p, bytes)) g_report.bulk_misuse++;
    }
    memcpy(p, v, bytes);
    Bookkeeping b;
    auto& u = (*g_fibers)[g_current].unfenced;
    const uintptr_t a = (uintptr_t)p;
    if (!u.empty() && u.back().second == a)
        u.back().second = a + bytes;
    else
        u.emplace_back(a, a + bytes);
}

namespace {

// Completes warp w's operation when every lane its mask names has reached
// it (or, with `force`, with the lanes that have: the others ended or wait
// elsewhere, which the hardware does not define; counted as divergent).
// True when it released lanes.
bool complete_warp_op(std::vector<Fiber>& fibers, unsigned w, bool force) {
    const unsigned base = w * kWarp;
    const unsigned lanes = (unsigned)std::min<size_t>(kWarp, fibers.size() - base);
    unsigned first = kWarp;
    for (unsigned l = 0; l < lanes; ++l)
        if (fibers[base + l].at == At::WarpOp) {
            first = l;
            break;
        }
    if (first == kWarp) return false;
    const Fiber& lead = fibers[base + first];
    unsigned present = 0;
    bool agree = true;
    for (unsigned l = 0; l < lanes; ++l) {
        const Fiber& f = fibers[base + l];
        if (f.at != At::WarpOp) continue;
        present |= 1u << l;
        agree &= f.op == lead.op && f.mask == lead.mask;
    }
    const unsigned wanted = lead.mask & (lanes == kWarp ? ~0u : (1u << lanes) - 1);
    const bool whole = agree && (present & wanted) == wanted && (present & ~wanted) == 0;
    if (!whole && !force) return false;
    if (!whole) g_report.divergent_warp++;
    g_report.warp_ops++;
    g_race->warp_gen[w]++;
    unsigned votes = 0;
    for (unsigned l = 0; l < lanes; ++l)
        if ((present >> l & 1) && fibers[base + l].value != 0) votes |= 1u << l;
    for (unsigned l = 0; l < lanes; ++l) {
        Fiber& f = fibers[base + l];
        if (!(present >> l & 1)) continue;
        switch (f.op) {
            case KVT_EMU_BALLOT:
                f.result = votes;
                break;
            case KVT_EMU_ANY:
                f.result = votes != 0;
                break;
            case KVT_EMU_ALL:
                f.result = votes == present;
                break;
            case KVT_EMU_SHFL: {
                const unsigned src = f.arg % kWarp;
                f.result = (present >> src & 1) ? fibers[base + src].value : f.value;
                break;
            }
            default:  // KVT_EMU_SYNCWARP
                f.result = 0;
        }
        f.at = At::Ready;
    }
    return true;
}

}  // namespace

template <class Params, void (*Kernel)(Params)>
static void call_kernel(const void* p) {
    Kernel(*static_cast<const Params*>(p));
}

// One block of the cluster being run: its shared memory, threads, barrier
// state and mbarriers.
struct BlockState {
    std::vector<unsigned char> smem;
    std::vector<Fiber> fibers;
    RaceSync race;
    std::deque<MBar> mbars;
    unsigned ended = 0;  // threads done
    bool exited = false;  // every thread done
};

// Called as each thread of block g_cluster_rank ends: a block whose threads
// have all ended has exited, and its shared memory is gone for the
// cluster's other blocks still running (overwritten).
static void thread_ended() {
    BlockState& bs = (*g_blocks)[g_cluster_rank];
    if (++bs.ended != bs.fibers.size()) return;
    bs.exited = true;
    for (const BlockState& other : *g_blocks)
        if (!other.exited) {
            memset(bs.smem.data(), kExitedFill, g_smem_bytes);
            return;
        }
}

// Distributed shared memory (mapa): `p`, an object of `bytes` in the
// calling block's shared memory, at the same offset in block `rank`'s. A block that has exited
// keeps no shared memory: mapping it is a misuse, and its bytes are
// overwritten when it exits (reads through an earlier mapping get garbage).
extern "C" void* kvt_emu_cluster_map(const void* p, unsigned rank, unsigned bytes) {
    Bookkeeping b;
    const unsigned char* c = static_cast<const unsigned char*>(p);
    if (rank >= g_cluster_size || c < kvt_emu_smem || c + bytes > kvt_emu_smem + g_smem_bytes) {
        g_report.cluster_misuse++;
        return const_cast<void*>(p);
    }
    BlockState& target = (*g_blocks)[rank];
    if (target.exited) g_report.cluster_misuse++;
    return target.smem.data() + (c - kvt_emu_smem);
}

// Releases the threads waiting at a cluster barrier that every thread has
// arrived at (`force`: when no thread can move otherwise, every waiter,
// counted as a divergent barrier: on a GPU the cluster would hang). True
// when some thread was released.
static bool release_cluster_waits(std::vector<BlockState>& blocks, bool force) {
    unsigned arrived = ~0u, waiting = 0, furthest = 0;
    for (const BlockState& bs : blocks)
        for (const Fiber& f : bs.fibers) {
            arrived = std::min(arrived, f.arrivals);
            if (f.at == At::ClusterWait) {
                waiting++;
                furthest = std::max(furthest, f.waits);
            }
        }
    if (waiting == 0) return false;
    if (force && furthest > arrived) {
        g_report.divergent_barrier++;
        arrived = furthest;
    }
    for (; g_cluster_done < arrived; ++g_cluster_done) g_report.cluster_barriers++;
    bool released = false;
    for (BlockState& bs : blocks)
        for (Fiber& f : bs.fibers)
            if (f.at == At::ClusterWait && f.waits <= g_cluster_done) {
                f.at = At::Ready;
                released = true;
            }
    return released;
}

// Points the emulator's per-thread state at block `r` of the cluster that
// starts at block `first`.
static void enter_block(std::vector<BlockState>& blocks, unsigned first, unsigned r) {
    BlockState& bs = blocks[r];
    blockIdx = dim3{first + r, 0, 0};
    kvt_emu_smem = bs.smem.data();
    g_fibers = &bs.fibers;
    g_race = &bs.race;
    g_mbars = &bs.mbars;
    g_cluster_rank = r;
    g_blocks = &blocks;
}

// Runs `grid` blocks of `block` threads in clusters of `cluster` blocks (a
// divisor of `grid`, as the driver requires): each block's threads are
// fibers, and the blocks of a cluster run together, so that a cluster
// barrier can hold them all and the race detector sees their accesses side
// by side (blocks of different clusters run one after another).
template <class Params, void (*Kernel)(Params)>
static kvt_emu_report run(const Params* p, unsigned grid, unsigned block, size_t smem_bytes,
                          const kvt_emu_range* loads, size_t n_loads, const kvt_emu_range* stores,
                          size_t n_stores, unsigned cluster = 1) {
    g_load_ranges = loads;
    g_n_load = n_loads;
    g_store_ranges = stores;
    g_n_store = n_stores;
    // the scheduler's work is the emulator's, not the kernel's
    Bookkeeping b;
    g_report = kvt_emu_report{};
    if (cluster == 0 || grid % cluster != 0) {  // the driver refuses such a launch
        g_report.divergent_barrier++;
        return g_report;
    }
    gridDim = dim3{grid, 1, 1};
    blockDim = dim3{block, 1, 1};
    g_cluster_size = cluster;

    // Stacks are mapped, not filled: a cluster of 1024-thread blocks takes
    // 128 KiB a thread of address space and only the pages its frames touch.
    const size_t stack_bytes = (size_t)cluster * block * kStack;
    char* stack_base = (char*)mmap(nullptr, stack_bytes, PROT_READ | PROT_WRITE,
                                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stack_base == (char*)MAP_FAILED) abort();
    std::vector<BlockState> blocks(cluster);
    for (BlockState& bs : blocks) {
        bs.smem.resize(smem_bytes + kSmemGuard);
        bs.fibers.resize(block);
    }
    g_run_thread = call_kernel<Params, Kernel>;
    g_params = p;
    g_smem_bytes = smem_bytes;
    g_rng = g_schedule * 0x9E3779B97F4A7C15ull + 1;

    const unsigned threads = cluster * block;
    std::vector<unsigned> order(threads);
    const unsigned warps = (block + kWarp - 1) / kWarp;
    g_scheduler_race = race_this_fiber();
    for (unsigned first = 0; first < grid; first += cluster) {
        for (unsigned r = 0; r < cluster; ++r) {
            BlockState& bs = blocks[r];
            memset(bs.smem.data(), kSmemFill, smem_bytes);
            memset(bs.smem.data() + smem_bytes, kGuardFill, kSmemGuard);
            bs.race = RaceSync{};
            bs.race.warp.assign(2 * warps, 0);
            bs.race.warp_gen.assign(warps, 0);
            bs.mbars.clear();
            for (unsigned t = 0; t < block; ++t) {
                init_fiber(bs.fibers[t], stack_base + ((size_t)r * block + t) * kStack);
                bs.fibers[t].race = race_new_fiber();
            }
            bs.ended = 0;
            bs.exited = false;
            race_release(&bs.race.block_start);
        }
        g_cluster_done = 0;
        while (true) {
            // One pass: every ready thread of the cluster runs to its next switch.
            for (unsigned i = 0; i < threads; ++i) order[i] = g_schedule == 1 ? threads - 1 - i : i;
            if (g_schedule > 1) {
                for (unsigned i = threads - 1; i > 0; --i) {
                    const unsigned j = (unsigned)(next_random() % (i + 1));
                    const unsigned tmp = order[i];
                    order[i] = order[j];
                    order[j] = tmp;
                }
            }
            bool ran = false;
            for (unsigned i = 0; i < threads; ++i) {
                const unsigned r = order[i] / block, t = order[i] % block;
                Fiber& f = blocks[r].fibers[t];
                if (f.at != At::Ready) continue;
                enter_block(blocks, first, r);
                g_current = t;
                threadIdx = dim3{t, 0, 0};
                race_enter(f.race);
                swapcontext(&g_scheduler, &f.ctx);
                ran = true;
            }
            bool released = false;
            for (unsigned r = 0; r < cluster; ++r) {
                enter_block(blocks, first, r);
                for (unsigned w = 0; w < warps; ++w) released |= complete_warp_op(blocks[r].fibers, w, false);
            }
            released |= release_cluster_waits(blocks, false);
            if (ran || released) continue;
            // Nobody can move: every live thread waits at a barrier or in a
            // warp operation some lane of its mask will never reach.
            unsigned done = 0;
            bool stuck = false;
            for (const BlockState& bs : blocks)
                for (const Fiber& f : bs.fibers) {
                    done += f.at == At::Done;
                    stuck |= f.at == At::WarpOp;
                }
            if (done == threads) break;
            if (stuck) {
                for (unsigned r = 0; r < cluster; ++r) {
                    enter_block(blocks, first, r);
                    for (unsigned w = 0; w < warps; ++w) complete_warp_op(blocks[r].fibers, w, true);
                }
                continue;
            }
            // A block barrier completes once every live thread of its block
            // waits at one; some threads ended while others wait: the kernel
            // left a barrier under a condition that was not block-uniform.
            bool passed = false;
            for (BlockState& bs : blocks) {
                unsigned bdone = 0, waiting = 0, count = 0;
                for (const Fiber& f : bs.fibers) {
                    bdone += f.at == At::Done;
                    if (f.at == At::Barrier) {
                        waiting++;
                        count += f.vote;
                    }
                }
                if (waiting == 0 || bdone + waiting != block) continue;
                if (bdone != 0) g_report.divergent_barrier++;
                g_report.barriers++;
                bs.race.barrier_gen++;
                for (Fiber& f : bs.fibers) {
                    if (f.at != At::Barrier) continue;
                    f.result = f.op == 1 ? count != 0 : f.op == 2 ? count == waiting : f.op == 3 ? count : 0;
                    f.at = At::Ready;
                }
                passed = true;
            }
            if (passed) continue;
            // Some threads wait at a cluster barrier that threads which ended
            // never arrived at, or at a block barrier their block's others
            // will never reach (they wait at the cluster's): divergent
            // either way; both are let go.
            if (release_cluster_waits(blocks, true)) continue;
            g_report.divergent_barrier++;
            for (BlockState& bs : blocks)
                for (Fiber& f : bs.fibers)
                    if (f.at == At::Barrier) f.at = At::Ready;
        }
        for (unsigned r = 0; r < cluster; ++r) {
            BlockState& bs = blocks[r];
            // bulk loads no thread ever waited for
            for (const MBar& m : bs.mbars)
                if (!m.loads.empty()) g_report.bulk_misuse++;
            race_acquire(&bs.race.block_end);
            for (Fiber& f : bs.fibers) race_free_fiber(f.race);
            for (size_t i = 0; i < kSmemGuard; ++i) {
                if (bs.smem[smem_bytes + i] != kGuardFill) {
                    g_report.smem_overflow++;
                    break;
                }
            }
        }
        g_mbars = nullptr;
        g_fibers = nullptr;
        g_race = nullptr;
    }
    munmap(stack_base, stack_bytes);
    return g_report;
}

// The gather and the writeback: the kernel of the call's copy method, as the
// launcher picks it (src/gather.rs, src/writeback.rs).
extern "C" kvt_emu_report kvt_emu_gather(const kvt_gather_params* p, unsigned grid, unsigned block,
                                         const kvt_emu_range* loads, size_t n_loads,
                                         const kvt_emu_range* stores, size_t n_stores) {
    if (p->flags & KVT_COPY_BULK_RUNS)
        return run<kvt_gather_params, kvt_gather_bulk_runs>(
            p, grid, block, kvt::bulk_smem_bytes(p->entry_bytes, block / kWarp), loads, n_loads, stores, n_stores);
    if (p->flags & KVT_COPY_MERGED_RUNS)
        return run<kvt_gather_params, kvt_gather_merged_runs>(p, grid, block, 0, loads, n_loads, stores,
                                                               n_stores);
    if (p->flags & KVT_COPY_LINE_ALIGNED)
        return run<kvt_gather_params, kvt_gather_line_aligned>(p, grid, block, 0, loads, n_loads, stores,
                                                                n_stores);
    return run<kvt_gather_params, kvt_gather>(p, grid, block, 0, loads, n_loads, stores, n_stores);
}

extern "C" kvt_emu_report kvt_emu_engram_gather(const kvt_engram_gather_params* p, unsigned grid,
                                                unsigned block, const kvt_emu_range* loads, size_t n_loads,
                                                const kvt_emu_range* stores, size_t n_stores) {
    return run<kvt_engram_gather_params, kvt_engram_gather>(p, grid, block, 0, loads, n_loads, stores,
                                                            n_stores);
}

extern "C" kvt_emu_report kvt_emu_writeback(const kvt_writeback_params* p, unsigned grid,
                                            unsigned block, const kvt_emu_range* loads,
                                            size_t n_loads, const kvt_emu_range* stores,
                                            size_t n_stores) {
    if (p->flags & KVT_COPY_BULK_RUNS)
        return run<kvt_writeback_params, kvt_writeback_bulk_runs>(
            p, grid, block, kvt::bulk_smem_bytes(p->entry_bytes, block / kWarp), loads, n_loads, stores, n_stores);
    if (p->flags & KVT_COPY_MERGED_RUNS)
        return run<kvt_writeback_params, kvt_writeback_merged_runs>(p, grid, block, 0, loads, n_loads, stores,
                                                                     n_stores);
    if (p->flags & KVT_COPY_LINE_ALIGNED)
        return run<kvt_writeback_params, kvt_writeback_line_aligned>(p, grid, block, 0, loads, n_loads, stores,
                                                                      n_stores);
    return run<kvt_writeback_params, kvt_writeback>(p, grid, block, 0, loads, n_loads, stores, n_stores);
}

// The swap-in's plan kernels, each as kvt_emu_<name> for kvt_<name> (the
// names tests/kernel_emulation.rs derives from kvtier::swap_in::plan_kernel).
#define KVT_EMU_SWAP_PLAN(name)                                                                        \
    extern "C" kvt_emu_report kvt_emu_##name(const kvt_swap_in_params* p, unsigned grid, unsigned block,  \
                                             size_t smem_bytes, const kvt_emu_range* loads,             \
                                             size_t n_loads, const kvt_emu_range* stores, size_t n_stores) { \
        return run<kvt_swap_in_params, kvt_##name>(p, grid, block, smem_bytes, loads, n_loads, stores,     \
                                                   n_stores);                                            \
    }
KVT_EMU_SWAP_PLAN(swap_in_plan)
KVT_EMU_SWAP_PLAN(swap_in_few_miss_plan)
KVT_EMU_SWAP_PLAN(swap_in_few_miss_512_plan)
KVT_EMU_SWAP_PLAN(swap_in_few_miss_lines_plan)
KVT_EMU_SWAP_PLAN(swap_in_few_miss_k2048_h4096_plan)
KVT_EMU_SWAP_PLAN(swap_in_few_miss_k2048_h8192_plan)
KVT_EMU_SWAP_PLAN(swap_in_few_miss_k2048_h4096_lines_plan)
KVT_EMU_SWAP_PLAN(swap_in_few_miss_k2048_h8192_lines_plan)
KVT_EMU_SWAP_PLAN(swap_in_compact_plan)

// The plan kernels launched in clusters of `cluster` blocks.
#define KVT_EMU_CLUSTER_PLAN(name)                                                                           \
    extern "C" kvt_emu_report kvt_emu_##name(const kvt_swap_in_params* p, unsigned grid, unsigned block,    \
                                             size_t smem_bytes, unsigned cluster, const kvt_emu_range* loads, \
                                             size_t n_loads, const kvt_emu_range* stores, size_t n_stores) {  \
        return run<kvt_swap_in_params, kvt_##name>(p, grid, block, smem_bytes, loads, n_loads, stores, n_stores, \
                                                   cluster);                                                 \
    }
KVT_EMU_CLUSTER_PLAN(swap_in_few_miss_cluster_plan)
KVT_EMU_CLUSTER_PLAN(swap_in_split_plan)

// The split planner in clusters of 2, for the race detector (a cluster of
// KVT_SWAP_CLUSTER blocks of 1024 threads is more fibers than
// ThreadSanitizer tracks, 8128, and two tests run at once).
extern "C" __global__ void kvt_swap_in_split_c2_plan(const kvt_swap_in_params p) {
    kvt::swap::split::plan<2>(p);
}
KVT_EMU_CLUSTER_PLAN(swap_in_split_c2_plan)

// The bulk kernels' shared memory, as they carve it (the launchers' figure,
// CopyMethod::bulk_smem_bytes, is held equal to it by a test).
extern "C" uint64_t kvt_emu_bulk_smem(uint32_t entry_bytes, uint32_t warps) {
    return kvt::bulk_smem_bytes(entry_bytes, warps);
}

// The planners' hash table size, called as the kernels call it (a device
// helper: no launch).
extern "C" uint32_t kvt_emu_hash_size(uint32_t entries, uint32_t spread) {
    return kvt::swap::hash_size(entries, spread);
}

// The copy kernel of the call's copy method, as the launcher picks it
// (src/swap_in/cuda.rs).
extern "C" kvt_emu_report kvt_emu_swap_in_copy(const kvt_swap_in_params* p, unsigned grid, unsigned block,
                                               size_t smem_bytes, const kvt_emu_range* loads, size_t n_loads,
                                               const kvt_emu_range* stores, size_t n_stores) {
    if (p->flags & KVT_SWAP_COPY_BULK)
        return run<kvt_swap_in_params, kvt_swap_in_copy_bulk>(p, grid, block, smem_bytes, loads, n_loads, stores,
                                                               n_stores);
    if (p->flags & KVT_SWAP_COPY_LINES)
        return run<kvt_swap_in_params, kvt_swap_in_copy_line_aligned>(p, grid, block, smem_bytes, loads, n_loads,
                                                                      stores, n_stores);
    return run<kvt_swap_in_params, kvt_swap_in_copy>(p, grid, block, smem_bytes, loads, n_loads, stores,
                                                     n_stores);
}

extern "C" kvt_emu_report kvt_emu_spec_swap_in(const kvt_spec_swap_in_params* p, unsigned grid, unsigned block,
                                               size_t smem_bytes, const kvt_emu_range* loads, size_t n_loads,
                                               const kvt_emu_range* stores, size_t n_stores) {
    return run<kvt_spec_swap_in_params, kvt_spec_swap_in>(p, grid, block, smem_bytes, loads, n_loads, stores,
                                                          n_stores);
}

extern "C" kvt_emu_report kvt_emu_planted_cluster(const kvt_planted_params* p, unsigned grid, unsigned block,
                                                  unsigned cluster, const kvt_emu_range* loads, size_t n_loads,
                                                  const kvt_emu_range* stores, size_t n_stores) {
    return run<kvt_planted_params, kvt_planted_cluster>(p, grid, block, 4 * block, loads, n_loads, stores, n_stores,
                                                        cluster);
}

extern "C" kvt_emu_report kvt_emu_planted(const kvt_planted_params* p, unsigned block, const kvt_emu_range* loads,
                                          size_t n_loads, const kvt_emu_range* stores, size_t n_stores) {
    // one shared word per thread for the shared-memory variants
    return run<kvt_planted_params, kvt_planted>(p, 1, block, block * sizeof(uint32_t), loads, n_loads, stores,
                                                n_stores);
}
