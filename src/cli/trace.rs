//! `kvtier trace synth` and the replay behind `kvtier plan --trace`.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use kvtier::trace::{
    SynthSpec, TraceReader, TraceShape, replay_stream, synth_header, synthesize_each, write_call,
    write_header,
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
    #[arg(long, short)]
    out: PathBuf,
    #[arg(long, default_value_t = 8)]
    requests: u32,
    #[arg(long, default_value_t = 4)]
    layers: u32,
    #[arg(long, default_value_t = 64)]
    steps: u32,
    /// Context length at the first step, in tokens.
    #[arg(long, default_value_t = 32768)]
    context: u32,
    #[arg(long, default_value_t = 2048)]
    top_k: u32,
    /// The hot buffer the trace names as its own (`plan --trace` replays at
    /// it, half and twice it unless told otherwise).
    #[arg(long, default_value_t = 4096)]
    hot: u32,
    /// Share of a step's selection kept from the previous step (0 to 1).
    #[arg(long, default_value_t = 0.9)]
    overlap: f64,
    /// Length of the runs of consecutive positions new picks come in.
    #[arg(long, default_value_t = 16)]
    run_len: u32,
    /// The newest positions every step selects (default: 128, or the top-k
    /// when smaller).
    #[arg(long)]
    recent: Option<u32>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

pub fn run(cmd: TraceCommand) -> kvtier::Result<()> {
    match cmd {
        TraceCommand::Synth(a) => {
            let spec = SynthSpec {
                requests: a.requests,
                layers: a.layers,
                steps: a.steps,
                context: a.context,
                top_k: a.top_k,
                hot: a.hot,
                overlap: a.overlap,
                run_len: a.run_len,
                recent: a.recent.unwrap_or(a.top_k.min(128)),
                seed: a.seed,
            };
            // checked before the file is made; then written a call at a time
            let header = synth_header(&spec)?;
            let f = kvtier::shared_fs::create_output(&a.out, "out")?;
            let mut w = std::io::BufWriter::new(f);
            write_header(&mut w, &header)?;
            let mut calls = 0u64;
            synthesize_each(&spec, |c| {
                calls += 1;
                write_call(&mut w, &c)
            })?;
            w.flush().map_err(|e| kvtier::Error::Io {
                context: format!("writing {}", a.out.display()),
                source: e,
            })?;
            println!(
                "wrote {calls} calls to {} ({})",
                a.out.display(),
                header.note
            );
            Ok(())
        }
    }
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
