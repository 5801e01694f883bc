//! Who a process is, in a way that survives pid reuse: its pid, the time it
//! started (in clock ticks since boot, `/proc/<pid>/stat` field 22), and the
//! boot it started in (`/proc/sys/kernel/random/boot_id`). A recorded owner is
//! alive only while a process with that pid exists, has not exited (no
//! zombie), and started at that same tick of that same boot.

use std::fs;

use crate::error::{Error, Result};

/// A process identity, as recorded in the pool's client table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessIdentity {
    pub pid: u32,
    pub start_ticks: u64,
    pub boot_id: u128,
}

/// What can be said about a recorded owner from this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    Alive,
    Dead,
    /// Recorded by another boot while other hosts may share the pool: it may
    /// be a process on another host, which this one cannot see.
    Unknown,
}

impl ProcessIdentity {
    /// The calling process.
    pub fn current() -> Result<Self> {
        let pid = std::process::id();
        let start_ticks = start_ticks(pid)?.ok_or_else(|| {
            Error::Pool("cannot read /proc/self/stat to identify this process".into())
        })?;
        Ok(ProcessIdentity {
            pid,
            start_ticks,
            boot_id: boot_id()?,
        })
    }

    /// Whether the recorded process is still running. With `same_host_only`
    /// (one host uses the pool), another boot id means the machine has
    /// rebooted since, so the owner is dead; otherwise it is Unknown.
    pub fn liveness(&self, same_host_only: bool) -> Result<Liveness> {
        if self.boot_id != boot_id()? {
            return Ok(if same_host_only {
                Liveness::Dead
            } else {
                Liveness::Unknown
            });
        }
        Ok(match start_ticks(self.pid)? {
            Some(t) if t == self.start_ticks => Liveness::Alive,
            _ => Liveness::Dead,
        })
    }
}

/// This process's PID namespace: the inode of `/proc/self/ns/pid` (0 where
/// the kernel does not say). A recorded pid means something here only when
/// it was recorded in the same namespace.
pub fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata("/proc/self/ns/pid")
        .map(|m| m.ino())
        .unwrap_or(0)
}

/// This process's effective user (as this user namespace numbers it).
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// A lock a client holds on its slot for as long as it is attached: an
/// open-file-description lock (`F_OFD_SETLK`) on one byte of the pool's
/// first device, far past its end. The kernel drops it when the holder's
/// last reference to the file goes (its exit, a crash), in whatever PID
/// namespace or container the holder runs, so a lock that is held means a
/// live holder.
pub(crate) struct ClientLock {
    file: fs::File,
    /// The locked file's device and inode, as this process sees them.
    id: u64,
}

/// Where slot `i`'s byte is.
const LOCK_BASE: i64 = 1 << 62;

/// Where region `i`'s hold byte is: every process that maps a region another
/// process allocated (a shared region, [`crate::Pool::join_region`]) holds a
/// shared lock on it, so that no reclaim frees a region a live process maps.
const REGION_HOLD_BASE: i64 = 1 << 61;

/// The byte every attached client holds a shared (read) lock on, on every
/// shared device it maps: a mark that the device is in use by a pool's
/// live holder, whichever device of the pool it is.
const HOLDER_BYTE: i64 = LOCK_BASE - 1;

/// Marks `file` (a shared device this process maps as a pool's client) as
/// in use, for as long as this open file description lives (the kernel
/// drops the mark when the last descriptor of it closes: at exit, a crash).
pub(crate) fn mark_holder(file: &fs::File) -> Result<()> {
    ofd_lock(
        file,
        libc::F_OFD_SETLK,
        libc::F_RDLCK as libc::c_short,
        HOLDER_BYTE,
        1,
    )
    .map(|_| ())
    .map_err(|source| Error::Io {
        context: "marking a pool device as in use".into(),
        source,
    })
}

/// Whether any live process holds `file` as a pool client: the holder mark
/// ([`mark_holder`]) or a client slot's lock.
pub(crate) fn in_use(file: &fs::File, slots: u32) -> bool {
    let marked = ofd_lock(
        file,
        libc::F_OFD_GETLK,
        libc::F_WRLCK as libc::c_short,
        HOLDER_BYTE,
        1,
    )
    .is_ok_and(|fl| fl.l_type != libc::F_UNLCK as libc::c_short);
    marked || ClientLock::any_held(file, slots)
}

fn ofd_lock(
    file: &fs::File,
    cmd: libc::c_int,
    kind: libc::c_short,
    start: i64,
    len: i64,
) -> std::io::Result<libc::flock> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock is plain data; l_pid must be 0 for OFD locks.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = start;
    fl.l_len = len;
    // SAFETY: a valid descriptor and a flock it may read and write.
    if unsafe { libc::fcntl(file.as_raw_fd(), cmd, &mut fl) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fl)
}

impl ClientLock {
    pub(crate) fn new(file: &fs::File) -> Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let meta = file.metadata().map_err(|source| Error::Io {
            context: "reading the pool device's inode".into(),
            source,
        })?;
        // never 0, which marks "no lock recorded"
        let id = (meta.dev().rotate_left(32) ^ meta.ino()) | 1;
        let file = file.try_clone().map_err(|source| Error::Io {
            context: "duplicating the pool device's descriptor".into(),
            source,
        })?;
        Ok(ClientLock { file, id })
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    fn fcntl(
        &self,
        cmd: libc::c_int,
        kind: libc::c_short,
        slot: u32,
    ) -> std::io::Result<libc::flock> {
        ofd_lock(&self.file, cmd, kind, LOCK_BASE + slot as i64, 1)
    }

