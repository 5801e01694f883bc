//! `kvtier bench --from-json FILES --swap-in-report`: where a run's swap-in
//! rows leave the swap-in's goals, by the rule the project decides by: one
//! method is clearly faster than another at a point where the interquartile
//! ranges of their samples are apart. Read from committed or fresh JSON
//! lines, so that a GPU run's verdict is a command, not an afternoon:
//!
//! - the default ([`SwapInChoice::default_for`] the run's GPU and each
//!   point's batch: its build's row where the run timed it; the plain
//!   build's row of its strategy and copy method where the bench left the
//!   build out, as the
//!   launcher falls back, and everywhere in a run that never timed the
//!   build, which the report then says; where the few-miss planner's state
//!   does not fit a block the library takes `FewMiss` instead, which the
//!   report cannot know) against SGLang's kernel at every point that timed
//!   it:
//!   the median of SGLang's time over the default's, and where it is
//!   clearly faster or slower;
//! - every other kvtier row against the default at the same points, and
//!   where it is clearly behind SGLang's kernel (a build may become the
//!   default where it is clearly ahead of it and behind SGLang nowhere);
//! - the latency-bound regime (2 misses a row): the default's and the best
//!   row's speed against SGLang's kernel;
//! - the link-bound regime (at least 100 misses a row and 4 MB a call): the
//!   default's, the best row's and SGLang's share of the link (the limit
//!   row's time over theirs, for the same bytes).

use std::collections::BTreeMap;
use std::fmt::Write;

use kvtier::{CopyMethod, PlannerBuild, SwapInChoice, SwapInStrategy};

use super::figures::Record;
use super::swap_in::{
    FEW_MISS_ROW, LIMIT_ROW, ONE_LAUNCH_FIXED_LINES_ROW, ONE_LAUNCH_FIXED_ROW,
    ONE_LAUNCH_LINES_ROW, ONE_LAUNCH_ROW, SGLANG_ROW, SPLIT_ROW,
};

/// The bench's rows of a choice the default may be: its build's row (None
/// for the plain build) and the plain build's row of its strategy and copy
/// method, the launcher's fallback.
fn default_rows(c: SwapInChoice) -> Option<(Option<&'static str>, &'static str)> {
    use CopyMethod::{LineAligned, WarpVectors};
    use SwapInStrategy::{FewMiss, FewMissOneLaunch};
    let plain = match (c.strategy, c.copy) {
        (FewMiss, WarpVectors) => FEW_MISS_ROW,
        (FewMissOneLaunch, WarpVectors) => ONE_LAUNCH_ROW,
        (FewMissOneLaunch, LineAligned) => ONE_LAUNCH_LINES_ROW,
        _ => return None,
    };
    let build = match (c.build, c.strategy, c.copy) {
        (PlannerBuild::Plain, _, _) => None,
        (PlannerBuild::Split, FewMiss, WarpVectors) => Some(SPLIT_ROW),
        (PlannerBuild::FixedShape, FewMissOneLaunch, WarpVectors) => Some(ONE_LAUNCH_FIXED_ROW),
        (PlannerBuild::FixedShape, FewMissOneLaunch, LineAligned) => {
            Some(ONE_LAUNCH_FIXED_LINES_ROW)
        }
        _ => return None,
    };
    Some((build, plain))
}

/// -1, 0 or 1: `a` clearly slower than `b`, level, clearly faster (their
/// samples' quartile ranges apart; level where either has none).
fn apart(a: &Record, b: &Record) -> i32 {
    match (a.quartiles, b.quartiles) {
        (Some((_, a3)), Some((b1, _))) if a3 < b1 => 1,
        (Some((a1, _)), Some((_, b3))) if a1 > b3 => -1,
        _ => 0,
    }
}

/// "sm_90" in a device's name as 90.
fn arch_of(device: &str) -> Option<u32> {
    let at = device.find("(sm_")? + 4;
    device[at..].split(')').next()?.parse().ok()
}

