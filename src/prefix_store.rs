//! Prefix pages shared through shared memory: a store of fixed-size pages
//! under string keys (SGLang's HiCache page hashes), in one file on tmpfs
//! (hugetlbfs is not yet tested), that every process of the host attaches. A page one instance
//! wrote is found and copied by every other, and by itself after a restart,
//! with no server: the key index lives in the file.
//!
//! # The file
//!
//! A header (geometry, the store's *namespace*: what its pages hold, which
//! an opener must name the same), then the index, then one 256-byte record
//! per slot (a state word and the key), then the slots' data, 2 MiB-aligned.
//! The index is set-associative: a key's 64-bit hash picks a set of eight
//! buckets (one cache line), and a bucket holds a 32-bit tag of the hash and
//! the slot number; there are eight buckets a slot, so a set holds one live
//! key on average (all eight live: about one set in 100,000), and a set
//! found full has a page of its own evicted.
//! Lookups take no lock and make no system call.
//!
//! # Why a reader never gets a wrong page, and a killed process leaves
//! # nothing half-done
//!
//! A slot is FREE, WRITING, PUBLISHED or EVICTING, with a generation that
//! moves each time the slot is taken for a new page. Two byte-range locks
//! per slot (open-file-description locks, which the kernel drops when the
//! holder dies, `kill -9` included) stand in for what a crashed process
//! could otherwise leave held:
//!
//! - the *writer lock*: whoever takes a slot (to write a page, to evict,
//!   to reclaim) holds it exclusively. A slot found WRITING or EVICTING
//!   whose writer lock can be taken was left by a dead process: it is
//!   reclaimed. A page is published (state PUBLISHED, release ordering) only
//!   after its bytes and its index bucket are in place, so a writer killed
//!   at any point leaves nothing a reader accepts.
//! - the *pin*: a reader holds it shared while it copies. An evictor first
//!   moves the slot to EVICTING (new readers turn away), then must take the
//!   pin exclusively; while any reader holds it, the eviction is undone. A
//!   reader checks the state and the key after pinning, so a slot reused
//!   for another key is never copied out under this one.
//!
//! Eviction is CLOCK: a lookup sets the slot's reference bit, the hand
//! clears it once before taking the slot. The same key written twice at
//! once is kept once (the later insert sees the earlier and withdraws).
//!
//! # What is shared, and with whom
//!
//! Every process of one host that opens the file with the same namespace.
//! The locks and atomics are the host's: hosts sharing a CXL device are not
//! coherent with each other and have no common lock, so one store file must
//! not be written from two hosts (kvtier cannot detect it; say so in the
//! deployment).

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};

use crate::error::{Error, Result, invalid};
use crate::shared_fs::{self, Devices, FileRule, Owner};

pub const PREFIX_MAGIC: [u8; 8] = *b"KVTIERPX";
pub const PREFIX_VERSION: u32 = 1;
/// The longest page key (SGLang's are a 64-character hash and a suffix).
pub const MAX_PAGE_KEY_BYTES: usize = 200;
/// The longest namespace.
pub const MAX_NAMESPACE_BYTES: usize = 512;
/// The most slots one store holds.
pub const MAX_SLOTS: u64 = 1 << 30;

const HEADER_BYTES: u64 = 4096;
const SLOT_RECORD_BYTES: u64 = 256;
const WAYS: u64 = 8;
const DATA_ALIGN: u64 = 2 << 20;
const SLOT_ALIGN: u64 = 4096;

/// Offsets of the header's shared words.
const STATE_WORD: usize = 2048;
const CLOCK_WORD: usize = STATE_WORD + 8;
const COUNTERS: usize = STATE_WORD + 64;
const READY: u64 = 0x5245_4144_5950_5821; // "READYPX!"

const EMPTY: u64 = 0;
const TOMB: u64 = u64::MAX;

const FREE: u64 = 0;
const WRITING: u64 = 1;
const PUBLISHED: u64 = 2;
const EVICTING: u64 = 3;
const STATE_MASK: u64 = 0xff;
const REFERENCED: u64 = 1 << 8;

/// Where the locks of slot `s` are: byte ranges far past any file's end.
const WRITER_LOCKS: i64 = 1 << 48;
const PIN_LOCKS: i64 = 1 << 49;

/// What a prefix store's file must be: a regular file this user (or its
/// group) owns, that others cannot write, with no other hard link.
const STORE_FILE: FileRule = FileRule {
    owner: Owner::MeOrMyGroup,
    forbidden_mode: 0o002,
    devices: Devices::None,
    single_link: true,
};

#[repr(C)]
#[derive(Clone, Copy)]
struct Header {
    magic: [u8; 8],
    version: u32,
    namespace_len: u32,
    page_bytes: u64,
    slot_stride: u64,
    slots: u64,
    sets: u64,
    index_offset: u64,
    records_offset: u64,
    data_offset: u64,
    file_bytes: u64,
    namespace: [u8; MAX_NAMESPACE_BYTES],
    sum: u64,
}

const _: () = assert!(std::mem::size_of::<Header>() <= STATE_WORD);

impl Header {
    fn new(namespace: &str, page_bytes: u64, slots: u64) -> Result<Header> {
        let slot_stride = page_bytes.next_multiple_of(SLOT_ALIGN);
        let sets = slots.next_power_of_two();
        let index_offset = HEADER_BYTES;
        let records_offset = index_offset + sets * WAYS * 8;
        let data_offset = (records_offset + slots * SLOT_RECORD_BYTES).next_multiple_of(DATA_ALIGN);
        let file_bytes = slots
            .checked_mul(slot_stride)
            .and_then(|d| d.checked_add(data_offset))
            .filter(|&b| b < 1 << 56)
            .ok_or_else(|| invalid("slots", "a store of that size is larger than a file can be"))?;
        let mut ns = [0u8; MAX_NAMESPACE_BYTES];
        ns[..namespace.len()].copy_from_slice(namespace.as_bytes());
        let mut h = Header {
            magic: PREFIX_MAGIC,
            version: PREFIX_VERSION,
            namespace_len: namespace.len() as u32,
            page_bytes,
            slot_stride,
            slots,
            sets,
            index_offset,
            records_offset,
            data_offset,
            file_bytes,
            namespace: ns,
            sum: 0,
        };
        h.sum = h.checksum();
        Ok(h)
    }

