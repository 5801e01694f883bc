//! The per-layer calls inside a CUDA graph: each is captured once on a
//! stream of kvtier's (a global capture, so that an allocation or a host
//! synchronisation inside the call fails it), then replayed three times
//! with new inputs written into the captured buffers between replays. After
//! every replay the result must equal the CPU executor's for the same
//! inputs and the same history (the swap-in's state carries over).

use std::sync::Arc;

use kvtier::cuda::CudaGraph;
use kvtier::{CudaDevice, Executor, Stream, SwapInEngine};

use super::snapshot::{Snapshot, Verdict, settle};
use super::swap_in::{Loaded, Path, SwapCase};
use super::tier_calls::{GatherCase, WritebackCase};
use super::{Row, run_cases};

const REPLAYS: u64 = 3;

pub(super) fn check(dev: &Arc<CudaDevice>, seed: u64) -> Row {
    let gpu = Executor::Cuda(dev.clone());
    run_cases("CUDA graph: gather, swap-in, writeback", seed, 4, |s| {
        for (what, verdict) in [
            ("gather", gather(dev, &gpu, s)?),
            ("swap-in", swap_in(dev, &gpu, s)?),
            ("writeback", writeback(dev, &gpu, s)?),
        ] {
            if let Verdict::Differ(d) = verdict {
                return Ok(Verdict::Differ(format!("{what}, replayed: {d}")));
            }
        }
        Ok(Verdict::Same {
            note: Some(format!(
                "each call captured once, replayed {REPLAYS} times with new inputs"
            )),
        })
    })
}

/// Waits for the replay and takes the bad-index report at the sync point.
fn after_replay(
    dev: &CudaDevice,
    stream: Stream,
    check: impl FnOnce() -> kvtier::Result<()>,
) -> kvtier::Result<Option<kvtier::BadIndexReport>> {
    dev.synchronize(stream)?;
    settle(Ok(()), check)
}

fn gather(dev: &Arc<CudaDevice>, gpu: &Executor, seed: u64) -> kvtier::Result<Verdict> {
    let mut case = GatherCase::clean(seed)?;
    let on_gpu = case.load(gpu)?;
    let stream = dev.create_stream()?;
    let graph = CudaGraph::capture(dev, &stream, |s| case.call(&on_gpu, s))?;
    for replay in 0..REPLAYS {
        case.topk = case.redraw(seed ^ (replay + 1) << 20);
        // SAFETY: the last replay was waited for; nothing runs.
        unsafe { on_gpu.topk.write(&case.topk)? };
        graph.launch(stream.stream())?;
        let report = after_replay(dev, stream.stream(), || on_gpu.check())?;
        let got = case.snapshot(&on_gpu, report)?;
        let cpu = case.load(&Executor::cpu())?;
        let report = settle(case.call(&cpu, Stream::null()), || Ok(()))?;
        let want = case.snapshot(&cpu, report)?;
        if let v @ Verdict::Differ(_) = Snapshot::compare(&want, &got) {
            return Ok(v);
        }
    }
    Ok(Verdict::Same { note: None })
}

fn swap_in(dev: &Arc<CudaDevice>, gpu: &Executor, seed: u64) -> kvtier::Result<Verdict> {
    // A clean DSA case recording into the engine's scratch.
    let mut case = SwapCase::random(Path::Dsa, seed & !1);
    case.clear_plan();
    let cpu = Executor::cpu();
    let mut engines = Vec::new();
    for exec in [&cpu, gpu] {
        let mut e = SwapInEngine::new(exec.clone())?;
        e.reserve(case.batch() as u32, case.entries() as u32)?;
        engines.push(e);
    }
    let (on_cpu, on_gpu) = (Loaded::new(&cpu, &case)?, Loaded::new(gpu, &case)?);
    let stream = dev.create_stream()?;
    let graph = CudaGraph::capture(dev, &stream, |s| engines[1].run(&on_gpu.args(&case), s))?;
    for replay in 0..REPLAYS {
        // New queries against the state the earlier replays left.
        let topk = case.redraw_queries(seed ^ (replay + 1) << 20);
        // SAFETY: the last replay was waited for; nothing runs.
        unsafe {
            on_gpu.topk.write(&topk)?;
            on_cpu.topk.write(&topk)?;
        }
        graph.launch(stream.stream())?;
        let report = after_replay(dev, stream.stream(), || engines[1].check())?;
        let got = on_gpu.snapshot(report)?;
        let report = settle(engines[0].run(&on_cpu.args(&case), Stream::null()), || {
            Ok(())
        })?;
        let want = on_cpu.snapshot(report)?;
        if let v @ Verdict::Differ(_) = Snapshot::compare(&want, &got) {
            return Ok(v);
        }
    }
    Ok(Verdict::Same { note: None })
}

fn writeback(dev: &Arc<CudaDevice>, gpu: &Executor, seed: u64) -> kvtier::Result<Verdict> {
    let case = WritebackCase::clean(seed)?;
    let cpu = Executor::cpu();
    let (on_cpu, on_gpu) = (case.load(&cpu)?, case.load(gpu)?);
    let stream = dev.create_stream()?;
    // The layer table the graph reads lives as long as the graph.
    let kv = case.register(&on_gpu)?;
    let graph = CudaGraph::capture(dev, &stream, |s| case.call(&on_gpu, kv.as_ref(), s))?;
    for replay in 0..REPLAYS {
        // New source rows in the captured buffers.
        let sources = case.sources(seed ^ (replay + 1) << 20);
        for l in [&on_cpu, &on_gpu] {
            for (buf, bytes) in l.sources.iter().zip(&sources) {
                // SAFETY: the last replay was waited for; nothing runs.
                unsafe { buf.write(bytes)? };
            }
        }
        graph.launch(stream.stream())?;
        let report = after_replay(dev, stream.stream(), || on_gpu.check())?;
        let got = case.snapshot(&on_gpu, report)?;
        let kv = case.register(&on_cpu)?;
        let report = settle(case.call(&on_cpu, kv.as_ref(), Stream::null()), || Ok(()))?;
        let want = case.snapshot(&on_cpu, report)?;
        if let v @ Verdict::Differ(_) = Snapshot::compare(&want, &got) {
            return Ok(v);
        }
    }
    Ok(Verdict::Same { note: None })
}
