//! `kvtier selftest`: on the user's GPU, every kernel kvtier serves against
//! the CPU executor, the per-layer calls captured in a CUDA graph and
//! replayed, and the link measured with one gather and one swap-in point
//! against it. The speculative swap-in, not yet served (`install()` leaves
//! it to SGLang), is left to the GPU tests: its state after a call is not
//! deterministic, so it is checked by invariants, not byte for byte.
//!
//! Every correctness check runs one input on both executors, from identical
//! state, and compares everything the call may write (outputs, state, the
//! device buffer, the pool) byte for byte, and the bad-index reports. The
//! inputs are random and adversarial: bad slots, lengths, tokens, host and
//! device rows, request rows named twice, broken LRU rows, padding rows.
//! The first difference is reported with the seed that reproduces it.
//!
//! Exit codes: 0 every check passed; 1 a check failed, or the selftest
//! could not run (a GPU without kvtier's kernels, a bad `--device`); 77
//! there is no usable GPU or driver (nothing was checked; the automake
//! convention for a skipped test).

mod graph;
mod snapshot;
mod swap_in;
mod tier_calls;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use serde_json::json;

use kvtier::Executor;
use kvtier::cuda::{self, FatbinImage, KernelBuild};

use super::bench;
use snapshot::Verdict;

/// The exit code for "no usable GPU: nothing was checked".
pub const EXIT_NO_GPU: u8 = 77;

#[derive(Debug, Args)]
pub struct SelftestArgs {
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Seed of the first case of every check (case i uses seed + i).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Random cases per correctness check.
    #[arg(long, default_value_t = 40, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    cases: u64,
    /// Skip the link measurements (correctness checks only).
    #[arg(long)]
    no_link: bool,
    /// A dry run of the selftest itself, without a GPU: the CPU executor
    /// stands in for the CUDA one, so every correctness check runs and passes
    /// (the link, which the CPU has not, is not measured); it proves that the
    /// selftest runs, nothing about the kernels.
    #[arg(long)]
    cpu: bool,
    /// Also write one JSON object per check here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// How a check ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    Pass,
    Fail,
    /// Not run, and why is in the detail.
    Skip,
    /// A measurement: no verdict, the figures are in the detail.
    Measured,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Fail => "FAIL",
            Status::Skip => "skip",
            Status::Measured => "measured",
        }
    }
}

/// One line of the table.
pub(crate) struct Row {
    pub check: String,
    pub status: Status,
    /// Cases run (0 for measurements).
    pub cases: u64,
    pub detail: String,
    pub seconds: f64,
}

impl Row {
    /// The row in the table; a measurement or a check not run has no cases.
    fn line(&self) -> String {
        let cases = match self.status {
            Status::Pass | Status::Fail => self.cases.to_string(),
            Status::Skip | Status::Measured => "-".into(),
        };
        let time = match self.status {
            Status::Skip => "-".into(),
            _ => format!("{:.1} s", self.seconds),
        };
        table_line(
            self.status.label(),
            &self.check,
            &cases,
            &time,
            &self.detail,
        )
    }

    fn skip(check: &str, why: &str) -> Self {
        Row {
            check: check.into(),
            status: Status::Skip,
            cases: 0,
            detail: why.into(),
            seconds: 0.0,
        }
    }
}

/// Runs `case(seed)` for `n` seeds from `first`, stopping at the first
/// difference or error.
pub(crate) fn run_cases(
    check: &str,
    first: u64,
    n: u64,
    mut case: impl FnMut(u64) -> kvtier::Result<Verdict>,
) -> Row {
    let start = Instant::now();
    let mut done = 0;
    let mut notes: Vec<String> = Vec::new();
    for seed in (0..n).map(|i| first.wrapping_add(i)) {
        let (status, detail) = match case(seed) {
            Ok(Verdict::Same { note }) => {
                done += 1;
                if let Some(n) = note
                    && !notes.contains(&n)
                {
                    notes.push(n);
                }
                continue;
            }
            Ok(Verdict::Differ(what)) => (Status::Fail, format!("seed {seed}: {what}")),
            Err(e) => (Status::Fail, format!("seed {seed}: error: {e}")),
        };
        return Row {
            check: check.into(),
            status,
            cases: done + 1,
            detail,
            seconds: start.elapsed().as_secs_f64(),
        };
    }
    Row {
        check: check.into(),
        status: Status::Pass,
        cases: done,
        detail: if notes.is_empty() {
            "identical on every case".into()
        } else {
            format!("identical on every case ({})", notes.join("; "))
        },
        seconds: start.elapsed().as_secs_f64(),
    }
}

