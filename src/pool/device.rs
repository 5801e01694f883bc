//! Pool memory devices: what a user names, and the mapping behind it.
//!
//! * `dax:/dev/dax0.0[:SIZE]`: a devdax character device (CXL Type-3 memory in
//!   devdax mode), mapped shared; its size comes from sysfs and must be a
//!   multiple of 2 MiB.
//! * `numa:NODE:SIZE`: anonymous memory bound (`mbind`, MPOL_BIND) to a NUMA
//!   node, such as CXL memory onlined as a CPU-less node. Private to the
//!   process that creates it. `numa:2+3:SIZE` interleaves its pages over
//!   nodes 2 and 3 (MPOL_INTERLEAVE): one range with the capacity and the
//!   bandwidth of both devices.
//! * `file:PATH:SIZE`: a shared file on tmpfs or hugetlbfs, the way several
//!   processes on one machine share a pool (and how tests emulate several CXL
//!   devices). When opening, the size may be left out (the file's length).
//! * `anon:SIZE`: anonymous memory, private to the process (the default).

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use memmap2::{MmapOptions, MmapRaw};

use crate::error::{Error, Result, invalid};
use crate::shared_fs::{self, Devices, FileRule, Owner};

/// A memory device a pool lives on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// Anonymous memory of this process.
    Anon { bytes: u64 },
    /// A shared file; `bytes` may be None when opening an existing pool.
    File { path: PathBuf, bytes: Option<u64> },
    /// Anonymous memory bound to NUMA node `nodes[0]`, or interleaved page by
    /// page over `nodes` (two or more, distinct).
    Numa { nodes: Vec<u32>, bytes: u64 },
    /// A devdax character device; all of it unless `bytes` is given.
    Dax { path: PathBuf, bytes: Option<u64> },
}

/// Whether a device is being created (a new pool) or opened (an existing one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapMode {
    Create,
    Open,
}

impl DeviceSpec {
    /// A shared file of `bytes` bytes.
    pub fn file(path: impl Into<PathBuf>, bytes: u64) -> Self {
        DeviceSpec::File {
            path: path.into(),
            bytes: Some(bytes),
        }
    }

    /// Whether other processes can map the same memory.
    pub fn is_shared(&self) -> bool {
        matches!(self, DeviceSpec::File { .. } | DeviceSpec::Dax { .. })
    }

    /// The device's kind and location without its size, the part that must
    /// match when a pool is opened again.
    pub fn identity(&self) -> String {
        match self {
            DeviceSpec::Anon { .. } => "anon".into(),
            DeviceSpec::File { path, .. } => format!("file:{}", path.display()),
            DeviceSpec::Numa { nodes, .. } => format!("numa:{}", node_list(nodes)),
            DeviceSpec::Dax { path, .. } => format!("dax:{}", path.display()),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let usage = "expected anon:SIZE, file:PATH[:SIZE], numa:NODE[+NODE...]:SIZE or dax:PATH[:SIZE] (e.g. \
                     anon:8GiB, file:/dev/shm/kv0:64GiB, numa:2:64GiB, numa:2+3:128GiB, dax:/dev/dax0.0)";
        let bad = || invalid("device", format!("{s:?}: {usage}"));
        let (kind, rest) = s.split_once(':').ok_or_else(bad)?;
        // "PATH" or "PATH:SIZE", where SIZE is the part after the last ':' if it parses
        let path_and_size = |rest: &str| -> Result<(PathBuf, Option<u64>)> {
            match rest.rsplit_once(':') {
                Some((p, size))
                    if size.starts_with(|c: char| c.is_ascii_digit() || c == '-' || c == '+') =>
                {
                    if p.is_empty() {
                        return Err(bad());
                    }
                    Ok((PathBuf::from(p), Some(parse_size(size)?)))
                }
                // "PATH:SIZE:more": the size is not last
                Some((p, last))
                    if p.rsplit_once(':')
                        .is_some_and(|(_, z)| parse_size(z).is_ok()) =>
                {
                    Err(invalid(
                        "device",
                        format!("{s:?}: {last:?} follows the size; the size comes last ({usage})"),
                    ))
                }
                _ if !rest.is_empty() => Ok((PathBuf::from(rest), None)),
                _ => Err(bad()),
            }
        };
        match kind {
            "anon" => Ok(DeviceSpec::Anon {
                bytes: parse_size(rest)?,
            }),
            "file" => {
                let (path, bytes) = path_and_size(rest)?;
                Ok(DeviceSpec::File { path, bytes })
            }
            "dax" => {
                let (path, bytes) = path_and_size(rest)?;
                Ok(DeviceSpec::Dax { path, bytes })
            }
            "numa" => {
                let (nodes, size) = rest.split_once(':').ok_or_else(|| {
                    invalid(
                        "device",
                        format!(
                            "{s:?} needs a size here ({s}:64GiB, say; `kvtier info` lists each node's memory): \
                             only the SGLang shim's config sizes a numa: device itself"
                        ),
                    )
                })?;
                Ok(DeviceSpec::Numa {
                    nodes: parse_nodes(nodes)?,
                    bytes: parse_size(size)?,
                })
            }
            other => Err(invalid(
                "device",
                format!("{other:?} is not a device kind; {usage}"),
            )),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let size = |b: &Option<u64>| {
            b.map(|b| format!(":{}", format_size(b)))
                .unwrap_or_default()
        };
        match self {
            DeviceSpec::Anon { bytes } => write!(f, "anon:{}", format_size(*bytes)),
            DeviceSpec::File { path, bytes } => write!(f, "file:{}{}", path.display(), size(bytes)),
            DeviceSpec::Numa { nodes, bytes } => {
                write!(f, "numa:{}:{}", node_list(nodes), format_size(*bytes))
            }
            DeviceSpec::Dax { path, bytes } => write!(f, "dax:{}{}", path.display(), size(bytes)),
        }
    }
}

/// What a device offers a pool, for capacity planning before it is mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCapacity {
    /// Bytes of memory the device holds (pool metadata included).
    pub bytes: u64,
    /// Whether those bytes are the host's general DRAM (anonymous memory, or
    /// a file on tmpfs or ramfs), the memory the kernel reports as available
    /// and an engine's own host-memory accounting already covers. False for
    /// a devdax device, a NUMA node's memory (which has its own account, the
    /// node's free memory) and files on other filesystems (hugetlbfs, a
    /// DAX-mounted CXL device).
    pub host_dram: bool,
    /// Whether the kernel lets the GPU driver or an RDMA NIC pin the pages
    /// for as long as they are registered (a long-term pin, as
    /// `cudaHostRegister` and `ibv_reg_mr` take): true for anonymous and
    /// NUMA memory, devdax devices and files on tmpfs, ramfs or hugetlbfs;
    /// false for files on a disk filesystem or FS-DAX, whose writable shared
    /// pages need dirty tracking (Linux refuses such pins).
    pub pinnable: bool,
    /// Of a `numa:` device's nodes, the bytes of online memory in
    /// ZONE_MOVABLE (0 for other devices). A long-term pin (a GPU or RDMA
    /// registration) first migrates movable pages out of that zone, which on
    /// a CXL node onlined as movable means into another node's DRAM: the pool
    /// would silently not be on CXL. Online such memory as normal memory, or
    /// use the device through `dax:` (see [`DeviceSpec::placement_warning`]).
    pub movable_bytes: u64,
}

impl DeviceSpec {
    /// What would make the device not hold the pool where it says, or not
    /// be usable by a GPU, found before it is mapped: a `numa:` node whose
    /// memory is movable (registration migrates its pages off the node), a
    /// file on a filesystem whose pages cannot be pinned (registration with
    /// a GPU fails). None when nothing is in the way.
    pub fn placement_warning(&self) -> Option<String> {
        self.placement_warning_in(Path::new("/sys"))
    }