    fn checksum(&self) -> u64 {
        let mut c = *self;
        c.sum = 0;
        // SAFETY: a plain repr(C) struct of integers and byte arrays, with no
        // padding (its fields are 8-byte multiples in 8-byte order).
        let bytes = unsafe {
            std::slice::from_raw_parts(
                &c as *const Header as *const u8,
                std::mem::size_of::<Header>(),
            )
        };
        crate::table::fnv1a(&[bytes])
    }

    fn namespace(&self) -> &[u8] {
        &self.namespace[..(self.namespace_len as usize).min(MAX_NAMESPACE_BYTES)]
    }

    /// Whether the header is one this version wrote, whole, for a file of
    /// `file_len` bytes; the reason when not.
    fn check(&self, file_len: u64) -> std::result::Result<(), String> {
        if self.version != PREFIX_VERSION {
            return Err(format!(
                "version {} (this kvtier reads {PREFIX_VERSION})",
                self.version
            ));
        }
        if self.sum != self.checksum() {
            return Err("its header's checksum does not match".into());
        }
        let again = Header::new(
            std::str::from_utf8(self.namespace()).map_err(|_| "its namespace is not UTF-8")?,
            self.page_bytes,
            self.slots,
        )
        .map_err(|e| e.to_string())?;
        if self.page_bytes == 0 || self.slots == 0 || self.slots > MAX_SLOTS {
            return Err("its geometry is out of range".into());
        }
        if (
            again.slot_stride,
            again.sets,
            again.data_offset,
            again.file_bytes,
        ) != (
            self.slot_stride,
            self.sets,
            self.data_offset,
            self.file_bytes,
        ) {
            return Err("its geometry does not add up".into());
        }
        if file_len < self.file_bytes {
            return Err(format!(
                "it is {file_len} bytes, shorter than the {} its header says",
                self.file_bytes
            ));
        }
        Ok(())
    }
}

/// The counters a store keeps, for every process together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Pages published.
    pub sets: u64,
    /// Pages copied out.
    pub hits: u64,
    /// Gets that found no page (or one being evicted).
    pub misses: u64,
    /// Pages evicted to make room.
    pub evictions: u64,
    /// Slots a killed writer or evictor left, taken back.
    pub reclaimed: u64,
    /// Sets refused: every slot pinned or being written, or the key's index
    /// set full.
    pub full: u64,
}

const COUNTER_NAMES: usize = 6;

/// What a store is: its geometry and its namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixStoreInfo {
    pub path: PathBuf,
    pub namespace: String,
    pub page_bytes: u64,
    pub slots: u64,
    pub file_bytes: u64,
}

/// How a set ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetOutcome {
    /// The page is published under the key.
    Stored,
    /// The key was there already (or was being written by another): nothing
    /// was written.
    Present,
    /// No slot could be had: every slot is pinned or being written, or the
    /// key's index set is full. Nothing was written.
    Full,
}

/// A prefix store this process has open.
pub struct PrefixStore {
    path: PathBuf,
    file: std::fs::File,
    map: MmapRaw,
    header: Header,
    /// Open file descriptions of the store's file, one per operation in
    /// flight: byte-range locks of one description never conflict with each
    /// other, so two threads of this process must not share one.
    lockers: Mutex<Vec<std::fs::File>>,
    /// A bit per slot: whether this process has mapped the slot's pages in
    /// (see [`PrefixStore::warm`]).
    warmed: Vec<AtomicU64>,
}

// SAFETY: the mapping is shared memory touched only through atomics and
// through copies into and out of slots guarded by the locks above; the
// handle holds no thread-bound state.
unsafe impl Send for PrefixStore {}
// SAFETY: as above.
unsafe impl Sync for PrefixStore {}

fn hash_key(key: &[u8]) -> u64 {
    // Eight bytes a step (a lookup hashes every key of a batch: a byte a
    // step made it a third of a 512-key lookup), then murmur3's finalizer,
    // which spreads every input bit over the set (low bits) and the tag
    // (high bits). Little-endian words: the same hash on every host.
    let mut x = 0x9e37_79b9_7f4a_7c15 ^ key.len() as u64;
    let mut words = key.chunks_exact(8);
    for w in &mut words {
        let w = u64::from_le_bytes(w.try_into().expect("eight bytes"));
        x = (x ^ w).wrapping_mul(0xff51_afd7_ed55_8ccd).rotate_left(29);
    }
    let rest = words.remainder();
    if !rest.is_empty() {
        let mut w = [0u8; 8];
        w[..rest.len()].copy_from_slice(rest);
        x = (x ^ u64::from_le_bytes(w))
            .wrapping_mul(0xc4ce_b9fe_1a85_ec53)
            .rotate_left(31);
    }
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn check_key(key: &[u8]) -> Result<()> {
    check_bytes("key", "a page key", key.len(), MAX_PAGE_KEY_BYTES)
}

/// Argument `arg` (`what`) of `len` bytes must hold 1 to `max`.
fn check_bytes(arg: &'static str, what: &str, len: usize, max: usize) -> Result<()> {
    if len == 0 || len > max {
        return Err(invalid(
            arg,
            format!("{what} is 1 to {max} bytes, not {len}"),
        ));
    }
    Ok(())
}

fn lock_byte(file: &std::fs::File, at: i64, kind: libc::c_int) -> bool {
    // SAFETY: flock is plain data; l_pid must be 0 for OFD locks.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = at;
    fl.l_len = 1;
    // SAFETY: a valid descriptor and a flock it may read.
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut fl) == 0 }
}

/// Takes the `flock` `how` on a store's `file`, waiting until `deadline`
/// (`wait` after the open began) for the process making it.
fn flock_by(
    file: &std::fs::File,
    path: &Path,
    how: i32,
    deadline: Instant,
    wait: Duration,
) -> Result<()> {
    match crate::pool::device::flock_until(file, how, deadline) {
        Ok(true) => Ok(()),
        Ok(false) => Err(being_made(path, wait)),
        Err(source) => Err(Error::Io {
            context: format!("locking {}", path.display()),
            source,
        }),
    }
}

fn being_made(path: &Path, wait: Duration) -> Error {
    Error::Pool(format!(
        "{} is being made by another process ({} s waited)",
        path.display(),
        wait.as_secs()
    ))
}

fn unlock_byte(file: &std::fs::File, at: i64) {
    lock_byte(file, at, libc::F_UNLCK);
}

