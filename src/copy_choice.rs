//! Which copy method a call takes: a table of what GPU runs measured, per
//! copy path, architecture, entry size and call size, written by
//! `kvtier copy-choice` from the bench's JSON lines and embedded in the
//! library ([`CopyMethodTable::measured`]). Where the table has nothing (an
//! architecture or entry size no run measured, the CPU executor) a call
//! takes the rule the methods were first chosen by
//! ([`CopyMethodTable::rule`]).
//!
//! How a run decides (the rule the bench's results are read by): at each
//! call size of a path, architecture and entry size, a method replaces the
//! rule's where the run shows it clearly faster (the samples' quartile
//! ranges apart) at one point at least and clearly slower at none; where
//! several do, the one clearly faster at the most points. A call of `rows`
//! rows takes the choice with the largest `min_rows` at or below `rows`
//! (below the smallest measured, the smallest's).

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::copy_method::CopyMethod;
use crate::error::{Result, invalid};

/// The copy paths a method is chosen for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CopyPath {
    /// The top-k gather (`Tier::gather`): pool rows into HBM.
    Gather,
    /// The writeback (`Tier::writeback_layer`, `writeback_all_layers`): HBM
    /// rows into the pool.
    Writeback,
}

/// One decision of the table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CopyChoice {
    pub path: CopyPath,
    /// The GPU's compute capability, major × 10 + minor (90: sm_90).
    pub arch: u32,
    /// Bytes of one entry.
    pub entry_bytes: u32,
    /// The smallest call, in rows moved, the choice applies to.
    pub min_rows: u64,
    /// The method's name ([`method_name`]).
    pub method: String,
    /// What the run showed: its device and commit, and at how many of the
    /// call size's points the method was clearly faster or slower than the
    /// rule's.
    pub evidence: String,
}

/// The table: every decision, sorted by path, architecture, entry size and
/// call size.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CopyMethodTable {
    pub choices: Vec<CopyChoice>,
}

/// A method's name in the table (and in `kvtier copy-choice`'s output).
pub fn method_name(m: CopyMethod) -> &'static str {
    match m {
        CopyMethod::WarpVectors => "warp-vectors",
        CopyMethod::LineAligned => "line-aligned",
        CopyMethod::MergedRuns => "merged-runs",
        CopyMethod::BulkRuns => "bulk-runs",
    }
}

/// The method named `name` ([`method_name`]).
pub fn method_by_name(name: &str) -> Option<CopyMethod> {
    CopyMethod::ALL
        .into_iter()
        .find(|&m| method_name(m) == name)
}

/// The table of the committed measurements (`src/copy_choice.json`, written
/// by `kvtier copy-choice` from the bench results it names; a test derives
/// it again from them).
const MEASURED: &str = include_str!("copy_choice.json");

impl CopyMethodTable {
    /// The table the library ships: what the committed GPU runs measured.
    pub fn measured() -> &'static CopyMethodTable {
        static TABLE: OnceLock<CopyMethodTable> = OnceLock::new();
        TABLE.get_or_init(|| {
            CopyMethodTable::from_json(MEASURED).expect("src/copy_choice.json is a valid table")
        })
    }

    /// Reads a table, checking every method name and that no two choices
    /// share a path, architecture, entry size and `min_rows`.
    pub fn from_json(text: &str) -> Result<CopyMethodTable> {
        let mut t: CopyMethodTable = serde_json::from_str(text)
            .map_err(|e| invalid("copy method table", format!("not a table: {e}")))?;
        for c in &t.choices {
            if method_by_name(&c.method).is_none() {
                return Err(invalid(
                    "copy method table",
                    format!(
                        "unknown method {:?} (known: {})",
                        c.method,
                        CopyMethod::ALL.map(method_name).join(", ")
                    ),
                ));
            }
        }
        t.sort();
        if let Some(w) = t.choices.windows(2).find(|w| key(&w[0]) == key(&w[1])) {
            return Err(invalid(
                "copy method table",
                format!(
                    "two choices for {:?} on sm_{} at {} B from {} rows",
                    w[0].path, w[0].arch, w[0].entry_bytes, w[0].min_rows
                ),
            ));
        }
        Ok(t)
    }

    /// The table as `kvtier copy-choice` writes it (sorted, one choice a line).
    pub fn to_json(&self) -> String {
        let mut t = self.clone();
        t.sort();
        let lines: Vec<String> = t
            .choices
            .iter()
            .map(|c| format!("    {}", serde_json::to_string(c).expect("serializable")))
            .collect();
        format!("{{\n  \"choices\": [\n{}\n  ]\n}}\n", lines.join(",\n"))
    }

    fn sort(&mut self) {
        self.choices.sort_by_key(key);
    }

    /// The choices for one path, architecture and entry size, by call size:
    /// (min_rows, method), ascending. Empty where nothing was measured.
    pub fn choices_for(
        &self,
        path: CopyPath,
        arch: u32,
        entry_bytes: u32,
    ) -> Vec<(u64, CopyMethod)> {
        self.choices
            .iter()
            .filter(|c| c.path == path && c.arch == arch && c.entry_bytes == entry_bytes)
            .map(|c| {
                (
                    c.min_rows,
                    method_by_name(&c.method).expect("checked when read"),
                )
            })
            .collect()
    }

    /// The rule a call takes where the table has nothing: the gather takes
    /// [`CopyMethod::for_gather`], the writeback `WarpVectors` (the methods
    /// the first GPU runs chose them by).
    pub fn rule(path: CopyPath, entry_bytes: u32) -> CopyMethod {
        match path {
            CopyPath::Gather => CopyMethod::for_gather(entry_bytes),
            CopyPath::Writeback => CopyMethod::WarpVectors,
        }
    }
}

