//! The pool's metadata, kept in the pool itself so that every process (and,
//! through a CXL switch, every host) that maps the devices sees one truth.
//!
//! Device 0 starts with a [`PoolHeader`] (magic, version, pool id, layout,
//! device table), then the region table and the client table, 64-byte entries
//! each; its data (regions) start on the next 2 MiB boundary. Every other
//! device starts with a [`DeviceHeader`] naming the pool and its index, and its
//! data start at 2 MiB.
//!
//! Ownership is one atomic word per entry: a region's control word holds its
//! state and its owner (client slot and that slot's generation); a client's
//! control word holds its state and generation. Every ownership change is one
//! compare-and-swap, so no crash leaves a half-changed owner, and a client
//! slot reused by a new process (new generation) never inherits the regions of
//! the dead one.
//!
//! Single host (or hardware-coherent CXL): the words are plain shared-memory
//! atomics. Several hosts without hardware coherence ([`Coherence::NonCoherent`]):
//! a host's CPU caches do not see another host's writes, and atomics are not
//! atomic across hosts. Then each host allocates only from its partition of
//! the tables (entry index mod hosts == host), so no entry is ever written by
//! two hosts; every metadata write is followed by a cache-line flush and a
//! store fence (the line reaches the device), and every metadata read is
//! preceded by a flush (dropping the stale copy) and a fence. Region bytes
//! follow the same rule: the writer flushes them before it publishes, a reader
//! flushes its cached lines before it reads. What does not hold across hosts:
//! liveness of another host's processes (recorded under another boot id, so
//! never reclaimed from here), and atomicity of concurrent writes to one entry
//! from two hosts (prevented by the partition, not by the hardware).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::layout::LayerFirstLayout;

/// First bytes of device 0 of a pool.
pub const POOL_MAGIC: [u8; 8] = *b"KVTIERPL";
/// First bytes of every other device of a pool.
pub const DEVICE_MAGIC: [u8; 8] = *b"KVTIERDV";
/// Version of the on-device format this build reads and writes (2: the
/// header carries a checksum).
pub const VERSION: u32 = 2;
/// Data start on this boundary (DAX mappings and huge pages want 2 MiB).
pub const DATA_ALIGN: u64 = 2 << 20;
/// Most devices one pool spans.
pub const MAX_DEVICES: usize = 16;
/// Most client slots (processes attached at once); client indices are 16-bit.
pub const MAX_CLIENTS: u32 = 4096;
/// Client slots a pool gets unless told otherwise.
pub const DEFAULT_CLIENTS: u32 = 256;
/// Bytes of a device spec kept in the device table.
pub const SPEC_BYTES: usize = 200;

/// One device of the pool, as recorded in the header.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct DeviceRecord {
    pub bytes: u64,
    pub data_offset: u64,
    pub first_region: u32,
    pub num_regions: u32,
    pub spec_len: u32,
    pub _pad: u32,
    pub spec: [u8; SPEC_BYTES],
}

/// The header at byte 0 of device 0. Written once by `Pool::create` (the
/// magic last), read-only after.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PoolHeader {
    pub magic: [u8; 8],
    pub version: u32,
    pub header_bytes: u32,
    pub uuid: [u8; 16],
    pub entry_bytes: u32,
    pub layers: u32,
    pub tokens_per_region: u32,
    pub num_devices: u32,
    pub region_stride: u64,
    pub num_regions: u32,
    pub num_clients: u32,
    /// 0: one host, or hardware-coherent memory; n >= 1: n hosts without
    /// hardware coherence, each owning a partition of the tables.
    pub hosts: u32,
    /// [`header_checksum`] of the rest of the header.
    pub checksum: u32,
    pub region_table_offset: u64,
    pub client_table_offset: u64,
    pub created_unix_ns: u64,
    pub devices: [DeviceRecord; MAX_DEVICES],
}

/// FNV-1a over the header's bytes with its magic and its checksum taken as
/// zero: the header is written once, so any later change to it (a stray
/// write, a corrupted device) shows.
pub fn header_checksum(h: &PoolHeader) -> u32 {
    let mut copy = *h;
    copy.magic = [0; 8];
    copy.checksum = 0;
    // SAFETY: PoolHeader is repr(C) plain data without padding (its fields
    // are laid out back to back; see the size assertion below).
    let bytes = unsafe {
        std::slice::from_raw_parts(
            &copy as *const PoolHeader as *const u8,
            size_of::<PoolHeader>(),
        )
    };
    bytes.iter().fold(0x811c_9dc5u32, |h, &b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    })
}