impl PrefixStore {
    /// Opens the store at `path`, making it (with `slots` slots of
    /// `page_bytes`) when the file is missing or empty. An existing store
    /// must have been made for the same `namespace` and `page_bytes`; its
    /// slot count is its own. A file that is not a prefix store is never
    /// written. Waits at most `wait` for a process making the store.
    pub fn open_or_create(
        path: &Path,
        namespace: &str,
        page_bytes: u64,
        slots: u64,
        wait: Duration,
    ) -> Result<PrefixStore> {
        check_bytes(
            "namespace",
            "a namespace",
            namespace.len(),
            MAX_NAMESPACE_BYTES,
        )?;
        if page_bytes == 0 || page_bytes > 1 << 40 {
            return Err(invalid(
                "page_bytes",
                format!("{page_bytes} is not in 1..=2^40"),
            ));
        }
        if slots == 0 || slots > MAX_SLOTS {
            return Err(invalid(
                "slots",
                format!("{slots} is not in 1..={MAX_SLOTS}"),
            ));
        }
        let wanted = Header::new(namespace, page_bytes, slots)?;
        let (file, meta, _) = shared_fs::open_or_create(path, 0o600, &STORE_FILE, "path")?;
        let deadline = Instant::now() + wait;
        let locking = |how| flock_by(&file, path, how, deadline, wait);
        // Made by one process under the exclusive lock; every attached
        // process holds the shared lock for as long as it is attached. A
        // store found ready under the shared lock is used as it is; else this
        // process makes it if it can have the exclusive lock now, or looks
        // again (several ranks start at once: one makes it, and the others
        // find it ready, holding their shared locks, which a waiting
        // exclusive lock would never get past).
        let expect = Some((namespace, page_bytes));
        let header = loop {
            if let Some(h) = Self::ready_header(&file, path, expect, Some(&locking))? {
                break h;
            }
            // SAFETY: flock on a descriptor this function owns.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                if let Some(h) = Self::ready_header(&file, path, expect, None)? {
                    break h;
                }
                // empty, or a maker died before READY: made (again)
                crate::pool::device::reserve(&file, path, &meta, wanted.file_bytes)?;
                let map = Self::map(&file, path, wanted.file_bytes)?;
                // SAFETY: the mapping holds the whole file; nobody else maps
                // it without the shared lock this process's exclusive one
                // keeps out.
                unsafe {
                    std::ptr::write_bytes(map.as_mut_ptr(), 0, wanted.data_offset as usize);
                    std::ptr::write_unaligned(map.as_mut_ptr() as *mut Header, wanted);
                    (*(map.as_ptr().add(STATE_WORD) as *const AtomicU64))
                        .store(READY, Ordering::Release);
                }
                map.flush().ok();
                break wanted;
            }
            if Instant::now() >= deadline {
                return Err(being_made(path, wait));
            }
            // apart, so that two openers looking at once do not keep meeting
            std::thread::sleep(Duration::from_micros(
                500 + 700 * (std::process::id() % 7) as u64,
            ));
        };
        locking(libc::LOCK_SH)?;
        Self::attach(path, file, header)
    }

    /// The handle on `file` (its shared lock held), whose header is `header`.
    fn attach(path: &Path, file: std::fs::File, header: Header) -> Result<PrefixStore> {
        let map = Self::map(&file, path, header.file_bytes)?;
        Ok(PrefixStore {
            path: path.to_path_buf(),
            file,
            map,
            header,
            lockers: Mutex::new(Vec::new()),
            warmed: (0..header.slots.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
        })
    }

    /// The header of a ready store at `file` made for `namespace` and
    /// `page_bytes`, taking the shared lock with `lock` first (given up
    /// again when not ready); None when the file is empty or its
    /// maker died before it was ready; an error
    /// for anything else.
    fn ready_header(
        file: &std::fs::File,
        path: &Path,
        expect: Option<(&str, u64)>,
        lock: Option<&dyn Fn(i32) -> Result<()>>,
    ) -> Result<Option<Header>> {
        if let Some(lock) = lock {
            lock(libc::LOCK_SH)?;
        }
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let mut head = [0u8; std::mem::size_of::<Header>()];
        let n = std::os::unix::fs::FileExt::read_at(file, &mut head, 0).unwrap_or(0);
        let ours = n >= 8 && head[..8] == PREFIX_MAGIC;
        if len > 0 && !ours {
            return Err(Error::Pool(format!(
                "{} is not a kvtier prefix store (it holds {len} bytes of something else; \
                 kvtier never writes over them)",
                path.display()
            )));
        }
        let mut state = [0u8; 8];
        let ready = ours
            && n == head.len()
            && std::os::unix::fs::FileExt::read_at(file, &mut state, STATE_WORD as u64)
                .is_ok_and(|k| k == 8)
            && u64::from_ne_bytes(state) == READY;
        if !ready {
            if lock.is_some() {
                // SAFETY: unlocking a descriptor this process owns.
                unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
            }
            return Ok(None);
        }
        // SAFETY: a plain copy of plain data of the header's size.
        let h: Header = unsafe { std::ptr::read_unaligned(head.as_ptr() as *const Header) };
        h.check(len).map_err(|why| {
            Error::Pool(format!(
                "{} is not a valid kvtier prefix store: {why}",
                path.display()
            ))
        })?;
        if let Some((namespace, page_bytes)) = expect
            && (h.namespace() != namespace.as_bytes() || h.page_bytes != page_bytes)
        {
            return Err(Error::Pool(format!(
                "{} holds pages of `{}` ({} B a page), not of `{namespace}` ({page_bytes} B \
                 a page): name another file",
                path.display(),
                String::from_utf8_lossy(h.namespace()),
                h.page_bytes
            )));
        }
        Ok(Some(h))
    }

    /// Opens the ready store at `path`, whatever it holds (an operator's
    /// look: `kvtier prefix status`); never makes one.
    pub fn open_existing(path: &Path, wait: Duration) -> Result<PrefixStore> {
        let (file, _) =
            shared_fs::open_file(path, shared_fs::Access::ReadWrite, &STORE_FILE, "path")?;
        let deadline = Instant::now() + wait;
        let locking = |how| flock_by(&file, path, how, deadline, wait);
        let header = Self::ready_header(&file, path, None, Some(&locking))?.ok_or_else(|| {
            Error::Pool(format!(
                "{} is not a ready kvtier prefix store (empty, or its maker died before it was ready)",
                path.display()
            ))
        })?;
        Self::attach(path, file, header)
    }

    fn map(file: &std::fs::File, path: &Path, len: u64) -> Result<MmapRaw> {
        let len = usize::try_from(len)
            .map_err(|_| invalid("path", "the store is larger than the address space"))?;
        let map = MmapOptions::new()
            .len(len)
            .map_raw(file)
            .map_err(|source| Error::Io {
                context: format!("mapping {}", path.display()),
                source,
            })?;
        // SAFETY: advice on a mapping this function made.
        unsafe { libc::madvise(map.as_ptr() as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
        Ok(map)
    }

    /// The store's geometry and namespace.
    pub fn info(&self) -> PrefixStoreInfo {
        PrefixStoreInfo {
            path: self.path.clone(),
            namespace: String::from_utf8_lossy(self.header.namespace()).into_owned(),
            page_bytes: self.header.page_bytes,
            slots: self.header.slots,
            file_bytes: self.header.file_bytes,
        }
    }

    fn word(&self, offset: u64) -> &AtomicU64 {
        // SAFETY: every caller's offset is 8-byte aligned and inside the
        // header, index or records (geometry checked at open); shared words
        // are only accessed atomically.
        unsafe { &*(self.map.as_ptr().add(offset as usize) as *const AtomicU64) }
    }

    fn counter(&self, i: usize) -> &AtomicU64 {
        self.word((COUNTERS + 8 * i) as u64)
    }

    fn bump(&self, i: usize) {
        self.counter(i).fetch_add(1, Ordering::Relaxed);
    }

    /// The counters, for every process of the store together.
    pub fn stats(&self) -> PrefixStats {
        let c = |i| self.counter(i).load(Ordering::Relaxed);
        PrefixStats {
            sets: c(0),
            hits: c(1),
            misses: c(2),
            evictions: c(3),
            reclaimed: c(4),
            full: c(5),
        }
    }

    fn bucket(&self, set: u64, way: u64) -> &AtomicU64 {
        self.word(self.header.index_offset + (set * WAYS + way) * 8)
    }

    fn record(&self, slot: u64) -> u64 {
        self.header.records_offset + slot * SLOT_RECORD_BYTES
    }

    fn state(&self, slot: u64) -> &AtomicU64 {
        self.word(self.record(slot))
    }

    fn key_hash(&self, slot: u64) -> &AtomicU64 {
        self.word(self.record(slot) + 8)
    }

    fn key_len(&self, slot: u64) -> &AtomicU64 {
        self.word(self.record(slot) + 16)
    }

    /// Whether slot `slot`'s record names `key` (its bytes read as they are:
    /// a record being rewritten compares unequal or is caught by the state).
    fn holds_key(&self, slot: u64, key: &[u8], hash: u64) -> bool {
        if self.key_hash(slot).load(Ordering::Acquire) != hash
            || self.key_len(slot).load(Ordering::Acquire) != key.len() as u64
        {
            return false;
        }
        let mut stored = [0u8; MAX_PAGE_KEY_BYTES];
        // SAFETY: inside the slot's record (key_len is at most
        // MAX_PAGE_KEY_BYTES, checked by the caller's key).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(self.record(slot) as usize + 32),
                stored.as_mut_ptr(),
                key.len(),
            )
        };
        stored[..key.len()] == *key
    }

    fn write_key(&self, slot: u64, key: &[u8], hash: u64) {
        // SAFETY: inside the slot's record; this process holds the slot's
        // writer lock, so nobody else writes it.
        unsafe {
            std::ptr::copy_nonoverlapping(
                key.as_ptr(),
                self.map.as_mut_ptr().add(self.record(slot) as usize + 32),
                key.len(),
            )
        };
        self.key_len(slot)
            .store(key.len() as u64, Ordering::Release);
        self.key_hash(slot).store(hash, Ordering::Release);
    }

    fn data(&self, slot: u64) -> *mut u8 {
        // SAFETY: slot < slots, so the page is inside the mapping.
        unsafe {
            self.map
                .as_mut_ptr()
                .add((self.header.data_offset + slot * self.header.slot_stride) as usize)
        }
    }

    /// Maps slot `slot`'s pages into this process in one call, the first
    /// time it copies the slot: touched one 4 KiB page at a time, a fresh
    /// mapping of tmpfs costs a fault each, which made a first copy ten times
    /// slower than the next (0.3-0.5 GB/s against 6-7 here). Where the kernel
    /// lacks `MADV_POPULATE_READ` (before 5.14) the faults happen as before.
    fn warm(&self, slot: u64) {
        let (word, bit) = ((slot / 64) as usize, 1u64 << (slot % 64));
        if self.warmed[word].load(Ordering::Relaxed) & bit != 0 {
            return;
        }
        // SAFETY: advice on a page-aligned range inside this process's
        // mapping (slots start on 4 KiB boundaries).
        unsafe {
            libc::madvise(
                self.data(slot) as *mut libc::c_void,
                self.header.slot_stride as usize,
                libc::MADV_POPULATE_READ,
            )
        };
        self.warmed[word].fetch_or(bit, Ordering::Relaxed);
    }

    fn set_of(&self, hash: u64) -> u64 {
        hash & (self.header.sets - 1)
    }

    fn bucket_value(hash: u64, slot: u64) -> u64 {
        ((hash >> 32) << 32) | (slot + 1)
    }

    /// The slot a bucket names, if it names one of this store's.
    fn slot_of(&self, b: u64) -> Option<u64> {
        if b == EMPTY || b == TOMB {
            return None;
        }
        let s = (b & 0xffff_ffff).checked_sub(1)?;
        (s < self.header.slots).then_some(s)
    }

    /// The slot that holds `key` in a state in `states`, by its index set.
    fn find(&self, key: &[u8], hash: u64, states: &[u64], except_way: Option<u64>) -> Option<u64> {
        let set = self.set_of(hash);
        (0..WAYS)
            .filter(|w| Some(*w) != except_way)
            .filter_map(|w| {
                let b = self.bucket(set, w).load(Ordering::Acquire);
                (b >> 32 == hash >> 32).then(|| self.slot_of(b)).flatten()
            })
            .find(|&s| {
                states.contains(&(self.state(s).load(Ordering::Acquire) & STATE_MASK))
                    && self.holds_key(s, key, hash)
            })
    }

    /// Whether `key`'s page is published (marking it recently used).
    pub fn exists(&self, key: &[u8]) -> Result<bool> {
        check_key(key)?;
        let hash = hash_key(key);
        Ok(match self.find(key, hash, &[PUBLISHED], None) {
            Some(s) => {
                self.state(s).fetch_or(REFERENCED, Ordering::Relaxed);
                true
            }
            None => false,
        })
    }

    /// How many of `keys`, from the first, are published: the longest
    /// prefix of them the store holds.
    pub fn prefix_len(&self, keys: &[&[u8]]) -> Result<usize> {
        for (i, k) in keys.iter().enumerate() {
            if !self.exists(k)? {
                return Ok(i);
            }
        }
        Ok(keys.len())
    }

    fn with_locker<R>(&self, f: impl FnOnce(&std::fs::File) -> R) -> Result<R> {
        let taken = self.lockers.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let locker = match taken {
            Some(l) => l,
            None => {
                // A new open file description of the same file (not a dup,
                // which would share this one's locks).
                let fd = format!("/proc/self/fd/{}", self.file.as_raw_fd());
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&fd)
                    .map_err(|source| Error::Io {
                        context: format!("opening {} again for its locks", self.path.display()),
                        source,
                    })?
            }
        };
        let r = f(&locker);
        self.lockers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(locker);
        Ok(r)
    }

    /// Copies `key`'s page into `dst` (the page's bytes laid end to end over
    /// the buffers, which must add up to the page's size). False when the
    /// store does not hold the page (or it is being evicted): `dst` may then
    /// hold anything.
    ///
    /// # Safety
    /// Each `(pointer, length)` of `dst` must be writable memory of that
    /// length, not overlapping the store's mapping or each other.
    pub unsafe fn get_into(&self, key: &[u8], dst: &[(*mut u8, usize)]) -> Result<bool> {
        check_key(key)?;
        self.check_parts(dst.iter().map(|d| d.1))?;
        let hash = hash_key(key);
        let Some(slot) = self.find(key, hash, &[PUBLISHED], None) else {
            self.bump(2);
            return Ok(false);
        };
        let got = self.with_locker(|locker| {
            let pin = PIN_LOCKS + slot as i64;
            if !lock_byte(locker, pin, libc::F_RDLCK) {
                return false; // being evicted
            }
            let state = self.state(slot).load(Ordering::Acquire);
            let ok = state & STATE_MASK == PUBLISHED && self.holds_key(slot, key, hash);
            if ok {
                self.warm(slot);
                let mut from = self.data(slot) as *const u8;
                for &(p, n) in dst {
                    // SAFETY: the caller's promise for `p`; the page is
                    // inside the mapping and pinned (nobody rewrites it).
                    unsafe {
                        std::ptr::copy_nonoverlapping(from, p, n);
                        from = from.add(n);
                    }
                }
                self.state(slot).fetch_or(REFERENCED, Ordering::Relaxed);
            }
            unlock_byte(locker, pin);
            ok
        })?;
        self.bump(if got { 1 } else { 2 });
        Ok(got)
    }

    fn check_parts(&self, lens: impl Iterator<Item = usize>) -> Result<()> {
        let total: u64 = lens.map(|n| n as u64).sum();
        if total != self.header.page_bytes {
            return Err(invalid(
                "buffers",
                format!(
                    "add up to {total} B; a page of this store is {} B",
                    self.header.page_bytes
                ),
            ));
        }
        Ok(())
    }

    /// Publishes `src` (the page's bytes laid end to end over the buffers,
    /// adding up to the page's size) under `key`, evicting the least
    /// recently used page when the store is full.
    ///
    /// # Safety
    /// Each `(pointer, length)` of `src` must be readable memory of that
    /// length.
    pub unsafe fn set_from(&self, key: &[u8], src: &[(*const u8, usize)]) -> Result<SetOutcome> {
        check_key(key)?;
        self.check_parts(src.iter().map(|s| s.1))?;
        let hash = hash_key(key);
        if self.find(key, hash, &[PUBLISHED, WRITING], None).is_some() {
            return Ok(SetOutcome::Present);
        }
        self.with_locker(|locker| {
            let Some(slot) = self.take_slot(locker) else {
                self.bump(5);
                return SetOutcome::Full;
            };
            self.write_key(slot, key, hash);
            self.warm(slot);
            let mut to = self.data(slot);
            for &(p, n) in src {
                // SAFETY: the caller's promise for `p`; the page is inside
                // the mapping and this process holds its writer lock.
                unsafe {
                    std::ptr::copy_nonoverlapping(p, to, n);
                    to = to.add(n);
                }
            }
            let mut outcome = self.insert(slot, key, hash);
            if outcome == SetOutcome::Full && self.evict_from_set(locker, self.set_of(hash)) {
                outcome = self.insert(slot, key, hash);
            }
            if outcome == SetOutcome::Stored {
                let state = self.state(slot).load(Ordering::Acquire);
                self.state(slot).store(
                    (state & !STATE_MASK & !REFERENCED) | PUBLISHED | REFERENCED,
                    Ordering::Release,
                );
                self.bump(0);
                unlock_byte(locker, WRITER_LOCKS + slot as i64);
            } else {
                self.release_free(locker, slot);
                if outcome == SetOutcome::Full {
                    self.bump(5);
                }
            }
            outcome
        })
    }

    /// Puts `slot` (WRITING, this process's) in `key`'s index set; Present
    /// when another holds the key, Full when the set has no free bucket.
    fn insert(&self, slot: u64, key: &[u8], hash: u64) -> SetOutcome {
        let live = [PUBLISHED, WRITING];
        if self.find(key, hash, &live, None).is_some() {
            return SetOutcome::Present;
        }
        let set = self.set_of(hash);
        let mine = Self::bucket_value(hash, slot);
        let Some(way) = (0..WAYS).find(|&w| {
            let b = self.bucket(set, w);
            [EMPTY, TOMB].into_iter().any(|free| {
                b.compare_exchange(free, mine, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            })
        }) else {
            return SetOutcome::Full;
        };
        // Another writer of the same key may have inserted meanwhile: the one
        // that sees the other withdraws (both may: a page lost, never two).
        if self.find(key, hash, &live, Some(way)).is_some() {
            let _ = self.bucket(set, way).compare_exchange(
                mine,
                TOMB,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            return SetOutcome::Present;
        }
        SetOutcome::Stored
    }

    /// Makes room in index set `set`: drops a bucket that names a free slot
    /// or another key's (left by a process killed between its insert and
    /// its record, or by a scribble), else evicts one page of the set that
    /// no reader holds (its slot left FREE); false when neither could be.
    fn evict_from_set(&self, locker: &std::fs::File, set: u64) -> bool {
        for w in 0..WAYS {
            let bucket = self.bucket(set, w);
            let b = bucket.load(Ordering::Acquire);
            let Some(t) = self.slot_of(b) else {
                continue;
            };
            let state = self.state(t).load(Ordering::Acquire) & STATE_MASK;
            let stale = state == FREE
                || (state == PUBLISHED
                    && self.key_hash(t).load(Ordering::Acquire) >> 32 != b >> 32);
            if stale
                && bucket
                    .compare_exchange(b, TOMB, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                return true;
            }
        }
        // the set's pages not used since the hand last passed, then any
        for referenced_too in [false, true] {
            for w in 0..WAYS {
                let Some(t) = self.slot_of(self.bucket(set, w).load(Ordering::Acquire)) else {
                    continue;
                };
                let state = self.state(t).load(Ordering::Acquire);
                if state & STATE_MASK == PUBLISHED
                    && (referenced_too || state & REFERENCED == 0)
                    && self.try_take(locker, t, true)
                {
                    self.release_free(locker, t);
                    return true;
                }
            }
        }
        false
    }

    /// Removes every bucket of `slot`'s key's set that names `slot`.
    fn unindex(&self, slot: u64) {
        let hash = self.key_hash(slot).load(Ordering::Acquire);
        let set = self.set_of(hash);
        for w in 0..WAYS {
            let b = self.bucket(set, w);
            let v = b.load(Ordering::Acquire);
            if self.slot_of(v) == Some(slot) {
                let _ = b.compare_exchange(v, TOMB, Ordering::AcqRel, Ordering::Acquire);
            }
        }
    }

    /// A slot for a new page, WRITING under a new generation, its writer
    /// lock held on `locker`: a free one, one a dead process left, or the
    /// least recently used page's (CLOCK). None when two sweeps find none.
    fn take_slot(&self, locker: &std::fs::File) -> Option<u64> {
        let slots = self.header.slots;
        let clock = self.word(CLOCK_WORD as u64);
        for _ in 0..slots.saturating_mul(2) {
            let slot = clock.fetch_add(1, Ordering::Relaxed) % slots;
            if self.try_take(locker, slot, false) {
                return Some(slot);
            }
        }
        None
    }

    /// Takes `slot` for writing if it can be had now (see [`take_slot`]);
    /// `force` ignores the reference bit (a clear).
    fn try_take(&self, locker: &std::fs::File, slot: u64, force: bool) -> bool {
        let writer = WRITER_LOCKS + slot as i64;
        if !lock_byte(locker, writer, libc::F_WRLCK) {
            return false; // another writer or evictor has it
        }
        let word = self.state(slot);
        let state = word.load(Ordering::Acquire);
        let next_gen = (state & !0xffff_ffff).wrapping_add(1 << 32);
        let taken = match state & STATE_MASK {
            PUBLISHED if state & REFERENCED != 0 && !force => {
                // a second chance
                let _ = word.compare_exchange(
                    state,
                    state & !REFERENCED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                false
            }
            PUBLISHED => {
                let evicting = (state & !STATE_MASK & !REFERENCED) | EVICTING;
                if word
                    .compare_exchange(state, evicting, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
                {
                    false
                } else if !lock_byte(locker, PIN_LOCKS + slot as i64, libc::F_WRLCK) {
                    // a reader is copying it: put it back
                    word.store(state, Ordering::Release);
                    false
                } else {
                    self.unindex(slot);
                    word.store(next_gen | WRITING, Ordering::Release);
                    unlock_byte(locker, PIN_LOCKS + slot as i64);
                    self.bump(3);
                    true
                }
            }
            FREE => {
                word.store(next_gen | WRITING, Ordering::Release);
                true
            }
            _ => {
                // WRITING or EVICTING (or a word no version writes) with its
                // writer lock free: its process died mid-way
                self.unindex(slot);
                word.store(next_gen | WRITING, Ordering::Release);
                self.bump(4);
                true
            }
        };
        if !taken {
            unlock_byte(locker, writer);
        }
        taken
    }

    /// Leaves `slot` (taken by [`try_take`](Self::try_take) on `locker`)
    /// FREE under its generation, and gives its writer lock back.
    fn release_free(&self, locker: &std::fs::File, slot: u64) {
        let state = self.state(slot).load(Ordering::Acquire);
        self.state(slot)
            .store(state & !STATE_MASK & !REFERENCED, Ordering::Release);
        unlock_byte(locker, WRITER_LOCKS + slot as i64);
    }

    /// Evicts every page no reader holds now; the number evicted.
    pub fn clear(&self) -> Result<u64> {
        self.with_locker(|locker| {
            let mut n = 0;
            for slot in 0..self.header.slots {
                let was = self.state(slot).load(Ordering::Acquire) & STATE_MASK;
                if was == FREE {
                    continue;
                }
                if self.try_take(locker, slot, true) {
                    self.release_free(locker, slot);
                    n += (was == PUBLISHED) as u64;
                }
            }
            n
        })
    }

    /// Pages published now (a scan of the slots' states).
    pub fn published(&self) -> u64 {
        (0..self.header.slots)
            .filter(|&s| self.state(s).load(Ordering::Relaxed) & STATE_MASK == PUBLISHED)
            .count() as u64
    }

    #[cfg(test)]
    fn raw(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }
}

impl std::fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixStore")
            .field("info", &self.info())
            .finish()
    }
}

const _: () = assert!(COUNTER_NAMES * 8 + COUNTERS <= HEADER_BYTES as usize);

/// Removes the prefix store file at `path`: refused while any process has it
/// open (they hold its shared lock), and for a file that is not a prefix
/// store (its bytes are someone else's).
pub fn destroy(path: &Path) -> Result<()> {
    let (file, meta) =
        shared_fs::open_file(path, shared_fs::Access::ReadWrite, &STORE_FILE, "path")?;
    let mut magic = [0u8; 8];
    let n = std::os::unix::fs::FileExt::read_at(&file, &mut magic, 0).unwrap_or(0);
    if n < 8 || magic != PREFIX_MAGIC {
        return Err(Error::Pool(format!(
            "{} is not a kvtier prefix store: not removed",
            path.display()
        )));
    }
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let pids: Vec<String> = crate::table::holders(path)?
            .iter()
            .map(|h| h.pid.to_string())
            .collect();
        return Err(Error::Pool(format!(
            "{} is open in {}: not removed",
            path.display(),
            if pids.is_empty() {
                "another process".to_string()
            } else {
                format!("pid {}", pids.join(", pid "))
            }
        )));
    }
    // The path must still name the file locked.
    crate::table::remove_still_named(path, &meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Scratch(PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn scratch(name: &str) -> Scratch {
        let dir = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let p = dir.join(format!("kvtier-prefix-{name}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        Scratch(p)
    }

    const WAIT: Duration = Duration::from_secs(5);

    fn open(p: &Scratch, page: u64, slots: u64) -> PrefixStore {
        PrefixStore::open_or_create(&p.0, "test-model/page_first/bf16", page, slots, WAIT).unwrap()
    }

    fn page(seed: u8, n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| seed.wrapping_mul(31).wrapping_add(i as u8))
            .collect()
    }

    fn set(s: &PrefixStore, key: &str, bytes: &[u8]) -> SetOutcome {
        let half = bytes.len() / 3;
        let parts = [
            (bytes.as_ptr(), half),
            (bytes[half..].as_ptr(), bytes.len() - half),
        ];
        // SAFETY: both parts are inside `bytes`.
        unsafe { s.set_from(key.as_bytes(), &parts) }.unwrap()
    }

    fn get(s: &PrefixStore, key: &str, n: usize) -> Option<Vec<u8>> {
        let mut out = vec![0u8; n];
        let (a, b) = out.split_at_mut(n / 2);
        let parts = [(a.as_mut_ptr(), a.len()), (b.as_mut_ptr(), b.len())];
        // SAFETY: both parts are inside `out`.
        unsafe { s.get_into(key.as_bytes(), &parts) }
            .unwrap()
            .then_some(out)
    }

    #[test]
    fn a_page_set_by_one_handle_is_found_by_another_and_after_reopening() {
        let p = scratch("share");
        let a = open(&p, 10_000, 16);
        let b = open(&p, 10_000, 99); // the store's own slot count wins
        assert_eq!(b.info().slots, 16);
        assert_eq!(set(&a, "k1", &page(1, 10_000)), SetOutcome::Stored);
        assert_eq!(set(&b, "k1", &page(9, 10_000)), SetOutcome::Present);
        assert_eq!(get(&b, "k1", 10_000), Some(page(1, 10_000)));
        assert_eq!(get(&b, "k2", 10_000), None);
        assert_eq!(a.prefix_len(&[b"k1", b"k2", b"k1"]).unwrap(), 1);
        drop((a, b));
        let c = open(&p, 10_000, 16);
        assert_eq!(get(&c, "k1", 10_000), Some(page(1, 10_000)));
        let st = c.stats();
        assert_eq!((st.sets, st.hits, st.misses), (1, 2, 1));
    }

    #[test]
    fn a_full_index_set_makes_room_by_dropping_stale_buckets_or_evicting_its_own_pages() {
        let p = scratch("set-full");
        let s = open(&p, 4096, 2);
        let set_of = |k: &str| s.set_of(hash_key(k.as_bytes()));
        // eight buckets of "m"'s set naming free slot 1 under another key's tag
        for w in 0..WAYS {
            s.bucket(set_of("m"), w)
                .store((0xabcd << 32) | 2, Ordering::Release);
        }
        assert_eq!(set(&s, "m", &page(1, 4096)), SetOutcome::Stored);
        assert_eq!(get(&s, "m", 4096), Some(page(1, 4096)));
        s.clear().unwrap();
        // a key of "m"'s set, its page live, named by all eight buckets: the
        // set is full of live entries, and that page is evicted for "m"
        let k = (0..)
            .map(|i| format!("k{i}"))
            .find(|k| set_of(k) == set_of("m"))
            .unwrap();
        assert_eq!(set(&s, &k, &page(2, 4096)), SetOutcome::Stored);
        let held = (0..2).find(|&t| s.state(t).load(Ordering::Acquire) & STATE_MASK == PUBLISHED);
        let value = PrefixStore::bucket_value(hash_key(k.as_bytes()), held.unwrap());
        for w in 0..WAYS {
            s.bucket(set_of("m"), w).store(value, Ordering::Release);
        }
        assert_eq!(set(&s, "m", &page(3, 4096)), SetOutcome::Stored);
        assert_eq!(get(&s, "m", 4096), Some(page(3, 4096)));
        assert_eq!(get(&s, &k, 4096), None);
    }

    #[test]
    fn many_openers_of_a_new_store_at_once_all_get_it_and_it_is_made_once() {
        let p = scratch("race");
        for round in 0..20 {
            let _ = std::fs::remove_file(&p.0);
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(6));
            let threads: Vec<_> = (0..6)
                .map(|_| {
                    let (path, barrier) = (p.0.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        PrefixStore::open_or_create(&path, "ns", 4096, 8, WAIT)
                    })
                })
                .collect();
            let opened: Result<Vec<PrefixStore>> =
                threads.into_iter().map(|t| t.join().unwrap()).collect();
            let opened = opened.unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert_eq!(set(&opened[0], "k", &page(1, 4096)), SetOutcome::Stored);
            assert!(
                opened
                    .iter()
                    .all(|s| get(s, "k", 4096) == Some(page(1, 4096)))
            );
        }
    }

    #[test]
    fn a_full_store_evicts_the_least_recently_used_page() {
        let p = scratch("evict");
        let s = open(&p, 4096, 4);
        for k in 0..4u8 {
            assert_eq!(
                set(&s, &format!("k{k}"), &page(k, 4096)),
                SetOutcome::Stored
            );
        }
        // every page has its reference bit from its set; k0 is read again
        assert!(get(&s, "k0", 4096).is_some());
        for k in 4..8u8 {
            assert_eq!(
                set(&s, &format!("k{k}"), &page(k, 4096)),
                SetOutcome::Stored
            );
        }
        assert_eq!(s.published(), 4);
        for k in 4..8u8 {
            assert_eq!(get(&s, &format!("k{k}"), 4096), Some(page(k, 4096)), "k{k}");
        }
        assert_eq!(s.stats().evictions, 4);
    }

    #[test]
    fn a_pinned_page_is_never_evicted_and_a_store_of_pinned_pages_is_full() {
        let p = scratch("pinned");
        let s = open(&p, 4096, 2);
        set(&s, "a", &page(1, 4096));
        set(&s, "b", &page(2, 4096));
        // another process's reader holds both pins (its own open file)
        let reader = std::fs::File::open(&p.0).unwrap();
        for slot in 0..2 {
            assert!(lock_byte(&reader, PIN_LOCKS + slot, libc::F_RDLCK));
        }
        assert_eq!(set(&s, "c", &page(3, 4096)), SetOutcome::Full);
        assert_eq!(get(&s, "a", 4096), Some(page(1, 4096)));
        assert_eq!(get(&s, "b", 4096), Some(page(2, 4096)));
        assert_eq!(s.stats().full, 1);
        drop(reader);
        assert_eq!(set(&s, "c", &page(3, 4096)), SetOutcome::Stored);
    }

    #[test]
    fn a_writer_killed_mid_page_leaves_nothing_visible_and_its_slot_is_reclaimed() {
        let p = scratch("killed");
        let s = open(&p, 4096, 1);
        // a dead writer: slot 0 WRITING with a key and a bucket, no lock held
        let hash = hash_key(b"half");
        s.write_key(0, b"half", hash);
        s.state(0).store((1 << 32) | WRITING, Ordering::Release);
        let set_no = s.set_of(hash);
        s.bucket(set_no, 0)
            .store(PrefixStore::bucket_value(hash, 0), Ordering::Release);
        assert!(!s.exists(b"half").unwrap());
        assert_eq!(get(&s, "half", 4096), None);
        // a live writer holds its lock: the slot is not taken from it
        let writer = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p.0)
            .unwrap();
        assert!(lock_byte(&writer, WRITER_LOCKS, libc::F_WRLCK));
        assert_eq!(set(&s, "new", &page(5, 4096)), SetOutcome::Full);
        drop(writer); // the writer dies
        assert_eq!(set(&s, "new", &page(5, 4096)), SetOutcome::Stored);
        assert_eq!(get(&s, "new", 4096), Some(page(5, 4096)));
        assert_eq!(s.stats().reclaimed, 1);
        assert!(
            s.find(b"half", hash, &[PUBLISHED, WRITING, EVICTING, FREE], None)
                .is_none(),
            "the dead writer's key is gone"
        );
    }

    #[test]
    fn the_same_key_written_at_once_is_kept_once_and_threads_never_read_a_torn_page() {
        let p = scratch("threads");
        let s = std::sync::Arc::new(open(&p, 8192, 8));
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for round in 0..300u32 {
                        let k = format!("key{}", round % 12);
                        let seed = (round % 12) as u8;
                        if (round + t as u32).is_multiple_of(3) {
                            set(&s, &k, &page(seed, 8192));
                        } else if let Some(got) = get(&s, &k, 8192) {
                            assert_eq!(got, page(seed, 8192), "{k}");
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        // no key is published twice
        let mut seen = std::collections::HashSet::new();
        for slot in 0..8 {
            if s.state(slot).load(Ordering::Acquire) & STATE_MASK == PUBLISHED {
                let n = s.key_len(slot).load(Ordering::Acquire) as usize;
                let mut k = vec![0u8; n];
                // SAFETY: inside the record.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        s.raw().add(s.record(slot) as usize + 32),
                        k.as_mut_ptr(),
                        n,
                    )
                };
                assert!(seen.insert(k), "a key published twice");
            }
        }
    }

    #[test]
    fn a_foreign_or_mismatched_or_corrupt_file_is_refused_and_never_written() {
        let p = scratch("foreign");
        std::fs::write(&p.0, b"another program's bytes").unwrap();
        let e = PrefixStore::open_or_create(&p.0, "ns", 4096, 4, WAIT).unwrap_err();
        assert!(e.to_string().contains("not a kvtier prefix store"), "{e}");
        assert_eq!(std::fs::read(&p.0).unwrap(), b"another program's bytes");
        std::fs::remove_file(&p.0).unwrap();
        drop(open(&p, 4096, 4));
        let e = PrefixStore::open_or_create(&p.0, "other", 4096, 4, WAIT).unwrap_err();
        assert!(e.to_string().contains("holds pages of `test-model"), "{e}");
        let e = PrefixStore::open_or_create(&p.0, "test-model/page_first/bf16", 8192, 4, WAIT)
            .unwrap_err();
        assert!(e.to_string().contains("4096 B a page"), "{e}");
        // a flipped geometry byte
        let mut bytes = std::fs::read(&p.0).unwrap();
        bytes[24] ^= 1;
        std::fs::write(&p.0, &bytes).unwrap();
        let e = PrefixStore::open_or_create(&p.0, "test-model/page_first/bf16", 4096, 4, WAIT)
            .unwrap_err();
        assert!(
            e.to_string().contains("not a valid kvtier prefix store"),
            "{e}"
        );
        for bad in [&b""[..], &[b'x'; MAX_PAGE_KEY_BYTES + 1][..]] {
            std::fs::remove_file(&p.0).unwrap();
            let s = open(&p, 4096, 4);
            assert!(s.exists(bad).is_err());
        }
    }

    #[test]
    fn a_scribbled_index_and_records_give_misses_or_true_pages_never_a_crash() {
        use rand::{Rng, SeedableRng};
        let p = scratch("scribble");
        let s = open(&p, 4096, 64);
        for k in 0..64u8 {
            set(&s, &format!("k{k}"), &page(k, 4096));
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (from, to) = (s.header.index_offset, s.header.data_offset);
        for round in 0..2000 {
            let at = rng.random_range(from..to) as usize & !7;
            // SAFETY: inside the metadata part of the mapping; 8-aligned.
            unsafe {
                (*(s.raw().add(at) as *const AtomicU64)).store(rng.random(), Ordering::Relaxed)
            };
            let k = round % 80;
            if let Some(got) = get(&s, &format!("k{k}"), 4096) {
                // a page is only ever returned under its own key's record
                assert!(k < 64 && got == page(k as u8, 4096), "k{k}");
            }
            let _ = s.exists(format!("k{k}").as_bytes());
            let _ = set(&s, &format!("n{round}"), &page(1, 4096));
        }
    }
}
