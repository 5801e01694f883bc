//! The bench's outputs: the table on stdout, one JSON object per measurement
//! (`--json`), and the plot (`--plot`).

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde_json::json;

use kvtier::Executor;

use super::{Measurement, driver_text};

/// What ran: the device, the driver, the executor, and why not the GPU.
pub(super) struct Environment {
    pub device: String,
    pub driver: String,
    pub executor: &'static str,
    pub cpu_reason: Option<String>,
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
                }
            }
            Executor::Cpu => Environment {
                device: format!("CPU: {}", cpu_model()),
                driver: driver_text(),
                executor: "cpu",
                cpu_reason: why_cpu.map(str::to_string),
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
        .map(|l| l.median_us / m.median_us)
}

fn gbps(m: &Measurement) -> f64 {
    m.bytes as f64 / m.median_us / 1e3
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
    let mut out = vec![
        format!("{}:", first.scenario),
        format!(
            "{:<pw$} {:<mw$} {:>10} {:>5} {:>10} {:>10} {:>10} {:>8} {:>8}",
            "point", "method", "bytes", "n", "median µs", "p99 µs", "max µs", "GB/s", "vs limit"
        ),
    ];
    for (r, point) in rows.iter().zip(&points) {
        out.push(format!(
            "{:<pw$} {:<mw$} {:>10} {:>5} {:>10} {:>10} {:>10} {:>8} {:>8}",
            point,
            r.method,
            format_bytes(r.bytes),
            r.samples,
            format_us(r.median_us),
            r.p99_us.map_or("-".into(), format_us),
            format_us(r.max_us),
            format_rate((r.bytes > 0).then(|| gbps(r))),
            format_rate(ratio(rows, r)),
        ));
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

/// One JSON object per line (JSON Lines).
pub(super) fn write_json(
    path: &Path,
    env: &Environment,
    all: &[Measurement],
) -> kvtier::Result<()> {
    let io = |source| kvtier::Error::Io {
        context: format!("writing {}", path.display()),
        source,
    };
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    let timestamp = rfc3339_now();
    for m in all {
        let params: serde_json::Map<String, serde_json::Value> = m
            .params
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let line = json!({
            "device": env.device,
            "driver": env.driver,
            "executor": env.executor,
            "cpu_reason": env.cpu_reason,
            "scenario": m.scenario,
            "method": m.method,
            "params": params,
            "bytes": m.bytes,
            "median_us": m.median_us,
            "p99_us": m.p99_us,
            "max_us": m.max_us,
            "samples": m.samples,
            "gbps": gbps(m),
            "ratio_to_limit": ratio(all, m),
            "is_limit": m.limit,
            "kvtier": env!("CARGO_PKG_VERSION"),
            "timestamp": timestamp,
        });
        writeln!(f, "{line}").map_err(io)?;
    }
    f.flush().map_err(io)
}

/// Now as `2026-11-21T20:55:05Z`.
fn rfc3339_now() -> String {
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

/// One line of a panel: a method and its points (x, median µs, GB/s).
type Series = (&'static str, Vec<(f64, f64, f64)>);

/// A panel of the plot: one x parameter, one line per method.
struct Panel {
    title: String,
    x_label: &'static str,
    /// The methods' lines, in first-seen order.
    series: Vec<Series>,
}

/// Which parameter is the x axis, and which get a panel per value, for each
/// scenario (and phase); every other parameter is held at its first value.
fn panels(all: &[Measurement]) -> Vec<Panel> {
    let layouts: [(&str, Option<&str>, &str, &[&str]); 5] = [
        ("gather", None, "k", &["batch"]),
        ("swap-in", None, "batch", &["hot", "misses"]),
        ("spec-swap-in", None, "batch", &["steps", "misses"]),
        ("writeback", Some("decode"), "batch", &["entry"]),
        ("writeback", Some("prefill"), "tokens", &["entry"]),
    ];
    let mut out = Vec::new();
    for (scenario, phase, x, facets) in layouts {
        let ms: Vec<&Measurement> = all
            .iter()
            .filter(|m| m.scenario == scenario)
            .filter(|m| phase.is_none_or(|p| get(m, "phase") == Some(json!(p))))
            .collect();
        let Some(first) = ms.first() else {
            continue;
        };
        // Held parameters: everything but x, the facets and derived ones.
        let held: Vec<(&str, serde_json::Value)> = first
            .params
            .iter()
            .filter(|(k, _)| *k != x && !facets.contains(k) && *k != "distinct_regions")
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        let ms: Vec<&Measurement> = ms
            .into_iter()
            .filter(|m| held.iter().all(|(k, v)| get(m, k).as_ref() == Some(v)))
            .collect();
        let mut facet_values: Vec<Vec<serde_json::Value>> = Vec::new();
        for m in &ms {
            let f: Vec<serde_json::Value> = facets
                .iter()
                .map(|k| get(m, k).unwrap_or_default())
                .collect();
            if !facet_values.contains(&f) {
                facet_values.push(f);
            }
        }
        for f in facet_values {
            let mut series: Vec<Series> = Vec::new();
            for m in ms.iter().filter(|m| {
                facets
                    .iter()
                    .zip(&f)
                    .all(|(k, v)| get(m, k).as_ref() == Some(v))
            }) {
                let Some(xv) = get(m, x).and_then(|v| v.as_f64()) else {
                    continue;
                };
                let point = (xv, m.median_us, gbps(m));
                match series.iter_mut().find(|(name, _)| *name == m.method) {
                    Some((_, pts)) => pts.push(point),
                    None => series.push((m.method, vec![point])),
                }
            }
            let describe = |pairs: Vec<(&str, &serde_json::Value)>| {
                pairs
                    .into_iter()
                    .map(|(k, v)| {
                        format!(
                            "{k} {}",
                            v.as_str().map(str::to_string).unwrap_or(v.to_string())
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let mut words = vec![scenario.to_string()];
            if let Some(p) = phase {
                words.push(p.to_string());
            }
            let title = format!(
                "{}: {}; {}",
                words.join(" "),
                describe(facets.iter().copied().zip(&f).collect()),
                describe(held.iter().map(|(k, v)| (*k, v)).collect())
            );
            out.push(Panel {
                title,
                x_label: x,
                series,
            });
        }
    }
    out
}

fn get(m: &Measurement, key: &str) -> Option<serde_json::Value> {
    m.params
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.clone())
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

/// Latency and bandwidth against k or batch, one line per method, a row of
/// two panels per slice of the grid (see [`panels`]); log-log axes.
pub(super) fn plot(
    path: &Path,
    font: Option<&Path>,
    env: &Environment,
    all: &[Measurement],
) -> kvtier::Result<()> {
    register_font(font)?;
    let panels = panels(all);
    if panels.is_empty() {
        return Err(kvtier::Error::InvalidArgument {
            arg: "--plot",
            msg: "nothing was measured".into(),
        });
    }
    let err = |e: String| kvtier::Error::Io {
        context: format!("drawing {}", path.display()),
        source: std::io::Error::other(e),
    };
    // A row per slice of the grid: latency, bandwidth, then the row's
    // legend beside them (never over the data).
    let (w, row_h, header, legend_w) = (1800u32, 340u32, 60u32, 300u32);
    let root =
        BitMapBackend::new(path, (w, header + row_h * panels.len() as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let (top, body) = root.split_vertically(header);
    top.draw_text(
        &format!(
            "kvtier bench — {} ({} executor, driver {}); median per call; the JSON has the full grid",
            env.device, env.executor, env.driver
        ),
        &("sans-serif", 22).into_font().color(&BLACK),
        (20, 18),
    )
    .map_err(|e| err(e.to_string()))?;
    let rows = body.split_evenly((panels.len(), 1));
    for (p, row) in panels.iter().zip(&rows) {
        let (charts, legend) = row.split_horizontally(w - legend_w);
        draw_legend(
            &legend,
            &p.series.iter().map(|(m, _)| *m).collect::<Vec<_>>(),
        )
        .map_err(err)?;
        let charts = charts.split_evenly((1, 2));
        for (j, area) in charts.iter().enumerate() {
            let pick = |pt: &(f64, f64, f64)| if j == 0 { pt.1 } else { pt.2 };
            let xs = p.series.iter().flat_map(|(_, v)| v.iter().map(|pt| pt.0));
            let ys = p.series.iter().flat_map(|(_, v)| v.iter().map(pick));
            let (x0, x1) = bounds(xs);
            let (y0, y1) = bounds(ys.filter(|y| y.is_finite() && *y > 0.0));
            let mut chart = ChartBuilder::on(area)
                .caption(
                    format!(
                        "{} — {}",
                        if j == 0 { "latency" } else { "bandwidth" },
                        p.title
                    ),
                    ("sans-serif", 14),
                )
                .margin(10)
                .x_label_area_size(36)
                .y_label_area_size(64)
                .build_cartesian_2d(
                    (x0..x1).log_scale().with_key_points(log_ticks(x0, x1)),
                    (y0..y1).log_scale().with_key_points(log_ticks(y0, y1)),
                )
                .map_err(|e| err(e.to_string()))?;
            chart
                .configure_mesh()
                .x_desc(p.x_label)
                .y_desc(if j == 0 { "median µs" } else { "GB/s" })
                .x_labels(12)
                .y_labels(12)
                .x_label_formatter(&|v| short_number(*v))
                .y_label_formatter(&|v| short_number(*v))
                .label_style(("sans-serif", 12))
                .draw()
                .map_err(|e| err(e.to_string()))?;
            for (n, (_, pts)) in p.series.iter().enumerate() {
                let color = Palette99::pick(n).to_rgba();
                let line: Vec<(f64, f64)> = pts.iter().map(|pt| (pt.0, pick(pt))).collect();
                chart
                    .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
                    .map_err(|e| err(e.to_string()))?;
                chart
                    .draw_series(
                        line.into_iter()
                            .map(|pt| Circle::new(pt, 3, color.filled())),
                    )
                    .map_err(|e| err(e.to_string()))?;
            }
        }
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// Ticks for a log axis over `lo..hi`: 1, 2 and 5 times the powers of ten
/// inside it, every integer multiple when that gives fewer than three (a
/// range within one decade still shows values).
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let ticks = |mults: &[f64]| -> Vec<f64> {
        let mut out = Vec::new();
        let mut decade = 10f64.powf(lo.log10().floor());
        while decade <= hi {
            for m in mults {
                let v = decade * m;
                if v >= lo && v <= hi {
                    out.push(v);
                }
            }
            decade *= 10.0;
        }
        out
    };
    let coarse = ticks(&[1.0, 2.0, 5.0]);
    if coarse.len() >= 3 {
        return coarse;
    }
    let fine = ticks(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
    if fine.len() >= 3 {
        return fine;
    }
    // within a narrow range: its ends and middle
    vec![lo, (lo * hi).sqrt(), hi]
}

/// The methods of a row and their colours, one per line.
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    methods: &[&str],
) -> Result<(), String> {
    for (n, method) in methods.iter().enumerate() {
        let color = Palette99::pick(n).to_rgba();
        let y = 40 + 20 * n as i32;
        area.draw(&PathElement::new(
            vec![(4, y), (28, y)],
            color.stroke_width(3),
        ))
        .map_err(|e| e.to_string())?;
        area.draw_text(
            method,
            &("sans-serif", 13).into_font().color(&BLACK),
            (34, y - 7),
        )
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// An axis label: 256, 1.5, 0.02, 12000.
fn short_number(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}").trim_end_matches(".0").to_string()
    } else {
        format!("{v:.3}").trim_end_matches('0').to_string()
    }
}

/// A log axis range around the values (a decade's margin when they are all equal).
fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, 0.0f64);
    for v in values {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() || hi <= 0.0 {
        return (0.1, 10.0);
    }
    if lo == hi {
        return (lo / 2.0, hi * 2.0);
    }
    (lo / 1.3, hi * 1.3)
}

#[cfg(test)]
mod tests {
    use super::{format_rate, log_ticks};

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
