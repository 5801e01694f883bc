//! `kvtier trace synth` and the replay behind `kvtier plan --trace`.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use kvtier::trace::{
    Calibration, SynthModel, SynthSpec, TraceReader, TraceRecipe, TraceShape, calibrate_overlap,
    replay_stream, synth_header, synthesize_each, write_call, write_header,
};
use serde_json::json;

#[derive(Debug, Subcommand)]
pub enum TraceCommand {
    /// Write a synthetic top-k trace: requests decoding side by side, each
    /// step keeping a share of the previous step's selection and drawing the
    /// rest in runs of consecutive positions. Its numbers are assumptions
    /// (the header says so), for trying the replay and the HOT sizes before
    /// a recorded trace exists.
    Synth(SynthArgs),
}

#[derive(Debug, Args)]
pub struct SynthArgs {
    /// Where to write the trace (JSON lines).
    #[arg(long, short, required_unless_present = "recipe")]
    out: Option<PathBuf>,
    /// Also (or instead) write the trace's recipe here: the numbers that
    /// make it and its outcome, each step's misses per layer (a few KiB;
    /// `kvtier bench --scenario decode-step --trace` takes it as the trace).
    #[arg(long, value_name = "FILE")]
    recipe: Option<PathBuf>,
    /// Regenerate the trace of this recipe (checked against its recorded
    /// outcome) instead of one from the flags.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["recipe", "model", "miss_rate"])]
    from_recipe: Option<PathBuf>,
    /// The model whose shape the trace has: deepseek-v3.2, deepseek-v4-flash
    /// (its C4 layers; positions are C4 entries) or minimax-m3 (block
    /// queries); sets --layers, --top-k, --block-tokens and --item-bytes
    /// (a flag given keeps its value).
    #[arg(long)]
    model: Option<String>,
    #[arg(long, default_value_t = 8)]
    requests: u32,
    /// Layers (default 4, or the model's).
    #[arg(long)]
    layers: Option<u32>,
    /// Decode steps written after the warm-up steps.
    #[arg(long, default_value_t = 64)]
    steps: u32,
    /// Decode steps before them that only bring the hot buffers to their
    /// steady state (the header names them; a decode-step replay runs them
    /// untimed).
    #[arg(long, default_value_t = 0)]
    warmup_steps: u32,
    /// Context length at the first step, in positions (C4 entries for
    /// deepseek-v4-flash).
    #[arg(long, default_value_t = 32768)]
    context: u32,
    /// Columns a query selects (default 2048, or the model's).
    #[arg(long)]
    top_k: Option<u32>,
    /// 0: token queries; else block queries of this many tokens (default 0,
    /// or the model's).
    #[arg(long)]
    block_tokens: Option<u32>,
    /// Bytes a miss moves, for the header (default 0: unknown, or the
    /// model's).
    #[arg(long)]
    item_bytes: Option<u64>,
    /// The hot buffer the trace names as its own (`plan --trace` replays at
    /// it, half and twice it unless told otherwise).
    #[arg(long, default_value_t = 4096)]
    hot: u32,
    /// Share of a step's selection kept from the previous step (0 to 1).
    #[arg(long, default_value_t = 0.9, conflicts_with = "miss_rate")]
    overlap: f64,
    /// Instead of --overlap: the share of the top-k that should miss the hot
    /// buffer per layer and step after the warm-up; the overlap that gives
    /// it is searched for on a pilot of the same shape. `published` takes
    /// HiSparse's published GLM-5.1 figure for the hot buffer asked (30 % at
    /// 1× top-k, 13.4 % at 2×, 6.7 % at 4×; log-linear between).
    #[arg(long)]
    miss_rate: Option<String>,
    /// Length of the runs of consecutive positions new picks come in.
    #[arg(long, default_value_t = 16)]
    run_len: u32,
    /// The newest positions every step selects (default: 128, or the top-k
    /// when smaller).
    #[arg(long)]
    recent: Option<u32>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Leave the rows' outcomes (their misses at --hot) out of the trace.
    #[arg(long)]
    no_outcomes: bool,
    /// SGLang's `index_topk_freq` for DSA models: above 1, layers 0, 1,
    /// 1 + K, 1 + 2K, ... select their own top-k and every other layer
    /// reuses the one below it, replaying its miss plan (no call of its
    /// own in the trace). None of the presets sets it: a trace with it is
    /// a synthetic configuration (its header says so).
    #[arg(long, default_value_t = 1)]
    index_topk_freq: u32,
}

