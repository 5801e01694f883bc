//! The bench's figures (`--plot DIR`), drawn from its JSON lines, so that a
//! live run and committed results (`--from-json`) give the same figures:
//!
//! * `headline.png`: every method's speed against the link's limit ("vs
//!   limit") at each grid point, a panel per scenario, with the spread of
//!   the method's samples;
//! * `<scenario>.png`: median latency against k or batch, a panel per slice
//!   of the grid (every slice: nothing is held back), with the same spread.
//!
//! Every figure carries what was measured where: kvtier's version and
//! commit, the device, the executor, the driver and the date.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

/// Colours told apart with any common colour-vision deficiency (Okabe and
/// Ito's set, its yellow swapped for a dark grey, which reads on white).
pub(crate) const PALETTE: [RGBColor; 7] = [
    RGBColor(0, 114, 178),   // blue
    RGBColor(213, 94, 0),    // vermillion
    RGBColor(0, 158, 115),   // bluish green
    RGBColor(204, 121, 167), // reddish purple
    RGBColor(230, 159, 0),   // orange
    RGBColor(86, 180, 233),  // sky blue
    RGBColor(102, 102, 102), // dark grey
];

/// Parameters that follow from the others (not a dimension of the grid);
/// a trace call's layer, requests and misses follow from the call, an
/// Engram gather's ids from its tokens, a decode step's totals, trace,
/// graph bucket, aliasing, selections and compute stand-in from its model,
/// context, batch and trace.
const DERIVED: [&str; 17] = [
    "distinct_regions",
    "unique_misses_per_request",
    "layer",
    "requests",
    "misses_total",
    "ids",
    "source",
    "bucket",
    "measured_steps",
    "calls",
    "rows_total",
    "entries_total",
    "host_rows",
    "device_buffers",
    "selections",
    "compute_stand_in_us",
    "compute_stand_in_bytes",
];

/// The most grid points a headline panel shows; beyond it parameters are
/// held at one value (said in the panel's title).
const HEADLINE_POINTS: usize = 16;

/// One measurement as the bench's JSON lines hold it.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Record {
    pub scenario: String,
    pub method: String,
    /// The grid point, derived parameters left out.
    pub point: Vec<(String, Value)>,
    pub bytes: u64,
    pub median_us: f64,
    /// The samples' first and third quartiles (written since the figures
    /// show spread; older results have none).
    pub quartiles: Option<(f64, f64)>,
    /// The p99, else the max: the spread drawn where there are no quartiles.
    pub upper_us: Option<f64>,
    pub is_limit: bool,
    pub meta: Meta,
}

/// Where and when a measurement was taken.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Meta {
    pub kvtier: String,
    pub commit: Option<String>,
    pub device: String,
    pub executor: String,
    pub driver: String,
    /// YYYY-MM-DD
    pub date: String,
}

impl Record {
    /// A record from one JSON line of `kvtier bench --json`; `commit` for
    /// lines that do not carry one (a `COMMIT` file beside them).
    pub fn parse(v: &Value, commit: Option<&str>) -> Result<Record, String> {
        let text = |k: &str| -> Result<String, String> {
            v.get(k)
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| format!("no \"{k}\" text"))
        };
        let number = |k: &str| -> Result<f64, String> {
            v.get(k)
                .and_then(Value::as_f64)
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| format!("no \"{k}\" number"))
        };
        let optional = |k: &str| v.get(k).and_then(Value::as_f64).filter(|x| x.is_finite());
        let params = v
            .get("params")
            .and_then(Value::as_object)
            .ok_or("no \"params\" object")?;
        let median_us = number("median_us")?;
        if median_us <= 0.0 {
            return Err("a median of 0 µs".into());
        }
        let quartiles = optional("q1_us").zip(optional("q3_us"));
        Ok(Record {
            scenario: text("scenario")?,
            method: text("method")?,
            point: params
                .iter()
                .filter(|(k, _)| !DERIVED.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            bytes: number("bytes")? as u64,
            median_us,
            quartiles,
            upper_us: optional("p99_us").or_else(|| optional("max_us")),
            is_limit: v
                .get("is_limit")
                .and_then(Value::as_bool)
                .ok_or("no \"is_limit\" flag")?,
            meta: Meta {
                kvtier: text("kvtier").unwrap_or_else(|_| "?".into()),
                commit: v
                    .get("commit")
                    .and_then(Value::as_str)
                    .or(commit)
                    .map(|c| c.chars().take(7).collect()),
                device: text("device")?,
                executor: text("executor")?,
                driver: text("driver").unwrap_or_else(|_| "?".into()),
                date: text("timestamp")
                    .map(|t| t.chars().take(10).collect())
                    .unwrap_or_else(|_| "?".into()),
            },
        })
    }

    pub(super) fn param(&self, key: &str) -> Option<&Value> {
        self.point.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

/// The records of JSON-lines files written by `kvtier bench --json`; a line
/// that is not one is an error naming the file and line.
pub(super) fn read(paths: &[PathBuf]) -> kvtier::Result<Vec<Record>> {
    let mut out = Vec::new();
    for path in paths {
        let bad = |msg: String| kvtier::Error::InvalidArgument {
            arg: "--from-json",
            msg,
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad(format!("cannot read {}: {e}", path.display())))?;
        // The GPU suite packs a COMMIT file beside its results.
        let commit = path
            .parent()
            .and_then(|d| std::fs::read_to_string(d.join("COMMIT")).ok())
            .map(|c| c.trim().to_string())
            .filter(|c| !c.is_empty() && c.chars().all(|ch| ch.is_ascii_hexdigit()));
        let before = out.len();
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let record = serde_json::from_str::<Value>(line)
                .map_err(|e| e.to_string())
                .and_then(|v| Record::parse(&v, commit.as_deref()))
                .map_err(|e| {
                    bad(format!(
                        "{}:{}: not a measurement of kvtier bench --json ({e})",
                        path.display(),
                        n + 1
                    ))
                })?;
            out.push(record);
        }
        if out.len() == before {
            return Err(bad(format!("{} holds no measurements", path.display())));
        }
    }
    Ok(out)
}

