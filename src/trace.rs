//! Top-k selection traces: what an engine's sparse-attention indexer chose,
//! layer by layer and step by step, recorded while serving (the SGLang shim)
//! or generated ([`synthesize`]), and replayed through the swap-in's exact
//! replacement policy (the CPU executor) at any hot-buffer size
//! ([`replay`]): the hits and misses a HOT buffer would have had.
//!
//! # The format
//!
//! JSON lines. The first line is the header:
//! `{"kvtier_trace": 1, "hot": H, "block_tokens": S, "item_bytes": B,
//! "synthetic": bool, "note": "..."}` (`block_tokens` 0 for token queries,
//! else the tokens per block id of a block query; `item_bytes` the bytes a
//! miss moves, 0 if unknown). Every other line is one swap-in call of one
//! layer: `{"layer": l, "rows": [{"req": r, "seq": n, "topk": [...],
//! "state": {"tokens": [...], "lru": [...]}}, ...]}`, its real batch rows
//! (padding rows are not recorded): the request's row in the engine's state
//! arrays, its sequence length, the query (token positions or block ids, -1
//! padding) and, where the recorder took one, the request's hot-buffer state
//! before the call (the `H` slots' tokens and the LRU order). A recorder
//! takes the state at a request row's first call, and whenever the row's
//! previous recorded call was not a long one (`seq > H`) or its sequence did
//! not grow by one (a new request in the row): in between, only the swap-in
//! changes that state, so replaying from the snapshots is exact at `H`.
//!
//! # Replaying at another size
//!
//! Rows are independent, so a trace replays a row at a time. At `H' != H` a
//! row whose call is its previous call's next step (`seq` one more) keeps
//! the state its replay left; a recorded state is used only where the
//! row's history starts (its first call, or a new request in the row), and
//! then fitted: its tokens in LRU order, the `H'` most recently used kept
//! (or empty slots added at the LRU end: a bigger buffer starts no warmer
//! than the recorded one). A row with `seq <= H'` is short there: token `t`
//! in slot `t`, LRU order `0..H'` (as the engine leaves a request that has
//! not outgrown its hot buffer), which is the state it carries into its
//! first long call. A row whose history starts long with no recorded state
//! (a synthetic trace) starts with an empty buffer.

use std::io::{BufRead, Write};

use serde_json::{Value, json};

use crate::cuda::Stream;
use crate::error::{Error, Result, invalid};
use crate::executor::Executor;
use crate::mem::{Buf, BufMut};
use crate::swap_in::{
    IndexBuf, KvBuffers, MAX_COUNTED_LAYERS, MAX_HOT, MAX_TOP_K, QueryKind, SwapInArgs,
    SwapInCounters, SwapInEngine,
};

/// The format version this build reads and writes.
pub const TRACE_VERSION: u64 = 1;

/// The longest sequence a trace may name (16M tokens): the replay holds a
/// host row per token position.
pub const MAX_TRACE_SEQ: u32 = 1 << 24;

/// A trace's header.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceHeader {
    pub hot: u32,
    /// 0: token queries; else tokens per block id.
    pub block_tokens: u32,
    /// Bytes one miss moves (every plane), 0 if unknown.
    pub item_bytes: u64,
    pub synthetic: bool,
    pub note: String,
    /// Read from a file whose last line was cut off (not written).
    pub truncated: bool,
}

/// A request's hot-buffer state before a call.
#[derive(Clone, Debug, PartialEq)]
pub struct RowState {
    pub tokens: Vec<i32>,
    pub lru: Vec<i16>,
}

/// One batch row of a recorded call.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRow {
    pub req: u32,
    pub seq: u32,
    pub topk: Vec<i32>,
    pub state: Option<RowState>,
}

/// One swap-in call of one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceCall {
    pub layer: u32,
    pub rows: Vec<TraceRow>,
}

/// A whole trace.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    pub header: TraceHeader,
    pub calls: Vec<TraceCall>,
}

fn bad(line: usize, msg: impl std::fmt::Display) -> Error {
    invalid("trace", format!("line {line}: {msg}"))
}

