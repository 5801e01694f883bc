//! The per-layer API an attention backend calls, one [`Tier`] per GPU rank.
//!
//! Requests are bound to *slots* once, when they are admitted
//! ([`Tier::bind_slot`]); a slot table (in device memory for the CUDA
//! executor) maps each slot to its region's base address. Per decode step and
//! layer the engine then passes only device tensors it already has — slot per
//! batch row, sequence lengths, top-k indices — so the per-layer calls do no
//! allocation, no host synchronisation and no data-dependent host work, run on
//! the caller's stream, and can be captured in a CUDA graph. Bad indices found
//! by the kernels are reported at the next [`Tier::check`].

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::copy_choice::{CopyChoices, CopyMethodTable, CopyPath};
use crate::copy_method::CopyMethod;
use crate::cuda::{CudaDevice, DeviceBuffer, Stream, copy_to_device_async};
use crate::error::{Result, invalid};
use crate::error_word::ErrorWord;
use crate::executor::Executor;
use crate::gather::{self, GatherBatch};
use crate::layout::LayerFirstLayout;
use crate::mem::{Buf, BufMut};
use crate::pool::{Pool, Region};
use crate::slots::TierTables;
use crate::swap_in::{SwapInArgs, SwapInEngine, SwapInStrategy};
use crate::writeback::{self, WritebackItems, WritebackSource};

/// Most slots a tier's table may have.
pub const MAX_SLOTS: u32 = 1 << 24;

static NEXT_TIER_ID: AtomicU64 = AtomicU64::new(1);

/// The KV tier of one GPU rank over one pool.
pub struct Tier {
    id: u64,
    pool: Arc<Pool>,
    exec: Executor,
    /// Region base per slot as the executor addresses it; 0 = unbound. For the
    /// CUDA executor this mirrors `Backend::Cuda::slots`.
    slots: Vec<u64>,
    backend: Backend,
    /// The swap-in engine, once enabled.
    swap_in: Option<SwapInEngine>,
    /// The copy methods the gather and the writeback take by call size, for
    /// this pool's entries on this GPU ([`CopyMethodTable::measured`]).
    gather_copy: CopyChoices,
    writeback_copy: CopyChoices,
}

enum Backend {
    Cpu,
    Cuda {
        dev: Arc<CudaDevice>,
        slots: DeviceBuffer<u64>,
        error: crate::cuda::DeviceErrorWord,
    },
}

/// The device KV buffers of every layer, registered once with
/// [`Tier::register_kv_layers`] for [`Tier::writeback_all_layers`].
pub struct KvLayers<'a> {
    tier: u64,
    table: LayerTable,
    layers: u32,
    rows: u64,
    _buffers: PhantomData<&'a [u8]>,
}

enum LayerTable {
    Host(Vec<u64>),
    Device(DeviceBuffer<u64>),
}

impl std::fmt::Debug for KvLayers<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvLayers")
            .field("layers", &self.layers)
            .field("rows", &self.rows)
            .finish()
    }
}

impl KvLayers<'_> {
    /// Rows in each layer's buffer.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Layers registered.
    pub fn layers(&self) -> u32 {
        self.layers
    }
}

impl Tier {
    /// A tier over `pool` with a table of `num_slots` request slots, running
    /// on `exec`. For the CUDA executor this registers the pool's memory with
    /// the GPU (once per pool) and allocates the slot table and error word.
    pub fn new(pool: Arc<Pool>, exec: Executor, num_slots: u32) -> Result<Self> {
        if num_slots == 0 || num_slots > MAX_SLOTS {
            return Err(invalid(
                "num_slots",
                format!("{num_slots} is outside 1..={MAX_SLOTS}"),
            ));
        }
        let backend = match &exec {
            Executor::Cpu => Backend::Cpu,
            Executor::Cuda(dev) => Backend::Cuda {
                dev: dev.clone(),
                slots: {
                    pool.register_all(dev)?;
                    DeviceBuffer::zeroed(dev, num_slots as usize)?
                },
                error: crate::cuda::DeviceErrorWord::new(dev)?,
            },
        };
        let arch = match &exec {
            Executor::Cpu => None,
            Executor::Cuda(dev) => {
                let (major, minor) = dev.compute_capability();
                Some((major * 10 + minor) as u32)
            }
        };
        let entry = pool.layout().entry_bytes();
        let table = CopyMethodTable::measured();
        Ok(Tier {
            id: NEXT_TIER_ID.fetch_add(1, Ordering::Relaxed),
            pool,
            exec,
            slots: vec![0; num_slots as usize],
            backend,
            swap_in: None,
            gather_copy: CopyChoices::new(table, CopyPath::Gather, arch, entry),
            writeback_copy: CopyChoices::new(table, CopyPath::Writeback, arch, entry),
        })
    }

