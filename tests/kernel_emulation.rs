//! The kernels' own source, run on the host: `kernels/*.cu` compiled by g++
//! against a small CUDA shim (tests/kernel_emu) and executed one emulated
//! thread at a time over a real grid. Every vector load and store is checked
//! for alignment and for lying inside the memory the call may touch (a
//! memcheck of the pool accesses that untrusted indices drive), and the
//! results are compared with the CPU executor and the model on the same
//! random cases as the other tests. It runs everywhere, GPU or not; it does
//! not replace the GPU run (no real memory model, no timing).

mod common;
#[path = "common/engram.rs"]
mod engram_model;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use common::spec::*;
use common::swap::*;
use common::*;
use kvtier::abi::{
    kvt_engram_gather_params, kvt_gather_params, kvt_swap_in_params, kvt_writeback_params,
};
use kvtier::swap_in::{EmulationScratch, emulation_params_with_copy, emulation_replay_params};
use kvtier::{CopyMethod, ErrorWord, Executor, LayerFirstLayout, SwapInStrategy};

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Range {
    start: u64,
    end: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Report {
    loads: u64,
    stores: u64,
    misaligned: u64,
    out_of_range: u64,
    first_bad_address: u64,
    smem_overflow: u64,
    divergent_barrier: u64,
    divergent_warp: u64,
    barriers: u64,
    warp_ops: u64,
    dependents_allowed: u64,
    bulk_loads: u64,
    bulk_stores: u64,
    bulk_misuse: u64,
    cluster_barriers: u64,
    cluster_misuse: u64,
}

impl Report {
    /// Every access in range and aligned, shared memory within bounds, every
    /// barrier reached by the whole block, every warp operation by every
    /// lane it names.
    fn clean(&self) -> bool {
        self.misaligned == 0
            && self.out_of_range == 0
            && self.smem_overflow == 0
            && self.divergent_barrier == 0
            && self.divergent_warp == 0
            && self.bulk_misuse == 0
            && self.cluster_misuse == 0
    }
}

type GatherFn = unsafe extern "C" fn(
    *const kvt_gather_params,
    u32,
    u32,
    *const Range,
    usize,
    *const Range,
    usize,
) -> Report;
type WritebackFn = unsafe extern "C" fn(
    *const kvt_writeback_params,
    u32,
    u32,
    *const Range,
    usize,
    *const Range,
    usize,
) -> Report;
type SwapFn = unsafe extern "C" fn(
    *const kvt_swap_in_params,
    u32,
    u32,
    usize,
    *const Range,
    usize,
    *const Range,
    usize,
) -> Report;

const BLOCK: u32 = kvtier::cuda::BLOCK_THREADS;

/// The copy methods' flags (KVT_COPY_*): every gather and writeback case runs
/// each method's kernel.
const METHODS: [u32; 4] = [
    0,
    kvtier::abi::KVT_COPY_LINE_ALIGNED,
    kvtier::abi::KVT_COPY_MERGED_RUNS,
    kvtier::abi::KVT_COPY_BULK_RUNS,
];

/// Whether this process runs the emulator under the race detector: the
/// emulator built with ThreadSanitizer, whose runtime the parent test
/// preloaded (see `the_race_detector_catches_planted_races_and_the_kernels_have_none`).
fn race_detector() -> bool {
    std::env::var("KVT_EMU_RACES").is_ok_and(|v| v == "1")
}

/// Builds the emulated kernels once per test binary with the host C++
/// compiler ($CXX, else c++), with UBSan aborting on undefined behaviour
/// (or, under the race detector, with ThreadSanitizer instead).
fn emulator() -> &'static libloading::Library {
    static LIB: OnceLock<libloading::Library> = OnceLock::new();
    LIB.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let races = race_detector();
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "libkvt_emu{}_{}.so",
            if races { "_races" } else { "" },
            std::process::id()
        ));
        let sanitizer: &[&str] = if races {
            &["-fsanitize=thread"]
        } else {
            &["-fsanitize=undefined", "-fno-sanitize-recover=all"]
        };
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let status = Command::new(&cxx)
            .args([
                "-std=c++17",
                "-O1",
                "-g",
                "-fPIC",
                "-shared",
                "-Wall",
                "-Wextra",
                "-Werror",
            ])
            .arg("-Wno-unknown-pragmas")
            .args(sanitizer)
            .arg("-include")
            .arg(root.join("tests/kernel_emu/cuda_host_shim.h"))
            .arg("-I")
            .arg(root.join("kernels"))
            .arg(root.join("tests/kernel_emu/emulator.cpp"))
            .arg("-o")
            .arg(&out)
            .status()
            .unwrap_or_else(|e| panic!("could not run the host C++ compiler {cxx:?}: {e}"));
        assert!(
            status.success(),
            "the kernels did not compile as host C++ under the emulation shim"
        );
        // SAFETY: our own library; its initialisers only set up its sanitizer.
        unsafe { libloading::Library::new(&out) }.unwrap()
    })
}

/// The random cases' seeds: all of `range`, or every twentieth under the race
/// detector, which is ten to a hundred times slower and judges orderings
/// (which accesses a barrier separates), not outputs, so fewer cases say as
/// much.
fn seeds(range: std::ops::Range<u64>) -> std::iter::StepBy<std::ops::Range<u64>> {
    range.step_by(if race_detector() { 20 } else { 1 })
}

/// The schedules a case runs under: all four, or one shuffle under the race
/// detector (which judges orderings whatever the order the threads ran in).
fn schedules() -> &'static [u64] {
    if race_detector() {
        &SCHEDULES[2..3]
    } else {
        &SCHEDULES
    }
}

/// The grids (see `grids`) a case runs on, each under its own schedule; under
/// the race detector only the widest, shuffled: within a block, which is all
/// it judges, the grid changes only how many rows a block takes.
fn grid_schedules(rows: u64) -> Vec<(u32, u64)> {
    let all: Vec<(u32, u64)> = grids(rows).into_iter().zip(SCHEDULES).collect();
    if race_detector() {
        vec![(all[2].0, 2)]
    } else {
        all
    }
}

/// Thread orders every emulated launch runs under (see kvt_emu_set_schedule):
/// ascending, descending, and two shuffles.
const SCHEDULES: [u64; 4] = [0, 1, 2, 3];

fn set_schedule(schedule: u64) {
    let f: libloading::Symbol<'static, unsafe extern "C" fn(u64)> =
        unsafe { emulator().get(b"kvt_emu_set_schedule") }.unwrap();
    unsafe { f(schedule) };
}

fn gather_fn() -> libloading::Symbol<'static, GatherFn> {
    unsafe { emulator().get(b"kvt_emu_gather") }.unwrap()
}

fn writeback_fn() -> libloading::Symbol<'static, WritebackFn> {
    unsafe { emulator().get(b"kvt_emu_writeback") }.unwrap()
}

/// The bytes of every bound region: what a kernel may read (gather) or write
/// (writeback) in the pool.
fn region_ranges(fx: &Fixture, setup: &Setup) -> Vec<Range> {
    let mut regions: Vec<u32> = setup.bindings.iter().flatten().copied().collect();
    regions.sort();
    regions.dedup();
    let bytes = setup.layout.region_bytes();
    regions
        .into_iter()
        .map(|r| {
            let start = fx.pool.region_host_addr(&fx.regions[r as usize]).unwrap();
            Range {
                start,
                end: start + bytes,
            }
        })
        .collect()
}

fn slot_table(fx: &Fixture, setup: &Setup) -> Vec<u64> {
    setup
        .bindings
        .iter()
        .map(|b| {
            b.map(|r| fx.pool.region_host_addr(&fx.regions[r as usize]).unwrap())
                .unwrap_or(0)
        })
        .collect()
}

/// The index arrays a gather reads besides the pool.
fn gather_meta(p: &kvt_gather_params) -> Vec<Range> {
    let r = |addr: u64, bytes: u64| Range {
        start: addr,
        end: addr + bytes,
    };
    let (b, k, stride) = (p.batch as u64, p.k as u64, p.topk_stride as u64);
    let topk = if b == 0 || k == 0 {
        0
    } else {
        (b - 1) * stride + k
    };
    vec![
        r(p.slot_bases, 8 * p.num_slots as u64),
        r(p.req_slots, 4 * b),
        r(p.seq_lens, 4 * b),
        r(p.topk, 4 * topk),
    ]
}

/// The index arrays (and layer table) a writeback reads besides the sources.
fn writeback_meta(p: &kvt_writeback_params) -> Vec<Range> {
    let r = |addr: u64, bytes: u64| Range {
        start: addr,
        end: addr + bytes,
    };
    let n = p.num_items as u64;
    let mut v = vec![
        r(p.slot_bases, 8 * p.num_slots as u64),
        r(p.item_slots, 4 * n),
        r(p.item_tokens, 4 * n),
        r(p.item_src_rows, 8 * n),
    ];
    if p.src_layer_bases != 0 {
        v.push(r(p.src_layer_bases, 8 * p.num_layers as u64));
    }
    v
}

/// 16-byte aligned storage holding `n` bytes starting `offset` bytes in. The
/// emulated kernels write through `addr()`, so it comes from `as_mut_ptr`
/// (taken once; the vector never reallocates), never from `as_ptr`.
struct Aligned {
    /// Owns the memory `ptr` points into.
    _storage: Vec<u128>,
    ptr: *mut u8,
    n: usize,
}

impl Aligned {
    fn new(n: usize, offset: usize, fill: u8) -> Self {
        let mut storage = vec![u128::from_le_bytes([fill; 16]); (n + offset).div_ceil(16) + 1];
        let ptr = unsafe { (storage.as_mut_ptr() as *mut u8).add(offset) };
        Aligned {
            _storage: storage,
            ptr,
            n,
        }
    }
    fn from(bytes: &[u8]) -> Self {
        let mut a = Aligned::new(bytes.len(), 0, 0);
        a.bytes_mut().copy_from_slice(bytes);
        a
    }
    fn addr(&self) -> u64 {
        self.ptr as u64
    }
    fn bytes(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.ptr, self.n) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.n) }
    }
    fn range(&self) -> Range {
        Range {
            start: self.addr(),
            end: self.addr() + self.n as u64,
        }
    }
}

/// Grids to run each case with: one block (one warp strides over everything),
/// three blocks, and enough blocks for a warp per row (idle warps included).
fn grids(rows: u64) -> [u32; 3] {
    [1, 3, rows.div_ceil((BLOCK / 32) as u64).max(1) as u32 + 1]
}

/// The kernel parameters of a gather case over the slot table `slots` into
/// `out`, reporting into `err`.
fn gather_params(
    case: &GatherCase,
    slots: &[u64],
    out: &Aligned,
    err: &mut ErrorWord,
    flags: u32,
) -> kvt_gather_params {
    let layout = case.setup.layout;
    kvt_gather_params {
        slot_bases: slots.as_ptr() as u64,
        req_slots: case.req_slots.as_ptr() as u64,
        seq_lens: case.seq_lens.as_ptr() as u64,
        topk: case.topk.as_ptr() as u64,
        out: out.addr(),
        error: err as *mut ErrorWord as u64,
        layer_offset: layout.layer_offset(case.layer).unwrap(),
        entry_bytes: layout.entry_bytes(),
        tokens_per_region: layout.tokens_per_region(),
        num_slots: case.setup.num_slots(),
        batch: case.batch() as u32,
        k: case.k,
        topk_stride: case.topk_stride,
        flags,
    }
}

/// Runs a gather case through the emulated kernel with `grid` blocks and
/// copy-method `flags` (KVT_COPY_*).
fn emulate_gather(case: &GatherCase, grid: u32, flags: u32) -> (Vec<u8>, ErrorWord, Report) {
    let fx = filled_pool(case.setup.layout, case.setup.n_regions);
    let slots = slot_table(&fx, &case.setup);
    let mut out = Aligned::new(case.out_bytes(), case.out_offset, 0xAB);
    let mut err = ErrorWord::clear();
    let p = gather_params(case, &slots, &out, &mut err, flags);
    let mut loads = region_ranges(&fx, &case.setup);
    loads.extend(gather_meta(&p));
    let stores = [out.range()];
    let report = unsafe {
        gather_fn()(
            &p,
            grid,
            BLOCK,
            loads.as_ptr(),
            loads.len(),
            stores.as_ptr(),
            1,
        )
    };
    let bytes = out.bytes_mut().to_vec();
    (bytes, err, report)
}

fn gather_agrees(case: &GatherCase) {
    let (cpu_out, cpu_res) = case.run(&Executor::cpu());
    let (model_out, model_err) = case.expected();
    assert!(
        cpu_out == model_out,
        "CPU executor differs from the model for {case:?}"
    );
    // every copy method on every grid and schedule
    let runs = grid_schedules(case.batch() as u64 * case.k as u64)
        .into_iter()
        .flat_map(|gs| METHODS.map(|flags| (gs, flags)));
    for ((grid, schedule), flags) in runs {
        set_schedule(schedule);
        let (out, err, report) = emulate_gather(case, grid, flags);
        assert!(
            report.clean(),
            "bad accesses {report:?} (flags {flags}) for {case:?}"
        );
        assert!(
            out == cpu_out,
            "kernel output differs from the CPU executor (grid {grid}, flags {flags}) for {case:?}"
        );
        assert_eq!(
            expected_report(&err),
            reported(&cpu_res),
            "grid {grid}: {case:?}"
        );
        assert_eq!(
            err, model_err,
            "error word differs bit for bit from the model's"
        );
    }
}

