//! `kvtier bench --scenario decode-step` on the CPU executor: a trace's
//! decode steps replayed at SGLang's padded batch, every row's misses
//! compared with the trace's recorded outcome; a planted wrong count fails
//! and says where; `kvtier plan` reads the measured step.

use std::path::{Path, PathBuf};
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

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvtier-decode-step-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A small trace's shape: 5 requests (SGLang's bucket 8), 3 layers, one
/// warm-up step and 3 measured ones.
const SHAPE: [&str; 18] = [
    "--requests",
    "5",
    "--layers",
    "3",
    "--steps",
    "3",
    "--warmup-steps",
    "1",
    "--context",
    "2000",
    "--top-k",
    "64",
    "--hot",
    "128",
    "--recent",
    "8",
    "--run-len",
    "4",
];

fn replay(trace: &Path) -> (bool, String, String) {
    kvtier(&[
        "bench",
        "--scenario",
        "decode-step",
        "--trace",
        trace.to_str().unwrap(),
        "--replay-only",
        "--executor",
        "cpu",
        "--pool-memory",
        "16MiB",
    ])
}

/// A timed replay on the CPU executor, its JSON lines to `json`.
fn timed(trace: &Path, json: &Path) -> (bool, String, String) {
    kvtier(&[
        "bench",
        "--scenario",
        "decode-step",
        "--trace",
        trace.to_str().unwrap(),
        "--executor",
        "cpu",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--pool-memory",
        "16MiB",
        "--json",
        json.to_str().unwrap(),
    ])
}

