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

/// The dependency list of `docs/architecture.md` (section 2: a line
/// `MODULE -> DEP, DEP` a module, `-> nothing` for none) is the graph
/// [`deps`] computes, both ways: a module or an edge added, or removed, in
/// the code without its line fails here, with the line to write.
#[test]
fn the_documented_dependency_list_is_the_code_s() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let section = &doc[doc.find("## 2. Dependencies").unwrap()..doc.find("## 3.").unwrap()];
    let block = section
        .split("```text\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a ```text block in section 2");
    let mut documented: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        let (module, edges) = line
            .split_once("->")
            .unwrap_or_else(|| panic!("not `MODULE -> DEP, DEP`: {line:?}"));
        let edges = edges.trim();
        let set = if edges == "nothing" {
            BTreeSet::new()
        } else {
            edges.split(',').map(|d| d.trim().to_string()).collect()
        };
        let old = documented.insert(module.trim().to_string(), set);
        assert!(old.is_none(), "two lines for {}", module.trim());
    }
    let expected_line = |module: &str, set: &BTreeSet<String>| {
        let edges = set.iter().cloned().collect::<Vec<_>>().join(", ");
        let edges = if edges.is_empty() {
            "nothing".into()
        } else {
            edges
        };
        format!("{module} -> {edges}")
    };
    let actual = deps();
    let mut fixes = Vec::new();
    for (module, set) in &actual {
        match documented.get(module) {
            None => fixes.push(format!("add the line `{}`", expected_line(module, set))),
            Some(doc_set) if doc_set != set => {
                let add: Vec<_> = set.difference(doc_set).collect();
                let remove: Vec<_> = doc_set.difference(set).collect();
                fixes.push(format!(
                    "`{module}`: add {add:?}, remove {remove:?}; the line reads `{}`",
                    expected_line(module, set)
                ));
            }
            Some(_) => {}
        }
    }
    for module in documented.keys().filter(|m| !actual.contains_key(*m)) {
        fixes.push(format!("remove the line of `{module}` (no such module)"));
    }
    assert!(
        fixes.is_empty(),
        "docs/architecture.md section 2 is not the code's dependency graph:\n{}",
        fixes.join("\n")
    );
}

/// Within each folder module, the sibling files depend on one another one
/// way too (`super::NAME` or `crate::MODULE::NAME` of a sibling), so that
/// each can be read after the ones it uses.
#[test]
fn sibling_files_have_no_cycle() {
    // the library's modules, and the command line's (its own crate)
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let checked: usize = [root.join("src"), root.join("cli/src")]
        .iter()
        .map(|src| siblings_have_no_cycle(src))
        .sum();
    assert!(checked >= 5, "folder modules checked: {checked}");
}

/// [`sibling_files_have_no_cycle`] in the crate whose sources are `src`:
/// how many folder modules it checked.
fn siblings_have_no_cycle(src: &Path) -> usize {
    let src = src.to_path_buf();
    let mut checked = 0;
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        let mut siblings: BTreeMap<String, String> = BTreeMap::new();
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p.clone());
                // a sub-folder module's files speak for it as one sibling
                let name = p.file_name().unwrap().to_str().unwrap().to_string();
                let mut text = String::new();
                for f in std::fs::read_dir(&p).unwrap() {
                    let f = f.unwrap().path();
                    if f.extension().and_then(|x| x.to_str()) == Some("rs") {
                        text += &std::fs::read_to_string(&f).unwrap();
                    }
                }
                siblings.insert(name, text);
            } else if p.extension().and_then(|x| x.to_str()) == Some("rs") {
                let name = p.file_stem().unwrap().to_str().unwrap().to_string();
                if name != "mod" && name != "lib" && name != "main" {
                    siblings.insert(name, std::fs::read_to_string(&p).unwrap());
                }
            }
        }
        if dir == src {
            continue; // the top level: module_dependencies_have_no_cycle
        }
        let module = dir
            .strip_prefix(&src)
            .unwrap()
            .to_str()
            .unwrap()
            .replace('/', "::");
        let names: BTreeSet<String> = siblings.keys().cloned().collect();
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (name, text) in &siblings {
            let deps = g.entry(name.clone()).or_default();
            for prefix in ["super::".to_string(), format!("crate::{module}::")] {
                for (i, _) in text.match_indices(&prefix) {
                    let used: String = text[i + prefix.len()..]
                        .chars()
                        .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                        .collect();
                    if names.contains(&used) && &used != name {
                        deps.insert(used);
                    }
                }
                // `use super::{a, b::c}`: each name in the braces
                for (i, _) in text.match_indices(&format!("{prefix}{{")) {
                    let inside: String = text[i + prefix.len() + 1..]
                        .chars()
                        .take_while(|&c| c != '}')
                        .collect();
                    for part in inside.split(',') {
                        let used: String = part
                            .trim()
                            .chars()
                            .take_while(|c| {
                                c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_'
                            })
                            .collect();
                        if names.contains(&used) && &used != name {
                            deps.insert(used);
                        }
                    }
                }
            }
        }
        let mut left = g.clone();
        while !left.is_empty() {
            let free: Vec<String> = left
                .iter()
                .filter(|(_, d)| d.iter().all(|m| !left.contains_key(m)))
                .map(|(m, _)| m.clone())
                .collect();
            assert!(
                !free.is_empty(),
                "a dependency cycle among the files of src/{}: {:?}",
                dir.strip_prefix(&src).unwrap().display(),
                left
            );
            for m in free {
                left.remove(&m);
            }
        }
        checked += 1;
    }
    checked
}