/// The kernel parameters of a writeback case whose source buffers are at
/// `table` (one per layer; `Layer` mode reads the first), reporting into `err`.
fn writeback_params(
    case: &WritebackCase,
    slots: &[u64],
    table: &[u64],
    err: &mut ErrorWord,
    flags: u32,
) -> kvt_writeback_params {
    let layout = case.setup.layout;
    let (first_layer, num_layers, src_base, src_layer_bases) = match case.mode {
        WritebackMode::Layer(l) => (l, 1, table[0], 0),
        WritebackMode::AllLayers => (0, layout.layers(), 0, table.as_ptr() as u64),
    };
    kvt_writeback_params {
        slot_bases: slots.as_ptr() as u64,
        item_slots: case.slots.as_ptr() as u64,
        item_tokens: case.tokens.as_ptr() as u64,
        item_src_rows: case.src_rows.as_ptr() as u64,
        src_base,
        src_layer_bases,
        error: err as *mut ErrorWord as u64,
        src_rows: case.rows,
        layer_bytes: layout.layer_bytes(),
        entry_bytes: layout.entry_bytes(),
        tokens_per_region: layout.tokens_per_region(),
        num_slots: case.setup.num_slots(),
        num_items: case.slots.len() as u32,
        first_layer,
        num_layers,
        flags,
    }
}

/// Runs a writeback case through the emulated kernel with `grid` blocks and
/// copy-method `flags` (KVT_COPY_*).
fn emulate_writeback(
    case: &WritebackCase,
    grid: u32,
    flags: u32,
) -> (Vec<Vec<u8>>, ErrorWord, Report) {
    let fx = filled_pool(case.setup.layout, case.setup.n_regions);
    let slots = slot_table(&fx, &case.setup);
    let src: Vec<Aligned> = case.src.iter().map(|b| Aligned::from(b)).collect();
    let table: Vec<u64> = src.iter().map(Aligned::addr).collect();
    let mut err = ErrorWord::clear();
    let p = writeback_params(case, &slots, &table, &mut err, flags);
    let mut loads: Vec<Range> = src.iter().map(Aligned::range).collect();
    loads.extend(writeback_meta(&p));
    let stores = region_ranges(&fx, &case.setup);
    let report = unsafe {
        writeback_fn()(
            &p,
            grid,
            BLOCK,
            loads.as_ptr(),
            loads.len(),
            stores.as_ptr(),
            stores.len(),
        )
    };
    (pool_contents(&fx), err, report)
}

fn writeback_agrees(case: &WritebackCase) {
    let (cpu_pool, cpu_res) = case.run(&Executor::cpu());
    let (model_pool, model_err) = case.expected();
    assert!(cpu_pool == model_pool);
    let rows = case.slots.len() as u64
        * if case.mode == WritebackMode::AllLayers {
            case.setup.layout.layers() as u64
        } else {
            1
        };
    // every copy method on every grid and schedule
    let runs = grid_schedules(rows)
        .into_iter()
        .flat_map(|gs| METHODS.map(|flags| (gs, flags)));
    for ((grid, schedule), flags) in runs {
        set_schedule(schedule);
        let (pool, err, report) = emulate_writeback(case, grid, flags);
        assert!(
            report.clean(),
            "bad accesses {report:?} (flags {flags}) for {case:?}"
        );
        assert!(
            pool == cpu_pool,
            "kernel pool contents differ from the CPU executor (grid {grid}, flags {flags}) for {case:?}"
        );
        assert_eq!(
            expected_report(&err),
            reported(&cpu_res),
            "grid {grid}: {case:?}"
        );
        assert_eq!(err, model_err);
    }
}

const MEDIUM: Limits = Limits {
    max_layers: 3,
    max_tokens: 700,
    max_regions: 5,
    max_batch: 8,
    max_k: 300,
    max_items: 200,
};

#[test]
fn gather_kernel_matches_the_cpu_executor() {
    for seed in seeds(0..120) {
        for h in [CLEAN, PADDED, HOSTILE] {
            gather_agrees(&GatherCase::random(seed, SMALL, h));
        }
    }
    for seed in seeds(500..520) {
        gather_agrees(&GatherCase::random(seed, MEDIUM, HOSTILE));
    }
}

#[test]
fn writeback_kernel_matches_the_cpu_executor() {
    for seed in seeds(0..120) {
        for h in [CLEAN, PADDED, HOSTILE] {
            writeback_agrees(&WritebackCase::random(seed, SMALL, h, true));
        }
    }
    for seed in seeds(500..520) {
        writeback_agrees(&WritebackCase::random(seed, MEDIUM, HOSTILE, true));
    }
}

/// Large entries take several passes of the unrolled loop (2 KiB per warp
/// per pass), in both the 16-byte and the 8-byte path.
#[test]
fn entries_larger_than_one_pass() {
    for (seed, entry) in [(1, 4096), (2, 4104), (3, 6152)] {
        let mut case = GatherCase::random(seed, SMALL, HOSTILE);
        case.setup.layout = LayerFirstLayout::new(entry, 2, 40).unwrap();
        case.layer = 1;
        gather_agrees(&case);
        let mut wb = WritebackCase::random(seed, SMALL, HOSTILE, true);
        wb.setup.layout = LayerFirstLayout::new(entry, 2, 40).unwrap();
        wb.mode = WritebackMode::Layer(1);
        wb.src = vec![
            (0..wb.rows as usize * entry as usize)
                .map(|i| (i % 253) as u8)
                .collect(),
        ];
        writeback_agrees(&wb);
    }
}

/// Larger regions and rows than SMALL for the run-heavy cases: runs of up to
/// 32 neighbours fit in a region, and a top-k row (an item list) spans
/// several groups of `CopyMethod::RUN_ROWS`.
const RUNS: Limits = Limits {
    max_layers: 2,
    max_tokens: 200,
    max_regions: 3,
    max_batch: 4,
    max_k: 80,
    max_items: 80,
};

/// Index patterns made of runs of 1 to 32 neighbours, whole and broken in
/// the middle by padding or refused rows, crossing groups and ending at the
/// region's (the source's) last entry: every method, every grid and
/// schedule, against the CPU executor and the model.
#[test]
fn run_heavy_cases_match_the_cpu_executor() {
    for seed in seeds(0..40) {
        for h in [CLEAN, PADDED, HOSTILE] {
            gather_agrees(&GatherCase::with_runs(seed, RUNS, h));
            writeback_agrees(&WritebackCase::with_runs(seed, RUNS, h, true));
        }
    }
}

/// A gather of one row of 656-byte entries through the merged-runs kernel
/// (one block), loads allowed only where `allowed` says: (report, output).
fn merged_gather_of_row(topk: &[i32], allowed: impl Fn(Range) -> Vec<Range>) -> (Report, Vec<u8>) {
    gather_of_row(topk, allowed, kvtier::abi::KVT_COPY_MERGED_RUNS)
}

/// The same through the kernel of the copy method `flags`.
fn gather_of_row(
    topk: &[i32],
    allowed: impl Fn(Range) -> Vec<Range>,
    flags: u32,
) -> (Report, Vec<u8>) {
    let mut case = GatherCase::random(4, SMALL, CLEAN);
    case.setup = Setup {
        layout: LayerFirstLayout::new(656, 1, 32).unwrap(),
        n_regions: 1,
        bindings: vec![Some(0)],
    };
    let k = topk.len() as u32;
    (case.layer, case.k, case.topk_stride, case.out_offset) = (0, k, k, 0);
    (case.req_slots, case.seq_lens, case.topk) = (vec![0], vec![32], topk.to_vec());
    let fx = filled_pool(case.setup.layout, 1);
    let slots = slot_table(&fx, &case.setup);
    let mut out = Aligned::new(case.out_bytes(), 0, 0x5A);
    let mut err = ErrorWord::clear();
    let p = gather_params(&case, &slots, &out, &mut err, flags);
    let mut loads = allowed(region_ranges(&fx, &case.setup)[0]);
    loads.extend(gather_meta(&p));
    let stores = [out.range()];
    set_schedule(0);
    let report = unsafe {
        gather_fn()(
            &p,
            1,
            BLOCK,
            loads.as_ptr(),
            loads.len(),
            stores.as_ptr(),
            1,
        )
    };
    assert!(err.is_clear());
    assert!(out.bytes_mut() == case.expected().0, "{topk:?}");
    (report, out.bytes().to_vec())
}

/// The merged-runs kernel finds the runs: a run's lines are read from the
/// run's own entries only (a run of 656-byte entries shares its first and
/// last lines with its neighbours, which the memcheck refuses here), and a
/// row of one run of 24 neighbours (three groups, ending at the region's
/// last entry) takes fewer warp operations than 24 rows that join nothing
/// (one shuffle per run).
#[test]
fn merged_runs_read_only_their_runs_and_merge_neighbours() {
    let tight = |topk: &'static [i32]| {
        move |region: Range| -> Vec<Range> {
            topk.iter()
                .filter(|&&t| t >= 0)
                .map(|&t| range(region.start + t as u64 * 656, 656))
                .collect()
        }
    };
    // runs of 4 and 2 at tokens whose lines their neighbours share, padding
    // between them, a run of 3 ending at the last entry
    let (r, _) = merged_gather_of_row(
        &[2, 3, 4, 5, -1, 9, 10, 29, 30, 31],
        tight(&[2, 3, 4, 5, 9, 10, 29, 30, 31]),
    );
    assert!(r.clean(), "{r:?}");

    let whole = |region: Range| vec![region];
    let ascending: Vec<i32> = (8..32).collect();
    let descending: Vec<i32> = (8..32).rev().collect();
    let (merged, _) = merged_gather_of_row(&ascending, whole);
    let (apart, _) = merged_gather_of_row(&descending, whole);
    assert!(merged.clean() && apart.clean());
    assert!(
        merged.warp_ops < apart.warp_ops,
        "one run a group takes fewer shuffles than 24 runs: {merged:?} vs {apart:?}"
    );
}

/// The bulk-copy gather moves each run of neighbours with one bulk load of
/// exactly the run's bytes (the memcheck refuses any other byte of the
/// region) and each group with one bulk store: a row of 24 ascending tokens
/// (three groups of one run each) takes 3 loads and 3 stores, the same
/// tokens descending 24 loads; padding and refused rows are zeros inside the
/// group's store.
#[test]
fn bulk_runs_load_each_run_once_and_store_each_group_once() {
    let bulk = kvtier::abi::KVT_COPY_BULK_RUNS;
    let tight = |topk: &'static [i32]| {
        move |region: Range| -> Vec<Range> {
            topk.iter()
                .filter(|&&t| t >= 0)
                .map(|&t| range(region.start + t as u64 * 656, 656))
                .collect()
        }
    };
    let (r, _) = gather_of_row(
        &[2, 3, 4, 5, -1, 9, 10, 29, 30, 31],
        tight(&[2, 3, 4, 5, 9, 10, 29, 30, 31]),
        bulk,
    );
    assert!(r.clean(), "{r:?}");
    // groups [2 3 4 5 -1 9 10 29] and [30 31]: runs 2-5, 9-10, 29 and 30-31
    assert_eq!((r.bulk_loads, r.bulk_stores), (4, 2), "{r:?}");

    let whole = |region: Range| vec![region];
    let ascending: Vec<i32> = (8..32).collect();
    let descending: Vec<i32> = (8..32).rev().collect();
    let (merged, _) = gather_of_row(&ascending, whole, bulk);
    let (apart, _) = gather_of_row(&descending, whole, bulk);
    assert!(merged.clean() && apart.clean(), "{merged:?} {apart:?}");
    assert_eq!((merged.bulk_loads, merged.bulk_stores), (3, 3));
    assert_eq!((apart.bulk_loads, apart.bulk_stores), (24, 3));
    // a row of padding only: no load, zeros stored
    let (empty, _) = gather_of_row(&[-1; 5], whole, bulk);
    assert!(empty.clean());
    assert_eq!((empty.bulk_loads, empty.bulk_stores), (0, 1));
}