    /// `fcntl` on region `index`'s hold byte (see [`REGION_HOLD_BASE`]).
    fn region_lock(
        &self,
        cmd: libc::c_int,
        kind: libc::c_int,
        index: u32,
    ) -> std::io::Result<libc::flock> {
        let at = REGION_HOLD_BASE + index as i64;
        ofd_lock(&self.file, cmd, kind as libc::c_short, at, 1)
    }

    /// Takes this process's shared hold on region `index`; holding it twice
    /// is holding it once.
    pub(crate) fn hold_region(&self, index: u32) -> Result<()> {
        self.region_lock(libc::F_OFD_SETLK, libc::F_RDLCK, index)
            .map(|_| ())
            .map_err(|source| Error::Io {
                context: format!("holding region {index}"),
                source,
            })
    }

    pub(crate) fn release_region(&self, index: u32) {
        let _ = self.region_lock(libc::F_OFD_SETLK, libc::F_UNLCK, index);
    }

    /// Whether another open file (a live process, or another pool handle of
    /// this one) holds region `index`; unknown counts as held, so that a
    /// kernel that cannot say never lets a mapped region be freed.
    pub(crate) fn region_held_by_another(&self, index: u32) -> bool {
        self.region_lock(libc::F_OFD_GETLK, libc::F_WRLCK, index)
            .map_or(true, |fl| fl.l_type != libc::F_UNLCK as libc::c_short)
    }

    /// Takes slot `slot`'s lock; false when another holds it.
    pub(crate) fn take(&self, slot: u32) -> Result<bool> {
        match self.fcntl(libc::F_OFD_SETLK, libc::F_WRLCK as libc::c_short, slot) {
            Ok(_) => Ok(true),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {
                Ok(false)
            }
            Err(source) => Err(Error::Io {
                context: format!("locking client slot {slot}"),
                source,
            }),
        }
    }

    pub(crate) fn release(&self, slot: u32) {
        let _ = self.fcntl(libc::F_OFD_SETLK, libc::F_UNLCK as libc::c_short, slot);
    }

    /// Whether any process still holds a client lock on `file`: processes
    /// attached to a pool that was there (destroyed with force, say), which
    /// a new pool on the file would hand their regions to others under.
    pub(crate) fn any_held(file: &fs::File, slots: u32) -> bool {
        use std::os::fd::AsRawFd;
        // SAFETY: flock is plain data; l_pid must be 0 for OFD locks.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = libc::F_WRLCK as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = LOCK_BASE;
        fl.l_len = slots as i64;
        // SAFETY: a valid descriptor and a flock it may read and write.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
        rc == 0 && fl.l_type != libc::F_UNLCK as libc::c_short
    }

    /// Whether another open file (a live process) holds slot `slot`'s lock;
    /// None when the kernel cannot say.
    pub(crate) fn held_by_another(&self, slot: u32) -> Option<bool> {
        self.fcntl(libc::F_OFD_GETLK, libc::F_WRLCK as libc::c_short, slot)
            .ok()
            .map(|fl| fl.l_type != libc::F_UNLCK as libc::c_short)
    }
}

/// The boot id of this machine, as 128 bits.
pub fn boot_id() -> Result<u128> {
    let text =
        fs::read_to_string("/proc/sys/kernel/random/boot_id").map_err(|source| Error::Io {
            context: "reading /proc/sys/kernel/random/boot_id".into(),
            source,
        })?;
    let hex: String = text.trim().chars().filter(|c| *c != '-').collect();
    u128::from_str_radix(&hex, 16)
        .map_err(|_| Error::Pool(format!("unexpected boot id {:?}", text.trim())))
}

/// The start time of a running (not zombie) process, or None when there is no
/// such process.
fn start_ticks(pid: u32) -> Result<Option<u64>> {
    let stat = match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s,
        // gone, or exiting while we read (ESRCH)
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                || e.raw_os_error() == Some(libc::ESRCH) =>
        {
            return Ok(None);
        }
        Err(source) => {
            return Err(Error::Io {
                context: format!("reading /proc/{pid}/stat"),
                source,
            });
        }
    };
    Ok(parse_stat(&stat))
}

/// Parses `/proc/<pid>/stat`: the start time (field 22) of a process that has
/// not exited, None for a zombie or dead one. The command name (field 2) may
/// hold spaces and parentheses, so fields are counted after its last ')'.
fn parse_stat(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); field 22 is at index 19
    let state = *fields.first()?;
    if state == "Z" || state == "X" || state == "x" {
        return None;
    }
    fields.get(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_lines() {
        let line = "4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000000 100";
        assert_eq!(parse_stat(line), Some(987654));
        let zombie = "4242 (x) Z 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 0 0";
        assert_eq!(parse_stat(zombie), None);
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn this_process_is_alive_and_a_made_up_one_is_not() {
        let me = ProcessIdentity::current().unwrap();
        assert_eq!(me.liveness(true).unwrap(), Liveness::Alive);
        let reused = ProcessIdentity {
            start_ticks: me.start_ticks + 1,
            ..me
        };
        assert_eq!(
            reused.liveness(true).unwrap(),
            Liveness::Dead,
            "same pid, other start time"
        );
        let rebooted = ProcessIdentity {
            boot_id: me.boot_id ^ 1,
            ..me
        };
        assert_eq!(rebooted.liveness(true).unwrap(), Liveness::Dead);
        assert_eq!(rebooted.liveness(false).unwrap(), Liveness::Unknown);
        let gone = ProcessIdentity {
            pid: u32::MAX - 7,
            ..me
        };
        assert_eq!(gone.liveness(true).unwrap(), Liveness::Dead);
    }
}