    fn placement_warning_in(&self, sysfs: &Path) -> Option<String> {
        match self {
            DeviceSpec::Numa { nodes, .. } => {
                let movable: u64 = nodes.iter().map(|&n| numa_movable_bytes(sysfs, n)).sum();
                (movable > 0).then(|| {
                    format!(
                        "{self}: {} of NUMA node {}'s online memory is in ZONE_MOVABLE; registering the pool \
                         with a GPU (or an RDMA NIC) migrates those pages off the node first, into another \
                         node's DRAM. Online the CXL memory as normal memory (daxctl online-memory \
                         --no-movable), or use it as a dax: device",
                        format_size(movable),
                        node_list(nodes)
                    )
                })
            }
            DeviceSpec::File { path, .. } => match file_system_of(path) {
                Ok(FileSystem::Disk) => Some(format!(
                    "{self}: {} is on a filesystem whose pages cannot be pinned (a disk or FS-DAX), so \
                     registering the pool with a GPU will fail; use tmpfs, hugetlbfs, dax: or numa:",
                    path.display()
                )),
                _ => None,
            },
            _ => None,
        }
    }

    /// The device's capacity: the size the spec gives, else an existing
    /// file's length or a devdax device's size from sysfs.
    pub fn capacity(&self) -> Result<DeviceCapacity> {
        self.capacity_in(Path::new("/sys"))
    }

    fn capacity_in(&self, sysfs: &Path) -> Result<DeviceCapacity> {
        let (bytes, fs) = match self {
            DeviceSpec::Anon { bytes } => (*bytes, FileSystem::Memory),
            DeviceSpec::Numa { nodes, bytes } => {
                for &node in nodes {
                    check_numa_node(sysfs, node)?;
                }
                (*bytes, FileSystem::Device)
            }
            DeviceSpec::File { path, bytes } => {
                let bytes = match bytes {
                    Some(b) => *b,
                    None => std::fs::metadata(path)
                        .map_err(io(format!("reading the size of {}", path.display())))?
                        .len(),
                };
                (bytes, file_system_of(path)?)
            }
            DeviceSpec::Dax { path, bytes } => match bytes {
                Some(b) => (*b, FileSystem::Device),
                None => (dax_size(sysfs, path)?, FileSystem::Device),
            },
        };
        let movable_bytes = match self {
            DeviceSpec::Numa { nodes, .. } => {
                nodes.iter().map(|&n| numa_movable_bytes(sysfs, n)).sum()
            }
            _ => 0,
        };
        Ok(DeviceCapacity {
            bytes,
            host_dram: fs == FileSystem::Memory,
            pinnable: fs != FileSystem::Disk,
            movable_bytes,
        })
    }
}

/// The capacity of a device string: a [`DeviceSpec`], or `numa:NODE[+NODE...]`
/// without a size, which offers the nodes' free memory.
pub fn device_capacity(spec: &str) -> Result<DeviceCapacity> {
    device_capacity_in(Path::new("/sys"), spec)
}

fn device_capacity_in(sysfs: &Path, spec: &str) -> Result<DeviceCapacity> {
    if let Some(nodes) = spec.strip_prefix("numa:").filter(|n| !n.contains(':')) {
        let (mut bytes, mut movable_bytes) = (0u64, 0u64);
        for node in parse_nodes(nodes)? {
            check_numa_node(sysfs, node)?;
            bytes = bytes.saturating_add(numa_free_bytes(sysfs, node)?);
            movable_bytes = movable_bytes.saturating_add(numa_movable_bytes(sysfs, node));
        }
        return Ok(DeviceCapacity {
            bytes,
            host_dram: false,
            pinnable: true,
            movable_bytes,
        });
    }
    spec.parse::<DeviceSpec>()?.capacity_in(sysfs)
}

/// `2` or `2+3`: distinct NUMA node numbers.
fn parse_nodes(s: &str) -> Result<Vec<u32>> {
    let mut nodes = Vec::new();
    for n in s.split('+') {
        let node: u32 = n
            .parse()
            .map_err(|_| invalid("device", format!("{n:?} is not a NUMA node number")))?;
        if nodes.contains(&node) {
            return Err(invalid(
                "device",
                format!("NUMA node {node} is named twice in {s:?}"),
            ));
        }
        nodes.push(node);
    }
    Ok(nodes)
}

fn node_list(nodes: &[u32]) -> String {
    nodes
        .iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join("+")
}

/// The free memory of NUMA node `node`, from its `meminfo` in sysfs.
pub(crate) fn numa_free_bytes(sysfs: &Path, node: u32) -> Result<u64> {
    // "Node 2 MemFree:   123456 kB"
    numa_meminfo(sysfs, node, "MemFree:")
}

/// A `numa:` device may not be larger than its nodes' memory: its pages
/// are taken as they are first touched, and a node without them left kills
/// the process that touches one, not the create.
pub(crate) fn check_numa_size(
    sysfs: &Path,
    spec: &DeviceSpec,
    nodes: &[u32],
    bytes: u64,
) -> Result<()> {
    let mut total = 0u64;
    for &node in nodes {
        match numa_meminfo(sysfs, node, "MemTotal:") {
            Ok(b) => total = total.saturating_add(b),
            Err(_) => return Ok(()), // nothing known: the kernel decides
        }
    }
    if bytes > total {
        return Err(invalid(
            "device",
            format!(
                "{spec}: NUMA node {} has {} of memory in all, less than the {} asked for",
                node_list(nodes),
                format_size_approx(total),
                format_size_approx(bytes)
            ),
        ));
    }
    Ok(())
}

/// A size in the largest binary unit it reaches, to one decimal.
fn format_size_approx(bytes: u64) -> String {
    for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if bytes >= 1 << shift {
            return format!("{:.1} {unit}", bytes as f64 / (1u64 << shift) as f64);
        }
    }
    format!("{bytes} B")
}

/// A `Node N <key> <n> kB` line of node `node`'s meminfo, in bytes.
fn numa_meminfo(sysfs: &Path, node: u32, key: &str) -> Result<u64> {
    let at = sysfs.join(format!("devices/system/node/node{node}/meminfo"));
    let text = std::fs::read_to_string(&at).map_err(io(format!("reading {}", at.display())))?;
    text.lines()
        .find_map(|line| {
            let (_, rest) = line.split_once(key)?;
            let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
            kib.checked_mul(1024)
        })
        .ok_or_else(|| Error::Pool(format!("{} has no {key} line", at.display())))
}

/// Bytes of NUMA node `node`'s online memory in ZONE_MOVABLE: its memory
/// blocks (`nodeN/memoryM` in sysfs) whose state is online and whose zone
/// (`valid_zones`, for an online block the zone it is in) is Movable, times
/// the block size. 0 where sysfs says nothing (no memory hotplug).
pub(crate) fn numa_movable_bytes(sysfs: &Path, node: u32) -> u64 {
    let block = std::fs::read_to_string(sysfs.join("devices/system/memory/block_size_bytes"))
        .ok()
        .and_then(|t| u64::from_str_radix(t.trim().trim_start_matches("0x"), 16).ok())
        .unwrap_or(0);
    let Ok(dir) = std::fs::read_dir(sysfs.join(format!("devices/system/node/node{node}"))) else {
        return 0;
    };
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).unwrap_or_default();
    let movable_blocks = dir
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("memory"))
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter(|e| {
            read(e.path().join("state")).trim() == "online"
                && read(e.path().join("valid_zones")).split_whitespace().next() == Some("Movable")
        })
        .count() as u64;
    movable_blocks.saturating_mul(block)
}