const _: () = assert!(
    size_of::<PoolHeader>() == 96 + MAX_DEVICES * size_of::<DeviceRecord>()
        && size_of::<DeviceRecord>() == 32 + SPEC_BYTES,
    "PoolHeader has no padding, so its checksum covers only its fields"
);

/// The header at byte 0 of every other device.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct DeviceHeader {
    pub magic: [u8; 8],
    pub version: u32,
    pub index: u32,
    pub uuid: [u8; 16],
}

/// A region's entry in the region table.
#[repr(C, align(64))]
pub struct RegionEntry {
    pub control: AtomicU64,
    /// The owner's request id, set after allocation.
    pub request: AtomicU64,
    /// Bumped at every allocation, before the new owner writes a byte: a
    /// reader that finds it unchanged after reading saw one owner's bytes.
    pub epoch: AtomicU64,
    /// The ticket (`Pool::region_ticket`) of an allocation whose owner
    /// asked to free it while another process held it: the last holder to
    /// leave frees it if the region is still that allocation (0: none; a
    /// pool of an earlier kvtier has 0 here, its padding).
    pub freeing: AtomicU64,
    _pad: [u64; 4],
}

/// A client (attached process) slot.
#[repr(C, align(64))]
pub struct ClientEntry {
    pub control: AtomicU64,
    pub pid: AtomicU64,
    pub start_ticks: AtomicU64,
    pub boot_lo: AtomicU64,
    pub boot_hi: AtomicU64,
    pub host: AtomicU64,
    /// The holder's PID namespace (the inode of its /proc/self/ns/pid).
    pub pid_ns: AtomicU64,
    /// Which file the holder's liveness lock is on (its device and inode,
    /// as the holder saw them): see `Pool::client_liveness`.
    pub lock_id: AtomicU64,
}

const _: () = assert!(size_of::<RegionEntry>() == 64 && size_of::<ClientEntry>() == 64);

/// State of a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RegionState {
    /// Not owned.
    Free,
    /// Owned; its bytes are being written.
    Allocated,
    /// Owned, and published: its bytes were written before this state was set.
    Ready,
}

/// A region's control word: state and owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionControl {
    pub state: RegionState,
    pub client: u16,
    pub generation: u32,
}

impl RegionControl {
    pub const FREE: RegionControl = RegionControl {
        state: RegionState::Free,
        client: 0,
        generation: 0,
    };

    pub fn encode(self) -> u64 {
        let s = match self.state {
            RegionState::Free => 0,
            RegionState::Allocated => 1,
            RegionState::Ready => 2,
        };
        s | (self.client as u64) << 8 | (self.generation as u64) << 32
    }

    /// None for a word no kvtier wrote (a corrupt table).
    pub fn decode(w: u64) -> Option<Self> {
        let state = match w & 0xff {
            0 => RegionState::Free,
            1 => RegionState::Allocated,
            2 => RegionState::Ready,
            _ => return None,
        };
        if w >> 24 & 0xff != 0 {
            return None;
        }
        let c = RegionControl {
            state,
            client: (w >> 8) as u16,
            generation: (w >> 32) as u32,
        };
        (state != RegionState::Free || c == Self::FREE).then_some(c)
    }
}

/// State of a client slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientState {
    Free,
    /// Being claimed: the identity fields are being written.
    Claiming,
    /// Attached.
    Live,
    /// Its process died; its regions are being freed.
    Reclaiming,
}

/// A client's control word: state and generation (bumped at every claim).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientControl {
    pub state: ClientState,
    pub generation: u32,
}

impl ClientControl {
    pub fn encode(self) -> u64 {
        let s = match self.state {
            ClientState::Free => 0,
            ClientState::Claiming => 1,
            ClientState::Live => 2,
            ClientState::Reclaiming => 3,
        };
        s | (self.generation as u64) << 32
    }