pub fn run(args: SelftestArgs) -> kvtier::Result<ExitCode> {
    // A path that cannot be written must not cost the run.
    if let Some(path) = &args.json {
        std::fs::write(path, "").map_err(|e| kvtier::Error::InvalidArgument {
            arg: "--json",
            msg: format!("cannot write {}: {e}", path.display()),
        })?;
    }
    println!("kvtier {} selftest", kvtier::VERSION);
    let dut = if args.cpu {
        println!(
            "executor under test: the CPU executor (--cpu: a dry run of the selftest; it checks the \
             selftest, not the CUDA kernels)"
        );
        Executor::cpu()
    } else {
        match Executor::cuda(args.device) {
            Ok(e) => e,
            Err(e @ kvtier::Error::NoDriver(_)) => {
                println!("no usable GPU, nothing was checked: {e}");
                println!(
                    "(exit code {EXIT_NO_GPU}; `kvtier selftest --cpu` runs the checks on the CPU \
                     executor as a dry run)"
                );
                return Ok(ExitCode::from(EXIT_NO_GPU));
            }
            // A GPU without kvtier's kernels, a bad ordinal: a failure.
            Err(e) => return Err(e),
        }
    };
    describe(&dut)?;

    // The table, a row as each check ends (once: a long run shows its
    // progress, and a failure's detail is on its row).
    println!();
    println!(
        "{}",
        table_line("result", "check", "cases", "time", "detail")
    );
    let mut rows = Vec::new();
    // --json: a line as each check ends, so a selftest cut by a time limit
    // (a kernel that hangs) keeps the checks before it.
    let mut json = match &args.json {
        Some(path) => Some(JsonLines::create(path, &dut)?),
        None => None,
    };
    let mut json_error = None;
    let mut add = |row: Row| {
        // on disk before it is shown
        if let Some(j) = &mut json
            && json_error.is_none()
            && let Err(e) = j.append(&row)
        {
            json_error = Some(e);
        }
        println!("{}", row.line());
        rows.push(row);
    };
    let (s, n) = (args.seed, args.cases);
    add(tier_calls::gather(&dut, s, n));
    add(tier_calls::gather_production_shape(&dut, s));
    add(tier_calls::writeback(&dut, s, n, false));
    add(tier_calls::writeback(&dut, s, n, true));
    for path in swap_in::Path::ALL {
        add(swap_in::check(&dut, path, s, n));
    }
    add(swap_in::replay(&dut, s, n));
    add(swap_in::production_shape(&dut, s));
    add(graph::check(&dut, s));
    if args.no_link {
        add(Row::skip("link", "--no-link"));
    } else if matches!(dut, Executor::Cpu) {
        // Host memcpys are no link: nothing to report of one.
        add(Row::skip(
            "link",
            "not run on the CPU executor (no link to measure; a GPU's selftest measures it)",
        ));
    } else {
        let start = Instant::now();
        match bench::link_figures(&dut) {
            Ok(bench::LinkFigures { figures, untried }) => {
                let seconds = start.elapsed().as_secs_f64() / figures.len().max(1) as f64;
                for (check, detail) in figures {
                    add(Row {
                        check,
                        status: Status::Measured,
                        cases: 0,
                        detail,
                        seconds,
                    });
                }
                if let Some(detail) = untried {
                    add(Row {
                        check: "swap-in builds no GPU had run, timed beside the link".into(),
                        status: Status::Fail,
                        cases: 0,
                        detail,
                        seconds: 0.0,
                    });
                }
            }
            Err(e) => add(Row {
                check: "link".into(),
                status: Status::Fail,
                cases: 0,
                detail: format!("the measurement failed: {e}"),
                seconds: start.elapsed().as_secs_f64(),
            }),
        }
    }
    println!();

    if let Some(e) = json_error {
        return Err(e);
    }
    if let Some(path) = &args.json {
        println!(
            "wrote {} to {}",
            bench::count(rows.len() as u64, "check", "checks"),
            path.display()
        );
    }
    let failed = rows.iter().filter(|r| r.status == Status::Fail).count();
    if failed > 0 {
        println!(
            "selftest FAILED: {} (details above)",
            if failed == 1 {
                "1 check differs".to_string()
            } else {
                format!("{failed} checks differ")
            }
        );
        Ok(ExitCode::FAILURE)
    } else {
        println!("selftest passed");
        Ok(ExitCode::SUCCESS)
    }
}