/// What holds a device's pages, as far as capacity and pinning go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FileSystem {
    /// The host's DRAM: anonymous memory, tmpfs, ramfs.
    Memory,
    /// Memory of its own: a NUMA node, a devdax device, hugetlbfs pages.
    Device,
    /// A file on any other filesystem (a disk, FS-DAX).
    Disk,
}

/// tmpfs, ramfs and hugetlbfs, as `statfs` names them.
pub(crate) const TMPFS_MAGIC: i64 = 0x0102_1994;
pub(crate) const RAMFS_MAGIC: i64 = 0x8584_58f6;
pub(crate) const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// `statfs` of `path`: the filesystem's type and its block size (a
/// hugetlbfs mount's page size).
pub(crate) fn statfs(path: &Path) -> Result<(i64, u64)> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| invalid("device", format!("{} holds a NUL byte", path.display())))?;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: a NUL-terminated path and a statfs buffer of the right type.
    if unsafe { libc::statfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        return Err(io(format!("statfs of {}", path.display()))(
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: statfs succeeded, so it filled the buffer.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)] // the fields' types differ between targets
    Ok((st.f_type as i64, st.f_bsize as u64))
}

/// The filesystem `path` (or, for a file not made yet, its directory) is on.
fn file_system_of(path: &Path) -> Result<FileSystem> {
    let probe = if path.exists() {
        path.to_path_buf()
    } else {
        match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        }
    };
    Ok(match statfs(&probe)?.0 {
        TMPFS_MAGIC | RAMFS_MAGIC => FileSystem::Memory,
        HUGETLBFS_MAGIC => FileSystem::Device,
        _ => FileSystem::Disk,
    })
}

/// Takes `flock(how)` on `file`, retrying until `deadline`: Ok(false) when
/// another holder kept it that long.
pub(crate) fn flock_until(
    file: &std::fs::File,
    how: i32,
    deadline: std::time::Instant,
) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: flock on a descriptor the caller owns.
        if unsafe { libc::flock(file.as_raw_fd(), how | libc::LOCK_NB) } == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        if !matches!(
            e.raw_os_error(),
            Some(libc::EWOULDBLOCK) | Some(libc::EINTR)
        ) {
            return Err(e);
        }
        if std::time::Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Parses `4096`, `64KiB`, `512MiB`, `8GiB`, `1TiB` (binary), `8GB` (decimal),
/// or `8G` (binary).
pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| {
        invalid(
            "size",
            format!("{s:?} does not start with a number; {SIZE_GRAMMAR}"),
        )
    })?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "ki" | "kib" => 1 << 10,
        "m" | "mi" | "mib" => 1 << 20,
        "g" | "gi" | "gib" => 1 << 30,
        "t" | "ti" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(invalid(
                "size",
                format!("{:?} is not a size unit; {SIZE_GRAMMAR}", unit.trim()),
            ));
        }
    };
    let bytes = n
        .checked_mul(mult)
        .ok_or_else(|| invalid("size", format!("{s:?} overflows 64 bits")))?;
    if bytes == 0 {
        return Err(invalid("size", "a device of 0 bytes holds nothing"));
    }
    Ok(bytes)
}

/// The sizes [`parse_size`] reads, for its messages and the docs.
pub const SIZE_GRAMMAR: &str = "a size is a whole number with an optional unit, in any case: B; K, Ki or KiB \
     (1024); M, Mi, MiB; G, Gi, GiB; T, Ti, TiB; or KB, MB, GB, TB (powers of 1000), e.g. 64GiB or 512m";

/// `bytes` for a person: the largest binary unit it reaches, with one
/// decimal where it is not whole (`38.2 MiB`, `64 GiB`, `656 B`).
pub fn human_size(bytes: u64) -> String {
    for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if bytes >= 1 << shift {
            let v = bytes as f64 / (1u64 << shift) as f64;
            return if bytes.is_multiple_of(1 << shift) {
                format!("{} {unit}", bytes >> shift)
            } else {
                format!("{v:.1} {unit}")
            };
        }
    }
    format!("{bytes} B")
}

/// `bytes` in the largest binary unit that divides it, exactly (the device
/// spec syntax, which parses back to the same number).
pub fn format_size(bytes: u64) -> String {
    for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    format!("{bytes}B")
}

/// A mapped device.
pub(crate) struct MappedDevice {
    map: MmapRaw,
    spec: DeviceSpec,
    /// The descriptor a shared device was mapped through (file:, dax:),
    /// kept for the clients' liveness locks.
    file: Option<std::fs::File>,
}

impl MappedDevice {
    pub(crate) fn map(spec: &DeviceSpec, mode: MapMode) -> Result<Self> {
        MappedDevice::map_with(spec, mode, DEFAULT_FILE_MODE, HostPages::Base)
    }