/// The bulk-copy writeback moves each run of items (one slot, consecutive
/// tokens, consecutive source rows) with one bulk load from HBM and one bulk
/// store into the pool: 24 items written in order (three groups) take 3 of
/// each, the same items in reverse token order 24; a padding item splits a
/// run in two. The pool matches the CPU executor's each time.
#[test]
fn bulk_writeback_moves_each_run_with_one_load_and_one_store() {
    let bulk = kvtier::abi::KVT_COPY_BULK_RUNS;
    let case_of = |slots: Vec<i32>, tokens: Vec<i32>| {
        let n = slots.len();
        WritebackCase {
            setup: Setup {
                layout: LayerFirstLayout::new(656, 1, 32).unwrap(),
                n_regions: 1,
                bindings: vec![Some(0)],
            },
            mode: WritebackMode::Layer(0),
            slots,
            tokens,
            src_rows: (0..n as i64).collect(),
            src: vec![(0..n * 656).map(|i| (i % 251) as u8).collect()],
            rows: n as u64,
        }
    };
    let run = |case: &WritebackCase| {
        set_schedule(2);
        let (pool, err, report) = emulate_writeback(case, 1, bulk);
        let (cpu_pool, _) = case.run(&Executor::cpu());
        assert!(report.clean() && err.is_clear(), "{report:?}");
        assert!(pool == cpu_pool, "{case:?}");
        (report.bulk_loads, report.bulk_stores)
    };
    let ascending = case_of(vec![0; 24], (8..32).collect());
    assert_eq!(run(&ascending), (3, 3));
    let descending = case_of(vec![0; 24], (8..32).rev().collect());
    assert_eq!(run(&descending), (24, 24));
    let mut split = case_of(vec![0; 8], (8..16).collect());
    split.slots[3] = -1;
    assert_eq!(run(&split), (2, 2));
}

/// The bulk kernels' shared memory as the launchers size it is what the
/// kernels carve (the emulator's smem guard catches a kernel that carves
/// more; this, a launcher that gives less or more).
#[test]
fn bulk_shared_memory_is_sized_as_the_kernels_carve_it() {
    type SmemFn = unsafe extern "C" fn(u32, u32) -> u64;
    let f: libloading::Symbol<'static, SmemFn> =
        unsafe { emulator().get(b"kvt_emu_bulk_smem") }.unwrap();
    for entry in [16, 512, 584, 656, 1152, 4096] {
        for warps in [1, 4, 8, 32] {
            // SAFETY: a pure function of its two integers.
            let kernel = unsafe { f(entry, warps) };
            assert_eq!(
                kvtier::CopyMethod::bulk_smem_bytes(entry, warps),
                kernel,
                "{entry} B, {warps} warps"
            );
        }
    }
}

/// The production shape: batch 16 of k = 2048, 656 B and 584 B entries.
#[test]
fn production_shape() {
    for (entry, offset) in [(656, 0), (584, 8)] {
        let mut case = GatherCase::random(9, SMALL, CLEAN);
        case.setup = Setup {
            layout: LayerFirstLayout::new(entry, 1, 4096).unwrap(),
            n_regions: 16,
            bindings: (0..16).map(Some).collect(),
        };
        case.layer = 0;
        (case.k, case.topk_stride, case.out_offset) = (2048, 2048, offset);
        case.req_slots = (0..16).rev().collect();
        case.seq_lens = vec![4096; 16];
        case.topk = (0..16 * 2048)
            .map(|i| ((i as u64 * 2_654_435_761) % 4096) as i32)
            .collect();
        let (cpu_out, _) = case.run(&Executor::cpu());
        let grid = grids(16 * 2048)[2];
        for flags in METHODS {
            let (out, err, report) = emulate_gather(&case, grid, flags);
            assert!(report.clean(), "{report:?}");
            assert!(err.is_clear());
            assert!(out == cpu_out, "flags {flags}");
        }
    }
}

/// A pool of its own for the emulated kernels: the regions of `setup`
/// packed back to back starting `shift` bytes past a 16-byte boundary, filled
/// with the pattern. The kernel contract only promises 8-byte aligned
/// regions; with `shift = 8` entries of a multiple of 16 bytes get both an
/// 8-byte head and an 8-byte tail, which page-aligned pools never produce.
struct ShiftedPool {
    mem: Aligned,
    region_bytes: usize,
    /// Bytes from one region's start to the next's.
    stride: usize,
}

impl ShiftedPool {
    fn new(setup: &Setup, shift: usize) -> Self {
        let region_bytes = setup.layout.region_bytes() as usize;
        Self::with_stride(setup, shift, region_bytes)
    }

    /// Regions `stride` bytes apart, the first `shift` bytes past a 16-byte
    /// boundary: with a stride of the region's bytes plus 8, every other
    /// region of 16-byte entries is 16-byte aligned.
    fn with_stride(setup: &Setup, shift: usize, stride: usize) -> Self {
        let l = setup.layout;
        let region_bytes = l.region_bytes() as usize;
        let mut mem = Aligned::new(stride * setup.n_regions as usize, shift, 0);
        let entry = l.entry_bytes() as usize;
        for r in 0..setup.n_regions {
            for layer in 0..l.layers() {
                for t in 0..l.tokens_per_region() {
                    let at = r as usize * stride + l.entry_offset(layer, t).unwrap() as usize;
                    mem.bytes_mut()[at..at + entry]
                        .copy_from_slice(&pattern_entry(r, layer, t, entry));
                }
            }
        }
        ShiftedPool {
            mem,
            region_bytes,
            stride,
        }
    }
    fn slot_table(&self, setup: &Setup) -> Vec<u64> {
        setup
            .bindings
            .iter()
            .map(|b| {
                b.map(|r| self.mem.addr() + r as u64 * self.stride as u64)
                    .unwrap_or(0)
            })
            .collect()
    }
    fn regions(&self) -> Vec<Vec<u8>> {
        (self.mem.bytes().chunks(self.stride))
            .map(|c| c[..self.region_bytes].to_vec())
            .collect()
    }
}

#[test]
fn regions_at_8_mod_16_take_the_head_and_tail_paths() {
    for seed in seeds(0..60) {
        let mut case = GatherCase::random(seed, SMALL, HOSTILE);
        case.out_offset = 8;
        let pool = ShiftedPool::new(&case.setup, 8);
        let slots = pool.slot_table(&case.setup);
        let out = Aligned::new(case.out_bytes(), 8, 0xAB);
        let mut err = ErrorWord::clear();
        // 8 mod 16: the line-aligned and merged-runs methods take today's
        // path (runs in 8-byte pieces, or 16 with a head and tail)
        let flags = METHODS[seed as usize % METHODS.len()];
        let p = gather_params(&case, &slots, &out, &mut err, flags);
        let mut loads = vec![pool.mem.range()];
        loads.extend(gather_meta(&p));
        let stores = [out.range()];
        let report = unsafe {
            gather_fn()(
                &p,
                2,
                BLOCK,
                loads.as_ptr(),
                loads.len(),
                stores.as_ptr(),
                1,
            )
        };
        assert!(report.clean(), "{report:?} for {case:?}");
        let (want, want_err) = case.expected();
        assert!(
            out.bytes() == want,
            "gather from shifted regions differs from the model for {case:?}"
        );
        assert_eq!(err, want_err);

        let wb = WritebackCase::random(seed, SMALL, HOSTILE, true);
        let pool = ShiftedPool::new(&wb.setup, 8);
        let slots = pool.slot_table(&wb.setup);
        let src: Vec<Aligned> = wb
            .src
            .iter()
            .map(|b| {
                let mut a = Aligned::new(b.len(), 8, 0);
                a.bytes_mut().copy_from_slice(b);
                a
            })
            .collect();
        let table: Vec<u64> = src.iter().map(Aligned::addr).collect();
        let mut err = ErrorWord::clear();
        // 8 mod 16: the line-aligned and merged-runs methods take today's path
        let flags = METHODS[(seed as usize + 1) % METHODS.len()];
        let p = writeback_params(&wb, &slots, &table, &mut err, flags);
        let mut loads: Vec<Range> = src.iter().map(Aligned::range).collect();
        loads.extend(writeback_meta(&p));
        let stores = [pool.mem.range()];
        let report = unsafe {
            writeback_fn()(
                &p,
                2,
                BLOCK,
                loads.as_ptr(),
                loads.len(),
                stores.as_ptr(),
                1,
            )
        };
        assert!(report.clean(), "{report:?} for {wb:?}");
        let (want, want_err) = wb.expected();
        assert!(
            pool.regions() == want,
            "writeback into shifted regions differs from the model for {wb:?}"
        );
        assert_eq!(err, want_err);
    }
}

/// The bulk kernels with an aligned output and source rows and every other
/// region 8 bytes off a 16-byte boundary: a warp moves the groups of the
/// aligned regions through its stages and the others as the merged-runs
/// kernels do, interleaved (one block strides over every group), and the
/// results are the model's.
#[test]
fn bulk_kernels_move_groups_of_misaligned_regions_as_merged_runs() {
    let bulk = kvtier::abi::KVT_COPY_BULK_RUNS;
    let (mut staged, mut apart) = (0, 0);
    for seed in seeds(0..40) {
        let mut case = GatherCase::with_runs(seed, RUNS, HOSTILE);
        case.out_offset = 0;
        let l = case.setup.layout;
        let pool = ShiftedPool::with_stride(&case.setup, 0, l.region_bytes() as usize + 8);
        let slots = pool.slot_table(&case.setup);
        let out = Aligned::new(case.out_bytes(), 0, 0xAB);
        let mut err = ErrorWord::clear();
        let p = gather_params(&case, &slots, &out, &mut err, bulk);
        let mut loads = vec![pool.mem.range()];
        loads.extend(gather_meta(&p));
        let stores = [out.range()];
        set_schedule(seed % 4);
        let report = unsafe {
            gather_fn()(
                &p,
                1,
                BLOCK,
                loads.as_ptr(),
                loads.len(),
                stores.as_ptr(),
                1,
            )
        };
        assert!(report.clean(), "{report:?} for {case:?}");
        let (want, want_err) = case.expected();
        assert!(
            out.bytes() == want,
            "gather differs from the model for {case:?}"
        );
        assert_eq!(err, want_err);
        if l.entry_bytes().is_multiple_of(16) && report.bulk_stores > 0 && report.stores > 0 {
            staged += 1;
        }

        let wb = WritebackCase::with_runs(seed, RUNS, HOSTILE, true);
        let l = wb.setup.layout;
        let pool = ShiftedPool::with_stride(&wb.setup, 0, l.region_bytes() as usize + 8);
        let slots = pool.slot_table(&wb.setup);
        let src: Vec<Aligned> = wb.src.iter().map(|b| Aligned::from(b)).collect();
        let table: Vec<u64> = src.iter().map(Aligned::addr).collect();
        let mut err = ErrorWord::clear();
        let p = writeback_params(&wb, &slots, &table, &mut err, bulk);
        let mut loads: Vec<Range> = src.iter().map(Aligned::range).collect();
        loads.extend(writeback_meta(&p));
        let stores = [pool.mem.range()];
        let report = unsafe {
            writeback_fn()(
                &p,
                1,
                BLOCK,
                loads.as_ptr(),
                loads.len(),
                stores.as_ptr(),
                1,
            )
        };
        assert!(report.clean(), "{report:?} for {wb:?}");
        let (want, want_err) = wb.expected();
        assert!(
            pool.regions() == want,
            "writeback differs from the model for {wb:?}"
        );
        assert_eq!(err, want_err);
        if l.entry_bytes().is_multiple_of(16) && report.bulk_stores > 0 && report.stores > 0 {
            apart += 1;
        }
    }
    // the cases did mix staged groups with groups moved apart
    assert!(staged > 0 && apart > 0, "{staged} {apart}");
}

/// The harness itself can fail: a misaligned output and a pool range that
/// stops one entry short are both caught.
#[test]
fn the_memcheck_catches_misaligned_and_out_of_range_accesses() {
    let mut case = GatherCase::random(4, SMALL, CLEAN);
    case.setup = Setup {
        layout: LayerFirstLayout::new(656, 1, 16).unwrap(),
        n_regions: 1,
        bindings: vec![Some(0)],
    };
    (case.layer, case.k, case.topk_stride, case.out_offset) = (0, 2, 2, 0);
    case.req_slots = vec![0];
    case.seq_lens = vec![16];
    case.topk = vec![15, 0];

    let fx = filled_pool(case.setup.layout, 1);
    let slots = slot_table(&fx, &case.setup);
    let out = Aligned::new(2 * 656 + 8, 0, 0);
    let mut err = ErrorWord::clear();
    let base = kvt_gather_params {
        slot_bases: slots.as_ptr() as u64,
        req_slots: case.req_slots.as_ptr() as u64,
        seq_lens: case.seq_lens.as_ptr() as u64,
        topk: case.topk.as_ptr() as u64,
        out: out.addr(),
        error: &mut err as *mut ErrorWord as u64,
        layer_offset: 0,
        entry_bytes: 656,
        tokens_per_region: 16,
        num_slots: 1,
        batch: 1,
        k: 2,
        topk_stride: 2,
        flags: 0,
    };
    let region = region_ranges(&fx, &case.setup)[0];
    let stores = [out.range()];
    let run = |p: &kvt_gather_params, pool: Range| {
        let mut loads = vec![pool];
        loads.extend(gather_meta(p));
        unsafe { gather_fn()(p, 1, BLOCK, loads.as_ptr(), loads.len(), stores.as_ptr(), 1) }
    };

    let clean = run(&base, region);
    assert_eq!((clean.misaligned, clean.out_of_range), (0, 0));
    let gathered = out.bytes().to_vec();
    assert_eq!(
        clean.stores,
        2 * 656 / 16,
        "both rows stored in 16-byte vectors"
    );

    let short = run(
        &base,
        Range {
            start: region.start,
            end: region.end - 656,
        },
    );
    assert!(
        short.out_of_range > 0,
        "token 15 lies outside the shortened range: {short:?}"
    );

    let skewed = kvt_gather_params {
        out: base.out + 4,
        ..base
    };
    let r = run(&skewed, region);
    assert!(r.misaligned > 0, "a 4-byte-aligned output is caught: {r:?}");

    // The line-aligned method reads the two entries and nothing of the
    // lines they share with their neighbours (token 15 starts 112 bytes into
    // a 128-byte line of a page-aligned region): loads allowed on exactly
    // the entries' bytes.
    assert_eq!(region.start % 128, 0);
    let aligned = kvt_gather_params {
        flags: kvtier::abi::KVT_COPY_LINE_ALIGNED,
        ..base
    };
    let mut loads: Vec<Range> = [15u64, 0]
        .iter()
        .map(|t| range(region.start + t * 656, 656))
        .collect();
    loads.extend(gather_meta(&aligned));
    unsafe { std::ptr::write_bytes(out.addr() as *mut u8, 0x5A, 2 * 656) };
    let r = unsafe {
        gather_fn()(
            &aligned,
            1,
            BLOCK,
            loads.as_ptr(),
            loads.len(),
            stores.as_ptr(),
            1,
        )
    };
    assert!(r.clean(), "{r:?}");
    assert_eq!(
        r.stores,
        2 * 656 / 16,
        "both rows stored in 16-byte vectors"
    );
    assert!(
        out.bytes()[..2 * 656] == gathered[..2 * 656],
        "the two entries' bytes, as the first method's"
    );
}