fn uint(v: &Value, key: &str, max: u64, line: usize) -> Result<u64> {
    match v.get(key).and_then(Value::as_u64) {
        Some(x) if x <= max => Ok(x),
        Some(x) => Err(bad(line, format!("`{key}` {x} is above {max}"))),
        None => Err(bad(
            line,
            format!("`{key}` is missing or not a non-negative integer"),
        )),
    }
}

fn ints<T: TryFrom<i64>>(v: &Value, key: &str, line: usize) -> Result<Vec<T>> {
    let arr = v
        .get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| bad(line, format!("`{key}` is missing or not a list")))?;
    arr.iter()
        .map(|x| {
            x.as_i64()
                .and_then(|x| T::try_from(x).ok())
                .ok_or_else(|| bad(line, format!("`{key}` holds {x}, not an integer in range")))
        })
        .collect()
}

impl Trace {
    /// Reads and checks a trace: a line that is not what the format says is
    /// an error naming the line, never a panic.
    pub fn read(r: impl BufRead) -> Result<Trace> {
        let mut lines = r.lines().enumerate();
        let io = |e: std::io::Error| Error::Io {
            context: "reading the trace".into(),
            source: e,
        };
        let (_, first) = lines
            .next()
            .ok_or_else(|| invalid("trace", "is empty (no header line)"))?;
        let h: Value = serde_json::from_str(&first.map_err(io)?)
            .map_err(|e| bad(1, format!("the header is not JSON: {e}")))?;
        if h.get("kvtier_trace").and_then(Value::as_u64) != Some(TRACE_VERSION) {
            return Err(bad(
                1,
                format!("not a kvtier trace of version {TRACE_VERSION}"),
            ));
        }
        let mut header = TraceHeader {
            hot: uint(&h, "hot", MAX_HOT as u64, 1)? as u32,
            block_tokens: match h.get("block_tokens") {
                None => 0,
                Some(_) => uint(&h, "block_tokens", MAX_TOP_K as u64, 1)? as u32,
            },
            item_bytes: match h.get("item_bytes") {
                None => 0,
                Some(_) => uint(&h, "item_bytes", u32::MAX as u64, 1)?,
            },
            synthetic: h.get("synthetic").and_then(Value::as_bool).unwrap_or(false),
            note: h
                .get("note")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            truncated: false,
        };
        if header.hot == 0 {
            return Err(bad(1, "`hot` is 0"));
        }
        let mut calls = Vec::new();
        let mut lines = lines.peekable();
        while let Some((i, text)) = lines.next() {
            let line = i + 1;
            let text = text.map_err(io)?;
            if text.trim().is_empty() {
                continue;
            }
            let v: Value = match serde_json::from_str(&text) {
                Ok(v) => v,
                // the last line of a recording cut off mid-write (a killed
                // server): the calls before it stand
                Err(e) if e.is_eof() && lines.peek().is_none() => {
                    header.truncated = true;
                    break;
                }
                Err(e) => return Err(bad(line, format!("not JSON: {e}"))),
            };
            let layer = uint(&v, "layer", MAX_COUNTED_LAYERS as u64 - 1, line)? as u32;
            let rows = v
                .get("rows")
                .and_then(Value::as_array)
                .ok_or_else(|| bad(line, "`rows` is missing or not a list"))?;
            let rows = rows
                .iter()
                .map(|r| {
                    let topk: Vec<i32> = ints(r, "topk", line)?;
                    let entries = topk.len() as u64 * header.block_tokens.max(1) as u64;
                    if topk.is_empty() || entries > MAX_TOP_K as u64 {
                        return Err(bad(line, format!("a query of {} columns", topk.len())));
                    }
                    let state = match r.get("state") {
                        None | Some(Value::Null) => None,
                        Some(s) => {
                            let st = RowState {
                                tokens: ints(s, "tokens", line)?,
                                lru: ints(s, "lru", line)?,
                            };
                            let h = header.hot as usize;
                            if st.tokens.len() != h || st.lru.len() != h {
                                return Err(bad(line, format!("a state of other than {h} slots")));
                            }
                            Some(st)
                        }
                    };
                    Ok(TraceRow {
                        req: uint(r, "req", u32::MAX as u64, line)? as u32,
                        seq: uint(r, "seq", MAX_TRACE_SEQ as u64, line)? as u32,
                        topk,
                        state,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            calls.push(TraceCall { layer, rows });
        }
        Ok(Trace { header, calls })
    }

    /// Writes the trace in its format.
    pub fn write(&self, mut w: impl Write) -> Result<()> {
        let io = |e: std::io::Error| Error::Io {
            context: "writing the trace".into(),
            source: e,
        };
        let h = &self.header;
        let header = json!({"kvtier_trace": TRACE_VERSION, "hot": h.hot, "block_tokens": h.block_tokens,
            "item_bytes": h.item_bytes, "synthetic": h.synthetic, "note": h.note});
        writeln!(w, "{header}").map_err(io)?;
        for c in &self.calls {
            let rows: Vec<Value> = c
                .rows
                .iter()
                .map(|r| {
                    let mut v = json!({"req": r.req, "seq": r.seq, "topk": r.topk});
                    if let Some(s) = &r.state {
                        v["state"] = json!({"tokens": s.tokens, "lru": s.lru});
                    }
                    v
                })
                .collect();
            writeln!(w, "{}", json!({"layer": c.layer, "rows": rows})).map_err(io)?;
        }
        Ok(())
    }

    /// The most entries a row of the trace resolves (query columns × block
    /// tokens): the smallest hot buffer it replays at.
    pub fn widest_query(&self) -> u32 {
        let cols = self
            .calls
            .iter()
            .flat_map(|c| c.rows.iter().map(|r| r.topk.len()))
            .max()
            .unwrap_or(0);
        cols as u32 * self.header.block_tokens.max(1)
    }

    /// Layers the trace names (the largest plus one).
    pub fn layers(&self) -> u32 {
        self.calls.iter().map(|c| c.layer + 1).max().unwrap_or(0)
    }
}

/// `s` fitted to `hot` slots: its tokens in LRU order, the `hot` most
/// recently used kept, empty slots added at the LRU end.
fn fit(s: &RowState, hot: usize) -> RowState {
    let order: Vec<i32> = s
        .lru
        .iter()
        .map(|&slot| s.tokens.get(slot as usize).copied().unwrap_or(-1))
        .collect();
    let kept = &order[order.len().saturating_sub(hot)..];
    let mut tokens = vec![-1; hot - kept.len()];
    tokens.extend_from_slice(kept);
    RowState {
        tokens,
        lru: (0..hot as i16).collect(),
    }
}

/// A request that has not outgrown `hot` slots: token `t` in slot `t`.
fn short_state(seq: u32, hot: usize) -> RowState {
    RowState {
        tokens: (0..hot as i32)
            .map(|t| if (t as u32) < seq { t } else { -1 })
            .collect(),
        lru: (0..hot as i16).collect(),
    }
}

/// The trace replayed at `hot` slots through the CPU executor's swap-in (the
/// kernels' exact policy): each layer's counters (`bytes` from the header's
/// `item_bytes`).
pub fn replay(trace: &Trace, hot: u32) -> Result<Vec<SwapInCounters>> {
    let engine = replay_calls(trace, hot, |_, _, _| {})?;
    let mut counted = engine.counters()?.unwrap_or_default();
    counted.truncate(trace.layers() as usize);
    for (layer, c) in counted.iter_mut().enumerate() {
        // the rows were replayed one call each; the recording's calls were batches
        c.calls = trace
            .calls
            .iter()
            .filter(|t| t.layer as usize == layer)
            .count() as u64;
        c.bytes = c.misses.saturating_mul(trace.header.item_bytes);
    }
    Ok(counted)
}

/// Each row's hot-buffer state just before the calls `wanted` (indices into
/// `trace.calls`) as the replay at `hot` slots has it: what a swap-in of
/// that call starts from (the bench times calls of a trace from it).
pub fn states_before(trace: &Trace, hot: u32, wanted: &[usize]) -> Result<Vec<Vec<RowState>>> {
    let mut out: Vec<Vec<RowState>> = vec![Vec::new(); wanted.len()];
    replay_calls(trace, hot, |call, _, state| {
        for (w, &c) in wanted.iter().enumerate() {
            if c == call {
                out[w].push(state.clone());
            }
        }
    })?;
    Ok(out)
}

/// The replay behind [`replay`] and [`states_before`]: `before(call, row,
/// state)` sees each row's state before its swap-in; returns the engine with
/// its counters.
fn replay_calls(
    trace: &Trace,
    hot: u32,
    mut before: impl FnMut(usize, usize, &RowState),
) -> Result<SwapInEngine> {
    if hot == 0 || hot > MAX_HOT {
        return Err(invalid("hot", format!("{hot} is outside 1..={MAX_HOT}")));
    }
    let h = hot as usize;
    let s = trace.header.block_tokens;
    let query = if s == 0 {
        QueryKind::Tokens
    } else {
        QueryKind::Blocks { block_tokens: s }
    };
    let max_seq = trace
        .calls
        .iter()
        .flat_map(|c| c.rows.iter().map(|r| r.seq))
        .max()
        .unwrap_or(1)
        .max(1) as usize;
    let max_cols = trace
        .calls
        .iter()
        .flat_map(|c| c.rows.iter().map(|r| r.topk.len()))
        .max()
        .unwrap_or(1) as u32;
    let layers = trace.layers().max(1);
    let mut engine = SwapInEngine::new(Executor::cpu())?;
    engine.reserve(1, (max_cols * s.max(1)).min(MAX_TOP_K))?;
    engine.enable_counters(layers)?;
    const ITEM: u32 = 8; // no KV moves (skip_io): rows only need to exist
    let host_locs: Vec<i64> = (0..max_seq as i64).collect();
    let host_cache = vec![0u8; max_seq * ITEM as usize];
    let mut device_buffer = vec![0u8; (h + 1) * ITEM as usize];
    let locs: Vec<i32> = (0..=hot as i32).collect();
    // each (layer, request row): its state, and the sequence length of its
    // last call
    let mut states: std::collections::HashMap<(u32, u32), (RowState, u32)> = Default::default();
    for (call_index, call) in trace.calls.iter().enumerate() {
        for (row_index, row) in call.rows.iter().enumerate() {
            let entries = row.topk.len() as u32 * s.max(1);
            if entries > hot {
                return Err(invalid(
                    "hot",
                    format!("{hot} slots cannot hold a query of {entries} entries"),
                ));
            }
            let key = (call.layer, row.req);
            // the row's own history continues when it is the same request's
            // next step; a recorded state is the truth at the recorded size
            // and a new start (a fitted one) elsewhere
            let continues = states
                .get(&key)
                .is_some_and(|(_, last)| row.seq == last + 1);
            let fresh = match (&row.state, row.seq as usize <= h) {
                (Some(st), _) if hot == trace.header.hot => Some(st.clone()),
                (_, true) => Some(short_state(row.seq, h)),
                (_, false) if continues => None,
                (Some(st), false) => Some(fit(st, h)),
                (None, false) => Some(short_state(0, h)),
            };
            let entry = states.entry(key).or_insert_with(|| (short_state(0, h), 0));
            if let Some(st) = fresh {
                entry.0 = st;
            }
            entry.1 = row.seq;
            let state = &mut entry.0;
            before(call_index, row_index, state);
            let mut out = vec![0i32; entries as usize];
            let (req, seq) = ([0i32], [row.seq as i32]);
            let args = SwapInArgs {
                top_k_tokens: Buf::host(&row.topk),
                top_k_stride: row.topk.len(),
                query,
                device_buffer_tokens: BufMut::host(&mut state.tokens),
                tokens_stride: h,
                device_buffer_locs: Buf::host(&locs),
                locs_stride: h + 1,
                lru_slots: BufMut::host(&mut state.lru),
                lru_stride: h,
                host_cache_locs: Buf::host(&host_locs),
                host_stride: max_seq,
                max_tokens: max_seq as u32,
                kv: KvBuffers::linear(
                    ITEM,
                    Buf::host(&host_cache),
                    BufMut::host(&mut device_buffer),
                )?,
                top_k_device_locs: BufMut::host(&mut out),
                out_stride: entries as usize,
                req_pool_indices: IndexBuf::I32(Buf::host(&req)),
                seq_lens: IndexBuf::I32(Buf::host(&seq)),
                num_real_reqs: None,
                num_requests: 1,
                num_top_k: row.topk.len() as u32,
                hot_buffer_size: hot,
                skip_io: true,
                layer: Some(call.layer),
                miss_plan: None,
            };
            // a refused entry (a token past the sequence, say) is counted as
            // a bad index, as the recording run counted it
            match engine.run(&args, Stream::null()) {
                Ok(()) | Err(Error::BadIndices(_)) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(engine)
}

/// What [`synthesize`] generates: requests decoding side by side, each
/// layer's selection per step an assumption, not a measurement.
#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub requests: u32,
    pub layers: u32,
    pub steps: u32,
    /// Context length at the first step (every request; each step adds one).
    pub context: u32,
    pub top_k: u32,
    /// The hot buffer the header names (the size it was "recorded" at).
    pub hot: u32,
    /// Share of a step's selection kept from the same layer's previous step.
    pub overlap: f64,
    /// Length of the runs of consecutive positions the new part is drawn in.
    pub run_len: u32,
    /// Positions at the end of the context always selected (a local window).
    pub recent: u32,
    pub seed: u64,
}

/// A synthetic trace: per request and layer, step 0 selects `top_k`
/// positions (the `recent` newest, the rest in runs of `run_len` at uniform
/// places); each later step keeps an `overlap` share of the previous step's
/// selection (uniformly chosen), takes the `recent` newest, and draws the
/// rest in runs. The header says it is synthetic and with what.
pub fn synthesize(spec: &SynthSpec) -> Result<Trace> {
    use rand::{Rng, SeedableRng, seq::SliceRandom};
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
        .is_none_or(|end| end > MAX_TRACE_SEQ)
    {
        return Err(invalid(
            "synth",
            format!(
                "context {} + steps {} is past {MAX_TRACE_SEQ} tokens",
                sp.context, sp.steps
            ),
        ));
    }
    if sp.top_k > MAX_TOP_K || sp.top_k > sp.context || sp.layers > MAX_COUNTED_LAYERS {
        return Err(invalid(
            "synth",
            format!(
                "top_k {} must be at most {MAX_TOP_K} and the context {}; layers at most {MAX_COUNTED_LAYERS}",
                sp.top_k, sp.context
            ),
        ));
    }
    if !(0.0..=1.0).contains(&sp.overlap) || sp.recent > sp.top_k {
        return Err(invalid(
            "synth",
            "overlap must be in 0..=1 and recent at most top_k",
        ));
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(sp.seed);
    let mut prev: std::collections::HashMap<(u32, u32), Vec<i32>> = Default::default();
    let mut calls = Vec::new();
    for step in 0..sp.steps {
        let seq = sp.context + step;
        for layer in 0..sp.layers {
            let mut rows = Vec::new();
            for req in 0..sp.requests {
                let k = sp.top_k as usize;
                let mut chosen: Vec<i32> = Vec::with_capacity(k);
                let mut seen = std::collections::HashSet::new();
                let mut take = |t: i32, chosen: &mut Vec<i32>| {
                    if chosen.len() < k && t >= 0 && (t as u32) < seq && seen.insert(t) {
                        chosen.push(t);
                    }
                };
                for t in (seq.saturating_sub(sp.recent)..seq).rev() {
                    take(t as i32, &mut chosen);
                }
                if let Some(p) = prev.get(&(layer, req)) {
                    let mut p = p.clone();
                    p.shuffle(&mut rng);
                    let keep = (sp.overlap * k as f64).round() as usize;
                    for &t in p.iter().take(keep) {
                        take(t, &mut chosen);
                    }
                }
                while chosen.len() < k {
                    let start = rng.random_range(0..seq);
                    for t in start..(start + sp.run_len).min(seq) {
                        take(t as i32, &mut chosen);
                    }
                }
                prev.insert((layer, req), chosen.clone());
                rows.push(TraceRow {
                    req,
                    seq,
                    topk: chosen,
                    state: None,
                });
            }
            calls.push(TraceCall { layer, rows });
        }
    }
    Ok(Trace {
        header: TraceHeader {
            hot: sp.hot,
            block_tokens: 0,
            item_bytes: 0,
            synthetic: true,
            truncated: false,
            note: format!(
                "synthetic (kvtier trace synth): {} requests, {} layers, {} steps from context {}, top-k {}, \
                 overlap {} with the previous step, runs of {}, the {} newest always; assumptions, not a \
                 measurement",
                sp.requests,
                sp.layers,
                sp.steps,
                sp.context,
                sp.top_k,
                sp.overlap,
                sp.run_len,
                sp.recent
            ),
        },
        calls,
    })
}
