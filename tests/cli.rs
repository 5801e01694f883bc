//! The `kvtier` binary: info, a short bench, and plain errors.

use std::process::Command;

fn kvtier(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn info_reports_kernels_and_driver() {
    let (ok, out, err) = kvtier(&["info"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("kernels:") && out.contains("driver:") && out.contains("pool devices"),
        "{out}"
    );
    if std::env::var("KVTIER_REQUIRE_KERNELS").as_deref() == Ok("1") {
        assert!(out.contains("embedded fatbin holds: sm_80, sm_90"), "{out}");
    }
}

#[test]
fn quick_bench_prints_kvtier_next_to_the_limit() {
    let (ok, out, err) = kvtier(&[
        "bench", "--quick", "--batch", "1,3", "--iters", "3", "--k", "512",
    ]);
    assert!(ok, "{err}");
    let cpu = out.contains("executor: CPU executor");
    let cuda = out.contains("executor: CUDA");
    assert!(cpu || cuda, "{out}");
    for method in if cpu {
        ["kvtier gather (CPU executor)", "contiguous memcpy (limit)"]
    } else {
        ["kvtier gather", "contiguous H2D copy (limit)"]
    } {
        assert_eq!(
            out.matches(method).count(),
            2,
            "one row per batch size for {method}:\n{out}"
        );
    }
    assert!(out.contains("1.01 MB"), "3 × 512 × 656 B = 1.01 MB:\n{out}");
    // the swap-in scenario: batches 1 and 3 × misses 2 and 410 at one hot size
    let swap = if cpu {
        "kvtier swap-in (CPU executor)"
    } else {
        "kvtier swap-in (plan + wide copy)"
    };
    assert_eq!(out.matches(swap).count(), 4, "{out}");
    assert!(out.contains("batch 3, hot 4096, 410 misses"), "{out}");
    assert!(
        out.contains("806.9 KB"),
        "3 × 410 × 656 B of misses:\n{out}"
    );
}

#[test]
fn swap_in_arguments_are_checked() {
    let (ok, _, err) = kvtier(&[
        "bench",
        "--quick",
        "--scenario",
        "swap-in",
        "--k",
        "600",
        "--misses",
        "700",
    ]);
    assert!(!ok);
    assert!(err.contains("--misses"), "{err}");
    let (ok, _, err) = kvtier(&[
        "bench",
        "--quick",
        "--scenario",
        "swap-in",
        "--k",
        "5000",
        "--hot",
        "4096",
    ]);
    assert!(!ok);
    assert!(err.contains("--k"), "{err}");
}

#[test]
fn bad_arguments_fail_plainly() {
    let (ok, _, err) = kvtier(&["bench", "--quick", "--k", "0"]);
    assert!(!ok);
    assert!(err.contains("--k"), "{err}");
    let (ok, _, err) = kvtier(&["bench", "--quick", "--entry", "650"]);
    assert!(!ok);
    assert!(err.contains("multiple of 8"), "{err}");
    let (ok, _, err) = kvtier(&["bench", "--executor", "tpu"]);
    assert!(!ok);
    assert!(err.contains("--executor"), "{err}");
}

#[test]
fn pool_commands_create_inspect_check_and_destroy() {
    let dir = std::env::temp_dir().join(format!("kvtier-cli-pool-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (
        format!("file:{}/a", dir.display()),
        format!("file:{}/b", dir.display()),
    );
    let devs = ["--device", &a, "--device", &b];
    let sized = [format!("{a}:8MiB"), format!("{b}:4MiB")];
    let (ok, out, err) = kvtier(&[
        "pool", "create", "--device", &sized[0], "--device", &sized[1], "--layers", "2",
        "--tokens", "64",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("created pool") && out.contains("on 2 device(s)"),
        "{out}"
    );
    let (ok, out, err) = kvtier(&[&["pool", "status"][..], &devs].concat());
    assert!(ok, "{err}");
    assert!(
        out.contains("656 B × 2 layers × 64 tokens")
            && out.contains("regions:")
            && out.contains("0 allocated"),
        "{out}"
    );
    let (ok, out, err) = kvtier(&[&["pool", "check", "--repair"][..], &devs].concat());
    assert!(ok, "{err}");
    assert!(
        out.contains("valid") && out.contains("reclaimed 0 client slot(s) and 0 region(s)"),
        "{out}"
    );
    let (ok, _, err) = kvtier(&[
        "pool", "create", "--device", &sized[0], "--layers", "2", "--tokens", "64",
    ]);
    assert!(!ok && err.contains("already holds a kvtier pool"), "{err}");
    let (ok, _, err) = kvtier(&["pool", "status", "--device", &b]);
    assert!(!ok && err.contains("device 1 of a pool"), "{err}");
    let (ok, _, err) = kvtier(&["pool", "status", "--device", "tape:1GiB"]);
    assert!(!ok && err.contains("not a device kind"), "{err}");
    let (ok, out, err) = kvtier(&[&["pool", "destroy"][..], &devs].concat());
    assert!(ok && out.contains("destroyed"), "{err}");
    let (ok, _, err) = kvtier(&[&["pool", "status"][..], &devs].concat());
    assert!(!ok && err.contains("no kvtier pool"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}
