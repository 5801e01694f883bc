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
//! "synthetic": bool, "note": "...", "warmup_steps": W}` (`block_tokens` 0
//! for token queries, else the tokens per block id of a block query;
//! `item_bytes` the bytes a miss moves, 0 if unknown; `warmup_steps`, where
//! given, the decode steps at the start that only bring the hot buffers to
//! their steady state: a replay of the decode step runs them untimed;
//! `index_topk_freq` and `layers`, where given, SGLang's shared-index layers:
//! see [`shared_index_anchor`]).
//! Every other line is one swap-in call of one layer: `{"layer": l, "rows":
//! [{"req": r, "seq": n, "topk": [...], "state": {"tokens": [...], "lru":
//! [...]}, "misses": m}, ...]}`, its real batch rows (padding rows are not
//! recorded): the request's row in the engine's state arrays, its sequence
//! length, the query (token positions or block ids, -1 padding), where the
//! recorder took one, the request's hot-buffer state before the call (the
//! `H` slots' tokens and the LRU order), and where it knew it, the call's
//! outcome: the row's entries that missed the hot buffer (copied from the
//! host) at `H`. A decode step is a run of calls of rising layers: a call
//! whose layer is not above the one before it starts the next step
//! ([`steps_of`]). A recorder
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

use std::io::{BufRead, Read, Write};

use serde_json::{Value, json};

use crate::cuda::Stream;
use crate::error::{Error, Result, invalid};
use crate::executor::Executor;
use crate::mem::{Buf, BufMut};
mod recipe;
mod synth;
pub use recipe::*;
pub use synth::*;