    pub fn decode(w: u64) -> Option<Self> {
        let state = match w & 0xffff_ffff {
            0 => ClientState::Free,
            1 => ClientState::Claiming,
            2 => ClientState::Live,
            3 => ClientState::Reclaiming,
            _ => return None,
        };
        Some(ClientControl {
            state,
            generation: (w >> 32) as u32,
        })
    }
}

/// How the hosts sharing a pool see each other's writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coherence {
    /// One host, or hardware-coherent memory: shared-memory atomics.
    Coherent,
    /// `hosts` hosts without hardware coherence; this one is `host`.
    NonCoherent { hosts: u32, host: u32 },
}

impl Coherence {
    /// Whether this host may write entry `index` of a table.
    pub fn owns(&self, index: u32) -> bool {
        match *self {
            Coherence::Coherent => true,
            Coherence::NonCoherent { hosts, host } => index % hosts == host,
        }
    }

    /// Before reading shared lines another host may have written: drop the
    /// cached copies.
    pub fn before_read(&self, addr: *const u8, len: usize) {
        if let Coherence::NonCoherent { .. } = self {
            flush_lines(addr, len);
        }
    }

    /// After writing shared lines: push them to the device.
    pub fn after_write(&self, addr: *const u8, len: usize) {
        if let Coherence::NonCoherent { .. } = self {
            flush_lines(addr, len);
        }
    }
}

