//! Trace recipes: a synthetic trace as the few numbers that make it (a
//! [`SynthSpec`]), what its selections were calibrated to and where that
//! figure comes from, and the outcome its replay must give (each step's
//! misses per layer). A recipe is a few kilobytes where its trace is
//! hundreds of megabytes: committed recipes are regenerated exactly (one
//! seed, one generator) and checked against their recorded outcome.
//!
//! # The format
//!
//! One JSON object: `{"kvtier_trace_recipe": 1, "name": ..., "model": ...,
//! "provenance": ..., "requests", "layers", "steps", "warmup_steps",
//! "context", "top_k", "block_tokens", "item_bytes", "hot", "overlap",
//! "run_len", "recent", "seed", "calibration": {"target_miss_rate",
//! "source", "pilot_miss_rate"}, "misses": [[...], ...]}`; `misses[s][l]`
//! is the sum over the rows of step `s` (warm-up steps first) and layer `l`
//! of the row's misses at `hot`.

use serde_json::{Value, json};

use super::{SynthSpec, TraceCall, TraceHeader, synth_header, synthesize_each};
use crate::error::{Error, Result, invalid};
use crate::plan::ModelSpec;

/// The recipe format version this build reads and writes.
pub const RECIPE_VERSION: u64 = 1;

/// The largest recipe file read (a recipe is a few KiB).
pub const MAX_RECIPE_BYTES: u64 = 16 << 20;

/// What a recipe's selections were calibrated to.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    /// The share of the top-k missed per layer and step the overlap was
    /// searched for.
    pub target_miss_rate: f64,
    /// Where that figure comes from.
    pub source: String,
    /// The rate the search's pilot reached.
    pub pilot_miss_rate: f64,
}

/// A synthetic trace as the numbers that make it, and its recorded outcome.
#[derive(Clone, Debug)]
pub struct TraceRecipe {
    pub name: String,
    /// The model whose shape the trace has (a [`SynthModel`] preset).
    pub model: String,
    pub spec: SynthSpec,
    pub calibration: Option<Calibration>,
    /// `[step][layer]`: the rows' misses summed (warm-up steps first).
    pub misses: Vec<Vec<u64>>,
}

/// A model's shape as a synthetic trace takes it: its swap-in layers,
/// query and item.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthModel {
    pub name: &'static str,
    /// Layers with a HiSparse swap-in each decode step.
    pub layers: u32,
    /// Query columns (positions, or blocks of `block_tokens`).
    pub top_k: u32,
    pub block_tokens: u32,
    /// Sequence tokens per stored entry (a trace's positions are entries).
    pub tokens_per_entry: u32,
    /// Bytes a miss moves.
    pub item_bytes: u64,
    pub source: String,
}