fn swap_fn(symbol: &[u8]) -> libloading::Symbol<'static, SwapFn> {
    unsafe { emulator().get(symbol) }.unwrap()
}

fn range(addr: u64, bytes: usize) -> Range {
    Range {
        start: addr,
        end: addr + bytes as u64,
    }
}

/// Runs a swap-in case through the emulated plan kernel of `strategy` (and,
/// but for one block per request, the copy kernel with `copy_grid` blocks),
/// with the parameters the library builds for a real launch.
fn emulate_swap(
    case: &SwapCase,
    strategy: SwapInStrategy,
    copy_grid: u32,
    opts: SwapOptions,
) -> (SwapOutcome, Vec<Report>) {
    let (batch, e) = (case.batch(), case.entries());
    let stride = plan_stride(e);
    let mut s = case.host_state();
    let mut err = ErrorWord::clear();
    // Without a caller's plan the kernels record into the engine's scratch:
    // here the same arrays, rows of `stride` (= max_top_k) elements.
    // The call counts into a one-layer table (kvt_swap_counters: 8 words),
    // read back as the engine reads its own.
    let counters: Box<[AtomicU64]> = (0..8).map(|_| AtomicU64::new(0)).collect();
    let scratch = EmulationScratch {
        src: s.plan_src.as_mut_ptr() as u64,
        dst: s.plan_dst.as_mut_ptr() as u64,
        count: s.plan_count.as_mut_ptr() as u64,
        max_batch: batch as u32,
        max_top_k: stride as u32,
        counters: counters.as_ptr() as u64,
        counter_layers: 1,
    };
    let plan = [
        range(scratch.src, 8 * batch * stride),
        range(scratch.dst, 4 * batch * stride),
        range(scratch.count, 4 * batch),
    ];
    let p = {
        let mut args = case.host_args(&mut s, opts);
        args.layer = Some(0);
        let mut p = emulation_params_with_copy(
            &args,
            strategy,
            opts.copy,
            scratch,
            &mut err as *mut ErrorWord as u64,
        )
        .unwrap();
        if opts.fixed_shape {
            p.flags |= kvtier::abi::KVT_SWAP_FIXED_SHAPE; // as SwapInEngine::run_fixed_shape
        }
        if opts.cluster_copy {
            assert_eq!(
                strategy,
                SwapInStrategy::FewMiss,
                "the cluster build is FewMiss's"
            );
            p.flags |= kvtier::abi::KVT_SWAP_CLUSTER_COPY; // as SwapInEngine::run_cluster_copy
        }
        if opts.cluster_plan {
            assert_eq!(
                strategy,
                SwapInStrategy::FewMiss,
                "the split planner is FewMiss's"
            );
            p.flags |= kvtier::abi::KVT_SWAP_CLUSTER_PLAN; // as SwapInEngine::run_cluster_plan
        }
        p
    };
    let index_bytes = |wide: bool| if wide { 8 } else { 4 } * batch;
    let mut loads = vec![
        range(p.top_k_tokens, 4 * case.topk.len()),
        range(p.device_buffer_tokens, 4 * case.tokens.len()),
        range(p.device_buffer_locs, 4 * case.locs.len()),
        range(p.lru_slots, 2 * case.lru.len()),
        range(p.host_cache_locs, 8 * case.host_locs.len()),
        range(p.req_pool_indices, index_bytes(case.req_i64)),
        range(p.seq_lens, index_bytes(case.seq_i64)),
        range(p.num_real_reqs, 4 * case.num_real.iter().count()),
    ];
    let mut stores = vec![
        range(p.top_k_device_locs, 4 * s.out.len()),
        range(p.device_buffer_tokens, 4 * case.tokens.len()),
        range(p.lru_slots, 2 * case.lru.len()),
    ];
    for plane in 0..case.planes() {
        loads.push(range(p.host_cache[plane], case.host_cache.len()));
        stores.push(range(p.device_buffer[plane], case.device_buffer.len()));
    }
    loads.extend(plan);
    stores.extend(plan);
    let mut reports = Vec::new();
    if batch > 0 {
        // The plan kernel a launch picks (kvtier::swap_in::plan_kernel), as
        // the emulator exports it: kvt_emu_ for kvt_.
        let (kernel, threads, smem) = kvtier::swap_in::plan_kernel(&p);
        let plan = format!("kvt_emu_{}", kernel.symbol().strip_prefix("kvt_").unwrap());
        let plan = plan.as_bytes();
        let clustered = kvtier::abi::KVT_SWAP_CLUSTER_COPY | kvtier::abi::KVT_SWAP_CLUSTER_PLAN;
        if p.flags & clustered != 0 {
            // The cluster build or the split planner in clusters of
            // `copy_grid` blocks a row (2 for 0; the GPU's are
            // KVT_SWAP_CLUSTER), and no copy kernel.
            let cluster = copy_grid.max(2);
            let (symbol, smem): (&[u8], usize) =
                if p.flags & kvtier::abi::KVT_SWAP_CLUSTER_PLAN != 0 {
                    // the build for clusters of 2, or the launcher's
                    let symbol: &[u8] = if cluster == 2 {
                        b"kvt_emu_swap_in_split_c2_plan"
                    } else {
                        assert_eq!(
                            cluster,
                            kvtier::abi::KVT_SWAP_CLUSTER,
                            "the split planner's clusters"
                        );
                        b"kvt_emu_swap_in_split_plan"
                    };
                    (symbol, kvtier::swap_in::split_smem_bytes(p.entries, p.hot))
                } else {
                    (b"kvt_emu_swap_in_few_miss_cluster_plan", smem)
                };
            type ClusterFn = unsafe extern "C" fn(
                *const kvt_swap_in_params,
                u32,
                u32,
                usize,
                u32,
                *const Range,
                usize,
                *const Range,
                usize,
            ) -> Report;
            let f: libloading::Symbol<'static, ClusterFn> =
                unsafe { emulator().get(symbol) }.unwrap();
            reports.push(unsafe {
                f(
                    &p,
                    batch as u32 * cluster,
                    threads,
                    smem,
                    cluster,
                    loads.as_ptr(),
                    loads.len(),
                    stores.as_ptr(),
                    stores.len(),
                )
            });
        } else {
            reports.push(unsafe {
                swap_fn(plan)(
                    &p,
                    batch as u32,
                    threads,
                    smem,
                    loads.as_ptr(),
                    loads.len(),
                    stores.as_ptr(),
                    stores.len(),
                )
            });
        }
        // The host launches no copy kernel for a skip-IO swap-in, nor
        // where the plan kernel (or its cluster) copies every miss.
        let copied_in_plan =
            kvtier::abi::KVT_SWAP_COPY_IN_PLAN | clustered | kvtier::abi::KVT_SWAP_SKIP_IO;
        if p.flags & copied_in_plan == 0 {
            let smem = kvtier::swap_in::copy_smem_bytes_for(&p);
            reports.push(unsafe {
                swap_fn(b"kvt_emu_swap_in_copy")(
                    &p,
                    copy_grid,
                    BLOCK,
                    smem,
                    loads.as_ptr(),
                    loads.len(),
                    stores.as_ptr(),
                    stores.len(),
                )
            });
        }
    }
    let report = (!err.is_clear()).then(|| kvtier::BadIndexReport::decode(&err));
    let w: Vec<u64> = counters.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    let counted = kvtier::SwapInCounters::from_words(&w);
    (case.outcome(&s, report, opts, Some(counted)), reports)
}

/// Runs a plan replay through the emulated copy kernel with `grid` blocks.
fn emulate_replay(case: &ReplayCase, grid: u32, copy: CopyMethod) -> (ReplayOutcome, Report) {
    let host: Vec<Vec<u64>> = case.host.iter().map(|h| words(h)).collect();
    let mut device: Vec<Vec<u64>> = case.device.iter().map(|d| words(d)).collect();
    let num_real: Vec<i32> = case.num_real.into_iter().collect();
    let mut err = ErrorWord::clear();
    let p = {
        let args = case.host_args(&host, &mut device, &num_real);
        emulation_replay_params(&args, copy, &mut err as *mut ErrorWord as u64).unwrap()
    };
    let cells = case.src.len();
    let mut loads = vec![
        range(p.plan_src, 8 * cells),
        range(p.plan_dst, 4 * cells),
        range(p.plan_count, 4 * case.count.len()),
        range(p.num_real_reqs, 4 * num_real.len()),
    ];
    let mut stores = Vec::new();
    for plane in 0..case.host.len() {
        loads.push(range(p.host_cache[plane], case.host[0].len()));
        stores.push(range(p.device_buffer[plane], case.device[0].len()));
    }
    let report = if case.count.is_empty() {
        Report::default() // the host launches nothing for an empty plan
    } else {
        unsafe {
            swap_fn(b"kvt_emu_swap_in_copy")(
                &p,
                grid,
                BLOCK,
                kvtier::swap_in::copy_smem_bytes_for(&p),
                loads.as_ptr(),
                loads.len(),
                stores.as_ptr(),
                stores.len(),
            )
        }
    };
    let dn = case.device[0].len();
    let outcome = ReplayOutcome {
        device: device.iter().map(|d| as_bytes(d, dn).to_vec()).collect(),
        report: (!err.is_clear()).then(|| kvtier::BadIndexReport::decode(&err)),
    };
    (outcome, report)
}