pub fn run(cmd: TraceCommand) -> kvtier::Result<()> {
    match cmd {
        TraceCommand::Synth(a) => synth(a),
    }
}

fn synth(a: SynthArgs) -> kvtier::Result<()> {
    if let Some(path) = &a.from_recipe {
        let recipe = TraceRecipe::read(path)?;
        let out = a
            .out
            .as_ref()
            .expect("clap: --out unless --recipe, which conflicts");
        return write_trace(out, &recipe.spec, |emit| recipe.synthesize_each(emit));
    }
    let model = a.model.as_deref().map(SynthModel::preset).transpose()?;
    let top_k = a.top_k.or(model.as_ref().map(|m| m.top_k)).unwrap_or(2048);
    let block_tokens = a
        .block_tokens
        .or(model.as_ref().map(|m| m.block_tokens))
        .unwrap_or(0);
    let mut spec = SynthSpec {
        requests: a.requests,
        layers: a.layers.or(model.as_ref().map(|m| m.layers)).unwrap_or(4),
        steps: a.steps,
        warmup_steps: a.warmup_steps,
        context: a.context,
        top_k,
        block_tokens,
        item_bytes: a
            .item_bytes
            .or(model.as_ref().map(|m| m.item_bytes))
            .unwrap_or(0),
        hot: a.hot,
        overlap: a.overlap,
        run_len: a.run_len,
        recent: a.recent.unwrap_or(top_k.min(128)),
        seed: a.seed,
        outcomes: !a.no_outcomes,
        provenance: model.as_ref().map(|m| m.source.clone()).unwrap_or_default(),
        index_topk_freq: a.index_topk_freq,
    };
    if a.index_topk_freq > 1 {
        let said = format!(
            "shared-index layers by SGLang's index_topk_freq {} applied to this shape: a synthetic configuration{}",
            a.index_topk_freq,
            if model.is_some() {
                " (the model's own has none)"
            } else {
                ""
            }
        );
        spec.provenance = if spec.provenance.is_empty() {
            said
        } else {
            format!("{}; {said}", spec.provenance)
        };
    }
    // checked before anything is searched or made
    synth_header(&spec)?;
    let calibration = match a.miss_rate.as_deref() {
        None => None,
        Some(r) => {
            let (target, source) = if r == "published" {
                let p = kvtier::plan::PublishedMissRate::for_buffer(
                    spec.hot,
                    top_k * block_tokens.max(1),
                )?;
                (p.rate, p.describe())
            } else {
                let x: f64 = r.parse().map_err(|_| kvtier::Error::InvalidArgument {
                    arg: "--miss-rate",
                    msg: format!("{r:?} is neither a share (0 to 1) nor `published`"),
                })?;
                (x, "given (--miss-rate)".to_string())
            };
            let (overlap, pilot) = calibrate_overlap(&spec, target)?;
            spec.overlap = overlap;
            let said = format!(
                "selections calibrated to {:.1} % misses after the warm-up (the overlap {overlap} that a pilot of \
                 this shape gives {:.2} % at; step-to-step locality is the assumption): {source}",
                target * 100.0,
                pilot * 100.0
            );
            spec.provenance = if spec.provenance.is_empty() {
                said
            } else {
                format!("{}; {said}", spec.provenance)
            };
            Some(Calibration {
                target_miss_rate: target,
                source,
                pilot_miss_rate: pilot,
            })
        }
    };
    if let Some(path) = &a.recipe {
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("recipe")
            .to_string();
        let model_name = model.as_ref().map(|m| m.name).unwrap_or("custom");
        let recipe = TraceRecipe::record(&name, model_name, spec.clone(), calibration)?;
        let text = recipe.to_text();
        let mut f = kvtier::shared_fs::create_output(path, "--recipe")?;
        writeln!(f, "{text}").map_err(|e| kvtier::Error::Io {
            context: format!("writing {}", path.display()),
            source: e,
        })?;
        let steps = recipe.misses.len();
        let total: u64 = recipe.misses.iter().flatten().sum();
        println!(
            "wrote the recipe to {} ({steps} steps, {total} misses in all, overlap {})",
            path.display(),
            recipe.spec.overlap
        );
    }
    match &a.out {
        Some(out) => write_trace(out, &spec, |emit| synthesize_each(&spec, emit)),
        None => Ok(()),
    }
}