/// The scenarios' order in the figures; others follow in first-seen order.
const SCENARIOS: [&str; 6] = [
    "gather",
    "swap-in",
    "spec-swap-in",
    "writeback",
    "engram-gather",
    "decode-step",
];

fn scenarios(records: &[Record]) -> Vec<String> {
    let mut out: Vec<String> = SCENARIOS
        .iter()
        .filter(|s| records.iter().any(|r| r.scenario == **s))
        .map(|s| s.to_string())
        .collect();
    for r in records {
        if !out.contains(&r.scenario) {
            out.push(r.scenario.clone());
        }
    }
    out
}

/// The x axis of a scenario's detail panels.
fn x_key(r: &Record) -> &'static str {
    if r.param("call").is_some() {
        return "call";
    }
    match (
        r.scenario.as_str(),
        r.param("phase").and_then(Value::as_str),
    ) {
        ("gather", _) => "k",
        ("engram-gather", _) => "tokens",
        ("writeback", Some("prefill")) => "tokens",
        _ => "batch",
    }
}

/// Parameters a headline panel holds at one value first, while it has more
/// than [`HEADLINE_POINTS`] points.
fn hold_order(scenario: &str) -> &'static [&'static str] {
    match scenario {
        "gather" => &["entry", "indices", "context", "batch"],
        "swap-in" => &["entry", "hot", "k"],
        "spec-swap-in" => &["entry", "hot", "k", "misses"],
        "writeback" => &["entry", "layers"],
        _ => &[],
    }
}

/// A parameter's place in labels: the grid's order, not the alphabet's.
fn key_rank(key: &str) -> usize {
    const ORDER: [&str; 15] = [
        "trace",
        "path",
        "phase",
        "entry",
        "context",
        "indices",
        "hot",
        "k",
        "block_tokens",
        "steps",
        "misses",
        "layers",
        "tokens",
        "batch",
        "call",
    ];
    ORDER.iter().position(|k| *k == key).unwrap_or(ORDER.len())
}

fn ordered(point: &[(String, Value)]) -> Vec<(String, Value)> {
    let mut p = point.to_vec();
    p.sort_by(|a, b| key_rank(&a.0).cmp(&key_rank(&b.0)).then(a.0.cmp(&b.0)));
    p
}

/// Compares grid points the way people read them (numbers as numbers).
fn cmp_points(a: &[(String, Value)], b: &[(String, Value)]) -> std::cmp::Ordering {
    for ((ka, va), (kb, vb)) in ordered(a).iter().zip(ordered(b).iter()) {
        let o = ka.cmp(kb).then_with(|| match (va.as_f64(), vb.as_f64()) {
            (Some(x), Some(y)) => x.total_cmp(&y),
            _ => va.to_string().cmp(&vb.to_string()),
        });
        if o.is_ne() {
            return o;
        }
    }
    a.len().cmp(&b.len())
}

/// A parameter's value in words: "656 B", "128K", "uniform".
fn value_text(key: &str, v: &Value) -> String {
    match (key, v.as_u64()) {
        ("entry", Some(b)) => format!("{b} B"),
        ("context", Some(t)) if t % 1024 == 0 => format!("{}K", t / 1024),
        _ => v
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| v.to_string()),
    }
}