    /// The pool.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The pool's layout.
    pub fn layout(&self) -> LayerFirstLayout {
        self.pool.layout()
    }

    /// The executor.
    pub fn executor(&self) -> &Executor {
        &self.exec
    }

    /// Slots in the table.
    pub fn num_slots(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Binds `slot` to `region` (a request's admission). For the CUDA
    /// executor the slot table is updated in `stream` order: kernels later on
    /// `stream` see the binding; kernels on another stream need an event or a
    /// synchronisation in between. Not for the per-layer path or a CUDA graph:
    /// it copies 8 bytes from pageable memory.
    pub fn bind_slot(&mut self, slot: u32, region: &Region, stream: Stream) -> Result<()> {
        let addr = match &self.backend {
            Backend::Cpu => self.pool.region_host_addr(region)?,
            Backend::Cuda { dev, .. } => self.pool.region_device_addr(region, dev)?,
        };
        self.set_slot(slot, addr, stream)
    }

    /// Unbinds `slot`: rows that name it are refused from now on.
    pub fn unbind_slot(&mut self, slot: u32, stream: Stream) -> Result<()> {
        self.set_slot(slot, 0, stream)
    }

    fn set_slot(&mut self, slot: u32, addr: u64, stream: Stream) -> Result<()> {
        if slot >= self.num_slots() {
            return Err(invalid(
                "slot",
                format!("{slot} is beyond the tier's {} slots", self.num_slots()),
            ));
        }
        if let Backend::Cuda { dev, slots, .. } = &self.backend {
            copy_to_device_async(dev, slots.device_ptr() + slot as u64 * 8, &[addr], stream)?;
        }
        self.slots[slot as usize] = addr;
        Ok(())
    }

    /// Top-k sparse gather of `layer` for a whole batch into `out`
    /// (`[batch][k][entry_bytes]`, 8-byte aligned), one launch, with the copy
    /// method measured best for its entry size and call size on this GPU
    /// ([`CopyMethodTable::measured`]; where nothing was measured,
    /// [`CopyMethod::for_gather`]). Padding (-1)
    /// rows and indices are zero-filled; bad indices are zero-filled and
    /// reported (CPU: now; CUDA: at the next [`Tier::check`]).
    pub fn gather(
        &self,
        layer: u32,
        batch: &GatherBatch<'_>,
        out: BufMut<'_, u8>,
        stream: Stream,
    ) -> Result<()> {
        let rows = batch.req_slots.len() as u64 * batch.k as u64;
        let method = self.gather_copy.method(rows);
        self.gather_with(layer, batch, out, method, stream)
    }

    /// [`Tier::gather`] with an explicit copy method for the CUDA executor
    /// (the CPU executor has one way; every method gives the same bytes).
    pub fn gather_with(
        &self,
        layer: u32,
        batch: &GatherBatch<'_>,
        out: BufMut<'_, u8>,
        method: CopyMethod,
        stream: Stream,
    ) -> Result<()> {
        let p = gather::plan(&self.tables(), layer, batch, &out, method)?;
        match &self.backend {
            // SAFETY: `plan` checked every host buffer; slot bases come from
            // bind_slot and point at regions of self.pool, which we keep alive.
            Backend::Cpu => unsafe { gather::run_cpu(&p) }.into_result(),
            // SAFETY: `plan` checked every buffer is device memory of the
            // right size (the Buf contract makes them valid); the slot table
            // and error word belong to this tier.
            Backend::Cuda { dev, .. } => unsafe { gather::launch(dev, &p, stream) },
        }
    }

    /// Writes back one layer: item `i` copies row `src_rows[i]` of `src` (the
    /// layer's device KV buffer, rows of `entry_bytes`) to token `tokens[i]`
    /// of `layer` in the region bound to `slots[i]`. One launch, with the
    /// copy method measured best for the entry size and item count on this
    /// GPU ([`CopyMethodTable::measured`]; where nothing was measured,
    /// `WarpVectors`).
    pub fn writeback_layer(
        &self,
        layer: u32,
        items: &WritebackItems<'_>,
        src: Buf<'_, u8>,
        stream: Stream,
    ) -> Result<()> {
        let method = self.writeback_copy.method(items.len() as u64);
        self.writeback_layer_with(layer, items, src, method, stream)
    }

    /// [`Tier::writeback_layer`] with an explicit copy method for the CUDA
    /// executor (the CPU executor has one way; every method writes the same
    /// bytes).
    pub fn writeback_layer_with(
        &self,
        layer: u32,
        items: &WritebackItems<'_>,
        src: Buf<'_, u8>,
        method: CopyMethod,
        stream: Stream,
    ) -> Result<()> {
        let entry = self.layout().entry_bytes() as usize;
        let rows = (src.len() / entry) as u64;
        // With items to copy, at least one whole row, and the alignment checks
        // that come with a non-empty requirement.
        let min_len = if items.is_empty() { 0 } else { entry };
        src.check_aligned("src", self.exec.location(), 8, min_len)?;
        self.writeback(
            layer,
            items,
            WritebackSource::Layer {
                base: src.addr(),
                rows,
            },
            method,
            stream,
        )
    }

    /// Registers the device KV buffers of every layer (in layer order, equal
    /// lengths, rows of `entry_bytes`) for [`Tier::writeback_all_layers`].
    /// Set-up work: uploads a table of their addresses.
    pub fn register_kv_layers<'a>(&self, layers: &[Buf<'a, u8>]) -> Result<KvLayers<'a>> {
        let layout = self.layout();
        if layers.len() != layout.layers() as usize {
            return Err(invalid(
                "layers",
                format!(
                    "{} buffers given; the layout has {} layers",
                    layers.len(),
                    layout.layers()
                ),
            ));
        }
        let len = layers[0].len();
        let rows = (len / layout.entry_bytes() as usize) as u64;
        if rows == 0 {
            return Err(invalid(
                "layers",
                format!(
                    "buffers of {len} bytes hold no {}-byte row",
                    layout.entry_bytes()
                ),
            ));
        }
        for b in layers {
            b.check_aligned("layers", self.exec.location(), 8, len)?;
            if b.len() != len {
                return Err(invalid(
                    "layers",
                    format!("buffers differ in length ({} vs {len} bytes)", b.len()),
                ));
            }
        }
        let addrs: Vec<u64> = layers.iter().map(|b| b.addr()).collect();
        let table = match &self.backend {
            Backend::Cpu => LayerTable::Host(addrs),
            Backend::Cuda { dev, .. } => LayerTable::Device(DeviceBuffer::from_host(dev, &addrs)?),
        };
        Ok(KvLayers {
            tier: self.id,
            table,
            layers: layout.layers(),
            rows,
            _buffers: PhantomData,
        })
    }

    /// Writes back every layer at once (decode: the newest token of each
    /// request): item `i` copies row `src_rows[i]` of every layer's buffer to
    /// token `tokens[i]` of that layer in the region bound to `slots[i]`. One
    /// launch, the copy method chosen as [`Tier::writeback_layer`]'s (the
    /// call moves items × layers rows).
    pub fn writeback_all_layers(
        &self,
        items: &WritebackItems<'_>,
        kv: &KvLayers<'_>,
        stream: Stream,
    ) -> Result<()> {
        let method = self
            .writeback_copy
            .method(items.len() as u64 * kv.layers as u64);
        self.writeback_all_layers_with(items, kv, method, stream)
    }

    /// [`Tier::writeback_all_layers`] with an explicit copy method for the
    /// CUDA executor (same bytes).
    pub fn writeback_all_layers_with(
        &self,
        items: &WritebackItems<'_>,
        kv: &KvLayers<'_>,
        method: CopyMethod,
        stream: Stream,
    ) -> Result<()> {
        if kv.tier != self.id {
            return Err(invalid("kv", "was registered with another tier"));
        }
        let table = match &kv.table {
            LayerTable::Host(v) => v.as_ptr() as u64,
            LayerTable::Device(b) => b.device_ptr(),
        };
        self.writeback(
            0,
            items,
            WritebackSource::AllLayers {
                table,
                layers: kv.layers,
                rows: kv.rows,
            },
            method,
            stream,
        )
    }

    fn writeback(
        &self,
        first_layer: u32,
        items: &WritebackItems<'_>,
        src: WritebackSource,
        method: CopyMethod,
        stream: Stream,
    ) -> Result<()> {
        let p = writeback::plan(&self.tables(), first_layer, items, src, method)?;
        match &self.backend {
            // SAFETY: as in `gather`; the source buffers were checked by the
            // callers (one layer) or at registration (all layers).
            Backend::Cpu => unsafe { writeback::run_cpu(&p) }.into_result(),
            // SAFETY: as in `gather`.
            Backend::Cuda { dev, .. } => unsafe { writeback::launch(dev, &p, stream) },
        }
    }

    /// Prepares [`Tier::swap_in`] for batches of up to `max_batch` rows and a
    /// top-k of up to `max_top_k` (see [`SwapInEngine::reserve`]: for the
    /// CUDA executor, allocates the plan scratch, so that the per-layer call
    /// allocates nothing). Calling it again grows the capacity.
    pub fn enable_swap_in(&mut self, max_batch: u32, max_top_k: u32) -> Result<()> {
        if self.swap_in.is_none() {
            self.swap_in = Some(SwapInEngine::new(self.exec.clone())?);
        }
        let engine = self.swap_in.as_mut().expect("set just above");
        engine.reserve(max_batch, max_top_k)
    }

    /// Counts the swap-ins of every layer of the tier's layout from now on
    /// (see [`SwapInEngine::enable_counters`]); after [`Tier::enable_swap_in`].
    /// Each swap-in adds to the layer its [`SwapInArgs::layer`] names.
    pub fn enable_swap_in_counters(&mut self) -> Result<()> {
        let layers = self.layout().layers();
        self.swap_in
            .as_mut()
            .ok_or_else(|| {
                invalid(
                    "swap_in",
                    "call Tier::enable_swap_in(max_batch, max_top_k) before enabling its counters",
                )
            })?
            .enable_counters(layers)
    }

    /// Each layer's swap-in counters once the swap-ins launched before the
    /// call have finished (the CUDA executor waits for the device); None
    /// while nothing is counted.
    pub fn swap_in_counters(&self) -> Result<Option<Vec<crate::swap_in::SwapInCounters>>> {
        match &self.swap_in {
            Some(engine) => engine.counters(),
            None => Ok(None),
        }
    }

    /// LRU device-buffer swap-in with page-table update for one layer and a
    /// whole batch, SGLang HiSparse semantics (see [`crate::swap_in`]), as
    /// [`crate::SwapInEngine::default_choice`] picks for the call's batch and
    /// this GPU. On the caller's stream, no allocation, no
    /// host synchronisation; bad indices are refused and reported (CPU: now;
    /// CUDA: at the next [`Tier::check`]). The plan scratch belongs to the
    /// tier: swap-ins of one tier must run one after the other (one stream,
    /// or ordered with events), as layers do.
    pub fn swap_in(&self, args: &SwapInArgs<'_>, stream: Stream) -> Result<()> {
        self.swap_in_engine()?.run(args, stream)
    }

    /// The strategy [`Tier::swap_in`] takes for `args`
    /// ([`crate::SwapInEngine::default_strategy`]).
    pub fn default_swap_in_strategy(&self, args: &SwapInArgs<'_>) -> Result<SwapInStrategy> {
        Ok(self.swap_in_engine()?.default_strategy(args))
    }

    /// What [`Tier::swap_in`] launches for `args`: its strategy, planner
    /// build and copy method ([`crate::SwapInEngine::default_choice`]).
    pub fn default_swap_in_choice(&self, args: &SwapInArgs<'_>) -> Result<crate::SwapInChoice> {
        Ok(self.swap_in_engine()?.default_choice(args))
    }

    fn swap_in_engine(&self) -> Result<&crate::SwapInEngine> {
        self.swap_in.as_ref().ok_or_else(|| {
            invalid(
                "swap_in",
                "call Tier::enable_swap_in(max_batch, max_top_k) once before swap_in",
            )
        })
    }

    /// [`Tier::swap_in`] with an explicit strategy for the CUDA executor (the
    /// CPU executor has one); the benchmark uses it to run the
    /// one-block-per-request baseline on identical inputs.
    pub fn swap_in_with(
        &self,
        args: &SwapInArgs<'_>,
        strategy: SwapInStrategy,
        stream: Stream,
    ) -> Result<()> {
        self.swap_in_with_copy(args, strategy, CopyMethod::WarpVectors, stream)
    }

    /// [`Tier::swap_in_with`] with the misses moved by `copy`'s method
    /// ([`crate::SwapInEngine::run_with_copy`]).
    pub fn swap_in_with_copy(
        &self,
        args: &SwapInArgs<'_>,
        strategy: SwapInStrategy,
        copy: CopyMethod,
        stream: Stream,
    ) -> Result<()> {
        self.swap_in_engine()?
            .run_with_copy(args, strategy, copy, stream)
    }

    /// [`Tier::swap_in_with_copy`] with the few-miss planner's fixed-shape
    /// builds ([`crate::SwapInEngine::run_fixed_shape`]), for the benchmark.
    #[doc(hidden)]
    pub fn swap_in_fixed_shape(
        &self,
        args: &SwapInArgs<'_>,
        strategy: SwapInStrategy,
        copy: CopyMethod,
        stream: Stream,
    ) -> Result<()> {
        self.swap_in_engine()?
            .run_fixed_shape(args, strategy, copy, stream)
    }

    /// The few-miss planner's cluster build
    /// ([`crate::SwapInEngine::run_cluster_copy`]), for the benchmark.
    #[doc(hidden)]
    pub fn swap_in_cluster_copy(&self, args: &SwapInArgs<'_>, stream: Stream) -> Result<()> {
        self.swap_in_engine()?.run_cluster_copy(args, stream)
    }

    /// The split planner in clusters
    /// ([`crate::SwapInEngine::run_cluster_plan`]), for the benchmark.
    #[doc(hidden)]
    pub fn swap_in_cluster_plan(&self, args: &SwapInArgs<'_>, stream: Stream) -> Result<()> {
        self.swap_in_engine()?.run_cluster_plan(args, stream)
    }

    /// The sync point: waits for the device, then reports (and clears) the
    /// bad indices that kernels recorded since the last check (gathers,
    /// writebacks and swap-ins together). A no-op for the CPU executor, which
    /// reports them immediately. Call it where the engine synchronises
    /// anyway, not on the per-layer path.
    pub fn check(&self, _stream: Stream) -> Result<()> {
        let mut word = match &self.backend {
            Backend::Cpu => ErrorWord::clear(),
            Backend::Cuda { error, .. } => error.take()?,
        };
        if let Some(engine) = &self.swap_in {
            word.merge(&engine.take_word()?);
        }
        word.into_result()
    }

    /// The slot table and error word as the executor addresses them.
    fn tables(&self) -> TierTables {
        let (slot_bases, error) = match &self.backend {
            Backend::Cpu => (self.slots.as_ptr() as u64, 0),
            Backend::Cuda { slots, error, .. } => (slots.device_ptr(), error.device_ptr()),
        };
        TierTables {
            layout: self.layout(),
            location: self.exec.location(),
            slot_bases,
            num_slots: self.num_slots(),
            error,
        }
    }
}

impl Drop for Tier {
    fn drop(&mut self) {
        // Kernels still running may read the slot table; let them finish
        // before the device buffers are freed.
        if let Backend::Cuda { dev, .. } = &self.backend {
            let _ = dev.synchronize_all();
        }
    }
}

impl std::fmt::Debug for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tier")
            .field("executor", &self.exec)
            .field("pool", &self.pool)
            .field("num_slots", &self.num_slots())
            .finish()
    }
}
