//! Synthetic traces: requests decoding side by side, each layer's
//! selection per step drawn from stated assumptions (a share kept from the
//! previous step, the rest in runs), never a measurement.

use super::*;

/// What [`synthesize`] generates: requests decoding side by side, each
/// layer's selection per step an assumption, not a measurement.
#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub requests: u32,
    pub layers: u32,
    /// Decode steps after the warm-up ones.
    pub steps: u32,
    /// Decode steps before them that only bring the hot buffers to their
    /// steady state (the header names them; a step replay runs them untimed).
    pub warmup_steps: u32,
    /// Context length at the first step (every request; each step adds one).
    pub context: u32,
    /// Columns a query selects: positions, or block ids of `block_tokens`.
    pub top_k: u32,
    /// 0: token queries; else block queries of this many tokens a block.
    pub block_tokens: u32,
    /// Bytes one miss moves (the header's `item_bytes`; 0 if unknown).
    pub item_bytes: u64,
    /// The hot buffer the header names (the size it was "recorded" at).
    pub hot: u32,
    /// Share of a step's selection kept from the same layer's previous step.
    pub overlap: f64,
    /// Length of the runs of consecutive positions the new part is drawn in.
    pub run_len: u32,
    /// Positions (or blocks) at the end of the context always selected (a
    /// local window).
    pub recent: u32,
    pub seed: u64,
    /// Each row's outcome (its misses at `hot`) recorded in the trace, by
    /// the replay [`OutcomeRecorder`] does.
    pub outcomes: bool,
    /// Said in the header's note before the generator's own words: what the
    /// trace stands for and where its numbers come from.
    pub provenance: String,
    /// SGLang's `index_topk_freq` (1: none): layers that reuse an anchor's
    /// selection ([`shared_index_anchor`]) get no call of their own.
    pub index_topk_freq: u32,
}

/// The most memory [`synthesize_each`] keeps of the previous step's
/// selections (`requests × layers × top_k` positions, 4 bytes each, when
/// `overlap` keeps any).
pub const SYNTH_STATE_BUDGET: u64 = 256 << 20;

/// A synthetic trace: per request and layer, step 0 selects `top_k`
/// positions (the `recent` newest, the rest in runs of `run_len` at uniform
/// places); each later step keeps an `overlap` share of the previous step's
/// selection (uniformly chosen; the count rounded at random, so that the
/// share is kept on average), takes the `recent` newest, and draws the
/// rest in runs. The header says it is synthetic and with what. In memory:
/// [`synthesize_each`] streams it instead.
pub fn synthesize(spec: &SynthSpec) -> Result<Trace> {
    let mut calls = Vec::new();
    let header = synthesize_each(spec, |c| {
        calls.push(c);
        Ok(())
    })?;
    Ok(Trace { header, calls })
}

/// [`synthesize`], each call handed to `emit` as it is made (a writer's,
/// say): memory for one call and the previous step's selections, never the
/// whole trace. Returns the header (the same before and after: see
/// [`synth_header`]).
pub fn synthesize_each(
    spec: &SynthSpec,
    mut emit: impl FnMut(TraceCall) -> Result<()>,
) -> Result<TraceHeader> {
    use rand::{Rng, SeedableRng, seq::SliceRandom};
    let header = synth_header(spec)?;
    let sp = spec;
    let mut rng = rand::rngs::StdRng::seed_from_u64(sp.seed);
    // the kept count of a row: the share's whole part, and one more with
    // the probability of its fraction (so that a query of few columns keeps
    // any share on average, not only multiples of one column)
    let share = sp.overlap * sp.top_k as f64;
    let (whole, frac) = (share.floor() as usize, share - share.floor());
    let keeps_any = sp.overlap > 0.0;
    let mut prev: std::collections::HashMap<(u32, u32), Vec<i32>> = Default::default();
    let mut unkept = vec![0i32; sp.top_k as usize];
    let total_steps = sp.warmup_steps + sp.steps;
    let mut outcomes = if sp.outcomes {
        Some(OutcomeRecorder::new(
            &header,
            sp.context + total_steps,
            sp.top_k,
            sp.layers,
        )?)
    } else {
        None
    };
    let mut seen = std::collections::HashSet::new();
    for step in 0..total_steps {
        let seq = sp.context + step;
        // what a query picks from: positions, or the blocks that hold them
        let n = match sp.block_tokens {
            0 => seq,
            s => seq.div_ceil(s),
        };
        for layer in 0..sp.layers {
            if shared_index_anchor(layer, sp.index_topk_freq).is_some() {
                continue;
            }
            let mut rows = Vec::new();
            for req in 0..sp.requests {
                let k = sp.top_k as usize;
                let mut chosen: Vec<i32> = Vec::with_capacity(k);
                seen.clear();
                let mut take = |t: i32, chosen: &mut Vec<i32>| {
                    if chosen.len() < k && t >= 0 && (t as u32) < n && seen.insert(t) {
                        chosen.push(t);
                    }
                };
                for t in (n.saturating_sub(sp.recent)..n).rev() {
                    take(t as i32, &mut chosen);
                }
                if let Some(p) = prev.get_mut(&(layer, req)) {
                    p.shuffle(&mut rng);
                    let keep = whole + usize::from(frac > 0.0 && rng.random::<f64>() < frac);
                    for &t in p.iter().take(keep) {
                        take(t, &mut chosen);
                    }
                } else if !keeps_any && step > 0 {
                    // nothing kept, but the draws as if it were: a seed
                    // gives the trace it always gave
                    unkept.shuffle(&mut rng);
                }
                while chosen.len() < k {
                    let start = rng.random_range(0..n);
                    for t in start..(start + sp.run_len).min(n) {
                        take(t as i32, &mut chosen);
                    }
                }
                if keeps_any {
                    prev.insert((layer, req), chosen.clone());
                }
                rows.push(TraceRow {
                    req,
                    seq,
                    topk: chosen,
                    state: None,
                    misses: None,
                });
            }
            let mut call = TraceCall { layer, rows };
            if let Some(o) = outcomes.as_mut() {
                o.record(&mut call)?;
            }
            emit(call)?;
        }
    }
    Ok(header)
}