    /// [`MappedDevice::map`]; a file device created here gets permissions
    /// `file_mode`; anonymous and NUMA memory is backed by `pages`.
    pub(crate) fn map_with(
        spec: &DeviceSpec,
        mode: MapMode,
        file_mode: u32,
        pages: HostPages,
    ) -> Result<Self> {
        if mode == MapMode::Open && !spec.is_shared() {
            return Err(invalid(
                "device",
                format!(
                    "{spec} is memory private to the process that created its pool; share a pool through \
                     file: or dax: devices"
                ),
            ));
        }
        let mut file = None;
        let map = match spec {
            DeviceSpec::Anon { bytes } => map_anon(*bytes, pages)?,
            DeviceSpec::Numa { nodes, bytes } => {
                for &node in nodes {
                    check_numa_node(Path::new("/sys"), node)?;
                }
                check_numa_size(Path::new("/sys"), spec, nodes, *bytes)?;
                let map = map_anon(*bytes, pages)?;
                bind_to_nodes(&map, nodes)?;
                map
            }
            DeviceSpec::File { path, bytes } => {
                let (map, f) = map_file(path, *bytes, mode, file_mode)?;
                file = Some(f);
                map
            }
            DeviceSpec::Dax { path, bytes } => {
                // one descriptor, judged a DAX device on itself, then mapped
                let (f, _) = shared_fs::open_dax(path, "device").map_err(|e| match e {
                    Error::Io { source, .. } => opening_dax(path)(source),
                    e => e,
                })?;
                let size = dax_size(Path::new("/sys"), path)?;
                let len = match bytes {
                    Some(b) if *b > size => {
                        return Err(invalid(
                            "device",
                            format!("{spec}: the device has only {}", format_size(size)),
                        ));
                    }
                    Some(b) => *b,
                    None => size,
                };
                if len % (2 << 20) != 0 {
                    return Err(invalid(
                        "device",
                        format!("{spec}: devdax mappings are 2 MiB multiples"),
                    ));
                }
                let map = map_shared(&f, path, len)?;
                file = Some(f);
                map
            }
        };
        Ok(MappedDevice {
            map,
            spec: spec.clone(),
            file,
        })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Bytes of the mapping that huge pages back ([`huge_page_bytes_in`]).
    pub(crate) fn huge_page_bytes(&self) -> Result<u64> {
        huge_page_bytes_in(self.ptr() as usize, self.len())
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn spec(&self) -> &DeviceSpec {
        &self.spec
    }

    /// The descriptor of a shared device (None for private memory).
    pub(crate) fn file(&self) -> Option<&std::fs::File> {
        self.file.as_ref()
    }
}

/// An exclusive `flock` on a shared device's file, held while a process
/// decides whether to create or open the pool on it (released on drop).
/// Serialises the processes of one host; hosts sharing memory through a CXL
/// switch create their pool beforehand instead.
pub(crate) struct CreateLock {
    _file: std::fs::File,
    /// Whether this lock's open made the file (O_EXCL): the only file of
    /// the pool a failed create may remove.
    pub(crate) created: bool,
}

/// How long a create waits for another process's create lock on the same
/// device before saying so (a create formats the pool's tables and
/// allocates its files: seconds for a large pool).
pub(crate) const CREATE_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

impl CreateLock {
    pub(crate) fn acquire(spec: &DeviceSpec, file_mode: u32) -> Result<CreateLock> {
        CreateLock::acquire_within(spec, file_mode, CREATE_LOCK_WAIT)
    }

    /// [`CreateLock::acquire`], waiting at most `wait` for another holder.
    /// The file is checked (a regular file of this user or group) before it
    /// is locked, and after the lock is taken the path must still name the
    /// file locked (a failed create of another process may have removed
    /// it): otherwise the lock is taken again on what the path names now.
    pub(crate) fn acquire_within(
        spec: &DeviceSpec,
        file_mode: u32,
        wait: std::time::Duration,
    ) -> Result<CreateLock> {
        use std::os::unix::fs::MetadataExt;
        let (path, is_file) = match spec {
            DeviceSpec::File { path, .. } => (path, true),
            DeviceSpec::Dax { path, .. } => (path, false),
            _ => {
                return Err(invalid(
                    "device",
                    format!("{spec} is private to one process; there is nothing to lock"),
                ));
            }
        };
        let deadline = std::time::Instant::now() + wait;
        loop {
            let (file, meta, created) = if is_file {
                shared_fs::open_or_create(path, file_mode, &CREATE_LOCK_FILE, "device").map_err(
                    |e| match e {
                        Error::Io { source, .. } => opening_file(path)(source),
                        e => e,
                    },
                )?
            } else {
                let (f, m) = shared_fs::open_dax(path, "device").map_err(|e| match e {
                    Error::Io { source, .. } => opening_dax(path)(source),
                    e => e,
                })?;
                (f, m, false)
            };
            let locked =
                flock_until(&file, libc::LOCK_EX, deadline).map_err(|source| Error::Io {
                    context: format!("locking {}", path.display()),
                    source,
                })?;
            if !locked {
                return Err(Error::Pool(format!(
                    "another process has held the create lock on {} for {} s (a pool being created \
                     there, or a process stuck while holding it); try again, or find it with `fuser {}`",
                    path.display(),
                    wait.as_secs(),
                    path.display()
                )));
            }
            if is_file {
                match std::fs::symlink_metadata(path) {
                    Ok(now) if now.dev() == meta.dev() && now.ino() == meta.ino() => {}
                    // the file locked was removed (or replaced) meanwhile
                    _ => continue,
                }
            }
            return Ok(CreateLock {
                _file: file,
                created,
            });
        }
    }
}

/// What a pool's file must be to be opened (see [`crate::shared_fs`]): a
/// regular file of this process's user, or of a group of its where the mode
/// gives that group read and write; not open to other users (a pool holds
/// every request's KV); no other hard link to it.
pub(crate) const POOL_FILE: FileRule = FileRule {
    owner: Owner::MeOrSharingGroup,
    forbidden_mode: 0o007,
    devices: Devices::None,
    single_link: true,
};

/// What a pool's file must be to take its create lock: as [`POOL_FILE`],
/// whatever its mode (the create or the open that follows judges that).
const CREATE_LOCK_FILE: FileRule = FileRule {
    forbidden_mode: 0,
    ..POOL_FILE
};

/// What a file a create formats must be: this user's own (whatever its
/// mode now: the create sets it), with no other hard link.
const NEW_POOL_FILE: FileRule = FileRule {
    owner: Owner::Me,
    forbidden_mode: 0,
    devices: Devices::None,
    single_link: true,
};

/// Opens the pool file `path` through [`crate::shared_fs`] (never a link,
/// never a wait on a FIFO; type, owner and mode judged on the descriptor),
/// with this module's words for what went wrong.
fn open_pool_file(
    path: &Path,
    access: shared_fs::Access,
    rule: &FileRule,
) -> Result<(std::fs::File, std::fs::Metadata)> {
    shared_fs::open_file(path, access, rule, "device").map_err(|e| match e {
        Error::Io { source, .. } => opening_file(path)(source),
        e => e,
    })
}

/// The first 8 bytes of a shared device (its magic), or None for a file too
/// short to hold one.
pub(crate) fn peek_magic(spec: &DeviceSpec) -> Result<Option<[u8; 8]>> {
    let len = match spec {
        DeviceSpec::File { path, .. } => std::fs::metadata(path)
            .map_err(io(format!("opening {}", path.display())))?
            .len(),
        _ => u64::MAX,
    };
    if len < 8 {
        return Ok(None);
    }
    let probe = match spec {
        DeviceSpec::File { path, .. } => DeviceSpec::File {
            path: path.clone(),
            bytes: Some(8),
        },
        // devdax maps in 2 MiB units
        DeviceSpec::Dax { path, .. } => DeviceSpec::Dax {
            path: path.clone(),
            bytes: Some(2 << 20),
        },
        other => {
            return Err(invalid(
                "device",
                format!("{other} is private to one process"),
            ));
        }
    };
    let m = MappedDevice::map(&probe, MapMode::Open)?;
    // SAFETY: the mapping holds at least 8 bytes.
    Ok(Some(unsafe {
        std::ptr::read_volatile(m.ptr() as *const [u8; 8])
    }))
}

/// Whether the shared device `spec` holds a destroyed pool (what
/// [`crate::Pool::destroy`] leaves).
pub fn is_destroyed(spec: &DeviceSpec) -> Result<bool> {
    Ok(peek_magic(spec)? == Some(DESTROYED_MAGIC))
}

/// The error for a pool file that cannot be opened: permission denied says
/// how a group shares a pool (a link is refused, and said, by shared_fs).
fn opening_file(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            invalid(
                "device",
                format!(
                    "{}: permission denied. A pool's files are their creator's alone (mode 0600) unless it was \
                     created for a group (kvtier pool create --mode 0660): its owner can `chgrp GROUP` the files \
                     to a group you are in and `chmod g+rw` them, or run this as the owner",
                    path.display()
                ),
            )
        } else {
            io(format!("opening {}", path.display()))(e)
        }
    }
}

/// The error for a dax device that cannot be opened; a missing one says how
/// to find and make one.
fn opening_dax(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            invalid(
                "device",
                format!(
                    "{} does not exist: `kvtier info` lists this machine's DAX devices, and `daxctl \
                     create-device` (ndctl) makes one from a CXL memory region",
                    path.display()
                ),
            )
        } else if e.kind() == std::io::ErrorKind::PermissionDenied {
            invalid(
                "device",
                format!(
                    "{}: permission denied. A DAX device is root's unless a udev rule gives a group read and \
                     write on it (e.g. GROUP=\"kvtier\", MODE=\"0660\" for SUBSYSTEM==\"dax\"): run as root, or \
                     add such a rule and a group you are in",
                    path.display()
                ),
            )
        } else {
            io(format!("opening {}", path.display()))(e)
        }
    }
}