/// Writes the trace `make` emits a call at a time (memory for one call).
fn write_trace(
    out: &Path,
    spec: &SynthSpec,
    make: impl FnOnce(
        &mut dyn FnMut(kvtier::trace::TraceCall) -> kvtier::Result<()>,
    ) -> kvtier::Result<kvtier::trace::TraceHeader>,
) -> kvtier::Result<()> {
    let header = synth_header(spec)?;
    let f = kvtier::shared_fs::create_output(out, "out")?;
    let mut w = std::io::BufWriter::new(f);
    write_header(&mut w, &header)?;
    let mut calls = 0u64;
    make(&mut |c| {
        calls += 1;
        write_call(&mut w, &c)
    })?;
    w.flush().map_err(|e| kvtier::Error::Io {
        context: format!("writing {}", out.display()),
        source: e,
    })?;
    println!("wrote {calls} calls to {} ({})", out.display(), header.note);
    Ok(())
}

/// `kvtier plan --trace`: the trace replayed at each size in `hot` (default:
/// its own, half and twice it), as a table or one JSON object.
pub fn replay_curve(path: &Path, hot: &[u32], budget: u64, as_json: bool) -> kvtier::Result<()> {
    // read a call at a time, once for its shape and once or more a size
    let open = || -> kvtier::Result<TraceReader<std::io::BufReader<std::fs::File>>> {
        let f = kvtier::shared_fs::open_input(path, "trace")?;
        TraceReader::new(std::io::BufReader::new(f))
    };
    let mut first = open()?;
    let shape = TraceShape::of(&mut first)?;
    let header = first.header.clone();
    let own = header.hot;
    let sizes: Vec<u32> = if hot.is_empty() {
        // the recorded size, half and twice it; never narrower than a query
        let mut v = vec![
            (own / 2).max(shape.widest_query(&header)).max(1),
            own,
            own.saturating_mul(2).min(kvtier::swap_in::MAX_HOT),
        ];
        v.dedup();
        v
    } else {
        hot.to_vec()
    };
    let mut curve = Vec::new();
    for &h in &sizes {
        let per_layer = replay_stream(&header, &shape, h, budget, open)?;
        let total = per_layer
            .iter()
            .fold(Default::default(), |a: kvtier::SwapInCounters, c| a.sum(c));
        curve.push((h, per_layer, total));
    }
    let rate = |c: &kvtier::SwapInCounters| c.hit_rate().map(|h| 1.0 - h);
    if as_json {
        let points: Vec<_> = curve
            .iter()
            .map(|(h, per_layer, total)| {
                json!({
                    "hot": h,
                    "hits": total.hits,
                    "misses": total.misses,
                    "miss_rate": rate(total),
                    "bytes": total.bytes,
                    "bad_indices": total.bad_indices,
                    "per_layer": per_layer.iter().map(|c| json!({
                        "calls": c.calls, "rows": c.rows, "hits": c.hits, "misses": c.misses,
                        "miss_rate": rate(c), "bytes": c.bytes,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        let out = json!({
            "trace": path.display().to_string(),
            "recorded_hot": own,
            "synthetic": header.synthetic,
            "truncated": header.truncated,
            "note": header.note,
            "calls": shape.calls,
            "curve": points,
        });
        println!("{out}");
        return Ok(());
    }
    println!(
        "trace {} ({} over {}; recorded at HOT {own}{})",
        path.display(),
        super::bench::count(shape.calls, "call", "calls"),
        super::bench::count(shape.layers(), "layer", "layers"),
        if header.synthetic { "; SYNTHETIC" } else { "" }
    );
    if !header.note.is_empty() {
        println!("  {}", header.note);
    }
    if header.truncated {
        println!(
            "  its last line was cut off (a recording stopped mid-write): the calls before it are replayed"
        );
    }
    println!(
        "{:>8}  {:>14}  {:>14}  {:>10}  {:>14}",
        "HOT", "hits", "misses", "miss rate", "bytes moved"
    );
    for (h, _, t) in &curve {
        let mr = rate(t).map_or("-".into(), |r| format!("{:.4}", r));
        let bytes = if header.item_bytes == 0 {
            "unknown".into()
        } else {
            t.bytes.to_string()
        };
        println!(
            "{h:>8}  {:>14}  {:>14}  {mr:>10}  {bytes:>14}",
            t.hits, t.misses
        );
    }
    println!("(replayed through the swap-in's exact policy, a row at a time on the CPU executor)");
    Ok(())
}
