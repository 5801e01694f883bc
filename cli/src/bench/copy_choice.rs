//! `kvtier bench --copy-choice FILE`: the copy-method table
//! ([`kvtier::CopyMethodTable`]) that a run's gather and writeback rows
//! decide (or, with `--from-json`, earlier runs' rows), by the rule its
//! module documents. The GPU suite writes one beside each run's results; the
//! library embeds the table of the committed runs (`src/copy_choice.json`),
//! which a test derives again from them.

use std::collections::{BTreeMap, BTreeSet};

use kvtier::copy_choice::{CopyChoice, method_name};
use kvtier::{CopyMethod, CopyMethodTable, CopyPath};

use super::figures::Record;

/// The bench's name (its `method` field) for `method` on `path`.
pub(crate) fn bench_label(path: CopyPath, method: CopyMethod) -> &'static str {
    match (path, method) {
        (CopyPath::Gather, CopyMethod::WarpVectors) => "kvtier gather",
        (CopyPath::Gather, CopyMethod::LineAligned) => {
            "kvtier gather, passes aligned to 128-byte host lines"
        }
        (CopyPath::Gather, CopyMethod::MergedRuns) => {
            "kvtier gather, neighbouring rows merged into runs"
        }
        (CopyPath::Writeback, CopyMethod::WarpVectors) => "kvtier writeback",
        (CopyPath::Writeback, CopyMethod::LineAligned) => {
            "kvtier writeback, passes aligned to 128-byte host lines"
        }
        (CopyPath::Writeback, CopyMethod::MergedRuns) => {
            "kvtier writeback, neighbouring rows merged into runs"
        }
        (CopyPath::Gather, CopyMethod::BulkRuns) => {
            "kvtier gather, runs moved by the bulk-copy engine through shared memory"
        }
        (CopyPath::Writeback, CopyMethod::BulkRuns) => {
            "kvtier writeback, runs moved by the bulk-copy engine through shared memory"
        }
    }
}

/// A copy method the gather or writeback bench times on a GPU beside its
/// first row's `WarpVectors`: its row's name, and what its check calls it.
/// Every method but that one has a row.
pub(super) fn other_method(path: CopyPath, method: CopyMethod) -> Option<(&'static str, String)> {
    let how = match method {
        CopyMethod::WarpVectors => return None,
        CopyMethod::LineAligned => "line-aligned",
        CopyMethod::MergedRuns => "merged runs",
        CopyMethod::BulkRuns => "bulk runs",
    };
    let scenario = match path {
        CopyPath::Gather => "gather",
        CopyPath::Writeback => "writeback",
    };
    Some((
        bench_label(path, method),
        format!("the kvtier {scenario}, {how}"),
    ))
}

fn path_of(scenario: &str) -> Option<CopyPath> {
    match scenario {
        "gather" => Some(CopyPath::Gather),
        "writeback" => Some(CopyPath::Writeback),
        _ => None,
    }
}

/// One point of one run: the rows of every method timed on it.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Point {
    path: CopyPath,
    arch: u32,
    entry: u32,
    rows: u64,
    run: String,
    point: String,
}

fn arch_of(device: &str) -> Option<u32> {
    // "NVIDIA H100 80GB HBM3 (sm_90)"
    let tail = device.rsplit_once("(sm_")?.1;
    tail.strip_suffix(')')?.parse().ok()
}

fn param(r: &Record, name: &str) -> Option<u64> {
    r.param(name)?.as_u64()
}

/// Rows a call moves: the gather's batch × k, the writeback's items ×
/// layers (tokens of a prefill chunk, or a decode batch).
fn rows_of(path: CopyPath, r: &Record) -> Option<u64> {
    match path {
        CopyPath::Gather => Some(param(r, "batch")? * param(r, "k")?),
        CopyPath::Writeback => {
            Some(param(r, "tokens").or_else(|| param(r, "batch"))? * param(r, "layers")?)
        }
    }
}

