//! What the swap-ins of each layer did, counted where they run: the kernels
//! add to a table on the device with atomics (no host sync, nothing to reset
//! between steps, so a CUDA graph captures them like any other parameter);
//! the CPU executor adds to the same table in host memory. Read on demand.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::abi::kvt_swap_counters;
use crate::cuda::{DeviceBuffer, DeviceSnapshot};
use crate::error::{Result, invalid};
use crate::executor::Executor;

/// Most layers one engine counts.
pub const MAX_COUNTED_LAYERS: u32 = 4096;

/// Words per layer in the table (`kvt_swap_counters`).
const WORDS: usize = size_of::<kvt_swap_counters>() / 8;

/// One layer's swap-ins since counting began (`kvt_swap_counters` in
/// `kernels/abi.h` says exactly what each adds). `repr(C)`: the C ABI hands
/// it out as `kvt_swap_in_counters`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SwapInCounters {
    /// Swap-in calls of the layer.
    pub calls: u64,
    /// Batch rows below `num_real_reqs` (CUDA-graph padding excluded).
    pub rows: u64,
    /// LRU slots whose token a long row's query named (one per slot, however
    /// often the query names the token).
    pub hits: u64,
    /// Misses loaded into evicted slots (the miss plans' counts).
    pub misses: u64,
    /// Bytes those misses moved from the host over every KV plane (none with
    /// `skip_io`).
    pub bytes: u64,
    /// Entries refused and reported in the error word.
    pub bad_indices: u64,
}

impl SwapInCounters {
    /// The counters of one `kvt_swap_counters` entry, as its words (the
    /// kernels' table; tests that run the kernels on the host read theirs).
    #[doc(hidden)]
    pub fn from_words(w: &[u64]) -> Self {
        SwapInCounters {
            calls: w[0],
            rows: w[1],
            hits: w[2],
            misses: w[3],
            bytes: w[4],
            bad_indices: w[5],
        }
    }

    /// hits / (hits + misses): the share of the long rows' LRU lookups the
    /// hot buffer served; None before any.
    pub fn hit_rate(&self) -> Option<f64> {
        let looked_up = self.hits + self.misses;
        (looked_up > 0).then(|| self.hits as f64 / looked_up as f64)
    }

    /// The counters of `self` and `other` added.
    pub fn sum(&self, other: &SwapInCounters) -> SwapInCounters {
        SwapInCounters {
            calls: self.calls + other.calls,
            rows: self.rows + other.rows,
            hits: self.hits + other.hits,
            misses: self.misses + other.misses,
            bytes: self.bytes + other.bytes,
            bad_indices: self.bad_indices + other.bad_indices,
        }
    }
}

/// The table the kernels (or the CPU executor) add to: `layers` entries of
/// `kvt_swap_counters`.
pub(super) struct CounterTable {
    layers: u32,
    store: Store,
    /// The non-blocking reader of a device table, made on first use.
    watch: Option<DeviceSnapshot<u64>>,
}

enum Store {
    /// The CPU executor adds through the table's address with atomics.
    Host(Box<[AtomicU64]>),
    Device(DeviceBuffer<u64>),
}

impl CounterTable {
    /// A zeroed table of `layers` layers where `exec` runs its swap-ins.
    pub(super) fn new(exec: &Executor, layers: u32) -> Result<Self> {
        if layers == 0 || layers > MAX_COUNTED_LAYERS {
            return Err(invalid(
                "layers",
                format!("{layers} is outside 1..={MAX_COUNTED_LAYERS}"),
            ));
        }
        let words = layers as usize * WORDS;
        let store = match exec {
            Executor::Cpu => Store::Host((0..words).map(|_| AtomicU64::new(0)).collect()),
            Executor::Cuda(dev) => Store::Device(DeviceBuffer::zeroed(dev, words)?),
        };
        Ok(CounterTable {
            layers,
            store,
            watch: None,
        })
    }

    pub(super) fn layers(&self) -> u32 {
        self.layers
    }

    /// The table's address where the executor adds to it.
    pub(super) fn address(&self) -> u64 {
        match &self.store {
            Store::Host(words) => words.as_ptr() as u64,
            Store::Device(buf) => buf.device_ptr(),
        }
    }

    /// Every layer's counters once every swap-in launched before the call
    /// has finished (the CUDA executor waits for the device).
    pub(super) fn read(&self) -> Result<Vec<SwapInCounters>> {
        let words = match &self.store {
            Store::Host(words) => words.iter().map(|w| w.load(Ordering::Relaxed)).collect(),
            Store::Device(buf) => buf.to_vec()?,
        };
        Ok(Self::decode(&words))
    }

    /// Every layer's counters without waiting: the CPU executor's now; the
    /// CUDA executor's as a copy the previous poll started found them (None
    /// on the first poll and while that copy is in flight).
    pub(super) fn poll(&mut self) -> Result<Option<Vec<SwapInCounters>>> {
        let buf = match &self.store {
            Store::Host(_) => return self.read().map(Some),
            Store::Device(buf) => buf,
        };
        if self.watch.is_none() {
            self.watch = Some(DeviceSnapshot::new(buf.device(), buf.len())?);
        }
        let watch = self.watch.as_mut().expect("made above");
        // SAFETY: the table holds `len` words and outlives the watch (a
        // field declared after it would drop first; `watch` is dropped by
        // Drop below before `store`).
        let words = unsafe { watch.poll(buf.device_ptr(), 0)? };
        Ok(words.map(|w| Self::decode(&w)))
    }

    fn decode(words: &[u64]) -> Vec<SwapInCounters> {
        words
            .chunks(WORDS)
            .map(SwapInCounters::from_words)
            .collect()
    }
}

impl Drop for CounterTable {
    fn drop(&mut self) {
        // The watch's copy reads the table: it goes (waiting for the copy)
        // before the table is freed.
        self.watch = None;
    }
}

/// Adds one CPU-executed call's counts to the layer's entry at `addr`.
///
/// # Safety
/// `addr` is 0 or the entry of a live [`CounterTable`] of the CPU executor.
pub(super) unsafe fn add_cpu(addr: u64, c: &SwapInCounters) {
    if addr == 0 {
        return;
    }
    let words = [c.calls, c.rows, c.hits, c.misses, c.bytes, c.bad_indices];
    for (i, v) in words.into_iter().enumerate() {
        // SAFETY: per this function's contract the entry is `WORDS` live
        // AtomicU64s (the table's own type).
        unsafe { AtomicU64::from_ptr((addr as *mut u64).add(i)) }.fetch_add(v, Ordering::Relaxed);
    }
}