/// The library's own dependencies are the library's: the command line's
/// crates (argument parsing, progress bars, plotting) are the `kvtier-cli`
/// package's, so a program that depends on kvtier builds none of them.
#[test]
fn the_library_depends_on_no_command_line_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let deps: Vec<&str> = manifest
        .split("\n[dependencies]\n")
        .nth(1)
        .expect("a [dependencies] table")
        .split("\n[")
        .next()
        .unwrap()
        .lines()
        .filter_map(|l| l.split('=').next().map(str::trim))
        .filter(|n| !n.is_empty() && !n.starts_with('#'))
        .collect();
    assert!(
        deps.contains(&"cudarc") && deps.contains(&"libc"),
        "{deps:?}"
    );
    for cli_only in ["clap", "indicatif", "plotters"] {
        assert!(
            !deps.contains(&cli_only),
            "the library depends on {cli_only}: {deps:?}"
        );
    }
    let cli = std::fs::read_to_string(root.join("cli/Cargo.toml")).unwrap();
    assert!(
        cli.contains("name = \"kvtier\"") && cli.contains("clap"),
        "{cli}"
    );
}

/// The file map in one place: every source file of the tree (the library,
/// the kernels, the command line, the Python package and extension module,
/// the scripts, CI's entry point, the tests and the benchmarks) is named in the module table of `docs/architecture.md`,
/// either by a row of its own or, under a row for its folder, by its file
/// name; and every path a row names exists. A file added, moved or removed
/// without its row fails here.
#[test]
fn the_file_map_names_every_source_file_and_nothing_else() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let table = &doc[doc.find("## 1. Modules").unwrap()..doc.find("## 2.").unwrap()];
    // row path -> the row's text
    let mut rows: BTreeMap<String, String> = BTreeMap::new();
    for line in table.lines().filter(|l| l.starts_with("| `")) {
        let path = line[3..].split('`').next().unwrap().to_string();
        rows.insert(path, line.to_string());
    }
    assert!(rows.len() > 40, "{} rows", rows.len());
    let missing: Vec<&String> = rows.keys().filter(|p| !root.join(p).exists()).collect();
    assert!(
        missing.is_empty(),
        "docs/architecture.md names what does not exist: {missing:?}"
    );

    fn walk(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if name.starts_with('.') || name == "__pycache__" {
                continue;
            }
            if p.is_dir() {
                walk(&p, out);
            } else if [".rs", ".cu", ".cuh", ".h", ".c", ".cpp", ".py", ".sh"]
                .iter()
                .any(|x| name.ends_with(x))
            {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    for dir in [
        "src",
        "kernels",
        "cli/src",
        "bindings/python/kvtier",
        "bindings/python/native/src",
        "bindings/python/tests",
        "bindings/python/benchmarks",
        "scripts",
        "tests",
        "cli/tests",
        "benches",
        "bench/sglang-kernels",
    ] {
        walk(&root.join(dir), &mut files);
    }
    for f in [
        "build.rs",
        "cli/build.rs",
        "bindings/abi.rs",
        "bindings/kvtier.h",
        "bindings/python/setup.py",
        ".ci/run",
    ] {
        files.push(root.join(f));
    }
    let mut unnamed = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(root).unwrap().to_string_lossy().into_owned();
        if rows.contains_key(&rel) {
            continue;
        }
        // the nearest folder row, which names the file (with or without its
        // extension, as `name` or `dir/name`) in its text
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let stem = name
            .rsplit_once('.')
            .map_or(name.as_str(), |(s, _)| s)
            .to_string();
        let covered = rows.iter().any(|(path, text)| {
            path.ends_with('/') && rel.starts_with(path.as_str()) && {
                let inner = &rel[path.len()..];
                let inner_stem = inner.rsplit_once('.').map_or(inner, |(s, _)| s);
                [inner, inner_stem, name.as_str(), stem.as_str()]
                    .iter()
                    .any(|n| {
                        text.contains(&format!("`{n}`"))
                            || text.contains(&format!("`{n} "))
                            || text.contains(&format!("`{n}:"))
                    })
            }
        });
        if !covered {
            unnamed.push(rel);
        }
    }
    assert!(
        unnamed.is_empty(),
        "source files docs/architecture.md does not name: {unnamed:#?}"
    );

    // and each file a folder row names by its extension exists, somewhere
    // under the folder (`main.rs` in the `cli/` row) or from the root
    // (`tests/architecture.rs` in the same row)
    let rels: Vec<String> = files
        .iter()
        .map(|f| f.strip_prefix(root).unwrap().to_string_lossy().into_owned())
        .collect();
    let mut gone = Vec::new();
    for (path, text) in rows.iter().filter(|(p, _)| p.ends_with('/')) {
        for name in text.split('`').skip(1).step_by(2) {
            let is_file = [".rs", ".cu", ".cuh", ".h", ".c", ".cpp", ".py", ".sh"]
                .iter()
                .any(|x| name.ends_with(x));
            if is_file
                && !name.contains(' ')
                && !root.join(name).exists()
                && !rels
                    .iter()
                    .any(|r| r.starts_with(path.as_str()) && r.ends_with(&format!("/{name}")))
            {
                gone.push(format!("{path}: {name}"));
            }
        }
    }
    assert!(
        gone.is_empty(),
        "folder rows of docs/architecture.md name files that do not exist: {gone:#?}"
    );
}
