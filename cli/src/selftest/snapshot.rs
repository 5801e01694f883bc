//! What a call wrote, as bytes, and the comparison of two executors' writes.

use crate::bench;
use kvtier::{BadIndexReport, Error};

/// The arrays a call may write (read back to the host after it), and the
/// bad indices it reported.
#[derive(Default)]
pub(crate) struct Snapshot {
    parts: Vec<Part>,
    pub report: Option<BadIndexReport>,
}

struct Part {
    name: String,
    elem: usize,
    bytes: Vec<u8>,
}

/// The outcome of comparing the executor under test with the CPU executor.
pub(crate) enum Verdict {
    /// Identical; `note` says something worth showing once (e.g. that
    /// hostile cases were refused as expected).
    Same { note: Option<String> },
    /// The first difference.
    Differ(String),
}

impl Snapshot {
    /// An empty snapshot with a call's report.
    pub fn with_report(report: Option<BadIndexReport>) -> Self {
        Snapshot {
            parts: Vec::new(),
            report,
        }
    }

    /// Adds an array (plain integers or bytes).
    pub fn add<T: Copy>(&mut self, name: impl Into<String>, data: &[T]) {
        // SAFETY: the element types used here are integers and bytes, whose
        // every byte is initialised; the view lives only for the copy.
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data))
        };
        self.parts.push(Part {
            name: name.into(),
            elem: std::mem::size_of::<T>(),
            bytes: bytes.to_vec(),
        });
    }

    /// Compares `got` (the executor under test) with `want` (the CPU
    /// executor): the reports first, then each array in order.
    pub fn compare(want: &Snapshot, got: &Snapshot) -> Verdict {
        if want.report != got.report {
            return Verdict::Differ(format!(
                "bad-index reports differ: CPU {}, under test {}",
                describe(&want.report),
                describe(&got.report)
            ));
        }
        if want.parts.len() != got.parts.len() {
            return Verdict::Differ("the snapshots hold different arrays".into());
        }
        for (w, g) in want.parts.iter().zip(&got.parts) {
            if w.name != g.name || w.bytes.len() != g.bytes.len() {
                return Verdict::Differ(format!("{} has another shape", w.name));
            }
            // memcmp first: the element search is for the rare difference.
            if w.bytes == g.bytes {
                continue;
            }
            if let Some(at) = w.bytes.iter().zip(&g.bytes).position(|(a, b)| a != b) {
                let i = at / w.elem;
                let differing = w.bytes.chunks(w.elem).zip(g.bytes.chunks(g.elem));
                let count = differing.filter(|(a, b)| a != b).count();
                return Verdict::Differ(format!(
                    "{} differs in {}, first at element {i} (CPU {}, under test {})",
                    w.name,
                    bench::count(count as u64, "element", "elements"),
                    hex(&w.bytes[i * w.elem..][..w.elem]),
                    hex(&g.bytes[i * g.elem..][..g.elem]),
                ));
            }
        }
        Verdict::Same {
            note: want
                .report
                .as_ref()
                .map(|_| "bad indices refused and reported alike".into()),
        }
    }
}

fn describe(r: &Option<BadIndexReport>) -> String {
    match r {
        None => "none".into(),
        Some(r) => format!("{r}"),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().rev().map(|x| format!("{x:02x}")).collect()
}

/// A call's bad-index report: the CPU executor returns it from the call, the
/// CUDA executor at the sync point (`check`). Any other error is an error.
pub(crate) fn settle(
    call: kvtier::Result<()>,
    check: impl FnOnce() -> kvtier::Result<()>,
) -> kvtier::Result<Option<BadIndexReport>> {
    let from_call = match call {
        Ok(()) => None,
        Err(Error::BadIndices(r)) => Some(r),
        Err(e) => return Err(e),
    };
    match check() {
        Ok(()) => Ok(from_call),
        Err(Error::BadIndices(r)) if from_call.is_none() => Ok(Some(r)),
        Err(Error::BadIndices(r)) => Err(Error::Pool(format!(
            "bad indices reported twice for one call: {r}"
        ))),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(v: &[i32]) -> Snapshot {
        let mut s = Snapshot::default();
        s.add("out", v);
        s
    }

    #[test]
    fn one_differing_element_is_found_and_named() {
        let Verdict::Differ(what) = Snapshot::compare(&snap(&[1, 2, 3]), &snap(&[1, 2, 4])) else {
            panic!("a difference went unnoticed");
        };
        assert!(
            what.contains("out differs in 1 element, first at element 2"),
            "{what}"
        );
        assert!(
            what.contains("CPU 00000003") && what.contains("under test 00000004"),
            "{what}"
        );
        let Verdict::Differ(what) = Snapshot::compare(&snap(&[1, 2, 3]), &snap(&[1, 5, 4])) else {
            panic!("a difference went unnoticed");
        };
        assert!(
            what.contains("out differs in 2 elements, first at element 1"),
            "{what}"
        );
        assert!(matches!(
            Snapshot::compare(&snap(&[1, 2, 3]), &snap(&[1, 2, 3])),
            Verdict::Same { note: None }
        ));
    }

    #[test]
    fn reports_are_compared() {
        let word = |count| {
            let mut w = kvtier::ErrorWord::clear();
            for i in 0..count {
                w.report(kvtier::abi::KVT_ERR_GATHER_INDEX, i, 7);
            }
            BadIndexReport::decode(&w)
        };
        let (mut a, mut b) = (snap(&[0]), snap(&[0]));
        a.report = Some(word(2));
        b.report = Some(word(3));
        assert!(matches!(Snapshot::compare(&a, &b), Verdict::Differ(_)));
        b.report = None;
        assert!(matches!(Snapshot::compare(&a, &b), Verdict::Differ(_)));
        b.report = Some(word(2));
        assert!(matches!(
            Snapshot::compare(&a, &b),
            Verdict::Same { note: Some(_) }
        ));
    }

    #[test]
    fn the_report_comes_from_the_call_or_the_check() {
        let r = BadIndexReport::decode(&kvtier::ErrorWord::clear());
        let bad = || Err(Error::BadIndices(r.clone()));
        assert!(settle(Ok(()), || Ok(())).unwrap().is_none());
        assert!(settle(bad(), || Ok(())).unwrap().is_some());
        assert!(settle(Ok(()), bad).unwrap().is_some());
        assert!(settle(bad(), bad).is_err());
        assert!(settle(Err(Error::Pool("x".into())), || Ok(())).is_err());
    }
}
