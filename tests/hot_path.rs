//! The host work of a per-layer launch allocates nothing: a swap-in's and a
//! plan replay's checks (every argument, the aliasing of the buffers, the
//! kernel parameters) run here under a counting allocator, with the most
//! buffers a call can name (two KV planes, `num_real_reqs`, a caller's plan);
//! so does a whole speculative swap-in on the CPU executor.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use common::spec::*;
use common::swap::*;
use common::*;
use kvtier::swap_in::{EmulationScratch, emulation_params, emulation_replay_params};
use kvtier::{CopyMethod, ErrorWord, Executor, Stream, SwapInEngine, SwapInStrategy};

/// Counts the allocations of the thread that asked (tests run side by side).
struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCATIONS.with(|n| n.set(n.get() + 1));
        }
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCATIONS.with(|n| n.set(n.get() + 1));
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f`, returning what it returned and how many allocations it made.
fn allocations<T>(f: impl FnOnce() -> T) -> (T, usize) {
    ALLOCATIONS.with(|n| n.set(0));
    COUNTING.with(|c| c.set(true));
    let out = f();
    COUNTING.with(|c| c.set(false));
    (out, ALLOCATIONS.with(Cell::get))
}

#[test]
fn the_counter_sees_an_allocation() {
    let (v, n) = allocations(|| vec![1u8; 64]);
    assert_eq!((v.len(), n), (64, 1));
}

#[test]
fn a_swap_in_check_allocates_nothing() {
    let mut widest = 0;
    for seed in 0..300 {
        let case = SwapCase::random(seed, SWAP_SMALL, CLEAN, None);
        let stride = plan_stride(case.entries());
        let mut s = case.host_state();
        let mut err = ErrorWord::clear();
        let (src, dst, count) = (
            s.plan_src.as_mut_ptr() as u64,
            s.plan_dst.as_mut_ptr() as u64,
            s.plan_count.as_mut_ptr() as u64,
        );
        let scratch = || EmulationScratch {
            src,
            dst,
            count,
            max_batch: case.batch() as u32,
            max_top_k: stride as u32,
            counters: 0,
            counter_layers: 0,
        };
        let error = &mut err as *mut ErrorWord as u64;
        let record_plan = seed % 2 == 0;
        let args = case.host_args(
            &mut s,
            SwapOptions {
                skip_io: false,
                record_plan,
                copy: kvtier::CopyMethod::WarpVectors,
                fixed_shape: false,
                cluster_copy: false,
                cluster_plan: false,
            },
        );
        for strategy in [
            SwapInStrategy::PlanThenCopy,
            SwapInStrategy::OneBlockPerRequest,
        ] {
            let (p, n) = allocations(|| emulation_params(&args, strategy, scratch(), error));
            p.unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            assert_eq!(n, 0, "seed {seed}: the check of a valid swap-in allocated");
        }
        if record_plan && case.planes() == 2 && args.num_real_reqs.is_some() {
            widest += 1;
        }
    }
    assert!(widest > 0, "no case named every buffer a swap-in can");
}

#[test]
fn a_replay_check_allocates_nothing() {
    let mut widest = 0;
    for seed in 0..200 {
        let case = ReplayCase::random(seed, false);
        let host: Vec<Vec<u64>> = case.host.iter().map(|h| words(h)).collect();
        let mut device: Vec<Vec<u64>> = case.device.iter().map(|d| words(d)).collect();
        let num_real: Vec<i32> = case.num_real.into_iter().collect();
        let mut err = ErrorWord::clear();
        let error = &mut err as *mut ErrorWord as u64;
        let args = case.host_args(&host, &mut device, &num_real);
        let (p, n) = allocations(|| emulation_replay_params(&args, CopyMethod::WarpVectors, error));
        p.unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(n, 0, "seed {seed}: the check of a valid replay allocated");
        if case.host.len() == 2 && !num_real.is_empty() {
            widest += 1;
        }
    }
    assert!(widest > 0, "no case named every buffer a replay can");
}

#[test]
fn a_speculative_swap_in_allocates_nothing() {
    let engine = SwapInEngine::new(Executor::cpu()).unwrap();
    // every miss fresh: the union fits the hot buffer (SGLang's union CLOCK);
    // it does not (the approximate CLOCK); and it is past the scratch too
    // (misses copied straight into slots)
    for (scratch, steps) in [(4096, 2), (8192, 4), (4096, 4)] {
        let mut c = SpecCase::new(2, 4096, 64, scratch, 16384, 2, steps, 2048);
        let t = steps as i32 * 2048;
        let topk: Vec<i32> = (0..2 * t).map(|i| 4096 + i % t).collect();
        let mut call = SpecCall::new(topk, 2, steps, 16384, true);
        let args = c.args(&mut call);
        let (r, n) = allocations(|| engine.run_spec(&args, Stream::null()));
        r.unwrap_or_else(|e| panic!("scratch {scratch}, {steps} steps: {e}"));
        assert_eq!(n, 0, "scratch {scratch}, {steps} steps: the call allocated");
        assert_eq!(c.misses(0), t);
        c.assert_outputs_hold(&call, |_| false);
    }
}
