//! The CUDA kernels against the CPU executor (and the model), on random and
//! adversarial inputs. Run on a machine with a GPU:
//!
//! ```text
//! cargo test --release --test gpu -- --ignored
//! compute-sanitizer --tool memcheck target/release/deps/gpu-<hash> --ignored --test-threads=1
//! ```

mod common;

use common::*;
use kvtier::{
    BadIndexKind, Buf, BufMut, DeviceBuffer, Error, Executor, GatherBatch, LayerFirstLayout,
    Stream, Tier, WritebackItems,
};

fn cuda() -> Executor {
    Executor::cuda(0)
        .unwrap_or_else(|e| panic!("these tests need a CUDA GPU and built kernels: {e}"))
}

const MEDIUM: Limits = Limits {
    max_layers: 4,
    max_tokens: 3000,
    max_regions: 6,
    max_batch: 12,
    max_k: 600,
    max_items: 300,
};

fn gather_agrees(case: &GatherCase, gpu: &Executor) {
    let (want_out, want_err) = case.expected();
    let (cpu_out, cpu_res) = case.run(&Executor::cpu());
    for method in kvtier::CopyMethod::ALL {
        let (gpu_out, gpu_res) = case.run_with(gpu, method);
        assert!(
            gpu_out == cpu_out,
            "CUDA ({method:?}) and CPU outputs differ for {case:?}"
        );
        assert_eq!(
            reported(&gpu_res),
            reported(&cpu_res),
            "{method:?}: {case:?}"
        );
    }
    assert!(
        cpu_out == want_out,
        "CPU output differs from the model for {case:?}"
    );
    assert_eq!(reported(&cpu_res), expected_report(&want_err));
}

fn writeback_agrees(case: &WritebackCase, gpu: &Executor) {
    let (cpu_pool, cpu_res) = case.run(&Executor::cpu());
    for method in kvtier::CopyMethod::ALL {
        let (gpu_pool, gpu_res) = case.run_with(gpu, method);
        assert!(
            gpu_pool == cpu_pool,
            "CUDA ({method:?}) and CPU pools differ for {case:?}"
        );
        assert_eq!(
            reported(&gpu_res),
            reported(&cpu_res),
            "{method:?}: {case:?}"
        );
    }
    assert_eq!(reported(&cpu_res), expected_report(&case.expected().1));
}

