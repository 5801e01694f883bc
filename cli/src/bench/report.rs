//! The bench's outputs: the table on stdout and one JSON object per
//! measurement (`--json`), which the figures (`--plot`, in `figures`) read.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde_json::json;

use kvtier::Executor;

use super::{Measurement, driver_text};

/// What ran: the device, the driver, the executor, and why not the GPU.
#[derive(Clone)]
pub(super) struct Environment {
    pub device: String,
    pub driver: String,
    pub executor: &'static str,
    pub cpu_reason: Option<String>,
    /// The compiler of the embedded kernels (`NVRTC 12.9`, `nvcc V13.0.88`),
    /// None when none were built: two builds of one commit measured side by
    /// side are told apart by it.
    pub kernels: Option<&'static str>,
}

impl Environment {
    pub fn probe(exec: &Executor, why_cpu: Option<&str>) -> Self {
        match exec {
            Executor::Cuda(dev) => {
                let (ma, mi) = dev.compute_capability();
                Environment {
                    device: format!("{} (sm_{ma}{mi})", dev.name()),
                    driver: driver_text(),
                    executor: "cuda",
                    cpu_reason: None,
                    kernels: kvtier::cuda::kernels::BUILD.compiler(),
                }
            }
            Executor::Cpu => Environment {
                device: format!("CPU: {}", cpu_model()),
                driver: driver_text(),
                executor: "cpu",
                cpu_reason: why_cpu.map(str::to_string),
                kernels: kvtier::cuda::kernels::BUILD.compiler(),
            },
        }
    }

