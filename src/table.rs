//! Tables: large read-only arrays read sparsely at every step (DeepSeek-V4.1's
//! Engram tables, other host-resident lookup tables), kept in shared memory
//! (a file on tmpfs or hugetlbfs, or a devdax device) so that they are
//! loaded once per host and attached by every instance and every restart.
//!
//! A table is identified by a *key* its loader gives: the model, the table,
//! its shape and dtype, and a fingerprint of the files it came from. The key
//! is written in the table's header, and attaching with another key is an
//! error, so stale bytes are never served under a new key.
//! [`TableStore`] names each key's file in a directory.
//!
//! # States, and why a half-written table is never served
//!
//! The file starts with a header (2 MiB, so the data start on a huge page):
//! the key, the data size, a fill bitmap (one bit per chunk of the data) and
//! a state word, FILLING or READY. A loader holds an exclusive `flock` on the
//! file for as long as it writes; it marks a chunk in the bitmap only after
//! the chunk's bytes are written, and sets READY (release ordering) only when
//! every chunk is marked. A reader takes a shared `flock` and accepts only
//! READY. So:
//!
//! - a loader killed at any point leaves FILLING (its lock goes with it), and
//!   the next loader resumes: it writes only the chunks not marked;
//! - a reader never attaches while a loader writes (the locks exclude each
//!   other), and never to FILLING;
//! - a table is not destroyed while a reader holds it (destroy needs the
//!   exclusive lock), and the holders are listed from `/proc/locks`.
//!
//! The locks are the kernel's, per host: several hosts sharing a CXL device
//! must agree among themselves on one loader.

use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};

use crate::error::{Error, Result, invalid};
use crate::shared_fs::{self, Devices, FileRule, Owner, open_file};

/// First bytes of a table file.
pub const TABLE_MAGIC: [u8; 8] = *b"KVTIERTB";
/// The format this build reads and writes.
pub const TABLE_VERSION: u32 = 1;
/// The longest key.
pub const MAX_KEY_BYTES: usize = 1024;
/// The data start here (a 2 MiB huge page).
pub const TABLE_DATA_OFFSET: u64 = 2 << 20;
/// The smallest chunk the fill bitmap counts.
pub const MIN_CHUNK_BYTES: u64 = 2 << 20;

const STATE_OFFSET: usize = 4096;
const BITMAP_OFFSET: usize = 8192;
/// Bits the bitmap has room for (the header's 2 MiB less its first 8 KiB).
const MAX_CHUNKS: u64 = ((TABLE_DATA_OFFSET as usize - BITMAP_OFFSET) * 8) as u64;

const FILLING: u64 = 0;
const READY: u64 = 1;

/// The header's fixed fields, written once by the loader that makes the
/// table (the magic last), read-only after.
#[repr(C)]
#[derive(Clone, Copy)]
struct Header {
    magic: [u8; 8],
    version: u32,
    key_len: u32,
    data_bytes: u64,
    data_offset: u64,
    chunk_bytes: u64,
    chunks: u64,
    checksum: u64,
    key: [u8; MAX_KEY_BYTES],
}

impl Header {
    fn new(key: &str, data_bytes: u64) -> Header {
        let chunk_bytes = MIN_CHUNK_BYTES.max(data_bytes.div_ceil(MAX_CHUNKS).next_power_of_two());
        let mut h = Header {
            magic: [0; 8],
            version: TABLE_VERSION,
            key_len: key.len() as u32,
            data_bytes,
            data_offset: TABLE_DATA_OFFSET,
            chunk_bytes,
            chunks: data_bytes.div_ceil(chunk_bytes),
            checksum: 0,
            key: [0; MAX_KEY_BYTES],
        };
        h.key[..key.len()].copy_from_slice(key.as_bytes());
        h.checksum = h.sum();
        h
    }

    /// FNV-1a over every field but the magic and the checksum.
    fn sum(&self) -> u64 {
        fnv1a(&[
            &self.version.to_le_bytes(),
            &self.key_len.to_le_bytes(),
            &self.data_bytes.to_le_bytes(),
            &self.data_offset.to_le_bytes(),
            &self.chunk_bytes.to_le_bytes(),
            &self.chunks.to_le_bytes(),
            &self.key,
        ])
    }

    fn key(&self) -> &[u8] {
        &self.key[..(self.key_len as usize).min(MAX_KEY_BYTES)]
    }

    /// Checks a header read from `path`: what is wrong, in words.
    fn check(&self, path: &Path, file_len: u64) -> Result<()> {
        let bad = |what: String| {
            Error::Pool(format!(
                "{} is not a usable kvtier table: {what}",
                path.display()
            ))
        };
        if self.magic != TABLE_MAGIC {
            return Err(bad("no table header (it may still be being made)".into()));
        }
        if self.version != TABLE_VERSION {
            return Err(bad(format!(
                "format version {}, this build reads {TABLE_VERSION}",
                self.version
            )));
        }
        if self.checksum != self.sum() {
            return Err(bad("its header is corrupted (checksum)".into()));
        }
        let end = self.data_offset.checked_add(self.data_bytes);
        if self.key_len as usize > MAX_KEY_BYTES
            || self.data_offset != TABLE_DATA_OFFSET
            || self.chunk_bytes < MIN_CHUNK_BYTES
            || self.chunks != self.data_bytes.div_ceil(self.chunk_bytes)
            || self.chunks > MAX_CHUNKS
            || end.is_none_or(|e| e > file_len)
        {
            return Err(bad(format!(
                "its header describes {} B of data in a file of {file_len} B",
                self.data_bytes
            )));
        }
        Ok(())
    }
}

/// 64-bit FNV-1a over `parts` in order: the header's checksum, a key's
/// file name.
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    parts
        .iter()
        .flat_map(|p| p.iter())
        .fold(0xcbf2_9ce4_8422_2325, |x, &b| {
            (x ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
        })
}

/// Where a table's pages come from, as far as lookups go (one TLB entry per
/// page).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backing {
    /// hugetlbfs, with pages of this size.
    HugeTlb { page_bytes: u64 },
    /// tmpfs or ramfs: 4 KiB pages unless transparent huge pages back shmem
    /// (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`, or the mount's
    /// `huge=` option); `shmem_enabled` as read.
    Shmem { shmem_enabled: String },
    /// A devdax device (its own alignment, 2 MiB or 1 GiB).
    DevDax,
    /// Another filesystem (a disk, FS-DAX).
    Other,
}