fn io(context: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { context, source }
}

/// Which pages back a pool's anonymous and NUMA memory (a file's are its
/// filesystem's: 2 MiB or 1 GiB on hugetlbfs, a devdax device's its
/// alignment). The GPU translates every host address it reads through them;
/// whether 2 MiB pages make a gather of rows spread over many gigabytes
/// faster is what the gather bench's `--host-pages` measures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostPages {
    /// The kernel's choice: 4 KiB pages unless the system makes every
    /// anonymous mapping transparent huge pages.
    #[default]
    Base,
    /// Transparent huge pages asked for (`madvise(MADV_HUGEPAGE)`, before
    /// the memory is touched): 2 MiB pages where the kernel can find them,
    /// 4 KiB where not (`Pool::huge_page_bytes` says how much it got).
    Transparent,
}

fn map_anon(bytes: u64, pages: HostPages) -> Result<MmapRaw> {
    let len =
        usize::try_from(bytes).map_err(|_| invalid("device", "larger than the address space"))?;
    let m = MmapOptions::new().len(len).map_anon().map_err(io(format!(
        "mapping {} of anonymous memory",
        format_size(bytes)
    )))?;
    let m = MmapRaw::from(m);
    if pages == HostPages::Transparent {
        // SAFETY: advice on our own fresh mapping, nothing touched yet.
        if unsafe {
            libc::madvise(
                m.as_mut_ptr() as *mut libc::c_void,
                m.len(),
                libc::MADV_HUGEPAGE,
            )
        } != 0
        {
            return Err(io(format!(
                "asking for transparent huge pages for {} (madvise; a kernel without them \
                 refuses: use HostPages::Base)",
                format_size(bytes)
            ))(std::io::Error::last_os_error()));
        }
    }
    Ok(m)
}

/// Bytes of `[start, start + len)` that 2 MiB (or larger) pages back, from
/// /proc/self/smaps: of each mapping (VMA) that overlaps the range, every
/// resident byte where its own pages are huge (hugetlbfs), else its
/// transparent huge pages (anonymous, shmem or file-backed ones). The kernel
/// may merge the range's VMA with a neighbour of the same flags, or split
/// it: a VMA that reaches past the range counts at most its overlap.
pub(crate) fn huge_page_bytes_in(start: usize, len: usize) -> Result<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")
        .map_err(io("reading /proc/self/smaps".into()))?;
    let end = start.saturating_add(len);
    // (overlap with the range, resident kB, huge-page kB, page size kB) per VMA
    let mut vmas: Vec<(u64, u64, u64, u64)> = Vec::new();
    let mut current: Option<usize> = None;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-')
            && let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        {
            current = None;
            if lo < end && hi > start {
                vmas.push(((hi.min(end) - lo.max(start)) as u64, 0, 0, 4));
                current = Some(vmas.len() - 1);
            }
            continue;
        }
        let Some(v) = current else { continue };
        let kb = words
            .next()
            .and_then(|w| w.parse::<u64>().ok())
            .unwrap_or(0);
        match first {
            "Rss:" => vmas[v].1 = kb,
            "KernelPageSize:" => vmas[v].3 = kb,
            "AnonHugePages:" | "ShmemPmdMapped:" | "FilePmdMapped:" => vmas[v].2 += kb,
            _ => {}
        }
    }
    if vmas.is_empty() {
        return Err(Error::Pool(format!(
            "no mapping at {start:#x} in /proc/self/smaps"
        )));
    }
    Ok(vmas
        .iter()
        .map(|&(overlap, rss, thp, page_kb)| {
            (1024 * if page_kb >= 2048 { rss } else { thp }).min(overlap)
        })
        .sum())
}

/// Permissions of the pool files kvtier creates: the creating user's alone
/// (a pool holds every request's KV). Shared groups ask for more
/// (`kvtier pool create --mode 0660`).
pub const DEFAULT_FILE_MODE: u32 = 0o600;

/// The first bytes [`crate::Pool::destroy`] leaves on a device: a file that
/// held a pool, which a new pool may reuse.
pub(crate) const DESTROYED_MAGIC: [u8; 8] = *b"KVTIERDX";

fn map_file(
    path: &Path,
    bytes: Option<u64>,
    mode: MapMode,
    file_mode: u32,
) -> Result<(MmapRaw, std::fs::File)> {
    // One descriptor, opened through shared_fs (no link followed, no FIFO
    // waited on), checked with fstat and mapped: nothing can swap the file
    // in between.
    let (file, meta) = match mode {
        MapMode::Create => open_pool_file(
            path,
            shared_fs::Access::Create { mode: file_mode },
            &NEW_POOL_FILE,
        )?,
        MapMode::Open => open_pool_file(path, shared_fs::Access::ReadWrite, &POOL_FILE)?,
    };
    let len = meta.len();
    let bytes = match (mode, bytes) {
        (MapMode::Create, None) => {
            return Err(invalid(
                "device",
                format!("file:{} needs a size", path.display()),
            ));
        }
        (MapMode::Create, Some(b)) => {
            // Format only what is ours (NEW_POOL_FILE) and holds nothing: a
            // new or empty file, one whose first bytes are zero, or a
            // destroyed pool.
            if len > 0 {
                let mut head = [0u8; 8];
                let n = std::os::unix::fs::FileExt::read_at(&file, &mut head, 0)
                    .map_err(io(format!("reading {}", path.display())))?;
                let blank = head[..n].iter().all(|&x| x == 0);
                if head == *b"KVTIERPL" || head == *b"KVTIERDV" {
                    // refused before anything is written: a create must not
                    // change a pool it cannot make (not even its length)
                    return Err(Error::Pool(format!(
                        "file:{} already holds a kvtier pool; destroy it first (kvtier pool destroy)",
                        path.display()
                    )));
                }
                if !blank && head != DESTROYED_MAGIC {
                    return Err(invalid(
                        "device",
                        format!(
                            "{} holds {len} B that are not a kvtier pool; kvtier formats only new or empty files \
                             and destroyed pools (remove it, or name another file)",
                            path.display()
                        ),
                    ));
                }
            }
            // exactly the mode asked for, whatever the umask
            file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(file_mode))
                .map_err(io(format!("setting the mode of {}", path.display())))?;
            reserve(&file, path, &meta, b)?;
            b
        }
        (MapMode::Open, Some(b)) if b > len => {
            return Err(invalid(
                "device",
                format!(
                    "{} holds {}, less than the {} asked for",
                    path.display(),
                    human_size(len),
                    human_size(b)
                ),
            ));
        }
        (MapMode::Open, b) => b.unwrap_or(len),
    };
    let map = map_shared(&file, path, bytes)?;
    Ok((map, file))
}