fn swap_agrees(case: &SwapCase) {
    let plain = SwapOptions::default();
    let record = SwapOptions {
        record_plan: true,
        ..plain
    };
    let probe = SwapOptions {
        record_plan: true,
        skip_io: true,
        ..plain
    };
    let lines = SwapOptions {
        copy: kvtier::CopyMethod::LineAligned,
        ..plain
    };
    let lines_recording = SwapOptions {
        copy: kvtier::CopyMethod::LineAligned,
        ..record
    };
    let cluster = SwapOptions {
        cluster_copy: true,
        ..plain
    };
    let cluster_recording = SwapOptions {
        cluster_copy: true,
        ..record
    };
    let cluster_probe = SwapOptions {
        cluster_copy: true,
        ..probe
    };
    let split = SwapOptions {
        cluster_plan: true,
        ..plain
    };
    let split_recording = SwapOptions {
        cluster_plan: true,
        ..record
    };
    let split_probe = SwapOptions {
        cluster_plan: true,
        ..probe
    };
    let rows = case.batch() as u64 * case.entries() as u64;
    let runs = [
        (SwapInStrategy::PlanThenCopy, 1, plain),
        (SwapInStrategy::PlanThenCopy, grids(rows)[2], plain),
        (SwapInStrategy::OneBlockPerRequest, 0, plain),
        (SwapInStrategy::PlanThenCopy, 3, plain),
        (SwapInStrategy::PlanThenCopy, grids(rows)[2], record),
        (SwapInStrategy::OneBlockPerRequest, 0, probe),
        (SwapInStrategy::PlanThenCopy, 2, probe),
        (SwapInStrategy::FewMiss, 1, plain),
        (SwapInStrategy::FewMiss, grids(rows)[2], record),
        (SwapInStrategy::FewMiss, 0, probe),
        (SwapInStrategy::Compact, 1, plain),
        (SwapInStrategy::Compact, grids(rows)[2], record),
        (SwapInStrategy::Compact, 0, probe),
        (SwapInStrategy::CompactOneLaunch, 0, plain),
        (SwapInStrategy::CompactOneLaunch, 0, record),
        (SwapInStrategy::FewMiss512, 1, plain),
        (SwapInStrategy::FewMiss512, grids(rows)[2], record),
        (SwapInStrategy::FewMiss512, 0, probe),
        // the line-aligned copy kernel after each kind of plan
        (SwapInStrategy::PlanThenCopy, grids(rows)[2], lines),
        (SwapInStrategy::FewMiss, 1, lines),
        (SwapInStrategy::Compact, grids(rows)[2], lines_recording),
        (SwapInStrategy::FewMiss512, 3, lines),
        // the few-miss planners copying every miss themselves
        (SwapInStrategy::FewMissOneLaunch, 0, plain),
        (SwapInStrategy::FewMissOneLaunch, 0, record),
        (SwapInStrategy::FewMissOneLaunch, 0, probe),
        (SwapInStrategy::FewMiss512OneLaunch, 0, plain),
        (SwapInStrategy::FewMiss512OneLaunch, 0, record),
        // ... with the rows' passes aligned to 128-byte host lines
        (SwapInStrategy::FewMissOneLaunch, 0, lines_recording),
        (SwapInStrategy::FewMiss512OneLaunch, 0, lines),
        // the few-miss planner's cluster build, in clusters of 2, 3 and 4
        // blocks a row (the grid column here)
        (SwapInStrategy::FewMiss, 2, cluster),
        (SwapInStrategy::FewMiss, 3, cluster_recording),
        (SwapInStrategy::FewMiss, 4, cluster_probe),
        // the split planner, in its clusters of KVT_SWAP_CLUSTER blocks a
        // row, and its build for clusters of 2 (the race detector's)
        (SwapInStrategy::FewMiss, 8, split),
        (SwapInStrategy::FewMiss, 8, split_recording),
        (SwapInStrategy::FewMiss, 8, split_probe),
        (SwapInStrategy::FewMiss, 2, split_recording),
    ];
    // under the race detector, each kernel once: the plan and copy kernels
    // recording, one block per request probing, the few-miss and compact
    // planners both ways, the compact one copying every miss, the 512-thread
    // few-miss planner both ways, the line-aligned copy kernel after the
    // first planner and after the compact one, and each few-miss planner
    // copying every miss itself (recording), and each with line-aligned
    // copies, and the cluster build recording (the fixed-shape builds run at
    // their shapes only: fixed_shape_builds_match_at_their_shapes), and the
    // split planner recording in clusters of 2 (ThreadSanitizer tracks at
    // most 8128 threads, and the child runs two tests at once: clusters of
    // at most 3 blocks of 1024 threads here)
    let runs: Vec<_> = if race_detector() {
        [
            4, 5, 7, 9, 10, 12, 13, 16, 17, 18, 20, 23, 26, 27, 28, 30, 35,
        ]
        .map(|i| runs[i])
        .to_vec()
    } else {
        runs.to_vec()
    };
    for ((strategy, grid, opts), schedule) in runs.into_iter().zip(SCHEDULES.iter().cycle()) {
        let cpu = case.run_with(&Executor::cpu(), SwapInStrategy::PlanThenCopy, opts);
        assert_eq!(
            cpu,
            case.expected_with(opts),
            "CPU executor differs from the model ({opts:?}) for {case:?}"
        );
        set_schedule(*schedule);
        let (got, reports) = emulate_swap(case, strategy, grid, opts);
        for r in &reports {
            assert!(
                r.clean(),
                "bad accesses {r:?} ({strategy:?}, copy grid {grid}) for {case:?}"
            );
        }
        assert_eq!(
            got, cpu,
            "kernels differ from the CPU executor ({strategy:?}, copy grid {grid}, {opts:?}) for {case:?}"
        );
    }
}

#[test]
fn swap_in_kernels_match_the_cpu_executor() {
    let mut duplicates = 0;
    for seed in seeds(0..40) {
        for h in [CLEAN, PADDED, HOSTILE] {
            let case = SwapCase::random(seed, SWAP_SMALL, h, None);
            let named_twice =
                |r: &kvtier::BadIndexReport| r.has(kvtier::BadIndexKind::SwapDuplicateRequest);
            duplicates += case.expected().report.as_ref().is_some_and(named_twice) as u32;
            swap_agrees(&case);
        }
    }
    // (the race detector's few seeds need not draw one)
    assert!(
        duplicates > 0 || race_detector(),
        "the hostile cases include a request named twice in a batch"
    );
}

#[test]
fn swap_in_kernels_on_bigger_hot_buffers() {
    let cases: &[(u64, usize)] = if race_detector() {
        &[(2, 7), (4, 300)]
    } else {
        &[(1, 2), (2, 7), (3, 64), (4, 300)]
    };
    for &(seed, misses) in cases {
        swap_agrees(&SwapCase::random(seed, SWAP_MEDIUM, CLEAN, Some(misses)));
    }
    if !race_detector() {
        swap_agrees(&SwapCase::random(5, SWAP_MEDIUM, HOSTILE, None));
    }
}

/// The swap-in's bulk copy kernel moves each miss with one bulk load and one
/// bulk store a plane where every row is one value piece of whole 16-byte
/// units at 16-byte aligned addresses, and as the line-aligned kernel where
/// not (rows with a scale piece, as V4's C4 rows): over random plan
/// replays, bulk loads only for such rows, a store for each, whole planes,
/// and the device rows the CPU executor's.
#[test]
fn the_swap_in_bulk_copy_moves_each_miss_with_one_load_and_store_a_plane() {
    let (mut staged, mut apart) = (0, 0);
    for seed in seeds(0..60) {
        let case = ReplayCase::random(seed, false);
        if case.count.is_empty() || case.skip_io {
            continue;
        }
        let cells = case.count.len() as u64 * case.capacity as u64;
        let grid = grid_schedules(cells)[0].0;
        set_schedule(2);
        let (got, report) = emulate_replay(&case, grid, CopyMethod::BulkRuns);
        assert!(report.clean(), "{report:?} for {case:?}");
        assert_eq!(got, case.run_cpu(), "{case:?}");
        let l = case.layout.to_abi();
        let whole = l.scale_bytes == 0
            && l.value_bytes.is_multiple_of(16)
            && l.page_bytes.is_multiple_of(16);
        let planes = case.host.len() as u64;
        if report.bulk_loads > 0 {
            staged += 1;
            assert!(whole, "{case:?}");
            assert_eq!(report.bulk_loads, report.bulk_stores, "{case:?}");
            assert_eq!(report.bulk_loads % planes, 0, "{case:?}");
        } else {
            apart += 1;
        }
    }
    assert!(staged > 0 && apart > 0, "{staged} staged, {apart} not");
}

#[test]
fn replay_kernel_matches_the_cpu_executor() {
    for seed in seeds(0..60) {
        for hostile in [false, true] {
            let case = ReplayCase::random(seed, hostile);
            let cpu = case.run_cpu();
            assert_eq!(
                cpu,
                case.expected(),
                "CPU executor differs from the model for {case:?}"
            );
            let cells = case.count.len() as u64 * case.capacity as u64;
            for (grid, schedule) in grid_schedules(cells) {
                for copy in CopyMethod::ALL {
                    set_schedule(schedule);
                    let (got, report) = emulate_replay(&case, grid, copy);
                    assert!(
                        report.clean(),
                        "bad accesses {report:?} (grid {grid}, {copy:?}) for {case:?}"
                    );
                    assert_eq!(
                        got, cpu,
                        "kernel differs from the CPU executor (grid {grid}, {copy:?}) for {case:?}"
                    );
                }
            }
        }
    }
}

// ---- the speculative swap-in -------------------------------------------------

type SpecFn = unsafe extern "C" fn(
    *const kvtier::abi::kvt_spec_swap_in_params,
    u32,
    u32,
    usize,
    *const Range,
    usize,
    *const Range,
    usize,
) -> Report;

/// Runs `call` on `case` through the emulated `kvt_spec_swap_in`: the
/// parameters the library builds for a launch, every buffer the call reads
/// as a load range, the ones it writes as store ranges.
fn emulate_spec(case: &mut SpecCase, call: &mut SpecCall) -> (ErrorWord, Report) {
    let mut err = ErrorWord::clear();
    let error = &mut err as *mut ErrorWord as u64;
    let p = {
        let args = case.args(call);
        kvtier::swap_in::emulation_spec_params(&args, error).unwrap()
    };
    let r = |addr: u64, n: usize| range(addr, n);
    let mut stores = vec![
        r(call.out.as_ptr() as u64, 4 * call.out.len()),
        r(case.tokens.as_ptr() as u64, 4 * case.tokens.len()),
        r(case.locs.as_ptr() as u64, 4 * case.locs.len()),
        r(case.cache_index.as_ptr() as u64, 8 * case.cache_index.len()),
        r(
            case.cache_policy.as_ptr() as u64,
            4 * case.cache_policy.len(),
        ),
        r(
            case.scratch_locs.as_ptr() as u64,
            4 * case.scratch_locs.len(),
        ),
        r(
            case.scratch_state.as_ptr() as u64,
            4 * case.scratch_state.len(),
        ),
        r(case.device.as_ptr() as u64, 8 * case.device.len()),
        r(error, std::mem::size_of::<ErrorWord>()),
    ];
    if let Some((src, dst, count)) = &call.plan {
        stores.push(r(src.as_ptr() as u64, 8 * src.len()));
        stores.push(r(dst.as_ptr() as u64, 4 * dst.len()));
        stores.push(r(count.as_ptr() as u64, 4 * count.len()));
    }
    let mut loads = stores.clone();
    loads.extend([
        r(call.topk.as_ptr() as u64, 4 * call.topk.len()),
        r(call.seq.as_ptr() as u64, 4 * call.seq.len()),
        r(call.req.as_ptr() as u64, 8 * call.req.len()),
        r(call.num_real.as_ptr() as u64, 4),
        r(case.host_locs.as_ptr() as u64, 8 * case.host_locs.len()),
        r(case.host.as_ptr() as u64, 8 * case.host.len()),
    ]);
    let f: libloading::Symbol<'static, SpecFn> =
        unsafe { emulator().get(b"kvt_emu_spec_swap_in") }.unwrap();
    let report = unsafe {
        f(
            &p,
            p.batch,
            kvtier::abi::KVT_SPEC_THREADS,
            kvtier::abi::KVT_SPEC_SMEM_BYTES as usize,
            loads.as_ptr(),
            loads.len(),
            stores.as_ptr(),
            stores.len(),
        )
    };
    (err, report)
}

/// Checks the emulated kernel against the CPU executor under every schedule
/// (see `common::spec::kernel_agrees`), with every access in range.
fn spec_agrees(case: &SpecCase, calls: &[SpecCall]) {
    for &schedule in schedules() {
        kernel_agrees(case, calls, &format!("schedule {schedule}"), |gpu, k| {
            set_schedule(schedule);
            let (err, report) = emulate_spec(gpu, k);
            assert!(
                report.clean(),
                "schedule {schedule}: bad accesses {report:?}"
            );
            expected_report(&err)
        });
    }
}

fn spec_call(topk: Vec<i32>, batch: usize, steps: usize, seq: i32) -> SpecCall {
    SpecCall::new(topk, batch, steps, seq, true)
}

#[test]
fn spec_kernel_union_clock_and_its_second_call() {
    // SGLang's 782 cross-step misses, then the same query (all hits)
    let case = SpecCase::new(1, 4096, 64, 4096, 16384, 2, 4, 2048);
    let q = cross_step_misses(4096, 2048);
    spec_agrees(
        &case,
        &[spec_call(q.clone(), 1, 4, 16384), spec_call(q, 1, 4, 16384)],
    );
}

#[test]
fn spec_kernel_approximate_clock_and_misses_past_the_scratch() {
    // every occurrence a fresh miss: past the hot buffer with a scratch that
    // holds them all (approximate CLOCK), and with half of them (direct
    // copies into victims' rows), two requests at once
    for scratch in [8192, 4096] {
        let case = SpecCase::new(2, 4096, 64, scratch, 20000, 1, 4, 2048);
        let topk: Vec<i32> = (0..2 * 8192)
            .map(|i| 4096 + i % 8192 + (i / 8192) * 3)
            .collect();
        let mut call = spec_call(topk, 2, 4, 20000);
        call.req = vec![1, 0];
        spec_agrees(&case, &[call.clone(), call]);
    }
}

