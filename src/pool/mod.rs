//! The pool: layer-first request regions on one or more memory devices (CXL
//! devices in devdax mode or as NUMA nodes, shared files, anonymous memory),
//! with its metadata in the devices themselves so that several processes —
//! and, through a CXL switch, several hosts — attach to one pool
//! ([`Pool::open`]) and allocate and free concurrently without a server.
//!
//! A process attaches as a *client* (pid, start time and boot id, so pid reuse
//! cannot impersonate it). A region is FREE, ALLOCATED (owned, being written)
//! or READY (owned and published after its bytes were written); readers trust
//! READY only. A client that died is reclaimed by the next process that opens
//! the pool (or by `kvtier pool check --repair`), freeing its regions, so a
//! crash leaks nothing for good; a clean exit frees its regions itself. See
//! [`metadata`] for the on-device format and what holds across hosts without
//! hardware coherence.
//!
//! Each rank places its requests on the devices per-rank round-robin
//! ([`RoundRobinPlacement`]), so ranks running at the same time read over
//! different links. Every device is registered with the GPU (portable,
//! device-mapped; flags configurable) when a CUDA tier uses the pool.

mod clients;
pub(crate) mod device;
mod identity;
mod lifecycle;
pub mod metadata;
mod placement;
mod regions;
mod report;
mod stats;

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

pub use device::{
    DeviceCapacity, DeviceSpec, MapMode, device_capacity, format_size, human_size, is_destroyed,
    node_of, numa_nodes, parse_size,
};
pub use identity::{Liveness, ProcessIdentity};
pub use metadata::{Coherence, DEFAULT_CLIENTS, MAX_CLIENTS, MAX_DEVICES, RegionState, VERSION};
pub use placement::RoundRobinPlacement;
pub use stats::{MAX_STATS_BYTES, PublishedStats, run_dir};

pub use device::HostPages;
use device::MappedDevice;
use metadata::{ClientControl, ClientEntry, ClientState, RegionEntry};

use crate::cuda::{CudaDevice, HostRegistration, REGISTER_FLAGS};
use crate::error::{Error, Result, invalid};
use crate::layout::LayerFirstLayout;

/// Regions start on this boundary (a page), so region bases are 16-byte
/// aligned and the per-entry alignment depends on the entry size alone.
pub const REGION_ALIGN: u64 = 4096;

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// How a process creates or attaches to a pool.
#[derive(Clone, Debug)]
pub struct PoolOptions {
    /// This process's GPU rank, and the number of ranks (for placement).
    pub rank: u32,
    pub ranks: u32,
    /// Client slots a new pool gets (processes attached at once).
    pub clients: u32,
    /// One host (or coherent memory), or this host's place among several.
    pub coherence: Coherence,
    /// `cuMemHostRegister` flags for every device (default: portable and
    /// device-mapped). devdax memory has struct pages and is pinned as DRAM
    /// is; `CU_MEMHOSTREGISTER_IOMEMORY` is for a PCIe device's MMIO, not
    /// for CXL memory.
    pub register_flags: u32,
    /// Attach as a client (needed to allocate); false inspects only.
    pub attach: bool,
    /// On open, reclaim the regions of clients whose process died.
    pub reclaim_dead: bool,
    /// Permissions of the pool files a create makes (default 0600: the
    /// creating user alone; 0660 for a group of users sharing the pool).
    pub file_mode: u32,
    /// Pages for anonymous and NUMA devices (default: the kernel's choice).
    pub host_pages: HostPages,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            rank: 0,
            ranks: 1,
            clients: DEFAULT_CLIENTS,
            coherence: Coherence::Coherent,
            register_flags: REGISTER_FLAGS,
            attach: true,
            reclaim_dead: true,
            file_mode: device::DEFAULT_FILE_MODE,
            host_pages: HostPages::Base,
        }
    }
}

