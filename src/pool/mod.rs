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

mod device;
mod identity;
pub mod metadata;
mod placement;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub use device::{
    DeviceCapacity, DeviceSpec, MapMode, device_capacity, format_size, human_size, node_of,
    numa_nodes, parse_size,
};
pub use identity::{Liveness, ProcessIdentity};
pub use metadata::{Coherence, DEFAULT_CLIENTS, MAX_CLIENTS, MAX_DEVICES, RegionState, VERSION};
pub use placement::RoundRobinPlacement;

use device::MappedDevice;
use metadata::{
    ClientControl, ClientEntry, ClientState, DEVICE_MAGIC, DeviceHeader, DeviceRecord, OBSERVE,
    POOL_MAGIC, PUBLISH, PoolHeader, RegionControl, RegionEntry, SPEC_BYTES,
};

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
    /// This process's liveness locks on the first device (shared pools).
    lock: Option<identity::ClientLock>,
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
/// [`Pool::free_region`].
#[derive(Debug, PartialEq, Eq)]
pub struct Region {
    pool: u64,
    index: u32,
    device: u32,
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

/// What a reclaim freed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reclaimed {
    pub clients: u32,
    pub regions: u32,
}

impl Pool {
    /// A new pool of `layout` regions on one device, with default options.
    pub fn create(layout: LayerFirstLayout, device: DeviceSpec) -> Result<Arc<Pool>> {
        Pool::create_on(layout, vec![device], PoolOptions::default())
    }

    /// Bytes a single-device pool needs to hold `regions` regions of
    /// `layout` (metadata included): its tables, rounded to 2 MiB, and the
    /// regions.
    pub fn device_bytes_for(layout: &LayerFirstLayout, regions: u32) -> Result<u64> {
        if regions == 0 {
            return Err(invalid("regions", "a pool holds at least one region"));
        }
        let too_big = || {
            invalid(
                "regions",
                format!(
                    "{regions} regions of {} B do not fit 64-bit sizes",
                    layout.region_bytes()
                ),
            )
        };
        let stride = layout.region_bytes().next_multiple_of(REGION_ALIGN);
        let data = (regions as u64).checked_mul(stride).ok_or_else(too_big)?;
        // The tables grow with the device (a region table entry per region
        // the device could hold): start from the data plus tables for it,
        // then step up to the first size the plan accepts (a few steps: the
        // tables take 64 B per region of at least 4 KiB).
        let mut bytes = data.checked_add(metadata::DATA_ALIGN).ok_or_else(too_big)?;
        for _ in 0..1 << 20 {
            match metadata::plan_geometry(layout, &[bytes], DEFAULT_CLIENTS) {
                Ok(g) if g.num_regions >= regions => return Ok(bytes),
                Ok(g) => {
                    let short = (regions - g.num_regions) as u64 * stride;
                    bytes = bytes.checked_add(short).ok_or_else(too_big)?;
                }
                Err(_) => {
                    bytes = bytes
                        .checked_add(metadata::DATA_ALIGN)
                        .ok_or_else(too_big)?
                }
            }
        }
        Err(too_big())
    }

    /// A new pool of `layout` regions across `devices`: maps them (creating
    /// or growing files), writes the header, the device table and empty
    /// region and client tables, and attaches this process. Refuses devices
    /// that already hold a pool.
    pub fn create_on(
        layout: LayerFirstLayout,
        devices: Vec<DeviceSpec>,
        options: PoolOptions,
    ) -> Result<Arc<Pool>> {
        check_options(&devices, &options)?;
        // Files this create makes are removed again if it fails.
        let new_files: Vec<std::path::PathBuf> = devices
            .iter()
            .filter_map(|d| match d {
                DeviceSpec::File { path, .. } if std::fs::symlink_metadata(path).is_err() => {
                    Some(path.clone())
                }
                _ => None,
            })
            .collect();
        let created = (|| {
            // Two processes creating on the same shared devices at once: one
            // wins, the other finds the pool and is refused.
            let _lock = match devices[0].is_shared() {
                true => Some(device::CreateLock::acquire(&devices[0], options.file_mode)?),
                false => None,
            };
            Pool::create_locked(layout, devices, options)
        })();
        if created.is_err() {
            for path in &new_files {
                let _ = std::fs::remove_file(path);
            }
        }
        created
    }