#[test]
fn spec_kernel_drafts_padding_and_bad_input() {
    let mut case = SpecCase::new(3, 2048, 16, 2048, 6000, 1, 2, 1024);
    // draft tokens 5996..6000 on request 0's extra page, not in the host table
    for (i, d) in (5996..6000).enumerate() {
        let slot = 2048 + 3 * i;
        case.tokens[slot] = d;
        let row = case.locs[slot] as usize;
        case.device[row] = d as u64 * SCALE;
        case.host_locs[d as usize] = -1;
    }
    let mut topk: Vec<i32> = Vec::new();
    for row in 0..3 {
        for step in 0..2 {
            let mut q: Vec<i32> = (0..1024)
                .map(|i| (i * 7 + step * 100 + row * 13) % 6000)
                .collect();
            q[0] = 5996 + step;
            q[1] = -1;
            topk.extend(q);
        }
    }
    topk[2] = 7000; // past the step's sequence: refused
    topk[3] = -9;
    let mut call = spec_call(topk.clone(), 3, 2, 6000);
    call.seq[1] = 5998; // step 1 of row 0 sees fewer tokens
    let mut dup = call.clone();
    dup.req = vec![0, 2, 0]; // row 2 names row 0's request: refused
    let mut padded = call.clone();
    padded.num_real = [2];
    // Bad step lengths: the first bad step of a row is the one reported
    // (row 1: both steps bad, with different values), and a bad request
    // takes precedence over its row's bad length (row 2).
    let mut lengths = call.clone();
    lengths.seq[2] = 7000;
    lengths.seq[3] = -3;
    lengths.seq[5] = 6001;
    let mut both = lengths.clone();
    both.req = vec![0, 1, 9];
    spec_agrees(&case, &[call, dup, padded, lengths, both]);
}

#[test]
fn spec_kernel_continues_on_the_cpu_executors_state() {
    // the CPU executor's state after one call is the kernel's input of the
    // next (and the reverse is what spec_agrees checks call after call)
    let mut case = SpecCase::new(1, 4096, 64, 4096, 16384, 2, 4, 2048);
    let engine = kvtier::SwapInEngine::new(Executor::cpu()).unwrap();
    let mut first = spec_call(cross_step_misses(4096, 2048), 1, 4, 16384);
    engine
        .run_spec(&case.args(&mut first), kvtier::Stream::null())
        .unwrap();
    let q: Vec<i32> = (0..8192).map(|i| (i * 5 + 3000) % 16000).collect();
    spec_agrees(&case, &[spec_call(q, 1, 4, 16384)]);
}

#[test]
fn spec_kernel_does_not_trust_a_miss_table_of_its_own_epoch() {
    let mut case = SpecCase::new(1, 4096, 64, 4096, 16384, 1, 4, 2048);
    let topk: Vec<i32> = (4096..4096 + 8192).collect();
    plant_foreign_cells(&mut case, &topk);
    spec_agrees(&case, &[spec_call(topk, 1, 4, 16384)]);
}

#[test]
fn spec_kernel_takes_over_stale_hash_entries() {
    let mut case = SpecCase::new(1, 4096, 64, 4096, 16384, 1, 4, 2048);
    plant_stale_entries(&mut case);
    let q = cross_step_misses(4096, 2048);
    spec_agrees(
        &case,
        &[spec_call(q.clone(), 1, 4, 16384), spec_call(q, 1, 4, 16384)],
    );
}

#[repr(C)]
struct PlantedParams {
    out: *mut u32,
    variant: u32,
}

/// One block of `block` threads of a planted kernel over `out`.
fn emulate_planted(variant: u32, block: u32, out: &mut [u32]) -> Report {
    emulate_planted_at(variant, block, out.as_mut_ptr(), 4 * out.len())
}

/// The same over `bytes` at `out`, which the caller keeps alive.
fn emulate_planted_at(variant: u32, block: u32, out: *mut u32, bytes: usize) -> Report {
    let p = PlantedParams { out, variant };
    let mem = [range(out as u64, bytes)];
    type PlantedFn = unsafe extern "C" fn(
        *const PlantedParams,
        u32,
        *const Range,
        usize,
        *const Range,
        usize,
    ) -> Report;
    let f: libloading::Symbol<'static, PlantedFn> =
        unsafe { emulator().get(b"kvt_emu_planted") }.unwrap();
    unsafe { f(&p, block, mem.as_ptr(), 1, mem.as_ptr(), 1) }
}

/// The emulator judges the bulk engine as the GPU would fail it: a store
/// with no wait for the loads writes what the stage held (and the loads
/// never waited for are counted); a store issued before the wait, shared
/// stores that reach a bulk store without the proxy fence, a stage written
/// again before its store has read it (through the tracked store or a
/// plain one), and a thread that ends with a store it never waited for are
/// each counted as misuse; the correct order moves the rows.
/// Planted in tests/kernel_emu/planted.cu.
#[test]
fn the_emulator_catches_planted_bulk_copy_bugs() {
    let run = |variant: u32| {
        // 16-byte aligned, as bulk operations need
        let mut mem = vec![0u128; 64];
        let out = mem.as_mut_ptr() as *mut u32;
        // SAFETY: 256 words inside `mem`, which outlives every use.
        let words = unsafe { std::slice::from_raw_parts_mut(out, 256) };
        for (i, w) in words.iter_mut().enumerate().take(48) {
            *w = 1000 + i as u32;
        }
        for w in &mut words[128..192] {
            *w = 0xDEAD;
        }
        set_schedule(2);
        let r = emulate_planted_at(variant, 128, out, 1024);
        // SAFETY: as above; the emulated kernel has returned.
        let words = unsafe { std::slice::from_raw_parts(out, 256) }.to_vec();
        drop(mem);
        (r, words)
    };
    let want: Vec<u32> = (1000..1048).chain([0; 16]).collect();
    let (r, out) = run(13);
    assert!(r.clean(), "{r:?}");
    assert_eq!(&out[128..192], &want[..]);
    assert_eq!((r.bulk_loads, r.bulk_stores), (3, 1));

    let (r, out) = run(14);
    assert!(r.bulk_misuse > 0, "loads never waited for: {r:?}");
    assert_ne!(
        &out[128..192],
        &want[..],
        "the store wrote what the stage held before"
    );
    let (r, _) = run(15);
    assert!(
        r.bulk_misuse > 0,
        "zeros stored without the proxy fence: {r:?}"
    );
    let (r, out) = run(16);
    assert!(r.bulk_misuse > 0, "a store never waited for: {r:?}");
    assert!(out[128..192].iter().all(|&w| w == 0xDEAD));
    let (r, _) = run(17);
    assert!(
        r.bulk_misuse > 0,
        "the stage written while its store reads it: {r:?}"
    );
    let (r, _) = run(18);
    assert!(
        r.bulk_misuse > 0,
        "a store issued before the loads' wait: {r:?}"
    );
    let (r, _) = run(19);
    assert!(
        r.bulk_misuse > 0,
        "a plain store into the stage under a store: {r:?}"
    );
}

/// The planners' hash table size in closed form is the smallest power of two
/// at least spread * entries (what the host sizes their shared memory with,
/// `next_power_of_two`), at every size a planner takes and the edges of the
/// closed form (0, 1, powers of two and their neighbours).
#[test]
fn hash_size_is_the_next_power_of_two() {
    type HashSizeFn = unsafe extern "C" fn(u32, u32) -> u32;
    let f: libloading::Symbol<'static, HashSizeFn> =
        unsafe { emulator().get(b"kvt_emu_hash_size") }.unwrap();
    let mut sizes: Vec<u32> = (0..=20_000).collect();
    for b in 1..28 {
        sizes.extend([(1u32 << b) - 1, 1 << b, (1 << b) + 1]);
    }
    for spread in [1u32, 2, 4] {
        for &e in &sizes {
            let Some(n) = e.checked_mul(spread).filter(|&n| n <= 1 << 30) else {
                continue;
            };
            // SAFETY: a pure function of its two integers.
            let got = unsafe { f(e, spread) };
            assert_eq!(got, n.next_power_of_two(), "entries {e}, spread {spread}");
        }
    }
}

/// The emulator judges warp-level code and ordering: shuffles exchange the
/// values of the lanes they name (a shuffle reading the wrong lane gives
/// wrong prefix sums), a full-warp vote that some lanes skip is reported, and
/// under the shuffled schedules threads switch at global accesses, so an
/// update two threads race on loses increments (one an atomic makes never
/// does). Planted in tests/kernel_emu/planted.cu.
#[test]
fn the_emulator_catches_planted_lane_exchange_vote_and_race_bugs() {
    let block = 256u32;
    let want: Vec<u32> = (0..block).map(|t| (0..=t % 32).sum()).collect();
    for schedule in SCHEDULES {
        set_schedule(schedule);
        let mut out = vec![0u32; block as usize];
        let r = emulate_planted(0, block, &mut out);
        assert!(
            r.clean() && r.warp_ops == 5 * u64::from(block / 32),
            "{r:?}"
        );
        assert_eq!(out, want, "correct shuffles, schedule {schedule}");
        let r = emulate_planted(1, block, &mut out);
        assert!(r.clean(), "{r:?}");
        assert_ne!(
            out, want,
            "a shuffle reading the wrong lane, schedule {schedule}"
        );
        let r = emulate_planted(2, block, &mut out);
        assert_eq!(
            r.divergent_warp,
            u64::from(block / 32),
            "a skipped vote: {r:?}"
        );
        let mut counter = [0u32];
        assert!(emulate_planted(4, block, &mut counter).clean());
        assert_eq!(counter[0], block, "atomic increments, schedule {schedule}");
    }
    // The 16-bit minimum by a CAS on the 32-bit word (the compact planner's
    // atomic_min16): exact in every schedule; a plain read, compare and
    // write loses minima where threads switch between the read and the write.
    let min_of = |parity: u32| {
        (0..block)
            .filter(|t| t % 2 == parity)
            .map(|t| 1000 + (t * 37) % 512)
            .min()
            .unwrap()
    };
    let minima = min_of(0) | (min_of(1) << 16);
    for (schedule, racy) in [(0, false), (1, false), (2, true), (3, true)] {
        set_schedule(schedule);
        let mut word = [u32::MAX];
        assert!(emulate_planted(11, block, &mut word).clean());
        assert_eq!(word[0], minima, "atomic_min16, schedule {schedule}");
        let mut word = [u32::MAX];
        assert!(emulate_planted(12, block, &mut word).clean());
        assert_eq!(
            word[0] != minima,
            racy,
            "plain 16-bit minima gave {:#x} (want {minima:#x}), schedule {schedule}",
            word[0]
        );
    }
    // The race shows under the shuffled schedules (threads switch between
    // the load and the store), not under the fixed orders.
    for (schedule, racy) in [(0, false), (1, false), (2, true), (3, true)] {
        set_schedule(schedule);
        let mut counter = [0u32];
        assert!(emulate_planted(3, block, &mut counter).clean());
        assert_eq!(
            counter[0] < block,
            racy,
            "racing increments gave {} of {block}, schedule {schedule}",
            counter[0]
        );
    }
}

/// Shared memory through the planted kernel (tests/kernel_emu/planted.cu):
/// each thread writes its word, then reads its neighbour's, after a barrier
/// (variant 5) or, within its warp, a __syncwarp (7), and gets the
/// neighbour's value. The race detector's test runs one variant per child
/// process, the racy ones too, through `KVT_EMU_PLANTED`.
#[test]
fn planted_shared_memory_orderings() {
    let block = 256u32;
    let variants: Vec<u32> = match std::env::var("KVT_EMU_PLANTED") {
        Ok(v) => vec![v.parse().expect("KVT_EMU_PLANTED is a variant number")],
        Err(_) => vec![5, 7],
    };
    for variant in variants {
        let mut out = vec![0u32; block as usize];
        let r = emulate_planted(variant, block, &mut out);
        assert!(r.clean(), "variant {variant}: {r:?}");
        let neighbour = |t: u32| {
            match variant {
                5 => (t + 1) % block,
                7 => t - t % 32 + (t % 32 + 1) % 32,
                _ => return None,
            }
            .into()
        };
        let want: Vec<Option<u32>> = (0..block)
            .map(|t| neighbour(t).map(|n: u32| 3 * n + 1))
            .collect();
        if want.iter().all(Option::is_some) {
            let got: Vec<Option<u32>> = out.iter().map(|&v| Some(v)).collect();
            assert_eq!(got, want, "variant {variant}");
        }
    }
}