/// A pool of request regions.
pub struct Pool {
    id: u64,
    layout: LayerFirstLayout,
    region_stride: u64,
    num_regions: u32,
    num_clients: u32,
    uuid: [u8; 16],
    coherence: Coherence,
    regions: *const RegionEntry,
    clients: *const ClientEntry,
    /// This process's client slot and its generation, when attached.
    me: Option<(u16, u32)>,
    /// The run dir this handle published its stats in (the file is
    /// removed when it closes).
    published_stats: Mutex<Option<std::path::PathBuf>>,
    /// The process that opened the pool. A forked child inherits the handle
    /// but not the identity: it frees, locks and allocates nothing through
    /// it (see [`Pool::owner`]), and its drop leaves the parent's regions,
    /// client slot and locks as they are.
    opened_by: u32,
    /// This process's liveness locks on the first device (shared pools).
    lock: Option<identity::ClientLock>,
    /// Regions of other processes this process has joined, with how many
    /// handles of each it holds (its hold lock goes with the last).
    joined: Mutex<std::collections::HashMap<u32, u32>>,
    placement: Mutex<RoundRobinPlacement>,
    register_flags: u32,
    // Last: unmapped after everything above (Drop frees this client's
    // regions through the tables first).
    devices: Vec<PoolDevice>,
}

// SAFETY: the raw pointers address the metadata tables inside `devices`'
// mappings, which live as long as the pool; every shared field is an atomic.
unsafe impl Send for Pool {}
unsafe impl Sync for Pool {}

struct PoolDevice {
    data_offset: u64,
    first_region: u32,
    num_regions: u32,
    bytes: u64,
    // Dropped before `map`: unregister, then unmap.
    registration: Mutex<Option<HostRegistration>>,
    map: MappedDevice,
}

/// One request's region: `layers × tokens_per_region × entry_bytes`, laid out
/// layer-first, owned by the process that allocated it. Give it back with
/// [`Pool::free_region`]. A handle from [`Pool::join_region`] maps a region
/// another process owns; giving it back leaves the region to its owner.
#[derive(Debug, PartialEq, Eq)]
pub struct Region {
    pool: u64,
    index: u32,
    device: u32,
    joined: bool,
}

impl Region {
    /// The region's index in its pool.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The device the region lives on.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// Whether this handle joined a region another process owns.
    pub fn is_joined(&self) -> bool {
        self.joined
    }
}

/// A region as `Pool::regions` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionInfo {
    pub index: u32,
    pub device: u32,
    pub state: RegionState,
    /// The owning client slot and its process, None when free.
    pub owner: Option<OwnerInfo>,
    pub request: u64,
    /// Whether another process has joined it and holds it now (a shared
    /// region: not freed, nor reclaimed, while it is held).
    pub joined: bool,
}

/// The owner of a region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnerInfo {
    pub client: u16,
    pub pid: u32,
    /// Alive, Dead, or Unknown (another host's); Dead also for a client slot
    /// that was freed or reused since (the region is an orphan).
    pub liveness: Liveness,
}

/// A client attached to the pool, as `Pool::clients_info` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientInfo {
    /// Its client slot, and which claim of that slot it is: the two name a
    /// live client uniquely (pids do not: processes in two PID namespaces
    /// may share one).
    pub slot: u16,
    pub generation: u32,
    /// Its pid, as its own PID namespace numbers it.
    pub pid: u32,
    /// The user it runs as (None: a client of an older kvtier, which does
    /// not record it).
    pub uid: Option<u32>,
    pub liveness: Liveness,
}

/// What a region's owner tells the processes that will join it
/// ([`Pool::region_ticket`], [`Pool::join_region`]): the pool (its uuid,
/// which no other pool and no later pool made on the same devices has), the
/// region, and this allocation of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionTicket {
    pub pool_uuid: [u8; 16],
    pub index: u32,
    pub epoch: u64,
}

/// A device as `Pool::devices` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub spec: String,
    pub bytes: u64,
    pub regions: u32,
    pub free: u32,
}

/// What `Pool::check` found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckReport {
    /// Inconsistencies that no repair fixes (a corrupt table entry).
    pub problems: Vec<String>,
    /// Client slots whose process died.
    pub dead_clients: Vec<(u16, u32)>,
    /// Regions owned by dead clients or orphaned (reclaimable).
    pub reclaimable_regions: u32,
}