/// The header of the synthetic trace `spec` describes, after checking it.
pub fn synth_header(spec: &SynthSpec) -> Result<TraceHeader> {
    let sp = spec;
    if sp.requests == 0 || sp.layers == 0 || sp.steps == 0 || sp.top_k == 0 || sp.run_len == 0 {
        return Err(invalid(
            "synth",
            "requests, layers, steps, top_k and run_len must be positive",
        ));
    }
    if sp
        .context
        .checked_add(sp.steps)
        .and_then(|end| end.checked_add(sp.warmup_steps))
        .is_none_or(|end| end > MAX_TRACE_SEQ)
    {
        return Err(invalid(
            "synth",
            format!(
                "context {} + steps {} + warm-up steps {} is past {MAX_TRACE_SEQ} tokens",
                sp.context, sp.steps, sp.warmup_steps
            ),
        ));
    }
    let columns_in_context = match sp.block_tokens {
        0 => sp.context,
        s => sp.context / s,
    };
    let entries = sp.top_k as u64 * sp.block_tokens.max(1) as u64;
    if entries > MAX_TOP_K as u64
        || sp.top_k > columns_in_context
        || sp.layers > MAX_COUNTED_LAYERS
        || sp.block_tokens > MAX_TOP_K
    {
        return Err(invalid(
            "synth",
            format!(
                "top_k {} (× block tokens {}) must be at most {MAX_TOP_K} entries and fit the context {}; layers at \
                 most {MAX_COUNTED_LAYERS}",
                sp.top_k, sp.block_tokens, sp.context
            ),
        ));
    }
    if sp.hot == 0 || sp.hot > MAX_HOT || (sp.hot as u64) < entries {
        return Err(invalid(
            "synth",
            format!(
                "hot {} must be in 1..={MAX_HOT} and hold a query's {entries} entries",
                sp.hot
            ),
        ));
    }
    if !(0.0..=1.0).contains(&sp.overlap) || sp.recent > sp.top_k {
        return Err(invalid(
            "synth",
            "overlap must be in 0..=1 and recent at most top_k",
        ));
    }
    // one call's rows, and the previous step's selections where kept: 4
    // bytes a position, and a row's own (a vector, its key in the map)
    let row_bytes = sp.requests as u64 * (sp.top_k as u64 * 4 + 64);
    let kept = if sp.overlap > 0.0 {
        row_bytes * sp.layers as u64
    } else {
        0
    };
    if row_bytes.max(kept) > SYNTH_STATE_BUDGET {
        return Err(invalid(
            "synth",
            format!(
                "{} requests × {} layers × top-k {} keeps {} MiB of selections between steps, past the {} MiB a \
                 synthesis holds; synthesize fewer requests (the rows are independent: several smaller traces \
                 say the same)",
                sp.requests,
                if kept > 0 { sp.layers } else { 1 },
                sp.top_k,
                row_bytes.max(kept) >> 20,
                SYNTH_STATE_BUDGET >> 20
            ),
        ));
    }
    let what = match sp.block_tokens {
        0 => String::new(),
        s => format!(" blocks of {s} tokens,"),
    };
    let shared = match sp.index_topk_freq {
        0 | 1 => String::new(),
        k => {
            format!(" shared-index layers by SGLang's index_topk_freq {k} (no call of their own),")
        }
    };
    let warm = match sp.warmup_steps {
        0 => String::new(),
        w => format!(" after {w} warm-up steps"),
    };
    let generated = format!(
        "synthetic (kvtier trace synth): {} requests, {} layers,{shared} {} steps{warm} from context {}, top-k {},{what} \
         overlap {} with the previous step, runs of {}, the {} newest always; assumptions, not a \
         measurement",
        sp.requests, sp.layers, sp.steps, sp.context, sp.top_k, sp.overlap, sp.run_len, sp.recent
    );
    Ok(TraceHeader {
        hot: sp.hot,
        block_tokens: sp.block_tokens,
        item_bytes: sp.item_bytes,
        synthetic: true,
        truncated: false,
        warmup_steps: sp.warmup_steps,
        index_topk_freq: sp.index_topk_freq.max(1),
        layers: if sp.index_topk_freq > 1 { sp.layers } else { 0 },
        note: if sp.provenance.is_empty() {
            generated
        } else {
            format!("{}; {generated}", sp.provenance)
        },
    })
}
