//! What `kvtier selftest` measures of the link: contiguous copies both ways,
//! and one gather point and one swap-in point of the benchmark against the
//! contiguous copy of the same bytes (the benchmark's own code, with its
//! self-checks, at those points).

use clap::Parser;

use kvtier::Executor;

use super::{Bench, BenchArgs, Clock, Measurement, Timing, gather, swap_in};
use crate::transfer::{self, Dir, ExecVec, Staging};

/// The benchmark's arguments, parsed as the command line would be.
#[derive(Parser)]
struct Only {
    #[command(flatten)]
    args: BenchArgs,
}

pub(super) fn bench_args(extra: &[&str]) -> kvtier::Result<BenchArgs> {
    let base = [
        "kvtier-bench",
        "--iters",
        "20",
        "--warmup",
        "3",
        "--max-seconds",
        "2",
        "--pool-memory",
        "2GiB",
        "--entry",
        "fp8-dsa",
    ];
    Only::try_parse_from(base.iter().chain(extra))
        .map(|o| o.args)
        .map_err(|e| super::invalid("selftest", e.to_string()))
}

/// The selftest's link figures: (what, figures) per measurement, and the
/// failures of the swap-in builds no GPU has run yet timed at the swap-in's
/// point ([`Bench::untried`]), if any.
pub(crate) struct LinkFigures {
    pub figures: Vec<(String, String)>,
    pub untried: Option<String>,
}

pub(crate) fn link_figures(exec: &Executor) -> kvtier::Result<LinkFigures> {
    let cpu_note = match exec {
        Executor::Cpu => " (CPU executor: host memcpy, no link)",
        Executor::Cuda(_) => "",
    };
    let mut out = Vec::new();
    let bytes: usize = match exec {
        Executor::Cpu => 64 << 20,
        Executor::Cuda(_) => 256 << 20,
    };
    let args = bench_args(&[])?;
    let b = Bench::new(&args, exec.clone())?;
    let clock = Clock::new(exec)?;
    let mut host = Staging::new(exec, bytes)?;
    let dev = ExecVec::<u8>::zeroed(exec, bytes)?;
    let host_addr = host.ptr() as u64;
    let none = |_| Ok(());
    for (dir, name) in [
        (Dir::HostToDevice, "link, host to device"),
        (Dir::DeviceToHost, "link, device to host"),
    ] {
        let (src, dst) = match dir {
            Dir::HostToDevice => (host_addr, dev.addr()),
            Dir::DeviceToHost => (dev.addr(), host_addr),
        };
        // SAFETY: both buffers hold `bytes` bytes (the host side registered
        // for the CUDA executor) and live past the timing.
        let median = b
            .time(&clock, Timing::Device, none, |s| unsafe {
                transfer::contiguous(exec, dir, src, dst, bytes, s)
            })?
            .median_us;
        out.push((
            name.to_string(),
            format!(
                "{:.1} GB/s, one contiguous copy of {} MiB{cpu_note}",
                bytes as f64 / median / 1e3,
                bytes >> 20
            ),
        ));
    }
    drop((host, dev));

    let gather = bench_args(&[
        "--k",
        "2048",
        "--batch",
        "8",
        "--context",
        "32768",
        "--indices",
        "uniform",
    ])?;
    let rows = gather::run(&Bench::new(&gather, exec.clone())?)?;
    out.push((
        "gather vs the link (batch 8, k 2048, 656 B)".into(),
        against_limit(&rows, "goal >= 0.95 at >= 4 MB")? + cpu_note,
    ));
    let swap = bench_args(&["--batch", "16", "--hot", "4096", "--misses", "410"])?;
    let bench = Bench::new(&swap, exec.clone())?;
    let rows = swap_in::run(&bench)?;
    out.push((
        "swap-in vs the link (batch 16, HOT 4096, 410 misses)".into(),
        against_limit(
            &rows,
            "its goal is SGLang's kernel: kvtier bench --scenario swap-in",
        )? + cpu_note,
    ));
    // A build no GPU has run yet that failed beside it: the figures stand,
    // and the failure is a check of its own.
    let untried = bench.no_failures().err().map(|e| e.to_string());
    Ok(LinkFigures {
        figures: out,
        untried,
    })
}

/// kvtier's time and the limit's, for the same bytes, as a ratio.
fn against_limit(rows: &[Measurement], goal: &str) -> kvtier::Result<String> {
    let find = |limit: bool| {
        rows.iter()
            .find(|m| m.limit == limit && (limit || m.method.starts_with("kvtier")))
            .ok_or_else(|| super::invalid("selftest", "the benchmark point gave no such row"))
    };
    let (ours, limit) = (find(false)?, find(true)?);
    Ok(format!(
        "{:.2} MB: kvtier {:.1} us ({:.1} GB/s), contiguous copy {:.1} us: {} of the link ({goal})",
        ours.bytes as f64 / 1e6,
        ours.time.median_us,
        ours.bytes as f64 / ours.time.median_us / 1e3,
        limit.time.median_us,
        super::report::format_rate(Some(limit.time.median_us / ours.time.median_us)),
    ))
}
