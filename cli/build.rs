//! Embeds the committed decode-step trace recipes (`../bench/traces/*.json`)
//! in the binary.

use std::env;
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    trace_recipes(manifest_dir.parent().expect("the workspace root"), &out_dir);
}

/// The committed decode-step trace recipes (`bench/traces/*.json`), embedded
/// in the binary as `(name, text)` pairs in `$OUT_DIR/trace_recipes.rs`: the
/// traces `kvtier bench --scenario decode-step` replays when given none. A
/// tree without them (an sdist cut down by hand) embeds none.
fn trace_recipes(manifest_dir: &Path, out_dir: &Path) {
    let dir = manifest_dir.join("bench").join("traces");
    println!("cargo::rerun-if-changed={}", dir.display());
    let mut found: Vec<(String, PathBuf)> = std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "json"))
                .filter_map(|p| Some((p.file_stem()?.to_str()?.to_string(), p)))
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    let mut text = String::from("&[\n");
    for (name, path) in &found {
        text.push_str(&format!(
            "    ({name:?}, include_str!({:?})),\n",
            path.display().to_string()
        ));
    }
    text.push_str("]\n");
    std::fs::write(out_dir.join("trace_recipes.rs"), text).expect("writing trace_recipes.rs");
}