/// Makes `file` (at `path`, its fstat `meta`) hold `bytes`, every one of
/// them allocated now: a sparse file on a filesystem too small for it would
/// map, and then kill with SIGBUS the first process to touch a page the
/// filesystem has no room for. Says so instead when the filesystem lacks the
/// room. A filesystem that cannot allocate ahead (ramfs) only grows the file.
pub(crate) fn reserve(
    file: &std::fs::File,
    path: &Path,
    meta: &std::fs::Metadata,
    bytes: u64,
) -> Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let no_room = |free: Option<u64>| {
        Error::Pool(format!(
            "{} needs {} for the pool; the filesystem holding it has {} free{}",
            path.display(),
            format_size_approx(bytes),
            free.map(format_size_approx)
                .unwrap_or_else(|| "too little".into()),
            " (a tmpfs's size is set when it is mounted: mount -o remount,size=...)"
        ))
    };
    // SAFETY: statvfs is plain data, filled by fstatvfs on a valid descriptor.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstatvfs(file.as_raw_fd(), &mut st) } == 0 && st.f_blocks > 0 {
        let free = (st.f_bavail as u64).saturating_mul(st.f_frsize as u64);
        let allocated = meta.blocks().saturating_mul(512);
        if bytes.saturating_sub(allocated) > free {
            return Err(no_room(Some(free)));
        }
    }
    let len =
        libc::off_t::try_from(bytes).map_err(|_| invalid("device", "larger than a file can be"))?;
    // SAFETY: fallocate on a descriptor this process owns (mode 0: allocate,
    // growing the file's size as needed).
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENOSPC) => Err(no_room(None)),
        Some(libc::EOPNOTSUPP) => {
            if meta.len() < bytes {
                file.set_len(bytes)
                    .map_err(io(format!("growing {}", path.display())))?;
            }
            Ok(())
        }
        _ => Err(Error::Io {
            context: format!(
                "allocating {} for {}",
                format_size_approx(bytes),
                path.display()
            ),
            source: e,
        }),
    }
}

/// Maps `len` bytes of `file` (at `path`) shared, read-write.
fn map_shared(file: &std::fs::File, path: &Path, len: u64) -> Result<MmapRaw> {
    let len =
        usize::try_from(len).map_err(|_| invalid("device", "larger than the address space"))?;
    MmapOptions::new()
        .len(len)
        .map_raw(file)
        .map_err(io(format!("mapping {}", path.display())))
}

/// The size of a devdax device, from `<sysfs>/bus/dax/devices/<name>/size`.
pub(crate) fn dax_size(sysfs: &Path, dev: &Path) -> Result<u64> {
    let name = dev
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| invalid("device", "no device name"))?;
    let at = sysfs.join("bus/dax/devices").join(name).join("size");
    let text = std::fs::read_to_string(&at).map_err(io(format!("reading {}", at.display())))?;
    text.trim().parse().map_err(|_| {
        Error::Pool(format!(
            "{} holds {:?}, not a size",
            at.display(),
            text.trim()
        ))
    })
}

/// The NUMA nodes under `<sysfs>/devices/system/node`, ascending.
pub fn numa_nodes(sysfs: &Path) -> Vec<u32> {
    let mut nodes: Vec<u32> = std::fs::read_dir(sysfs.join("devices/system/node"))
        .map(|d| {
            d.filter_map(|e| {
                e.ok()?
                    .file_name()
                    .to_str()?
                    .strip_prefix("node")?
                    .parse()
                    .ok()
            })
            .collect()
        })
        .unwrap_or_default();
    nodes.sort();
    nodes
}

/// Fails with a message listing the machine's nodes unless `node` exists.
pub(crate) fn check_numa_node(sysfs: &Path, node: u32) -> Result<()> {
    let dir = sysfs.join("devices/system/node");
    if dir.join(format!("node{node}")).is_dir() {
        return Ok(());
    }
    let nodes = numa_nodes(sysfs);
    Err(invalid(
        "device",
        format!("NUMA node {node} does not exist; this machine has nodes {nodes:?}"),
    ))
}

