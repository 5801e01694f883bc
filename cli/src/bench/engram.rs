//! The `engram-gather` scenario: DeepSeek-V4.1's Engram lookups. A table of
//! rows in SGLang's byte layout (every row's 256 e4m3 bytes, then every
//! row's 8 e8m0 scale bytes: 264 B a row) in host memory the GPU maps; per
//! point, one engram layer's gather of `tokens × 24` uniformly drawn rows
//! (24: the rows DeepSeek-V4.1-Flash's config reads per token and layer,
//! (max n-gram 4 − 1) × 8 heads). Methods, on the same table and ids:
//!
//! 1. kvtier's Engram gather (dequantized to bf16 rows), reading the rows
//!    in the ids' order, and again in address order (the ids sorted, each
//!    row written to its place: SGLang's `sort_ids`; the sort is done
//!    before the timing);
//! 2. the limit: one contiguous copy of the bytes the rows hold;
//! 3. SGLang's host staging: the host gathers the rows and their scales
//!    (`index_select`) into pinned staging, then copies them over.
//!
//! SGLang's own Triton kernel is not timed here (it needs triton on the GPU
//! machine).

use serde_json::json;

use kvtier::engram::{EngramArgs, EngramGatherer, bf16_rne, e4m3_to_f32, e8m0_scale};
use kvtier::{Buf, BufMut, IndexBuf};

use super::{Bench, Clock, Measurement, Timing, count, invalid, named};
use crate::transfer::{self, Dir, ExecVec, Staging};

pub(super) const SCENARIO: &str = "engram-gather";
const DIM: usize = 256;
const BLOCK: usize = 32;
const ROW_BYTES: usize = DIM + DIM / BLOCK;
/// Rows read per token and engram layer (DeepSeek-V4.1-Flash).
pub(super) const IDS_PER_TOKEN: u32 = 24;

fn grid(b: &Bench) -> kvtier::Result<(Vec<u32>, u64)> {
    let tokens = b.args.engram_tokens();
    let rows = b.args.engram_rows();
    if rows == 0 || tokens.contains(&0) {
        return Err(invalid(
            "--engram-rows/--engram-tokens",
            "need at least one row and one token",
        ));
    }
    // The limit copies the bytes of as many rows as the ids from the
    // table's start: the table must hold them.
    if let Some(&t) = tokens
        .iter()
        .find(|&&t| t as u64 * IDS_PER_TOKEN as u64 > rows)
    {
        return Err(invalid(
            "--engram-rows",
            format!(
                "{rows} rows; {t} tokens read {} ({IDS_PER_TOKEN} a token): give at least as many rows",
                t as u64 * IDS_PER_TOKEN as u64
            ),
        ));
    }
    let bytes = rows.saturating_mul(ROW_BYTES as u64);
    let budget = b.pool_budget()?;
    if bytes > budget {
        return Err(invalid(
            "--engram-rows",
            format!(
                "{rows} rows of {ROW_BYTES} B need {}, more than --pool-memory's {}",
                kvtier::pool::human_size(bytes),
                kvtier::pool::human_size(budget)
            ),
        ));
    }
    Ok((tokens.to_vec(), rows))
}

pub(super) fn points(b: &Bench) -> kvtier::Result<u64> {
    Ok(grid(b)?.0.len() as u64)
}

