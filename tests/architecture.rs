//! The library's modules depend on one another one way: no module reaches,
//! through `crate::` paths, a module that reaches it back (the CLI and the C
//! ABI on top, then the tier, the mechanisms and the pool, then layout and
//! cuda, then the error types).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

fn deps() -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().and_then(|x| x.to_str()) != Some("rs") {
                continue;
            }
            let rel = p.strip_prefix(&src).unwrap();
            let top = rel
                .iter()
                .next()
                .unwrap()
                .to_str()
                .unwrap()
                .trim_end_matches(".rs")
                .to_string();
            if top == "lib" || top == "main" {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap();
            let entry = out.entry(top.clone()).or_default();
            for (i, _) in text.match_indices("crate::") {
                let name: String = text[i + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                if !name.is_empty() && name != top {
                    entry.insert(name);
                }
            }
        }
    }
    out
}

#[test]
fn module_dependencies_have_no_cycle() {
    let g = deps();
    // Kahn: repeatedly remove modules that depend on nothing left
    let mut left = g.clone();
    while !left.is_empty() {
        let free: Vec<String> = left
            .iter()
            .filter(|(_, d)| d.iter().all(|m| !left.contains_key(m)))
            .map(|(m, _)| m.clone())
            .collect();
        assert!(!free.is_empty(), "a dependency cycle among {:?}", left);
        for m in free {
            left.remove(&m);
        }
    }
    // and the layers named in the docs hold
    for (low, high) in [
        ("error", "pool"),
        ("layout", "tier"),
        ("pool", "ffi"),
        ("tier", "ffi"),
        ("error_word", "error"),
    ] {
        assert!(!g[low].contains(high), "{low} depends on {high}");
    }
}