    pub fn banner(&self) -> String {
        match &self.cpu_reason {
            None => format!(
                "executor: CUDA on {} (driver {}); timed with CUDA events; the limits are copy-engine \
                 transfers",
                self.device, self.driver
            ),
            Some(why) => format!(
                "executor: CPU executor on {} (no CUDA executor: {why}); timed with the wall clock; the \
                 limits are host memcpys. These are CPU figures, not GPU figures.",
                self.device
            ),
        }
    }
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// limit's median / method's median, per (scenario, point); none where the
/// point moves no bytes (a ratio of two calls that copy nothing).
fn ratio(all: &[Measurement], m: &Measurement) -> Option<f64> {
    all.iter()
        .find(|o| o.limit && o.scenario == m.scenario && o.params == m.params)
        .filter(|l| l.bytes > 0 && m.bytes > 0)
        .map(|l| l.time.median_us / m.time.median_us)
}

/// Whether a row is SGLang's own kernel (the swap-in scenarios time it
/// beside kvtier's on a GPU).
fn is_sglang(m: &Measurement) -> bool {
    m.method.starts_with("SGLang ")
}

/// SGLang's median / method's median, per (scenario, point): how many times
/// as fast as SGLang's own kernel the method is (above 1.00: faster); none
/// where SGLang's kernel was not timed at the point.
fn ratio_to_sglang(all: &[Measurement], m: &Measurement) -> Option<f64> {
    all.iter()
        .find(|o| is_sglang(o) && o.scenario == m.scenario && o.params == m.params)
        .map(|s| s.time.median_us / m.time.median_us)
}

fn gbps(m: &Measurement) -> f64 {
    m.bytes as f64 / m.time.median_us / 1e3
}

/// A time in µs: two decimals below 10 µs, one above.
fn format_us(us: f64) -> String {
    if us < 10.0 {
        format!("{us:.2}")
    } else {
        format!("{us:.1}")
    }
}

/// A rate or ratio, with the digits that make a small one more than "0.00";
/// "-" where it is not defined.
pub(super) fn format_rate(x: Option<f64>) -> String {
    match x {
        Some(x) if x.is_finite() => {
            if x == 0.0 || x >= 0.01 {
                format!("{x:.2}")
            } else if x >= 0.001 {
                format!("{x:.4}")
            } else {
                format!("{x:.1e}")
            }
        }
        _ => "-".into(),
    }
}

/// A scenario's table: one row per method and point, the point and method
/// columns as wide as their longest entry.
pub(super) fn print_table(rows: &[Measurement]) {
    for line in table(rows) {
        println!("{line}");
    }
}

fn table(rows: &[Measurement]) -> Vec<String> {
    let Some(first) = rows.first() else {
        return Vec::new();
    };
    let points: Vec<String> = rows.iter().map(Measurement::point).collect();
    let width = |min: usize, texts: &mut dyn Iterator<Item = usize>| texts.fold(min, usize::max);
    let pw = width(58, &mut points.iter().map(|p| p.chars().count()));
    let mw = width(46, &mut rows.iter().map(|r| r.method.chars().count()));
    // A "vs SGLang" column where SGLang's kernel was timed beside kvtier's.
    let sglang = rows.iter().any(is_sglang);
    let mut header = format!(
        "{:<pw$} {:<mw$} {:>10} {:>5} {:>10} {:>10} {:>10} {:>8} {:>8}",
        "point", "method", "bytes", "n", "median µs", "p99 µs", "max µs", "GB/s", "vs limit"
    );
    if sglang {
        header.push_str(&format!(" {:>9}", "vs SGLang"));
    }
    let mut out = vec![format!("{}:", first.scenario), header];
    for (r, point) in rows.iter().zip(&points) {
        let mut line = format!(
            "{:<pw$} {:<mw$} {:>10} {:>5} {:>10} {:>10} {:>10} {:>8} {:>8}",
            point,
            r.method,
            format_bytes(r.bytes),
            r.time.samples,
            format_us(r.time.median_us),
            r.time.p99_us.map_or("-".into(), format_us),
            format_us(r.time.max_us),
            format_rate((r.bytes > 0).then(|| gbps(r))),
            format_rate(ratio(rows, r)),
        );
        if sglang {
            line.push_str(&format!(" {:>9}", format_rate(ratio_to_sglang(rows, r))));
        }
        out.push(line);
    }
    out
}

fn format_bytes(bytes: u64) -> String {
    if bytes >= 1_000_000_000 {
        format!("{:.2} GB", bytes as f64 / 1e9)
    } else if bytes >= 1_000_000 {
        format!("{:.2} MB", bytes as f64 / 1e6)
    } else if bytes >= 1000 {
        format!("{:.1} KB", bytes as f64 / 1e3)
    } else {
        format!("{bytes} B")
    }
}

/// One JSON object per measurement: what `--json` writes and the figures
/// read.
/// `timestamp`: the run's (one for all its lines: readers take a run's date
/// from it), as [`rfc3339_now`] writes it.
pub(super) fn json_lines(
    env: &Environment,
    all: &[Measurement],
    timestamp: &str,
) -> Vec<serde_json::Value> {
    // Set by the GPU suite and the test script (the binary cannot know it).
    let commit = std::env::var("KVTIER_COMMIT")
        .ok()
        .filter(|c| !c.is_empty());
    all.iter()
        .map(|m| {
            let params: serde_json::Map<String, serde_json::Value> = m
                .params
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect();
            json!({
                "device": env.device,
                "driver": env.driver,
                "executor": env.executor,
                "cpu_reason": env.cpu_reason,
                "kernels": env.kernels,
                "scenario": m.scenario,
                "method": m.method,
                "params": params,
                "bytes": m.bytes,
                "median_us": m.time.median_us,
                "q1_us": m.time.q1_us,
                "q3_us": m.time.q3_us,
                "p99_us": m.time.p99_us,
                "max_us": m.time.max_us,
                "samples": m.time.samples,
                "gbps": gbps(m),
                "ratio_to_limit": ratio(all, m),
                "ratio_to_sglang": ratio_to_sglang(all, m),
                "is_limit": m.limit,
                "kvtier": kvtier::VERSION,
                "commit": commit,
                "timestamp": timestamp,
            })
        })
        .collect()
}

/// One JSON object per line (JSON Lines).
/// The --json file, written a point at a time: each point's measurements are
/// appended (and flushed) as the point completes, so a run cut by a time
/// limit, or stopped by an error at a later point, keeps the points before
/// it. The GPU suite runs each bench under a limit, and a kernel that has
/// never run on a GPU may fail or hang at any point.
pub(super) struct JsonSink {
    env: Environment,
    /// The run's, on every line.
    timestamp: String,
    path: std::path::PathBuf,
    file: std::cell::RefCell<std::io::BufWriter<std::fs::File>>,
    written: std::cell::Cell<u64>,
}

impl JsonSink {
    /// Creates (empties) `path`: never through a link planted there, never
    /// into a FIFO.
    pub fn create(path: &Path, env: Environment, timestamp: &str) -> kvtier::Result<Self> {
        let file = kvtier::shared_fs::create_output(path, "--json")?;
        Ok(JsonSink {
            env,
            timestamp: timestamp.to_string(),
            path: path.to_path_buf(),
            file: std::cell::RefCell::new(std::io::BufWriter::new(file)),
            written: std::cell::Cell::new(0),
        })
    }

    /// Appends one point's measurements, one JSON line each.
    pub fn append(&self, point: &[Measurement]) -> kvtier::Result<()> {
        let io = |source| kvtier::Error::Io {
            context: format!("writing {}", self.path.display()),
            source,
        };
        let mut f = self.file.borrow_mut();
        for line in json_lines(&self.env, point, &self.timestamp) {
            writeln!(f, "{line}").map_err(io)?;
        }
        f.flush().map_err(io)?;
        self.written.set(self.written.get() + point.len() as u64);
        Ok(())
    }