/// Thread-block clusters (kernels/common.cuh `cluster_sync`, planted in
/// tests/kernel_emu/planted.cu): the blocks of a cluster run together, each
/// knows its rank and the cluster's size, and a cluster barrier orders one
/// block's global stores before another's loads, under every schedule;
/// without the barrier a block reads what its neighbour has not written
/// yet, and a rank that ends before the barrier is a divergent barrier. The
/// same through distributed shared memory (`cluster_map`, variants 23-25):
/// ordered by the barrier; unordered without it; and a block that exits
/// while another still maps its shared memory is a misuse (its bytes are
/// gone). The race detector's test runs variants 20, 21, 23 and 24 in child
/// processes through `KVT_EMU_PLANTED` (21 and 24 are races between blocks).
#[test]
fn the_emulator_runs_clusters_and_catches_a_missing_cluster_barrier() {
    let variants: Vec<u32> = match std::env::var("KVT_EMU_PLANTED") {
        Ok(v) => vec![v.parse().expect("KVT_EMU_PLANTED is a variant number")],
        Err(_) => vec![20, 21, 22, 23, 24, 25],
    };
    type ClusterFn = unsafe extern "C" fn(
        *const PlantedParams,
        u32,
        u32,
        u32,
        *const Range,
        usize,
        *const Range,
        usize,
    ) -> Report;
    let f: libloading::Symbol<'static, ClusterFn> =
        unsafe { emulator().get(b"kvt_emu_planted_cluster") }.unwrap();
    let block = 64u32;
    for variant in variants {
        for (cluster, schedule) in [(2u32, 0u64), (4, 2), (4, 3)] {
            let grid = 3 * cluster;
            let (n, g) = (block as usize, grid as usize);
            let mut out = vec![0u32; 2 * g * n + g];
            let p = PlantedParams {
                out: out.as_mut_ptr(),
                variant,
            };
            let mem = [range(out.as_ptr() as u64, 4 * out.len())];
            set_schedule(schedule);
            let r = unsafe { f(&p, grid, block, cluster, mem.as_ptr(), 1, mem.as_ptr(), 1) };
            let written = |b: usize, t: usize| 7 * b as u32 + t as u32 + 1;
            let next = |b: usize| {
                let c = cluster as usize;
                b - b % c + (b % c + 1) % c
            };
            let read_right =
                (0..g).all(|b| (0..n).all(|t| out[(g + b) * n + t] == written(next(b), t)));
            let ranks: Vec<u32> = (0..g)
                .map(|b| 100 * (b as u32 % cluster) + cluster)
                .collect();
            assert_eq!(&out[2 * g * n..], &ranks[..], "variant {variant}");
            let what =
                format!("variant {variant}, clusters of {cluster}, schedule {schedule}: {r:?}");
            match variant {
                20 => {
                    assert!(r.clean() && read_right, "{what}");
                    assert_eq!(r.cluster_barriers, (grid / cluster) as u64, "{what}");
                }
                21 => {
                    assert!(r.clean() && r.cluster_barriers == 0, "{what}");
                    assert!(
                        !read_right,
                        "the blocks read their neighbours unordered, yet right: {what}"
                    );
                }
                22 => assert!(r.divergent_barrier > 0, "{what}"),
                23 => {
                    assert!(r.clean() && read_right, "{what}");
                    assert_eq!(r.cluster_barriers, 2 * (grid / cluster) as u64, "{what}");
                }
                24 => {
                    assert!(r.clean(), "{what}");
                    assert!(
                        !read_right,
                        "the blocks read their neighbours' shared memory unordered, yet right: {what}"
                    );
                }
                25 => assert!(
                    r.cluster_misuse > 0,
                    "a block read the shared memory of a block that exited: {what}"
                ),
                _ => {}
            }
        }
    }
    // a grid that is not whole clusters is refused, as the driver refuses it
    let mut out = vec![0u32; 64];
    let p = PlantedParams {
        out: out.as_mut_ptr(),
        variant: 20,
    };
    let mem = [range(out.as_ptr() as u64, 4 * out.len())];
    let r = unsafe { f(&p, 3, 8, 2, mem.as_ptr(), 1, mem.as_ptr(), 1) };
    assert!(!r.clean() && r.loads == 0 && r.stores == 0, "{r:?}");
}

/// Taking the error word while kernels report into it (R6): 255 threads
/// each report four times (three kinds) while thread 0 takes the word once, under
/// the shuffled schedules, which switch threads at every atomic and global
/// access. With `kvt_error_take`'s exchanges (kernels/error_word.cu) every
/// report is in what the take got or still in the word: counts add up to 1020,
/// flags and first positions merge to what the CPU reference computes, and
/// some schedule takes in the middle. The earlier read-then-reset loses
/// reports under some schedule, which this test tells from the fixed one.
#[test]
fn a_report_racing_the_error_word_take_is_not_lost() {
    use kvtier::abi::kvt_error_word;
    let block = 256u32;
    let reports = 4 * (block - 1);
    let mut want = ErrorWord::clear();
    for t in 1..block {
        for i in 0..4 {
            want.report((t + i) % 3, 4 * t + i, -i64::from(t));
        }
    }
    for (variant, exchanges) in [(9u32, true), (10, false)] {
        let (mut split, mut lost) = (false, false);
        for schedule in 2..14 {
            set_schedule(schedule);
            let mut words = [ErrorWord::clear().0, ErrorWord::clear().0];
            let bytes = 2 * std::mem::size_of::<kvt_error_word>();
            let r = emulate_planted_at(variant, block, words.as_mut_ptr().cast(), bytes);
            assert!(r.clean(), "{r:?}");
            let (left, taken) = (ErrorWord(words[0]), ErrorWord(words[1]));
            let mut merged = taken;
            merged.merge(&left);
            split |= taken.0.count > 0 && taken.0.count < reports;
            if exchanges {
                assert_eq!(
                    merged, want,
                    "schedule {schedule}: taken {taken:?} and left {left:?} lose reports"
                );
            } else {
                lost |= merged.0.count < reports;
            }
        }
        assert!(
            split,
            "variant {variant}: no schedule took the word mid-way"
        );
        assert_eq!(
            lost, !exchanges,
            "variant {variant}: the naive take should lose reports under some schedule, the exchanges never"
        );
    }
}

/// The tests `the_race_detector_...` runs under the race detector: every
/// kernel, each strategy and path of the swap-in, on fewer random cases (see
/// `seeds`). Not the production shape's or the memcheck's (shapes and bad
/// addresses, not orderings; the production shape takes minutes under it).
const RACE_CHECKED: [&str; 16] = [
    "gather_kernel_matches_the_cpu_executor",
    "writeback_kernel_matches_the_cpu_executor",
    "run_heavy_cases_match_the_cpu_executor",
    "entries_larger_than_one_pass",
    "regions_at_8_mod_16_take_the_head_and_tail_paths",
    "swap_in_kernels_match_the_cpu_executor",
    "swap_in_kernels_on_bigger_hot_buffers",
    "replay_kernel_matches_the_cpu_executor",
    "spec_kernel_union_clock_and_its_second_call",
    "spec_kernel_approximate_clock_and_misses_past_the_scratch",
    "spec_kernel_drafts_padding_and_bad_input",
    "spec_kernel_continues_on_the_cpu_executors_state",
    "spec_kernel_does_not_trust_a_miss_table_of_its_own_epoch",
    "spec_kernel_takes_over_stale_hash_entries",
    "planners_barriers_per_block",
    "plan_kernels_let_a_successor_start_only_when_the_copy_kernel_follows",
];

/// The race detector (tests/kernel_emu/emulator.cpp): the emulator built
/// with ThreadSanitizer, each emulated thread one of its fibers, in a child
/// process of this test binary with ThreadSanitizer's runtime preloaded (the
/// Rust code is not instrumented, the emulated kernels are). Each planted
/// race is reported: shared memory read with no barrier, or with only a vote
/// between (votes order no memory), and a plain read-modify-write of global
/// memory; their correctly ordered twins are not, and neither is any kernel
/// under the tests `RACE_CHECKED` names. The speculative swap-in's loads and
/// stores that race with its atomics by design are `ld_racy`/`st_racy`
/// (kernels/common.cuh): atomics to the detector, strong accesses on the GPU.
#[test]
fn the_race_detector_catches_planted_races_and_the_kernels_have_none() {
    if race_detector() {
        return; // the child process runs the other tests
    }
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let runtime = Command::new(&cxx)
        .arg("-print-file-name=libtsan.so")
        .output()
        .expect("the host C++ compiler runs");
    let runtime = PathBuf::from(String::from_utf8_lossy(&runtime.stdout).trim());
    assert!(
        runtime.is_absolute() && runtime.exists(),
        "{cxx} has no ThreadSanitizer runtime (libtsan.so) for the race detector"
    );
    // The Rust side is not instrumented, so ThreadSanitizer misses its
    // synchronisation (std's channels and locks use atomics it cannot see)
    // and would report its own threads' hand-offs: races with a frame in this
    // binary are suppressed. An emulated thread's stack never has one (each
    // starts in the emulator's fiber entry), so a race between two emulated
    // threads always shows.
    let exe = std::env::current_exe().unwrap();
    let suppressions = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("tsan-suppressions-{}.txt", std::process::id()));
    std::fs::write(
        &suppressions,
        format!("race:{}\n", exe.file_name().unwrap().to_string_lossy()),
    )
    .unwrap();
    let options = format!(
        "exitcode=66 halt_on_error=0 report_signal_unsafe=0 suppressions={}",
        suppressions.display()
    );
    let child = |args: &[&str], planted: Option<u32>| {
        let mut cmd = Command::new(&exe);
        cmd.args(args)
            .env("KVT_EMU_RACES", "1")
            .env("LD_PRELOAD", &runtime)
            .env("TSAN_OPTIONS", &options);
        match planted {
            Some(v) => cmd.env("KVT_EMU_PLANTED", v.to_string()),
            None => cmd.env_remove("KVT_EMU_PLANTED"),
        };
        let out = cmd.output().expect("the test binary runs again");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let races = stderr
            .matches("WARNING: ThreadSanitizer: data race")
            .count();
        (out.status.code(), races, stderr)
    };
    // Each planted variant of `test` in a child of its own: the racy ones
    // reported in a kernel whose name holds `kernel`, the ordered twins not.
    let planted = |test: &str, variants: &[(u32, bool)], kernel: &str| {
        for &(variant, racy) in variants {
            let (code, races, stderr) =
                child(&["--exact", test, "--test-threads=1"], Some(variant));
            if racy {
                assert!(
                    code == Some(66) && races > 0 && stderr.contains(kernel),
                    "planted variant {variant} of {test}: a race the detector missed (exit {code:?}):\n{stderr}"
                );
            } else {
                assert!(
                    code == Some(0) && races == 0,
                    "planted variant {variant} of {test} is correctly ordered, yet (exit {code:?}):\n{stderr}"
                );
            }
        }
    };
    // shared memory read with no barrier, or with only a ballot between
    planted(
        "planted_shared_memory_orderings",
        &[(5, false), (6, true), (7, false), (8, true)],
        "kvt_planted",
    );
    // a cluster barrier orders the blocks of a cluster, their global memory
    // and their shared memory read through cluster_map; without it they race
    planted(
        "the_emulator_runs_clusters_and_catches_a_missing_cluster_barrier",
        &[(20, false), (21, true), (23, false), (24, true)],
        "kvt_planted_cluster",
    );
    // the planted global-memory race (variant 3) is one case of this test
    let (code, races, stderr) = child(
        &[
            "--exact",
            "the_emulator_catches_planted_lane_exchange_vote_and_race_bugs",
        ],
        None,
    );
    assert!(
        code == Some(66) && races > 0 && stderr.contains("kvt_planted"),
        "the planted global-memory race was missed (exit {code:?}):\n{stderr}"
    );
    // the kernels under the race detector
    let mut args = RACE_CHECKED.to_vec();
    args.extend(["--exact", "--test-threads=2"]);
    let (code, races, stderr) = child(&args, None);
    assert!(
        code == Some(0) && races == 0,
        "the race detector reports {races} race(s) in the kernels (exit {code:?}):\n{stderr}"
    );
}

/// The few-miss planner's fixed-shape builds at their shapes, K 2048 over
/// HOT 4096 and 8192 (the only shapes that take them: elsewhere the flag
/// runs the plain build), the one-launch planner's with warp-vector and
/// line-aligned copies, with 2 and 410 misses, on valid rows and on rows
/// with a few bad entries or wholly hostile ones; recording the plan and
/// probing; outputs, state, plan, bytes and reports the CPU executor's, five
/// barriers a block as the plain build.
#[test]
fn fixed_shape_builds_match_at_their_shapes() {
    let few_bad = Hostility {
        bad: 0.002,
        padding: 0.01,
    };
    let cases = [
        (4096usize, 2usize, CLEAN),
        (8192, 410, CLEAN),
        (4096, 410, few_bad),
        (8192, 2, HOSTILE),
    ];
    for (seed, (hot, misses, h)) in cases.into_iter().enumerate() {
        let shape = SwapShape {
            batch: Some(3),
            short_share: 0.0,
            ..SwapShape::tokens(hot, 2048, 656, 3, hot + 4096)
        };
        let clean = h.bad == 0.0 && h.padding == 0.0;
        let mut case = SwapCase::shaped(seed as u64, shape, Some(misses)).spoiled(seed as u64, h);
        case.num_real = None;
        let record = SwapOptions {
            record_plan: true,
            ..SwapOptions::default()
        };
        let probe = SwapOptions {
            skip_io: true,
            ..record
        };
        for opts in [SwapOptions::default(), record, probe] {
            let want = case.run_with(&Executor::cpu(), SwapInStrategy::PlanThenCopy, opts);
            set_schedule(2 + seed as u64 % 2);
            for (strategy, copy) in [
                (SwapInStrategy::FewMiss, CopyMethod::WarpVectors),
                (SwapInStrategy::FewMissOneLaunch, CopyMethod::WarpVectors),
                (SwapInStrategy::FewMissOneLaunch, CopyMethod::LineAligned),
            ] {
                let fixed = SwapOptions {
                    fixed_shape: true,
                    copy,
                    ..opts
                };
                let (got, reports) = emulate_swap(&case, strategy, 4, fixed);
                assert!(
                    got == want,
                    "{strategy:?}, HOT {hot}, {misses} misses, {h:?}, {fixed:?}"
                );
                if clean {
                    assert!(reports.iter().all(|r| r.clean()), "{reports:?}");
                    assert_eq!(
                        reports[0].barriers,
                        3 * 5,
                        "{strategy:?}, HOT {hot}: three blocks"
                    );
                }
            }
        }
    }
}