impl std::fmt::Display for Backing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backing::HugeTlb { page_bytes } => write!(
                f,
                "hugetlbfs, {} pages",
                crate::pool::human_size(*page_bytes)
            ),
            Backing::Shmem { shmem_enabled } => write!(
                f,
                "tmpfs (shmem transparent huge pages: {shmem_enabled}; 4 KiB pages, one TLB miss per row, \
                 unless that is always/within_size/advise or the mount has huge=; hugetlbfs or devdax \
                 give 2 MiB or 1 GiB pages for sure)"
            ),
            Backing::DevDax => write!(f, "devdax"),
            Backing::Other => write!(f, "a file on neither tmpfs nor hugetlbfs"),
        }
    }
}

fn backing_of(path: &Path, meta: &std::fs::Metadata) -> Backing {
    use crate::pool::device::{HUGETLBFS_MAGIC, RAMFS_MAGIC, TMPFS_MAGIC, statfs};
    if meta.file_type().is_char_device() {
        return Backing::DevDax;
    }
    match statfs(path) {
        Ok((HUGETLBFS_MAGIC, page_bytes)) => Backing::HugeTlb { page_bytes },
        Ok((TMPFS_MAGIC | RAMFS_MAGIC, _)) => Backing::Shmem {
            shmem_enabled: std::fs::read_to_string(
                "/sys/kernel/mm/transparent_hugepage/shmem_enabled",
            )
            .ok()
            .and_then(|s| {
                s.split_whitespace()
                    .find(|w| w.starts_with('['))
                    .map(|w| w.trim_matches(['[', ']']).to_string())
            })
            .unwrap_or_else(|| "unknown".into()),
        },
        _ => Backing::Other,
    }
}

/// An open, mapped table file and the lock this process holds on it.
struct Mapped {
    path: PathBuf,
    file: std::fs::File,
    map: MmapRaw,
}

impl Mapped {
    fn header(&self) -> Header {
        // SAFETY: the mapping is at least a header long (checked by the
        // opener); a plain copy of plain data.
        unsafe { std::ptr::read_unaligned(self.map.as_ptr() as *const Header) }
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: offsets inside the header area (checked by the opener),
        // 8-byte aligned in a page-aligned mapping; shared words are only
        // ever accessed atomically.
        unsafe { &*(self.map.as_ptr().add(offset) as *const AtomicU64) }
    }

    fn state(&self) -> u64 {
        state_of(&self.map)
    }

    fn chunk_done(&self, c: u64) -> bool {
        let w = self.word(BITMAP_OFFSET + (c / 64) as usize * 8);
        w.load(Ordering::Acquire) & (1 << (c % 64)) != 0
    }

    fn chunks_done(&self, h: &Header) -> u64 {
        (0..h.chunks).filter(|&c| self.chunk_done(c)).count() as u64
    }
}

/// How long a loader or reader waits for another's lock before saying so.
pub const LOCK_WAIT: Duration = Duration::from_secs(30);