    /// Measurements written so far.
    pub fn written(&self) -> u64 {
        self.written.get()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Now as `2026-11-21T20:55:05Z`.
pub(super) fn rfc3339_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// A TrueType font for the plot: `--plot-font`, else a common one found
/// under the system's font directories.
pub(crate) fn find_font(given: Option<&Path>) -> kvtier::Result<PathBuf> {
    if let Some(p) = given {
        if !p.is_file() {
            return Err(kvtier::Error::InvalidArgument {
                arg: "--plot-font",
                msg: format!("{} is not a font file", p.display()),
            });
        }
        return Ok(p.to_path_buf());
    }
    let mut found: BTreeSet<PathBuf> = BTreeSet::new();
    let mut dirs: Vec<PathBuf> = ["/usr/share/fonts", "/usr/local/share/fonts"]
        .iter()
        .map(PathBuf::from)
        .collect();
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x.eq_ignore_ascii_case("ttf")) {
                found.insert(p);
            }
        }
    }
    let preferred = [
        "DejaVuSans.ttf",
        "LiberationSans-Regular.ttf",
        "NotoSans-Regular.ttf",
    ];
    preferred
        .iter()
        .find_map(|name| {
            found
                .iter()
                .find(|p| p.file_name().is_some_and(|f| f == *name))
        })
        .or_else(|| found.iter().next())
        .cloned()
        .ok_or_else(|| kvtier::Error::InvalidArgument {
            arg: "--plot",
            msg: "no TrueType font under /usr/share/fonts for the plot's text: install one \
                      (apt-get install fonts-dejavu-core) or pass --plot-font FILE"
                .into(),
        })
}

/// Registers `font` (or one found under /usr/share/fonts) as the plots'
/// "sans-serif".
pub(crate) fn register_font(font: Option<&Path>) -> kvtier::Result<()> {
    let font_path = find_font(font)?;
    let bytes = std::fs::read(&font_path).map_err(|source| kvtier::Error::Io {
        context: format!("reading the font {}", font_path.display()),
        source,
    })?;
    // plotters keeps fonts for the process; one plot per run.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).map_err(|_| {
        kvtier::Error::InvalidArgument {
            arg: "--plot-font",
            msg: format!("{} is not a TrueType font", font_path.display()),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::super::figures::log_ticks;
    use super::super::{Measurement, Stats};
    use super::{format_rate, table};
    use serde_json::json;

    #[test]
    fn swap_in_tables_say_each_method_against_sglangs_kernel_where_it_was_timed() {
        let at = |batch: u32, method: &'static str, median_us: f64| {
            let t = Stats {
                median_us,
                q1_us: median_us,
                q3_us: median_us,
                p99_us: None,
                max_us: median_us,
                samples: 5,
            };
            Measurement::new(
                "swap-in",
                method,
                &[("batch", json!(batch))],
                1000,
                t,
                false,
            )
        };
        let rows = [
            at(1, "kvtier swap-in, compact planner", 10.0),
            at(1, "SGLang 0.5.23's swap-in kernel", 15.0),
            at(8, "kvtier swap-in, compact planner", 30.0),
        ];
        let t = table(&rows);
        assert!(t[1].ends_with("vs SGLang"), "{t:?}");
        // batch 1: SGLang's 15 µs over 10 µs; batch 8: SGLang's kernel not timed
        assert!(t[2].ends_with(" 1.50"), "{t:?}");
        assert!(t[3].ends_with(" 1.00"), "{t:?}");
        assert!(t[4].ends_with(" -"), "{t:?}");
        // without SGLang's kernel (the CPU executor) the column is left out
        let t = table(&rows[2..]);
        assert!(t[1].ends_with("vs limit"), "{t:?}");
    }

    #[test]
    fn small_rates_keep_their_digits_and_undefined_ones_are_a_dash() {
        assert_eq!(format_rate(Some(12.345)), "12.35");
        assert_eq!(format_rate(Some(0.0123)), "0.01");
        assert_eq!(format_rate(Some(0.00123)), "0.0012");
        assert_eq!(format_rate(Some(0.000_38)), "3.8e-4");
        assert_eq!(format_rate(None), "-");
        assert_eq!(format_rate(Some(f64::NAN)), "-");
    }

    #[test]
    fn every_log_axis_gets_values() {
        assert_eq!(
            log_ticks(0.8, 120.0),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
        );
        // within one decade: every integer multiple
        assert_eq!(log_ticks(21.0, 68.0), vec![30.0, 40.0, 50.0, 60.0]);
        // narrower than one step: the ends and the middle
        let t = log_ticks(41.0, 44.0);
        assert_eq!(t.len(), 3);
        assert!((t[1] - (41.0f64 * 44.0).sqrt()).abs() < 1e-9);
    }
}