fn describe(point: &[(String, Value)]) -> String {
    ordered(point)
        .iter()
        .map(|(k, v)| format!("{k} {}", value_text(k, v)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A grid point on a headline axis: "b8 k2048", "hot4096 m2 b1".
fn short_label(point: &[(String, Value)]) -> String {
    ordered(point)
        .iter()
        .map(|(k, v)| {
            let short = match k.as_str() {
                "batch" => "b",
                "misses" => "m",
                "steps" => "s",
                "tokens" => "t",
                "context" => "ctx",
                "hot" => "h",
                "block_tokens" => "×",
                "entry" | "phase" | "indices" | "path" => "",
                other => other,
            };
            let value = match (k.as_str(), v.as_str()) {
                (_, Some(s)) => s.to_string(),
                ("entry", None) => format!("{}B", v),
                _ => value_text(k, v),
            };
            format!("{short}{value}")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The abbreviations a headline panel's labels use.
fn label_key(keys: &BTreeSet<String>) -> String {
    [
        ("batch", "b = batch"),
        ("k", "k = top-k"),
        ("misses", "m = misses per request"),
        ("steps", "s = draft steps"),
        ("tokens", "t = tokens"),
        ("hot", "h = HOT slots"),
        ("context", "ctx = context"),
    ]
    .iter()
    .filter(|(k, _)| keys.contains(*k))
    .map(|(_, t)| *t)
    .collect::<Vec<_>>()
    .join(", ")
}

/// A headline panel's points: every distinct point of the scenario, with
/// parameters held at their most measured value (ties: the first seen),
/// in [`hold_order`], until at most [`HEADLINE_POINTS`] remain.
pub(super) struct Slice {
    /// (parameter, value) held, in the order they were held.
    pub held: Vec<(String, Value)>,
    /// Parameters with one value at every point shown (in the title, not
    /// the labels).
    pub constant: Vec<(String, Value)>,
    /// The points shown, sorted, with neither held nor constant parameters.
    pub points: Vec<Vec<(String, Value)>>,
}

pub(super) fn headline_slice(records: &[&Record]) -> Slice {
    let Some(first) = records.first() else {
        return Slice {
            held: Vec::new(),
            constant: Vec::new(),
            points: Vec::new(),
        };
    };
    let mut held: Vec<(String, Value)> = Vec::new();
    let keep =
        |r: &&Record, held: &[(String, Value)]| held.iter().all(|(k, v)| r.param(k) == Some(v));
    let distinct = |held: &[(String, Value)]| {
        let mut pts: Vec<Vec<(String, Value)>> = Vec::new();
        for r in records.iter().filter(|r| keep(r, held)) {
            let p: Vec<(String, Value)> = r
                .point
                .iter()
                .filter(|(k, _)| !held.iter().any(|(h, _)| h == k))
                .cloned()
                .collect();
            if !pts.contains(&p) {
                pts.push(p);
            }
        }
        pts
    };
    let mut candidates: Vec<String> = hold_order(&first.scenario)
        .iter()
        .map(|s| s.to_string())
        .collect();
    // Then anything else that varies, but never the x axis of the detail panels.
    for r in records {
        for (k, _) in &r.point {
            if !candidates.contains(k) && k != x_key(r) {
                candidates.push(k.clone());
            }
        }
    }
    for key in candidates {
        if distinct(&held).len() <= HEADLINE_POINTS {
            break;
        }
        // The value with the most records among those still shown.
        let mut counts: Vec<(Value, usize)> = Vec::new();
        for r in records.iter().filter(|r| keep(r, &held)) {
            if let Some(v) = r.param(&key) {
                match counts.iter_mut().find(|(c, _)| c == v) {
                    Some((_, n)) => *n += 1,
                    None => counts.push((v.clone(), 1)),
                }
            }
        }
        if counts.len() < 2 {
            continue;
        }
        let best = counts
            .iter()
            .fold(None::<&(Value, usize)>, |b, c| match b {
                Some(b) if b.1 >= c.1 => Some(b),
                _ => Some(c),
            })
            .map(|c| c.0.clone());
        if let Some(v) = best {
            held.push((key, v));
        }
    }
    let mut points = distinct(&held);
    let constant: Vec<(String, Value)> = match points.first() {
        Some(p) if points.len() > 1 => p
            .iter()
            .filter(|kv| points.iter().all(|q| q.contains(kv)))
            .cloned()
            .collect(),
        _ => Vec::new(),
    };
    for p in &mut points {
        p.retain(|kv| !constant.contains(kv));
    }
    points.sort_by(|a, b| cmp_points(a, b));
    Slice {
        held,
        constant,
        points,
    }
}

/// A method's "vs limit" at a point: the limit's median over the method's
/// median, and the spread of the method's samples against the limit's
/// median: its quartiles where recorded, else median to p99 (or max).
pub(super) fn vs_limit(limit: &Record, m: &Record) -> Option<(f64, f64, f64)> {
    if limit.bytes == 0 || m.bytes == 0 {
        return None;
    }
    let l = limit.median_us;
    let mid = l / m.median_us;
    let (lo, hi) = match (m.quartiles, m.upper_us) {
        (Some((q1, q3)), _) if q1 > 0.0 && q3 > 0.0 => (l / q3, l / q1),
        (None, Some(up)) if up > 0.0 => (l / up, mid),
        _ => (mid, mid),
    };
    Some((lo.min(mid), mid, hi.max(mid)))
}

/// How the figures' whiskers were computed, in words.
fn spread_words(records: &[Record]) -> &'static str {
    let with = records.iter().filter(|r| r.quartiles.is_some()).count();
    if with == records.len() {
        "whiskers: the interquartile range of each method's samples (q1 to q3)"
    } else if with == 0 {
        "whiskers: each method's median to its p99 (its max below 100 samples); these results \
         carry no quartiles"
    } else {
        "whiskers: the interquartile range of each method's samples, or median to p99 where the \
         results carry no quartiles"
    }
}

/// "kvtier 0.1.0 at 02fd26c · NVIDIA H100 … · CUDA executor, driver CUDA 13.0 · 2026-11-25".
pub(super) fn meta_line(records: &[Record]) -> String {
    let set = |f: &dyn Fn(&Meta) -> String| {
        let s: BTreeSet<String> = records.iter().map(|r| f(&r.meta)).collect();
        s.into_iter().collect::<Vec<_>>().join(" + ")
    };
    let commit = set(&|m| {
        m.commit
            .clone()
            .unwrap_or_else(|| "commit not recorded".into())
    });
    format!(
        "kvtier {} ({}) · {} · {} executor, driver {} · measured {}",
        set(&|m| m.kvtier.clone()),
        commit,
        set(&|m| m.device.clone()),
        set(&|m| m.executor.to_uppercase()),
        set(&|m| m.driver.clone()),
        set(&|m| m.date.clone()),
    )
}

/// A method's colour and marker in every figure of a scenario: the limit in
/// black, the others in the palette, in first-seen order.
struct Styles {
    methods: Vec<(String, bool)>,
}

#[derive(Clone, Copy)]
enum Marker {
    Circle,
    Triangle,
    Square,
    Cross,
}

impl Styles {
    fn of(records: &[&Record]) -> Self {
        let mut methods: Vec<(String, bool)> = Vec::new();
        for r in records {
            if !methods.iter().any(|(m, _)| *m == r.method) {
                methods.push((r.method.clone(), r.is_limit));
            }
        }
        // The limit last: it is the reference, not a contender.
        methods.sort_by_key(|(_, limit)| *limit);
        Styles { methods }
    }

    fn style(&self, method: &str) -> (RGBColor, Marker) {
        const MARKERS: [Marker; 4] = [
            Marker::Circle,
            Marker::Triangle,
            Marker::Square,
            Marker::Cross,
        ];
        let n = self
            .methods
            .iter()
            .filter(|(_, l)| !l)
            .position(|(m, _)| m == method);
        match n {
            Some(n) => (PALETTE[n % PALETTE.len()], MARKERS[n % MARKERS.len()]),
            None => (BLACK, Marker::Square),
        }
    }
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// Draws a marker at a point of a chart (its size in pixels).
macro_rules! chart_marker {
    ($chart:expr, $at:expr, $marker:expr, $color:expr) => {{
        let (at, color) = ($at, $color);
        match $marker {
            Marker::Circle => $chart
                .draw_series(std::iter::once(Circle::new(at, 5, color.filled())))
                .map(|_| ()),
            Marker::Triangle => $chart
                .draw_series(std::iter::once(TriangleMarker::new(at, 6, color.filled())))
                .map(|_| ()),
            Marker::Square => $chart
                .draw_series(std::iter::once(
                    EmptyElement::at(at) + Rectangle::new([(-4, -4), (4, 4)], color.filled()),
                ))
                .map(|_| ()),
            Marker::Cross => $chart
                .draw_series(std::iter::once(Cross::new(at, 5, color.stroke_width(2))))
                .map(|_| ()),
        }
        .map_err(|e| e.to_string())
    }};
}

/// How wide `text` is in the legend's font.
fn text_width(text: &str) -> Result<u32, String> {
    ("sans-serif", 15)
        .into_font()
        .box_size(text)
        .map(|(w, _)| w)
        .map_err(|e| format!("{e:?}"))
}

fn marker<'a, DB: DrawingBackend + 'a>(
    at: (i32, i32),
    m: Marker,
    color: RGBColor,
    area: &DrawingArea<DB, Shift>,
) -> Result<(), String> {
    let style = color.filled();
    let r = match m {
        Marker::Circle => area.draw(&Circle::new(at, 5, style)),
        Marker::Triangle => area.draw(&TriangleMarker::new(at, 6, style)),
        Marker::Square => area.draw(&Rectangle::new(
            [(at.0 - 4, at.1 - 4), (at.0 + 4, at.1 + 4)],
            style,
        )),
        Marker::Cross => area.draw(&Cross::new(at, 5, color.stroke_width(2))),
    };
    r.map_err(|e| e.to_string())
}

/// The legend of `styles` in rows across `area`'s width, each entry as wide
/// as its text (nothing clipped); returns the height used.
/// How the limit is named in a detail figure's legend, and in the headline's.
const REFERENCE: &str = " (the reference)";
const AT_ONE: &str = ": the dashed line at 1";

/// A legend's entries placed in rows across `w` pixels, each as wide as
/// its text (nothing clipped): (method, text, x, row), and the rows.
struct Legend {
    entries: Vec<(String, String, i32, u32)>,
    rows: u32,
}

impl Legend {
    fn layout(w: u32, styles: &Styles, limit_note: &str) -> Result<Legend, String> {
        let (mut x, mut row) = (16i32, 0u32);
        let mut entries = Vec::new();
        for (method, limit) in &styles.methods {
            let text = if *limit {
                format!("{method}{limit_note}")
            } else {
                method.clone()
            };
            let width = 34 + text_width(&text)? as i32 + 26;
            if x + width > w as i32 - 8 && x > 16 {
                x = 16;
                row += 1;
            }
            entries.push((method.clone(), text, x, row));
            x += width;
        }
        Ok(Legend {
            entries,
            rows: row + 1,
        })
    }

    /// Pixels the legend takes.
    fn height(&self) -> u32 {
        self.rows * 22 + 4
    }

    /// Draws the legend on `area` from `top` down.
    fn draw(&self, area: &Area, styles: &Styles, top: i32) -> Result<(), String> {
        let font = ("sans-serif", 15).into_font().color(&BLACK);
        for (method, text, x, row) in &self.entries {
            let (x, y) = (*x, top + 22 * *row as i32);
            let (color, m) = styles.style(method);
            area.draw(&PathElement::new(
                vec![(x, y + 8), (x + 26, y + 8)],
                color.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?;
            marker((x + 13, y + 8), m, color, area)?;
            area.draw_text(text, &font, (x + 34, y))
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

fn header(area: &Area, lines: &[(String, u32)]) -> Result<(), String> {
    let mut y = 10;
    for (text, size) in lines {
        area.draw_text(
            text,
            &("sans-serif", *size as i32).into_font().color(&BLACK),
            (16, y),
        )
        .map_err(|e| e.to_string())?;
        y += *size as i32 + 8;
    }
    Ok(())
}

/// A log axis's range around `values`, with room for the markers.
fn log_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, 0.0f64);
    for v in values.filter(|v| v.is_finite() && *v > 0.0) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.1, 10.0);
    }
    if hi / lo < 1.5 {
        let mid = (lo * hi).sqrt();
        return (mid / 2.0, mid * 2.0);
    }
    (lo / 1.4, hi * 1.4)
}

/// Ticks for a log axis over `lo..hi`: 1, 2 and 5 times the powers of ten
/// inside it, every integer multiple when that gives fewer than three (a
/// range within one decade still shows values).
pub(super) fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
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
    vec![lo, (lo * hi).sqrt(), hi]
}

/// An axis label: 256, 1.5, 0.02, 12000.
fn short_number(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}").trim_end_matches(".0").to_string()
    } else if v >= 0.001 {
        let s = format!("{v:.4}");
        s.trim_end_matches('0').to_string()
    } else {
        // 5e-5, 2.5e-4: fixed decimals would print two ticks alike
        let s = format!("{v:.1e}");
        s.replace(".0e", "e")
    }
}

/// Draws every figure of `records` into `dir` (made if missing); returns
/// the files written, the headline first.
pub(super) fn draw_all(dir: &Path, records: &[Record]) -> kvtier::Result<Vec<PathBuf>> {
    if records.is_empty() {
        return Err(kvtier::Error::InvalidArgument {
            arg: "--plot",
            msg: "nothing was measured".into(),
        });
    }
    std::fs::create_dir_all(dir).map_err(|source| kvtier::Error::Io {
        context: format!("making the figures' folder {}", dir.display()),
        source,
    })?;
    // a decode step's figures show each trace's steps in all, not step by step
    let all_steps: Vec<Record> = records
        .iter()
        .filter(|r| {
            r.scenario != "decode-step" || r.param("step").and_then(Value::as_str) == Some("all")
        })
        .cloned()
        .collect();
    let records = &all_steps[..];
    let mut written = Vec::new();
    let path = dir.join("headline.png");
    headline(&path, records).map_err(|e| drawing(&path, e))?;
    written.push(path);
    for s in scenarios(records) {
        let path = dir.join(format!("{s}.png"));
        let rs: Vec<&Record> = records.iter().filter(|r| r.scenario == s).collect();
        detail(&path, &s, &rs).map_err(|e| drawing(&path, e))?;
        written.push(path);
    }
    Ok(written)
}

fn drawing(path: &Path, e: String) -> kvtier::Error {
    kvtier::Error::Io {
        context: format!("drawing {}", path.display()),
        source: std::io::Error::other(e),
    }
}

/// The headline: a panel per scenario, "vs limit" on a log axis against the
/// grid points, each method a marker at its median with whiskers.
fn headline(path: &Path, records: &[Record]) -> Result<(), String> {
    let scenarios = scenarios(records);
    let cpu = records.iter().any(|r| r.meta.executor == "cpu");
    let (w, head, panel_h) = (1800u32, 140u32, 470u32);
    let root =
        BitMapBackend::new(path, (w, head + panel_h * scenarios.len() as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (top, body) = root.split_vertically(head);
    let limit_words = if cpu {
        "the limit is one host memcpy of the same bytes (CPU executor: CPU figures, not GPU figures)"
    } else {
        "the limit is one contiguous copy of the same bytes over the GPU's host link"
    };
    header(
        &top,
        &[
            (
                "kvtier bench — each method's speed against a reference (the reference's median time \
                 / the method's; 1 = as fast, higher is better)"
                    .into(),
                20,
            ),
            (meta_line(records), 16),
            (
                format!(
                    "the reference: the link's limit (vs limit), or SGLang's own kernel where it was \
                     timed (vs SGLang's kernel); {limit_words}"
                ),
                15,
            ),
            (
                format!("markers: medians; {}", spread_words(records)),
                15,
            ),
        ],
    )?;
    let panels = body.split_evenly((scenarios.len(), 1));
    for (s, area) in scenarios.iter().zip(&panels) {
        let rs: Vec<&Record> = records.iter().filter(|r| &r.scenario == s).collect();
        // Where SGLang's own kernel was timed beside kvtier's, the panel is
        // kvtier against it (its median over each method's), the link's
        // limit one more marker: what a user choosing between the two asks.
        if rs.iter().any(|r| is_sglang(r)) {
            let against: Vec<Record> = rs
                .iter()
                .map(|r| Record {
                    is_limit: is_sglang(r),
                    ..(*r).clone()
                })
                .collect();
            let against: Vec<&Record> = against.iter().collect();
            headline_panel(area, s, &against, "vs SGLang's kernel")?;
        } else {
            headline_panel(area, s, &rs, "vs limit")?;
        }
    }
    root.present().map_err(|e| e.to_string())
}

/// Whether a record is SGLang's own kernel's.
fn is_sglang(r: &Record) -> bool {
    r.method.starts_with("SGLang ")
}

/// A headline panel: each method's speed against the reference (the
/// records marked `is_limit`), `versus` naming it ("vs limit").
fn headline_panel(area: &Area, scenario: &str, rs: &[&Record], versus: &str) -> Result<(), String> {
    let slice = headline_slice(rs);
    let styles = Styles::of(rs);
    let contenders: Vec<&str> = styles
        .methods
        .iter()
        .filter(|(_, l)| !l)
        .map(|(m, _)| m.as_str())
        .collect();
    // (point index, method index, lo, mid, hi)
    let mut marks: Vec<(usize, usize, (f64, f64, f64))> = Vec::new();
    let in_slice = |r: &Record, p: &[(String, Value)]| {
        let fixed = slice.held.iter().chain(&slice.constant);
        fixed.clone().all(|(k, v)| r.param(k) == Some(v))
            && p.iter().all(|(k, v)| r.param(k) == Some(v))
            && r.point.len() == p.len() + fixed.count()
    };
    for (i, p) in slice.points.iter().enumerate() {
        let Some(limit) = rs.iter().find(|r| r.is_limit && in_slice(r, p)) else {
            continue;
        };
        for (j, m) in contenders.iter().enumerate() {
            if let Some(r) = rs.iter().find(|r| r.method == *m && in_slice(r, p))
                && let Some(v) = vs_limit(limit, r)
            {
                marks.push((i, j, v));
            }
        }
    }
    let keys: BTreeSet<String> = slice
        .points
        .iter()
        .flat_map(|p| p.iter().map(|(k, _)| k.clone()))
        .collect();
    let mut title = format!("{scenario}: {versus} at each grid point");
    let fixed: Vec<(String, Value)> = slice.held.iter().chain(&slice.constant).cloned().collect();
    if !fixed.is_empty() {
        title += &format!("; {} at every point shown", describe(&fixed));
    }
    if !slice.held.is_empty() {
        title += &format!(" (all points: {scenario}.png)");
    }
    let key = label_key(&keys);
    if !key.is_empty() {
        title += &format!(" — {key}");
    }
    let legend = Legend::layout(area.dim_in_pixel().0, &styles, AT_ONE)?;
    let legend_h = legend.height();
    let (legend_area, chart) = area.split_vertically(legend_h + 8);
    legend.draw(&legend_area, &styles, 4)?;
    if marks.is_empty() {
        chart
            .draw_text(
                "no point of this scenario moves bytes against a limit",
                &("sans-serif", 16).into_font().color(&BLACK),
                (40, 40),
            )
            .map_err(|e| e.to_string())?;
        return Ok(());
    }
    let n = slice.points.len();
    let (y0, y1) = log_range(marks.iter().flat_map(|m| [m.2.0, m.2.2]).chain([1.0]));
    let labels: Vec<String> = slice.points.iter().map(|p| short_label(p)).collect();
    let mut c = ChartBuilder::on(&chart)
        .caption(title, ("sans-serif", 16))
        .margin(12)
        .margin_right(24)
        .x_label_area_size(34)
        .y_label_area_size(70)
        .build_cartesian_2d(
            // f64 ticks fall on the integers at one label per point.
            -0.5f64..n as f64 - 0.5,
            (y0..y1).log_scale().with_key_points(log_ticks(y0, y1)),
        )
        .map_err(|e| e.to_string())?;
    c.configure_mesh()
        .disable_x_mesh()
        .x_labels(n + 1)
        .x_label_formatter(&|v| {
            let i = v.round();
            if (v - i).abs() < 1e-6 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|v| short_number(*v))
        .y_desc(format!("{versus} (log)"))
        .label_style(("sans-serif", 12))
        .axis_desc_style(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())?;
    // The limit itself.
    c.draw_series(DashedLineSeries::new(
        [(-0.5, 1.0), (n as f64 - 0.5, 1.0)],
        8,
        6,
        BLACK.stroke_width(1),
    ))
    .map_err(|e| e.to_string())?;
    let width = 0.8 / contenders.len().max(1) as f64;
    for (i, j, (lo, mid, hi)) in marks {
        let x = i as f64 - 0.4 + width * (j as f64 + 0.5);
        let (color, m) = styles.style(contenders[j]);
        c.draw_series(std::iter::once(PathElement::new(
            vec![(x, lo), (x, hi)],
            color.stroke_width(2),
        )))
        .map_err(|e| e.to_string())?;
        chart_marker!(c, (x, mid), m, color)?;
    }
    Ok(())
}

/// A scenario's detail figure: median latency (log) against its x
/// parameter, a panel per slice of the rest of the grid.
fn detail(path: &Path, scenario: &str, rs: &[&Record]) -> Result<(), String> {
    let styles = Styles::of(rs);
    // Panels: every distinct point without its x parameter.
    let mut facets: Vec<Vec<(String, Value)>> = Vec::new();
    for r in rs {
        let x = x_key(r);
        let f: Vec<(String, Value)> = r.point.iter().filter(|(k, _)| k != x).cloned().collect();
        if !facets.contains(&f) {
            facets.push(f);
        }
    }
    facets.sort_by(|a, b| cmp_points(a, b));
    let cols = facets.len().clamp(1, 3) as u32;
    let rows = (facets.len() as u32).div_ceil(cols);
    let (w, panel_h) = (1800u32, 400u32);
    let sub: Vec<Record> = rs.iter().map(|r| (*r).clone()).collect();
    let legend = Legend::layout(w, &styles, REFERENCE)?;
    let legend_h = legend.height();
    let head = 96 + legend_h;
    let root = BitMapBackend::new(path, (w, head + rows * panel_h)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (top, body) = root.split_vertically(head);
    header(
        &top,
        &[
            (
                format!(
                    "kvtier bench — {scenario}: median latency {} against {}, one panel per \
                     slice of the grid (log axes)",
                    if scenario == "decode-step" {
                        "of a trace's measured decode steps, every swap-in of each (their medians summed)"
                    } else {
                        "per call"
                    },
                    if scenario == "writeback" {
                        "batch (decode) or tokens (prefill)".to_string()
                    } else {
                        rs.first().map(|r| x_key(r)).unwrap_or("batch").to_string()
                    }
                ),
                20,
            ),
            (meta_line(&sub), 16),
            (format!("markers: medians; {}", spread_words(&sub)), 15),
        ],
    )?;
    legend.draw(&top, &styles, 92)?;
    let areas = body.split_evenly((rows as usize, cols as usize));
    for (f, area) in facets.iter().zip(&areas) {
        let in_facet = |r: &&&Record| {
            let x = x_key(r);
            r.point.len() == f.len() + 1
                && f.iter().all(|(k, v)| r.param(k) == Some(v))
                && r.param(x).is_some()
        };
        let members: Vec<&&Record> = rs.iter().filter(in_facet).collect();
        let Some(first) = members.first() else {
            continue;
        };
        let xk = x_key(first);
        let xs: Vec<f64> = {
            let mut v: Vec<f64> = members
                .iter()
                .filter_map(|r| r.param(xk).and_then(Value::as_f64))
                .collect();
            v.sort_by(f64::total_cmp);
            v.dedup();
            v
        };
        let spread = |r: &Record| match (r.quartiles, r.upper_us) {
            (Some((q1, q3)), _) => (q1.min(r.median_us), q3.max(r.median_us)),
            (None, Some(up)) => (r.median_us, up.max(r.median_us)),
            _ => (r.median_us, r.median_us),
        };
        let (x0, x1) = log_range(xs.iter().copied());
        let (y0, y1) = log_range(members.iter().flat_map(|r| {
            let (lo, hi) = spread(r);
            [lo, hi]
        }));
        let mut c = ChartBuilder::on(area)
            .caption(describe(f), ("sans-serif", 15))
            .margin(10)
            .margin_right(20)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(
                (x0..x1).log_scale().with_key_points(xs.clone()),
                (y0..y1).log_scale().with_key_points(log_ticks(y0, y1)),
            )
            .map_err(|e| e.to_string())?;
        c.configure_mesh()
            .x_desc(xk)
            .y_desc("median µs")
            .x_label_formatter(&|v| short_number(*v))
            .y_label_formatter(&|v| short_number(*v))
            .label_style(("sans-serif", 12))
            .axis_desc_style(("sans-serif", 13))
            .draw()
            .map_err(|e| e.to_string())?;
        for (method, limit) in &styles.methods {
            let (color, m) = styles.style(method);
            let mut pts: Vec<(f64, &Record)> = members
                .iter()
                .filter(|r| &r.method == method)
                .filter_map(|r| r.param(xk).and_then(Value::as_f64).map(|x| (x, **r)))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            let line: Vec<(f64, f64)> = pts.iter().map(|(x, r)| (*x, r.median_us)).collect();
            if *limit {
                c.draw_series(DashedLineSeries::new(line, 6, 4, color.stroke_width(2)))
                    .map_err(|e| e.to_string())?;
            } else {
                c.draw_series(LineSeries::new(line, color.stroke_width(2)))
                    .map_err(|e| e.to_string())?;
            }
            for (x, r) in &pts {
                let (lo, hi) = spread(r);
                c.draw_series(std::iter::once(PathElement::new(
                    vec![(*x, lo), (*x, hi)],
                    color.stroke_width(1),
                )))
                .map_err(|e| e.to_string())?;
                chart_marker!(c, (*x, r.median_us), m, color)?;
            }
        }
    }
    root.present().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn line(method: &str, limit: bool, params: Value, median: f64) -> Value {
        json!({
            "scenario": "swap-in", "method": method, "is_limit": limit, "params": params,
            "bytes": 1000, "median_us": median, "q1_us": median * 0.9, "q3_us": median * 1.2,
            "p99_us": null, "max_us": median * 2.0, "device": "CPU: test", "executor": "cpu",
            "driver": "none", "kvtier": "0.1.0", "timestamp": "2026-11-25T10:00:00Z",
        })
    }

    #[test]
    fn a_record_reads_what_the_bench_writes_and_names_what_is_missing() {
        let v = line(
            "kvtier",
            false,
            json!({"batch": 1, "distinct_regions": 1}),
            10.0,
        );
        let r = Record::parse(&v, Some("0123456789abcdef")).unwrap();
        // derived parameters are not a dimension of the grid
        assert_eq!(r.point, vec![("batch".to_string(), json!(1))]);
        assert_eq!(r.quartiles, Some((9.0, 12.0)));
        assert_eq!(r.upper_us, Some(20.0));
        assert_eq!(r.meta.commit.as_deref(), Some("0123456"));
        assert_eq!(r.meta.date, "2026-11-25");
        let mut no_median = v.clone();
        no_median.as_object_mut().unwrap().remove("median_us");
        assert!(
            Record::parse(&no_median, None)
                .unwrap_err()
                .contains("median_us")
        );
        let mut zero = v.clone();
        zero["median_us"] = json!(0.0);
        assert!(Record::parse(&zero, None).is_err());
        // results from before the quartiles: the p99 or max is the spread
        let mut old = v;
        old.as_object_mut().unwrap().remove("q1_us");
        assert_eq!(Record::parse(&old, None).unwrap().quartiles, None);
    }

    #[test]
    fn vs_limit_is_the_limits_median_over_the_methods_with_its_spread() {
        let p = json!({"batch": 1});
        let limit = Record::parse(&line("copy", true, p.clone(), 5.0), None).unwrap();
        let m = Record::parse(&line("kvtier", false, p.clone(), 10.0), None).unwrap();
        // quartiles 9 and 12 µs against the limit's 5 µs median
        let (lo, mid, hi) = vs_limit(&limit, &m).unwrap();
        assert!((mid - 0.5).abs() < 1e-12);
        assert!((lo - 5.0 / 12.0).abs() < 1e-12 && (hi - 5.0 / 9.0).abs() < 1e-12);
        let mut old = m.clone();
        old.quartiles = None;
        let (lo, mid2, hi) = vs_limit(&limit, &old).unwrap();
        assert!((lo - 0.25).abs() < 1e-12 && hi == mid2);
        let mut nothing = m;
        nothing.bytes = 0;
        assert_eq!(vs_limit(&limit, &nothing), None);
    }

    #[test]
    fn the_headline_holds_parameters_at_their_most_measured_value_until_few_points_remain() {
        // entry 512 at 3 batches, entry 656 at 4, each at 2 hot sizes x 2 miss
        // counts: 28 points, too many for a panel
        let mut rs = Vec::new();
        for (entry, batches) in [(512, vec![1, 10, 100]), (656, vec![1, 10, 100, 256])] {
            for hot in [4096, 8192] {
                for misses in [2, 410] {
                    for &b in &batches {
                        let p = json!({"entry": entry, "hot": hot, "k": 2048, "misses": misses, "batch": b});
                        rs.push(Record::parse(&line("kvtier", false, p, 10.0), None).unwrap());
                    }
                }
            }
        }
        let refs: Vec<&Record> = rs.iter().collect();
        let s = headline_slice(&refs);
        // the entry size with the most points (656 B) is held; 16 remain
        assert_eq!(s.held, vec![("entry".to_string(), json!(656))]);
        assert_eq!(s.constant, vec![("k".to_string(), json!(2048))]);
        assert_eq!(s.points.len(), 16);
        // sorted as read: hot, misses, then batch numerically (1 < 10 < 100 < 256)
        let labels: Vec<String> = s.points.iter().map(|p| short_label(p)).collect();
        assert_eq!(
            labels[..4],
            [
                "h4096 m2 b1",
                "h4096 m2 b10",
                "h4096 m2 b100",
                "h4096 m2 b256"
            ]
        );
        assert_eq!(labels[15], "h8192 m410 b256");
        // few enough: nothing held
        let small: Vec<&Record> = rs
            .iter()
            .filter(|r| r.param("entry") == Some(&json!(512)))
            .collect();
        let s = headline_slice(&small);
        assert!(s.held.is_empty() && s.points.len() == 12);
    }

    #[test]
    fn axis_numbers_stay_distinct_down_to_tiny_ratios() {
        let shown: Vec<String> = [256.0, 1.5, 0.02, 0.0002, 0.0001, 0.00005, 0.00025]
            .iter()
            .map(|v| short_number(*v))
            .collect();
        assert_eq!(
            shown,
            ["256", "1.5", "0.02", "2e-4", "1e-4", "5e-5", "2.5e-4"]
        );
    }

    #[test]
    fn the_metadata_line_names_version_commit_device_executor_and_date() {
        let mut r = Record::parse(&line("kvtier", false, json!({"batch": 1}), 10.0), None).unwrap();
        assert_eq!(
            meta_line(std::slice::from_ref(&r)),
            "kvtier 0.1.0 (commit not recorded) · CPU: test · CPU executor, driver none · measured 2026-11-25"
        );
        r.meta.commit = Some("02fd26c".into());
        assert!(meta_line(&[r]).starts_with("kvtier 0.1.0 (02fd26c) · "));
    }
}