/// Where a device's sampled pages are ([`Pool::residency`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Residency {
    /// Pages asked about.
    pub sampled: u32,
    /// (NUMA node, pages on it), by node.
    pub by_node: Vec<(u32, u32)>,
    /// Pages not in memory (never touched).
    pub not_present: u32,
}

impl Residency {
    /// "node 0: 60, node 2: 4, 192 not touched by this process yet (...)".
    pub fn describe(&self) -> String {
        let mut parts: Vec<String> = self
            .by_node
            .iter()
            .map(|(n, c)| format!("node {n}: {c}"))
            .collect();
        if self.not_present > 0 {
            // reserved (a file's pages are allocated at create) but not in
            // this process's page tables: the kernel names no node for them
            parts.push(format!(
                "{} not touched by this process yet (reserved; their node shows once touched)",
                self.not_present
            ));
        }
        parts.join(", ")
    }
}

/// What a reclaim freed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reclaimed {
    pub clients: u32,
    pub regions: u32,
}

impl Drop for Pool {
    fn drop(&mut self) {
        if self.forked() {
            // A forked child's copy of the parent's handle: the regions, the
            // client slot and the liveness lock (an OFD lock the child shares
            // with the parent: unlocking it here would unlock the parent's)
            // are the parent's. Only the child's mappings go, and its copy of
            // the GPU registration is not unregistered (CUDA does not carry
            // across fork).
            for d in &self.devices {
                if let Some(r) = d
                    .registration
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                {
                    std::mem::forget(r);
                }
            }
            return;
        }
        // A clean exit: what it published goes, then its regions and its slot.
        self.unpublish_stats();
        if let Some((client, generation)) = self.me {
            self.free_regions_of(client, generation, true);
            let e = self.client_entry(client as u32);
            let live = ClientControl {
                state: ClientState::Live,
                generation,
            }
            .encode();
            self.cas(
                &e.control,
                live,
                ClientControl {
                    state: ClientState::Free,
                    generation,
                }
                .encode(),
                Ordering::AcqRel,
            );
            // a joiner that left while the slot was still Live judged the
            // owner alive: free what it left, now that it would judge Dead
            self.free_regions_of(client, generation, false);
            if let Some(l) = &self.lock {
                l.release(client as u32);
            }
        }
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field(
                "devices",
                &self
                    .devices
                    .iter()
                    .map(|d| d.map.spec().to_string())
                    .collect::<Vec<_>>(),
            )
            .field("layout", &self.layout)
            .field("num_regions", &self.num_regions)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn device_bytes_for_is_the_least_that_holds_the_regions_and_never_hangs() {
        for (layout, regions) in [
            (LayerFirstLayout::new(656, 61, 4096).unwrap(), 1),
            (LayerFirstLayout::new(656, 61, 4096).unwrap(), 300),
            (LayerFirstLayout::new(64, 1, 1).unwrap(), 100_000),
            (LayerFirstLayout::new(1152, 2, 131072).unwrap(), 7),
        ] {
            let bytes = Pool::device_bytes_for(&layout, regions).unwrap();
            let stride = layout.region_bytes().next_multiple_of(REGION_ALIGN);
            let fits = |b| {
                metadata::plan_geometry(&layout, &[b], DEFAULT_CLIENTS)
                    .is_ok_and(|g| g.num_regions >= regions)
            };
            assert!(
                fits(bytes) && !fits(bytes - stride),
                "{layout:?} × {regions}"
            );
        }
        let small = LayerFirstLayout::new(64, 1, 1).unwrap();
        assert!(Pool::device_bytes_for(&small, 0).is_err(), "no regions");
        let huge = LayerFirstLayout::new(u32::MAX - 7, 4096, 16).unwrap();
        let t0 = std::time::Instant::now();
        assert!(
            Pool::device_bytes_for(&huge, u32::MAX).is_err(),
            "overflows 64 bits"
        );
        assert!(t0.elapsed() < std::time::Duration::from_secs(1));
        // a region beyond 256 TiB is no layout at all
        assert!(LayerFirstLayout::new(u32::MAX - 7, 4096, i32::MAX as u32).is_err());
    }

    fn small_pool(regions: u32) -> Arc<Pool> {
        let layout = LayerFirstLayout::new(584, 2, 10).unwrap();
        Pool::create(
            layout,
            DeviceSpec::Anon {
                bytes: Pool::device_bytes_for(&layout, regions).unwrap(),
            },
        )
        .unwrap()
    }

    #[test]
    fn allocates_until_full_then_says_so() {
        let pool = small_pool(3);
        assert_eq!(pool.num_regions(), 3);
        let regions: Vec<_> = (0..3).map(|_| pool.alloc_region().unwrap()).collect();
        assert_eq!(
            regions.iter().map(Region::index).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        let err = pool.alloc_region().unwrap_err().to_string();
        assert!(err.contains("pool is full"), "{err}");
        pool.free_region(regions.into_iter().nth(1).unwrap())
            .unwrap();
        assert_eq!(pool.alloc_region().unwrap().index(), 1);
    }

    #[test]
    fn too_small_device_is_refused() {
        let layout = LayerFirstLayout::new(656, 61, 131072).unwrap();
        let err = Pool::create(layout, DeviceSpec::Anon { bytes: 1 << 30 })
            .unwrap_err()
            .to_string();
        assert!(err.contains("hold no region"), "{err}");
    }

    #[test]
    fn foreign_regions_are_refused() {
        let (a, b) = (small_pool(1), small_pool(1));
        let r = a.alloc_region().unwrap();
        assert!(b.write_tokens(&r, 0, 0, &[0; 584]).is_err());
        assert!(b.free_region(r).is_err());
    }

    #[test]
    fn token_io_is_layer_first_and_checked() {
        let pool = small_pool(2);
        let _r0 = pool.alloc_region().unwrap();
        let r1 = pool.alloc_region().unwrap();
        let data: Vec<u8> = (0..3 * 584).map(|i| i as u8).collect();
        pool.write_tokens(&r1, 1, 7, &data).unwrap();
        let mut back = vec![0u8; 3 * 584];
        pool.read_tokens(&r1, 1, 7, &mut back).unwrap();
        assert_eq!(back, data);
        let addr = pool.region_host_addr(&r1).unwrap() + pool.layout().entry_offset(1, 7).unwrap();
        assert_eq!(unsafe { *(addr as *const u8) }, 0);
        assert_eq!(unsafe { *((addr + 1) as *const u8) }, 1);
        assert!(
            pool.write_tokens(&r1, 1, 8, &data).is_err(),
            "runs past capacity"
        );
        assert!(
            pool.write_tokens(&r1, 2, 0, &data[..584]).is_err(),
            "no layer 2"
        );
        assert!(
            pool.write_tokens(&r1, 0, 0, &data[..100]).is_err(),
            "partial entry"
        );
    }

    #[test]
    fn publish_and_free_need_ownership() {
        let pool = small_pool(2);
        let r = pool.alloc_region_for(77).unwrap();
        assert_eq!(
            pool.region_state(r.index()).unwrap(),
            RegionState::Allocated
        );
        let mut out = [0u8; 584];
        assert!(
            pool.read_ready(r.index(), 0, 0, &mut out).is_err(),
            "not READY yet"
        );
        pool.publish(&r).unwrap();
        assert_eq!(pool.region_state(r.index()).unwrap(), RegionState::Ready);
        pool.read_ready(r.index(), 0, 0, &mut out).unwrap();
        assert!(pool.publish(&r).is_err(), "published twice");
        let info = &pool.regions()[r.index() as usize];
        assert_eq!((info.state, info.request), (RegionState::Ready, 77));
        assert_eq!(info.owner.as_ref().unwrap().liveness, Liveness::Alive);
        let i = r.index();
        pool.free_region(r).unwrap();
        assert_eq!(pool.region_state(i).unwrap(), RegionState::Free);
    }
}
