//! kvtier — the KV-cache tier for sparse-attention LLMs.
//!
//! The full KV cache of every request lives in a large host-side pool (CXL
//! memory devices, or host DRAM); per layer the GPU fetches only the top-k
//! entries the sparse-attention indexer selected. This crate holds the pool,
//! the layer-first layout, the per-layer API an attention backend calls
//! ([`Tier`]), and two executors with one semantics: CUDA kernels compiled at
//! build time, and a plain CPU reference.
//!
//! ```no_run
//! use kvtier::{Buf, BufMut, Executor, GatherBatch, LayerFirstLayout, Pool, DeviceSpec, Stream, Tier};
//! # fn main() -> kvtier::Result<()> {
//! let layout = LayerFirstLayout::new(656, 61, 4096)?; // fp8 DSA entries, 61 layers, 4K tokens/request
//! let pool = Pool::create(layout, DeviceSpec::Anon { bytes: 8 << 30 })?;
//! let mut tier = Tier::new(pool.clone(), Executor::cpu(), 256)?;
//! let region = pool.alloc_region()?;
//! tier.bind_slot(0, &region, Stream::null())?;
//! // per decode step and layer: the indexer's top-k for a batch of one request
//! let (slots, seq_lens, topk) = ([0i32], [4096i32], vec![0i32; 2048]);
//! let mut out = vec![0u8; 2048 * 656];
//! let batch = GatherBatch::new(Buf::host(&slots), Buf::host(&seq_lens), Buf::host(&topk), 2048);
//! tier.gather(5, &batch, BufMut::host(&mut out), Stream::null())?;
//! # Ok(()) }
//! ```

/// This build's version (the `kvtier` binary prints it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub mod abi;
pub mod copy_choice;
pub mod copy_method;
pub mod cuda;
pub mod engram;
pub mod error;
pub mod error_word;
pub mod executor;
pub mod ffi;
pub mod gather;
pub mod layout;
pub mod mem;
pub mod plan;
pub mod pool;
pub mod prefix_store;
pub mod shared_fs;
mod slots;
pub mod swap_in;
pub mod table;
pub mod tier;
pub mod trace;
pub mod writeback;

pub use copy_choice::{CopyMethodTable, CopyPath};
pub use copy_method::CopyMethod;
pub use cuda::{CudaDevice, DeviceBuffer, Stream};
pub use error::{Error, Result};
pub use error_word::{BadIndex, BadIndexKind, BadIndexReport, ErrorWord};
pub use executor::Executor;
pub use gather::GatherBatch;
pub use layout::{EntryFormat, ItemLayout, LayerFirstLayout};
pub use mem::{Buf, BufMut, Location};
pub use pool::{DeviceSpec, HostPages, Pool, PoolOptions, Region, RegionTicket};
pub use swap_in::{
    IndexBuf, KvBuffers, KvPlane, MissPlan, PlannedCopyArgs, PlannerBuild, QueryKind, SpecState,
    SpecSwapInArgs, SwapInArgs, SwapInChoice, SwapInCounters, SwapInEngine, SwapInStrategy,
};
pub use tier::{KvLayers, Tier};
pub use writeback::WritebackItems;

/// The README's Rust example, compiled and run as a doctest so that it
/// stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The Rust API page's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/rust-api.md")]
pub struct RustApiDoctests;
