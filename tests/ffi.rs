//! The C ABI through its header: a C program (tests/ffi/abi_test.c) compiled
//! against bindings/kvtier.h and linked to the cdylib, so that the header's
//! declarations, struct layouts and the library's behaviour are checked
//! together.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The directory holding the libkvtier.so cargo built alongside this test.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    for dir in [deps, deps.parent().unwrap()] {
        if dir.join("libkvtier.so").exists() {
            return dir.to_path_buf();
        }
    }
    panic!(
        "no libkvtier.so next to {} (the cdylib is built with the library)",
        exe.display()
    );
}

fn compile(out: &Path) {
    let lib = lib_dir();
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
        .arg(repo().join("bindings"))
        .arg(repo().join("tests/ffi/abi_test.c"))
        .arg("-L")
        .arg(&lib)
        .arg("-lkvtier")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-o")
        .arg(out)
        .status()
        .expect("a C compiler (cc) is needed for the C ABI test");
    assert!(status.success(), "compiling tests/ffi/abi_test.c failed");
}

/// Runs the C test program against the library cargo built with this test
/// (cargo's LD_LIBRARY_PATH may name a stale build in target/<profile> first).
fn run_c(bin: &Path) -> Command {
    let mut c = Command::new(bin);
    c.env("LD_LIBRARY_PATH", lib_dir());
    c
}

/// The C test program, compiled into a directory of its own for `test`.
fn test_binary(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvtier-ffi-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bin = dir.join("abi_test");
    compile(&bin);
    bin
}

#[test]
fn header_struct_layouts_match_the_library() {
    let bin = test_binary("layout");
    let out = run_c(&bin).arg("layout").output().unwrap();
    assert!(out.status.success());
    let c: Vec<(String, usize)> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (name, value) = l.rsplit_once(' ').unwrap();
            (name.to_string(), value.parse().unwrap())
        })
        .collect();
    let rust: Vec<(String, usize)> = kvtier::ffi::layout_table()
        .into_iter()
        .map(|(n, v)| (n.to_string(), v))
        .collect();
    assert_eq!(c, rust, "bindings/kvtier.h and src/ffi.rs disagree");
    let _ = std::fs::remove_dir_all(bin.parent().unwrap());
}

#[test]
fn the_c_abi_works_from_c_and_refuses_bad_input() {
    let bin = test_binary("run");
    let out = run_c(&bin).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let failed: Vec<&str> = text.lines().filter(|l| l.starts_with("FAIL")).collect();
    assert!(
        out.status.success() && failed.is_empty(),
        "C ABI checks failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.lines().filter(|l| l.starts_with("ok")).count() >= 30,
        "{text}"
    );
    let _ = std::fs::remove_dir_all(bin.parent().unwrap());
}

#[test]
fn the_header_is_valid_cpp() {
    let status = Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()))
        .args([
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fsyntax-only",
            "-x",
            "c++",
        ])
        .arg(repo().join("bindings/kvtier.h"))
        .status()
        .expect("a C++ compiler (c++) is needed for the header test");
    assert!(status.success());
}

/// Every function the header declares is exported, and nothing else is.
#[test]
fn the_library_exports_exactly_the_header() {
    let header = std::fs::read_to_string(repo().join("bindings/kvtier.h")).unwrap();
    // The code without its comments, then every `kvt_name(`.
    let code: String = header
        .split("/*")
        .enumerate()
        .map(|(i, part)| {
            if i == 0 {
                part
            } else {
                part.split_once("*/").map_or("", |p| p.1)
            }
        })
        .collect();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut declared: Vec<String> = code
        .match_indices("kvt_")
        .filter(|&(at, _)| !code[..at].ends_with(ident))
        .filter_map(|(at, _)| {
            let name: String = code[at..].chars().take_while(|&c| ident(c)).collect();
            code[at + name.len()..].starts_with('(').then_some(name)
        })
        .collect();
    declared.sort();
    declared.dedup();
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(lib_dir().join("libkvtier.so"))
        .output()
        .expect("nm (binutils) is needed for the export test");
    let mut exported: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|s| s.starts_with("kvt_"))
        .map(String::from)
        .collect();
    exported.sort();
    assert_eq!(declared, exported);
}