/// Writes back and invalidates the cache lines of `addr..addr + len`, then
/// fences, so later loads go to memory and earlier stores have reached it.
#[cfg(target_arch = "x86_64")]
fn flush_lines(addr: *const u8, len: usize) {
    use std::arch::x86_64::{_mm_clflush, _mm_mfence};
    let start = addr as usize & !63;
    let end = addr as usize + len;
    // SAFETY: clflush on mapped addresses (the caller's metadata or region
    // bytes); mfence has no preconditions.
    unsafe {
        _mm_mfence();
        for line in (start..end).step_by(64) {
            _mm_clflush(line as *const u8);
        }
        _mm_mfence();
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn flush_lines(_addr: *const u8, _len: usize) {
    unreachable!("Pool refuses non-coherent mode off x86_64")
}

/// Whether non-coherent mode is available on this architecture.
pub fn non_coherent_supported() -> bool {
    cfg!(target_arch = "x86_64")
}

/// Where the regions and tables of a pool go, computed from the device sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub region_stride: u64,
    pub region_table_offset: u64,
    pub client_table_offset: u64,
    /// (data offset, first region, regions) per device.
    pub devices: Vec<(u64, u32, u32)>,
    pub num_regions: u32,
}

/// Plans the tables and regions of a new pool over devices of `sizes` bytes.
pub fn plan_geometry(layout: &LayerFirstLayout, sizes: &[u64], clients: u32) -> Result<Geometry> {
    let region_stride = layout.region_bytes().next_multiple_of(super::REGION_ALIGN);
    // Regions if each device gave its whole space (an upper bound that sizes
    // the region table).
    let upper: u64 = sizes
        .iter()
        .enumerate()
        .map(|(i, &b)| b.saturating_sub(if i == 0 { 0 } else { DATA_ALIGN }) / region_stride)
        .sum();
    let region_table_offset = (size_of::<PoolHeader>() as u64).next_multiple_of(64);
    let client_table_offset = region_table_offset + 64 * upper;
    let meta = (client_table_offset + 64 * clients as u64).next_multiple_of(DATA_ALIGN);
    // The tables live on device 0, sized for every device's regions: a small
    // first device may not hold them.
    if sizes.first().is_none_or(|&b| b < meta) {
        return Err(Error::Pool(format!(
            "the first device ({}) cannot hold the pool's tables ({}: a region table for up to {upper} \
             regions over all devices, and {clients} client slots); list the largest device first or make the \
             first one larger",
            super::human_size(sizes.first().copied().unwrap_or(0)),
            super::human_size(meta)
        )));
    }
    let mut devices = Vec::new();
    let mut first = 0u64;
    for (i, &bytes) in sizes.iter().enumerate() {
        let data_offset = if i == 0 { meta } else { DATA_ALIGN };
        let n = bytes.saturating_sub(data_offset) / region_stride;
        devices.push((data_offset, first as u32, n as u32));
        first += n;
    }
    if first == 0 {
        return Err(Error::Pool(format!(
            "the devices hold no region: one region of this layout ({} layers × {} tokens × {} B) needs \
             {} after {} of metadata on the first device",
            layout.layers(),
            layout.tokens_per_region(),
            layout.entry_bytes(),
            super::human_size(region_stride),
            super::human_size(meta)
        )));
    }
    let num_regions =
        u32::try_from(first).map_err(|_| Error::Pool(format!("{first} regions exceed 2^32")))?;
    Ok(Geometry {
        region_stride,
        region_table_offset,
        client_table_offset,
        devices,
        num_regions,
    })
}

/// Reads a device record's spec text.
pub fn record_spec(r: &DeviceRecord) -> String {
    String::from_utf8_lossy(&r.spec[..(r.spec_len as usize).min(SPEC_BYTES)]).into_owned()
}

/// Fences used around publication: the bytes of a region are written before
/// the Release CAS that makes it Ready, and read after an Acquire load that
/// sees Ready.
pub const PUBLISH: Ordering = Ordering::Release;
pub const OBSERVE: Ordering = Ordering::Acquire;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_words_round_trip_and_reject_garbage() {
        for c in [
            RegionControl::FREE,
            RegionControl {
                state: RegionState::Allocated,
                client: 4095,
                generation: u32::MAX,
            },
            RegionControl {
                state: RegionState::Ready,
                client: 7,
                generation: 3,
            },
        ] {
            assert_eq!(RegionControl::decode(c.encode()), Some(c));
        }
        assert_eq!(RegionControl::decode(3), None, "state 3");
        assert_eq!(RegionControl::decode(1 << 24), None, "stray bits");
        assert_eq!(
            RegionControl::decode(7 << 8),
            None,
            "a free region with an owner"
        );
        for c in [
            ClientControl {
                state: ClientState::Live,
                generation: 9,
            },
            ClientControl {
                state: ClientState::Reclaiming,
                generation: 0,
            },
        ] {
            assert_eq!(ClientControl::decode(c.encode()), Some(c));
        }
        assert_eq!(ClientControl::decode(4), None);
    }

    #[test]
    fn geometry_puts_tables_first_and_regions_on_2mib_boundaries() {
        let layout = LayerFirstLayout::new(656, 2, 1000).unwrap(); // region 1.31 MB, stride 1314816
        let g = plan_geometry(&layout, &[64 << 20, 16 << 20], 8).unwrap();
        assert_eq!(g.region_stride, 1_314_816);
        assert_eq!(g.devices[0].0 % DATA_ALIGN, 0);
        assert_eq!(g.devices[1].0, DATA_ALIGN);
        assert_eq!(g.devices[0].1, 0);
        assert_eq!(g.devices[1].1, g.devices[0].2);
        assert_eq!(g.num_regions, g.devices[0].2 + g.devices[1].2);
        assert!(
            g.client_table_offset + 64 * 8 <= g.devices[0].0,
            "tables fit before the data"
        );
        for (i, &(off, _, n)) in g.devices.iter().enumerate() {
            let size = [64u64 << 20, 16 << 20][i];
            assert!(off + n as u64 * g.region_stride <= size);
        }
        assert!(plan_geometry(&layout, &[2 << 20], 8).is_err());
    }

    /// The tables go on device 0, sized for all devices' regions: a small
    /// first device beside a large one is refused, not written past.
    #[test]
    fn a_first_device_too_small_for_the_tables_is_refused() {
        let layout = LayerFirstLayout::new(656, 1, 4).unwrap(); // 4 KiB strides
        let err = plan_geometry(&layout, &[4 << 20, 2 << 30], 256)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("the first device (4 MiB) cannot hold the pool's tables (34 MiB"),
            "{err}"
        );
        let g = plan_geometry(&layout, &[2 << 30, 4 << 20], 256).unwrap();
        assert!(g.client_table_offset + 64 * 256 <= g.devices[0].0);
        assert!(plan_geometry(&layout, &[], 8).is_err());
    }

    #[test]
    fn partitions_split_the_tables_between_hosts() {
        let c = Coherence::NonCoherent { hosts: 3, host: 1 };
        assert_eq!(
            (0..9).filter(|&i| c.owns(i)).collect::<Vec<_>>(),
            vec![1, 4, 7]
        );
        assert!((0..9).all(|i| Coherence::Coherent.owns(i)));
    }
}