impl SynthModel {
    /// The models a decode-step trace is synthesized for, their shapes
    /// from `kvtier plan`'s presets (whose sources they cite).
    pub fn presets() -> Vec<SynthModel> {
        let from = |name: &'static str, block: u32, item: Option<u64>, why: &str| {
            let m = ModelSpec::preset(name).expect("a built-in model");
            SynthModel {
                name,
                layers: m.offloaded_layers,
                top_k: m.top_k / block.max(1),
                block_tokens: block,
                tokens_per_entry: m.tokens_per_entry,
                item_bytes: item.unwrap_or(m.entry_bytes as u64),
                source: format!(
                    "{name}: {} swap-in layers, {why}; as `kvtier plan` has it",
                    m.offloaded_layers
                ),
            }
        };
        vec![
            from(
                "deepseek-v3.2",
                0,
                None,
                "top-k 2048 positions, 656 B fp8 DSA rows (every layer has its own indexer: no shared-index layers)",
            ),
            from(
                "deepseek-v4-flash",
                0,
                Some(584),
                "its compressed-by-4 (C4) layers, top-k 512 of C4 entries (a position is 4 tokens), 584 B moved \
                 a miss (576 B of values and 8 B of scales, SGLang 0.5.23's DeepSeek-V4 swap-in), no shared-index \
                 layers (SGLang's planned copy is for DSA models only)",
            ),
            from(
                "minimax-m3",
                128,
                None,
                "its sparse layers, top-k 16 blocks of 128 tokens, 512 B bf16 K and V of a rank's head",
            ),
        ]
    }

    pub fn preset(name: &str) -> Result<SynthModel> {
        SynthModel::presets()
            .into_iter()
            .find(|m| m.name == name)
            .ok_or_else(|| {
                invalid(
                    "model",
                    format!(
                        "{name:?} is not a model traces are synthesized for ({})",
                        SynthModel::presets()
                            .iter()
                            .map(|m| m.name)
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
            })
    }
}

/// The overlap with the previous step at which `spec`'s selections miss
/// `target` of the top-k per layer and step after the warm-up, found by
/// bisection on a pilot of the same shape (at most 8 requests, one layer, at
/// least 2 warm-up steps and 8 measured ones): (overlap, the pilot's rate).
/// More overlap, fewer misses; an unreachable target is an error.
pub fn calibrate_overlap(spec: &SynthSpec, target: f64) -> Result<(f64, f64)> {
    if !(target.is_finite() && target > 0.0 && target < 1.0) {
        return Err(invalid("miss_rate", format!("{target} is not in (0, 1)")));
    }
    let pilot = |overlap: f64| -> Result<f64> {
        let p = SynthSpec {
            requests: spec.requests.min(8),
            layers: 1,
            steps: 8,
            warmup_steps: spec.warmup_steps.max(2),
            overlap,
            outcomes: true,
            ..spec.clone()
        };
        let (mut missed, mut entries) = (0u64, 0u64);
        let warm = p.warmup_steps as usize;
        let mut call = 0usize;
        synthesize_each(&p, |c| {
            if call >= warm {
                for r in &c.rows {
                    missed += r.misses.unwrap_or(0) as u64;
                    entries += r.topk.len() as u64 * p.block_tokens.max(1) as u64;
                }
            }
            call += 1;
            Ok(())
        })?;
        Ok(missed as f64 / entries.max(1) as f64)
    };
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    let (mut best, mut best_rate) = (0.5, f64::INFINITY);
    for _ in 0..16 {
        let mid = (lo + hi) / 2.0;
        let rate = pilot(mid)?;
        if (rate - target).abs() < (best_rate - target).abs() {
            (best, best_rate) = (mid, rate);
        }
        if rate > target {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    // four decimals: the recipe states it and a regeneration uses that value
    let best = (best * 1e4).round() / 1e4;
    let rate = pilot(best)?;
    if (rate - target).abs() > 0.01 {
        return Err(invalid(
            "miss_rate",
            format!(
                "no overlap gives {:.1} % misses with these selections (the nearest, {best}, gives {:.1} %)",
                target * 100.0,
                rate * 100.0
            ),
        ));
    }
    Ok((best, rate))
}

impl TraceRecipe {
    /// Synthesizes the recipe's trace, a call at a time (with each row's
    /// outcome), and checks that its replay gives the recorded misses.
    pub fn synthesize_each(
        &self,
        emit: impl FnMut(TraceCall) -> Result<()>,
    ) -> Result<TraceHeader> {
        let (header, got) = synthesize_counting(&self.spec, emit)?;
        self.check_misses(&got)?;
        Ok(header)
    }

    /// Whether `got` (`[step][layer]` misses) is the recorded outcome; an
    /// error names the first step and layer that differ.
    pub fn check_misses(&self, got: &[Vec<u64>]) -> Result<()> {
        if got.len() != self.misses.len() {
            return Err(Error::Pool(format!(
                "trace recipe {}: the replay has {} steps, the recipe records {}",
                self.name,
                got.len(),
                self.misses.len()
            )));
        }
        for (s, (g, want)) in got.iter().zip(&self.misses).enumerate() {
            if let Some(l) = (0..g.len().max(want.len())).find(|&l| g.get(l) != want.get(l)) {
                return Err(Error::Pool(format!(
                    "trace recipe {}: step {s}, layer {l}: the replay misses {:?} entries, the recipe records {:?}",
                    self.name,
                    g.get(l),
                    want.get(l)
                )));
            }
        }
        Ok(())
    }

    /// Makes a recipe of `spec` (its outcome recorded by synthesizing it
    /// once).
    pub fn record(
        name: &str,
        model: &str,
        spec: SynthSpec,
        calibration: Option<Calibration>,
    ) -> Result<Self> {
        let (_, misses) = synthesize_counting(&spec, |_| Ok(()))?;
        Ok(TraceRecipe {
            name: name.to_string(),
            model: model.to_string(),
            spec,
            calibration,
            misses,
        })
    }

    pub fn to_json(&self) -> Value {
        let s = &self.spec;
        json!({
            "kvtier_trace_recipe": RECIPE_VERSION,
            "name": self.name,
            "model": self.model,
            "provenance": s.provenance,
            "requests": s.requests,
            "layers": s.layers,
            "steps": s.steps,
            "warmup_steps": s.warmup_steps,
            "context": s.context,
            "top_k": s.top_k,
            "block_tokens": s.block_tokens,
            "item_bytes": s.item_bytes,
            "hot": s.hot,
            "overlap": s.overlap,
            "run_len": s.run_len,
            "recent": s.recent,
            "seed": s.seed,
            "index_topk_freq": s.index_topk_freq.max(1),
            "calibration": self.calibration.as_ref().map(|c| json!({
                "target_miss_rate": c.target_miss_rate,
                "source": c.source,
                "pilot_miss_rate": c.pilot_miss_rate,
            })),
            "misses": self.misses,
        })
    }

    /// The recipe as the text its file holds: pretty JSON, a step's misses
    /// on one line.
    pub fn to_text(&self) -> String {
        let mut v = self.to_json();
        v["misses"] = json!(
            (0..self.misses.len())
                .map(|i| format!("@step{i}@"))
                .collect::<Vec<_>>()
        );
        let mut text = serde_json::to_string_pretty(&v).expect("JSON");
        for (i, step) in self.misses.iter().enumerate() {
            text = text.replace(
                &format!("\"@step{i}@\""),
                &serde_json::to_string(step).expect("JSON"),
            );
        }
        text
    }

    /// Reads a recipe from its JSON text; every field checked (the spec by
    /// the synthesizer's own checks), every error naming the field.
    pub fn parse(text: &str) -> Result<Self> {
        let bad = |msg: String| invalid("recipe", msg);
        let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        if v.get("kvtier_trace_recipe").and_then(Value::as_u64) != Some(RECIPE_VERSION) {
            return Err(bad(format!(
                "not a kvtier trace recipe of version {RECIPE_VERSION}"
            )));
        }
        let uint = |key: &str| -> Result<u32> {
            v.get(key)
                .and_then(Value::as_u64)
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| {
                    bad(format!(
                        "`{key}` is missing or not a 32-bit unsigned integer"
                    ))
                })
        };
        let text_of = |key: &str| -> Result<String> {
            v.get(key)
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| bad(format!("`{key}` is missing or not a string")))
        };
        let overlap = v
            .get("overlap")
            .and_then(Value::as_f64)
            .ok_or_else(|| bad("`overlap` is missing or not a number".into()))?;
        let spec = SynthSpec {
            requests: uint("requests")?,
            layers: uint("layers")?,
            steps: uint("steps")?,
            warmup_steps: uint("warmup_steps")?,
            context: uint("context")?,
            top_k: uint("top_k")?,
            block_tokens: uint("block_tokens")?,
            item_bytes: uint("item_bytes")? as u64,
            hot: uint("hot")?,
            overlap,
            run_len: uint("run_len")?,
            recent: uint("recent")?,
            seed: v
                .get("seed")
                .and_then(Value::as_u64)
                .ok_or_else(|| bad("`seed` is missing or not an unsigned integer".into()))?,
            outcomes: true,
            provenance: text_of("provenance")?,
            index_topk_freq: match v.get("index_topk_freq") {
                None => 1,
                Some(_) => uint("index_topk_freq")?.max(1),
            },
        };
        synth_header(&spec)?;
        let calibration = match v.get("calibration") {
            None | Some(Value::Null) => None,
            Some(c) => {
                let num = |key: &str| {
                    c.get(key).and_then(Value::as_f64).ok_or_else(|| {
                        bad(format!("`calibration.{key}` is missing or not a number"))
                    })
                };
                Some(Calibration {
                    target_miss_rate: num("target_miss_rate")?,
                    source: c
                        .get("source")
                        .and_then(Value::as_str)
                        .ok_or_else(|| {
                            bad("`calibration.source` is missing or not a string".into())
                        })?
                        .to_string(),
                    pilot_miss_rate: num("pilot_miss_rate")?,
                })
            }
        };
        let steps = (spec.steps + spec.warmup_steps) as usize;
        let misses: Vec<Vec<u64>> = v
            .get("misses")
            .and_then(Value::as_array)
            .filter(|a| a.len() == steps)
            .ok_or_else(|| {
                bad(format!(
                    "`misses` is missing or not a list of {steps} steps"
                ))
            })?
            .iter()
            .map(|step| {
                step.as_array()
                    .filter(|a| a.len() == spec.layers as usize)
                    .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
                    .ok_or_else(|| {
                        bad(format!(
                            "a step of `misses` is not a list of {} counts",
                            spec.layers
                        ))
                    })
            })
            .collect::<Result<_>>()?;
        Ok(TraceRecipe {
            name: text_of("name")?,
            model: text_of("model")?,
            spec,
            calibration,
            misses,
        })
    }

    /// Reads a recipe file (at most [`MAX_RECIPE_BYTES`]).
    pub fn read(path: &std::path::Path) -> Result<Self> {
        use std::io::Read;
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_RECIPE_BYTES + 1).read_to_string(&mut text))
            .map_err(|e| Error::Io {
                context: format!("reading the recipe {}", path.display()),
                source: e,
            })?;
        if text.len() as u64 > MAX_RECIPE_BYTES {
            return Err(invalid(
                "recipe",
                format!(
                    "{} is larger than a recipe ({MAX_RECIPE_BYTES} B)",
                    path.display()
                ),
            ));
        }
        TraceRecipe::parse(&text)
    }

    /// Whether `text` (a file's start) is a recipe rather than a trace.
    pub fn looks_like(text: &[u8]) -> bool {
        let head = &text[..text.len().min(4096)];
        head.windows(20).any(|w| w == b"\"kvtier_trace_recipe")
    }
}

/// `spec` synthesized with its outcomes, each call handed to `emit`: the
/// header, and each step's misses per layer.
fn synthesize_counting(
    spec: &SynthSpec,
    mut emit: impl FnMut(TraceCall) -> Result<()>,
) -> Result<(TraceHeader, Vec<Vec<u64>>)> {
    let spec = SynthSpec {
        outcomes: true,
        ..spec.clone()
    };
    let mut got: Vec<Vec<u64>> = Vec::new();
    let mut last_layer: Option<u32> = None;
    let header = synthesize_each(&spec, |c| {
        if last_layer.is_none() || super::starts_step(last_layer, c.layer) {
            got.push(vec![0; spec.layers as usize]);
        }
        last_layer = Some(c.layer);
        got.last_mut().expect("a step")[c.layer as usize] += c
            .rows
            .iter()
            .map(|row| row.misses.unwrap_or(0) as u64)
            .sum::<u64>();
        emit(c)
    })?;
    Ok((header, got))
}