fn param(r: &Record, key: &str) -> Option<u64> {
    r.point.iter().find(|(k, _)| k == key)?.1.as_u64()
}

fn point_label(r: &Record) -> String {
    r.point
        .iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => format!("{k} {s}"),
            v => format!("{k} {v}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The fastest kvtier swap-in row of a point (the default's is one).
fn best<'a>(rows: &BTreeMap<&'a str, &'a Record>) -> (&'a str, &'a Record) {
    rows.iter()
        .filter(|(m, _)| m.starts_with("kvtier swap-in"))
        .min_by(|a, b| a.1.median_us.total_cmp(&b.1.median_us))
        .map(|(m, r)| (*m, *r))
        .expect("the default's row is a kvtier row")
}

/// The report of every run (device, commit) among `records` with swap-in
/// rows timed beside SGLang's kernel.
pub(super) fn report(records: &[Record]) -> kvtier::Result<String> {
    // run -> point -> method -> record
    type Points<'a> = BTreeMap<String, BTreeMap<&'a str, &'a Record>>;
    let mut runs: BTreeMap<(String, String), Points> = BTreeMap::new();
    for r in records.iter().filter(|r| r.scenario == "swap-in") {
        let run = (
            r.meta.device.clone(),
            r.meta
                .commit
                .clone()
                .unwrap_or_else(|| "(no commit)".into()),
        );
        let point = point_label(r);
        let rows = runs
            .entry(run)
            .or_default()
            .entry(point.clone())
            .or_default();
        if rows.insert(r.method.as_str(), r).is_some() {
            // two builds of one commit (NVRTC's and nvcc's), or one file twice
            return Err(super::invalid(
                "--swap-in-report",
                format!(
                    "two rows of \"{}\" at {point} on {} (commit {}): give one build's files \
                     at a time",
                    r.method,
                    r.meta.device,
                    r.meta.commit.as_deref().unwrap_or("none")
                ),
            ));
        }
    }
    let mut out = String::new();
    for ((device, commit), points) in &runs {
        let arch = arch_of(device);
        // the builds' rows this run timed somewhere: a build it never timed
        // (a run before the build, or a GPU without it) is read as its
        // plain row everywhere, and said
        let timed = |row: &str| points.values().any(|rows| rows.contains_key(row));
        let mut untimed = Vec::new();
        // the points with SGLang's kernel and the default's row
        let mut calls = Vec::new();
        // points with SGLang's kernel left out: a trace's calls (no batch
        // in their point), or no row of the default
        let mut left_out = 0;
        for (label, rows) in points {
            let Some(theirs) = rows.get(SGLANG_ROW) else {
                continue;
            };
            let any = *rows.values().next().expect("a point has rows");
            let ours = param(any, "batch").and_then(|batch| {
                let (build, plain) = default_rows(SwapInChoice::default_for(arch, batch as usize))?;
                match build {
                    Some(b) if timed(b) => rows.get(b).or_else(|| rows.get(plain)),
                    Some(b) => {
                        if !untimed.contains(&b) {
                            untimed.push(b);
                        }
                        rows.get(plain)
                    }
                    None => rows.get(plain),
                }
            });
            match ours {
                Some(ours) => calls.push((label, rows, *ours, *theirs)),
                None => left_out += 1,
            }
        }
        if calls.is_empty() {
            continue;
        }
        let _ = writeln!(
            out,
            "swap-in report: {device}, commit {commit}: {} points with SGLang's kernel{}",
            calls.len(),
            if left_out > 0 {
                format!(" ({left_out} more left out: a trace's calls, or no row of the default)")
            } else {
                String::new()
            }
        );
        for b in &untimed {
            let _ = writeln!(
                out,
                "not timed in this run, so the default's points read its plain build's row: \
                 {b}"
            );
        }
        // the default against SGLang's kernel
        let speeds: Vec<f64> = calls
            .iter()
            .map(|(_, _, o, t)| t.median_us / o.median_us)
            .collect();
        let count = |want: i32| {
            calls
                .iter()
                .filter(|(_, _, o, t)| apart(o, t) == want)
                .count()
        };
        let _ = writeln!(
            out,
            "the default against SGLang's kernel: median {:.2}x (SGLang's time over the \
             default's); clearly faster at {}, level at {}, clearly slower at {}",
            median(speeds),
            count(1),
            count(0),
            count(-1)
        );
        for (label, _, o, t) in calls.iter().filter(|(_, _, o, t)| apart(o, t) == -1) {
            let _ = writeln!(out, "  slower: {label}: {:.2}x", t.median_us / o.median_us);
        }
        // every other kvtier row against the default and SGLang's kernel
        let mut methods: BTreeMap<&str, [usize; 4]> = BTreeMap::new();
        let mut ahead_at: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for (label, rows, o, t) in &calls {
            for (m, r) in rows.iter() {
                if !m.starts_with("kvtier swap-in") || *m == o.method.as_str() {
                    continue;
                }
                let c = methods.entry(m).or_default();
                match apart(r, o) {
                    1 => {
                        c[0] += 1;
                        ahead_at
                            .entry(m)
                            .or_default()
                            .push(format!("{label} ({:.2}x)", o.median_us / r.median_us));
                    }
                    0 => c[1] += 1,
                    _ => c[2] += 1,
                }
                if apart(r, t) == -1 {
                    c[3] += 1;
                }
            }
        }
        let _ = writeln!(
            out,
            "each other kvtier row against the default where both ran (clearly ahead / level / \
             clearly behind), and clearly behind SGLang's kernel:"
        );
        for (m, [a, l, b, s]) in &methods {
            let _ = writeln!(
                out,
                "  {m}: {a} / {l} / {b}; behind SGLang at {s}{}",
                if *a > 0 && *s == 0 {
                    " (a candidate default where it is ahead)"
                } else {
                    ""
                }
            );
            for p in ahead_at.get(m).into_iter().flatten() {
                let _ = writeln!(out, "    ahead: {p}");
            }
        }
        // the latency-bound regime: 2 misses a row
        let _ = writeln!(
            out,
            "latency-bound (2 misses a row; goal: 1.5x SGLang's kernel at batch <= 16, 1.25x \
             at 100-256): the default, the best kvtier row"
        );
        for (label, rows, o, t) in calls.iter().filter(|c| param(c.2, "misses") == Some(2)) {
            let (bm, br) = best(rows);
            let _ = writeln!(
                out,
                "  {label}: {:.2}x; {:.2}x ({bm})",
                t.median_us / o.median_us,
                t.median_us / br.median_us
            );
        }
        // the link-bound regime: >= 100 misses a row, >= 4 MB a call
        let _ = writeln!(
            out,
            "link-bound (>= 100 misses a row, >= 4 MB a call; goal: 0.90 of the link at 656 B, \
             0.93 at 512 B): the default, the best kvtier row, SGLang's kernel"
        );
        for (label, rows, o, t) in &calls {
            let Some(limit) = rows.get(LIMIT_ROW) else {
                continue;
            };
            if param(o, "misses").unwrap_or(0) < 100 || limit.bytes < 4_000_000 {
                continue;
            }
            let (bm, br) = best(rows);
            let share = |r: &Record| limit.median_us / r.median_us;
            let _ = writeln!(
                out,
                "  {label}: {:.2}; {:.2} ({bm}); {:.2}",
                share(o),
                share(br),
                share(t)
            );
        }
        out.push('\n');
    }
    if out.is_empty() {
        return Err(super::invalid(
            "--swap-in-report",
            "no swap-in point in these files has SGLang's kernel and the default's row",
        ));
    }
    Ok(out)
}