fn lock(file: &std::fs::File, path: &Path, how: i32, wait: Duration) -> Result<()> {
    let locked =
        crate::pool::device::flock_until(file, how, Instant::now() + wait).map_err(|source| {
            Error::Io {
                context: format!("locking {}", path.display()),
                source,
            }
        })?;
    if locked {
        return Ok(());
    }
    let holders = holders(path)
        .map(|h| {
            h.iter()
                .map(|l| {
                    format!(
                        "pid {} ({})",
                        l.pid,
                        if l.exclusive { "loading" } else { "reading" }
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default();
    Err(Error::Pool(format!(
        "{} is held by {} ({} s waited): {}",
        path.display(),
        if how == libc::LOCK_EX {
            "readers or a loader"
        } else {
            "its loader"
        },
        wait.as_secs(),
        if holders.is_empty() {
            "see `fuser` for who".to_string()
        } else {
            holders
        }
    )))
}

/// A process holding a table's lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub pid: u32,
    /// The loader's exclusive lock (else a reader's shared one).
    pub exclusive: bool,
}

/// The processes holding `path`'s `flock`s, from `/proc/locks` (this host,
/// pids as this PID namespace sees them).
pub fn holders(path: &Path) -> Result<Vec<Holder>> {
    let meta = std::fs::metadata(path).map_err(|source| Error::Io {
        context: format!("reading {}", path.display()),
        source,
    })?;
    let (major, minor) = (libc::major(meta.dev()), libc::minor(meta.dev()));
    let want = format!("{major:02x}:{minor:02x}:{}", meta.ino());
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    Ok(parse_locks(&locks, &want))
}

/// `/proc/locks` lines of FLOCKs on the file `dev_ino` ("08:01:1234").
fn parse_locks(locks: &str, dev_ino: &str) -> Vec<Holder> {
    let mut out = Vec::new();
    for line in locks.lines() {
        // "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; a process
        // waiting for the lock has "->" after the number: not a holder
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.get(1) == Some(&"->") {
            continue;
        }
        if f.len() >= 6
            && f[1] == "FLOCK"
            && f[5].eq_ignore_ascii_case(dev_ino)
            && let Ok(pid) = f[4].parse()
        {
            out.push(Holder {
                pid,
                exclusive: f[3] == "WRITE",
            });
        }
    }
    out
}

/// How a table file is opened: a loader (or destroy) writes, and makes a
/// missing file; a reader only reads.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    Load,
    Write,
    Read,
}

/// What a table's file must be (see [`crate::shared_fs`]): a regular file
/// its user owns (or this process's effective group, where the mode shares
/// it with that group), that other users cannot write, with no other hard
/// link; or a DAX
/// device. A table is a model's weights, readable by others if its owner
/// says so, but written only by its owner (or its group).
const TABLE_FILE: FileRule = FileRule {
    owner: Owner::MeOrMyGroup,
    forbidden_mode: 0o002,
    devices: Devices::Dax,
    single_link: true,
};

/// How many times an open starts again when the path came to name another
/// file while this process waited for its lock (a destroy, a new load).
const REOPENS: u32 = 8;

/// Opens the table file at `path` by [`TABLE_FILE`] (never following a
/// link, never waiting on a FIFO); `Load` makes a missing file (mode 0600)
/// and says whether it did.
fn open(path: &Path, access: Access) -> Result<(std::fs::File, std::fs::Metadata, bool)> {
    let opened = match access {
        Access::Read => open_file(path, shared_fs::Access::Read, &TABLE_FILE, "table")
            .map(|(f, m)| (f, m, false)),
        Access::Write => open_file(path, shared_fs::Access::ReadWrite, &TABLE_FILE, "table")
            .map(|(f, m)| (f, m, false)),
        Access::Load => shared_fs::open_or_create(path, 0o600, &TABLE_FILE, "table"),
    };
    opened.map_err(|e| match e {
        Error::Io { source, .. } => Error::Io {
            context: format!("opening the table {}", path.display()),
            source,
        },
        e => e,
    })
}

fn changing(path: &Path) -> Error {
    Error::Pool(format!(
        "{} kept being removed and made again while this process opened it; try again",
        path.display()
    ))
}

/// Whether `path` still names the file `meta` describes (a destroy may have
/// removed it, and a loader made another, while this process waited for
/// its lock).
pub(crate) fn still_named(path: &Path, meta: &std::fs::Metadata) -> bool {
    std::fs::symlink_metadata(path)
        .is_ok_and(|now| now.dev() == meta.dev() && now.ino() == meta.ino())
}

/// Removes `path` when it still names the file `meta` describes (the
/// destroyer holds that file's lock); an error saying to look again when it
/// names another.
pub(crate) fn remove_still_named(path: &Path, meta: &std::fs::Metadata) -> Result<()> {
    if !still_named(path, meta) {
        return Err(Error::Pool(format!(
            "{} changed while it was being destroyed; look again",
            path.display()
        )));
    }
    std::fs::remove_file(path).map_err(|source| Error::Io {
        context: format!("removing {}", path.display()),
        source,
    })
}

/// Takes `how` on `file` (waiting until `deadline`); false when the path
/// no longer names the file by then.
fn lock_named(
    file: &std::fs::File,
    meta: &std::fs::Metadata,
    path: &Path,
    how: i32,
    deadline: Instant,
) -> Result<bool> {
    lock(
        file,
        path,
        how,
        deadline.saturating_duration_since(Instant::now()),
    )?;
    Ok(still_named(path, meta))
}

/// The first 8 bytes of a table file (of a devdax device, through a
/// mapping: a character device has no read()); zeros for a shorter file.
fn magic_of(file: &std::fs::File, path: &Path, backing: &Backing) -> Result<[u8; 8]> {
    if *backing == Backing::DevDax {
        let probe = map(file, path, TABLE_DATA_OFFSET, page_of(backing, path), false)?;
        // SAFETY: the mapping is at least 2 MiB.
        return Ok(unsafe { *(probe.as_ptr() as *const [u8; 8]) });
    }
    let mut head = [0u8; 8];
    let n =
        std::os::unix::fs::FileExt::read_at(file, &mut head, 0).map_err(|source| Error::Io {
            context: format!("reading {}", path.display()),
            source,
        })?;
    Ok(if n < 8 { [0; 8] } else { head })
}

/// The largest table (64 PiB): its sizes, rounded to any page, stay far
/// from the limits of a file offset.
pub const MAX_TABLE_BYTES: u64 = 1 << 56;

/// The length mappings of a table are multiples of: hugetlbfs's page (a
/// mapping of another length cannot be unmapped) and a devdax device's
/// alignment (it refuses others); 2 MiB elsewhere.
fn page_of(backing: &Backing, path: &Path) -> u64 {
    match backing {
        Backing::HugeTlb { page_bytes } => (*page_bytes).max(MIN_CHUNK_BYTES),
        Backing::DevDax => path
            .file_name()
            .and_then(|n| {
                std::fs::read_to_string(Path::new("/sys/bus/dax/devices").join(n).join("align"))
                    .ok()
            })
            .and_then(|a| a.trim().parse::<u64>().ok())
            .filter(|a| a.is_power_of_two())
            .unwrap_or(MIN_CHUNK_BYTES)
            .max(MIN_CHUNK_BYTES),
        _ => MIN_CHUNK_BYTES,
    }
}

/// The bytes the file (or devdax device) holds, read now.
fn length_of(file: &std::fs::File, path: &Path, backing: &Backing) -> Result<u64> {
    if *backing == Backing::DevDax {
        return Ok(crate::pool::device_capacity(&format!("dax:{}", path.display()))?.bytes);
    }
    file.metadata()
        .map(|m| m.len())
        .map_err(|source| Error::Io {
            context: format!("reading {}", path.display()),
            source,
        })
}

/// Maps the first `len` bytes of `file`, the length rounded up to `page`;
/// read-only unless `writable`.
fn map(file: &std::fs::File, path: &Path, len: u64, page: u64, writable: bool) -> Result<MmapRaw> {
    let len = usize::try_from(len.next_multiple_of(page))
        .map_err(|_| invalid("table", "larger than the address space"))?;
    let mut opts = MmapOptions::new();
    opts.len(len);
    let map = if writable {
        opts.map_raw(file)
    } else {
        opts.map_raw_read_only(file)
    }
    .map_err(|source| Error::Io {
        context: format!("mapping {}", path.display()),
        source,
    })?;
    // Where shmem takes transparent huge pages on advice, ask for them (a
    // row lookup then costs no TLB miss of its own); harmless elsewhere.
    // SAFETY: advice on a mapping this function made.
    unsafe { libc::madvise(map.as_ptr() as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
    Ok(map)
}

fn check_key(key: &str) -> Result<()> {
    if key.is_empty() || key.len() > MAX_KEY_BYTES {
        return Err(invalid(
            "key",
            format!(
                "a table key is 1 to {MAX_KEY_BYTES} bytes, not {}",
                key.len()
            ),
        ));
    }
    Ok(())
}

/// Opens (making it if missing) the table `key` of `data_bytes` at `path`
/// for loading: the exclusive lock is taken (waiting at most `wait` for a
/// loader or readers), the header written if the file has none, and the
/// chunks still to write are known. A READY table is returned as such:
/// nothing to load.
pub fn load(path: &Path, key: &str, data_bytes: u64, wait: Duration) -> Result<Load> {
    check_key(key)?;
    if data_bytes == 0 || data_bytes > MAX_TABLE_BYTES {
        return Err(invalid(
            "table",
            format!("a table holds 1 to {MAX_TABLE_BYTES} bytes, not {data_bytes}"),
        ));
    }
    let deadline = Instant::now() + wait;
    for _ in 0..REOPENS {
        let (file, meta, created) = open(path, Access::Load)?;
        // A READY table needs no exclusive lock (readers may hold it): look
        // first under a shared one.
        if !lock_named(&file, &meta, path, libc::LOCK_SH, deadline)? {
            continue; // destroyed while this process waited: what is there now
        }
        let backing = backing_of(path, &meta);
        if let Ok((m, h)) = header_of(&file, path, &backing)
            && state_of(&m) == READY
            && h.key() == key.as_bytes()
            && h.data_bytes == data_bytes
        {
            return Ok(Load::Ready);
        }
        // SAFETY: flock on a descriptor this function owns.
        unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
        if !lock_named(&file, &meta, path, libc::LOCK_EX, deadline)? {
            continue;
        }
        return fill(path, key, data_bytes, file, meta, backing, created);
    }
    Err(changing(path))
}

/// A file this call made, removed again if the call fails before it has
/// made a table of it (a failed load leaves nothing behind).
struct Made<'a> {
    path: &'a Path,
    meta: Option<std::fs::Metadata>,
}

impl Drop for Made<'_> {
    fn drop(&mut self) {
        if let Some(meta) = &self.meta
            && still_named(self.path, meta)
        {
            let _ = std::fs::remove_file(self.path);
        }
    }
}

/// [`load`] under the exclusive lock on `file`, which `path` names.
fn fill(
    path: &Path,
    key: &str,
    data_bytes: u64,
    file: std::fs::File,
    meta: std::fs::Metadata,
    backing: Backing,
    created: bool,
) -> Result<Load> {
    let page = page_of(&backing, path);
    let want_len = TABLE_DATA_OFFSET
        .checked_add(data_bytes)
        .and_then(|n| n.checked_next_multiple_of(page))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(|| invalid("table", format!("{data_bytes} B is more than a file holds")))?;
    // What the file holds now (after the lock: another loader may have made it).
    let len = length_of(&file, path, &backing)?;
    let head = magic_of(&file, path, &backing)?;
    let fresh = head == [0; 8];
    // this call's own new file, removed if the load fails before its header
    let mut made = Made {
        path,
        meta: (created && fresh && backing != Backing::DevDax).then_some(meta),
    };
    if !fresh && head != TABLE_MAGIC {
        return Err(invalid(
            "table",
            format!(
                "{} holds something that is not a kvtier table; remove it or name another file",
                path.display()
            ),
        ));
    }
    if !fresh && len < want_len {
        return Err(Error::Pool(format!(
            "{} is truncated: it holds {}, the table {} (destroy it and load it again)",
            path.display(),
            crate::pool::human_size(len),
            crate::pool::human_size(want_len)
        )));
    }
    if fresh && backing != Backing::DevDax && len < want_len {
        // SAFETY: fallocate on a descriptor this function owns; the
        // bytes are allocated now, so a full filesystem says so here
        // instead of killing a reader with SIGBUS later.
        let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, want_len as libc::off_t) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                file.set_len(want_len).map_err(|source| Error::Io {
                    context: format!("growing {}", path.display()),
                    source,
                })?;
            } else {
                return Err(Error::Io {
                    context: format!(
                        "allocating {} for the table {}",
                        crate::pool::human_size(want_len),
                        path.display()
                    ),
                    source: e,
                });
            }
        }
    }
    let file_len = length_of(&file, path, &backing)?;
    if file_len < want_len {
        return Err(invalid(
            "table",
            format!(
                "{} holds {}, less than the {} the table needs",
                path.display(),
                crate::pool::human_size(file_len),
                crate::pool::human_size(want_len)
            ),
        ));
    }
    let map = map(&file, path, want_len, page, true)?;
    let m = Mapped {
        path: path.to_path_buf(),
        file,
        map,
    };
    if fresh {
        let h = Header::new(key, data_bytes);
        // The fixed fields first, the magic last: a header without its
        // magic is a table not made yet.
        // SAFETY: the mapping is at least 2 MiB; no other process maps the
        // header's bytes while this one holds the exclusive lock.
        unsafe {
            let dst = m.map.as_mut_ptr();
            std::ptr::write_bytes(dst, 0, TABLE_DATA_OFFSET as usize);
            let mut no_magic = h;
            no_magic.magic = [0; 8];
            std::ptr::write_unaligned(dst as *mut Header, no_magic);
            m.word(STATE_OFFSET).store(FILLING, Ordering::Relaxed);
            std::sync::atomic::fence(Ordering::Release);
            std::ptr::copy_nonoverlapping(TABLE_MAGIC.as_ptr(), dst, 8);
        }
    }
    made.meta = None; // a table now: failed or not, a later load resumes it
    let h = m.header();
    h.check(path, file_len)?;
    if h.key() != key.as_bytes() {
        return Err(Error::Pool(format!(
            "{} holds the table {:?}, not {key:?}; a different key never attaches to another's bytes \
             (destroy it, or use another file)",
            path.display(),
            String::from_utf8_lossy(h.key())
        )));
    }
    if h.data_bytes != data_bytes {
        return Err(Error::Pool(format!(
            "{} holds {} of {key:?}, not {}",
            path.display(),
            h.data_bytes,
            data_bytes
        )));
    }
    if m.state() == READY {
        return Ok(Load::Ready);
    }
    Ok(Load::Filling(Box::new(TableLoader {
        m,
        h,
        partial: std::collections::HashMap::new(),
    })))
}