use crate::swap_in::{
    IndexBuf, KvBuffers, MAX_COUNTED_LAYERS, MAX_HOT, MAX_TOP_K, MissPlan, QueryKind, SwapInArgs,
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
    /// Decode steps at the start that only warm the hot buffers up.
    pub warmup_steps: u32,
    /// SGLang's `index_topk_freq` (1: every layer has its own selection):
    /// above 1, the layers [`shared_index_anchor`] names reuse an anchor
    /// layer's selection and replay its miss plan; the trace has calls of
    /// the anchors only.
    pub index_topk_freq: u32,
    /// The model's swap-in layers, shared-index ones included (0: the
    /// layers the calls name).
    pub layers: u32,
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
    /// The recorded outcome: the row's entries that missed the hot buffer.
    pub misses: Option<u32>,
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

/// The longest line a trace may hold (a call of many rows with their
/// states): a reader holds one line at a time, never more.
pub const MAX_TRACE_LINE_BYTES: usize = 64 << 20;

/// A trace read a call at a time: memory for one line, whatever the file's
/// length.
pub struct TraceReader<R> {
    r: R,
    pub header: TraceHeader,
    line: usize,
    buf: Vec<u8>,
    /// A line read ahead (to tell a cut-off last line from a bad one).
    ahead: Option<(usize, Vec<u8>)>,
}

impl<R: BufRead> TraceReader<R> {
    /// Reads and checks the header line.
    pub fn new(mut r: R) -> Result<TraceReader<R>> {
        let mut buf = Vec::new();
        if !read_line(&mut r, &mut buf, 1)? {
            return Err(invalid("trace", "is empty (no header line)"));
        }
        let h: Value = serde_json::from_slice(&buf)
            .map_err(|e| bad(1, format!("the header is not JSON: {e}")))?;
        if h.get("kvtier_trace").and_then(Value::as_u64) != Some(TRACE_VERSION) {
            return Err(bad(
                1,
                format!("not a kvtier trace of version {TRACE_VERSION}"),
            ));
        }
        let header = TraceHeader {
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
            warmup_steps: match h.get("warmup_steps") {
                None => 0,
                Some(_) => uint(&h, "warmup_steps", u32::MAX as u64, 1)? as u32,
            },
            index_topk_freq: match h.get("index_topk_freq") {
                None => 1,
                Some(_) => uint(&h, "index_topk_freq", MAX_COUNTED_LAYERS as u64, 1)?.max(1) as u32,
            },
            layers: match h.get("layers") {
                None => 0,
                Some(_) => uint(&h, "layers", MAX_COUNTED_LAYERS as u64, 1)? as u32,
            },
            truncated: false,
        };
        if header.hot == 0 {
            return Err(bad(1, "`hot` is 0"));
        }
        Ok(TraceReader {
            r,
            header,
            line: 1,
            buf,
            ahead: None,
        })
    }

    /// The next non-empty line and its number, None at the end.
    fn next_line(&mut self) -> Result<Option<(usize, Vec<u8>)>> {
        if let Some(l) = self.ahead.take() {
            return Ok(Some(l));
        }
        loop {
            self.line += 1;
            let mut buf = std::mem::take(&mut self.buf);
            if !read_line(&mut self.r, &mut buf, self.line)? {
                return Ok(None);
            }
            if buf.iter().all(u8::is_ascii_whitespace) {
                self.buf = buf;
                continue;
            }
            return Ok(Some((self.line, buf)));
        }
    }

    /// The next call, None at the end (or at a last line cut off mid-write:
    /// the header's `truncated` says so).
    pub fn next_call(&mut self) -> Result<Option<TraceCall>> {
        let Some((line, text)) = self.next_line()? else {
            return Ok(None);
        };
        // straight into typed rows (4 bytes a position); a line that does
        // not fit them is looked at again as a JSON value, for words that
        // say which key is wrong, when it is small enough to
        let typed = serde_json::from_slice::<RawCall>(&text);
        let call = match typed {
            Ok(raw) => raw.check(&self.header, line),
            // the last line of a recording cut off mid-write (a killed
            // server): the calls before it stand
            Err(e) if e.is_eof() => {
                self.ahead = self.next_line()?;
                if self.ahead.is_none() {
                    self.header.truncated = true;
                    return Ok(None);
                }
                Err(bad(line, format!("not JSON: {e}")))
            }
            Err(e) if text.len() <= EXPLAINED_LINE_BYTES => {
                match serde_json::from_slice::<Value>(&text) {
                    Ok(v) => raw_call(&v, line).and_then(|raw| raw.check(&self.header, line)),
                    Err(e) => Err(bad(line, format!("not JSON: {e}"))),
                }
                .and_then(|_| Err(bad(line, format!("not a trace call: {e}"))))
            }
            Err(e) => Err(bad(line, format!("not a trace call: {e}"))),
        };
        self.buf = text;
        call.map(Some)
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<TraceCall>;

    fn next(&mut self) -> Option<Result<TraceCall>> {
        self.next_call().transpose()
    }
}

/// Lines up to this long are parsed a second time, as JSON values, to say
/// what is wrong with them (a value costs ~30 bytes a number: not for a
/// line of tens of MiB).
const EXPLAINED_LINE_BYTES: usize = 1 << 20;

/// A call line as it is read: typed, so a position costs 4 bytes.
#[derive(serde::Deserialize)]
struct RawCall {
    layer: u64,
    rows: Vec<RawRow>,
}

#[derive(serde::Deserialize)]
struct RawRow {
    req: u64,
    seq: u64,
    topk: Vec<i32>,
    #[serde(default)]
    state: Option<RawState>,
    #[serde(default)]
    misses: Option<u64>,
}

#[derive(serde::Deserialize)]
struct RawState {
    tokens: Vec<i32>,
    lru: Vec<i16>,
}

impl RawCall {
    /// The checks every call line gets: ranges and sizes.
    fn check(self, header: &TraceHeader, line: usize) -> Result<TraceCall> {
        let below = |key: &str, x: u64, max: u64| -> Result<u64> {
            if x <= max {
                Ok(x)
            } else {
                Err(bad(line, format!("`{key}` {x} is above {max}")))
            }
        };
        let layer = below("layer", self.layer, MAX_COUNTED_LAYERS as u64 - 1)? as u32;
        let rows = self
            .rows
            .into_iter()
            .map(|r| {
                let entries = r.topk.len() as u64 * header.block_tokens.max(1) as u64;
                if r.topk.is_empty() || entries > MAX_TOP_K as u64 {
                    return Err(bad(line, format!("a query of {} columns", r.topk.len())));
                }
                let state = match r.state {
                    None => None,
                    Some(st) => {
                        let h = header.hot as usize;
                        if st.tokens.len() != h || st.lru.len() != h {
                            return Err(bad(line, format!("a state of other than {h} slots")));
                        }
                        Some(RowState {
                            tokens: st.tokens,
                            lru: st.lru,
                        })
                    }
                };
                let misses = match r.misses {
                    None => None,
                    Some(m) => Some(below("misses", m, entries)? as u32),
                };
                Ok(TraceRow {
                    req: below("req", r.req, u32::MAX as u64)? as u32,
                    seq: below("seq", r.seq, MAX_TRACE_SEQ as u64)? as u32,
                    topk: r.topk,
                    state,
                    misses,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(TraceCall { layer, rows })
    }
}

/// Reads one line (without its newline) into `buf`, at most
/// [`MAX_TRACE_LINE_BYTES`]; false at the end of the input.
fn read_line(r: &mut impl BufRead, buf: &mut Vec<u8>, line: usize) -> Result<bool> {
    buf.clear();
    let n = r
        .by_ref()
        .take(MAX_TRACE_LINE_BYTES as u64 + 1)
        .read_until(b'\n', buf)
        .map_err(|e| Error::Io {
            context: "reading the trace".into(),
            source: e,
        })?;
    if n == 0 {
        return Ok(false);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > MAX_TRACE_LINE_BYTES {
        return Err(bad(
            line,
            format!("longer than {MAX_TRACE_LINE_BYTES} bytes (a trace writes a call a line)"),
        ));
    }
    Ok(true)
}

/// A call line read as JSON values into the typed rows: only to say, key by
/// key, what is wrong with a line that does not fit them (the ranges are
/// [`RawCall::check`]'s, as for every line).
fn raw_call(v: &Value, line: usize) -> Result<RawCall> {
    let rows = v
        .get("rows")
        .and_then(Value::as_array)
        .ok_or_else(|| bad(line, "`rows` is missing or not a list"))?;
    let rows = rows
        .iter()
        .map(|r| {
            Ok(RawRow {
                topk: ints(r, "topk", line)?,
                state: match r.get("state") {
                    None | Some(Value::Null) => None,
                    Some(s) => Some(RawState {
                        tokens: ints(s, "tokens", line)?,
                        lru: ints(s, "lru", line)?,
                    }),
                },
                req: uint(r, "req", u64::MAX, line)?,
                seq: uint(r, "seq", u64::MAX, line)?,
                misses: match r.get("misses") {
                    None | Some(Value::Null) => None,
                    Some(_) => Some(uint(r, "misses", u64::MAX, line)?),
                },
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(RawCall {
        layer: uint(v, "layer", u64::MAX, line)?,
        rows,
    })
}

/// What a replay needs to know of a trace before it starts, from a first
/// pass over its calls.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TraceShape {
    pub calls: u64,
    /// Calls per layer (the layers the trace names: the largest plus one).
    pub calls_per_layer: Vec<u64>,
    /// The longest sequence, and the most columns a query has.
    pub max_seq: u32,
    pub max_cols: u32,
}

impl TraceShape {
    fn add(&mut self, c: &TraceCall) {
        self.calls += 1;
        let l = c.layer as usize;
        if self.calls_per_layer.len() <= l {
            self.calls_per_layer.resize(l + 1, 0);
        }
        self.calls_per_layer[l] += 1;
        for r in &c.rows {
            self.max_seq = self.max_seq.max(r.seq);
            self.max_cols = self.max_cols.max(r.topk.len() as u32);
        }
    }

    /// Layers the trace names (the largest plus one).
    pub fn layers(&self) -> u32 {
        self.calls_per_layer.len() as u32
    }

    /// The most entries a row resolves: the smallest hot buffer it replays at.
    pub fn widest_query(&self, header: &TraceHeader) -> u32 {
        self.max_cols * header.block_tokens.max(1)
    }

    /// The shape of the calls `calls` yields (a first pass over a trace).
    pub fn of<C: std::borrow::Borrow<TraceCall>>(
        calls: impl IntoIterator<Item = Result<C>>,
    ) -> Result<TraceShape> {
        let mut shape = TraceShape::default();
        for c in calls {
            shape.add(c?.borrow());
        }
        Ok(shape)
    }
}

fn write_io(e: std::io::Error) -> Error {
    Error::Io {
        context: "writing the trace".into(),
        source: e,
    }
}

/// Writes a trace's header line.
pub fn write_header(w: &mut impl Write, h: &TraceHeader) -> Result<()> {
    let mut header = json!({"kvtier_trace": TRACE_VERSION, "hot": h.hot, "block_tokens": h.block_tokens,
        "item_bytes": h.item_bytes, "synthetic": h.synthetic, "note": h.note});
    if h.warmup_steps > 0 {
        header["warmup_steps"] = json!(h.warmup_steps);
    }
    if h.index_topk_freq > 1 {
        header["index_topk_freq"] = json!(h.index_topk_freq);
    }
    if h.layers > 0 {
        header["layers"] = json!(h.layers);
    }
    writeln!(w, "{header}").map_err(write_io)
}

/// Writes one call's line, a row at a time (no JSON value of the whole
/// call is built).
pub fn write_call(w: &mut impl Write, c: &TraceCall) -> Result<()> {
    // the keys in the order a JSON object of them prints (sorted), as the
    // format has always written them
    #[derive(serde::Serialize)]
    struct Row<'a> {
        #[serde(skip_serializing_if = "Option::is_none")]
        misses: Option<u32>,
        req: u32,
        seq: u32,
        #[serde(skip_serializing_if = "Option::is_none")]
        state: Option<State<'a>>,
        topk: &'a [i32],
    }
    #[derive(serde::Serialize)]
    struct State<'a> {
        lru: &'a [i16],
        tokens: &'a [i32],
    }
    write!(w, "{{\"layer\":{},\"rows\":[", c.layer).map_err(write_io)?;
    for (i, r) in c.rows.iter().enumerate() {
        if i > 0 {
            w.write_all(b",").map_err(write_io)?;
        }
        let row = Row {
            misses: r.misses,
            req: r.req,
            seq: r.seq,
            state: r.state.as_ref().map(|s| State {
                lru: &s.lru,
                tokens: &s.tokens,
            }),
            topk: &r.topk,
        };
        serde_json::to_writer(&mut *w, &row).map_err(|e| write_io(e.into()))?;
    }
    w.write_all(b"]}\n").map_err(write_io)
}

impl Trace {
    /// Reads and checks a whole trace into memory (see [`TraceReader`] for
    /// one call at a time): a line that is not what the format says is an
    /// error naming the line, never a panic.
    pub fn read(r: impl BufRead) -> Result<Trace> {
        let mut reader = TraceReader::new(r)?;
        let mut calls = Vec::new();
        while let Some(c) = reader.next_call()? {
            calls.push(c);
        }
        Ok(Trace {
            header: reader.header,
            calls,
        })
    }

    /// Writes the trace in its format.
    pub fn write(&self, mut w: impl Write) -> Result<()> {
        write_header(&mut w, &self.header)?;
        for c in &self.calls {
            write_call(&mut w, c)?;
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

/// The most memory a replay keeps of request rows' hot-buffer states
/// (6 bytes a slot for each row that has outgrown its buffer): a trace that
/// needs more is replayed a group of layers at a time (rows of different
/// layers never share a state), and one layer that alone needs more is an
/// error that says so.
pub const REPLAY_STATE_BUDGET: u64 = 256 << 20;

/// The trace replayed at `hot` slots through the CPU executor's swap-in (the
/// kernels' exact policy): each layer's counters (`bytes` from the header's
/// `item_bytes`).
pub fn replay(trace: &Trace, hot: u32) -> Result<Vec<SwapInCounters>> {
    let shape = TraceShape::of(trace.calls.iter().map(Ok))?;
    replay_calls_from(&trace.header, &shape, hot, REPLAY_STATE_BUDGET, || {
        Ok(trace
            .calls
            .iter()
            .map(|c| Ok(std::borrow::Cow::Borrowed(c))))
    })
}

/// [`replay`] of a trace read a call at a time: `calls` opens it anew for
/// each pass (a first pass for its [`TraceShape`], then one or more over
/// groups of layers), so memory holds one line and the rows' states within
/// `budget` bytes ([`REPLAY_STATE_BUDGET`] by default), whatever the
/// trace's length.
pub fn replay_stream<I>(
    header: &TraceHeader,
    shape: &TraceShape,
    hot: u32,
    budget: u64,
    calls: impl FnMut() -> Result<I>,
) -> Result<Vec<SwapInCounters>>
where
    I: Iterator<Item = Result<TraceCall>>,
{
    let mut calls = calls;
    replay_calls_from(header, shape, hot, budget, || {
        Ok(calls()?.map(|c| c.map(std::borrow::Cow::Owned)))
    })
}

fn replay_calls_from<'a, I>(
    header: &TraceHeader,
    shape: &TraceShape,
    hot: u32,
    budget: u64,
    calls: impl FnMut() -> Result<I>,
) -> Result<Vec<SwapInCounters>>
where
    I: Iterator<Item = Result<std::borrow::Cow<'a, TraceCall>>>,
{
    let mut counted = replay_passes(header, shape, hot, budget, calls, |_, _, _| {})?;
    counted.truncate(shape.layers() as usize);
    for (layer, c) in counted.iter_mut().enumerate() {
        // the rows were replayed one call each; the recording's calls were batches
        c.calls = shape.calls_per_layer[layer];
        c.bytes = c.misses.saturating_mul(header.item_bytes);
    }
    Ok(counted)
}

/// Each row's hot-buffer state just before the calls `wanted` (indices into
/// `trace.calls`) as the replay at `hot` slots has it: what a swap-in of
/// that call starts from (the bench times calls of a trace from it). The
/// trace is in memory already; its replay keeps every row's state.
pub fn states_before(trace: &Trace, hot: u32, wanted: &[usize]) -> Result<Vec<Vec<RowState>>> {
    let shape = TraceShape::of(trace.calls.iter().map(Ok))?;
    let mut out: Vec<Vec<RowState>> = vec![Vec::new(); wanted.len()];
    replay_passes(
        &trace.header,
        &shape,
        hot,
        REPLAY_STATE_BUDGET,
        || {
            Ok(trace
                .calls
                .iter()
                .map(|c| Ok(std::borrow::Cow::Borrowed(c))))
        },
        |call, _, state| {
            for (w, &c) in wanted.iter().enumerate() {
                if c == call {
                    out[w].push(state.clone());
                }
            }
        },
    )?;
    Ok(out)
}

/// The layer whose selection and miss plan `layer` reuses under SGLang's
/// `index_topk_freq` rule (DSA models, without `index_skip_topk_offset`):
/// with a frequency `k` above 1, layer `i` computes its own selection when
/// `max(i - 1, 0)` is a multiple of `k` (layers 0, 1, 1 + k, 1 + 2k, ...),
/// and every other layer reuses the nearest such layer below it, replaying
/// its miss plan (`copy_cache_planned_mla`) on a side stream. None: `layer`
/// computes its own.
pub fn shared_index_anchor(layer: u32, freq: u32) -> Option<u32> {
    let computes = |i: u32| freq <= 1 || i.saturating_sub(1).is_multiple_of(freq);
    if computes(layer) {
        return None;
    }
    (0..layer).rev().find(|&i| computes(i))
}

/// Whether a call of `layer` after a call of `previous` starts the next
/// decode step: its layer is not above the one before it.
pub fn starts_step(previous: Option<u32>, layer: u32) -> bool {
    previous.is_some_and(|p| layer <= p)
}

/// The decode steps of a run of calls: a call whose layer is not above the
/// one before it starts the next step. Each step as the range of its calls.
pub fn steps_of<C: std::borrow::Borrow<TraceCall>>(calls: &[C]) -> Vec<std::ops::Range<usize>> {
    let mut steps = Vec::new();
    let mut start = 0;
    for i in 1..calls.len() {
        if starts_step(Some(calls[i - 1].borrow().layer), calls[i].borrow().layer) {
            steps.push(start..i);
            start = i;
        }
    }
    if start < calls.len() {
        steps.push(start..calls.len());
    }
    steps
}

/// Fills in calls' outcomes as they are made: each row's misses at the
/// trace's own hot size, from the replay [`replay`] does (a row at a time,
/// through the CPU executor's swap-in). A synthesizer hands it every call in
/// order; a recorder of a real run has the outcome from the run itself.
pub struct OutcomeRecorder {
    r: Replayer,
    calls: usize,
}

impl OutcomeRecorder {
    /// For calls of queries of at most `max_cols` columns, sequences of at
    /// most `max_seq`, layers below `layers`, at `header.hot`.
    pub fn new(header: &TraceHeader, max_seq: u32, max_cols: u32, layers: u32) -> Result<Self> {
        let shape = TraceShape {
            calls: 0,
            calls_per_layer: vec![0; layers.max(1) as usize],
            max_seq,
            max_cols,
        };
        Ok(OutcomeRecorder {
            r: Replayer::new(header, &shape, header.hot)?,
            calls: 0,
        })
    }

    /// Sets `call`'s rows' `misses` to what the replay finds.
    pub fn record(&mut self, call: &mut TraceCall) -> Result<()> {
        let mut misses = vec![0u32; call.rows.len()];
        let index = self.calls;
        let over = self.r.call(
            index,
            call,
            REPLAY_STATE_BUDGET,
            &mut |_, _, _| {},
            &mut |_, row, m| misses[row] = m,
        )?;
        if let Err(over) = over {
            return Err(invalid(
                "trace",
                format!(
                    "recording outcomes keeps the states of {} request rows (up to {} B each) at layer {}, past \
                     the {} MiB a replay keeps: fewer requests or layers",
                    over.rows,
                    self.r.state_bytes(),
                    over.layer,
                    REPLAY_STATE_BUDGET >> 20
                ),
            ));
        }
        for (row, m) in call.rows.iter_mut().zip(misses) {
            row.misses = Some(m);
        }
        self.calls += 1;
        Ok(())
    }
}

/// A request row's state between its calls: a row that has not outgrown
/// its buffer holds `short_state(seq)`, kept as its length alone.
enum Kept {
    Short(u32),
    Long(RowState),
}

/// Why a pass stopped: its layers' states outgrew the budget.
struct OverBudget {
    layer: u32,
    rows: usize,
}

/// The replay behind [`replay`] and [`states_before`]: the calls, a group
/// of layers a pass (all of them at first, fewer while the rows' states
/// outgrow `budget` bytes); `before(call, row, state)` sees each row's
/// state before its swap-in (a pass that outgrew the budget and was
/// replayed in smaller ones shows its rows again). Returns each layer's
/// counters.
fn replay_passes<'a, I>(
    header: &TraceHeader,
    shape: &TraceShape,
    hot: u32,
    budget: u64,
    mut calls: impl FnMut() -> Result<I>,
    mut before: impl FnMut(usize, usize, &RowState),
) -> Result<Vec<SwapInCounters>>
where
    I: Iterator<Item = Result<std::borrow::Cow<'a, TraceCall>>>,
{
    if hot == 0 || hot > MAX_HOT {
        return Err(invalid("hot", format!("{hot} is outside 1..={MAX_HOT}")));
    }
    let layers = shape.layers().max(1);
    let mut counted = vec![SwapInCounters::default(); layers as usize];
    let (mut first, mut group) = (0, layers);
    'spans: while first < layers {
        let span = first..(first + group).min(layers);
        let mut r = Replayer::new(header, shape, hot)?;
        for (call_index, call) in calls()?.enumerate() {
            let call = call?;
            if !span.contains(&call.layer) {
                continue;
            }
            if let Err(over) = r.call(call_index, &call, budget, &mut before, &mut |_, _, _| {})? {
                if group == 1 {
                    return Err(invalid(
                        "trace",
                        format!(
                            "replaying layer {} at HOT {hot} keeps the states of {} request rows at once (up to {} \
                             B each), past the {} MiB a replay keeps; replay at a smaller HOT, give the replay more \
                             memory, or a trace of fewer request rows",
                            over.layer,
                            over.rows,
                            r.state_bytes(),
                            budget >> 20
                        ),
                    ));
                }
                // this span again, in halves (the spans before it stand)
                group = group.div_ceil(2);
                continue 'spans;
            }
        }
        let got = r.engine.counters()?.unwrap_or_default();
        for l in span.clone() {
            if let Some(c) = got.get(l as usize) {
                counted[l as usize] = *c;
            }
        }
        first = span.end;
    }
    Ok(counted)
}

/// The swap-in's CPU executor and the rows' states, replaying calls.
struct Replayer {
    engine: SwapInEngine,
    hot: u32,
    recorded_hot: u32,
    query: QueryKind,
    block_tokens: u32,
    max_seq: usize,
    host_locs: Vec<i64>,
    host_cache: Vec<u8>,
    device_buffer: Vec<u8>,
    locs: Vec<i32>,
    /// Each (layer, request row): its state and the sequence length of its
    /// last call.
    states: std::collections::HashMap<(u32, u32), (Kept, u32)>,
    /// How many of them are Long (the memory they hold).
    long: u64,
    scratch: RowState,
    out: Vec<i32>,
    /// The miss plan each row's call records (its count is the row's misses).
    miss_src: Vec<i64>,
    miss_dst: Vec<i32>,
    miss_count: [i32; 1],
}

const ITEM: u32 = 8; // no KV moves (skip_io): rows only need to exist

impl Replayer {
    fn new(header: &TraceHeader, shape: &TraceShape, hot: u32) -> Result<Replayer> {
        let h = hot as usize;
        let s = header.block_tokens;
        let max_seq = shape.max_seq.max(1) as usize;
        let mut engine = SwapInEngine::new(Executor::cpu())?;
        engine.reserve(1, (shape.max_cols.max(1) * s.max(1)).min(MAX_TOP_K))?;
        engine.enable_counters(shape.layers().max(1))?;
        Ok(Replayer {
            engine,
            hot,
            recorded_hot: header.hot,
            query: if s == 0 {
                QueryKind::Tokens
            } else {
                QueryKind::Blocks { block_tokens: s }
            },
            block_tokens: s,
            max_seq,
            host_locs: (0..max_seq as i64).collect(),
            host_cache: vec![0u8; max_seq * ITEM as usize],
            device_buffer: vec![0u8; (h + 1) * ITEM as usize],
            locs: (0..=hot as i32).collect(),
            states: Default::default(),
            long: 0,
            scratch: short_state(0, h),
            out: Vec::new(),
            miss_src: vec![0; ((shape.max_cols.max(1) * s.max(1)).min(MAX_TOP_K)) as usize],
            miss_dst: vec![0; ((shape.max_cols.max(1) * s.max(1)).min(MAX_TOP_K)) as usize],
            miss_count: [0],
        })
    }

    /// Bytes one kept long state holds.
    fn state_bytes(&self) -> u64 {
        self.hot as u64 * (4 + 2)
    }

    /// Bytes the rows' kept states take: every row's entry (a short row's
    /// too, its length alone), and the slots of the long ones.
    fn kept_bytes(&self) -> u64 {
        // the map's entry and its control byte, rounded up
        const ENTRY: u64 = (size_of::<((u32, u32), (Kept, u32))>() + 16) as u64;
        self.states.len() as u64 * ENTRY + self.long * self.state_bytes()
    }

    /// Replays one call's rows (`before` sees each row's state before its
    /// swap-in, `after` its misses); Err(OverBudget) when the states kept
    /// outgrow the budget.
    fn call(
        &mut self,
        call_index: usize,
        call: &TraceCall,
        budget: u64,
        before: &mut impl FnMut(usize, usize, &RowState),
        after: &mut impl FnMut(usize, usize, u32),
    ) -> Result<std::result::Result<(), OverBudget>> {
        let h = self.hot as usize;
        for (row_index, row) in call.rows.iter().enumerate() {
            let entries = row.topk.len() as u32 * self.block_tokens.max(1);
            if entries > self.hot {
                return Err(invalid(
                    "hot",
                    format!(
                        "{} slots cannot hold a query of {entries} entries",
                        self.hot
                    ),
                ));
            }
            let key = (call.layer, row.req);
            // the row's own history continues when it is the same request's
            // next step; a recorded state is the truth at the recorded size
            // and a new start (a fitted one) elsewhere
            let kept = self.states.remove(&key);
            if matches!(kept, Some((Kept::Long(_), _))) {
                self.long -= 1;
            }
            let continues = kept.as_ref().is_some_and(|(_, last)| row.seq == last + 1);
            let short = row.seq as usize <= h;
            let mut state = match (&row.state, short) {
                (Some(st), _) if self.hot == self.recorded_hot => Kept::Long(st.clone()),
                (_, true) => Kept::Short(row.seq),
                (_, false) if continues => kept.map(|(k, _)| k).unwrap(),
                (Some(st), false) => Kept::Long(fit(st, h)),
                (None, false) => Kept::Short(0),
            };
            // a short state is built in the scratch; a long call keeps its own
            let st: &mut RowState = match &mut state {
                Kept::Short(seq) => {
                    let seq = *seq;
                    for (t, slot) in self.scratch.tokens.iter_mut().enumerate() {
                        *slot = if (t as u32) < seq { t as i32 } else { -1 };
                    }
                    for (i, l) in self.scratch.lru.iter_mut().enumerate() {
                        *l = i as i16;
                    }
                    &mut self.scratch
                }
                Kept::Long(st) => st,
            };
            before(call_index, row_index, st);
            self.out.clear();
            self.out.resize(entries as usize, 0);
            let (req, seq) = ([0i32], [row.seq as i32]);
            self.miss_count[0] = 0;
            let args = SwapInArgs {
                top_k_tokens: Buf::host(&row.topk),
                top_k_stride: row.topk.len(),
                query: self.query,
                device_buffer_tokens: BufMut::host(&mut st.tokens),
                tokens_stride: h,
                device_buffer_locs: Buf::host(&self.locs),
                locs_stride: h + 1,
                lru_slots: BufMut::host(&mut st.lru),
                lru_stride: h,
                host_cache_locs: Buf::host(&self.host_locs),
                host_stride: self.max_seq,
                max_tokens: self.max_seq as u32,
                kv: KvBuffers::linear(
                    ITEM,
                    Buf::host(&self.host_cache),
                    BufMut::host(&mut self.device_buffer),
                )?,
                top_k_device_locs: BufMut::host(&mut self.out),
                out_stride: entries as usize,
                req_pool_indices: IndexBuf::I32(Buf::host(&req)),
                seq_lens: IndexBuf::I32(Buf::host(&seq)),
                num_real_reqs: None,
                num_requests: 1,
                num_top_k: row.topk.len() as u32,
                hot_buffer_size: self.hot,
                skip_io: true,
                layer: Some(call.layer),
                miss_plan: Some(MissPlan {
                    stride: self.miss_src.len(),
                    capacity: self.miss_src.len(),
                    src: BufMut::host(&mut self.miss_src),
                    dst: BufMut::host(&mut self.miss_dst),
                    count: BufMut::host(&mut self.miss_count),
                }),
            };
            // a refused entry (a token past the sequence, say) is counted as
            // a bad index, as the recording run counted it
            match self.engine.run(&args, Stream::null()) {
                Ok(()) | Err(Error::BadIndices(_)) => {}
                Err(e) => return Err(e),
            }
            after(call_index, row_index, self.miss_count[0].max(0) as u32);
            // what the row carries into its next call: a long call changed
            // its state (kept whole from now on); a short one changed nothing
            let state = match state {
                Kept::Short(_) if !short => Kept::Long(self.scratch.clone()),
                k => k,
            };
            if matches!(state, Kept::Long(_)) {
                self.long += 1;
            }
            self.states.insert(key, (state, row.seq));
            if self.kept_bytes() > budget {
                return Ok(Err(OverBudget {
                    layer: call.layer,
                    rows: self.states.len(),
                }));
            }
        }
        Ok(Ok(()))
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    fn synth(requests: u32, layers: u32) -> Trace {
        synthesize(&SynthSpec {
            requests,
            layers,
            steps: 6,
            context: 600,
            top_k: 32,
            hot: 128,
            overlap: 0.7,
            run_len: 4,
            recent: 8,
            seed: 3,
            warmup_steps: 0,
            block_tokens: 0,
            item_bytes: 0,
            outcomes: false,
            provenance: String::new(),
            index_topk_freq: 1,
        })
        .unwrap()
    }

    fn replay_within(t: &Trace, hot: u32, budget: u64) -> Result<Vec<SwapInCounters>> {
        let shape = TraceShape::of(t.calls.iter().map(Ok)).unwrap();
        replay_passes(
            &t.header,
            &shape,
            hot,
            budget,
            || Ok(t.calls.iter().map(|c| Ok(std::borrow::Cow::Borrowed(c)))),
            |_, _, _| {},
        )
    }

    /// SGLang's `index_topk_freq` rule (DSA, no offset): layers 0, 1,
    /// 1 + k, 1 + 2k, ... select; the others reuse the nearest one below.
    #[test]
    fn shared_index_layers_follow_sglangs_rule() {
        let anchors = |freq, n| {
            (0..n)
                .map(|l| shared_index_anchor(l, freq))
                .collect::<Vec<_>>()
        };
        assert_eq!(anchors(1, 4), [None; 4]);
        assert_eq!(anchors(2, 6), [None, None, Some(1), None, Some(3), None]);
        assert_eq!(
            anchors(4, 10),
            [
                None,
                None,
                Some(1),
                Some(1),
                Some(1),
                None,
                Some(5),
                Some(5),
                Some(5),
                None
            ]
        );
    }

    /// Rows of different layers share no state: a replay split into passes
    /// over fewer layers (the budget too small for all at once) counts
    /// exactly what one pass counts; a layer that alone exceeds it is an
    /// error that says so.
    #[test]
    fn a_replay_in_passes_of_fewer_layers_counts_the_same() {
        let t = synth(5, 6);
        for hot in [64u32, 128, 256] {
            let whole = replay_within(&t, hot, u64::MAX).unwrap();
            let per = hot as u64 * 6;
            // room for one layer's 5 rows, not two layers'
            let split = replay_within(&t, hot, 7 * per).unwrap();
            assert_eq!(whole, split, "HOT {hot}");
            assert!(whole.iter().map(|c| c.misses).sum::<u64>() > 0);
            let e = replay_within(&t, hot, 3 * per).unwrap_err().to_string();
            assert!(e.contains("keeps the states of"), "{e}");
        }
    }

    /// Rows that never outgrow their buffer keep only their length, but
    /// that counts too: a trace of very many of them is refused by layer,
    /// not replayed into unbounded memory.
    #[test]
    fn many_short_rows_count_against_the_budget() {
        let header = TraceHeader {
            hot: 64,
            block_tokens: 0,
            item_bytes: 0,
            synthetic: false,
            note: String::new(),
            truncated: false,
            warmup_steps: 0,
            index_topk_freq: 1,
            layers: 0,
        };
        let calls: Vec<TraceCall> = (0..5000)
            .map(|req| TraceCall {
                layer: 0,
                rows: vec![TraceRow {
                    req,
                    seq: 1,
                    topk: vec![0],
                    state: None,
                    misses: None,
                }],
            })
            .collect();
        let t = Trace { header, calls };
        assert!(replay_within(&t, 64, u64::MAX).is_ok());
        let e = replay_within(&t, 64, 64 << 10).unwrap_err().to_string();
        assert!(e.contains("keeps the states of"), "{e}");
    }

    /// A trace read a call at a time replays as the whole trace in memory.
    #[test]
    fn a_streamed_trace_replays_as_one_in_memory() {
        let t = synth(3, 4);
        let mut text = Vec::new();
        t.write(&mut text).unwrap();
        let open = || TraceReader::new(std::io::Cursor::new(text.as_slice()));
        let mut first = open().unwrap();
        let shape = TraceShape::of(&mut first).unwrap();
        assert_eq!(shape.calls, t.calls.len() as u64);
        assert_eq!(shape.layers(), t.layers());
        for hot in [32u32, 100] {
            assert_eq!(
                replay_stream(&first.header, &shape, hot, REPLAY_STATE_BUDGET, open).unwrap(),
                replay(&t, hot).unwrap()
            );
        }
    }

    #[test]
    fn a_line_longer_than_a_trace_writes_is_refused_without_reading_on() {
        let mut text = b"{\"kvtier_trace\": 1, \"hot\": 8}\n".to_vec();
        text.extend(std::iter::repeat_n(b' ', MAX_TRACE_LINE_BYTES + 10));
        let mut r = TraceReader::new(std::io::Cursor::new(text)).unwrap();
        let e = r.next_call().unwrap_err().to_string();
        assert!(e.contains("line 2: longer than"), "{e}");
    }

    #[test]
    fn a_synthesis_too_large_to_hold_is_refused_before_anything_is_made() {
        let spec = SynthSpec {
            requests: 100_000_000,
            layers: 1,
            steps: 1,
            context: 4096,
            top_k: 1,
            hot: 4096,
            overlap: 0.9,
            run_len: 1,
            recent: 0,
            seed: 1,
            warmup_steps: 0,
            block_tokens: 0,
            item_bytes: 0,
            outcomes: false,
            provenance: String::new(),
            index_topk_freq: 1,
        };
        let mut calls = 0;
        let e = synthesize_each(&spec, |_| {
            calls += 1;
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("synthesize fewer requests"), "{e}");
        assert_eq!(calls, 0);
    }
}
