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

/// The pool on `devices` (device specs as the command line takes them),
/// opened by rank `rank` of `ranks`.
fn open_as_rank(devices: &[&String], rank: u32, ranks: u32) -> std::sync::Arc<kvtier::Pool> {
    let specs: Vec<kvtier::DeviceSpec> = devices.iter().map(|d| d.parse().unwrap()).collect();
    let opts = kvtier::PoolOptions {
        rank,
        ranks,
        ..kvtier::PoolOptions::default()
    };
    kvtier::Pool::open(specs, opts).unwrap()
}

/// A reader that goes away (`kvtier info | head -1`) ends the command quietly,
/// by SIGPIPE as the shell's tools end, not with a panic and exit 101.
#[test]
fn a_closed_pipe_ends_the_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .arg("info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader is gone before the first line
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?}: {stderr}",
        out.status
    );
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
fn quick_bench_runs_every_scenario_and_method_and_writes_json_and_a_plot() {
    let dir = std::env::temp_dir().join(format!("kvtier-cli-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, png) = (dir.join("bench.jsonl"), dir.join("bench.png"));
    let (ok, out, err) = kvtier(&[
        "bench",
        "--quick",
        "--batch",
        "1,3",
        "--iters",
        "3",
        "--k",
        "512",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        png.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let cpu = out.contains("executor: CPU executor");
    assert!(cpu || out.contains("executor: CUDA"), "{out}");
    if cpu {
        assert!(
            out.contains("These are CPU figures, not GPU figures"),
            "{out}"
        );
    }

    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&json)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for l in &lines {
        for key in [
            "device",
            "driver",
            "scenario",
            "method",
            "params",
            "bytes",
            "median_us",
            "p99_us",
            "gbps",
            "ratio_to_limit",
            "timestamp",
        ] {
            assert!(l.get(key).is_some(), "{key} missing in {l}");
        }
        assert!(l["median_us"].as_f64().unwrap() > 0.0, "{l}");
    }
    let count = |scenario: &str| lines.iter().filter(|l| l["scenario"] == scenario).count();
    // gather: 2 batches × 1 k × 1 entry × 1 context × 2 index kinds, 5 methods
    assert_eq!(count("gather"), 2 * 2 * 5, "{out}");
    // swap-in: 2 batches × 1 hot × 2 miss counts, 4 methods on the CPU, 5 on CUDA
    assert_eq!(count("swap-in"), 2 * 2 * if cpu { 4 } else { 5 }, "{out}");
    // writeback: 1 prefill chunk + 2 decode batches, 4 methods
    assert_eq!(count("writeback"), 3 * 4, "{out}");
    // speculative swap-in: 2 batches × 2 step counts × 2 miss counts, 2
    // methods
    let spec = 2 * 2 * 2;
    assert_eq!(count("spec-swap-in"), spec * 2, "{out}");
    // every point has one limit, at ratio 1, and the others' ratios
    for l in lines.iter().filter(|l| l["is_limit"] == true) {
        assert_eq!(l["ratio_to_limit"].as_f64(), Some(1.0), "{l}");
    }
    assert_eq!(
        lines.iter().filter(|l| l["is_limit"] == true).count(),
        4 + 4 + 3 + spec
    );
    let g = lines
        .iter()
        .find(|l| l["scenario"] == "gather" && l["params"]["batch"] == 3 && l["is_limit"] == true)
        .unwrap();
    assert_eq!(g["bytes"], 3 * 512 * 656, "{g}");
    assert!(
        lines.iter().any(|l| l["method"]
            .as_str()
            .unwrap()
            .starts_with("full-context fetch")
            && l["bytes"] == 3 * 8192 * 656),
        "the full-context fetch moves whole layers"
    );

    let png = std::fs::read(&png).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "a PNG was drawn"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn swap_in_arguments_are_checked() {
    let (ok, _, err) = kvtier(&[
        "bench",
        "--quick",
        "--scenario",
        "swap-in",
        "--swap-k",
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
        "--swap-k",
        "5000",
        "--hot",
        "4096",
    ]);
    assert!(!ok);
    assert!(err.contains("--swap-k"), "{err}");
}

#[test]
fn bad_arguments_fail_plainly() {
    // pool files for the create errors below (none is ever made)
    let shm = if std::path::Path::new("/dev/shm").is_dir() {
        "/dev/shm".into()
    } else {
        std::env::temp_dir()
    };
    let file = |name: &str, size: &str| {
        format!(
            "file:{}/kvtier-cli-bad-{}-{name}:{size}",
            shm.display(),
            std::process::id()
        )
    };
    let (small, large, eight) = (file("a", "4MiB"), file("b", "2GiB"), file("c", "8MiB"));
    let (ok, _, err) = kvtier(&["bench", "--quick", "--k", "0"]);
    assert!(!ok);
    assert!(err.contains("--k"), "{err}");
    let (ok, _, err) = kvtier(&["bench", "--quick", "--entry", "650"]);
    assert!(!ok);
    assert!(err.contains("multiple of 8"), "{err}");
    let (ok, _, err) = kvtier(&["bench", "--executor", "tpu"]);
    assert!(!ok);
    assert!(err.contains("--executor"), "{err}");
    // a small first device beside a large one: refused, not written past (a
    // segfault before)
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "pool", "create", "--device", &small, "--device", &large, "--layers", "1", "--tokens",
            "4",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot hold the pool's tables"), "{err}");
    for f in [&small, &large] {
        let path = f.trim_start_matches("file:").rsplit_once(':').unwrap().0;
        assert!(
            !std::path::Path::new(path).exists(),
            "a refused create leaves no file: {path}"
        );
    }
    // errors name the flags the user typed
    let (ok, _, err) = kvtier(&[
        "pool", "create", "--device", &eight, "--entry", "650", "--layers", "1", "--tokens", "4",
    ]);
    assert!(!ok && err.contains("`--entry`: 650"), "{err}");
    let (ok, _, err) = kvtier(&[
        "pool",
        "create",
        "--device",
        "dax:/dev/dax77.7",
        "--layers",
        "1",
        "--tokens",
        "4",
    ]);
    assert!(
        !ok && err.contains("kvtier info") && err.contains("daxctl"),
        "{err}"
    );
    // output paths are checked before anything is measured
    let t0 = std::time::Instant::now();
    let (ok, out, err) = kvtier(&["bench", "--quick", "--json", "/nonexistent-dir/b.jsonl"]);
    assert!(
        !ok && err.contains("`--json`: cannot write /nonexistent-dir/b.jsonl"),
        "{err}"
    );
    assert!(
        !out.contains("GB/s") && t0.elapsed() < std::time::Duration::from_secs(5),
        "{out}"
    );
    let (ok, _, err) = kvtier(&[
        "bench",
        "--quick",
        "--plot",
        "/tmp/kvtier-p.png",
        "--plot-font",
        "/no/font.ttf",
    ]);
    assert!(!ok && err.contains("--plot-font"), "{err}");
    for mode in ["400", "999", "rw"] {
        let (ok, _, err) = kvtier(&[
            "pool", "create", "--device", &eight, "--layers", "1", "--tokens", "4", "--mode", mode,
        ]);
        assert!(!ok && err.contains("--mode"), "{mode}: {err}");
    }
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
    {
        // two ranks of four hold regions: status names who reads from which device
        let p1 = open_as_rank(&[&a, &b], 1, 4);
        let p2 = open_as_rank(&[&a, &b], 2, 4);
        let _r1 = p1.alloc_region_for(1).unwrap();
        let _r2 = p2.alloc_region_for(2).unwrap();
        let (ok, out, err) = kvtier(&[&["pool", "status"][..], &devs].concat());
        assert!(ok, "{err}");
        let line = |i: &str| {
            out.lines()
                .find(|l| l.trim_start().starts_with(i))
                .unwrap()
                .to_string()
        };
        assert!(line("0  file:").ends_with("readers 2"), "{out}");
        assert!(line("1  file:").ends_with("readers 1"), "{out}");
    }
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

#[test]
fn a_wrong_sglang_kernels_library_is_refused_before_the_bench() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "bench",
            "--quick",
            "--scenario",
            "spec-swap-in",
            "--executor",
            "cpu",
        ])
        .env(
            "KVTIER_SGLANG_KERNELS",
            "/nonexistent/libkvt_sglang_kernels.so",
        )
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("KVTIER_SGLANG_KERNELS") && err.contains("scripts/sglang-kernels.sh"),
        "{err}"
    );
}

/// Without a GPU the selftest checks nothing and says so with its own exit
/// code; with `--cpu` it runs every check on the CPU executor (a dry run),
/// prints the table and writes a JSON line per check. (scripts/test.sh runs
/// the release build's dry run with the link measurements.)
#[test]
fn selftest_says_when_there_is_no_gpu_and_dry_runs_on_the_cpu() {
    if let kvtier::cuda::DriverStatus::Ready { devices, .. } = kvtier::cuda::probe_driver()
        && devices > 0
    {
        eprintln!("a GPU is here: `kvtier selftest` itself runs in the GPU suite");
    } else {
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .arg("selftest")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(77), "{stdout}");
        assert!(
            stdout.contains("no usable GPU, nothing was checked"),
            "{stdout}"
        );
    }

    let dir = std::env::temp_dir().join(format!("kvtier-cli-selftest-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("selftest.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["selftest", "--cpu", "--cases", "3", "--no-link", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("a dry run of the selftest"), "{stdout}");
    for check in [
        "gather (random, half hostile)",
        "writeback, every layer",
        "swap-in, DSA tokens, linear rows",
        "swap-in, DeepSeek-V4 page-padded C4 rows",
        "swap-in, MiniMax-M3 blocks, K and V",
        "miss-plan replay",
        "swap-in, HOT 4096, K 2048, 2 and 410 misses",
        "graph replays (CPU: calls repeated, no graph)",
    ] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with("PASS") && l.contains(check)),
            "no passing row for {check}:\n{stdout}"
        );
    }
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("skip") && l.contains("--no-link")),
        "{stdout}"
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&json)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 11, "{lines:?}");
    assert!(lines.iter().all(|l| l["result"] != "FAIL"), "{lines:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_operator_can_always_get_out() {
    let dir = std::env::temp_dir().join(format!("kvtier-cli-exits-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dev = |n: &str| format!("file:{}/{n}", dir.display());
    let create = |extra: &[&str], d: &str| {
        kvtier(
            &[
                &[
                    "pool",
                    "create",
                    "--device",
                    &format!("{d}:4MiB"),
                    "--layers",
                    "2",
                    "--tokens",
                    "16",
                ][..],
                extra,
            ]
            .concat(),
        )
    };

    // a pool shared by several hosts is destroyed with this host's index
    let shared = dev("shared");
    let (ok, _, err) = create(&["--hosts", "2", "--host", "0"], &shared);
    assert!(ok, "{err}");
    let (ok, _, err) = kvtier(&["pool", "destroy", "--device", &shared]);
    assert!(!ok && err.contains("--hosts/--host"), "{err}");
    let (ok, out, err) = kvtier(&[
        "pool", "destroy", "--device", &shared, "--hosts", "2", "--host", "1",
    ]);
    assert!(ok && out.contains("destroyed"), "{err}");

    // a pool that cannot be trusted: a corrupt header, then a shrunk device
    for damage in ["header", "shrunk"] {
        let d = dev(damage);
        let path = dir.join(damage);
        let (ok, _, err) = create(&[], &d);
        assert!(ok, "{err}");
        // a process attached before the damage still maps the pool
        let spec: kvtier::DeviceSpec = d.parse().unwrap();
        let holder = kvtier::Pool::open(vec![spec], kvtier::PoolOptions::default()).unwrap();
        if damage == "header" {
            let mut bytes = std::fs::read(&path).unwrap();
            bytes[40] ^= 0xff; // inside the checksummed header
            std::fs::write(&path, bytes).unwrap();
        } else {
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(1 << 20)
                .unwrap();
        }
        let (ok, _, _) = kvtier(&["pool", "status", "--device", &d]);
        assert!(!ok, "{damage}: status of a damaged pool");
        let (ok, _, err2) = create(&[], &d);
        assert!(!ok && err2.contains("destroy it first"), "{damage}: {err2}");
        let (ok, _, err) = kvtier(&["pool", "destroy", "--device", &d]);
        assert!(
            !ok && err.contains("pool destroy --force` clears its headers"),
            "{damage}: {err}"
        );
        // while a process still maps it, even force refuses
        let (ok, _, err) = kvtier(&["pool", "destroy", "--force", "--device", &d]);
        assert!(
            !ok && err.contains("processes still map"),
            "{damage}: {err}"
        );
        drop(holder);
        let (ok, out, err) = kvtier(&["pool", "destroy", "--force", "--device", &d]);
        assert!(
            ok && out.contains("found: ") && out.contains("destroyed"),
            "{damage}: {out}{err}"
        );
        let (ok, _, err) = create(&[], &d);
        assert!(
            ok,
            "{damage}: a new pool after destroying the damaged one: {err}"
        );
        let _ = err;
    }

    // a file that holds no pool is never written by destroy --force
    let other = dir.join("not-a-pool");
    let precious: Vec<u8> = b"precious bytes, not a pool "
        .iter()
        .copied()
        .cycle()
        .take(64 << 10)
        .collect();
    std::fs::write(&other, &precious).unwrap();
    std::fs::set_permissions(&other, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let (ok, _, err) = kvtier(&[
        "pool",
        "destroy",
        "--force",
        "--device",
        &format!("file:{}", other.display()),
    ]);
    assert!(!ok && err.contains("no kvtier pool"), "{err}");
    assert_eq!(std::fs::read(&other).unwrap(), precious);

    // anon: and numa: pools live in the process that makes them: every pool
    // command says so instead of making one that vanishes or failing later
    for cmd in [
        &["create", "--layers", "2", "--tokens", "16"][..],
        &["status"],
        &["check"],
        &["destroy", "--force"],
    ] {
        for d in ["anon:64MiB", "numa:0:64MiB"] {
            let (ok, out, err) = kvtier(&[&["pool"][..], cmd, &["--device", d]].concat());
            assert!(
                !ok && err.contains("lives only inside the process that makes it"),
                "{cmd:?} {d}: {out}{err}"
            );
            assert!(!out.contains("created pool"), "{out}");
        }
    }
    let (_, out, _) = kvtier(&["pool", "status", "--help"]);
    assert!(
        out.contains("file:PATH") && out.contains("dax:PATH") && out.contains("anon: and numa:"),
        "{out}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn create_warns_of_a_pool_file_that_a_gpu_cannot_register() {
    // a file on a disk filesystem (the build directory's, when it is one)
    // and one on tmpfs: only the first is warned about
    let disk = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("kvtier-disk-{}", std::process::id()));
    // tmpfs, ramfs and hugetlbfs pages can be pinned; any other filesystem's not
    let pinnable_fs = |p: &std::path::Path| {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: statfs is plain data, filled for a valid path.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::statfs(c.as_ptr(), &mut st) }, 0);
        [0x0102_1994_i64, 0x8584_58f6, 0x9584_58f6].contains(&(st.f_type as i64))
    };
    let dir_of = |p: &std::path::Path| p.parent().unwrap().to_path_buf();
    for (path, expect_warning) in [
        (disk.clone(), !pinnable_fs(&dir_of(&disk))),
        (
            std::path::PathBuf::from(format!("/dev/shm/kvtier-shm-{}", std::process::id())),
            false,
        ),
    ] {
        if !dir_of(&path).is_dir() {
            continue;
        }
        let spec = format!("file:{}:4MiB", path.display());
        let (ok, _, err) = kvtier(&[
            "pool", "create", "--device", &spec, "--layers", "2", "--tokens", "16",
        ]);
        let _ = std::fs::remove_file(&path);
        assert!(ok, "{err}");
        assert_eq!(
            err.contains("cannot be pinned"),
            expect_warning,
            "{}: {err}",
            path.display()
        );
    }
}

#[test]
fn plan_answers_in_json_a_table_and_a_plot() {
    let args = [
        "plan",
        "--context",
        "128K",
        "--hbm-for-kv",
        "40GiB",
        "--dram-for-kv",
        "1024GiB",
    ];
    let (ok, out, err) = kvtier(&[&args[..], &["--json"]].concat());
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    // by hand: 61 × 656 B on the host, 61 × 132 B of indexer keys in HBM;
    // 1 TiB / (8 GPUs × 5,244,977,152 B) = 26 requests per GPU: host memory binds
    assert_eq!(v["host_bytes_per_token"], 40016.0);
    assert_eq!(v["hbm_bytes_per_token"], 8052.0);
    assert_eq!(v["max_requests"], 208);
    assert_eq!(v["limited_by"], "host_memory");
    assert_eq!(
        v["configurations"].as_array().unwrap().len(),
        1,
        "no CXL given"
    );
    // with CXL, HBM binds (35 per GPU)
    let (ok, out, err) = kvtier(&[&args[..], &["--cxl", "512GiB@30", "--json"]].concat());
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        (v["max_requests"].as_u64(), v["limited_by"].as_str()),
        (Some(280), Some("hbm"))
    );
    assert_eq!(
        v["configurations"][1]["requests_per_gpu_allowed_by"]["cxl_bandwidth"],
        68
    );
    // the table, and a plot
    let dir = std::env::temp_dir().join(format!("kvtier-cli-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let png = dir.join("plan.png");
    let (ok, out, err) = kvtier(
        &[
            &args[..],
            &["--cxl", "512GiB", "--plot", png.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(ok, "{err}");
    assert!(
        out.contains("DRAM only") && out.contains("DRAM + CXL") && out.contains("limited by"),
        "{out}"
    );
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
    // a model file: DeepSeek-V4's C4 layers, four tokens an entry
    let model = dir.join("model.json");
    std::fs::write(
        &model,
        r#"{"name": "c4", "offloaded_layers": 21, "entry_bytes": 585, "tokens_per_entry": 4,
            "indexer_layers": 21, "indexer_entry_bytes": 132, "top_k": 512, "hot_slots": 4096,
            "page_entries": 64, "max_context": 1048576}"#,
    )
    .unwrap();
    let (ok, out, err) = kvtier(&[
        "plan",
        "--model-file",
        model.to_str().unwrap(),
        "--context",
        "1M",
        "--hbm-for-kv",
        "40GiB",
        "--dram-for-kv",
        "1024GiB",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["host_bytes_per_token"], 21.0 * 585.0 / 4.0);
    assert_eq!(v["host_bytes_per_request"], 21.0 * 585.0 * 262144.0);
    // bad input is named by its flag
    for (bad, flag) in [
        (&["--context", "0"][..], "--context"),
        (&["--context", "200K"][..], "--context"),
        (&["--context", "128K", "--tp", "3"][..], "--tp"),
        (
            &["--context", "128K", "--miss-rate", "2"][..],
            "--miss-rate",
        ),
        (&["--context", "128K", "--cxl", "1GiB@fast"][..], "--cxl"),
        (&["--context", "128K", "--model", "glm-5"][..], "--model"),
    ] {
        let (ok, _, err) = kvtier(
            &[
                &["plan", "--hbm-for-kv", "40GiB", "--dram-for-kv", "1TiB"][..],
                bad,
            ]
            .concat(),
        );
        assert!(!ok && err.contains(flag), "{bad:?}: {err}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn pool_status_json_counts_per_device_and_per_client() {
    let dir = std::path::PathBuf::from(if std::path::Path::new("/dev/shm").is_dir() {
        "/dev/shm"
    } else {
        "/tmp"
    })
    .join(format!("kvtier-cli-status-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (
        format!("file:{}/a", dir.display()),
        format!("file:{}/b", dir.display()),
    );
    let (ok, _, err) = kvtier(&[
        "pool",
        "create",
        "--device",
        &format!("{a}:4MiB"),
        "--device",
        &format!("{b}:4MiB"),
        "--layers",
        "2",
        "--tokens",
        "16",
    ]);
    assert!(ok, "{err}");
    // rank 0 holds two regions on device 0 (one published), rank 1 one on device 1
    let p0 = open_as_rank(&[&a, &b], 0, 2);
    let p1 = open_as_rank(&[&a, &b], 1, 2);
    let r = [
        p0.alloc_region().unwrap(),
        p0.alloc_region().unwrap(),
        p1.alloc_region().unwrap(),
    ];
    p0.publish(&r[0]).unwrap();
    assert_eq!((r[0].device(), r[1].device(), r[2].device()), (0, 0, 1));
    let (ok, out, err) = kvtier(&["pool", "status", "--json", "--device", &a, "--device", &b]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["regions"]["allocated"], 2);
    assert_eq!(v["regions"]["ready"], 1);
    let dev = |i: usize, k: &str| v["devices"][i][k].as_u64().unwrap();
    assert_eq!(
        (
            dev(0, "allocated"),
            dev(0, "ready"),
            dev(1, "allocated"),
            dev(1, "ready")
        ),
        (1, 1, 1, 0)
    );
    assert_eq!(dev(0, "free") + 2, dev(0, "regions"));
    assert!(
        v["devices"][0]["residency"]["sampled_pages"]
            .as_u64()
            .unwrap()
            > 0
    );
    let clients = v["clients"].as_array().unwrap();
    let me = std::process::id() as u64;
    assert_eq!(clients.len(), 2, "{clients:?}");
    let held: Vec<(u64, u64)> = clients
        .iter()
        .map(|c| {
            assert_eq!(
                (c["pid"].as_u64(), c["liveness"].as_str()),
                (Some(me), Some("alive"))
            );
            (
                c["allocated"].as_u64().unwrap(),
                c["ready"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(held.contains(&(1, 1)) && held.contains(&(1, 0)), "{held:?}");
    assert!(
        clients.iter().all(|c| c.get("published").is_none()),
        "nothing published yet"
    );

    // What this process publishes (its swap-in counters, say) shows with its
    // client entries; a file that is not what a client writes is reported.
    let run = dir.join("run");
    std::fs::create_dir_all(&run).unwrap();
    let status = || {
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .args(["pool", "status", "--json", "--device", &a, "--device", &b])
            .env("KVTIER_RUN_DIR", &run)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["clients"].as_array().unwrap().clone()
    };
    // (written as a client writes it: <run dir>/<pool uuid>/<pid>.json; the
    // library's own writer is tested in src/pool/stats.rs)
    let uuid: String = p0.uuid().iter().map(|b| format!("{b:02x}")).collect();
    std::fs::create_dir_all(run.join(&uuid)).unwrap();
    let published = run.join(&uuid).join(format!("{me}.json"));
    let stats = serde_json::json!({"totals": {"cuda:0": {"hits": 7, "misses": 3}}});
    std::fs::write(&published, stats.to_string()).unwrap();
    for c in status() {
        assert_eq!(c["published"], stats, "{c}");
        assert!(c["published_age_s"].as_f64().unwrap() < 60.0, "{c}");
    }
    std::fs::write(&published, "{truncated").unwrap();
    for c in status() {
        assert!(c.get("published").is_none(), "{c}");
        assert!(
            c["published_error"]
                .as_str()
                .unwrap()
                .contains("not a JSON object"),
            "{c}"
        );
    }
    drop((p0, p1)); // a clean exit frees their regions
    std::fs::remove_dir_all(dir).unwrap();
}

/// `kvtier trace synth` writes a trace that says it is synthetic, and `kvtier
/// plan --trace` replays it at each size asked for; a broken trace file is
/// one line naming the line, exit 1.
#[test]
fn plan_replays_a_trace_at_each_hot_size() {
    let dir = std::env::temp_dir().join(format!("kvtier-cli-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("t.jsonl");
    let f = file.to_str().unwrap();
    let (ok, out, err) = kvtier(&[
        "trace",
        "synth",
        "-o",
        f,
        "--requests",
        "2",
        "--layers",
        "3",
        "--steps",
        "10",
        "--context",
        "1000",
        "--top-k",
        "64",
        "--hot",
        "128",
        "--recent",
        "8",
    ]);
    assert!(ok && out.contains("not a measurement"), "{out}{err}");
    let (ok, out, err) = kvtier(&["plan", "--trace", f, "--hot", "64,128,512", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["synthetic"], true);
    assert_eq!(v["recorded_hot"], 128);
    let curve = v["curve"].as_array().unwrap();
    assert_eq!(
        curve
            .iter()
            .map(|p| p["hot"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [64, 128, 512]
    );
    for p in curve {
        assert_eq!(p["per_layer"].as_array().unwrap().len(), 3);
        let (h, m) = (p["hits"].as_u64().unwrap(), p["misses"].as_u64().unwrap());
        assert!(
            m > 0 && (p["miss_rate"].as_f64().unwrap() - m as f64 / (h + m) as f64).abs() < 1e-12
        );
        assert_eq!(p["per_layer"][0]["calls"], 10);
    }
    let (ok, out, err) = kvtier(&["plan", "--trace", f]);
    assert!(
        ok && out.contains("SYNTHETIC") && out.contains("miss rate"),
        "{out}{err}"
    );
    let (ok, _, err) = kvtier(&["plan", "--trace", f, "--hot", "32"]);
    assert!(!ok && err.contains("cannot hold a query of 64"), "{err}");
    let (ok, _, err) = kvtier(&["plan", "--trace", f, "--context", "128K"]);
    assert!(!ok && err.contains("--context"), "{err}");
    std::fs::write(
        &file,
        "{\"kvtier_trace\": 1, \"hot\": 8}\n{\"layer\": 0, \"rows\": 3}\n",
    )
    .unwrap();
    let (ok, out, err) = kvtier(&["plan", "--trace", f]);
    assert!(
        !ok && out.is_empty() && err.contains("line 2") && !err.contains("panicked"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