/// What [`load`] found.
pub enum Load {
    /// Loaded already (by this or another process): attach to it.
    Ready,
    /// To fill: the chunks not yet written.
    Filling(Box<TableLoader>),
}

/// A table being filled, this process holding its exclusive lock (dropped
/// without [`TableLoader::publish`], it stays FILLING and resumable).
pub struct TableLoader {
    m: Mapped,
    h: Header,
    /// Chunks written in pieces by this loader: the byte ranges written so
    /// far, merged, relative to the chunk (a chunk is marked when they
    /// cover it).
    partial: std::collections::HashMap<u64, Vec<Range<u64>>>,
}

impl TableLoader {
    /// Bytes of data.
    pub fn len(&self) -> u64 {
        self.h.data_bytes
    }

    pub fn is_empty(&self) -> bool {
        self.h.data_bytes == 0
    }

    /// The chunk size the fill bitmap counts.
    pub fn chunk_bytes(&self) -> u64 {
        self.h.chunk_bytes
    }

    /// The byte ranges still to write, merged, in order (all of them for a
    /// new table; what a killed loader left for a resumed one).
    pub fn missing(&self) -> Vec<Range<u64>> {
        let mut out: Vec<Range<u64>> = Vec::new();
        for c in 0..self.h.chunks {
            if self.m.chunk_done(c) {
                continue;
            }
            let r = c * self.h.chunk_bytes..((c + 1) * self.h.chunk_bytes).min(self.h.data_bytes);
            match out.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => out.push(r),
            }
        }
        out
    }

    /// Chunks written so far, of all.
    pub fn progress(&self) -> (u64, u64) {
        (self.m.chunks_done(&self.h), self.h.chunks)
    }

    /// Copies `bytes` to the data at `offset` and marks every chunk now
    /// written whole: one this write covers, or one this loader's writes
    /// have covered in pieces, in any order (pieces a killed loader wrote
    /// are not remembered: a resumed load writes such a chunk again).
    pub fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<()> {
        let end = offset
            .checked_add(bytes.len() as u64)
            .filter(|&e| e <= self.h.data_bytes)
            .ok_or_else(|| {
                invalid(
                    "table",
                    format!(
                        "a write of {} B at {offset} runs past the table's {} B",
                        bytes.len(),
                        self.h.data_bytes
                    ),
                )
            })?;
        // SAFETY: `offset..end` is inside the data (checked); this process
        // holds the exclusive lock, so no reader maps the table meanwhile.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.m
                    .map
                    .as_mut_ptr()
                    .add((TABLE_DATA_OFFSET + offset) as usize),
                bytes.len(),
            );
        }
        self.mark(offset..end);
        Ok(())
    }

    /// Marks the chunks `range` completes (see [`TableLoader::write`]).
    fn mark(&mut self, range: Range<u64>) {
        if range.is_empty() {
            return;
        }
        let cb = self.h.chunk_bytes;
        // the bytes before the mark, the mark before READY
        std::sync::atomic::fence(Ordering::Release);
        for c in range.start / cb..range.end.div_ceil(cb) {
            let (start, stop) = (c * cb, ((c + 1) * cb).min(self.h.data_bytes));
            let piece = range.start.max(start) - start..range.end.min(stop) - start;
            let covered = self.partial.entry(c).or_default();
            covered.push(piece);
            covered.sort_by_key(|r| r.start);
            let mut merged: Vec<Range<u64>> = Vec::with_capacity(covered.len());
            for r in covered.drain(..) {
                match merged.last_mut() {
                    Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                    _ => merged.push(r),
                }
            }
            if merged.len() == 1 && merged[0] == (0..stop - start) {
                self.partial.remove(&c);
                self.m
                    .word(BITMAP_OFFSET + (c / 64) as usize * 8)
                    .fetch_or(1 << (c % 64), Ordering::Release);
            } else {
                *covered = merged;
            }
        }
    }

    /// Marks every chunk written and publishes the table READY (the
    /// exclusive lock goes with `self`). Refused while a chunk is missing.
    pub fn publish(self) -> Result<()> {
        let missing = self.missing();
        if !missing.is_empty() {
            let bytes: u64 = missing.iter().map(|r| r.end - r.start).sum();
            return Err(Error::Pool(format!(
                "{} cannot be published: {} of it not written yet (first at byte {})",
                self.m.path.display(),
                crate::pool::human_size(bytes),
                missing[0].start
            )));
        }
        self.m.word(STATE_OFFSET).store(READY, Ordering::Release);
        // A file on a disk or FS-DAX keeps what it is told to keep.
        let _ = self.m.map.flush();
        Ok(())
    }
}