/// Binds the mapping's pages to one node (MPOL_BIND, strict), or
/// interleaves them over several (MPOL_INTERLEAVE: page i on node
/// i mod n, in node order), before any is touched.
fn bind_to_nodes(map: &MmapRaw, nodes: &[u32]) -> Result<()> {
    const MPOL_BIND: libc::c_long = 2;
    const MPOL_INTERLEAVE: libc::c_long = 3;
    const MPOL_MF_STRICT: libc::c_long = 1;
    let top = *nodes.iter().max().expect("a numa device names a node");
    let mut mask = vec![0u64; top as usize / 64 + 1];
    for &node in nodes {
        mask[node as usize / 64] |= 1 << (node % 64);
    }
    let mode = if nodes.len() == 1 {
        MPOL_BIND
    } else {
        MPOL_INTERLEAVE
    };
    // SAFETY: mbind on our own fresh mapping with a mask of mask.len() * 64 bits.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            map.as_mut_ptr(),
            map.len(),
            mode,
            mask.as_ptr(),
            (mask.len() * 64 + 1) as libc::c_ulong,
            MPOL_MF_STRICT,
        )
    };
    if rc != 0 {
        return Err(Error::Io {
            context: format!(
                "binding {} to NUMA node{} {} (mbind)",
                format_size(map.len() as u64),
                if nodes.len() == 1 { "" } else { "s" },
                node_list(nodes)
            ),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// The NUMA node that holds the page at `addr` (after it was touched).
// The kernel only looks the address up among the process's mappings (an
// unmapped one fails with EFAULT); nothing is dereferenced.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn node_of(addr: *const u8) -> Result<u32> {
    const MPOL_F_NODE: libc::c_ulong = 1;
    const MPOL_F_ADDR: libc::c_ulong = 2;
    let mut node: libc::c_int = -1;
    // SAFETY: get_mempolicy writes one int; addr is a mapped address.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    if rc != 0 {
        return Err(Error::Io {
            context: "get_mempolicy".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(node as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        assert_eq!(
            "anon:8GiB".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Anon { bytes: 8 << 30 }
        );
        assert_eq!(
            "file:/dev/shm/kv0:64GiB".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::file("/dev/shm/kv0", 64 << 30)
        );
        assert_eq!(
            "file:/dev/shm/kv0".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::File {
                path: "/dev/shm/kv0".into(),
                bytes: None
            }
        );
        assert_eq!(
            "numa:2:64GiB".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Numa {
                nodes: vec![2],
                bytes: 64 << 30
            }
        );
        assert_eq!(
            "dax:/dev/dax0.0".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Dax {
                path: "/dev/dax0.0".into(),
                bytes: None
            }
        );
        assert_eq!(
            "dax:/dev/dax1.2:4GiB".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Dax {
                path: "/dev/dax1.2".into(),
                bytes: Some(4 << 30)
            }
        );
        assert_eq!(
            "anon:2GB".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Anon {
                bytes: 2_000_000_000
            }
        );
        for bad in [
            "anon",
            "anon:",
            "anon:0",
            "anon:8XB",
            "file:",
            "file::8GiB",
            "tape:1GiB",
            "numa:x:1GiB",
            "numa:2",
            "dax:",
            "anon:99999999999TiB",
        ] {
            assert!(bad.parse::<DeviceSpec>().is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn specs_round_trip_through_display() {
        for s in [
            "anon:8GiB",
            "file:/tmp/a:b:1GiB",
            "file:/dev/shm/x",
            "numa:3:512MiB",
            "dax:/dev/dax0.0",
            "dax:/dev/dax0.0:2GiB",
        ] {
            assert_eq!(s.parse::<DeviceSpec>().unwrap().to_string(), s);
        }
        for s in ["4000B", "64KiB", "512MiB", "8GiB", "1TiB"] {
            assert_eq!(format_size(parse_size(s).unwrap()), s);
        }
    }

    /// One size grammar, in any case (an evaluator found `1GB` taken and
    /// `1gb`, `1k`, `1Gi` refused), and device strings whose size is wrong say
    /// so in the same words for every kind.
    #[test]
    fn sizes_have_one_grammar_and_bad_ones_say_why() {
        for (s, bytes) in [
            ("1gb", 1_000_000_000u64),
            ("1GB", 1_000_000_000),
            ("1k", 1 << 10),
            ("1Gi", 1 << 30),
            ("512m", 512 << 20),
            ("64GiB", 64 << 30),
            ("2 TiB", 2 << 40),
            ("4096", 4096),
            ("7b", 7),
        ] {
            assert_eq!(parse_size(s).unwrap(), bytes, "{s}");
        }
        for (s, says) in [
            ("-1GiB", "does not start with a number"),
            ("1GiB:extra", "not a size unit"),
            ("1Gx", "\"Gx\" is not a size unit"),
            ("0", "0 bytes"),
            ("99999999999TiB", "overflows"),
        ] {
            let e = parse_size(s).unwrap_err().to_string();
            assert!(e.contains(says), "{s}: {e}");
            if !says.contains("bytes") && !says.contains("overflows") {
                assert!(
                    e.contains("KiB (1024)"),
                    "the message gives the grammar: {e}"
                );
            }
        }
        let err = |s: &str| s.parse::<DeviceSpec>().unwrap_err().to_string();
        for kind in ["anon:", "file:/p:", "dax:/p:"] {
            let e = err(&format!("{kind}-1GiB"));
            assert!(
                e.contains("\"-1GiB\" does not start with a number"),
                "{kind}: {e}"
            );
        }
        assert!(err("file:/p:1GiB:extra").contains("\"extra\" follows the size"));
        assert!(err("dax:/p:1GiB:extra").contains("follows the size"));
        assert!(err("numa:0").contains("needs a size here"));
        assert!(err("numa:0").contains("numa:0:64GiB"));
        assert_eq!(
            "file:/tmp/a:b".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::File {
                path: "/tmp/a:b".into(),
                bytes: None
            },
            "a colon in a path is the path's"
        );
    }

    #[test]
    fn dax_size_comes_from_sysfs() {
        let root = std::env::temp_dir().join(format!("kvtier-sysfs-{}", std::process::id()));
        let dir = root.join("bus/dax/devices/dax3.1");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("size"), "68719476736\n").unwrap();
        assert_eq!(dax_size(&root, Path::new("/dev/dax3.1")).unwrap(), 64 << 30);
        let err = dax_size(&root, Path::new("/dev/dax9.9"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("dax9.9"), "{err}");
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn the_create_lock_waits_a_bounded_time_and_says_for_whom() {
        use std::os::fd::AsRawFd;
        let dir = std::env::temp_dir().join(format!("kvtier-lockwait-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let spec = DeviceSpec::file(dir.join("dev0"), 4 << 20);
        let first = CreateLock::acquire(&spec, DEFAULT_FILE_MODE).unwrap();
        assert!(first.created, "the first lock's open made the file");
        let t = std::time::Instant::now();
        let err = CreateLock::acquire_within(
            &spec,
            DEFAULT_FILE_MODE,
            std::time::Duration::from_millis(300),
        )
        .err()
        .expect("held by the first")
        .to_string();
        assert!(
            err.contains("has held the create lock") && err.contains("dev0"),
            "{err}"
        );
        assert!(
            t.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            t.elapsed()
        );
        drop(first);
        let second = CreateLock::acquire(&spec, DEFAULT_FILE_MODE).unwrap();
        assert!(!second.created, "the file was there");
        drop(second);
        // the file a waiter opened was removed before it got the lock: it
        // locks the file the path names afterwards, not the unlinked one
        let holder = std::fs::File::open(dir.join("dev0")).unwrap();
        // SAFETY: flock on a descriptor this test owns.
        assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX) }, 0);
        let s2 = spec.clone();
        let waiter = std::thread::spawn(move || {
            CreateLock::acquire(&s2, DEFAULT_FILE_MODE).map(|l| l.created)
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        std::fs::remove_file(dir.join("dev0")).unwrap();
        drop(holder);
        assert!(
            waiter.join().unwrap().unwrap(),
            "it made and locked a new file"
        );
        assert!(dir.join("dev0").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn movable_node_memory_is_found_and_warned_about() {
        let root = std::env::temp_dir().join(format!("kvtier-movable-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let mem = root.join("devices/system/memory");
        std::fs::create_dir_all(&mem).unwrap();
        std::fs::write(mem.join("block_size_bytes"), "8000000\n").unwrap(); // 128 MiB
        // node 1: CXL onlined movable (three blocks, one offline); node 2: normal
        for (node, blocks) in [
            (
                1,
                vec![
                    (10, "online", "Movable"),
                    (11, "online", "Movable"),
                    (12, "offline", "Normal Movable"),
                    (13, "online", "Movable"),
                ],
            ),
            (2, vec![(20, "online", "Normal"), (21, "online", "Normal")]),
        ] {
            let dir = root.join(format!("devices/system/node/node{node}"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(
                dir.join("meminfo"),
                format!("Node {node} MemFree:        1048576 kB\n"),
            )
            .unwrap();
            for (m, state, zones) in blocks {
                let b = mem.join(format!("memory{m}"));
                std::fs::create_dir_all(&b).unwrap();
                std::fs::write(b.join("state"), format!("{state}\n")).unwrap();
                std::fs::write(b.join("valid_zones"), format!("{zones}\n")).unwrap();
                std::os::unix::fs::symlink(&b, dir.join(format!("memory{m}"))).unwrap();
            }
        }
        assert_eq!(numa_movable_bytes(&root, 1), 3 << 27);
        assert_eq!(numa_movable_bytes(&root, 2), 0);
        assert_eq!(
            numa_movable_bytes(&root, 7),
            0,
            "no such node: nothing known"
        );
        let cap = |s: &str| device_capacity_in(&root, s).unwrap();
        assert_eq!(cap("numa:1").movable_bytes, 3 << 27);
        assert_eq!(cap("numa:1+2:1GiB").movable_bytes, 3 << 27);
        assert_eq!(cap("numa:2").movable_bytes, 0);
        let spec: DeviceSpec = "numa:1:1GiB".parse().unwrap();
        let w = spec.placement_warning_in(&root).expect("a warning");
        assert!(
            w.contains("384MiB") && w.contains("ZONE_MOVABLE") && w.contains("--no-movable"),
            "{w}"
        );
        let spec: DeviceSpec = "numa:2:1GiB".parse().unwrap();
        assert_eq!(spec.placement_warning_in(&root), None);
        assert_eq!(
            "anon:1GiB"
                .parse::<DeviceSpec>()
                .unwrap()
                .placement_warning_in(&root),
            None
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn capacity_comes_from_the_spec_the_file_sysfs_or_the_node() {
        let root = std::env::temp_dir().join(format!("kvtier-cap-{}", std::process::id()));
        let dax = root.join("bus/dax/devices/dax0.0");
        let node = root.join("devices/system/node/node1");
        std::fs::create_dir_all(&dax).unwrap();
        std::fs::create_dir_all(&node).unwrap();
        std::fs::write(dax.join("size"), "1099511627776\n").unwrap();
        std::fs::write(
            node.join("meminfo"),
            "Node 1 MemTotal:       134217728 kB\nNode 1 MemFree:        100663296 kB\n",
        )
        .unwrap();
        let cap = |s: &str| device_capacity_in(&root, s);
        let not_dram = |bytes| DeviceCapacity {
            bytes,
            host_dram: false,
            pinnable: true,
            movable_bytes: 0,
        };
        assert_eq!(cap("dax:/dev/dax0.0").unwrap(), not_dram(1 << 40));
        assert_eq!(cap("dax:/dev/dax0.0:64GiB").unwrap(), not_dram(64 << 30));
        assert_eq!(cap("numa:1").unwrap(), not_dram(96 << 30));
        let node2 = root.join("devices/system/node/node2");
        std::fs::create_dir_all(&node2).unwrap();
        std::fs::write(node2.join("meminfo"), "Node 2 MemFree:        1048576 kB\n").unwrap();
        assert_eq!(cap("numa:1+2").unwrap(), not_dram((96 << 30) + (1 << 30)));
        assert_eq!(cap("numa:1+2:8GiB").unwrap(), not_dram(8 << 30));
        assert_eq!(cap("numa:1:8GiB").unwrap(), not_dram(8 << 30));
        assert_eq!(
            cap("anon:1GiB").unwrap(),
            DeviceCapacity {
                bytes: 1 << 30,
                host_dram: true,
                pinnable: true,
                movable_bytes: 0,
            }
        );
        for bad in ["numa:3", "numa:x", "dax:/dev/dax7.0", "anon"] {
            assert!(cap(bad).is_err(), "{bad}");
        }
        // a file: its size, given or its length; on tmpfs it is DRAM
        let f = root.join("kv0");
        std::fs::write(&f, vec![0u8; 4096]).unwrap();
        let fs = file_system_of(&root).unwrap();
        assert_eq!(
            cap(&format!("file:{}", f.display())).unwrap(),
            DeviceCapacity {
                bytes: 4096,
                host_dram: fs == FileSystem::Memory,
                pinnable: fs != FileSystem::Disk,
                movable_bytes: 0,
            }
        );
        assert_eq!(
            cap(&format!("file:{}:1GiB", root.join("new").display()))
                .unwrap()
                .bytes,
            1 << 30
        );
        assert!(cap(&format!("file:{}", root.join("missing").display())).is_err());
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        if mounts.lines().any(|l| l.contains(" /dev/shm tmpfs ")) {
            assert!(
                cap("file:/dev/shm/kvtier-cap-probe:1GiB")
                    .unwrap()
                    .host_dram
            );
        }
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn numa_nodes_are_checked_against_sysfs() {
        let root = std::env::temp_dir().join(format!("kvtier-numa-{}", std::process::id()));
        for n in [0, 2] {
            std::fs::create_dir_all(root.join(format!("devices/system/node/node{n}"))).unwrap();
        }
        assert!(check_numa_node(&root, 2).is_ok());
        let err = check_numa_node(&root, 1).unwrap_err().to_string();
        assert!(
            err.contains("NUMA node 1 does not exist") && err.contains("[0, 2]"),
            "{err}"
        );
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn private_memory_cannot_be_opened_again() {
        for spec in ["anon:1MiB", "numa:0:1MiB"] {
            let err = MappedDevice::map(&spec.parse().unwrap(), MapMode::Open)
                .err()
                .unwrap()
                .to_string();
            assert!(err.contains("private"), "{err}");
        }
    }

    #[test]
    fn missing_devices_are_reported() {
        let err = MappedDevice::map(
            &"dax:/dev/dax-nonexistent".parse().unwrap(),
            MapMode::Create,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            err.contains("/dev/dax-nonexistent") && err.contains("kvtier info"),
            "{err}"
        );
        let err = MappedDevice::map(&"file:/nonexistent-dir/x".parse().unwrap(), MapMode::Open)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("/nonexistent-dir/x"), "{err}");
        let not_char = std::env::temp_dir().join(format!("kvtier-notdax-{}", std::process::id()));
        std::fs::write(&not_char, b"x").unwrap();
        let err = MappedDevice::map(
            &DeviceSpec::Dax {
                path: not_char.clone(),
                bytes: None,
            },
            MapMode::Create,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("is a regular file, not a DAX device"), "{err}");
        std::fs::remove_file(not_char).unwrap();
        // nor a character device that is not DAX (a pool "on" /dev/zero)
        let err = MappedDevice::map(
            &DeviceSpec::Dax {
                path: "/dev/zero".into(),
                bytes: Some(2 << 20),
            },
            MapMode::Create,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            err.contains("is a character device, not a DAX device"),
            "{err}"
        );
    }

    /// NUMA node 0 exists on every Linux machine: bind there and check where
    /// the pages went.
    #[test]
    fn numa_memory_lands_on_its_node() {
        let d = MappedDevice::map(&"numa:0:4MiB".parse().unwrap(), MapMode::Create).unwrap();
        // SAFETY: touching our own mapping.
        unsafe { d.ptr().write_bytes(1, d.len()) };
        assert_eq!(node_of(d.ptr()).unwrap(), 0);
        assert_eq!(node_of(unsafe { d.ptr().add(d.len() - 1) }).unwrap(), 0);
        let err = MappedDevice::map(&"numa:4095:4MiB".parse().unwrap(), MapMode::Create)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("NUMA node 4095 does not exist"), "{err}");
    }

    /// Pages of a multi-node device alternate between its nodes. Runs where
    /// the machine has two nodes or more (CI machines have one: there only
    /// the refusal of a missing second node runs).
    #[test]
    fn interleaved_numa_memory_alternates_between_its_nodes() {
        let nodes = numa_nodes(Path::new("/sys"));
        let err = MappedDevice::map(&"numa:0+4095:4MiB".parse().unwrap(), MapMode::Create)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("NUMA node 4095 does not exist"), "{err}");
        let [a, b, ..] = nodes[..] else {
            eprintln!("one NUMA node: interleaving not exercised");
            return;
        };
        let d = MappedDevice::map(
            &format!("numa:{a}+{b}:4MiB").parse().unwrap(),
            MapMode::Create,
        )
        .unwrap();
        // SAFETY: touching our own mapping.
        unsafe { d.ptr().write_bytes(1, d.len()) };
        let page = 4096;
        let on: Vec<u32> = (0..d.len() / page)
            .map(|i| node_of(unsafe { d.ptr().add(i * page) }).unwrap())
            .collect();
        assert!(on.iter().all(|n| *n == a || *n == b), "{on:?}");
        assert!(
            on.windows(2).all(|w| w[0] != w[1]),
            "pages alternate: {on:?}"
        );
    }

    #[test]
    fn human_sizes_read_as_a_person_writes_them() {
        assert_eq!(human_size(40_017_920), "38.2 MiB");
        assert_eq!(human_size(64 << 30), "64 GiB");
        assert_eq!(human_size(656), "656 B");
        assert_eq!(human_size(1536), "1.5 KiB");
    }

    #[test]
    fn multi_node_specs_parse_and_round_trip() {
        let s: DeviceSpec = "numa:2+3:128GiB".parse().unwrap();
        assert_eq!(
            s,
            DeviceSpec::Numa {
                nodes: vec![2, 3],
                bytes: 128 << 30
            }
        );
        assert_eq!(s.to_string(), "numa:2+3:128GiB");
        assert_eq!(s.identity(), "numa:2+3");
        for bad in [
            "numa:2+2:1GiB",
            "numa:2+:1GiB",
            "numa:+3:1GiB",
            "numa:2+x:1GiB",
        ] {
            assert!(bad.parse::<DeviceSpec>().is_err(), "{bad}");
        }
    }
}