pub(super) fn run(b: &Bench) -> kvtier::Result<Vec<Measurement>> {
    let (tokens, rows) = grid(b)?;
    let exec = &b.exec;
    // The table where the GPU maps it (host memory registered for the CUDA
    // executor), filled with a pattern: weights, then scales.
    let n_rows = rows as usize;
    let mut table = Staging::new(exec, n_rows * ROW_BYTES)?;
    for (i, w) in table.bytes_mut().chunks_mut(8).enumerate() {
        let x = (i as u64 ^ b.args.seed).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let x = (x ^ (x >> 29)).to_le_bytes();
        w.copy_from_slice(&x[..w.len()]);
    }
    let host = table.ptr() as u64;
    let (w_addr, s_addr) = (table.exec_addr(), table.exec_addr() + (n_rows * DIM) as u64);
    let gatherer = EngramGatherer::new(exec.clone())?;
    let mut out = Vec::new();
    for &t in &tokens {
        b.progress
            .set_message(format!("engram-gather: {}", count(t, "token", "tokens")));
        let n = (t as u64 * IDS_PER_TOKEN as u64) as usize; // <= rows (checked)
        let ids: Vec<i64> = {
            use rand::{Rng, SeedableRng};
            let mut rng = rand::rngs::StdRng::seed_from_u64(b.args.seed ^ t as u64);
            (0..n).map(|_| rng.random_range(0..rows as i64)).collect()
        };
        let useful = n * ROW_BYTES;
        let params = [
            ("tokens", json!(t)),
            ("ids", json!(n)),
            ("rows", json!(rows)),
            ("dim", json!(DIM)),
        ];
        let clock = Clock::new(exec)?;
        let loc = exec.location();
        let none = |_: kvtier::Stream| Ok(());
        // sorted reads (SGLang's sort_ids): the ids in address order and
        // each one's output row; the sort itself (a device sort in SGLang)
        // is done before the timing and not counted
        let mut order: Vec<i32> = (0..n as i32).collect();
        order.sort_by_key(|&i| ids[i as usize]);
        let sorted: Vec<i64> = order.iter().map(|&i| ids[i as usize]).collect();
        let order_buf = ExecVec::from_host(exec, &order)?;
        let mut gathers = Vec::new();
        for (read, out_rows) in [(&ids, None), (&sorted, Some(&order_buf))] {
            let ids_buf = ExecVec::from_host(exec, read)?;
            // bf16 output rows, 16-byte aligned (u128 storage)
            let out = ExecVec::<u128>::zeroed(exec, n * DIM * 2 / 16)?;
            let t = b.time(&clock, Timing::Device, none, |s| {
                // SAFETY: the table and output live until after the timing,
                // of the lengths given; `order` is a permutation of the
                // output rows; one method runs at a time.
                let a = unsafe {
                    EngramArgs {
                        weights: Buf::from_raw(w_addr, n_rows * DIM, loc),
                        scales: Buf::from_raw(s_addr, n_rows * DIM / BLOCK, loc),
                        ids: IndexBuf::I64(ids_buf.buf()),
                        out: BufMut::from_raw(out.addr(), n * DIM, loc),
                        out_rows: out_rows.map(|r| r.buf()),
                        dim: DIM as u32,
                        block: BLOCK as u32,
                        row_lo: 0,
                        row_hi: rows as i64,
                    }
                };
                gatherer.gather(&a, s)
            })?;
            gatherer.check()?;
            verify(host, n_rows, &ids, &out.to_vec()?)?;
            gathers.push(t);
        }
        let kv_sorted = gathers.pop().expect("two gathers");
        let kv = gathers.pop().expect("two gathers");
        let dst = ExecVec::<u8>::zeroed(exec, useful)?;
        // SAFETY: the table holds at least `useful` bytes (as many ids as
        // rows at most, checked by `grid`) from its start, registered for
        // the CUDA executor; `dst` as many.
        let limit = b.time(&clock, Timing::Device, none, |s| unsafe {
            transfer::contiguous(exec, Dir::HostToDevice, host, dst.addr(), useful, s)
        })?;
        let mut staging_w = Staging::new(exec, n * DIM)?;
        let mut staging_s = Staging::new(exec, n * (DIM / BLOCK))?;
        let w_src: Vec<u64> = ids.iter().map(|&r| host + r as u64 * DIM as u64).collect();
        let s_src: Vec<u64> = ids
            .iter()
            .map(|&r| host + (n_rows * DIM) as u64 + r as u64 * (DIM / BLOCK) as u64)
            .collect();
        let staged = b.time(&clock, Timing::HostDriven, none, |s| {
            // SAFETY: rows and scale rows of the table; each staging holds
            // its part, and `dst` both parts (n * 264 bytes).
            unsafe {
                transfer::staged_gather(exec, &w_src, &mut staging_w, dst.addr(), DIM, s)?;
                transfer::staged_gather(
                    exec,
                    &s_src,
                    &mut staging_s,
                    dst.addr() + (n * DIM) as u64,
                    DIM / BLOCK,
                    s,
                )
            }
        })?;
        let row = |cpu, cuda, t, limit| {
            Measurement::new(SCENARIO, named(exec, cpu, cuda), &params, useful, t, limit)
        };
        let point = [
            row(
                "kvtier Engram gather (CPU executor)",
                "kvtier Engram gather",
                kv,
                false,
            ),
            row(
                "kvtier Engram gather, sorted reads (CPU executor; sort not timed)",
                "kvtier Engram gather, sorted reads (sort not timed)",
                kv_sorted,
                false,
            ),
            row(
                "contiguous memcpy of the rows' bytes (limit)",
                "contiguous H2D copy of the rows' bytes (limit)",
                limit,
                true,
            ),
            row(
                "host index_select to staging + one memcpy (SGLang's staging)",
                "host index_select to pinned staging + one H2D copy (SGLang's staging)",
                staged,
                false,
            ),
        ];
        b.point_done(&point)?;
        out.extend(point);
    }
    Ok(out)
}

/// The first and last gathered rows against the arithmetic (a benchmark
/// that writes the wrong values measures nothing).
fn verify(table: u64, n_rows: usize, ids: &[i64], out: &[u128]) -> kvtier::Result<()> {
    // SAFETY: `out` is n * DIM bf16 values in u128 storage.
    let out = unsafe { std::slice::from_raw_parts(out.as_ptr() as *const u16, ids.len() * DIM) };
    for i in [0, ids.len() - 1] {
        let r = ids[i] as usize;
        for j in 0..DIM {
            // SAFETY: row r of the table's weights and scales.
            let (w, e) = unsafe {
                (
                    *((table as *const u8).add(r * DIM + j)),
                    *((table as *const u8).add(n_rows * DIM + r * (DIM / BLOCK) + j / BLOCK)),
                )
            };
            if out[i * DIM + j] != bf16_rne(e4m3_to_f32(w) * e8m0_scale(e)) {
                return Err(kvtier::Error::Pool(format!(
                    "benchmark self-check failed: the Engram gather wrote the wrong value at row {i}, \
                     column {j}"
                )));
            }
        }
    }
    Ok(())
}