/// The compact planner's reason to exist: two of its blocks share an SM at
/// top-k 2048 over a hot buffer of 8192 on sm_80 and sm_90 (one where an SM
/// holds at most 1536 threads: sm_86, sm_89, sm_120).
/// The 512-thread few-miss planner's reason to exist: two of its blocks
/// share an SM at top-k 2048 over a hot buffer of 4096 on sm_90 (the H100
/// and H200; one on sm_80, whose SM has 164 KiB of shared memory).
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_512_thread_few_miss_planner_holds_two_blocks_an_sm() {
    let Executor::Cuda(dev) = cuda() else {
        unreachable!()
    };
    let blocks = kvtier::swap_in::few_miss_512_blocks_per_sm(&dev, 2048, 4096).unwrap();
    let want = match dev.compute_capability() {
        (9, 0) => 2,
        _ => 1,
    };
    assert!(
        blocks >= want,
        "{blocks} blocks an SM on sm_{:?}",
        dev.compute_capability()
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_compact_planner_holds_two_blocks_an_sm() {
    let Executor::Cuda(dev) = cuda() else {
        unreachable!()
    };
    let blocks = kvtier::swap_in::compact_planner_blocks_per_sm(&dev, 2048, 8192).unwrap();
    let want = match dev.compute_capability() {
        (8, 0) | (9, 0) => 2,
        _ => 1,
    };
    assert!(
        blocks >= want,
        "{blocks} blocks an SM on sm_{:?}",
        dev.compute_capability()
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gather_matches_cpu_on_random_batches() {
    let gpu = cuda();
    for seed in 0..150 {
        for h in [CLEAN, PADDED, HOSTILE] {
            gather_agrees(&GatherCase::random(seed, SMALL, h), &gpu);
        }
    }
    for seed in 1000..1030 {
        for h in [CLEAN, HOSTILE] {
            gather_agrees(&GatherCase::random(seed, MEDIUM, h), &gpu);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn writeback_matches_cpu_on_random_items() {
    let gpu = cuda();
    for seed in 0..150 {
        for h in [CLEAN, PADDED, HOSTILE] {
            writeback_agrees(&WritebackCase::random(seed, SMALL, h, true), &gpu);
        }
    }
    for seed in 1000..1030 {
        writeback_agrees(&WritebackCase::random(seed, MEDIUM, HOSTILE, true), &gpu);
    }
}

/// Top-k rows and item lists made of runs of 1 to 32 neighbours (whole,
/// broken by padding or refused rows, shifted by one, ending at the
/// region's last entry), which `CopyMethod::MergedRuns` moves a run at a
/// time; every method against the CPU executor.
#[test]
#[ignore = "needs a CUDA GPU"]
fn run_heavy_cases_match_cpu() {
    let gpu = cuda();
    for seed in 0..100 {
        for h in [CLEAN, PADDED, HOSTILE] {
            gather_agrees(&GatherCase::with_runs(seed, MEDIUM, h), &gpu);
            writeback_agrees(&WritebackCase::with_runs(seed, MEDIUM, h, true), &gpu);
        }
    }
}

/// The production shape: batch 64, k = 2048, 656-byte entries, and the
/// awkward 584-byte size, output 8 bytes past a 16-byte boundary.
#[test]
#[ignore = "needs a CUDA GPU"]
fn full_size_batches_match_cpu() {
    let gpu = cuda();
    for (entry, out_offset) in [(656, 0), (584, 8), (1152, 8)] {
        let mut case = GatherCase::random(7, SMALL, CLEAN);
        case.setup = Setup {
            layout: LayerFirstLayout::new(entry, 2, 4096).unwrap(),
            n_regions: 64,
            bindings: (0..64).map(Some).collect(),
        };
        let (batch, k) = (64usize, 2048usize);
        case.layer = 1;
        case.k = k as u32;
        case.topk_stride = k as u32;
        case.out_offset = out_offset;
        case.req_slots = (0..batch as i32).rev().collect();
        case.seq_lens = (0..batch).map(|b| 4096 - b as i32).collect();
        case.topk = (0..batch * k)
            .map(|i| ((i * 7919) % (4096 - 63)) as i32)
            .collect();
        gather_agrees(&case, &gpu);
        // sorted top-k rows: runs of five neighbours one token apart, each
        // row's last run ending at its request's last token
        case.topk = (0..batch * k)
            .map(|i| {
                let (b, d) = (i / k, k - 1 - i % k);
                (4096 - b - 1 - d - d / 5) as i32
            })
            .collect();
        gather_agrees(&case, &gpu);
    }
}

/// Indices that would leave the mapping if they were followed: the last
/// region ends exactly where the registered pool memory ends.
#[test]
#[ignore = "needs a CUDA GPU"]
fn out_of_range_indices_at_the_end_of_the_pool_are_refused() {
    let gpu = cuda();
    let layout = LayerFirstLayout::new(4096, 1, 256).unwrap(); // region = 1 MiB exactly, no padding
    let setup = Setup {
        layout,
        n_regions: 2,
        bindings: vec![Some(0), Some(1)],
    };
    let (fx, tier) = setup.build(&gpu);
    assert_eq!(fx.pool.region_stride(), layout.region_bytes());
    let Executor::Cuda(dev) = &gpu else {
        unreachable!()
    };
    let slots = DeviceBuffer::from_host(dev, &[1, 1, 1, 1]).unwrap();
    let seq = DeviceBuffer::from_host(dev, &[256, 256, 257, i32::MAX]).unwrap();
    // row 0: last token, then one past it; row 1: far past it, below -1;
    // rows 2 and 3: lengths past the region capacity
    let topk = DeviceBuffer::from_host(dev, &[255, 256, i32::MAX, -2, 0, 0, 5, 6]).unwrap();
    let mut out = DeviceBuffer::<u8>::zeroed(dev, 8 * 4096).unwrap();
    let batch = GatherBatch::new(slots.as_buf(), seq.as_buf(), topk.as_buf(), 2);
    tier.gather(0, &batch, out.as_buf_mut(), Stream::null())
        .unwrap();
    let Err(Error::BadIndices(r)) = tier.check(Stream::null()) else {
        panic!("not reported")
    };
    assert_eq!(r.count, 7, "{r}");
    assert!(r.has(BadIndexKind::GatherIndex) && r.has(BadIndexKind::GatherSeqLen));
    let bytes = out.to_vec().unwrap();
    assert_eq!(bytes[..4096], pattern_entry(1, 0, 255, 4096)[..]);
    assert!(bytes[4096..].iter().all(|&b| b == 0));
    tier.check(Stream::null())
        .expect("check clears the error word");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn writeback_past_the_last_token_is_refused() {
    let gpu = cuda();
    let layout = LayerFirstLayout::new(4096, 2, 256).unwrap();
    let setup = Setup {
        layout,
        n_regions: 1,
        bindings: vec![Some(0)],
    };
    let (fx, tier) = setup.build(&gpu);
    let Executor::Cuda(dev) = &gpu else {
        unreachable!()
    };
    let src = DeviceBuffer::from_host(dev, &vec![7u8; 2 * 4096]).unwrap();
    let slots = DeviceBuffer::from_host(dev, &[0, 0, 0]).unwrap();
    let tokens = DeviceBuffer::from_host(dev, &[255, 256, i32::MAX]).unwrap();
    let rows = DeviceBuffer::from_host(dev, &[1i64, 0, 0]).unwrap();
    let items = WritebackItems {
        slots: slots.as_buf(),
        tokens: tokens.as_buf(),
        src_rows: rows.as_buf(),
    };
    tier.writeback_layer(1, &items, src.as_buf(), Stream::null())
        .unwrap();
    let Err(Error::BadIndices(r)) = tier.check(Stream::null()) else {
        panic!("not reported")
    };
    assert_eq!(r.count, 2);
    let mut last = vec![0u8; 4096];
    fx.pool
        .read_tokens(&fx.regions[0], 1, 255, &mut last)
        .unwrap();
    assert!(last.iter().all(|&b| b == 7));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn runs_on_the_callers_stream_and_the_null_stream() {
    let gpu = cuda();
    let Executor::Cuda(dev) = &gpu else {
        unreachable!()
    };
    let setup = Setup {
        layout: LayerFirstLayout::new(656, 1, 64).unwrap(),
        n_regions: 1,
        bindings: vec![Some(0)],
    };
    let (_fx, tier) = setup.build(&gpu);
    let slots = DeviceBuffer::from_host(dev, &[0]).unwrap();
    let seq = DeviceBuffer::from_host(dev, &[64]).unwrap();
    let topk = DeviceBuffer::from_host(dev, &[63, 0]).unwrap();
    let owned = dev.create_stream().unwrap();
    // a raw handle, as an engine passes its own stream
    let engine_stream = unsafe { Stream::from_raw(owned.stream().raw()) };
    for stream in [engine_stream, Stream::null()] {
        let mut out = DeviceBuffer::<u8>::zeroed(dev, 2 * 656).unwrap();
        let batch = GatherBatch::new(slots.as_buf(), seq.as_buf(), topk.as_buf(), 2);
        tier.gather(0, &batch, out.as_buf_mut(), stream).unwrap();
        tier.check(stream).unwrap();
        let bytes = out.to_vec().unwrap();
        assert_eq!(bytes[..656], pattern_entry(0, 0, 63, 656)[..]);
        assert_eq!(bytes[656..], pattern_entry(0, 0, 0, 656)[..]);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_executor_refuses_host_buffers() {
    let gpu = cuda();
    let setup = Setup {
        layout: LayerFirstLayout::new(656, 1, 64).unwrap(),
        n_regions: 1,
        bindings: vec![Some(0)],
    };
    let (_fx, tier): (_, Tier) = setup.build(&gpu);
    let (slots, seq, topk) = ([0], [64], [1]);
    let mut out = vec![0u8; 656];
    let batch = GatherBatch::new(Buf::host(&slots), Buf::host(&seq), Buf::host(&topk), 1);
    match tier.gather(0, &batch, BufMut::host(&mut out), Stream::null()) {
        Err(Error::InvalidArgument {
            arg: "req_slots",
            msg,
        }) => {
            assert!(msg.contains("CUDA executor reads device memory"), "{msg}")
        }
        other => panic!("host buffers accepted by the CUDA executor: {other:?}"),
    }
}

/// Which strategy and copy method pairs [`swap_agrees`] runs.
#[derive(Clone, Copy, PartialEq)]
enum Pairs {
    /// Every strategy with every copy method.
    All,
    /// Every strategy with the default copy method, and, copying without
    /// recording, every copy method with the strategies whose kernels it
    /// changes the most (the plan kernel's copy kernel, the few-miss
    /// planner's, and the one-launch planner's own copies): for cases of
    /// hundreds of MB, where each run registers and fills its own pool.
    Each,
}

fn swap_agrees(case: &common::swap::SwapCase, gpu: &Executor, pairs: Pairs) {
    use common::swap::SwapOptions;
    use kvtier::{CopyMethod, SwapInStrategy};
    let record = SwapOptions {
        skip_io: false,
        record_plan: true,
        copy: CopyMethod::WarpVectors,
        fixed_shape: false,
        cluster_copy: false,
        cluster_plan: false,
    };
    let probe = SwapOptions {
        skip_io: true,
        record_plan: true,
        copy: CopyMethod::WarpVectors,
        fixed_shape: false,
        cluster_copy: false,
        cluster_plan: false,
    };
    let copied_by = [
        SwapInStrategy::PlanThenCopy,
        SwapInStrategy::FewMiss,
        SwapInStrategy::FewMissOneLaunch,
    ];
    let mut untried = Vec::new();
    for (n, opts) in [SwapOptions::default(), record, probe]
        .into_iter()
        .enumerate()
    {
        let cpu = case.run_with(&Executor::cpu(), SwapInStrategy::PlanThenCopy, opts);
        for strategy in SwapInStrategy::ALL {
            for copy in CopyMethod::ALL {
                if pairs == Pairs::Each
                    && copy != CopyMethod::default()
                    && (n > 0 || !copied_by.contains(&strategy))
                {
                    continue;
                }
                let opts = SwapOptions { copy, ..opts };
                let got = case.run_with(gpu, strategy, opts);
                assert!(
                    got == cpu,
                    "CUDA ({strategy:?}, {opts:?}) and CPU differ for {case:?} (and in the builds \
                     no GPU had run before: {untried:#?})"
                );
            }
        }
        // The builds no GPU has run yet: each is checked even when another
        // differs, and the case fails after all of them with every
        // difference named, so that one GPU run says which hold. The
        // few-miss planner's cluster build (one launch in clusters of
        // KVT_SWAP_CLUSTER blocks a row); the split planner (a cluster plans
        // each row; the few-miss planner and its copy kernel where a
        // block's state does not fit); the few-miss planner's fixed-shape
        // builds (the plain build at other shapes), the one-launch one also
        // with line-aligned copies.
        for (build, strategy, opts) in [
            (
                "the cluster build",
                SwapInStrategy::FewMiss,
                SwapOptions {
                    cluster_copy: true,
                    ..opts
                },
            ),
            (
                "the split planner",
                SwapInStrategy::FewMiss,
                SwapOptions {
                    cluster_plan: true,
                    ..opts
                },
            ),
            (
                "the fixed-shape build",
                SwapInStrategy::FewMiss,
                SwapOptions {
                    fixed_shape: true,
                    ..opts
                },
            ),
            (
                "the fixed-shape build",
                SwapInStrategy::FewMissOneLaunch,
                SwapOptions {
                    fixed_shape: true,
                    ..opts
                },
            ),
            (
                "the fixed-shape build with line-aligned copies",
                SwapInStrategy::FewMissOneLaunch,
                SwapOptions {
                    fixed_shape: true,
                    copy: CopyMethod::LineAligned,
                    ..opts
                },
            ),
        ] {
            if case.run_with(gpu, strategy, opts) != cpu {
                untried.push(format!("{build}, {strategy:?}, {opts:?}"));
            }
        }
    }
    assert!(
        untried.is_empty(),
        "CUDA and CPU differ for {case:?} in: {untried:#?}"
    );
}

/// One line on stderr a passed case of a long test, with the time since the
/// test began: the GPU suite runs each test with `--nocapture` under a time
/// limit, so a test cut by it still shows how far it got.
fn passed(test: &str, case: impl std::fmt::Display, began: std::time::Instant) {
    eprintln!(
        "{test}: case {case} passed ({:.1} s)",
        began.elapsed().as_secs_f64()
    );
}

/// How many random seeds a test of many cases runs: `full`, or fewer where
/// `KVTIER_GPU_TEST_SEEDS` says (the sanitizers, at tens of times the
/// speed cost, run a few seeds of every strategy and copy method within a
/// device command instead of a fraction of the seeds of the first).
fn seeds(full: u64) -> u64 {
    match std::env::var("KVTIER_GPU_TEST_SEEDS") {
        Ok(n) => n
            .parse::<u64>()
            .unwrap_or_else(|_| panic!("KVTIER_GPU_TEST_SEEDS={n:?} is not a count"))
            .min(full),
        Err(_) => full,
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn swap_in_matches_cpu_on_random_cases() {
    use common::swap::*;
    let gpu = cuda();
    let began = std::time::Instant::now();
    let test = "swap_in_matches_cpu_on_random_cases";
    for seed in 0..seeds(100) {
        for h in [CLEAN, PADDED, HOSTILE] {
            swap_agrees(
                &SwapCase::random(seed, SWAP_SMALL, h, None),
                &gpu,
                Pairs::All,
            );
        }
        passed(test, format_args!("small seed {seed}"), began);
    }
    for seed in 1000..1000 + seeds(20) {
        swap_agrees(
            &SwapCase::random(seed, SWAP_MEDIUM, HOSTILE, None),
            &gpu,
            Pairs::All,
        );
        passed(test, format_args!("medium seed {seed}"), began);
    }
}

/// Miss-plan replays (SGLang's copy_cache_planned_mla): linear, C4-paged and
/// two-plane rows, valid and hostile plans, on a grid of SGLang's
/// shared-index prefetch size (4 blocks of 1024 threads worth of warps),
/// with the copy kernel of each copy method.
#[test]
#[ignore = "needs a CUDA GPU"]
fn replays_match_cpu_on_random_cases() {
    use common::swap::ReplayCase;
    let gpu = cuda();
    for seed in 0..seeds(200) {
        let case = ReplayCase::random(seed, seed % 2 == 1);
        let cpu = case.run_cpu();
        for copy in kvtier::CopyMethod::ALL {
            assert_eq!(case.run(&gpu, copy), cpu, "{copy:?}: {case:?}");
        }
    }
}

/// A case at a production shape: top-k 2048 over a hot buffer of `hot`
/// slots (the fixed-shape builds' shapes at 4096 and 8192), 656-byte items,
/// `misses` a request, a tenth of the rows short, spoiled by `h`.
fn production_case(
    seed: u64,
    hot: usize,
    misses: usize,
    batch: usize,
    h: common::Hostility,
) -> common::swap::SwapCase {
    use common::swap::*;
    let shape = SwapShape {
        batch: Some(batch),
        short_share: 0.1,
        ..SwapShape::tokens(hot, 2048, 656, batch, hot + 4096)
    };
    SwapCase::shaped(seed, shape, Some(misses)).spoiled(seed, h)
}

/// Bad entries and padding mixed into valid rows.
const FEW_BAD: common::Hostility = common::Hostility {
    bad: 0.002,
    padding: 0.01,
};

/// The benchmark's grid: HOT 4096 and 8192, K = 2048, 2 and 410 misses per
/// request, 656-byte items (the fixed-shape builds' shapes), valid and with
/// bad input mixed in.
#[test]
#[ignore = "needs a CUDA GPU"]
fn swap_in_production_shapes() {
    let gpu = cuda();
    let began = std::time::Instant::now();
    for (seed, hot, misses, batch, h) in [
        (1, 4096, 2, 4, CLEAN),
        (2, 4096, 410, 16, CLEAN),
        (3, 8192, 410, 8, CLEAN),
        (4, 8192, 2, 32, CLEAN),
        (6, 4096, 410, 4, FEW_BAD),
        (7, 8192, 2, 4, HOSTILE),
    ] {
        let case = production_case(seed, hot, misses, batch, h);
        swap_agrees(&case, &gpu, Pairs::Each);
        passed(
            "swap_in_production_shapes",
            format_args!("{seed} (HOT {hot}, {misses} misses, batch {batch})"),
            began,
        );
    }
}

/// The default's two sm_90 builds (`SwapInChoice::default_for`: the split
/// planner up to `SPLIT_UP_TO_BATCH` rows, the one-launch fixed-shape build
/// with line-aligned copies above) at the production shapes they serve, K
/// 2048 over HOT 4096 and 8192, 656-byte items, valid and with bad input,
/// plain, recording the plan and probing, against the CPU executor: only
/// these builds, so that a short test budget reaches them (the quick pass
/// runs it first); `swap_in_production_shapes` runs every strategy there.
/// Every difference is named before the test fails.
#[test]
#[ignore = "needs a CUDA GPU"]
fn swap_in_default_builds_at_production_shapes() {
    use common::swap::*;
    use kvtier::swap_in::SPLIT_UP_TO_BATCH;
    use kvtier::{CopyMethod, PlannerBuild, SwapInChoice, SwapInStrategy};
    let gpu = cuda();
    let began = std::time::Instant::now();
    let mut differ = Vec::new();
    for (seed, hot, misses, batch, h) in [
        (11, 4096, 2, 4, CLEAN),
        (12, 8192, 410, 8, CLEAN),
        (13, 4096, 274, 12, CLEAN),
        (14, 8192, 2, 16, CLEAN),
        (15, 4096, 410, 16, FEW_BAD),
        (16, 8192, 2, 10, HOSTILE),
    ] {
        let case = production_case(seed, hot, misses, batch, h);
        // what the default takes at this batch on sm_90, run with the
        // options that launch the same kernels (SwapInEngine::run's flags)
        let choice = SwapInChoice::default_for(Some(90), batch);
        let split = batch <= SPLIT_UP_TO_BATCH;
        assert_eq!(
            choice.build,
            if split {
                PlannerBuild::Split
            } else {
                PlannerBuild::FixedShape
            }
        );
        for base in [
            SwapOptions::default(),
            SwapOptions {
                record_plan: true,
                ..SwapOptions::default()
            },
            SwapOptions {
                record_plan: true,
                skip_io: true,
                ..SwapOptions::default()
            },
        ] {
            let opts = if split {
                SwapOptions {
                    cluster_plan: true,
                    ..base
                }
            } else {
                assert_eq!(choice.strategy, SwapInStrategy::FewMissOneLaunch);
                assert_eq!(choice.copy, CopyMethod::LineAligned);
                SwapOptions {
                    fixed_shape: true,
                    copy: CopyMethod::LineAligned,
                    ..base
                }
            };
            let cpu = case.run_with(&Executor::cpu(), SwapInStrategy::PlanThenCopy, base);
            if case.run_with(&gpu, choice.strategy, opts) != cpu {
                differ.push(format!(
                    "seed {seed}: HOT {hot}, {misses} misses, batch {batch}, {opts:?}"
                ));
            }
        }
        passed(
            "swap_in_default_builds_at_production_shapes",
            format_args!("{seed} (HOT {hot}, {misses} misses, batch {batch})"),
            began,
        );
    }
    assert!(differ.is_empty(), "CUDA and CPU differ in: {differ:#?}");
}

/// The largest accepted shape needs 144 KiB of shared memory per planning
/// block (within the opt-in limit of sm_80 and sm_90).
#[test]
#[ignore = "needs a CUDA GPU"]
fn swap_in_largest_shape() {
    use common::swap::*;
    let gpu = cuda();
    let hot = kvtier::swap_in::MAX_HOT as usize;
    let shape = SwapShape {
        batch: Some(2),
        short_share: 0.0,
        ..SwapShape::tokens(hot, kvtier::swap_in::MAX_TOP_K as usize, 16, 2, hot + 8192)
    };
    swap_agrees(&SwapCase::shaped(5, shape, Some(1000)), &gpu, Pairs::Each);
}

/// Every device kind registers with the GPU and serves a gather: anon, a
/// shared file, NUMA node 0, two devices in one pool, and a devdax device
/// when KVTIER_TEST_DAX names one (it is formatted: its contents are lost).
#[test]
#[ignore = "needs a CUDA GPU"]
fn every_device_kind_registers_and_serves_gathers() {
    use kvtier::pool::PoolOptions;
    use kvtier::{DeviceSpec, Pool};
    let gpu = cuda();
    let Executor::Cuda(dev) = &gpu else {
        unreachable!()
    };
    let layout = LayerFirstLayout::new(656, 2, 64).unwrap();
    let dir = shm_dir("devices");
    std::fs::create_dir_all(&dir).unwrap();
    let mut pools: Vec<Vec<DeviceSpec>> = vec![
        vec!["anon:8MiB".parse().unwrap()],
        vec![DeviceSpec::file(dir.join("f"), 8 << 20)],
        vec!["numa:0:8MiB".parse().unwrap()],
        vec![
            DeviceSpec::file(dir.join("g0"), 4 << 20),
            DeviceSpec::file(dir.join("g1"), 4 << 20),
        ],
    ];
    match std::env::var("KVTIER_TEST_DAX") {
        Ok(path) => pools.push(vec![DeviceSpec::Dax {
            path: path.into(),
            bytes: None,
        }]),
        Err(_) => eprintln!("KVTIER_TEST_DAX not set: devdax registration not tested"),
    }
    for specs in pools {
        let label = format!("{specs:?}");
        let pool = Pool::create_on(layout, specs, PoolOptions::default()).unwrap();
        let n = pool.num_regions().min(4);
        let regions: Vec<_> = (0..n).map(|_| pool.alloc_region().unwrap()).collect();
        for (i, r) in regions.iter().enumerate() {
            let bytes: Vec<u8> = (0..64 * 656).map(|b| (b * 7 + i * 13) as u8).collect();
            pool.write_tokens(r, 1, 0, &bytes).unwrap();
        }
        let mut tier = Tier::new(pool.clone(), gpu.clone(), n).unwrap();
        for (s, r) in regions.iter().enumerate() {
            tier.bind_slot(s as u32, r, Stream::null()).unwrap();
        }
        dev.synchronize_all().unwrap();
        let slots = DeviceBuffer::from_host(dev, &(0..n as i32).collect::<Vec<_>>()).unwrap();
        let seq = DeviceBuffer::from_host(dev, &vec![64i32; n as usize]).unwrap();
        let topk = DeviceBuffer::from_host(
            dev,
            &(0..n as i32 * 3).map(|i| (i * 5) % 64).collect::<Vec<_>>(),
        )
        .unwrap();
        let mut out = DeviceBuffer::<u8>::zeroed(dev, n as usize * 3 * 656).unwrap();
        let batch = GatherBatch::new(slots.as_buf(), seq.as_buf(), topk.as_buf(), 3);
        tier.gather(1, &batch, out.as_buf_mut(), Stream::null())
            .unwrap();
        tier.check(Stream::null()).unwrap();
        let got = out.to_vec().unwrap();
        for b in 0..n as usize {
            for j in 0..3 {
                let t = ((b * 3 + j) * 5 % 64) as u32;
                let mut want = vec![0u8; 656];
                pool.read_tokens(&regions[b], 1, t, &mut want).unwrap();
                assert_eq!(
                    got[(b * 3 + j) * 656..][..656],
                    want[..],
                    "{label}: row {b}, column {j}"
                );
            }
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// A fresh folder on tmpfs for file pools: only memory-backed files can be
/// pinned for the GPU (the temporary folder may be on a disk filesystem, as
/// on the lent H100 machines, where registration is refused as it should be).
fn shm_dir(what: &str) -> std::path::PathBuf {
    let base = std::path::Path::new("/dev/shm");
    let base = if base.is_dir() {
        base.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    base.join(format!("kvtier-gpu-{what}-{}", std::process::id()))
}

/// The host cache an engine passes (e.g. a pinned torch tensor) is looked up
/// as the kernels will address it; pageable memory is a clear error.
#[test]
#[ignore = "needs a CUDA GPU"]
fn host_memory_is_mapped_for_the_kernels_or_refused() {
    let Executor::Cuda(dev) = cuda() else {
        unreachable!()
    };
    let mut pinned = vec![0u8; 1 << 20];
    // SAFETY: the vector outlives the registration and is not registered yet.
    let reg = unsafe {
        kvtier::cuda::HostRegistration::register(
            &dev,
            pinned.as_mut_ptr(),
            pinned.len(),
            kvtier::cuda::REGISTER_FLAGS,
        )
    }
    .unwrap();
    let base = dev.mapped_host_address(pinned.as_ptr() as u64).unwrap();
    assert_eq!(base, reg.device_addr());
    let inner = dev
        .mapped_host_address(pinned.as_ptr() as u64 + 4096)
        .unwrap();
    assert_eq!(
        inner,
        base + 4096,
        "an interior pointer maps to the same offset"
    );
    let pageable = vec![0u8; 1 << 20];
    let err = dev
        .mapped_host_address(pageable.as_ptr() as u64)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not page-locked"), "{err}");
    drop(reg);
}

/// Bad indices surface through polls, which never wait: a snapshot of the
/// error word lands a poll or more later, with the report `check` gives;
/// polls only read, so `check` still reports (and clears) the word.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_indices_surface_through_polls_without_waiting() {
    use common::swap::*;
    use kvtier::{SwapInEngine, SwapInStrategy};
    use std::time::{Duration, Instant};
    let gpu = cuda();
    let case = (0..200)
        .map(|seed| SwapCase::random(seed, SWAP_SMALL, HOSTILE, None))
        .find(|c| c.expected().report.is_some())
        .expect("a hostile case with bad indices");
    let want = case.expected().report.unwrap();
    let mut engine = SwapInEngine::new(gpu.clone()).unwrap();
    engine
        .reserve(case.batch().max(1) as u32, case.entries() as u32)
        .unwrap();
    let mut polled = None;
    let mut polls = 0;
    case.run_cuda_then(
        &mut engine,
        SwapInStrategy::PlanThenCopy,
        SwapOptions::default(),
        |e| {
            let t0 = Instant::now();
            while polled.is_none() && t0.elapsed() < Duration::from_secs(10) {
                polled = e.poll_bad_indices()?;
                polls += 1;
            }
            Ok(())
        },
    );
    let (report, new) = polled.expect("a poll reported the bad indices");
    assert!(polls >= 2, "the first poll only starts a snapshot");
    assert_eq!((report.clone(), new), (want.clone(), want.count));
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(engine.poll_bad_indices().unwrap(), None, "nothing new");
    }
    match engine.check() {
        Err(kvtier::Error::BadIndices(r)) => assert_eq!(r, want),
        other => panic!("check after polls: {other:?}"),
    }
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(engine.poll_bad_indices().unwrap(), None, "cleared by check");
    }
}

/// Counters reach a poll without waiting: a snapshot lands a poll or more
/// after the swap-in, equal to what the waiting read and the model give.
#[test]
#[ignore = "needs a CUDA GPU"]
fn counters_surface_through_polls_without_waiting() {
    use common::swap::*;
    use kvtier::{SwapInEngine, SwapInStrategy};
    use std::time::{Duration, Instant};
    let case = (0..200)
        .map(|seed| SwapCase::random(seed, SWAP_SMALL, HOSTILE, None))
        .find(|c| {
            let n = c.expected().counters.unwrap();
            n.misses > 0 && n.bad_indices > 0
        })
        .expect("a hostile case with misses and bad indices");
    let want = case.expected().counters.unwrap();
    let mut engine = SwapInEngine::new(cuda()).unwrap();
    engine
        .reserve(case.batch().max(1) as u32, case.entries() as u32)
        .unwrap();
    engine.enable_counters(1).unwrap();
    let mut polled = None;
    let mut polls = 0;
    let got = case.run_cuda_then(
        &mut engine,
        SwapInStrategy::FewMiss,
        SwapOptions::default(),
        |e| {
            let t0 = Instant::now();
            // a snapshot started before the swap-in finished may land first
            while polled
                .as_ref()
                .is_none_or(|c: &Vec<kvtier::SwapInCounters>| c[0] != want)
                && t0.elapsed() < Duration::from_secs(10)
            {
                if let Some(c) = e.poll_counters()? {
                    polled = Some(c);
                }
                polls += 1;
            }
            let _ = e.check();
            Ok(())
        },
    );
    assert_eq!(got.counters, Some(want), "the waiting read");
    assert_eq!(polled.expect("a poll landed")[0], want);
    assert!(polls >= 2, "the first poll only starts a snapshot");
}

/// The speculative swap-in kernel against the CPU executor: the same
/// invariants the host emulation checks (SGLang's union and approximate
/// CLOCK, misses past the scratch, draft tokens, padding, bad input, a
/// hostile miss table, calls on the CPU executor's state).
#[test]
#[ignore = "needs a CUDA GPU"]
fn spec_swap_in_matches_cpu_invariants() {
    use common::spec::*;
    let engine = kvtier::SwapInEngine::new(cuda()).unwrap();
    let run = |case: &SpecCase, calls: &[SpecCall], label: &str| {
        kernel_agrees(case, calls, label, |c, call| c.run_cuda(&engine, call));
    };
    let q = cross_step_misses(4096, 2048);
    let union = SpecCase::new(1, 4096, 64, 4096, 16384, 2, 4, 2048);
    let call = |topk: Vec<i32>, b, s, seq| SpecCall::new(topk, b, s, seq, true);
    run(
        &union,
        &[call(q.clone(), 1, 4, 16384), call(q, 1, 4, 16384)],
        "782 misses",
    );
    for scratch in [8192, 4096] {
        let case = SpecCase::new(8, 4096, 64, scratch, 20000, 72, 4, 2048);
        let topk: Vec<i32> = (0..8 * 8192)
            .map(|i| 4096 + i % 8192 + (i / 8192) * 3)
            .collect();
        let c = call(topk, 8, 4, 20000);
        run(&case, &[c.clone(), c], &format!("scratch {scratch}"));
    }
    let mut hostile = SpecCase::new(1, 4096, 64, 4096, 16384, 1, 4, 2048);
    let topk: Vec<i32> = (4096..4096 + 8192).collect();
    plant_foreign_cells(&mut hostile, &topk);
    run(&hostile, &[call(topk, 1, 4, 16384)], "foreign miss table");
    let mut bad: Vec<i32> = (0..3 * 2048).map(|i| (i * 7) % 6000).collect();
    bad[2] = 7000;
    bad[3] = -9;
    let mut b = call(bad, 3, 2, 6000);
    b.num_real = [2];
    b.req = vec![2, 0, 1];
    let case = SpecCase::new(3, 2048, 16, 2048, 6000, 1, 2, 1024);
    run(&case, &[b], "bad input and padding");
}

/// Gathers tokens `0..n` of `layer` from the region bound to `slot`.
fn gather_tokens(
    tier: &Tier,
    dev: &std::sync::Arc<kvtier::CudaDevice>,
    slot: i32,
    layer: u32,
    n: u32,
) -> Vec<u8> {
    let entry = tier.layout().entry_bytes() as usize;
    let slots = DeviceBuffer::from_host(dev, &[slot]).unwrap();
    let seq = DeviceBuffer::from_host(dev, &[tier.layout().tokens_per_region() as i32]).unwrap();
    let topk = DeviceBuffer::from_host(dev, &(0..n as i32).collect::<Vec<_>>()).unwrap();
    let mut out = DeviceBuffer::<u8>::zeroed(dev, n as usize * entry).unwrap();
    let batch = GatherBatch::new(slots.as_buf(), seq.as_buf(), topk.as_buf(), n);
    tier.gather(layer, &batch, out.as_buf_mut(), Stream::null())
        .unwrap();
    tier.check(Stream::null()).unwrap();
    out.to_vec().unwrap()
}

/// The bytes a process writes into tokens `0..n` of a region's layer.
fn stamp(seed: u64, n: u32, entry: u32) -> Vec<u8> {
    (0..n as u64 * entry as u64)
        .map(|i| (i.wrapping_mul(0x9E37_79B9) ^ seed.wrapping_mul(31)) as u8)
        .collect()
}

/// A pool of tens of GiB (32 GiB, or half the available memory when that
/// is less; at least 4 GiB) registers with the GPU, and its last region
/// serves a gather. The registration time is printed (run with
/// `--nocapture`: the GPU suite does).
#[test]
#[ignore = "needs a CUDA GPU"]
fn registration_of_a_pool_of_tens_of_gib() {
    use kvtier::{DeviceSpec, Pool};
    let gpu = cuda();
    let Executor::Cuda(dev) = &gpu else {
        unreachable!()
    };
    let available = std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap()
        * 1024;
    let bytes = (32u64 << 30).min(available / 2);
    if bytes < 4 << 30 {
        eprintln!("only {available} B available: a pool of tens of GiB is not tested here");
        return;
    }
    let layout = LayerFirstLayout::new(656, 61, 4096).unwrap(); // 164 MB regions
    let pool = Pool::create(layout, DeviceSpec::Anon { bytes }).unwrap();
    let regions: Vec<_> = (0..pool.num_regions())
        .map(|_| pool.alloc_region().unwrap())
        .collect();
    let last = regions.last().unwrap();
    let want = stamp(7, 64, 656);
    pool.write_tokens(last, 60, 0, &want).unwrap();
    let start = std::time::Instant::now();
    let mut tier = Tier::new(pool.clone(), gpu.clone(), 1).unwrap();
    let took = start.elapsed();
    eprintln!(
        "registered a pool of {:.1} GiB ({} regions of {} B) with {} in {:.2} s",
        bytes as f64 / (1u64 << 30) as f64,
        regions.len(),
        layout.region_bytes(),
        dev.name(),
        took.as_secs_f64()
    );
    tier.bind_slot(0, last, Stream::null()).unwrap();
    assert!(
        gather_tokens(&tier, dev, 0, 60, 64) == want,
        "the last region's bytes"
    );
}

const GPU_WORKER_ENV: &str = "KVTIER_GPU_WORKER";

/// The child of `registration_by_two_processes_sharing_one_pool`: opens the
/// shared-file pool named in its environment, writes and publishes a region
/// of its own, registers the pool with the GPU, checks a gather of its
/// region, prints "child REGION", and holds everything until a line comes
/// on stdin (so both processes hold their registrations at once).
#[test]
#[ignore = "a child process of a GPU test"]
fn gpu_pool_worker() {
    use kvtier::{DeviceSpec, Pool, PoolOptions};
    let Ok(path) = std::env::var(GPU_WORKER_ENV) else {
        return;
    };
    // SAFETY: prctl(PR_SET_PDEATHSIG) only sets a signal for this process.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let gpu = cuda();
    let Executor::Cuda(dev) = &gpu else {
        unreachable!()
    };
    let pool = Pool::open(
        vec![DeviceSpec::file(path, 8 << 20)],
        PoolOptions::default(),
    )
    .unwrap();
    let region = pool.alloc_region().unwrap();
    let want = stamp(2, 64, 656);
    pool.write_tokens(&region, 1, 0, &want).unwrap();
    pool.publish(&region).unwrap();
    let mut tier = Tier::new(pool.clone(), gpu.clone(), 1).unwrap();
    tier.bind_slot(0, &region, Stream::null()).unwrap();
    assert!(
        gather_tokens(&tier, dev, 0, 1, 64) == want,
        "the child's gather"
    );
    println!("child {}", region.index());
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
}

/// Two processes on one GPU share one pool (a shared file): each registers
/// it, writes a region of its own and gathers it on the GPU while the other
/// holds its registration, and each region's bytes are the other's to read.
#[test]
#[ignore = "needs a CUDA GPU"]
fn registration_by_two_processes_sharing_one_pool() {
    use kvtier::{DeviceSpec, Pool, PoolOptions};
    use std::io::{BufRead, Write};
    use std::process::{Command, Stdio};
    let gpu = cuda();
    let Executor::Cuda(dev) = &gpu else {
        unreachable!()
    };
    let dir = shm_dir("shared");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("pool");
    let layout = LayerFirstLayout::new(656, 2, 64).unwrap();
    let pool = Pool::create_on(
        layout,
        vec![DeviceSpec::file(&path, 8 << 20)],
        PoolOptions::default(),
    )
    .unwrap();
    let mine = pool.alloc_region().unwrap();
    let want = stamp(1, 64, 656);
    pool.write_tokens(&mine, 1, 0, &want).unwrap();
    pool.publish(&mine).unwrap();
    let mut tier = Tier::new(pool.clone(), gpu.clone(), 1).unwrap();
    tier.bind_slot(0, &mine, Stream::null()).unwrap();

    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "gpu_pool_worker",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
            "--quiet",
        ])
        .env(GPU_WORKER_ENV, &path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let theirs: u32 = loop {
        let line = lines
            .next()
            .expect("the child exited before it was ready")
            .unwrap();
        if let Some(index) = line.strip_prefix("child ") {
            break index.trim().parse().unwrap();
        }
    };
    // Both registrations held: gather here, read the child's region.
    assert!(
        gather_tokens(&tier, dev, 0, 1, 64) == want,
        "the parent's gather"
    );
    let mut child_bytes = vec![0u8; 64 * 656];
    pool.read_ready(theirs, 1, 0, &mut child_bytes).unwrap();
    assert!(
        child_bytes == stamp(2, 64, 656),
        "the child's region, read here"
    );
    writeln!(child.stdin.take().unwrap()).unwrap();
    assert!(child.wait().unwrap().success(), "the child failed");
    drop(tier);
    drop(pool);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A caller with a context of its own keeps it current: kvtier makes the
/// device's primary context current for each call and puts the caller's
/// back (it used to leave its own current).
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_callers_context_is_current_again_after_each_call() {
    use cudarc::driver::{result, sys};
    let gpu = cuda();
    let Executor::Cuda(dev) = &gpu else {
        unreachable!()
    };
    let mut device = 0;
    let mut mine: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: out-pointers to locals; the context is destroyed below.
    unsafe {
        assert_eq!(
            sys::cuDeviceGet(&mut device, 0),
            sys::CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            sys::cuCtxCreate_v2(&mut mine, 0, device),
            sys::CUresult::CUDA_SUCCESS
        );
    }
    assert_eq!(
        result::ctx::get_current().unwrap(),
        Some(mine),
        "cuCtxCreate makes it current"
    );
    let buf = DeviceBuffer::from_host(dev, &[1i32, 2, 3]).unwrap();
    assert_eq!(buf.to_vec().unwrap(), [1, 2, 3]);
    dev.synchronize_all().unwrap();
    drop(buf);
    assert_eq!(
        result::ctx::get_current().unwrap(),
        Some(mine),
        "after kvtier's calls"
    );
    // SAFETY: the context this test created, current on this thread.
    unsafe { sys::cuCtxDestroy_v2(mine) };
}

#[path = "common/engram.rs"]
mod engram_model;

/// The Engram gather on the GPU against the CPU executor (and the model):
/// every byte pair from a device table, random and hostile cases with the
/// table in registered host memory (the tables' home), ids past the table
/// reported through the error word.
#[test]
#[ignore = "needs a CUDA GPU"]
fn engram_gather_matches_cpu_from_device_and_host_tables() {
    use kvtier::IndexBuf;
    use kvtier::cuda::{HostRegistration, REGISTER_FLAGS};
    use kvtier::engram::{EngramArgs, EngramGatherer};
    let gpu = cuda();
    let Executor::Cuda(dev) = &gpu else {
        unreachable!()
    };
    let g = EngramGatherer::new(gpu.clone()).unwrap();
    let mut all = vec![engram_model::EngramCase {
        dim: 256,
        block: 256,
        rows: 256,
        weights: (0..256 * 256).map(|i| (i % 256) as u8).collect(),
        scales: (0..=255u8).collect(),
        ids: (0..256).collect(),
        ids_int64: false,
        row_lo: 0,
        row_hi: 256,
        out_rows: None,
    }];
    all.extend(engram_model::cases(200, false));
    all.extend(engram_model::cases(200, true));
    for (k, case) in all.iter().enumerate() {
        let (cpu_out, cpu_res) = case.run_cpu();
        let n = case.ids.len();
        let ids64 = DeviceBuffer::from_host(dev, &case.ids).unwrap();
        let ids32 = DeviceBuffer::from_host(dev, &case.ids32()).unwrap();
        let mut out = DeviceBuffer::<u16>::zeroed(dev, n * case.dim as usize).unwrap();
        let out_rows = case
            .out_rows
            .as_ref()
            .map(|r| DeviceBuffer::from_host(dev, r).unwrap());
        // odd cases read the table from host memory the GPU maps
        let host = k % 2 == 1;
        let (mut hw, mut hs) = (case.weights.clone(), case.scales.clone());
        let (dw, ds) = (
            DeviceBuffer::from_host(dev, &case.weights).unwrap(),
            DeviceBuffer::from_host(dev, &case.scales).unwrap(),
        );
        let regs = host.then(|| unsafe {
            (
                HostRegistration::register(dev, hw.as_mut_ptr(), hw.len(), REGISTER_FLAGS).unwrap(),
                HostRegistration::register(dev, hs.as_mut_ptr(), hs.len(), REGISTER_FLAGS).unwrap(),
            )
        });
        let (weights, scales) = match &regs {
            Some((rw, rs)) => unsafe {
                (
                    Buf::from_raw(rw.device_addr(), hw.len(), kvtier::Location::Device),
                    Buf::from_raw(rs.device_addr(), hs.len(), kvtier::Location::Device),
                )
            },
            None => (dw.as_buf(), ds.as_buf()),
        };
        g.gather(
            &EngramArgs {
                weights,
                scales,
                ids: if case.ids_int64 {
                    IndexBuf::I64(ids64.as_buf())
                } else {
                    IndexBuf::I32(ids32.as_buf())
                },
                out: out.as_buf_mut(),
                out_rows: out_rows.as_ref().map(|r| r.as_buf()),
                dim: case.dim,
                block: case.block,
                row_lo: case.row_lo,
                row_hi: case.row_hi,
            },
            Stream::null(),
        )
        .unwrap();
        let gpu_res = g.check();
        assert!(
            out.to_vec().unwrap() == cpu_out,
            "case {k} differs: {case:?}"
        );
        assert_eq!(reported(&gpu_res), reported(&cpu_res), "case {k}: {case:?}");
        drop(regs);
    }
}

/// Two swap-ins on two streams of one engine, each with a plan of its own
/// (SGLang replays shared-index plans on a side stream) and bad input,
/// running at once: each one's outputs, state and plan are its own model's,
/// and the error word and the layer's counters, which they share, hold
/// both: counts and counters summed, the first entry of each kind the lower
/// of the two.
#[test]
#[ignore = "needs a CUDA GPU"]
fn two_streams_share_the_error_word_and_counters() {
    use common::swap::*;
    use kvtier::{BadIndex, BadIndexReport, SwapInCounters, SwapInEngine, SwapInStrategy};
    let cases: Vec<SwapCase> = (0..400)
        .map(|seed| SwapCase::random(seed, SWAP_SMALL, HOSTILE, None))
        .filter(|c| {
            let n = c.expected().counters.unwrap();
            n.misses > 0 && n.bad_indices > 0
        })
        .take(2)
        .collect();
    let (a, b) = (&cases[0], &cases[1]);
    let record = SwapOptions {
        record_plan: true,
        skip_io: false,
        copy: kvtier::CopyMethod::WarpVectors,
        fixed_shape: false,
        cluster_copy: false,
        cluster_plan: false,
    };
    let (want_a, want_b) = (a.expected_with(record), b.expected_with(record));
    let sum = |x: SwapInCounters, y: SwapInCounters| SwapInCounters {
        calls: x.calls + y.calls,
        rows: x.rows + y.rows,
        hits: x.hits + y.hits,
        misses: x.misses + y.misses,
        bytes: x.bytes + y.bytes,
        bad_indices: x.bad_indices + y.bad_indices,
    };
    let key = |e: &BadIndex| {
        (((e.row as u64) << 16 | e.col as u64) << 32) | (e.value as u32 ^ 0x8000_0000) as u64
    };
    let merged = |x: &BadIndexReport, y: &BadIndexReport| {
        let mut first: Vec<BadIndex> = x.first.clone();
        for e in &y.first {
            match first.iter_mut().find(|f| f.kind == e.kind) {
                Some(f) if key(e) < key(f) => *f = *e,
                Some(_) => {}
                None => first.push(*e),
            }
        }
        first.sort_by_key(|e| e.kind as u32);
        BadIndexReport {
            count: x.count + y.count,
            first,
            unknown_flags: 0,
        }
    };
    let want_report = merged(
        want_a.report.as_ref().unwrap(),
        want_b.report.as_ref().unwrap(),
    );
    let want_counters = sum(want_a.counters.unwrap(), want_b.counters.unwrap());
    for strategy in [
        SwapInStrategy::FewMiss,
        SwapInStrategy::Compact,
        SwapInStrategy::CompactOneLaunch,
        SwapInStrategy::FewMiss512,
        SwapInStrategy::FewMissOneLaunch,
        SwapInStrategy::FewMiss512OneLaunch,
    ] {
        let mut engine = SwapInEngine::new(cuda()).unwrap();
        let batch = a.batch().max(b.batch()).max(1) as u32;
        let entries = a.entries().max(b.entries()) as u32;
        engine.reserve(batch, entries).unwrap();
        engine.enable_counters(1).unwrap();
        // b is launched on its stream while a's may still run on its own
        let mut got_b = None;
        let got_a = a.run_cuda_then(&mut engine, strategy, record, |e| {
            got_b = Some(b.run_cuda_then(e, strategy, record, |_| Ok(())));
            Ok(())
        });
        let got_b = got_b.unwrap();
        let state = |o: &SwapOutcome| {
            (
                o.out.clone(),
                o.tokens.clone(),
                o.lru.clone(),
                o.device_buffer.clone(),
                o.device_buffer_v.clone(),
                o.plan.clone(),
            )
        };
        assert!(
            state(&got_a) == state(&want_a),
            "{strategy:?}: the first call"
        );
        assert!(
            state(&got_b) == state(&want_b),
            "{strategy:?}: the second call"
        );
        assert_eq!(
            engine.counters().unwrap().unwrap()[0],
            want_counters,
            "{strategy:?}"
        );
        match engine.check() {
            Err(kvtier::Error::BadIndices(r)) => assert_eq!(r, want_report, "{strategy:?}"),
            other => panic!("{strategy:?}: {other:?}"),
        }
    }
}