    /// [`Pool::create_on`], the caller holding the create lock (or the
    /// devices being private).
    fn create_locked(
        layout: LayerFirstLayout,
        devices: Vec<DeviceSpec>,
        options: PoolOptions,
    ) -> Result<Arc<Pool>> {
        if options.clients == 0 || options.clients > MAX_CLIENTS {
            return Err(invalid(
                "clients",
                format!("{} is outside 1..={MAX_CLIENTS}", options.clients),
            ));
        }
        let maps: Vec<MappedDevice> = devices
            .iter()
            .map(|d| MappedDevice::map_with(d, MapMode::Create, options.file_mode))
            .collect::<Result<_>>()?;
        for m in &maps {
            if (m.len() as u64) < metadata::DATA_ALIGN {
                return Err(Error::Pool(format!(
                    "{} is {} B; a pool device holds at least {} (its header, then regions)",
                    m.spec(),
                    m.len(),
                    format_size(metadata::DATA_ALIGN)
                )));
            }
            // SAFETY: the mapping holds at least DATA_ALIGN bytes.
            let magic = unsafe { std::ptr::read_volatile(m.ptr() as *const [u8; 8]) };
            if m.spec().is_shared() && (magic == POOL_MAGIC || magic == DEVICE_MAGIC) {
                return Err(Error::Pool(format!(
                    "{} already holds a kvtier pool; destroy it first (kvtier pool destroy)",
                    m.spec()
                )));
            }
        }
        if let Some(f) = maps[0].file()
            && identity::ClientLock::any_held(f, MAX_CLIENTS)
        {
            return Err(Error::Pool(format!(
                "{} is still mapped by processes attached to the pool that was there; stop them before \
                 creating a new pool on it",
                maps[0].spec()
            )));
        }
        let sizes: Vec<u64> = maps.iter().map(|m| m.len() as u64).collect();
        let g = metadata::plan_geometry(&layout, &sizes, options.clients)?;
        let hosts = match options.coherence {
            Coherence::Coherent => 0,
            Coherence::NonCoherent { hosts, .. } => hosts,
        };
        let mut header = PoolHeader {
            magic: [0; 8],
            version: VERSION,
            header_bytes: size_of::<PoolHeader>() as u32,
            uuid: rand::random(),
            entry_bytes: layout.entry_bytes(),
            layers: layout.layers(),
            tokens_per_region: layout.tokens_per_region(),
            num_devices: devices.len() as u32,
            region_stride: g.region_stride,
            num_regions: g.num_regions,
            num_clients: options.clients,
            hosts,
            checksum: 0,
            region_table_offset: g.region_table_offset,
            client_table_offset: g.client_table_offset,
            created_unix_ns: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0),
            devices: [DeviceRecord {
                bytes: 0,
                data_offset: 0,
                first_region: 0,
                num_regions: 0,
                spec_len: 0,
                _pad: 0,
                spec: [0; SPEC_BYTES],
            }; MAX_DEVICES],
        };
        for (i, (spec, &(data_offset, first_region, num_regions))) in
            devices.iter().zip(&g.devices).enumerate()
        {
            let text = spec.identity();
            if text.len() > SPEC_BYTES {
                return Err(invalid(
                    "device",
                    format!("{text:?} is longer than {SPEC_BYTES} bytes"),
                ));
            }
            let rec = &mut header.devices[i];
            rec.bytes = sizes[i];
            rec.data_offset = data_offset;
            rec.first_region = first_region;
            rec.num_regions = num_regions;
            rec.spec_len = text.len() as u32;
            rec.spec[..text.len()].copy_from_slice(text.as_bytes());
        }
        header.checksum = metadata::header_checksum(&header);
        let coherence = options.coherence;
        // Zero the tables, write the device headers, then the pool header,
        // each magic last, so that no opener sees a half-written pool.
        let base = maps[0].ptr();
        let meta_len = (g.client_table_offset + 64 * options.clients as u64) as usize;
        // SAFETY: the geometry puts header and tables inside device 0's metadata area.
        unsafe { base.write_bytes(0, meta_len) };
        coherence.after_write(base, meta_len);
        for (i, m) in maps.iter().enumerate().skip(1) {
            let dh = DeviceHeader {
                magic: [0; 8],
                version: VERSION,
                index: i as u32,
                uuid: header.uuid,
            };
            // SAFETY: device i is at least DATA_ALIGN bytes (it holds a region past it, or none at all).
            unsafe { std::ptr::write_volatile(m.ptr() as *mut DeviceHeader, dh) };
            std::sync::atomic::fence(Ordering::SeqCst);
            unsafe { std::ptr::write_volatile(m.ptr() as *mut [u8; 8], DEVICE_MAGIC) };
            coherence.after_write(m.ptr(), size_of::<DeviceHeader>());
        }
        // SAFETY: device 0 holds the header (the geometry put the tables after it).
        unsafe { std::ptr::write_volatile(base as *mut PoolHeader, header) };
        std::sync::atomic::fence(Ordering::SeqCst);
        unsafe { std::ptr::write_volatile(base as *mut [u8; 8], POOL_MAGIC) };
        coherence.after_write(base, size_of::<PoolHeader>());
        Pool::attach(maps, &options)
    }

    /// Attaches to an existing pool on `devices` (in the order it was created
    /// with; sizes may be left out): checks the header, the device table and
    /// every device header, registers this process as a client, and reclaims
    /// the regions of clients whose process died.
    pub fn open(devices: Vec<DeviceSpec>, options: PoolOptions) -> Result<Arc<Pool>> {
        check_options(&devices, &options)?;
        let maps: Vec<MappedDevice> = devices
            .iter()
            .map(|d| MappedDevice::map(d, MapMode::Open))
            .collect::<Result<_>>()?;
        Pool::attach(maps, &options)
    }

    /// Opens the pool on `devices`, or creates it with `layout` when the
    /// first device holds none: how processes that start together (the ranks
    /// of one server) share a pool, the first to arrive creating it. The
    /// decision is serialised with an exclusive `flock` on the first device,
    /// which holds among the processes of one host; hosts that share memory
    /// through a CXL switch create the pool beforehand (`kvtier pool create`).
    /// An existing pool serves `layout` when its regions have room for it
    /// (see [`Pool::open_expecting`]). Private devices (`anon:`, `numa:`)
    /// cannot be shared, so for them this creates a new pool.
    pub fn open_or_create(
        layout: LayerFirstLayout,
        devices: Vec<DeviceSpec>,
        options: PoolOptions,
    ) -> Result<Arc<Pool>> {
        check_options(&devices, &options)?;
        if !devices[0].is_shared() {
            return Pool::create_locked(layout, devices, options);
        }
        let _lock = device::CreateLock::acquire(&devices[0], options.file_mode)?;
        if device::peek_magic(&devices[0])? == Some(POOL_MAGIC) {
            Pool::open_expecting(devices, layout, options)
        } else {
            Pool::create_locked(layout, devices, options)
        }
    }

    /// [`Pool::open`] for regions of `layout`: the pool's own, or any whose
    /// bytes fit its regions. A region is `region_stride` bytes, and a process
    /// may lay them out with a smaller layout of its own: the stages of a
    /// pipeline-parallel server hold different layer ranges, and share one
    /// pool whose regions were sized for the largest stage. The handle then
    /// addresses regions (and reports their size) with `layout`; processes
    /// that share a region's bytes must use the same layout.
    pub fn open_expecting(
        devices: Vec<DeviceSpec>,
        layout: LayerFirstLayout,
        options: PoolOptions,
    ) -> Result<Arc<Pool>> {
        let mut pool = Pool::open(devices, options)?;
        if pool.layout == layout {
            return Ok(pool);
        }
        if layout.region_bytes() > pool.region_stride {
            return Err(Error::Pool(format!(
                "the pool's regions hold {} B (made for {} B × {} layers × {} tokens); this process needs {} B \
                 for {} B × {} × {}: create the pool for the largest layout that will use it (under pipeline \
                 parallelism, the stage with the most layers)",
                pool.region_stride,
                pool.layout.entry_bytes(),
                pool.layout.layers(),
                pool.layout.tokens_per_region(),
                layout.region_bytes(),
                layout.entry_bytes(),
                layout.layers(),
                layout.tokens_per_region()
            )));
        }
        Arc::get_mut(&mut pool)
            .expect("a pool just opened has one handle")
            .layout = layout;
        Ok(pool)
    }

    /// Invalidates the pool on `devices`: marks every device header destroyed
    /// so that it no longer opens and a new pool may reuse the files (the
    /// bytes stay). Refuses while
    /// other live processes are attached, unless `force`.
    pub fn destroy(devices: Vec<DeviceSpec>, force: bool) -> Result<()> {
        let options = PoolOptions {
            attach: false,
            reclaim_dead: false,
            ..PoolOptions::default()
        };
        let pool = Pool::open(devices, options)?;
        let live: Vec<u32> = pool
            .clients_info()
            .into_iter()
            .filter(|c| c.2 == Liveness::Alive)
            .map(|c| c.1)
            .collect();
        if !live.is_empty() && !force {
            return Err(Error::Pool(format!(
                "processes {live:?} are attached to the pool; stop them, or destroy with force"
            )));
        }
        for d in pool.devices.iter().rev() {
            // SAFETY: every device starts with an 8-byte magic.
            unsafe {
                std::ptr::write_volatile(d.map.ptr() as *mut [u8; 8], device::DESTROYED_MAGIC)
            };
            pool.coherence.after_write(d.map.ptr(), 8);
        }
        Ok(())
    }

    fn attach(maps: Vec<MappedDevice>, options: &PoolOptions) -> Result<Arc<Pool>> {
        let spec0 = maps[0].spec().clone();
        if maps[0].len() < size_of::<PoolHeader>() {
            return Err(Error::Pool(format!(
                "{spec0} is too small to hold a pool header"
            )));
        }
        let base = maps[0].ptr();
        options.coherence.before_read(base, size_of::<PoolHeader>());
        // SAFETY: the mapping holds a header-sized prefix (checked above).
        let h = unsafe { std::ptr::read_volatile(base as *const PoolHeader) };
        if h.magic == DEVICE_MAGIC {
            // SAFETY: as above; a device header is a prefix of the header's size.
            let dh = unsafe { std::ptr::read_volatile(base as *const DeviceHeader) };
            return Err(Error::Pool(format!(
                "{spec0} is device {} of a pool, not its first; give all of the pool's devices, in order",
                dh.index
            )));
        }
        if h.magic == device::DESTROYED_MAGIC {
            return Err(Error::Pool(format!(
                "no kvtier pool on {spec0}: the pool there was destroyed (create one with kvtier pool create)"
            )));
        }
        if h.magic != POOL_MAGIC {
            return Err(Error::Pool(format!(
                "no kvtier pool on {spec0} (create one with kvtier pool create)"
            )));
        }
        if h.version != VERSION {
            return Err(Error::Pool(format!(
                "the pool on {spec0} has format version {}; this kvtier reads version {VERSION}",
                h.version
            )));
        }
        let corrupt = |what: String| Error::Pool(format!("corrupt pool header on {spec0}: {what}"));
        if metadata::header_checksum(&h) != h.checksum {
            return Err(corrupt(
                "its checksum does not match (the header was overwritten); the pool cannot be trusted".into(),
            ));
        }
        let layout = LayerFirstLayout::new(h.entry_bytes, h.layers, h.tokens_per_region)
            .map_err(|e| corrupt(e.to_string()))?;
        check_header_geometry(&h, maps[0].len() as u64).map_err(corrupt)?;
        if h.region_stride < layout.region_bytes() || !h.region_stride.is_multiple_of(REGION_ALIGN)
        {
            return Err(Error::Pool(format!(
                "corrupt pool header on {spec0}: regions {} B apart cannot hold {} B each",
                h.region_stride,
                layout.region_bytes()
            )));
        }
        if h.num_devices as usize != maps.len() || h.num_devices as usize > MAX_DEVICES {
            return Err(Error::Pool(format!(
                "the pool spans {} devices; {} were given",
                h.num_devices,
                maps.len()
            )));
        }
        match (h.hosts, options.coherence) {
            (0, Coherence::Coherent) => {}
            (0, _) => {
                return Err(invalid(
                    "coherence",
                    "this pool was created for one host (coherent memory)",
                ));
            }
            (n, Coherence::NonCoherent { hosts, .. }) if hosts == n => {}
            (n, _) => {
                return Err(invalid(
                    "coherence",
                    format!(
                        "this pool is shared by {n} hosts without hardware coherence; give this host's index"
                    ),
                ));
            }
        }
        let mut devices = Vec::new();
        for (i, map) in maps.into_iter().enumerate() {
            let rec = h.devices[i];
            let recorded = metadata::record_spec(&rec);
            if recorded != map.spec().identity() {
                return Err(Error::Pool(format!(
                    "device {i} of the pool is {recorded}, not {}",
                    map.spec()
                )));
            }
            if i > 0 {
                options
                    .coherence
                    .before_read(map.ptr(), size_of::<DeviceHeader>());
                // SAFETY: devices hold at least their data offset (checked below) >= the header.
                let dh = unsafe { std::ptr::read_volatile(map.ptr() as *const DeviceHeader) };
                if dh.magic != DEVICE_MAGIC || dh.uuid != h.uuid || dh.index != i as u32 {
                    return Err(Error::Pool(format!(
                        "{} is not device {i} of this pool",
                        map.spec()
                    )));
                }
            }
            // checked by check_header_geometry: no overflow
            let end = rec.data_offset + rec.num_regions as u64 * h.region_stride;
            if (map.len() as u64) < end {
                return Err(Error::Pool(format!(
                    "{} is {} B; the pool's regions on it need {end} B",
                    map.spec(),
                    map.len()
                )));
            }
            devices.push(PoolDevice {
                data_offset: rec.data_offset,
                first_region: rec.first_region,
                num_regions: rec.num_regions,
                bytes: rec.bytes,
                registration: Mutex::new(None),
                map,
            });
        }
        let placement = RoundRobinPlacement::new(options.rank, options.ranks, devices.len() as u32)
            .ok_or_else(|| {
                invalid(
                    "rank",
                    format!("rank {} of {} ranks", options.rank, options.ranks),
                )
            })?;
        let mut pool = Pool {
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            layout,
            region_stride: h.region_stride,
            num_regions: h.num_regions,
            num_clients: h.num_clients,
            uuid: h.uuid,
            coherence: options.coherence,
            // SAFETY: the header's offsets lie inside device 0's metadata area.
            regions: unsafe { base.add(h.region_table_offset as usize) } as *const RegionEntry,
            clients: unsafe { base.add(h.client_table_offset as usize) } as *const ClientEntry,
            me: None,
            lock: match devices.first().and_then(|d| d.map.file()) {
                Some(f) => Some(identity::ClientLock::new(f)?),
                None => None,
            },
            placement: Mutex::new(placement),
            register_flags: options.register_flags,
            devices,
        };
        if options.reclaim_dead {
            pool.reclaim_dead()?;
        }
        if options.attach {
            pool.me = Some(pool.claim_client()?);
        }
        Ok(Arc::new(pool))
    }

    // ---- tables ------------------------------------------------------------

    fn region_entry(&self, i: u32) -> &RegionEntry {
        debug_assert!(i < self.num_regions);
        // SAFETY: the table holds num_regions entries for the pool's lifetime.
        unsafe { &*self.regions.add(i as usize) }
    }

    fn client_entry(&self, i: u32) -> &ClientEntry {
        debug_assert!(i < self.num_clients);
        // SAFETY: the table holds num_clients entries for the pool's lifetime.
        unsafe { &*self.clients.add(i as usize) }
    }

    fn load(&self, w: &AtomicU64) -> u64 {
        self.coherence
            .before_read(w as *const AtomicU64 as *const u8, 64);
        w.load(OBSERVE)
    }

    fn cas(&self, w: &AtomicU64, current: u64, new: u64, order: Ordering) -> bool {
        let ok = w
            .compare_exchange(current, new, order, Ordering::Acquire)
            .is_ok();
        self.coherence
            .after_write(w as *const AtomicU64 as *const u8, 64);
        ok
    }

    fn store(&self, w: &AtomicU64, v: u64) {
        w.store(v, Ordering::Release);
        self.coherence
            .after_write(w as *const AtomicU64 as *const u8, 64);
    }

    fn region_control(&self, i: u32) -> Option<RegionControl> {
        RegionControl::decode(self.load(&self.region_entry(i).control))
    }

    fn client_identity(&self, i: u32) -> (ProcessIdentity, u32) {
        let c = self.client_entry(i);
        let pid = self.load(&c.pid) as u32;
        let id = ProcessIdentity {
            pid,
            start_ticks: self.load(&c.start_ticks),
            boot_id: (self.load(&c.boot_hi) as u128) << 64 | self.load(&c.boot_lo) as u128,
        };
        (id, self.load(&c.host) as u32)
    }

    /// Whether client `i`'s process lives, judged without trusting pid
    /// numbers across PID namespaces: its liveness lock held means alive; a
    /// free lock on the very file it locked means dead; otherwise its pid
    /// decides only when it was recorded in this PID namespace, and a holder
    /// that cannot be judged is Unknown (never reclaimed).
    fn client_liveness(&self, i: u32) -> Result<Liveness> {
        if self.me.map(|(c, _)| c as u32) == Some(i) {
            return Ok(Liveness::Alive); // this process (its own lock does not show to itself)
        }
        let single_host = self.coherence == Coherence::Coherent;
        let lock = self.lock.as_ref();
        if lock.and_then(|l| l.held_by_another(i)) == Some(true) {
            return Ok(Liveness::Alive);
        }
        let (id, _) = self.client_identity(i);
        if id.pid == 0 {
            return Ok(Liveness::Dead); // claimed, identity never written, no lock held
        }
        if id.boot_id != identity::boot_id()? {
            return id.liveness(single_host); // another boot (or host)
        }
        let e = self.client_entry(i);
        if let Some(l) = lock
            && self.load(&e.lock_id) == l.id()
            && l.held_by_another(i) == Some(false)
        {
            return Ok(Liveness::Dead);
        }
        if self.load(&e.pid_ns) != identity::pid_namespace() {
            return Ok(Liveness::Unknown);
        }
        id.liveness(single_host)
    }

    /// Takes a free client slot of this host and records this process in it.
    fn claim_client(&self) -> Result<(u16, u32)> {
        let me = ProcessIdentity::current()?;
        for attempt in 0..2 {
            for i in (0..self.num_clients).filter(|&i| self.coherence.owns(i)) {
                let e = self.client_entry(i);
                let w = self.load(&e.control);
                let Some(c) = ClientControl::decode(w) else {
                    continue;
                };
                if c.state != ClientState::Free {
                    continue;
                }
                let generation = c.generation.wrapping_add(1);
                let claiming = ClientControl {
                    state: ClientState::Claiming,
                    generation,
                }
                .encode();
                if !self.cas(&e.control, w, claiming, Ordering::AcqRel) {
                    continue;
                }
                if let Some(l) = &self.lock
                    && !l.take(i)?
                {
                    // a live process still holds the slot's lock: leave it
                    self.cas(&e.control, claiming, w, Ordering::AcqRel);
                    continue;
                }
                self.store(&e.pid_ns, identity::pid_namespace());
                self.store(&e.lock_id, self.lock.as_ref().map_or(0, |l| l.id()));
                self.store(&e.pid, 0);
                self.store(&e.start_ticks, me.start_ticks);
                self.store(&e.boot_lo, me.boot_id as u64);
                self.store(&e.boot_hi, (me.boot_id >> 64) as u64);
                self.store(
                    &e.host,
                    match self.coherence {
                        Coherence::Coherent => 0,
                        Coherence::NonCoherent { host, .. } => host as u64,
                    },
                );
                self.store(&e.pid, me.pid as u64); // last: a pid marks the identity complete
                let live = ClientControl {
                    state: ClientState::Live,
                    generation,
                }
                .encode();
                if self.cas(&e.control, claiming, live, Ordering::AcqRel) {
                    return Ok((i as u16, generation));
                }
                // a reclaimer judged the half-claimed slot dead: take another
            }
            if attempt == 0 {
                self.reclaim_dead()?;
            }
        }
        Err(Error::Pool(format!(
            "all {} client slots are taken by live processes",
            self.num_clients
        )))
    }

    /// Frees the regions of clients whose process died (or whose slot has
    /// been freed or reused since), and those client slots. Only this host's
    /// partition is touched. Concurrent reclaimers are harmless: every change
    /// is a compare-and-swap from the dead owner's exact word.
    pub fn reclaim_dead(&self) -> Result<Reclaimed> {
        let mut out = Reclaimed::default();
        for i in (0..self.num_clients).filter(|&i| self.coherence.owns(i)) {
            if self.me.map(|(c, _)| c as u32) == Some(i) {
                continue;
            }
            let e = self.client_entry(i);
            let w = self.load(&e.control);
            let Some(c) = ClientControl::decode(w) else {
                continue;
            };
            let reclaiming = ClientControl {
                state: ClientState::Reclaiming,
                generation: c.generation,
            }
            .encode();
            let take = match c.state {
                ClientState::Free => false,
                ClientState::Reclaiming => true, // a reclaimer died or is at work: (re)do it
                ClientState::Live | ClientState::Claiming => {
                    // a holder that cannot be judged stays
                    self.client_liveness(i).unwrap_or(Liveness::Unknown) == Liveness::Dead
                        && self.cas(&e.control, w, reclaiming, Ordering::AcqRel)
                }
            };
            if take {
                out.regions += self.free_regions_of(i as u16, c.generation);
                let free = ClientControl {
                    state: ClientState::Free,
                    generation: c.generation,
                }
                .encode();
                if self.cas(&e.control, reclaiming, free, Ordering::AcqRel) {
                    out.clients += 1;
                }
            }
        }
        out.regions += self.free_orphans();
        Ok(out)
    }

    /// Frees every region of this partition owned by (client, generation).
    fn free_regions_of(&self, client: u16, generation: u32) -> u32 {
        let mut n = 0;
        for r in (0..self.num_regions).filter(|&r| self.coherence.owns(r)) {
            let e = self.region_entry(r);
            let w = self.load(&e.control);
            if let Some(c) = RegionControl::decode(w)
                && c.state != RegionState::Free
                && c.client == client
                && c.generation == generation
                && self.cas(
                    &e.control,
                    w,
                    RegionControl::FREE.encode(),
                    Ordering::AcqRel,
                )
            {
                n += 1;
            }
        }
        n
    }

    /// Frees regions whose owning slot is free or was claimed again since.
    fn free_orphans(&self) -> u32 {
        let mut n = 0;
        for r in (0..self.num_regions).filter(|&r| self.coherence.owns(r)) {
            let e = self.region_entry(r);
            let w = self.load(&e.control);
            let Some(c) = RegionControl::decode(w) else {
                continue;
            };
            if c.state == RegionState::Free || c.client as u32 >= self.num_clients {
                continue;
            }
            let owner =
                ClientControl::decode(self.load(&self.client_entry(c.client as u32).control));
            let orphan = match owner {
                Some(o) => o.generation != c.generation || o.state == ClientState::Free,
                None => false,
            };
            if orphan
                && self.cas(
                    &e.control,
                    w,
                    RegionControl::FREE.encode(),
                    Ordering::AcqRel,
                )
            {
                n += 1;
            }
        }
        n
    }

    // ---- regions -----------------------------------------------------------

    fn owner(&self) -> Result<(u16, u32)> {
        self.me
            .ok_or_else(|| invalid("pool", "was opened for inspection only (attach = false)"))
    }

    fn device_has_free(&self, d: u32) -> bool {
        let dev = &self.devices[d as usize];
        (dev.first_region..dev.first_region + dev.num_regions)
            .filter(|&r| self.coherence.owns(r))
            .any(|r| {
                self.region_control(r)
                    .is_some_and(|c| c.state == RegionState::Free)
            })
    }

    /// Takes a free region on the device this rank's placement picks.
    pub fn alloc_region(&self) -> Result<Region> {
        self.alloc_region_for(0)
    }

    /// Takes a free region for request `request` (an id of the caller's,
    /// shown by `kvtier pool status`).
    pub fn alloc_region_for(&self, request: u64) -> Result<Region> {
        let (client, generation) = self.owner()?;
        let mine = RegionControl {
            state: RegionState::Allocated,
            client,
            generation,
        }
        .encode();
        loop {
            let d = self
                .placement
                .lock()
                .unwrap()
                .next(|d| self.device_has_free(d))
                .ok_or_else(|| {
                    Error::Pool(format!(
                        "pool is full: all {} regions are allocated",
                        self.num_regions
                    ))
                })?;
            let dev = &self.devices[d as usize];
            for r in (dev.first_region..dev.first_region + dev.num_regions)
                .filter(|&r| self.coherence.owns(r))
            {
                let e = self.region_entry(r);
                if self.load(&e.control) == RegionControl::FREE.encode()
                    && self.cas(
                        &e.control,
                        RegionControl::FREE.encode(),
                        mine,
                        Ordering::AcqRel,
                    )
                {
                    e.epoch.fetch_add(1, Ordering::AcqRel);
                    self.coherence
                        .after_write(&e.epoch as *const AtomicU64 as *const u8, 8);
                    self.store(&e.request, request);
                    return Ok(Region {
                        pool: self.id,
                        index: r,
                        device: d,
                    });
                }
            }
            // others took that device's free regions meanwhile: place again
        }
    }

    /// Publishes a region: its bytes have been written (by this process, or
    /// by a kernel whose completion the caller awaited), and readers may
    /// trust them from now on.
    pub fn publish(&self, region: &Region) -> Result<()> {
        self.check_region(region)?;
        let (client, generation) = self.owner()?;
        let from = RegionControl {
            state: RegionState::Allocated,
            client,
            generation,
        }
        .encode();
        let to = RegionControl {
            state: RegionState::Ready,
            client,
            generation,
        }
        .encode();
        if self.cas(&self.region_entry(region.index).control, from, to, PUBLISH) {
            Ok(())
        } else {
            Err(self.not_owned(region, "publish"))
        }
    }

    /// Returns a region to the pool.
    pub fn free_region(&self, region: Region) -> Result<()> {
        self.check_region(&region)?;
        let (client, generation) = self.owner()?;
        let e = &self.region_entry(region.index).control;
        for state in [RegionState::Allocated, RegionState::Ready] {
            let w = RegionControl {
                state,
                client,
                generation,
            }
            .encode();
            if self.cas(e, w, RegionControl::FREE.encode(), Ordering::AcqRel) {
                return Ok(());
            }
        }
        Err(self.not_owned(&region, "free"))
    }

    fn not_owned(&self, region: &Region, what: &str) -> Error {
        let state = self.region_control(region.index).map(|c| c.state);
        Error::Pool(format!(
            "cannot {what} region {}: it is not allocated by this process (its state is {state:?}; a dead \
             owner's regions are reclaimed, so this one may have been reclaimed from a process judged dead)",
            region.index
        ))
    }

    fn check_region(&self, region: &Region) -> Result<()> {
        if region.pool != self.id || region.index >= self.num_regions {
            return Err(invalid("region", "belongs to another pool"));
        }
        Ok(())
    }

    /// The state of region `index` (e.g. to poll for READY).
    pub fn region_state(&self, index: u32) -> Result<RegionState> {
        if index >= self.num_regions {
            return Err(invalid(
                "index",
                format!("{index} is beyond the pool's {} regions", self.num_regions),
            ));
        }
        self.region_control(index)
            .map(|c| c.state)
            .ok_or_else(|| Error::Pool(format!("region {index}'s table entry is corrupt")))
    }

    /// Writes consecutive entries of one layer of a region this process
    /// owns, starting at `first_token`; `data` holds whole entries.
    pub fn write_tokens(
        &self,
        region: &Region,
        layer: u32,
        first_token: u32,
        data: &[u8],
    ) -> Result<()> {
        self.check_region(region)?;
        let owner = self.owner()?;
        match self.region_control(region.index) {
            Some(c) if c.state != RegionState::Free && (c.client, c.generation) == owner => {}
            _ => return Err(self.not_owned(region, "write")),
        }
        let at = self.token_range(region.index, layer, first_token, data.len(), "data")?;
        // SAFETY: token_range checked that the bytes lie inside the region's
        // device mapping; the source is a distinct Rust slice.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), at, data.len()) };
        self.coherence.after_write(at, data.len());
        Ok(())
    }

    /// Reads consecutive entries of one layer of a region this process owns.
    pub fn read_tokens(
        &self,
        region: &Region,
        layer: u32,
        first_token: u32,
        out: &mut [u8],
    ) -> Result<()> {
        self.check_region(region)?;
        self.read_at(region.index, layer, first_token, out)
    }

    /// Reads consecutive entries of one layer of region `index`, which must be
    /// READY (published by its owner, whoever that is) from before the read
    /// to after it: a region freed or reallocated meanwhile (its bytes may
    /// be another owner's, half written) is an error, never torn bytes.
    pub fn read_ready(
        &self,
        index: u32,
        layer: u32,
        first_token: u32,
        out: &mut [u8],
    ) -> Result<()> {
        if index >= self.num_regions {
            return Err(invalid(
                "index",
                format!(
                    "region {index} does not exist; the pool has {}",
                    self.num_regions
                ),
            ));
        }
        let e = self.region_entry(index);
        let seen = || (self.load(&e.control), self.load(&e.epoch));
        let before = seen();
        if RegionControl::decode(before.0).map(|c| c.state) != Some(RegionState::Ready) {
            return Err(Error::Pool(format!(
                "region {index} is not READY; its bytes may be partial"
            )));
        }
        self.read_at(index, layer, first_token, out)?;
        // the bytes are read before the words are looked at again
        std::sync::atomic::fence(Ordering::Acquire);
        if seen() != before {
            return Err(Error::Pool(format!(
                "region {index} was freed or reallocated while it was read; read it again if it is READY"
            )));
        }
        Ok(())
    }

    fn read_at(&self, index: u32, layer: u32, first_token: u32, out: &mut [u8]) -> Result<()> {
        let at = self.token_range(index, layer, first_token, out.len(), "out")?;
        self.coherence.before_read(at, out.len());
        // SAFETY: as in write_tokens.
        unsafe { std::ptr::copy_nonoverlapping(at, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// The host address of whole entries of one layer, all checked.
    fn token_range(
        &self,
        index: u32,
        layer: u32,
        first_token: u32,
        len: usize,
        arg: &'static str,
    ) -> Result<*mut u8> {
        let entry = self.layout.entry_bytes() as usize;
        if !len.is_multiple_of(entry) {
            return Err(invalid(
                arg,
                format!("{len} bytes is not a whole number of {entry}-byte entries"),
            ));
        }
        let tokens = (len / entry) as u64;
        if first_token as u64 + tokens > self.layout.tokens_per_region() as u64 {
            return Err(invalid(
                arg,
                format!(
                    "tokens {first_token}..{} run past the region capacity of {}",
                    first_token as u64 + tokens,
                    self.layout.tokens_per_region()
                ),
            ));
        }
        let in_region = self.layout.layer_offset(layer)? + first_token as u64 * entry as u64;
        Ok((self.host_addr(index) + in_region) as *mut u8)
    }

    fn device_of(&self, index: u32) -> usize {
        self.devices.partition_point(|d| d.first_region <= index) - 1
    }

    fn host_addr(&self, index: u32) -> u64 {
        let d = &self.devices[self.device_of(index)];
        d.map.ptr() as u64 + d.data_offset + (index - d.first_region) as u64 * self.region_stride
    }

    /// The host address of a region's first byte.
    pub fn region_host_addr(&self, region: &Region) -> Result<u64> {
        self.check_region(region)?;
        Ok(self.host_addr(region.index))
    }

    /// The address at which `dev`'s kernels see a region's first byte,
    /// registering its device with the driver the first time.
    pub fn region_device_addr(&self, region: &Region, dev: &Arc<CudaDevice>) -> Result<u64> {
        self.check_region(region)?;
        let d = self.device_of(region.index);
        let base = self.register_device(d, dev)?;
        let pd = &self.devices[d];
        Ok(base + pd.data_offset + (region.index - pd.first_region) as u64 * self.region_stride)
    }

    /// Registers every device with `dev` (portable, device-mapped, or the
    /// flags in the pool options).
    pub fn register_all(&self, dev: &Arc<CudaDevice>) -> Result<()> {
        for d in 0..self.devices.len() {
            self.register_device(d, dev)?;
        }
        Ok(())
    }

    /// The device address of byte 0 of device `d`, registering it once.
    fn register_device(&self, d: usize, dev: &Arc<CudaDevice>) -> Result<u64> {
        let pd = &self.devices[d];
        let mut reg = pd.registration.lock().unwrap();
        if let Some(r) = reg.as_ref() {
            // Portable registrations are visible in every context; under
            // unified addressing the device address is the same in all.
            return Ok(r.device_addr());
        }
        // SAFETY: the mapping outlives the registration (field order), and
        // each device is registered once.
        let r = unsafe { HostRegistration::register(dev, pd.map.ptr(), pd.map.len(), self.register_flags) }.map_err(|e| {
            Error::Pool(format!(
                "registering {} ({}) with the GPU failed ({e}); check the memlock limit (ulimit -l); a file on \
                 a disk filesystem or FS-DAX cannot be pinned (use tmpfs, hugetlbfs, a dax: device or a numa: \
                 node); memory someone else registered already (an engine's host pool) is refused as such",
                pd.map.spec(),
                format_size(pd.map.len() as u64)
            ))
        })?;
        let addr = r.device_addr();
        *reg = Some(r);
        Ok(addr)
    }

    // ---- reports -----------------------------------------------------------

    /// The layout of every region.
    pub fn layout(&self) -> LayerFirstLayout {
        self.layout
    }

    /// Regions in the pool.
    pub fn num_regions(&self) -> u32 {
        self.num_regions
    }

    /// Regions not allocated (in every partition).
    pub fn free_regions(&self) -> u32 {
        (0..self.num_regions)
            .filter(|&r| {
                self.region_control(r)
                    .is_some_and(|c| c.state == RegionState::Free)
            })
            .count() as u32
    }

    /// Bytes between consecutive region bases.
    pub fn region_stride(&self) -> u64 {
        self.region_stride
    }

    /// The pool's id (random, set at creation).
    pub fn uuid(&self) -> [u8; 16] {
        self.uuid
    }

    /// The devices, in pool order.
    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.devices
            .iter()
            .map(|d| DeviceInfo {
                spec: d.map.spec().to_string(),
                bytes: d.bytes,
                regions: d.num_regions,
                free: (d.first_region..d.first_region + d.num_regions)
                    .filter(|&r| {
                        self.region_control(r)
                            .is_some_and(|c| c.state == RegionState::Free)
                    })
                    .count() as u32,
            })
            .collect()
    }

    /// Every region's state and owner.
    pub fn regions(&self) -> Vec<RegionInfo> {
        (0..self.num_regions)
            .filter_map(|r| {
                let c = self.region_control(r)?;
                let owner = (c.state != RegionState::Free).then(|| self.owner_info(c));
                Some(RegionInfo {
                    index: r,
                    device: self.device_of(r) as u32,
                    state: c.state,
                    owner,
                    request: self.load(&self.region_entry(r).request),
                })
            })
            .collect()
    }

    fn owner_info(&self, c: RegionControl) -> OwnerInfo {
        if c.client as u32 >= self.num_clients {
            return OwnerInfo {
                client: c.client,
                pid: 0,
                liveness: Liveness::Dead,
            };
        }
        let slot = ClientControl::decode(self.load(&self.client_entry(c.client as u32).control));
        let (id, _) = self.client_identity(c.client as u32);
        let liveness = match slot {
            Some(s)
                if s.generation == c.generation
                    && matches!(s.state, ClientState::Live | ClientState::Claiming) =>
            {
                self.client_liveness(c.client as u32)
                    .unwrap_or(Liveness::Unknown)
            }
            _ => Liveness::Dead,
        };
        OwnerInfo {
            client: c.client,
            pid: id.pid,
            liveness,
        }
    }

    /// Attached clients: (slot, pid, liveness).
    pub fn clients_info(&self) -> Vec<(u16, u32, Liveness)> {
        (0..self.num_clients)
            .filter_map(|i| {
                let c = ClientControl::decode(self.load(&self.client_entry(i).control))?;
                (c.state != ClientState::Free).then(|| {
                    let (id, _) = self.client_identity(i);
                    (
                        i as u16,
                        id.pid,
                        self.client_liveness(i).unwrap_or(Liveness::Unknown),
                    )
                })
            })
            .collect()
    }

    /// Verifies the region and client tables: every word decodes and names a
    /// client slot that exists; lists dead clients and reclaimable regions.
    pub fn check(&self) -> CheckReport {
        let mut report = CheckReport::default();
        for i in 0..self.num_clients {
            match ClientControl::decode(self.load(&self.client_entry(i).control)) {
                None => report
                    .problems
                    .push(format!("client slot {i} holds an unknown state")),
                Some(c)
                    if c.state != ClientState::Free
                        && self.client_liveness(i).unwrap_or(Liveness::Unknown)
                            == Liveness::Dead =>
                {
                    report
                        .dead_clients
                        .push((i as u16, self.client_identity(i).0.pid));
                }
                _ => {}
            }
        }
        for r in 0..self.num_regions {
            match self.region_control(r) {
                None => report
                    .problems
                    .push(format!("region {r} holds an unknown state")),
                Some(c) if c.state != RegionState::Free => {
                    if c.client as u32 >= self.num_clients {
                        report.problems.push(format!(
                            "region {r} names client slot {}, which does not exist",
                            c.client
                        ));
                    } else if self.owner_info(c).liveness == Liveness::Dead {
                        report.reclaimable_regions += 1;
                    }
                }
                _ => {}
            }
        }
        report
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // A clean exit: free this client's regions and its slot.
        if let Some((client, generation)) = self.me {
            self.free_regions_of(client, generation);
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

/// Whether a header's tables and device records describe a pool that fits
/// its first device of `dev0_len` bytes: every offset and count is checked,
/// with checked arithmetic, before anything is read through them.
fn check_header_geometry(h: &PoolHeader, dev0_len: u64) -> std::result::Result<(), String> {
    let n = h.num_devices as usize;
    if n == 0 || n > MAX_DEVICES {
        return Err(format!("{n} devices"));
    }
    if h.header_bytes as usize != size_of::<PoolHeader>() {
        return Err(format!("a header of {} B", h.header_bytes));
    }
    if h.num_clients == 0 || h.num_clients > MAX_CLIENTS {
        return Err(format!("{} client slots", h.num_clients));
    }
    let region_table = (size_of::<PoolHeader>() as u64).next_multiple_of(64);
    let table_end = |offset: u64, entries: u32| offset.checked_add(64 * entries as u64);
    let regions_end = table_end(h.region_table_offset, h.num_regions);
    let clients_end = table_end(h.client_table_offset, h.num_clients);
    let (Some(regions_end), Some(clients_end)) = (regions_end, clients_end) else {
        return Err("tables past the end of the address space".into());
    };
    if h.region_table_offset != region_table
        || h.client_table_offset < regions_end
        || !h.client_table_offset.is_multiple_of(64)
    {
        return Err(format!(
            "tables at {} and {} for {} regions",
            h.region_table_offset, h.client_table_offset, h.num_regions
        ));
    }
    let mut next_region = 0u64;
    for (i, rec) in h.devices[..n].iter().enumerate() {
        let min_offset = if i == 0 {
            clients_end
        } else {
            metadata::DATA_ALIGN
        };
        let end = (rec.num_regions as u64)
            .checked_mul(h.region_stride)
            .and_then(|b| b.checked_add(rec.data_offset));
        if rec.data_offset < min_offset
            || !rec.data_offset.is_multiple_of(metadata::DATA_ALIGN)
            || rec.first_region as u64 != next_region
            || end.is_none_or(|e| e > rec.bytes)
            || rec.spec_len as usize > SPEC_BYTES
        {
            return Err(format!("the record of device {i} does not fit its device"));
        }
        next_region += rec.num_regions as u64;
    }
    if next_region != h.num_regions as u64 {
        return Err(format!(
            "{} regions; the devices hold {next_region}",
            h.num_regions
        ));
    }
    if h.devices[0].data_offset > dev0_len {
        return Err(format!("device 0 is {dev0_len} B, less than its tables"));
    }
    Ok(())
}

fn check_options(devices: &[DeviceSpec], o: &PoolOptions) -> Result<()> {
    if devices.is_empty() || devices.len() > MAX_DEVICES {
        return Err(invalid(
            "devices",
            format!(
                "{} given; a pool spans 1..={MAX_DEVICES} devices",
                devices.len()
            ),
        ));
    }
    if let Coherence::NonCoherent { hosts, host } = o.coherence {
        if !metadata::non_coherent_supported() {
            return Err(invalid(
                "coherence",
                "non-coherent multi-host mode is implemented for x86_64 only",
            ));
        }
        if hosts == 0 || host >= hosts {
            return Err(invalid(
                "coherence",
                format!("host {host} of {hosts} hosts"),
            ));
        }
    }
    if o.ranks == 0 || o.rank >= o.ranks {
        return Err(invalid(
            "rank",
            format!("rank {} of {} ranks", o.rank, o.ranks),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
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
