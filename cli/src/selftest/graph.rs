//! The per-layer calls inside a CUDA graph: each is captured once on a
//! stream of kvtier's (a global capture, so that an allocation or a host
//! synchronisation inside the call fails it), then replayed three times
//! with new inputs written into the captured buffers between replays. After
//! every replay the result must equal the CPU executor's for the same
//! inputs and the same history (the swap-in's state carries over).
//!
//! On the CPU executor (the `--cpu` dry run) there is no graph: the
//! "replay" calls the recorded closure again, so the checks' own logic runs.

use std::sync::Arc;

use kvtier::cuda::{CudaGraph, OwnedStream};
use kvtier::{CopyMethod, CudaDevice, Executor, Stream, SwapInEngine, SwapInStrategy};

use super::snapshot::{Snapshot, Verdict, settle};
use super::swap_in::{Loaded, Path, SwapCase};
use super::tier_calls::{GatherCase, WritebackCase};
use super::{Row, run_cases};

const REPLAYS: u64 = 3;

pub(super) fn check(dut: &Executor, seed: u64) -> Row {
    let name = match dut {
        Executor::Cuda(_) => "CUDA graph: gather, swap-in, writebacks",
        Executor::Cpu => "graph replays (CPU: calls repeated, no graph)",
    };
    run_cases(name, seed, 4, |s| {
        // Clean cases only: odd seeds are the hostile ones.
        let clean = s.wrapping_mul(2);
        // The gather as the tier picks its method, then with each method
        // (each its own kernel; the bulk one with shared memory and barriers).
        let mut checks = vec![("gather", gather(dut, clean, None)?)];
        for method in CopyMethod::ALL {
            checks.push((
                "gather, each copy method",
                gather(dut, clean, Some(method))?,
            ));
        }
        for (strategy, plan) in [
            (SwapInStrategy::PlanThenCopy, false),
            (SwapInStrategy::OneBlockPerRequest, false),
            (SwapInStrategy::FewMiss, false),
            (SwapInStrategy::PlanThenCopy, true),
            (SwapInStrategy::FewMiss, true),
            (SwapInStrategy::Compact, false),
            (SwapInStrategy::Compact, true),
            (SwapInStrategy::CompactOneLaunch, false),
            (SwapInStrategy::FewMiss512, false),
            (SwapInStrategy::FewMissOneLaunch, false),
            (SwapInStrategy::FewMiss512OneLaunch, false),
        ] {
            checks.push((
                "swap-in",
                swap_in(
                    dut,
                    clean,
                    strategy,
                    plan,
                    Run::Copy(CopyMethod::WarpVectors),
                )?,
            ));
        }
        // the few-miss planner's cluster build: one launch in clusters
        // (sm_90 and later), its blocks ordered by a cluster barrier
        checks.push((
            "swap-in, the few-miss planner's cluster build",
            swap_in(dut, clean, SwapInStrategy::FewMiss, false, Run::Cluster)?,
        ));
        // the split planner: one launch in clusters (sm_90 and later), its
        // blocks exchanging counts through distributed shared memory
        checks.push((
            "swap-in, the split planner",
            swap_in(dut, clean, SwapInStrategy::FewMiss, false, Run::Split)?,
        ));
        // the copy kernels of the other methods (the bulk one stages in
        // shared memory and waits on barriers)
        for copy in [CopyMethod::LineAligned, CopyMethod::BulkRuns] {
            checks.push((
                "swap-in, copy method",
                swap_in(dut, clean, SwapInStrategy::FewMiss, false, Run::Copy(copy))?,
            ));
        }
        for all_layers in [false, true] {
            let what = if all_layers {
                "writeback of every layer"
            } else {
                "writeback of one layer"
            };
            checks.push((what, writeback(dut, clean, all_layers)?));
        }
        for (what, verdict) in checks {
            if let Verdict::Differ(d) = verdict {
                return Ok(Verdict::Differ(format!("{what}, replayed: {d}")));
            }
        }
        Ok(Verdict::Same {
            note: Some(format!(
                "each call recorded once, replayed {REPLAYS} times with new inputs"
            )),
        })
    })
}

/// A recorded call: a CUDA graph, or (CPU executor) the call itself.
enum Recorded<'a> {
    Graph {
        dev: Arc<CudaDevice>,
        stream: OwnedStream,
        graph: CudaGraph,
    },
    Direct(Box<dyn Fn(Stream) -> kvtier::Result<()> + 'a>),
}

impl<'a> Recorded<'a> {
    fn record(
        exec: &Executor,
        call: impl Fn(Stream) -> kvtier::Result<()> + 'a,
    ) -> kvtier::Result<Self> {
        Ok(match exec {
            Executor::Cuda(dev) => {
                let stream = dev.create_stream()?;
                let graph = CudaGraph::capture(dev, &stream, call)?;
                Recorded::Graph {
                    dev: dev.clone(),
                    stream,
                    graph,
                }
            }
            Executor::Cpu => Recorded::Direct(Box::new(call)),
        })
    }

    /// One replay, waited for; then the bad indices at the sync point
    /// `check` (the CPU executor reports them from the call).
    fn replay(
        &self,
        check: impl FnOnce() -> kvtier::Result<()>,
    ) -> kvtier::Result<Option<kvtier::BadIndexReport>> {
        match self {
            Recorded::Graph { dev, stream, graph } => {
                graph.launch(stream.stream())?;
                dev.synchronize(stream.stream())?;
                settle(Ok(()), check)
            }
            Recorded::Direct(call) => settle(call(Stream::null()), check),
        }
    }
}