fn key(c: &CopyChoice) -> (CopyPath, u32, u32, u64) {
    (c.path, c.arch, c.entry_bytes, c.min_rows)
}

/// One call site's choices (a tier's, for its entry size on its GPU),
/// looked up per call without allocating.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyChoices {
    rule: CopyMethod,
    by_rows: Vec<(u64, CopyMethod)>,
}

impl CopyChoices {
    /// The choices of `table` for `path` at `entry_bytes` on a GPU of
    /// compute capability `arch` (None: the CPU executor, which has one way).
    pub fn new(
        table: &CopyMethodTable,
        path: CopyPath,
        arch: Option<u32>,
        entry_bytes: u32,
    ) -> Self {
        CopyChoices {
            rule: CopyMethodTable::rule(path, entry_bytes),
            by_rows: arch
                .map(|a| table.choices_for(path, a, entry_bytes))
                .unwrap_or_default(),
        }
    }

    /// The method a call of `rows` rows takes.
    pub fn method(&self, rows: u64) -> CopyMethod {
        match self.by_rows.iter().rev().find(|&&(min, _)| min <= rows) {
            Some(&(_, m)) => m,
            None => self.by_rows.first().map_or(self.rule, |&(_, m)| m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choice(path: CopyPath, arch: u32, entry: u32, min_rows: u64, m: CopyMethod) -> CopyChoice {
        CopyChoice {
            path,
            arch,
            entry_bytes: entry,
            min_rows,
            method: method_name(m).into(),
            evidence: String::new(),
        }
    }

    #[test]
    fn every_method_has_a_name_of_its_own() {
        for m in CopyMethod::ALL {
            assert_eq!(method_by_name(method_name(m)), Some(m));
        }
        assert_eq!(method_by_name("bulk"), None);
    }

    #[test]
    fn a_call_takes_the_choice_of_the_largest_call_size_at_or_below_its_own() {
        use CopyMethod::*;
        let t = CopyMethodTable {
            choices: vec![
                choice(CopyPath::Gather, 90, 656, 2048, WarpVectors),
                choice(CopyPath::Gather, 90, 656, 256, LineAligned),
                choice(CopyPath::Gather, 90, 656, 65536, LineAligned),
                choice(CopyPath::Writeback, 90, 656, 0, LineAligned),
                choice(CopyPath::Gather, 80, 656, 0, WarpVectors),
            ],
        };
        let t = CopyMethodTable::from_json(&t.to_json()).unwrap();
        let c = CopyChoices::new(&t, CopyPath::Gather, Some(90), 656);
        // below the smallest measured call: the smallest's choice
        assert_eq!(c.method(1), LineAligned);
        assert_eq!(c.method(256), LineAligned);
        assert_eq!(c.method(2047), LineAligned);
        assert_eq!(c.method(2048), WarpVectors);
        assert_eq!(c.method(65535), WarpVectors);
        assert_eq!(c.method(u64::MAX), LineAligned);
        // nothing measured: the rule
        let other = CopyChoices::new(&t, CopyPath::Gather, Some(90), 1152);
        assert_eq!(other.method(4096), WarpVectors);
        let odd = CopyChoices::new(&t, CopyPath::Gather, Some(100), 656);
        assert_eq!(odd.method(4096), CopyMethod::for_gather(656));
        let cpu = CopyChoices::new(&t, CopyPath::Gather, None, 656);
        assert_eq!(cpu.method(4096), CopyMethod::for_gather(656));
        assert_eq!(
            CopyChoices::new(&t, CopyPath::Writeback, Some(90), 656).method(1),
            LineAligned
        );
        assert_eq!(
            CopyChoices::new(&t, CopyPath::Writeback, Some(90), 1152).method(1),
            WarpVectors
        );
    }

    #[test]
    fn a_table_naming_an_unknown_method_or_a_choice_twice_is_refused() {
        let mut t = CopyMethodTable {
            choices: vec![choice(
                CopyPath::Gather,
                90,
                656,
                0,
                CopyMethod::LineAligned,
            )],
        };
        t.choices[0].method = "bulk".into();
        let e = CopyMethodTable::from_json(&t.to_json())
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown method \"bulk\""), "{e}");
        let twice = CopyMethodTable {
            choices: vec![
                choice(CopyPath::Gather, 90, 656, 0, CopyMethod::LineAligned),
                choice(CopyPath::Gather, 90, 656, 0, CopyMethod::WarpVectors),
            ],
        };
        let e = CopyMethodTable::from_json(&twice.to_json())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("two choices for Gather on sm_90 at 656 B from 0 rows"),
            "{e}"
        );
        let e = CopyMethodTable::from_json("{\"choices\": [{\"path\": \"gather\"}]}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a table"), "{e}");
    }

    #[test]
    fn the_shipped_table_reads() {
        let t = CopyMethodTable::measured();
        assert_eq!(CopyMethodTable::from_json(&t.to_json()).unwrap(), *t);
    }
}