/// The few-miss planner's cluster build at production shapes (K 2048 over
/// HOT 4096, 656-byte rows), in clusters of 4 blocks a row: 410 misses a row
/// (every block of the cluster copies its share after the cluster barrier)
/// and 2 (rank 0 copies them itself), valid and with a few bad entries;
/// recording the plan and probing; outputs, state, plan, bytes and reports
/// the CPU executor's, one cluster barrier a row, and as many block
/// barriers as the plain planner's.
#[test]
fn cluster_build_matches_at_production_shapes() {
    let few_bad = Hostility {
        bad: 0.002,
        padding: 0.01,
    };
    for (seed, misses, h) in [(11u64, 410usize, CLEAN), (12, 2, CLEAN), (13, 410, few_bad)] {
        let shape = SwapShape {
            batch: Some(2),
            short_share: 0.0,
            ..SwapShape::tokens(4096, 2048, 656, 2, 4096 + 4096)
        };
        let clean = h.bad == 0.0 && h.padding == 0.0;
        let mut case = SwapCase::shaped(seed, shape, Some(misses)).spoiled(seed, h);
        case.num_real = None;
        let record = SwapOptions {
            record_plan: true,
            cluster_copy: true,
            ..SwapOptions::default()
        };
        for opts in [
            SwapOptions {
                cluster_copy: true,
                ..SwapOptions::default()
            },
            record,
            SwapOptions {
                skip_io: true,
                ..record
            },
        ] {
            let want = case.run_with(&Executor::cpu(), SwapInStrategy::PlanThenCopy, opts);
            set_schedule(2 + seed % 2);
            let (got, reports) = emulate_swap(&case, SwapInStrategy::FewMiss, 4, opts);
            assert!(got == want, "{misses} misses, {h:?}, {opts:?}");
            assert_eq!(reports.len(), 1, "one launch: {reports:?}");
            if clean {
                assert!(reports[0].clean(), "{reports:?}");
                assert_eq!(reports[0].cluster_barriers, 2, "a cluster barrier a row");
                assert_eq!(
                    reports[0].barriers,
                    2 * 5,
                    "five block barriers a row's rank 0"
                );
            }
        }
    }
}

/// The split planner at production shapes (K 2048 over HOT 4096, 656-byte
/// rows) in its clusters of KVT_SWAP_CLUSTER blocks a row: 410 misses a row
/// (every block copies the misses among its entries) and 2, valid and with
/// a few bad entries; plain, recording the plan and probing; outputs, state,
/// plan, bytes and reports the CPU executor's, one launch, and four cluster
/// barriers a clean row (three before the copy, one before a block exits).
#[test]
fn split_planner_matches_at_production_shapes() {
    let few_bad = Hostility {
        bad: 0.002,
        padding: 0.01,
    };
    let cluster = kvtier::abi::KVT_SWAP_CLUSTER;
    for (seed, misses, h) in [(21u64, 410usize, CLEAN), (22, 2, few_bad)] {
        let shape = SwapShape {
            batch: Some(2),
            short_share: 0.0,
            ..SwapShape::tokens(4096, 2048, 656, 2, 4096 + 4096)
        };
        let clean = h.bad == 0.0 && h.padding == 0.0;
        let mut case = SwapCase::shaped(seed, shape, Some(misses)).spoiled(seed, h);
        case.num_real = None;
        let plain = SwapOptions {
            cluster_plan: true,
            ..SwapOptions::default()
        };
        let record = SwapOptions {
            record_plan: true,
            ..plain
        };
        let probe = SwapOptions {
            skip_io: true,
            ..record
        };
        for opts in [plain, record, probe] {
            let want = case.run_with(&Executor::cpu(), SwapInStrategy::PlanThenCopy, opts);
            set_schedule(2 + seed % 2);
            let (got, reports) = emulate_swap(&case, SwapInStrategy::FewMiss, cluster, opts);
            assert!(got == want, "{misses} misses, {h:?}, {opts:?}");
            assert_eq!(reports.len(), 1, "one launch: {reports:?}");
            assert!(reports[0].cluster_misuse == 0, "{reports:?}");
            if clean {
                assert!(reports[0].clean(), "{reports:?}");
                assert_eq!(
                    reports[0].cluster_barriers,
                    2 * 4,
                    "four cluster barriers a row"
                );
            }
        }
    }
}

/// Barriers and warp operations per planning block, for a row of K 2048
/// over HOT 4096 with 2 and with 410 misses, for both planners (printed with
/// --nocapture): the few-miss planner passes five barriers on a long row,
/// the block-scan planner dozens.
#[test]
fn planners_barriers_per_block() {
    for misses in [2usize, 410] {
        let shape = SwapShape {
            batch: Some(1),
            short_share: 0.0,
            ..SwapShape::tokens(4096, 2048, 656, 1, 4096 + 4096)
        };
        let mut case = SwapCase::shaped(misses as u64, shape, Some(misses));
        case.num_real = None; // the row is real
        let want = case.run_with(
            &Executor::cpu(),
            SwapInStrategy::PlanThenCopy,
            SwapOptions::default(),
        );
        set_schedule(0);
        for strategy in [
            SwapInStrategy::PlanThenCopy,
            SwapInStrategy::FewMiss,
            SwapInStrategy::Compact,
            SwapInStrategy::CompactOneLaunch,
            SwapInStrategy::FewMiss512,
            SwapInStrategy::FewMissOneLaunch,
            SwapInStrategy::FewMiss512OneLaunch,
        ] {
            let (got, reports) = emulate_swap(&case, strategy, 4, SwapOptions::default());
            assert!(got == want, "{strategy:?}, {misses} misses");
            let plan = &reports[0];
            assert!(plan.clean(), "{plan:?}");
            println!(
                "{strategy:?}, {misses} misses: {} barriers per block, {} warp operations",
                plan.barriers, plan.warp_ops
            );
            if matches!(
                strategy,
                SwapInStrategy::FewMiss
                    | SwapInStrategy::FewMiss512
                    | SwapInStrategy::FewMissOneLaunch
                    | SwapInStrategy::FewMiss512OneLaunch
            ) {
                assert_eq!(plan.barriers, 5, "{misses} misses");
            }
            // One launch: the planning block copied every miss itself.
            if matches!(
                strategy,
                SwapInStrategy::FewMissOneLaunch | SwapInStrategy::FewMiss512OneLaunch
            ) {
                assert_eq!(reports.len(), 1, "{strategy:?}: no copy kernel");
            }
            // The compact planner: one more (its slot test runs in slot
            // order, its counts in LRU order after it).
            if matches!(
                strategy,
                SwapInStrategy::Compact | SwapInStrategy::CompactOneLaunch
            ) {
                assert_eq!(plan.barriers, 6, "{misses} misses");
                assert_eq!(
                    reports.len(),
                    1 + (strategy == SwapInStrategy::Compact) as usize
                );
            }
        }
    }
}

/// A plan kernel lets a programmatic successor start (griddepcontrol.
/// launch_dependents) only when kvtier's copy kernel follows it: never with
/// one block per request (the block copies) or without I/O (no copy kernel
/// is launched), where a successor of another library would otherwise be let
/// in before the kernel's outputs and LRU writes.
#[test]
fn plan_kernels_let_a_successor_start_only_when_the_copy_kernel_follows() {
    let shape = SwapShape {
        batch: Some(2),
        short_share: 0.0,
        ..SwapShape::tokens(64, 16, 16, 2, 64 + 64)
    };
    let mut case = SwapCase::shaped(7, shape, Some(3));
    case.num_real = None;
    let probe = SwapOptions {
        record_plan: true,
        skip_io: true,
        copy: kvtier::CopyMethod::WarpVectors,
        fixed_shape: false,
        cluster_copy: false,
        cluster_plan: false,
    };
    set_schedule(0);
    for (strategy, opts, follows) in [
        (SwapInStrategy::PlanThenCopy, SwapOptions::default(), true),
        (SwapInStrategy::FewMiss, SwapOptions::default(), true),
        (
            SwapInStrategy::OneBlockPerRequest,
            SwapOptions::default(),
            false,
        ),
        (SwapInStrategy::PlanThenCopy, probe, false),
        (SwapInStrategy::FewMiss, probe, false),
        (SwapInStrategy::Compact, SwapOptions::default(), true),
        (SwapInStrategy::Compact, probe, false),
        (SwapInStrategy::FewMiss512, SwapOptions::default(), true),
        (SwapInStrategy::FewMiss512, probe, false),
        // every miss copied by its planning block: no copy kernel follows
        (
            SwapInStrategy::CompactOneLaunch,
            SwapOptions::default(),
            false,
        ),
        (
            SwapInStrategy::FewMissOneLaunch,
            SwapOptions::default(),
            false,
        ),
        (
            SwapInStrategy::FewMiss512OneLaunch,
            SwapOptions::default(),
            false,
        ),
        // the cluster build: its own blocks copy, after a cluster barrier
        (
            SwapInStrategy::FewMiss,
            SwapOptions {
                cluster_copy: true,
                ..SwapOptions::default()
            },
            false,
        ),
    ] {
        let (_, reports) = emulate_swap(&case, strategy, 2, opts);
        let plan = &reports[0];
        assert!(plan.clean(), "{plan:?}");
        assert_eq!(
            plan.dependents_allowed > 0,
            follows,
            "{strategy:?}, {opts:?}: {} threads triggered",
            plan.dependents_allowed
        );
    }
}

type EngramFn = unsafe extern "C" fn(
    *const kvt_engram_gather_params,
    u32,
    u32,
    *const Range,
    usize,
    *const Range,
    usize,
) -> Report;

/// The Engram gather kernel under the emulator, on the model's random and
/// hostile cases, at every grid and schedule: the CPU executor's output and
/// error word, every load inside the table rows it may read.
#[test]
fn engram_gather_kernel_matches_the_cpu_executor() {
    let f: libloading::Symbol<'static, EngramFn> =
        unsafe { emulator().get(b"kvt_emu_engram_gather") }.unwrap();
    for hostile in [false, true] {
        for case in engram_model::cases(40, hostile) {
            let (cpu_out, cpu_res) = case.run_cpu();
            let (want, _) = case.expected();
            assert!(
                cpu_out == want,
                "CPU executor differs from the model for {case:?}"
            );
            let weights = Aligned::from(&case.weights);
            let scales = Aligned::from(&case.scales);
            let ids64 = case.ids.clone();
            let ids32 = case.ids32();
            let (ids_addr, ids_bytes) = if case.ids_int64 {
                (ids64.as_ptr() as u64, 8 * ids64.len() as u64)
            } else {
                (ids32.as_ptr() as u64, 4 * ids32.len() as u64)
            };
            let n = case.ids.len();
            let out_rows = case.out_rows.clone();
            let out_rows_range = out_rows
                .as_ref()
                .map_or(Range { start: 0, end: 0 }, |r| Range {
                    start: r.as_ptr() as u64,
                    end: r.as_ptr() as u64 + 4 * r.len() as u64,
                });
            let rows = (n as u64).max(1);
            for (grid, schedule) in grid_schedules(rows) {
                set_schedule(schedule);
                let out = Aligned::new(2 * n * case.dim as usize, 0, 0xCD);
                let mut err = ErrorWord::clear();
                let p = kvt_engram_gather_params {
                    weights: weights.addr(),
                    scales: scales.addr(),
                    ids: ids_addr,
                    out: out.addr(),
                    out_rows: out_rows.as_ref().map_or(0, |r| r.as_ptr() as u64),
                    error: &mut err as *mut ErrorWord as u64,
                    row_lo: case.row_lo,
                    row_hi: case.row_hi,
                    rows: case.rows as u64,
                    n: n as u32,
                    dim: case.dim,
                    block: case.block,
                    ids_int64: case.ids_int64 as u32,
                };
                let loads = [
                    weights.range(),
                    scales.range(),
                    Range {
                        start: ids_addr,
                        end: ids_addr + ids_bytes,
                    },
                    out_rows_range,
                ];
                let stores = [out.range()];
                let report = unsafe { f(&p, grid, BLOCK, loads.as_ptr(), 4, stores.as_ptr(), 1) };
                assert!(report.clean(), "bad accesses {report:?} for {case:?}");
                let got: Vec<u16> = out
                    .bytes()
                    .chunks(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect();
                assert!(
                    got == cpu_out,
                    "kernel differs from the CPU executor (grid {grid}) for {case:?}"
                );
                // the raw word, read as the Engram gather reads it
                assert_eq!(
                    expected_report(&err).map(|r| r.as_engram()),
                    reported(&cpu_res),
                    "grid {grid}: {case:?}"
                );
            }
        }
    }
}