fn gather(dut: &Executor, seed: u64, method: Option<CopyMethod>) -> kvtier::Result<Verdict> {
    let case = GatherCase::random(seed)?;
    let under_test = case.load(dut)?;
    let recorded = Recorded::record(dut, |s| case.call_with(&under_test, method, s))?;
    for replay in 0..REPLAYS {
        // The replay's top-k, and the same case with it for the CPU.
        let mut reference = case.clone();
        reference.topk = case.redraw(seed ^ (replay + 1) << 20);
        // SAFETY: the last replay was waited for; nothing runs.
        unsafe { under_test.topk.write(&reference.topk)? };
        let report = recorded.replay(|| under_test.check())?;
        let got = case.snapshot(&under_test, report)?;
        let cpu = reference.load(&Executor::cpu())?;
        let report = settle(reference.call(&cpu, Stream::null()), || Ok(()))?;
        let want = reference.snapshot(&cpu, report)?;
        if let Verdict::Differ(d) = Snapshot::compare(&want, &got) {
            let how = method.map(|m| format!("{m:?}: ")).unwrap_or_default();
            return Ok(Verdict::Differ(format!("{how}{d}")));
        }
    }
    Ok(Verdict::Same { note: None })
}

/// How a checked swap-in runs: `strategy` with a copy method, or (with
/// `strategy` FewMiss) the few-miss planner's cluster build
/// (`SwapInEngine::run_cluster_copy`) or the split planner
/// (`run_cluster_plan`).
#[derive(Clone, Copy, Debug)]
enum Run {
    Copy(CopyMethod),
    Cluster,
    Split,
}

fn swap_in(
    dut: &Executor,
    seed: u64,
    strategy: SwapInStrategy,
    plan: bool,
    run: Run,
) -> kvtier::Result<Verdict> {
    let mut case = SwapCase::random(Path::Dsa, seed);
    // Every real row copies: no timing probe, no padding row count.
    case.for_graph(plan);
    let cpu = Executor::cpu();
    let mut engines = Vec::new();
    for exec in [&cpu, dut] {
        let mut e = SwapInEngine::new(exec.clone())?;
        e.reserve(case.batch() as u32, case.entries() as u32)?;
        engines.push(e);
    }
    let (on_cpu, under_test) = (Loaded::new(&cpu, &case)?, Loaded::new(dut, &case)?);
    let recorded = Recorded::record(dut, |s| match run {
        Run::Copy(copy) => engines[1].run_with_copy(&under_test.args(&case), strategy, copy, s),
        Run::Cluster => engines[1].run_cluster_copy(&under_test.args(&case), s),
        Run::Split => engines[1].run_cluster_plan(&under_test.args(&case), s),
    })?;
    for replay in 0..REPLAYS {
        // New queries against the state the earlier replays left.
        let topk = case.redraw_queries(seed ^ (replay + 1) << 20);
        // SAFETY: the last replay was waited for; nothing runs.
        unsafe {
            under_test.topk.write(&topk)?;
            on_cpu.topk.write(&topk)?;
        }
        let report = recorded.replay(|| engines[1].check())?;
        let got = under_test.snapshot(report)?;
        let report = settle(engines[0].run(&on_cpu.args(&case), Stream::null()), || {
            Ok(())
        })?;
        let want = on_cpu.snapshot(report)?;
        if let Verdict::Differ(d) = Snapshot::compare(&want, &got) {
            let plan = if plan { ", caller's miss plan" } else { "" };
            return Ok(Verdict::Differ(format!(
                "{strategy:?} ({}){plan}: {d}",
                match run {
                    Run::Copy(c) => format!("{c:?}"),
                    Run::Cluster => "cluster build".into(),
                    Run::Split => "split planner".into(),
                }
            )));
        }
    }
    Ok(Verdict::Same { note: None })
}

fn writeback(dut: &Executor, seed: u64, all_layers: bool) -> kvtier::Result<Verdict> {
    let case = WritebackCase::random(seed, all_layers)?;
    let cpu = Executor::cpu();
    let (on_cpu, under_test) = (case.load(&cpu)?, case.load(dut)?);
    // The layer table the recorded call reads lives as long as the recording.
    let kv = case.register(&under_test)?;
    let recorded = Recorded::record(dut, |s| case.call(&under_test, kv.as_ref(), s))?;
    for replay in 0..REPLAYS {
        // New source rows in the recorded call's buffers.
        let sources = case.sources(seed ^ (replay + 1) << 20);
        for l in [&on_cpu, &under_test] {
            for (buf, bytes) in l.sources.iter().zip(&sources) {
                // SAFETY: the last replay was waited for; nothing runs.
                unsafe { buf.write(bytes)? };
            }
        }
        let report = recorded.replay(|| under_test.check())?;
        let got = case.snapshot(&under_test, report)?;
        let cpu_kv = case.register(&on_cpu)?;
        let report = settle(case.call(&on_cpu, cpu_kv.as_ref(), Stream::null()), || {
            Ok(())
        })?;
        let want = case.snapshot(&on_cpu, report)?;
        if let v @ Verdict::Differ(_) = Snapshot::compare(&want, &got) {
            return Ok(v);
        }
    }
    Ok(Verdict::Same { note: None })
}