/// The table `records` decide. Rows of other scenarios, methods and
/// executors are not read, nor rows without quartiles (runs before
/// 2026-11-26): there is nothing to decide by.
pub(super) fn derive(records: &[Record]) -> kvtier::Result<CopyMethodTable> {
    // point -> method's name -> (q1, q3)
    let mut points: BTreeMap<Point, BTreeMap<&'static str, (f64, f64)>> = BTreeMap::new();
    for r in records {
        let Some(path) = path_of(&r.scenario) else {
            continue;
        };
        let Some(method) = CopyMethod::ALL
            .into_iter()
            .find(|&m| bench_label(path, m) == r.method)
        else {
            continue;
        };
        let Some((q1, q3)) = r.quartiles else {
            continue;
        };
        if r.meta.executor != "cuda" {
            continue;
        }
        let without = |what: &str| {
            super::invalid(
                "--copy-choice",
                format!("a {} row of {} without {what}", r.scenario, r.meta.device),
            )
        };
        let arch = arch_of(&r.meta.device).ok_or_else(|| without("its sm_ architecture"))?;
        let entry = param(r, "entry")
            .and_then(|e| u32::try_from(e).ok())
            .ok_or_else(|| without("an entry size"))?;
        let rows = rows_of(path, r).ok_or_else(|| without("its call's size"))?;
        let commit = r.meta.commit.as_deref().unwrap_or("an unnamed commit");
        let point = Point {
            path,
            arch,
            entry,
            rows,
            run: format!(
                "{} at {}, {}",
                r.meta.device,
                &commit[..commit.len().min(7)],
                r.meta.date
            ),
            point: format!("{:?}", r.point),
        };
        points
            .entry(point)
            .or_default()
            .insert(method_name(method), (q1, q3));
    }
    // (path, arch, entry, rows) -> method -> (points compared, faster, slower), runs
    type Tally = BTreeMap<&'static str, (u32, u32, u32)>;
    type Group = (CopyPath, u32, u32, u64);
    let mut groups: BTreeMap<Group, (Tally, BTreeSet<String>)> = BTreeMap::new();
    for (p, methods) in &points {
        let rule = method_name(CopyMethodTable::rule(p.path, p.entry));
        let Some(&(b1, b3)) = methods.get(rule) else {
            continue;
        };
        for (&m, &(q1, q3)) in methods {
            if m == rule {
                continue;
            }
            let g = groups.entry((p.path, p.arch, p.entry, p.rows)).or_default();
            let t = g.0.entry(m).or_default();
            t.0 += 1;
            t.1 += (q3 < b1) as u32;
            t.2 += (q1 > b3) as u32;
            g.1.insert(p.run.clone());
        }
    }
    let mut choices = Vec::new();
    for ((path, arch, entry, rows), (tally, runs)) in groups {
        let rule = method_name(CopyMethodTable::rule(path, entry));
        let best = tally
            .iter()
            .filter(|(_, t)| t.1 > 0 && t.2 == 0)
            .max_by_key(|(_, t)| t.1)
            .map(|(&m, _)| m);
        let summary: Vec<String> = tally
            .iter()
            .map(|(&m, t)| {
                format!(
                    "{m} against {rule}: faster at {} of {}, slower at {}",
                    t.1,
                    super::count(t.0, "point", "points"),
                    t.2
                )
            })
            .collect();
        choices.push(CopyChoice {
            path,
            arch,
            entry_bytes: entry,
            min_rows: rows,
            method: best.unwrap_or(rule).into(),
            evidence: format!(
                "{} ({})",
                runs.into_iter().collect::<Vec<_>>().join("; "),
                summary.join("; ")
            ),
        });
    }
    CopyMethodTable::from_json(&CopyMethodTable { choices }.to_json())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(scenario: &str, method: &str, params: &str, q1: f64, q3: f64) -> String {
        format!(
            r#"{{"scenario":"{scenario}","executor":"cuda","device":"NVIDIA H100 80GB HBM3 (sm_90)","commit":"7a799b8c93","method":"{method}","params":{params},"bytes":1,"is_limit":false,"q1_us":{q1},"q3_us":{q3},"median_us":{},"timestamp":"2026-11-27T08:36:47Z"}}"#,
            (q1 + q3) / 2.0
        )
    }

    const WV: &str = "kvtier writeback";
    const LA: &str = "kvtier writeback, passes aligned to 128-byte host lines";

    fn records(lines: &[String]) -> Vec<Record> {
        lines
            .iter()
            .map(|l| Record::parse(&serde_json::from_str(l).unwrap(), None).unwrap())
            .collect()
    }

    fn table(lines: &[String]) -> CopyMethodTable {
        derive(&records(lines)).unwrap()
    }

    #[test]
    fn a_method_replaces_the_rules_where_faster_somewhere_and_slower_nowhere() {
        let p = |tokens: u32, phase: &str| {
            format!(r#"{{"entry":656,"layers":1,"phase":"{phase}","tokens":{tokens}}}"#)
        };
        let t = table(&[
            // 1024 rows: faster at one point, level at the other -> line-aligned
            line("writeback", WV, &p(1024, "a"), 10.0, 11.0),
            line("writeback", LA, &p(1024, "a"), 8.0, 9.0),
            line("writeback", WV, &p(1024, "b"), 10.0, 11.0),
            line("writeback", LA, &p(1024, "b"), 10.5, 11.5),
            // 8192 rows: faster at one point, slower at another -> the rule's
            line("writeback", WV, &p(8192, "a"), 10.0, 11.0),
            line("writeback", LA, &p(8192, "a"), 8.0, 9.0),
            line("writeback", WV, &p(8192, "b"), 10.0, 11.0),
            line("writeback", LA, &p(8192, "b"), 12.0, 13.0),
            // 61 rows: level (the ranges overlap, whichever way) -> the rule's
            line("writeback", WV, &p(61, "a"), 10.0, 11.0),
            line("writeback", LA, &p(61, "a"), 9.5, 10.5),
            line("writeback", WV, &p(61, "b"), 10.0, 11.0),
            line("writeback", LA, &p(61, "b"), 10.5, 11.5),
            // only one method timed: no choice
            line("writeback", WV, &p(4096, "a"), 10.0, 11.0),
            // other methods and scenarios are not read
            line(
                "writeback",
                "cudaMemcpyAsync per entry",
                &p(4096, "a"),
                1.0,
                2.0,
            ),
            line("swap-in", "kvtier swap-in", &p(4096, "a"), 1.0, 2.0),
        ]);
        let got: Vec<(u64, &str)> = t
            .choices
            .iter()
            .map(|c| (c.min_rows, c.method.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                (61, "warp-vectors"),
                (1024, "line-aligned"),
                (8192, "warp-vectors")
            ]
        );
        assert!(
            t.choices[1].evidence.contains(
                "line-aligned against warp-vectors: faster at 1 of 2 points, slower at 0"
            ),
            "{}",
            t.choices[1].evidence
        );
        assert!(
            t.choices[1]
                .evidence
                .contains("NVIDIA H100 80GB HBM3 (sm_90) at 7a799b8, 2026-11-27")
        );
        assert!(
            t.choices
                .iter()
                .all(|c| c.arch == 90 && c.path == CopyPath::Writeback)
        );
        // the CPU executor's rows decide nothing
        let cpu: Vec<String> = [
            line("writeback", WV, &p(1024, "a"), 10.0, 11.0),
            line("writeback", LA, &p(1024, "a"), 8.0, 9.0),
        ]
        .iter()
        .map(|l| l.replace(r#""executor":"cuda""#, r#""executor":"cpu""#))
        .collect();
        assert_eq!(table(&cpu), CopyMethodTable::default());
    }

    #[test]
    fn the_gathers_rule_is_line_aligned_for_entries_of_part_lines() {
        let p = |entry: u32| format!(r#"{{"batch":1,"entry":{entry},"k":256}}"#);
        let gw = bench_label(CopyPath::Gather, CopyMethod::WarpVectors);
        let gl = bench_label(CopyPath::Gather, CopyMethod::LineAligned);
        let t = table(&[
            // warp vectors faster than line-aligned at 656 B: it replaces the
            // rule's; at 1152 B it is the rule's
            line("gather", gw, &p(656), 5.0, 6.0),
            line("gather", gl, &p(656), 7.0, 8.0),
            line("gather", gw, &p(1152), 5.0, 6.0),
            line("gather", gl, &p(1152), 7.0, 8.0),
        ]);
        let got: Vec<(u32, &str)> = t
            .choices
            .iter()
            .map(|c| (c.entry_bytes, c.method.as_str()))
            .collect();
        assert_eq!(got, [(656, "warp-vectors"), (1152, "warp-vectors")]);
        assert_eq!(t.choices[0].min_rows, 256);
    }

    #[test]
    fn the_bulk_method_is_chosen_where_a_run_shows_it_clearly_faster() {
        let p = |k: u32| format!(r#"{{"batch":64,"entry":656,"k":{k}}}"#);
        let (gl, gb) = (
            bench_label(CopyPath::Gather, CopyMethod::LineAligned),
            bench_label(CopyPath::Gather, CopyMethod::BulkRuns),
        );
        let (ww, wb) = (
            bench_label(CopyPath::Writeback, CopyMethod::WarpVectors),
            bench_label(CopyPath::Writeback, CopyMethod::BulkRuns),
        );
        let wp = r#"{"entry":656,"layers":1,"phase":"prefill","tokens":8192}"#;
        let t = table(&[
            // the gather's rule at 656 B is line-aligned: bulk replaces it
            // at k 2048, is level at k 256 (overlapping quartiles)
            line("gather", gl, &p(2048), 10.0, 11.0),
            line("gather", gb, &p(2048), 7.0, 8.0),
            line("gather", gl, &p(256), 10.0, 11.0),
            line("gather", gb, &p(256), 10.5, 11.5),
            // the writeback's rule is warp vectors: bulk slower keeps it
            line("writeback", ww, wp, 10.0, 11.0),
            line("writeback", wb, wp, 12.0, 13.0),
        ]);
        let got: Vec<(CopyPath, u64, &str)> = t
            .choices
            .iter()
            .map(|c| (c.path, c.min_rows, c.method.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                (CopyPath::Gather, 64 * 256, "line-aligned"),
                (CopyPath::Gather, 64 * 2048, "bulk-runs"),
                (CopyPath::Writeback, 8192, "warp-vectors"),
            ]
        );
        assert_eq!(
            kvtier::copy_choice::method_by_name("bulk-runs"),
            Some(CopyMethod::BulkRuns)
        );
    }

    #[test]
    fn a_row_without_its_shape_is_refused_and_one_without_quartiles_skipped() {
        let bad = line("gather", "kvtier gather", r#"{"entry":656}"#, 1.0, 2.0);
        let e = derive(&records(&[bad])).unwrap_err().to_string();
        assert!(
            e.contains("a gather row of NVIDIA H100 80GB HBM3 (sm_90) without its call's size"),
            "{e}"
        );
        let params = r#"{"batch":1,"entry":656,"k":256}"#;
        let old =
            line("gather", "kvtier gather", params, 1.0, 2.0).replace("\"q1_us\"", "\"p99_us\"");
        let older = line(
            "gather",
            bench_label(CopyPath::Gather, CopyMethod::LineAligned),
            params,
            3.0,
            4.0,
        );
        assert_eq!(table(&[old, older]), CopyMethodTable::default());
    }
}