/// A READY table attached for reading (a shared lock held until drop).
pub struct Table {
    m: Mapped,
    h: Header,
}

impl Table {
    /// Attaches to the READY table `key` at `path`, waiting at most `wait`
    /// for a loader that holds it; a table not loaded is an error saying
    /// how far its loading got.
    pub fn attach(path: &Path, key: &str, wait: Duration) -> Result<Table> {
        check_key(key)?;
        let (probe, h, backing) = read_header(path, Some(wait))?;
        if h.key() != key.as_bytes() {
            return Err(Error::Pool(format!(
                "{} holds the table {:?}, not {key:?}",
                path.display(),
                String::from_utf8_lossy(h.key())
            )));
        }
        if probe.state() != READY {
            let (done, all) = (probe.chunks_done(&h), h.chunks);
            return Err(Error::Pool(format!(
                "{} is not loaded: {done} of {all} chunks written and no loader at work (one was \
                 killed, or has not started); load it again to resume",
                path.display()
            )));
        }
        let Mapped { path, file, .. } = probe;
        let page = page_of(&backing, &path);
        let map = map(&file, &path, h.data_offset + h.data_bytes, page, false)?;
        Ok(Table {
            m: Mapped { path, file, map },
            h,
        })
    }

    /// The table's bytes.
    pub fn data(&self) -> &[u8] {
        // SAFETY: READY data are never written again while a reader holds
        // the shared lock (a loader needs the exclusive one).
        unsafe {
            std::slice::from_raw_parts(
                self.m.map.as_ptr().add(TABLE_DATA_OFFSET as usize),
                self.h.data_bytes as usize,
            )
        }
    }

    /// The address of the first data byte in this process.
    pub fn data_addr(&self) -> u64 {
        self.m.map.as_ptr() as u64 + TABLE_DATA_OFFSET
    }

    pub fn key(&self) -> String {
        String::from_utf8_lossy(self.h.key()).into_owned()
    }
}

/// What `kvtier table status` says of a table.
#[derive(Clone, Debug, PartialEq)]
pub struct TableStatus {
    pub path: PathBuf,
    pub key: String,
    pub data_bytes: u64,
    pub ready: bool,
    pub chunks_done: u64,
    pub chunks: u64,
    pub holders: Vec<Holder>,
    pub backing: Backing,
}

