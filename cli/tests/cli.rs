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
fn quick_bench_runs_every_scenario_and_method_and_writes_json_and_figures() {
    let dir = std::env::temp_dir().join(format!("kvtier-cli-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, figures) = (dir.join("bench.jsonl"), dir.join("figures"));
    // a hung-builds file naming the split planner: made by an earlier run
    let hung = dir.join("hung-builds.txt");
    std::fs::write(&hung, "split planner\n").unwrap();
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
        figures.to_str().unwrap(),
        "--hung-builds",
        hung.to_str().unwrap(),
    ]);
    // Kept as it was (no build hung). Where the GPU launches clusters the
    // split planner is skipped as hung, named, and the run ends with an error
    // after writing everything; elsewhere (the CPU executor) it never runs.
    assert_eq!(std::fs::read_to_string(&hung).unwrap(), "split planner\n");
    assert!(!out.contains("split planner (a cluster a row"), "{out}");
    if out.contains("note: split planner failed at") {
        assert!(
            !ok && err.contains("split planner failed at")
                && err.contains("skipped: an earlier run found it hung"),
            "{err}"
        );
    } else {
        assert!(ok, "{err}");
    }
    assert!(
        out.contains("wrote 7 figures to") && out.contains("headline.png, gather.png"),
        "{out}"
    );
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
            "q1_us",
            "q3_us",
            "p99_us",
            "gbps",
            "ratio_to_limit",
            "timestamp",
        ] {
            assert!(l.get(key).is_some(), "{key} missing in {l}");
        }
        assert!(l["median_us"].as_f64().unwrap() > 0.0, "{l}");
        // the kernels' compiler, which tells two builds of one commit apart
        assert_eq!(
            l["kernels"],
            serde_json::json!(kvtier::cuda::kernels::BUILD.compiler()),
            "{l}"
        );
        let q = |k: &str| l[k].as_f64().unwrap();
        assert!(
            q("q1_us") <= q("median_us")
                && q("median_us") <= q("q3_us")
                && q("q3_us") <= q("max_us"),
            "{l}"
        );
    }
    let count = |scenario: &str| lines.iter().filter(|l| l["scenario"] == scenario).count();
    // gather: 2 batches × 1 k × 1 entry × 1 context × 2 index kinds, 5 methods
    assert_eq!(count("gather"), 2 * 2 * 5, "{out}");
    // swap-in: 2 batches × 1 hot × 2 miss counts, 4 methods on the CPU, 5 on CUDA
    assert_eq!(count("swap-in"), 2 * 2 * if cpu { 4 } else { 5 }, "{out}");
    // writeback: 1 prefill chunk from scattered and from in-order source
    // rows + 2 decode batches, 4 methods
    assert_eq!(count("writeback"), 4 * 4, "{out}");
    for sources in ["scattered", "in order"] {
        let prefill = |l: &&serde_json::Value| {
            l["scenario"] == "writeback" && l["params"]["sources"] == sources
        };
        assert_eq!(lines.iter().filter(prefill).count(), 4, "{sources}: {out}");
    }
    // speculative swap-in: 2 batches × 2 step counts × 2 miss counts, 2
    // methods
    let spec = 2 * 2 * 2;
    assert_eq!(count("spec-swap-in"), spec * 2, "{out}");
    // Engram gather: 2 token counts (1 and 64, 24 rows each), 4 methods
    // (unsorted and sorted reads, the limit, SGLang's staging)
    assert_eq!(count("engram-gather"), 2 * 4, "{out}");
    // decode step: 3 recipes (one a model) × (3 measured steps + all), kvtier
    // and the floor on the CPU, SGLang's kernel beside them on CUDA where
    // its harness is given (not here)
    let steps = 3 * (3 + 1);
    assert_eq!(count("decode-step"), steps * 2, "{out}");
    // every point has one limit, at ratio 1, and the others' ratios
    for l in lines.iter().filter(|l| l["is_limit"] == true) {
        assert_eq!(l["ratio_to_limit"].as_f64(), Some(1.0), "{l}");
    }
    assert_eq!(
        lines.iter().filter(|l| l["is_limit"] == true).count(),
        4 + 4 + 4 + spec + 2 + steps
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

    for name in [
        "headline",
        "gather",
        "swap-in",
        "spec-swap-in",
        "writeback",
        "decode-step",
    ] {
        let png = std::fs::read(figures.join(format!("{name}.png"))).unwrap();
        assert!(
            png.starts_with(b"\x89PNG") && png.len() > 10_000,
            "{name}.png was drawn"
        );
    }

    // The same figures from the JSON alone, as from committed results.
    let again = dir.join("again");
    let (ok, out, err) = kvtier(&[
        "bench",
        "--from-json",
        json.to_str().unwrap(),
        "--plot",
        again.to_str().unwrap(),
    ]);
    assert!(ok && out.contains("wrote 7 figures"), "{out}{err}");
    assert!(!out.contains("executor:"), "measures nothing: {out}");
    for name in ["headline", "writeback"] {
        let a = std::fs::read(figures.join(format!("{name}.png"))).unwrap();
        let b = std::fs::read(again.join(format!("{name}.png"))).unwrap();
        assert!(a == b, "{name}.png is drawn from the JSON in both cases");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The decode step lays each committed model's trace out as SGLang's entry
/// point for it does (the path from the trace's header): DeepSeek-V3.2's
/// linear rows, DeepSeek-V4-Flash's C4 pages of 64 rows, MiniMax-M3's K and
/// V planes of half the trace's 512 B item each. Its check reads every
/// piece of a missed row on every plane where the layout puts it, so a
/// replay whose kernels were given another layout stops; the JSON and the
/// summary say which layout ran, so one back on a linear plane fails here.
#[test]
fn the_decode_step_lays_each_trace_out_as_its_sglang_path_does() {
    let dir = std::env::temp_dir().join(format!("kvtier-cli-decode-paths-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("d.jsonl");
    let (ok, out, err) = kvtier(&[
        "bench",
        "--scenario",
        "decode-step",
        "--quick",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&json)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for (source, path, planes, page_rows, entry, said) in [
        (
            "dsv32-32k-b8",
            "mla",
            1,
            1,
            656,
            "path mla, laid out as linear rows of 656 B;",
        ),
        (
            "dsv4flash-32k-b8",
            "dsv4-c4",
            1,
            64,
            584,
            "path dsv4-c4, laid out as DeepSeek-V4's C4 pages (64 rows of 576 B values and 8 B scales \
             in separate runs, 37440 B a page);",
        ),
        (
            "m3-32k-b8",
            "m3-kv",
            2,
            1,
            512,
            "path m3-kv, laid out as two planes, K and V, of 256 B rows;",
        ),
    ] {
        let mine: Vec<&serde_json::Value> = lines
            .iter()
            .filter(|l| l["scenario"] == "decode-step" && l["params"]["source"] == source)
            .collect();
        // 3 measured steps and all, kvtier's and the floor's line each
        assert_eq!(mine.len(), 4 * 2, "{source}: {out}");
        for l in mine {
            let p = &l["params"];
            assert_eq!(
                (&p["path"], &p["planes"], &p["page_rows"], &p["entry"]),
                (
                    &serde_json::json!(path),
                    &serde_json::json!(planes),
                    &serde_json::json!(page_rows),
                    &serde_json::json!(entry)
                ),
                "{source}: {l}"
            );
            // every plane's piece of every miss
            assert_eq!(
                l["bytes"].as_u64(),
                Some(p["misses_total"].as_u64().unwrap() * entry),
                "{l}"
            );
        }
        assert!(
            out.contains(&format!("decode-step {source}: {said}")),
            "{source}: {out}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_engram_bench_refuses_more_ids_than_table_rows() {
    // the limit copies as many rows' bytes as there are ids: a table
    // smaller than that is refused, not read past
    let (ok, _, err) = kvtier(&[
        "bench",
        "--scenario",
        "engram-gather",
        "--engram-rows",
        "100",
        "--engram-tokens",
        "8192",
    ]);
    assert!(
        !ok && err.contains("--engram-rows") && err.contains("196608"),
        "{err}"
    );
}

#[test]
fn figures_from_json_name_a_bad_line_and_the_plot_takes_a_folder() {
    let dir = std::env::temp_dir().join(format!("kvtier-cli-figures-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, "{\"scenario\": \"gather\"}\n").unwrap();
    let out_dir = dir.join("out");
    let (ok, _, err) = kvtier(&[
        "bench",
        "--from-json",
        bad.to_str().unwrap(),
        "--plot",
        out_dir.to_str().unwrap(),
    ]);
    assert!(
        !ok && err.contains("bad.jsonl:1: not a measurement of kvtier bench --json"),
        "{err}"
    );
    let empty = dir.join("empty.jsonl");
    std::fs::write(&empty, "\n").unwrap();
    let (ok, _, err) = kvtier(&[
        "bench",
        "--from-json",
        empty.to_str().unwrap(),
        "--plot",
        out_dir.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("holds no measurements"), "{err}");
    // --from-json draws: without --plot it has nowhere to
    let (ok, _, err) = kvtier(&["bench", "--from-json", bad.to_str().unwrap()]);
    assert!(!ok && err.contains("--plot"), "{err}");
    // a PNG path, as --plot took before the figures were several
    let (ok, _, err) = kvtier(&["bench", "--quick", "--plot", "/tmp/kvtier-figure.png"]);
    assert!(
        !ok && err.contains("takes a folder for the figures"),
        "{err}"
    );
    let file = dir.join("a-file");
    std::fs::write(&file, "").unwrap();
    let (ok, _, err) = kvtier(&["bench", "--quick", "--plot", file.to_str().unwrap()]);
    assert!(!ok && err.contains("is a file, not a folder"), "{err}");
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

/// The swap-in's DeepSeek-V4 C4 and MiniMax-M3 K/V paths with the flags of
/// the GPU suite's quick grid (scripts/gpu-suite/3-bench.sh), on the CPU
/// executor: every point's rows are there, labelled with their path, and
/// move every piece of every miss.
#[test]
fn the_swap_in_times_deepseek_v4s_c4_path_and_minimax_m3s_kv_path() {
    let script = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scripts/gpu-suite/3-bench.sh"
    ))
    .unwrap();
    // the flags the suite gives each path, and the quick grid's use of them
    let flags_of = |name: &str| -> Vec<String> {
        let line = script
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}=(")))
            .unwrap_or_else(|| panic!("3-bench.sh defines no {name}"));
        line.trim_end_matches(')')
            .split_whitespace()
            .map(String::from)
            .collect()
    };
    // the quick grid: its branch, and the swap-in grids it runs through
    // quick_swap_in_grids (shared with the follow-up's part 3)
    let branch = script
        .split("elif [ \"$quick\" = 1 ]")
        .nth(1)
        .and_then(|rest| rest.split("elif").next())
        .expect("3-bench.sh has a quick grid");
    assert!(branch.contains("  quick_swap_in_grids\n"), "{branch}");
    let grids = script
        .split("quick_swap_in_grids() {")
        .nth(1)
        .and_then(|rest| rest.split("\n}").next())
        .expect("3-bench.sh defines quick_swap_in_grids");
    let quick = format!("{branch}{grids}");
    // (path, k, entry, misses, block tokens, planes)
    for (name, path, k, entry, misses, block, planes) in [
        ("dsv4_c4", "dsv4-c4", 512, 584, 34, None, 1),
        ("m3_kv", "m3-kv", 16, 256, 274, Some(128), 2),
    ] {
        assert!(
            quick.contains(&format!("\"${{{name}[@]}}\"")),
            "the quick grid has no {name} rows"
        );
        let mut args: Vec<String> = flags_of(name);
        assert!(args.contains(&path.to_string()), "{name}: {args:?}");
        args.extend(
            ["--batch", "1,3", "--iters", "2", "--warmup", "1"]
                .iter()
                .map(|s| s.to_string()),
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (out, _, lines) = cpu_bench(name, &args);
        let methods = [
            "kvtier swap-in (CPU executor)",
            "contiguous memcpy of the misses (limit)",
            "per-miss memcpy",
            "host gather of the misses + one memcpy",
        ];
        // 2 batches, 1 HOT size, 1 miss count: every method at each
        assert_eq!(lines.len(), 2 * methods.len(), "{out}");
        for l in &lines {
            let p = &l["params"];
            assert_eq!(l["scenario"], "swap-in", "{l}");
            assert!(methods.contains(&l["method"].as_str().unwrap()), "{l}");
            assert_eq!(p["path"], path, "{l}");
            assert_eq!(p["k"], k, "{l}");
            assert_eq!(p["entry"], entry, "{l}");
            assert_eq!(p["misses"], misses, "{l}");
            assert_eq!(p["hot"], 4096, "{l}");
            assert_eq!(p.get("block_tokens").and_then(|b| b.as_u64()), block, "{l}");
            // every piece of every plane of each request's misses
            let batch = p["batch"].as_u64().unwrap();
            assert_eq!(l["bytes"], batch * misses * entry * planes, "{l}");
            assert!(l["median_us"].as_f64().unwrap() > 0.0, "{l}");
        }
        for batch in [1, 3] {
            let at = lines.iter().filter(|l| l["params"]["batch"] == batch);
            assert_eq!(at.count(), methods.len(), "batch {batch}: {out}");
        }
    }

    // refused: the C4 layout's fixed rows resized, a path outside the
    // swap-in grid, a query wider than the HOT buffer, more misses than
    // entries
    let swap_in = ["bench", "--scenario", "swap-in", "--swap-path"];
    for (args, said) in [
        (&["dsv4-c4", "--entry", "656"][..], &["--entry", "C4"][..]),
        (
            &["m3-kv", "--hot", "4096", "--swap-k", "40"],
            &["--swap-k", "40 blocks of 128 tokens"],
        ),
        (&["dsv4-c4", "--misses", "600"], &["--misses", "512"]),
    ] {
        let (ok, _, err) = kvtier(&[&swap_in[..], args].concat());
        assert!(
            !ok && said.iter().all(|s| err.contains(s)),
            "{args:?}: {err}"
        );
    }
    let (ok, _, err) = kvtier(&["bench", "--quick", "--swap-path", "m3-kv"]);
    assert!(
        !ok && err.contains("--swap-path") && err.contains("--scenario swap-in"),
        "{err}"
    );
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
        "/tmp/kvtier-p",
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
        out.contains("created pool") && out.contains("on 2 devices:"),
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
        assert!(line("0  file:").ends_with("  2"), "{out}");
        assert!(line("1  file:").ends_with("  1"), "{out}");
        // the header names every column the rows have
        let header = line("#  device");
        for column in ["size", "regions", "free", "requests"] {
            assert!(header.contains(column), "{header}");
        }
        // pages reserved but not yet touched here are said to be that
        assert!(
            out.contains("not touched by this process yet (reserved")
                && !out.contains("not present"),
            "{out}"
        );
    }
    let (ok, out, err) = kvtier(&[&["pool", "check", "--repair"][..], &devs].concat());
    assert!(ok, "{err}");
    assert!(
        out.contains("valid") && out.contains("reclaimed 0 client slots and 0 regions"),
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
    assert!(
        out.contains("--remove-files"),
        "says how to free the files: {out}"
    );
    let (ok, _, err) = kvtier(&[&["pool", "status"][..], &devs].concat());
    assert!(!ok && err.contains("no kvtier pool"), "{err}");
    // the files of a destroyed pool go on request, and nothing else does
    let other = dir.join("other");
    std::fs::write(&other, b"another program's bytes").unwrap();
    let (ok, _, err) = kvtier(
        &[
            &["pool", "destroy", "--remove-files"][..],
            &devs,
            &["--device", &format!("file:{}", other.display())],
        ]
        .concat(),
    );
    assert!(!ok, "{err}");
    assert!(
        std::path::Path::new(&a[5..]).exists() && other.exists(),
        "nothing removed"
    );
    let (ok, out, err) = kvtier(&[&["pool", "destroy", "--remove-files"][..], &devs].concat());
    assert!(ok && out.contains("removed"), "{out}{err}");
    assert!(!std::path::Path::new(&a[5..]).exists() && !std::path::Path::new(&b[5..]).exists());
    std::fs::remove_dir_all(dir).unwrap();
}

/// The pool page's commands, as written (their files moved to a scratch
/// directory): they fit a laptop (at most 4 GiB in all), and they run,
/// leaving no file behind.
///
/// The pool reserves every byte of its files when it creates them, so the
/// scratch directory is on a filesystem with room for them: `/dev/shm`, where
/// the page puts them, when it has the room (a CI machine's disk may not: one
/// had 992 MiB free in `/tmp`), else the temporary directory.
#[test]
fn the_pool_pages_commands_fit_a_laptop_and_run() {
    let page =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/pool.md")).unwrap();
    let block = page
        .split("```bash\n")
        .find(|b| b.starts_with("kvtier pool create"))
        .expect("docs/pool.md's pool example")
        .split("```")
        .next()
        .unwrap();
    let commands: Vec<&str> = block
        .lines()
        .map(|line| line.split('#').next().unwrap().trim())
        .filter(|c| !c.is_empty())
        .collect();
    let total: u64 = commands
        .iter()
        .flat_map(|c| c.split_whitespace())
        .filter_map(|w| w.strip_prefix("file:").and_then(|f| f.rsplit_once(':')))
        .map(|(_, size)| kvtier::pool::parse_size(size).unwrap())
        .sum();
    assert!(
        total > 0 && total <= 4 << 30,
        "the example's devices take {total} B"
    );
    let free = |dir: &std::path::Path| -> u64 {
        let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
            return 0;
        };
        // SAFETY: statvfs is plain data, filled by statvfs on a valid C string.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
            return 0;
        }
        (st.f_bavail as u64).saturating_mul(st.f_frsize as u64)
    };
    let candidates = [std::path::PathBuf::from("/dev/shm"), std::env::temp_dir()];
    let base = candidates
        .iter()
        .find(|d| free(d) >= total + (64 << 20))
        .unwrap_or_else(|| {
            panic!(
                "no filesystem here has room for the pool page's example ({total} B): {}",
                candidates
                    .iter()
                    .map(|d| format!("{} has {} B free", d.display(), free(d)))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        });
    let dir = base.join(format!("kvtier-cli-docs-pool-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for command in commands {
        let words: Vec<String> = command
            .split_whitespace()
            .skip(1) // "kvtier"
            .map(|w| w.replace("/dev/shm/", &format!("{}/", dir.display())))
            .collect();
        let args: Vec<&str> = words.iter().map(String::as_str).collect();
        let (ok, _, err) = kvtier(&args);
        if !ok {
            let _ = std::fs::remove_dir_all(&dir);
        }
        assert!(ok, "{command}: {err}");
    }
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "destroy --remove-files left files"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// The first screen's modelled gain is what `kvtier plan` answers for the
/// inputs it states.
#[test]
fn the_first_screens_modelled_gain_is_kvtier_plans() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let glance = readme.split("**At a glance.**").nth(1).unwrap();
    let glance = glance.split("**Contents:**").next().unwrap();
    let number = |after: &str| -> u64 {
        let rest = glance
            .split(after)
            .nth(1)
            .unwrap_or_else(|| panic!("{after:?} in the first screen"));
        rest.split_whitespace().next().unwrap().parse().unwrap()
    };
    let (without, with, published) = (
        number("512 GiB of DRAM holds"),
        number("in a kvtier pool it holds"),
        number("but only"),
    );
    let plan = |cxl: &[&str]| -> u64 {
        let base = [
            "plan",
            "--context",
            "128K",
            "--hbm-for-kv",
            "40GiB",
            "--dram-for-kv",
            "512GiB",
            "--json",
        ];
        let (ok, out, err) = kvtier(&[&base[..], cxl].concat());
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        v["max_requests"].as_u64().unwrap()
    };
    let two = ["--cxl", "512GiB@30", "--cxl", "512GiB@30"];
    // the text's 2 %, then plan's default (the published rate)
    assert_eq!(without, plan(&["--miss-rate", "0.02"]));
    assert_eq!(with, plan(&[&two[..], &["--miss-rate", "0.02"]].concat()));
    assert_eq!(without, plan(&[]));
    assert_eq!(published, plan(&two));
    assert!(glance.contains("published 13.4 %"), "{glance}");
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
/// the release build's dry run; the link is measured on a GPU only.)
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

/// A selftest cut short (a kernel that hangs, a time limit) keeps the JSON
/// lines of the checks it finished: each is on disk before its row shows.
#[test]
fn a_selftest_cut_short_keeps_the_checks_it_finished() {
    use std::io::BufRead;
    let dir = std::env::temp_dir().join(format!("kvtier-cli-selftest-cut-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("selftest.jsonl");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["selftest", "--cpu", "--cases", "3", "--no-link", "--json"])
        .arg(&json)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let first = std::io::BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map(|l| l.unwrap())
        .find(|l| l.starts_with("PASS"))
        .expect("a first passing check");
    child.kill().unwrap();
    child.wait().unwrap();
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&json)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(!lines.is_empty(), "nothing written before {first:?}");
    let check = lines[0]["check"].as_str().unwrap();
    assert!(first.contains(check), "{first:?} against {check:?}");
    assert_eq!(lines[0]["result"], "PASS", "{lines:?}");
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
        // the hand arithmetic below is at 2 % misses per layer and step
        "--miss-rate",
        "0.02",
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
        out.contains("DRAM only") && out.contains("DRAM + CXL"),
        "{out}"
    );
    // headers that say what they count, and every default shown
    assert!(
        out.contains("host KV bytes")
            && out.contains("requests a GPU as each resource allows")
            && out.contains("host mem: requests a GPU by that memory"),
        "{out}"
    );
    let assumed = out.lines().find(|l| l.starts_with("assumed:")).unwrap();
    for default in [
        "8 GPUs (--gpus)",
        "attention TP 1 (--tp)",
        "(--miss-rate)",
        "(--step-ms)",
        "(--link-gbps)",
    ] {
        assert!(assumed.contains(default), "{assumed}");
    }
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
    // what a deployment needs, with a worked example, when it is missing
    let (ok, _, err) = kvtier(&["plan", "--context", "128K"]);
    assert!(
        !ok && err.contains("--hbm-for-kv, --dram-for-kv missing")
            && err.contains("For example: kvtier plan --context 128K"),
        "{err}"
    );
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
        (
            &["--context", "128K", "--model", "deepseek-v4"][..],
            "--model",
        ),
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
    assert_eq!(v["regions"]["joined"], 0);
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
    // exact modes, whatever the umask (a group-writable directory or file is
    // not trusted)
    let mode = |p: &std::path::Path, m: u32| {
        std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(m)).unwrap()
    };
    mode(&run, 0o755);
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
    // (written as a client writes it: <run dir>/kvtier-<uid>/<pool
    // uuid>/<slot>-<generation>.json; the library's own writer is tested in
    // src/pool/stats.rs)
    let uuid: String = p0.uuid().iter().map(|b| format!("{b:02x}")).collect();
    let first = &status()[0];
    let uid = first["uid"].as_u64().unwrap();
    let dir_of_pool = run.join(format!("kvtier-{uid}")).join(&uuid);
    std::fs::create_dir_all(&dir_of_pool).unwrap();
    mode(dir_of_pool.parent().unwrap(), 0o755);
    mode(&dir_of_pool, 0o755);
    let published = dir_of_pool.join(format!("{}-{}.json", first["client"], first["generation"]));
    let stats = serde_json::json!({"totals": {"cuda:0": {"hits": 7, "misses": 3}}});
    std::fs::write(&published, stats.to_string()).unwrap();
    mode(&published, 0o644);
    let mine = |clients: Vec<serde_json::Value>| {
        let c: Vec<serde_json::Value> = clients
            .into_iter()
            .filter(|c| c["client"] == first["client"])
            .collect();
        assert_eq!(c.len(), 1);
        c[0].clone()
    };
    let all = status();
    let c = mine(all.clone());
    assert_eq!(c["published"], stats, "{c}");
    assert!(c["published_age_s"].as_f64().unwrap() < 60.0, "{c}");
    assert!(
        all.iter().filter(|c| c.get("published").is_some()).count() == 1,
        "the other client of this process published nothing: {all:?}"
    );
    std::fs::write(&published, "{truncated").unwrap();
    mode(&published, 0o644);
    let c = mine(status());
    assert!(c.get("published").is_none(), "{c}");
    assert!(
        c["published_error"]
            .as_str()
            .unwrap()
            .contains("not a JSON object"),
        "{c}"
    );
    // planted where a live client's file is (its name is no secret): a FIFO
    // is reported at once, a link is never followed (to /dev/zero, say)
    std::fs::remove_file(&published).unwrap();
    let c_path = std::ffi::CString::new(published.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o644) }, 0);
    let t0 = std::time::Instant::now();
    let c = mine(status());
    assert!(t0.elapsed() < std::time::Duration::from_secs(20));
    assert!(
        c["published_error"].as_str().unwrap().contains("FIFO"),
        "{c}"
    );
    std::fs::remove_file(&published).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &published).unwrap();
    let c = mine(status());
    assert!(
        c["published_error"]
            .as_str()
            .unwrap()
            .contains("symbolic link"),
        "{c}"
    );
    std::fs::remove_file(&published).unwrap();
    // a forged file (another user's) is untrusted, not shown as the client's
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        std::fs::write(&published, stats.to_string()).unwrap();
        mode(&published, 0o644);
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::chown(c_path.as_ptr(), 65534, 65534) }, 0);
        let c = mine(status());
        assert!(c.get("published").is_none(), "{c}");
        let why = c["published_error"].as_str().unwrap();
        assert!(why.starts_with("untrusted") && why.contains("65534"), "{c}");
    }
    drop((p0, p1)); // a clean exit frees their regions
    std::fs::remove_dir_all(dir).unwrap();
}

/// A small trace of many request rows (61 layers × 20 rows, each a long
/// sequence) at HOT 16384 once kept 96 KiB a (layer, row) for the whole
/// replay (114 MiB; a 1.3 MB trace of this kind took 1.5 GB) and aborted
/// under an 80 MB address-space limit; the replay now holds at most
/// `--replay-memory` of states (a group of layers a pass) and answers
/// exactly: one miss a row.
#[test]
fn plan_replays_a_trace_of_many_rows_in_bounded_memory() {
    let dir = std::env::temp_dir().join(format!("kvtier-cli-trace-mem-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("rows.jsonl");
    let mut text = String::from("{\"kvtier_trace\": 1, \"hot\": 16384, \"item_bytes\": 656}\n");
    for layer in 0..61 {
        for req in 0..20 {
            text.push_str(&format!(
                "{{\"layer\": {layer}, \"rows\": [{{\"req\": {req}, \"seq\": 20000, \"topk\": [{req}]}}]}}\n"
            ));
        }
    }
    std::fs::write(&file, &text).unwrap();
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "ulimit -v 80000 && exec {} plan --trace {} --hot 16384 --replay-memory 8MiB --json",
            env!("CARGO_BIN_EXE_kvtier"),
            file.display()
        ))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let p = &v["curve"][0];
    assert_eq!(
        (p["hot"].as_u64(), p["misses"].as_u64(), p["hits"].as_u64()),
        (Some(16384), Some(61 * 20), Some(0))
    );
    assert_eq!(p["bytes"].as_u64(), Some(61 * 20 * 656));
    assert_eq!(v["calls"].as_u64(), Some(61 * 20));
    // a FIFO named as the trace is refused, not waited on
    let fifo = dir.join("fifo.jsonl");
    let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let (ok, _, err) = kvtier(&["plan", "--trace", fifo.to_str().unwrap()]);
    assert!(
        !ok && err.contains("is a FIFO, not a regular file"),
        "{err}"
    );
    // and synth never writes through a link planted at its output
    let target = dir.join("target");
    std::fs::write(&target, "untouched").unwrap();
    let link = dir.join("out.jsonl");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let (ok, _, err) = kvtier(&[
        "trace",
        "synth",
        "-o",
        link.to_str().unwrap(),
        "--steps",
        "1",
    ]);
    assert!(!ok && err.contains("symbolic link"), "{err}");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "untouched");
    let (ok, _, err) = kvtier(&[
        "trace",
        "synth",
        "-o",
        "/dev/null",
        "--requests",
        "100000000",
    ]);
    assert!(!ok && err.contains("synthesize fewer requests"), "{err}");
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

/// A small bench on the CPU executor whose measurements are read back from
/// its JSON: (stdout, stderr, one object per measurement). `name` keeps
/// the tests' files apart.
fn cpu_bench(name: &str, args: &[&str]) -> (String, String, Vec<serde_json::Value>) {
    let dir = std::env::temp_dir().join(format!("kvtier-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("bench.jsonl");
    let mut all = vec![
        "bench",
        "--executor",
        "cpu",
        "--json",
        json.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let (ok, out, err) = kvtier(&all);
    assert!(ok, "{out}{err}");
    let lines = std::fs::read_to_string(&json)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    std::fs::remove_dir_all(&dir).unwrap();
    (out, err, lines)
}

/// One writeback point of each phase, a few bytes: fast on any CPU.
const TINY_WRITEBACK: [&str; 10] = [
    "--scenario",
    "writeback",
    "--batch",
    "1",
    "--prefill-tokens",
    "8",
    "--layers",
    "1",
    "--entry",
    "656",
];

fn samples(lines: &[serde_json::Value]) -> Vec<u64> {
    lines
        .iter()
        .map(|l| l["samples"].as_u64().unwrap())
        .collect()
}

/// The CPU executor's smaller default grid lowers defaults only: flags given
/// keep their values (they were clamped: `--iters 100 --max-seconds 10` ran
/// 20 iterations, `--hot 8192,4096` only 8192), what it lowers is said in
/// one line on stderr, and `--help` gives both defaults.
#[test]
fn cpu_bench_keeps_the_flags_given_and_says_which_defaults_it_lowers() {
    let mut given = TINY_WRITEBACK.to_vec();
    given.extend(["--iters", "100", "--max-seconds", "10", "--warmup", "1"]);
    let (out, err, lines) = cpu_bench("given", &given);
    assert!(!lines.is_empty());
    assert!(samples(&lines).iter().all(|&n| n == 100), "{out}");
    assert!(
        out.contains("timed 100 times") && out.contains("at most 10 s"),
        "{out}"
    );
    assert!(
        !err.contains("lowers the defaults"),
        "nothing was lowered: {err}"
    );

    let (_, _, lines) = cpu_bench(
        "hot",
        &[
            "--scenario",
            "swap-in",
            "--hot",
            "8192,4096",
            "--batch",
            "1",
            "--misses",
            "2",
            "--iters",
            "2",
            "--warmup",
            "1",
        ],
    );
    let mut hots: Vec<u64> = lines
        .iter()
        .map(|l| l["params"]["hot"].as_u64().unwrap())
        .collect();
    hots.dedup();
    assert_eq!(hots, [8192, 4096]);

    // defaults: lowered, and said so once
    let (out, err, lines) = cpu_bench("defaults", &TINY_WRITEBACK);
    assert!(samples(&lines).iter().all(|&n| n == 20), "{out}");
    let notes: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("lowers the defaults"))
        .collect();
    assert_eq!(notes.len(), 1, "{err}");
    for said in [
        "--iters 20 (not 50)",
        "--warmup 3 (not 5)",
        "--max-seconds 1 (not 5)",
        "--full",
    ] {
        assert!(notes[0].contains(said), "{said}: {err}");
    }
    // flags that do not touch the scenario run are not named
    assert!(
        !notes[0].contains("--hot") && !notes[0].contains("--k "),
        "{err}"
    );

    // --quick lowers defaults only too
    let mut quick = vec!["--quick", "--iters", "12"];
    quick.extend_from_slice(&TINY_WRITEBACK);
    let (out, _, lines) = cpu_bench("quick", &quick);
    assert!(samples(&lines).iter().all(|&n| n == 12), "{out}");

    let (ok, help, _) = kvtier(&["bench", "--help"]);
    assert!(ok);
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    for default in [
        "(default 50; the CPU executor's default grid: 20; --quick: 10)",
        "(default 5; the CPU executor's default grid: 3; --quick: 2)",
        "(default 5; the CPU executor's default grid and --quick: 1)",
        "default 4096,8192; the CPU executor's default grid and --quick: 4096)",
    ] {
        assert!(help.contains(default), "{default}: {help}");
    }
}

/// A p99 of fewer than 100 samples is their max: it is reported from 100
/// samples on (JSON `p99_us` null below), the max and the sample count
/// always, in the JSON and the table.
#[test]
fn bench_reports_p99_only_from_enough_samples_and_always_the_max_and_n() {
    let mut few = TINY_WRITEBACK.to_vec();
    few.extend(["--iters", "5", "--warmup", "1"]);
    let (out, _, lines) = cpu_bench("few", &few);
    let header = out.lines().find(|l| l.starts_with("point")).unwrap();
    let columns: Vec<&str> = header
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    for c in ["n", "median µs", "p99 µs", "max µs"] {
        assert!(columns.contains(&c), "{c}: {header}");
    }
    for l in &lines {
        assert!(l["p99_us"].is_null(), "{l}");
        assert_eq!(l["samples"], 5, "{l}");
        assert!(
            l["max_us"].as_f64().unwrap() >= l["median_us"].as_f64().unwrap(),
            "{l}"
        );
    }
    // in the table: n 5, no p99
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("phase ")).collect();
    assert_eq!(rows.len(), lines.len(), "{out}");
    for r in rows {
        let f: Vec<&str> = r.split_whitespace().rev().take(6).collect();
        // vs limit, GB/s, max, p99, median, n
        assert_eq!(
            (f[2].parse::<f64>().is_ok(), f[3], f[5]),
            (true, "-", "5"),
            "{r}"
        );
    }

    let mut many = TINY_WRITEBACK.to_vec();
    many.extend(["--iters", "100", "--warmup", "1", "--max-seconds", "10"]);
    let (_, _, lines) = cpu_bench("many", &many);
    for l in &lines {
        let (median, p99, max) = (
            l["median_us"].as_f64().unwrap(),
            l["p99_us"].as_f64().unwrap(),
            l["max_us"].as_f64().unwrap(),
        );
        assert!(median <= p99 && p99 <= max, "{l}");
        assert_eq!(l["samples"], 100, "{l}");
    }
}

/// Every scenario's table is aligned (the speculative swap-in's long points
/// pushed its columns out of line), and a rate is never a bare "0.00": "-"
/// where there are no bytes (no misses), more digits where it is small.
#[test]
fn bench_tables_are_aligned_and_print_no_zero_rates() {
    let (out, _, lines) = cpu_bench(
        "tables",
        &[
            "--quick", "--batch", "1", "--k", "256", "--misses", "0,2", "--iters", "2", "--warmup",
            "1",
        ],
    );
    assert!(
        lines.iter().any(|l| l["scenario"] == "spec-swap-in"),
        "{out}"
    );
    let mut tables = 0;
    for block in out.split("\n\n") {
        let table: Vec<&str> = block
            .lines()
            .skip_while(|l| !l.starts_with("point"))
            .collect();
        let Some(header) = table.first() else {
            continue;
        };
        tables += 1;
        let width = header.chars().count();
        for row in &table[1..] {
            assert_eq!(row.chars().count(), width, "out of line:\n{block}");
            let f: Vec<&str> = row.split_whitespace().rev().take(2).collect();
            assert!(f.iter().all(|x| *x != "0.00"), "{row}");
            if row.contains("misses 0,") {
                assert_eq!(f, ["-", "-"], "{row}");
            }
        }
    }
    assert_eq!(tables, 6, "{out}");
}

/// `selftest --cpu` prints its table once, and no link rows of "0 cases"
/// measured on host memcpys: the link is not run on the CPU executor.
#[test]
fn cpu_selftest_prints_its_table_once_without_link_measurements() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["selftest", "--cpu", "--cases", "1"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    for check in ["gather (random, half hostile)", "graph replays"] {
        assert_eq!(
            stdout.lines().filter(|l| l.contains(check)).count(),
            1,
            "{check}:\n{stdout}"
        );
    }
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("result")).count(),
        1,
        "{stdout}"
    );
    assert!(
        !stdout.contains("0 cases") && !stdout.contains("measured"),
        "{stdout}"
    );
    let link: Vec<&str> = stdout.lines().filter(|l| l.contains("link")).collect();
    assert!(
        link.len() == 1 && link[0].starts_with("skip") && link[0].contains("not run on the CPU"),
        "{stdout}"
    );
}

/// Counts read right for one and for many.
#[test]
fn bench_messages_read_right_for_one_and_for_many() {
    let one = [
        "--scenario",
        "swap-in",
        "--hot",
        "4096",
        "--misses",
        "1",
        "--entry",
        "656",
        "--max-seconds",
        "1",
    ];
    let mut args = one.to_vec();
    args.extend(["--iters", "1", "--warmup", "1", "--batch", "1"]);
    let (out, _, lines) = cpu_bench("plural-one", &args);
    assert!(
        out.contains("plan: 1 grid point, each method timed 1 time after 1 warm-up call (at most"),
        "{out}"
    );
    assert!(
        out.contains(&format!("wrote {} measurements to", lines.len())),
        "{out}"
    );
    let mut args = one.to_vec();
    args.extend(["--iters", "2", "--warmup", "2", "--batch", "1,2"]);
    let (out, _, _) = cpu_bench("plural-many", &args);
    assert!(
        out.contains("plan: 2 grid points, each method timed 2 times after 2 warm-up calls"),
        "{out}"
    );
}

/// The pool commands' errors name the flag the user typed and give sizes in
/// human units (an evaluator saw `entry format` and `1048576 B`).
#[test]
fn pool_errors_name_flags_and_human_sizes() {
    let dir = std::env::temp_dir().join(format!("kvtier-cli-words-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dev = |size: &str| format!("file:{}/d:{size}", dir.display());
    let (ok, _, err) = kvtier(&[
        "pool",
        "create",
        "--device",
        &dev("4MiB"),
        "--layers",
        "2",
        "--tokens",
        "16",
        "--entry",
        "foo",
    ]);
    assert!(
        !ok && err.contains("`--entry`") && !err.contains("entry format"),
        "{err}"
    );
    let (ok, _, err) = kvtier(&[
        "pool",
        "create",
        "--device",
        &dev("1MiB"),
        "--layers",
        "2",
        "--tokens",
        "16",
    ]);
    assert!(
        !ok && err.contains("is 1 MiB; a pool device holds at least 2 MiB"),
        "{err}"
    );
    let (ok, _, err) = kvtier(&[
        "pool",
        "create",
        "--device",
        &dev("4MiB"),
        "--device",
        &dev("4MiB"),
        "--layers",
        "2",
        "--tokens",
        "16",
    ]);
    assert!(!ok && err.contains("named twice"), "{err}");
    let (ok, _, err) = kvtier(&[
        "pool",
        "create",
        "--device",
        &dev("4gx"),
        "--layers",
        "2",
        "--tokens",
        "16",
    ]);
    assert!(
        !ok && err.contains("\"gx\" is not a size unit") && err.contains("KiB (1024)"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_bench_times_a_traces_calls_from_the_state_its_replay_reaches() {
    let dir = std::env::temp_dir().join(format!("kvtier-cli-bench-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (trace, json) = (dir.join("t.jsonl"), dir.join("b.jsonl"));
    let t = trace.to_str().unwrap();
    let (ok, _, err) = kvtier(&[
        "trace",
        "synth",
        "--out",
        t,
        "--requests",
        "3",
        "--layers",
        "2",
        "--steps",
        "5",
        "--context",
        "1100",
        "--top-k",
        "256",
        "--hot",
        "1024",
        "--overlap",
        "0.8",
    ]);
    assert!(ok, "{err}");
    // every long call timed: the misses it planned, summed per layer, are
    // the replay's at the trace's HOT size
    let (ok, out, err) = kvtier(&[
        "bench",
        "--trace",
        t,
        "--trace-calls",
        "100",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert!(
        !out.contains("gather:") && out.contains("swap-in:"),
        "{out}"
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&json)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let limits: Vec<&serde_json::Value> = lines.iter().filter(|l| l["is_limit"] == true).collect();
    // 5 steps x 2 layers, every one with a request past 1024 tokens
    assert_eq!(limits.len(), 10, "{out}");
    let mut per_layer = [0u64; 2];
    for l in &limits {
        assert_eq!(l["params"]["trace"], "t.jsonl");
        assert_eq!(l["params"]["hot"], 1024);
        per_layer[l["params"]["layer"].as_u64().unwrap() as usize] +=
            l["params"]["misses_total"].as_u64().unwrap();
        // the limit moves exactly the planned misses
        assert_eq!(
            l["bytes"].as_u64().unwrap(),
            l["params"]["misses_total"].as_u64().unwrap() * 656
        );
    }
    let (ok, plan, err) = kvtier(&["plan", "--trace", t, "--hot", "1024", "--json"]);
    assert!(ok, "{err}");
    let plan: serde_json::Value = serde_json::from_str(&plan).unwrap();
    let replayed: Vec<u64> = plan["curve"][0]["per_layer"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["misses"].as_u64().unwrap())
        .collect();
    assert!(per_layer[0] > 0 && per_layer[1] > 0);
    assert_eq!(per_layer.to_vec(), replayed);

    // a few calls spread over the trace
    let (ok, out, _) = kvtier(&["bench", "--trace", t, "--trace-calls", "3", "--iters", "1"]);
    assert!(ok && out.contains("plan: 3 grid points"), "{out}");
    // refused: another HOT size, another scenario, a trace that never swaps
    let (ok, _, err) = kvtier(&["bench", "--trace", t, "--hot", "2048"]);
    assert!(
        !ok && err.contains("--hot") && err.contains("plan --trace"),
        "{err}"
    );
    let (ok, _, err) = kvtier(&["bench", "--trace", t, "--scenario", "gather"]);
    assert!(!ok && err.contains("swap-in scenario, not gather"), "{err}");
    let short = dir.join("short.jsonl");
    let (ok, _, err) = kvtier(&[
        "trace",
        "synth",
        "--out",
        short.to_str().unwrap(),
        "--requests",
        "1",
        "--layers",
        "1",
        "--steps",
        "2",
        "--context",
        "512",
        "--top-k",
        "256",
        "--hot",
        "1024",
    ]);
    assert!(ok, "{err}");
    let (ok, _, err) = kvtier(&["bench", "--trace", short.to_str().unwrap()]);
    assert!(!ok && err.contains("longer than its HOT buffer"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn plan_prices_a_million_tokens_and_recomputing() {
    let base = [
        "plan",
        "--context",
        "128K",
        "--hbm-for-kv",
        "40GiB",
        "--dram-for-kv",
        "512GiB",
        "--cxl",
        "512GiB@30",
        "--cxl",
        "512GiB@30",
        "--price-gpu-hour",
        "2.5",
        "--price-dram-gib-hour",
        "0.0015",
        "--price-cxl-gib-hour",
        "0.0008",
        "--prefill-tokens-per-s",
        "8000",
        // the costs below are at 2 % misses per layer and step
        "--miss-rate",
        "0.02",
    ];
    let (ok, out, err) = kvtier(&base);
    assert!(ok, "{err}");
    assert!(
        out.contains("cost, DRAM only: 2.77 per million decode tokens")
            && out.contains("cost, DRAM + CXL: 1.07 per million decode tokens")
            && out.contains("0.39× DRAM only's"),
        "{out}"
    );
    let mut json = base.to_vec();
    json.push("--json");
    let (ok, out, err) = kvtier(&json);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let dram = &v["cost"]["per_configuration"][0];
    // 8 x 2.5 + 512 x 0.0015 an hour; 104 requests x 72,000 tokens an hour
    assert!(
        (dram["node_per_hour"].as_f64().unwrap() - 20.768).abs() < 1e-9,
        "{v}"
    );
    assert_eq!(dram["tokens_per_hour"].as_f64().unwrap(), 104.0 * 72_000.0);
    let r = &v["cost"]["recompute"];
    assert!(
        (r["per_million_context_tokens"].as_f64().unwrap() - 2.5 / 3600.0 / 8000.0 * 1e6).abs()
            < 1e-12
    );
    assert!(
        r["break_even_hours"]["cxl"].as_f64().unwrap()
            > r["break_even_hours"]["dram"].as_f64().unwrap()
    );
    // without prices, no cost; a price alone needs the GPU's; bad values refused
    let (ok, out, _) = kvtier(&base[..11]);
    assert!(ok && !out.contains("cost,"), "{out}");
    // base[..7]: the node without CXL or prices
    let (ok, _, err) = kvtier(&[&base[..7], &["--price-dram-gib-hour", "0.1"]].concat());
    assert!(!ok && err.contains("--price-gpu-hour"), "{err}");
    let (ok, _, err) = kvtier(&[&base[..7], &["--price-gpu-hour=-1"]].concat());
    assert!(
        !ok && err.contains("--price-*") && err.contains("not negative"),
        "{err}"
    );
}

/// Starts `kvtier ARGS`, waits for its stdout to say `line`, kills it with
/// SIGKILL (as `kill -9` would) and reaps it.
fn kill_when(args: &[&str], line: &str) {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = std::io::BufReader::new(child.stdout.take().unwrap());
    for l in out.lines() {
        if l.unwrap().contains(line) {
            break;
        }
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
}

#[test]
fn a_table_killed_while_loading_is_never_served_and_the_next_load_resumes_it() {
    let dir = std::env::temp_dir().join(format!("kvtier-cli-table-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let store = dir.to_str().unwrap();
    let key = "model-x/engram.0 [8 MiB + 3 B, e4m3] sha256:00ff";
    let at = ["--store", store, "--key", key];
    fn load<'a>(at: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        let mut a = vec!["table", "load"];
        a.extend(at);
        a.extend(["--synthetic", "8388611"]);
        a.extend(extra);
        a
    }
    let attach = |extra: &[&str]| {
        let mut a = vec!["table", "attach", "--wait", "0"];
        a.extend(at);
        a.extend(extra);
        kvtier(&a)
    };
    // killed at several points of the load: never attachable, and each
    // next loader starts where the chunks written end (2 MiB chunks: 5)
    for chunks in ["1", "2", "4"] {
        kill_when(
            &load(&at, &["--pause-after-chunks", chunks]),
            "paused after",
        );
        let (ok, _, err) = attach(&[]);
        assert!(
            !ok && err.contains(&format!("{chunks} of 5 chunks written")),
            "{chunks}: {err}"
        );
    }
    let (ok, out, err) = kvtier(&[
        "table",
        "status",
        "--json",
        &format!("{store}/{}", {
            std::fs::read_dir(&dir)
                .unwrap()
                .next()
                .unwrap()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .into_owned()
        }),
    ]);
    assert!(ok, "{err}");
    let s: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(s[0]["state"], "filling");
    assert_eq!(s[0]["chunks_written"], 4);
    assert_eq!(
        s[0]["loader"],
        serde_json::Value::Null,
        "the killed loader's lock went with it"
    );
    let (ok, out, err) = kvtier(&load(&at, &[]));
    assert!(ok && out.contains("resumed: 4 of 5 chunks"), "{out}{err}");
    // served now, every byte right (the resumed parts and the first ones)
    let (ok, out, err) = attach(&["--verify-synthetic"]);
    assert!(
        ok && out.contains("every byte is the synthetic pattern"),
        "{out}{err}"
    );
    // loaded once: a second load does nothing; another key gets its own file
    let (ok, out, _) = kvtier(&load(&at, &[]));
    assert!(ok && out.contains("loaded already"), "{out}");
    let (ok, _, err) = kvtier(&[
        "table",
        "attach",
        "--store",
        store,
        "--key",
        "model-x/engram.1",
        "--wait",
        "0",
    ]);
    assert!(!ok && err.contains("opening the table"), "{err}");
    // a reader holds it: listed, and it cannot be destroyed under it
    let mut reader = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "table", "attach", "--store", store, "--key", key, "--hold", "30",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::BufRead;
        let mut out = std::io::BufReader::new(reader.stdout.as_mut().unwrap());
        let mut l = String::new();
        while !l.contains("holding") {
            l.clear();
            out.read_line(&mut l).unwrap();
        }
    }
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let (ok, out, _) = kvtier(&["table", "status", "--json", file.to_str().unwrap()]);
    let s: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(ok && s[0]["readers"][0] == reader.id(), "{out}");
    let (ok, _, err) = kvtier(&["table", "destroy", file.to_str().unwrap()]);
    assert!(
        !ok && err.contains(&format!("pid {} (reading)", reader.id())),
        "{err}"
    );
    reader.kill().unwrap();
    reader.wait().unwrap();
    let (ok, _, err) = kvtier(&["table", "destroy", file.to_str().unwrap()]);
    assert!(ok && !file.exists(), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_model_file_may_keep_layers_and_bytes_per_request_in_hbm() {
    let dir = std::env::temp_dir().join(format!("kvtier-cli-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("m.json");
    let base = r#""name": "x", "offloaded_layers": 2, "entry_bytes": 100, "tokens_per_entry": 4,
        "indexer_layers": 2, "indexer_entry_bytes": 10, "top_k": 8, "hot_slots": 16,
        "page_entries": 4, "max_context": 4096"#;
    let run = |extra: &str| {
        std::fs::write(&file, format!("{{{base}{extra}}}")).unwrap();
        kvtier(&[
            "plan",
            "--model-file",
            file.to_str().unwrap(),
            "--context",
            "1024",
            "--hbm-for-kv",
            "1MiB",
            "--dram-for-kv",
            "1GiB",
            "--json",
        ])
    };
    let (ok, out, err) =
        run(r#", "resident_layers": [[3, 50, 128]], "hbm_bytes_per_request": 1000"#);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    // 2 x 10 / 4 + 3 x 50 / 128 per token; at 1024 tokens (256 entries):
    // indexer 5120 + HOT 2 x 100 x 20 + resident 3 x 50 x 8 + 1000
    assert_eq!(v["hbm_bytes_per_token"].as_f64(), Some(6.171875));
    assert_eq!(v["hbm_bytes_per_request"].as_f64(), Some(11320.0));
    let (ok, out, _) = run("");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(ok && v["hbm_bytes_per_request"].as_f64() == Some(9120.0));
    for bad in [
        r#", "resident_layers": [[3, 50]]"#,
        r#", "resident_layers": 3"#,
        r#", "resident_layers": [[0, 50, 128]]"#,
    ] {
        let (ok, _, err) = run(bad);
        assert!(!ok && err.contains("--model-file"), "{bad}: {err}");
    }
    let (ok, out, err) = kvtier(&[
        "plan",
        "--model",
        "deepseek-v4-flash",
        "--context",
        "1M",
        "--hbm-for-kv",
        "40GiB",
        "--dram-for-kv",
        "1536GiB",
    ]);
    assert!(
        ok && out.contains("per token: host 3071.25 B, HBM 828 B"),
        "{out}{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The README's DeepSeek-V4.1 case: eight TP-1 instances on one node, the
/// Engram tables in HBM, a copy per instance, or one copy in kvtier's store.
#[test]
fn plan_places_deepseek_v4_1s_engram_tables() {
    let args = [
        "plan",
        "--model",
        "deepseek-v4.1-flash",
        "--context",
        "128K",
        "--tp",
        "1",
        "--hbm-for-kv",
        "20GiB",
        "--dram-for-kv",
        "1TiB",
        "--json",
    ];
    let run = |tables: &str| {
        let (ok, out, err) = kvtier(&[&args[..], &["--tables", tables]].concat());
        assert!(ok, "{err}");
        serde_json::from_str::<serde_json::Value>(out.trim()).unwrap()
    };
    let table = 202_758_032_400u64;
    // by hand: a 128K request takes 653 × (3 × 65536 + 131072) B of KV, the
    // 768-token window in 40 layers at 585 B and 24 KiB: 20 GiB holds 92
    let per_request = 653 * (3 * 65_536 + 131_072) + 768 * 40 * 585 + 24_576u64;
    assert_eq!((20u64 << 30) / per_request, 92);
    let v = run("hbm");
    assert_eq!(v["hisparse"], false);
    assert_eq!(v["table_bytes"], table);
    assert_eq!(v["tables"]["hbm_bytes_per_gpu"], table);
    assert_eq!(
        (v["max_requests"].as_u64(), v["limited_by"].as_str()),
        (Some(0), Some("hbm"))
    );
    let v = run("host-per-group");
    assert_eq!(v["tables"]["host_bytes_per_node"], 8 * table);
    assert_eq!(
        (v["max_requests"].as_u64(), v["limited_by"].as_str()),
        (Some(0), Some("host_memory"))
    );
    let v = run("host-shared");
    assert_eq!(v["tables"]["host_bytes_per_node"], table);
    assert_eq!(
        (v["max_requests"].as_u64(), v["limited_by"].as_str()),
        (Some(736), Some("hbm"))
    );
    let (ok, _, err) = kvtier(&[&args[..], &["--tables", "disk"]].concat());
    assert!(!ok && err.contains("--tables"), "{err}");
    // MiniMax-M3 at TP 2 is refused, saying why
    let (ok, _, err) = kvtier(&[
        "plan",
        "--model",
        "minimax-m3",
        "--context",
        "128K",
        "--tp",
        "2",
        "--hbm-for-kv",
        "40GiB",
        "--dram-for-kv",
        "1TiB",
    ]);
    assert!(
        !ok && err.contains("--tp") && err.contains("one KV head a rank"),
        "{err}"
    );
}

/// `kvtier prefix status` says what a store holds and who has it open;
/// `destroy` refuses while a process has it open and for a file that is not
/// a store, then removes it.
#[test]
fn prefix_status_and_destroy() {
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    }
    .join(format!("kvtier-cli-prefix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("store");
    let store = kvtier::prefix_store::PrefixStore::open_or_create(
        &path,
        "model|page_first|bf16",
        4096,
        8,
        std::time::Duration::from_secs(5),
    )
    .unwrap();
    let page = vec![7u8; 4096];
    // SAFETY: the part is `page`'s bytes.
    unsafe { store.set_from(b"k0", &[(page.as_ptr(), page.len())]) }.unwrap();
    let p = path.to_str().unwrap();
    let (ok, out, err) = kvtier(&["prefix", "status", p]);
    assert!(ok, "{err}");
    assert!(
        out.contains("model|page_first|bf16")
            && out.contains("1 pages held of 8 slots")
            && out.contains(&format!("pid {}", std::process::id())),
        "{out}"
    );
    let (ok, out, err) = kvtier(&["prefix", "status", "--json", p]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["pages"], 1);
    assert_eq!(v[0]["sets"], 1);
    let (ok, _, err) = kvtier(&["prefix", "destroy", p]);
    assert!(!ok && err.contains("is open in pid"), "{err}");
    drop(store);
    let other = dir.join("other");
    std::fs::write(&other, b"another program's bytes").unwrap();
    let (ok, _, err) = kvtier(&["prefix", "destroy", other.to_str().unwrap()]);
    assert!(!ok && err.contains("not a kvtier prefix store"), "{err}");
    let (ok, _, err) = kvtier(&["prefix", "status", other.to_str().unwrap()]);
    assert!(!ok && err.contains("not a kvtier prefix store"), "{err}");
    assert_eq!(std::fs::read(&other).unwrap(), b"another program's bytes");
    let (ok, out, err) = kvtier(&["prefix", "destroy", p]);
    assert!(ok && out.contains("removed"), "{err}");
    assert!(!path.exists());
    std::fs::remove_dir_all(dir).unwrap();
}

/// Runs, as written, the ```bash block of `docs/<page>` that starts with
/// `first`: through bash, with the built `kvtier` first on the PATH, in a
/// scratch folder that also stands for `/dev/hugepages/`, holding `files`
/// (name, bytes) first. Fails on the first command that fails; returns
/// what the block printed.
fn run_page_block(page: &str, first: &str, files: &[(&str, usize)]) -> String {
    let text =
        std::fs::read_to_string(format!("{}/../docs/{page}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let block = text
        .split("```bash\n")
        .find(|b| b.starts_with(first))
        .unwrap_or_else(|| panic!("docs/{page} has no bash block starting {first:?}"))
        .split("```")
        .next()
        .unwrap();
    let dir = std::env::temp_dir().join(format!(
        "kvtier-cli-docs-{}-{}",
        page.trim_end_matches(".md"),
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, len) in files {
        std::fs::write(
            dir.join(name),
            (0..*len).map(|i| i as u8).collect::<Vec<u8>>(),
        )
        .unwrap();
    }
    let script = block.replace("/dev/hugepages/", &format!("{}/", dir.display()));
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_kvtier"));
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .current_dir(&dir)
        .env("PATH", path)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "docs/{page}'s block failed:\n{script}\n{stdout}\n{stderr}"
    );
    stdout.into_owned()
}

/// docs/planning.md's first commands run as written (on any machine: a
/// plan is arithmetic), the plot included.
#[test]
fn the_planning_pages_commands_run_as_written() {
    let out = run_page_block("planning.md", "kvtier plan", &[]);
    assert!(out.contains("per token:"), "{out}");
}

/// docs/tables.md's commands (load, attach, status, destroy) run as
/// written, in a scratch folder instead of `/dev/hugepages/`.
#[test]
fn the_tables_pages_commands_run_as_written() {
    let out = run_page_block(
        "tables.md",
        "mkdir -p /dev/hugepages/kvtier",
        &[("part0.bin", 8192), ("part1.bin", 8192)],
    );
    for step in ["loaded 16 KiB", "attached to", "destroyed"] {
        assert!(out.contains(step), "no {step:?} in {out}");
    }
}

/// The committed gather and writeback results under `bench/results/`, in
/// path order: what the library's copy method table is decided by.
fn committed_copy_results(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if p.is_dir() {
            committed_copy_results(&p, out);
        } else if (name.starts_with("gather") || name.starts_with("writeback"))
            && name.ends_with(".jsonl")
        {
            out.push(p);
        }
    }
}

/// The table the library ships (`src/copy_choice.json`, read by
/// `kvtier::CopyMethodTable::measured`) is the one `kvtier bench
/// --copy-choice` writes from every committed gather and writeback result:
/// a new run committed without the table written again fails here.
#[test]
fn the_shipped_copy_method_table_is_the_committed_runs_decision() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let mut files = Vec::new();
    committed_copy_results(&root.join("bench/results"), &mut files);
    assert!(files.len() >= 5, "{files:?}");
    let list: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    let out = std::env::temp_dir().join(format!("kvtier-copy-choice-{}.json", std::process::id()));
    let (ok, stdout, err) = kvtier(&[
        "bench",
        "--from-json",
        &list.join(","),
        "--copy-choice",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stdout}{err}");
    let written = std::fs::read_to_string(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    let shipped = std::fs::read_to_string(root.join("src/copy_choice.json")).unwrap();
    assert_eq!(
        written,
        shipped,
        "src/copy_choice.json is not what the committed results decide; write it again with \
         kvtier bench --from-json {} --copy-choice src/copy_choice.json",
        list.join(",")
    );
    let table = kvtier::CopyMethodTable::from_json(&shipped).unwrap();
    assert_eq!(&table, kvtier::CopyMethodTable::measured());
    // the measured runs' sm_90 656-byte gather takes the line-aligned copy
    // at every size (MergedRuns, chosen at 16384 rows by the H100 runs alone,
    // was slower than it at one point of the H200 run of acb1aac); the
    // 656-byte prefill writeback MergedRuns
    use kvtier::CopyMethod::{LineAligned, MergedRuns, WarpVectors};
    let gather = table.choices_for(kvtier::CopyPath::Gather, 90, 656);
    assert_eq!(
        gather,
        [
            (256, LineAligned),
            (2048, LineAligned),
            (16384, LineAligned),
            (65536, LineAligned),
            (131072, LineAligned)
        ]
    );
    let writeback = table.choices_for(kvtier::CopyPath::Writeback, 90, 656);
    assert_eq!(writeback.last(), Some(&(8192, MergedRuns)));
    assert!(
        writeback[..writeback.len() - 1]
            .iter()
            .all(|&(_, m)| m == WarpVectors)
    );
}

/// `--swap-in-report` on the committed H200 runs of 2026-11-28: the figures
/// the README and the swap-in issue quote from the third (the default, the
/// split planner to batch 10 and the one-launch fixed-shape build with
/// line-aligned copies above, at median 1.10x SGLang's kernel over 54
/// points, clearly faster at 41, slower at 4, the slowest 0.77x at batch
/// 256 with 2 misses a row), each row against the default, and both
/// regimes; the earlier two, which did not time every build the default
/// takes, read through the plain build's rows and said so.
#[test]
fn the_swap_in_report_reads_a_runs_verdict_from_its_json() {
    let swap_in_files = |run: &str, stage: &str, n: usize| {
        let dir = format!(
            "{}/../bench/results/{run}/{stage}",
            env!("CARGO_MANIFEST_DIR")
        );
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path().display().to_string())
            .filter(|p| p.contains("/swap-in-") && p.ends_with(".jsonl"))
            .collect();
        files.sort();
        assert_eq!(files.len(), n, "{files:?}");
        files
    };
    let report = |files: &[String]| {
        let (ok, out, err) =
            kvtier(&["bench", "--from-json", &files.join(","), "--swap-in-report"]);
        assert!(ok, "{err}");
        out
    };
    let files = swap_in_files("h200-2026-11-28c", "3-bench-part3", 8);
    let out = report(&files);
    for line in [
        "swap-in report: NVIDIA H200 (sm_90), commit 2a671a0: 54 points with SGLang's kernel\n\
         the default against SGLang's kernel",
        "median 1.10x (SGLang's time over the default's); clearly faster at 41, level at 9, \
         clearly slower at 4",
        "  slower: batch 256, entry 656, hot 4096, k 2048, misses 2: 0.77x",
        "  batch 10, entry 656, hot 8192, k 2048, misses 2: 1.45x; 1.45x (kvtier swap-in, split \
         planner (a cluster a row, one launch))",
    ] {
        assert!(out.contains(line), "{line:?} not in:\n{out}");
    }
    assert_eq!(out.matches("  slower: ").count(), 4, "{out}");
    assert!(!out.contains("not timed in this run"), "{out}");
    let not_timed = "not timed in this run, so the default's points read its plain build's row: ";
    let out = report(&swap_in_files("h200-2026-11-28b", "3-bench", 7));
    for line in [
        "commit acb1aac: 46 points with SGLang's kernel",
        &format!(
            "{not_timed}kvtier swap-in, few-miss planner, one launch, fixed-shape build, \
             line-aligned copy"
        ),
        "median 1.11x (SGLang's time over the default's); clearly faster at 33, level at 9, \
         clearly slower at 4",
    ] {
        assert!(out.contains(line), "{line:?} not in:\n{out}");
    }
    let out = report(&swap_in_files("h200-2026-11-28", "3-bench", 7));
    for line in [
        "commit 4e141c1: 46 points with SGLang's kernel",
        &format!("{not_timed}kvtier swap-in, split planner (a cluster a row, one launch)"),
        "clearly faster at 27, level at 9, clearly slower at 10",
    ] {
        assert!(out.contains(line), "{line:?} not in:\n{out}");
    }
    // a file given twice (or two builds of one commit) is refused
    let twice = format!("{},{}", files[0], files[0]);
    let (ok, _, err) = kvtier(&["bench", "--from-json", &twice, "--swap-in-report"]);
    assert!(
        !ok && err.contains("give one build's files at a time"),
        "{err}"
    );
    // files of no swap-in point beside SGLang's kernel are refused
    let gather = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../bench/results/h100-2026-11-27b/3-bench/gather.jsonl"
    );
    let (ok, _, err) = kvtier(&["bench", "--from-json", gather, "--swap-in-report"]);
    assert!(!ok && err.contains("no swap-in point"), "{err}");
}