#[test]
fn a_recipe_replays_exactly_and_a_planted_count_fails() {
    let d = dir("recipe");
    let recipe = d.join("small.json");
    let mut args = vec![
        "trace",
        "synth",
        "--recipe",
        recipe.to_str().unwrap(),
        "--miss-rate",
        "0.2",
    ];
    args.extend(SHAPE);
    let (ok, out, err) = kvtier(&args);
    assert!(ok && out.contains("wrote the recipe"), "{out}{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&recipe).unwrap()).unwrap();
    // calibrated: its pilot near the rate asked, the overlap it found stated
    let pilot = v["calibration"]["pilot_miss_rate"].as_f64().unwrap();
    assert!((pilot - 0.2).abs() < 0.01, "{v}");
    assert!(
        v["provenance"]
            .as_str()
            .unwrap()
            .contains("calibrated to 20.0 %"),
        "{v}"
    );
    assert_eq!(v["misses"].as_array().unwrap().len(), 4);

    let (ok, out, err) = replay(&recipe);
    assert!(ok, "{out}{err}");
    assert!(out.contains("replayed 4 steps (1 warm-up)"), "{out}");
    assert!(
        out.contains("every row's misses as the trace records them (60 rows"),
        "{out}"
    );
    assert!(
        out.contains("each layer's total as the recipe records it"),
        "{out}"
    );
    assert!(out.contains("bucket 8 for 5 requests"), "{out}");

    // one layer's count planted one off: the replay says where
    let mut planted = v.clone();
    let m = planted["misses"][2][1].as_u64().unwrap();
    planted["misses"][2][1] = serde_json::json!(m + 1);
    let bad = d.join("planted.json");
    std::fs::write(&bad, planted.to_string()).unwrap();
    let (ok, out, err) = replay(&bad);
    assert!(!ok, "{out}");
    assert!(
        err.contains("step 2, layer 1")
            && err.contains(&format!("{m} misses, the recipe records {}", m + 1)),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_trace_files_outcome_is_checked_row_by_row() {
    let d = dir("file");
    let trace = d.join("t.jsonl");
    let mut args = vec![
        "trace",
        "synth",
        "-o",
        trace.to_str().unwrap(),
        "--overlap",
        "0.7",
    ];
    args.extend(SHAPE);
    let (ok, out, err) = kvtier(&args);
    assert!(ok, "{out}{err}");
    let (ok, out, err) = replay(&trace);
    assert!(ok, "{out}{err}");
    assert!(
        out.contains("every row's misses as the trace records them (60 rows)"),
        "{out}"
    );

    // a row of the third step's second layer recorded one miss more
    let text = std::fs::read_to_string(&trace).unwrap();
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let line = 1 + 2 * 3 + 1; // the header, two steps of three layers, layer 1
    let mut call: serde_json::Value = serde_json::from_str(&lines[line]).unwrap();
    let m = call["rows"][3]["misses"].as_u64().unwrap();
    call["rows"][3]["misses"] = serde_json::json!(m + 1);
    lines[line] = call.to_string();
    let bad = d.join("planted.jsonl");
    std::fs::write(&bad, lines.join("\n") + "\n").unwrap();
    let (ok, out, err) = replay(&bad);
    assert!(!ok, "{out}");
    assert!(
        err.contains("step 2, layer 1, row 3 (request 3)")
            && err.contains(&format!("the trace records {}", m + 1)),
        "{err}"
    );

    // a trace without outcomes replays, and says it checked nothing
    let bare = d.join("bare.jsonl");
    let mut args = vec![
        "trace",
        "synth",
        "-o",
        bare.to_str().unwrap(),
        "--no-outcomes",
    ];
    args.extend(SHAPE);
    assert!(kvtier(&args).0);
    let (ok, out, err) = replay(&bare);
    assert!(
        ok && out.contains("the trace records no outcome"),
        "{out}{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// Timed on the CPU executor: a line per measured step and method, one for
/// all steps, the floor the reference; plan takes the measured miss rate
/// and step time from them.
#[test]
fn a_timed_replay_writes_steps_and_plan_reads_them() {
    let d = dir("timed");
    let trace = d.join("t.jsonl");
    let mut args = vec![
        "trace",
        "synth",
        "-o",
        trace.to_str().unwrap(),
        "--overlap",
        "0.8",
        "--item-bytes",
        "656",
    ];
    args.extend(SHAPE);
    assert!(kvtier(&args).0);
    let json = d.join("ds.jsonl");
    let (ok, out, err) = timed(&trace, &json);
    assert!(ok, "{out}{err}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&json)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // (3 steps + all) × (kvtier, floor)
    assert_eq!(lines.len(), 8, "{lines:?}");
    let all: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["params"]["step"] == "all")
        .collect();
    assert_eq!(all.len(), 2);
    let per_step_misses: u64 = lines
        .iter()
        .filter(|l| l["params"]["step"] != "all" && l["is_limit"] == true)
        .map(|l| l["params"]["misses_total"].as_u64().unwrap())
        .sum();
    for l in &all {
        assert_eq!(l["params"]["measured_steps"], 3);
        assert_eq!(l["params"]["bucket"], 8);
        assert_eq!(l["params"]["batch"], 5);
        assert_eq!(
            l["params"]["misses_total"].as_u64().unwrap(),
            per_step_misses
        );
        assert_eq!(l["bytes"].as_u64().unwrap(), per_step_misses * 656);
        assert!(l["ratio_to_limit"].as_f64().unwrap() > 0.0);
    }

    // plan: the measured rate and step instead of an assumption
    let (ok, out, err) = kvtier(&[
        "plan",
        "--context",
        "128K",
        "--hbm-for-kv",
        "40GiB",
        "--dram-for-kv",
        "1536GiB",
        "--decode-step",
        json.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let kvtier_all = all.iter().find(|l| l["is_limit"] == false).unwrap();
    let rate = per_step_misses as f64 / kvtier_all["params"]["entries_total"].as_f64().unwrap();
    assert!(
        out.contains(&format!(
            "{:.2} % of the top-k per layer and step, measured by the decode step",
            rate * 100.0
        )),
        "{out}"
    );
    assert!(
        out.contains("measured: a decode step's swap-ins took"),
        "{out}"
    );
    // a file without kvtier's lines is refused, and says what it looked for
    let empty = d.join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let (ok, _, err) = kvtier(&[
        "plan",
        "--context",
        "128K",
        "--hbm-for-kv",
        "40GiB",
        "--dram-for-kv",
        "1536GiB",
        "--decode-step",
        empty.to_str().unwrap(),
    ]);
    assert!(
        !ok && err.contains("no line of kvtier's decode step"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// Without --miss-rate, plan assumes the published figure for the model's
/// hot buffer, cites it, and shows the plan at each published rate.
#[test]
fn plan_defaults_to_the_published_miss_rate_and_shows_the_spread() {
    let base = [
        "plan",
        "--context",
        "128K",
        "--hbm-for-kv",
        "40GiB",
        "--dram-for-kv",
        "1536GiB",
    ];
    let (ok, out, err) = kvtier(&base);
    assert!(ok, "{err}");
    assert!(
        out.contains("miss rate: 13.4 % of the top-k missing per layer and step at a hot buffer of 2.00× top-k: the \
                      published figure; source: HiSparse's published GLM-5.1 misses"),
        "{out}"
    );
    assert!(
        out.contains("at the published miss rates instead (DRAM only): 30.0 % (1× top-k)"),
        "{out}"
    );
    let mut json_args = base.to_vec();
    json_args.push("--json");
    let (ok, out, err) = kvtier(&json_args);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["assumptions"]["miss_rate"], 0.134);
    let spread = v["miss_rate_spread"].as_array().unwrap();
    assert_eq!(spread.len(), 3);
    // more misses, more of the step on the link
    let shares: Vec<f64> = spread
        .iter()
        .map(|s| s["link_share"].as_f64().unwrap())
        .collect();
    assert!(shares[0] > shares[1] && shares[1] > shares[2], "{shares:?}");
    // DeepSeek-V4-Flash's buffer is 8× its top-k: the largest published
    // figure, said to be an over-estimate
    let mut v4 = base.to_vec();
    v4.extend(["--model", "deepseek-v4-flash"]);
    let (ok, out, err) = kvtier(&v4);
    assert!(ok, "{err}");
    assert!(out.contains("6.7 % of the top-k missing per layer and step at a hot buffer of 8.00× top-k: the largest"), "{out}");
    // a rate given is used and said to be given
    let mut given = base.to_vec();
    given.extend(["--miss-rate", "0.02"]);
    let (ok, out, _) = kvtier(&given);
    assert!(
        ok && out.contains("miss rate: 2.0 % of the top-k per layer and step (--miss-rate)"),
        "{out}"
    );
}

/// A trace of a DSA model with shared-index layers (SGLang's
/// `index_topk_freq`, a synthetic configuration): calls of the anchors only;
/// the replay runs each anchor's swap-in with its miss plan and the shared
/// layers' replays of it, checks their bytes, and counts their bytes in the
/// step's.
#[test]
fn shared_index_layers_replay_their_anchors_plans() {
    let d = dir("shared");
    let trace = d.join("t.jsonl");
    let mut args = vec![
        "trace",
        "synth",
        "-o",
        trace.to_str().unwrap(),
        "--overlap",
        "0.8",
        "--index-topk-freq",
        "2",
        "--item-bytes",
        "64",
    ];
    args.extend(SHAPE);
    let (ok, out, err) = kvtier(&args);
    assert!(ok && out.contains("index_topk_freq 2"), "{out}{err}");
    let text = std::fs::read_to_string(&trace).unwrap();
    let mut lines = text.lines();
    let header: serde_json::Value = serde_json::from_str(lines.next().unwrap()).unwrap();
    assert_eq!(
        (
            header["index_topk_freq"].as_u64(),
            header["layers"].as_u64()
        ),
        (Some(2), Some(3))
    );
    // layers 0 and 1 select; layer 2 reuses layer 1's selection
    let layers: Vec<u64> = lines
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["layer"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(&layers[..4], &[0, 1, 0, 1]);

    let json = d.join("ds.jsonl");
    let (ok, out, err) = timed(&trace, &json);
    assert!(ok, "{out}{err}");
    assert!(
        out.contains(
            "1 shared-index layers of 3 (SGLang's index_topk_freq 2) replay their anchors' miss plans"
        ),
        "{out}"
    );
    let all: Vec<serde_json::Value> = std::fs::read_to_string(&json)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|l: &serde_json::Value| l["params"]["step"] == "all")
        .collect();
    // the bytes: layer 0's misses once, layer 1's twice (its own, and
    // layer 2's replay of them); both more than the misses alone
    let kv = all.iter().find(|l| l["is_limit"] == false).unwrap();
    let misses = kv["params"]["misses_total"].as_u64().unwrap();
    let bytes = kv["bytes"].as_u64().unwrap();
    assert!(bytes > misses * 64 && bytes < 2 * misses * 64, "{kv}");
    // the overlap measurement (on the CPU executor the same calls in order,
    // its page tables checked): the stand-ins alone, the replays in order
    // and on a second stream, a point of their own
    for method in [
        "compute stand-in alone (one memset a layer)",
        "kvtier, a compute stand-in a layer: shared-index replays in order",
        "kvtier, a compute stand-in a layer: shared-index replays on a second stream",
    ] {
        let l = all
            .iter()
            .find(|l| l["method"] == method)
            .unwrap_or_else(|| panic!("{method}: {all:?}"));
        assert!(
            l["params"]["compute_stand_in_us"].as_f64().unwrap() > 0.0,
            "{l}"
        );
        let want = if method.starts_with("compute") {
            0
        } else {
            bytes
        };
        assert_eq!(l["bytes"].as_u64().unwrap(), want, "{l}");
    }
    let _ = std::fs::remove_dir_all(&d);
}