/// Reads a table's header and state without locking it.
pub fn status(path: &Path) -> Result<TableStatus> {
    let (m, h, backing) = read_header(path, None)?;
    Ok(TableStatus {
        path: path.to_path_buf(),
        key: String::from_utf8_lossy(h.key()).into_owned(),
        data_bytes: h.data_bytes,
        ready: m.state() == READY,
        chunks_done: m.chunks_done(&h),
        chunks: h.chunks,
        holders: holders(path)?,
        backing,
    })
}

/// Opens the table at `path` read-only (with `lock_wait`, under a shared
/// lock taken within that wait, on the file the path still names then),
/// maps its header and checks it against the file's length read after the
/// lock.
fn read_header(path: &Path, lock_wait: Option<Duration>) -> Result<(Mapped, Header, Backing)> {
    let deadline = Instant::now() + lock_wait.unwrap_or_default();
    for _ in 0..REOPENS {
        let (file, meta, _) = open(path, Access::Read)?;
        if lock_wait.is_some() && !lock_named(&file, &meta, path, libc::LOCK_SH, deadline)? {
            continue; // destroyed (and made again) while this process waited
        }
        let backing = backing_of(path, &meta);
        let (map, h) = header_of(&file, path, &backing)?;
        let m = Mapped {
            path: path.to_path_buf(),
            file,
            map,
        };
        return Ok((m, h, backing));
    }
    Err(changing(path))
}

/// Maps the header of the table file `file` (at `path`) and checks it
/// against the file's length.
fn header_of(file: &std::fs::File, path: &Path, backing: &Backing) -> Result<(MmapRaw, Header)> {
    let file_len = length_of(file, path, backing)?;
    if file_len < TABLE_DATA_OFFSET {
        return Err(Error::Pool(format!(
            "{} is not a kvtier table ({file_len} B)",
            path.display()
        )));
    }
    let map = map(file, path, TABLE_DATA_OFFSET, page_of(backing, path), false)?;
    // SAFETY: the mapping is at least a header long; a plain copy of plain data.
    let h = unsafe { std::ptr::read_unaligned(map.as_ptr() as *const Header) };
    h.check(path, file_len)?;
    Ok((map, h))
}

/// The state word of a mapped header.
fn state_of(map: &MmapRaw) -> u64 {
    // SAFETY: inside the header (at least 2 MiB mapped), 8-byte aligned in
    // a page-aligned mapping; shared words are only accessed atomically.
    unsafe { &*(map.as_ptr().add(STATE_OFFSET) as *const AtomicU64) }.load(Ordering::Acquire)
}

/// Removes the table at `path`: refused while a reader or loader holds it
/// (naming them), and for anything that is not a kvtier table (its first
/// bytes read under the exclusive lock): another program's file, a pool's
/// device, a device that cannot be read, a FIFO, a link. The file is
/// removed, then its magic cleared, so a process that opened it and waits
/// for its lock finds no table in it. A table on a devdax device loses its
/// magic; the device stays.
pub fn destroy(path: &Path) -> Result<()> {
    let (file, meta, _) = open(path, Access::Write)?;
    lock(&file, path, libc::LOCK_EX, Duration::ZERO)?;
    // The path must still name the file locked: a process that removed it
    // meanwhile leaves nothing here to remove.
    if !still_named(path, &meta) {
        return Err(Error::Pool(format!(
            "{} changed while it was being destroyed; look again",
            path.display()
        )));
    }
    let backing = backing_of(path, &meta);
    let head = magic_of(&file, path, &backing)?;
    if head != TABLE_MAGIC {
        return Err(invalid(
            "table",
            format!(
                "{} is not a kvtier table (its first bytes are not a table's): kvtier destroys only its own \
                 tables. A load killed before it wrote its header leaves a file that the next load of the \
                 same key reuses",
                path.display()
            ),
        ));
    }
    // The file goes first (a refused unlink changes nothing), then its
    // magic, through a mapping (hugetlbfs files take no write()): a process
    // that opened the table and waits for its lock finds no table in it.
    if backing != Backing::DevDax {
        remove_still_named(path, &meta)?;
    }
    let m = map(
        &file,
        path,
        TABLE_DATA_OFFSET,
        page_of(&backing, path),
        true,
    )?;
    // SAFETY: the first 8 bytes of a mapping of at least 2 MiB, under the
    // exclusive lock.
    unsafe { std::ptr::write_bytes(m.as_mut_ptr(), 0, 8) };
    Ok(())
}

/// A directory of tables (a hugetlbfs or tmpfs mount, say), each key's
/// file named by the key: `<readable part>-<hash>.table`.
#[derive(Clone, Debug)]
pub struct TableStore {
    pub dir: PathBuf,
}