/// The device, driver and the kernel code the driver loaded.
fn describe(dut: &Executor) -> kvtier::Result<()> {
    println!("driver:    {}", bench::driver_text());
    match cuda::kernels::BUILD {
        KernelBuild::Built { compiler, sass, .. } => println!(
            "kernels:   built by {compiler}, SASS for {}",
            sass.join(", ")
        ),
        KernelBuild::NotBuilt { reason } => println!("kernels:   NOT BUILT: {reason}"),
    }
    if let Executor::Cuda(dev) = dut {
        let (ma, mi) = dev.compute_capability();
        println!(
            "device:    GPU {}: {} (sm_{ma}{mi}, {} SMs)",
            dev.ordinal(),
            dev.name(),
            dev.sm_count()
        );
        println!("loaded:    {}", loaded_code(dev)?);
        println!(
            "launches:  the swap-in's copy kernel {}",
            if dev.dependent_launch() {
                "as a programmatic dependent of the plan kernel (sm_90+)"
            } else {
                "after the plan kernel (an ordinary launch)"
            }
        );
    }
    Ok(())
}

/// Which of the fatbin's images the driver runs: SASS for the device, or
/// PTX compiled at load time.
fn loaded_code(dev: &kvtier::CudaDevice) -> kvtier::Result<String> {
    let (binary, ptx) = dev.loaded_kernel_arch()?;
    let images = cuda::kernels::fatbin_images(cuda::kernels::fatbin()?)?;
    let has_sass = images
        .iter()
        .any(|i| matches!(i, FatbinImage::Sass { arch } if *arch as i32 == binary));
    Ok(if has_sass {
        format!("sm_{binary} SASS from the embedded fatbin (PTX arch {ptx})")
    } else {
        format!(
            "code for sm_{binary} compiled by the driver at load time from compute_{ptx} PTX (the \
             fatbin has no SASS for this GPU)"
        )
    })
}

/// A line of the table: result, check, cases, time, detail.
fn table_line(result: &str, check: &str, cases: &str, time: &str, detail: &str) -> String {
    format!("{result:<8} {check:<52} {cases:>6} {time:>8}  {detail}")
}

/// The --json file, a line a check, written as each check ends.
struct JsonLines {
    path: std::path::PathBuf,
    file: std::fs::File,
    device: serde_json::Value,
}

impl JsonLines {
    fn create(path: &std::path::Path, dut: &Executor) -> kvtier::Result<Self> {
        let device = match dut {
            Executor::Cuda(dev) => json!({
                "name": dev.name(),
                "compute_capability": format!("{}.{}", dev.compute_capability().0, dev.compute_capability().1),
                "loaded": loaded_code(dev)?,
            }),
            Executor::Cpu => json!("CPU executor (--cpu dry run)"),
        };
        let file = std::fs::File::create(path).map_err(|source| kvtier::Error::Io {
            context: format!("writing {}", path.display()),
            source,
        })?;
        Ok(JsonLines {
            path: path.to_path_buf(),
            file,
            device,
        })
    }

    fn append(&mut self, r: &Row) -> kvtier::Result<()> {
        use std::io::Write;
        let line = json!({
            "check": r.check,
            "result": r.status.label(),
            "cases": r.cases,
            "detail": r.detail,
            "seconds": r.seconds,
            "device": self.device,
            "driver": bench::driver_text(),
            "kvtier": kvtier::VERSION,
        });
        // one write a line, unbuffered: on disk when the check's row is shown
        writeln!(self.file, "{line}").map_err(|source| kvtier::Error::Io {
            context: format!("writing {}", self.path.display()),
            source,
        })
    }
}