impl TableStore {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        TableStore { dir: dir.into() }
    }

    /// The file of `key` in this store.
    pub fn path_of(&self, key: &str) -> PathBuf {
        let x = fnv1a(&[key.as_bytes()]);
        let readable: String = key
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .take(48)
            .collect();
        self.dir.join(format!("{readable}-{x:016x}.table"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvtier-table-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn pattern(offset: u64, n: usize) -> Vec<u8> {
        (0..n as u64)
            .map(|i| (((offset + i) * 2_654_435_761) >> 11) as u8)
            .collect()
    }

    #[test]
    fn a_table_is_readable_only_once_every_chunk_is_written_and_resumes_where_it_stopped() {
        let d = dir("resume");
        let path = d.join("t.table");
        let n: u64 = 5 * MIN_CHUNK_BYTES + 12_345;
        let Load::Filling(mut l) = load(&path, "engram/test", n, LOCK_WAIT).unwrap() else {
            panic!("a new table is filling");
        };
        assert_eq!(l.missing(), vec![0..n]);
        // two whole chunks and half of the third
        l.write(0, &pattern(0, 2 * MIN_CHUNK_BYTES as usize))
            .unwrap();
        let half = MIN_CHUNK_BYTES / 2;
        l.write(
            2 * MIN_CHUNK_BYTES,
            &pattern(2 * MIN_CHUNK_BYTES, half as usize),
        )
        .unwrap();
        assert_eq!(l.progress(), (2, 6));
        drop(l); // a loader gone before publishing
        let e = Table::attach(&path, "engram/test", Duration::ZERO)
            .err()
            .unwrap();
        assert!(e.to_string().contains("2 of 6 chunks written"), "{e}");
        let s = status(&path).unwrap();
        assert!(!s.ready && s.chunks_done == 2 && s.key == "engram/test");
        // the next loader resumes at the third chunk
        let Load::Filling(mut l) = load(&path, "engram/test", n, LOCK_WAIT).unwrap() else {
            panic!("still filling");
        };
        assert_eq!(l.missing(), vec![2 * MIN_CHUNK_BYTES..n]);
        for r in l.missing() {
            l.write(r.start, &pattern(r.start, (r.end - r.start) as usize))
                .unwrap();
        }
        l.publish().unwrap();
        let t = Table::attach(&path, "engram/test", Duration::ZERO).unwrap();
        assert!(t.data() == pattern(0, n as usize).as_slice());
        // loaded already: nothing to do, readers or not; a reader is listed
        assert!(matches!(
            load(&path, "engram/test", n, Duration::ZERO).unwrap(),
            Load::Ready
        ));
        let s = status(&path).unwrap();
        assert!(
            s.ready
                && s.holders
                    .iter()
                    .any(|h| h.pid == std::process::id() && !h.exclusive)
        );
        // never destroyed under a reader
        let e = destroy(&path).unwrap_err();
        assert!(e.to_string().contains("reading"), "{e}");
        drop(t);
        assert!(matches!(
            load(&path, "engram/test", n, LOCK_WAIT).unwrap(),
            Load::Ready
        ));
        destroy(&path).unwrap();
        assert!(!path.exists());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn another_key_or_size_never_attaches_and_a_bad_header_is_reported() {
        let d = dir("keys");
        let path = d.join("t.table");
        let Load::Filling(mut l) = load(&path, "a", 100, LOCK_WAIT).unwrap() else {
            panic!()
        };
        let e = l.write(90, &[0; 20]).unwrap_err();
        assert!(e.to_string().contains("runs past"), "{e}");
        l.write(0, &[7; 100]).unwrap();
        l.publish().unwrap();
        let e = Table::attach(&path, "b", Duration::ZERO).err().unwrap();
        assert!(
            e.to_string().contains("holds the table \"a\", not \"b\""),
            "{e}"
        );
        let e = load(&path, "b", 100, LOCK_WAIT).err().unwrap();
        assert!(e.to_string().contains("never attaches"), "{e}");
        assert!(load(&path, "a", 101, LOCK_WAIT).is_err());
        assert!(load(&path, "", 1, LOCK_WAIT).is_err());
        // a flipped byte in the header's key: reported, never served
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            f.write_at(b"z", std::mem::offset_of!(Header, key) as u64)
                .unwrap();
        }
        let e = Table::attach(&path, "a", Duration::ZERO).err().unwrap();
        assert!(e.to_string().contains("corrupted"), "{e}");
        assert!(status(&path).is_err());
        // not a table at all
        let other = d.join("other");
        std::fs::write(&other, vec![1u8; 3 << 20]).unwrap();
        let e = load(&other, "a", 100, LOCK_WAIT).err().unwrap();
        assert!(e.to_string().contains("not a kvtier table"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn chunks_written_in_pieces_in_any_order_count_and_a_truncated_table_is_reported() {
        let d = dir("pieces");
        let path = d.join("t.table");
        let n = 3 * MIN_CHUNK_BYTES;
        let Load::Filling(mut l) = load(&path, "p", n, LOCK_WAIT).unwrap() else {
            panic!()
        };
        let half = (MIN_CHUNK_BYTES / 2) as usize;
        // chunk 0 in two pieces, in order: marked
        l.write(0, &pattern(0, half)).unwrap();
        assert_eq!(l.progress().0, 0);
        l.write(half as u64, &pattern(half as u64, half)).unwrap();
        assert_eq!(l.progress().0, 1);
        // chunk 1's second half first (a table's second tensor loaded
        // before its first): not marked until its first half comes
        let c1 = MIN_CHUNK_BYTES;
        l.write(c1 + half as u64, &pattern(c1 + half as u64, half))
            .unwrap();
        assert_eq!(l.progress().0, 1);
        // three pieces of chunk 2 out of order, the middle last, and gaps
        // between them at first: marked only when covered
        let c2 = 2 * MIN_CHUNK_BYTES;
        let q = half as u64 / 2;
        l.write(c2 + 3 * q, &pattern(c2 + 3 * q, q as usize))
            .unwrap();
        l.write(c2, &pattern(c2, q as usize)).unwrap();
        assert_eq!(l.progress().0, 1);
        l.write(c1, &pattern(c1, half)).unwrap();
        assert_eq!(l.progress().0, 2);
        l.write(c2 + q, &pattern(c2 + q, 2 * q as usize)).unwrap();
        assert_eq!(l.progress(), (3, 3));
        l.publish().unwrap();
        assert!(
            Table::attach(&path, "p", Duration::ZERO).unwrap().data() == pattern(0, n as usize)
        );
        // cut short (a full disk, a careless `truncate`): reported, never mapped past its end
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(3 << 20).unwrap();
        let e = load(&path, "p", n, LOCK_WAIT).err().unwrap();
        assert!(e.to_string().contains("truncated"), "{e}");
        assert!(Table::attach(&path, "p", Duration::ZERO).is_err());
        assert!(status(&path).is_err());
        f.set_len(4096).unwrap();
        assert!(load(&path, "p", n, LOCK_WAIT).is_err());
        assert!(Table::attach(&path, "p", Duration::ZERO).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }

    fn mkfifo(p: &Path) {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    }

    fn loaded(path: &Path, key: &str, n: u64) {
        let Load::Filling(mut l) = load(path, key, n, LOCK_WAIT).unwrap() else {
            panic!("a new table");
        };
        l.write(0, &pattern(0, n as usize)).unwrap();
        l.publish().unwrap();
    }

    /// A FIFO at a key's path (it is predictable) is refused at once by
    /// every opener, never waited on.
    #[test]
    fn a_fifo_at_a_tables_path_is_refused_without_waiting() {
        let d = dir("fifo");
        let path = d.join("t.table");
        mkfifo(&path);
        let t0 = Instant::now();
        let e = Table::attach(&path, "k", LOCK_WAIT)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("is a FIFO"), "{e}");
        assert!(
            status(&path)
                .err()
                .unwrap()
                .to_string()
                .contains("is a FIFO")
        );
        let e = load(&path, "k", 100, LOCK_WAIT).err().unwrap().to_string();
        assert!(e.contains("is a FIFO"), "{e}");
        let e = destroy(&path).unwrap_err().to_string();
        assert!(e.contains("is a FIFO"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert!(
            std::fs::symlink_metadata(&path)
                .unwrap()
                .file_type()
                .is_fifo(),
            "left alone"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Destroy removes only what it proves is a table: never a pool's device
    /// (with a process attached), a character device, another program's
    /// file, another user's.
    #[test]
    fn destroy_destroys_only_tables() {
        let d = dir("destroy");
        // a live pool's device file
        let dev = d.join("pool0");
        let pool = crate::pool::Pool::create_on(
            crate::layout::LayerFirstLayout::new(64, 2, 16).unwrap(),
            vec![crate::pool::DeviceSpec::file(&dev, 8 << 20)],
            Default::default(),
        )
        .unwrap();
        let e = destroy(&dev).unwrap_err().to_string();
        assert!(e.contains("not a kvtier table"), "{e}");
        assert!(dev.exists());
        let r = pool.alloc_region().unwrap();
        pool.free_region(r).unwrap();
        drop(pool);
        assert!(
            crate::pool::Pool::open(
                vec![crate::pool::DeviceSpec::file(&dev, 8 << 20)],
                Default::default()
            )
            .is_ok()
        );
        // /dev/zero, "destroyed" by zeroing bytes it never read
        let e = destroy(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(e.contains("character device"), "{e}");
        // another program's file, and an empty one
        for (name, bytes) in [("other", vec![7u8; 4096]), ("empty", vec![])] {
            let f = d.join(name);
            std::fs::write(&f, &bytes).unwrap();
            let e = destroy(&f).unwrap_err().to_string();
            assert!(e.contains("not a kvtier table"), "{e}");
            assert_eq!(std::fs::read(&f).unwrap(), bytes, "untouched");
        }
        // a link to a table is not followed
        let path = d.join("t.table");
        loaded(&path, "k", 64);
        let link = d.join("link.table");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(
            destroy(&link)
                .unwrap_err()
                .to_string()
                .contains("symbolic link")
        );
        // another user's table (only root can make one to try)
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: a valid C string.
            assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
            let e = destroy(&path).unwrap_err().to_string();
            assert!(e.contains("belongs to user 65534"), "{e}");
            // SAFETY: as above.
            assert_eq!(unsafe { libc::chown(c.as_ptr(), 0, 0) }, 0);
        }
        destroy(&path).unwrap();
        assert!(!path.exists());
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Sizes near 2^64 are refused before anything is made (they wrapped
    /// the file's length to 0, then a write of the header hit SIGBUS), and a
    /// load that fails for want of room leaves no file behind.
    #[test]
    fn a_table_too_large_is_refused_and_leaves_nothing() {
        let d = dir("huge");
        let path = d.join("t.table");
        for n in [u64::MAX - (2 << 20) + 1, u64::MAX, MAX_TABLE_BYTES + 1] {
            let e = load(&path, "k", n, LOCK_WAIT).err().unwrap().to_string();
            assert!(e.contains("a table holds 1 to"), "{n}: {e}");
            assert!(!path.exists());
        }
        // (no filesystem here holds 64 PiB: fallocate, or on one without it
        // the mapping of a sparse file, fails)
        assert!(load(&path, "k", MAX_TABLE_BYTES, LOCK_WAIT).is_err());
        assert!(!path.exists(), "a failed load leaves no file");
        let _ = std::fs::remove_dir_all(&d);
    }

    /// How many descriptors of this process name `path`.
    fn opened(path: &Path) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|target| target == path)
            .count()
    }

    /// An attach that opened a table and waits for its lock while the file
    /// is removed and the key loaded again attaches the new file, never the
    /// deleted one.
    #[test]
    fn an_attach_waiting_through_a_destroy_attaches_what_the_path_names_after() {
        let d = dir("attach-destroy");
        let path = d.join("t.table");
        let n = 4096u64;
        let Load::Filling(mut first) = load(&path, "k", n, LOCK_WAIT).unwrap() else {
            panic!()
        };
        first.write(0, &pattern(0, n as usize)).unwrap();
        let old = std::fs::metadata(&path).unwrap();
        let attacher = {
            let path = path.clone();
            std::thread::spawn(move || Table::attach(&path, "k", LOCK_WAIT))
        };
        let t0 = Instant::now();
        // the loader's descriptor, and the attach's, which then waits for
        // the loader's lock
        while opened(&path) < 2 {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the attach never opened it"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        std::fs::remove_file(&path).unwrap();
        loaded(&path, "k", n);
        let new = std::fs::metadata(&path).unwrap();
        first.publish().unwrap(); // the removed file READY too, its lock released
        let t = attacher.join().unwrap().unwrap();
        let got = t.m.file.metadata().unwrap();
        assert_ne!(old.ino(), new.ino());
        assert_eq!(got.ino(), new.ino(), "attached the file the path names");
        drop(t);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn lock_holders_are_read_from_proc_locks() {
        let locks = "1: FLOCK  ADVISORY  WRITE 4242 00:2a:77 0 EOF\n\
                     2: FLOCK  ADVISORY  READ  17 00:2a:77 0 EOF\n\
                     2: -> FLOCK  ADVISORY  READ  18 00:2a:77 0 EOF\n\
                     3: POSIX  ADVISORY  WRITE 5 00:2a:77 0 EOF\n\
                     4: FLOCK  ADVISORY  READ  9 00:2a:78 0 EOF\n";
        assert_eq!(
            parse_locks(locks, "00:2a:77"),
            vec![
                Holder {
                    pid: 4242,
                    exclusive: true
                },
                Holder {
                    pid: 17,
                    exclusive: false
                },
            ]
        );
    }

    #[test]
    fn a_store_names_each_key_its_own_file() {
        let s = TableStore::new("/dev/shm/t");
        let a = s.path_of("deepseek-v4.1-flash/engram.0 [384006168x256 e4m3+e8m0] sha256:ab");
        assert!(a.starts_with("/dev/shm/t"));
        assert!(a.to_string_lossy().ends_with(".table"));
        assert_ne!(a, s.path_of("deepseek-v4.1-flash/engram.1"));
        assert_eq!(
            a,
            s.path_of("deepseek-v4.1-flash/engram.0 [384006168x256 e4m3+e8m0] sha256:ab")
        );
    }
}
