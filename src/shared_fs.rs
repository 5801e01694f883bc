//! Files and directories in places other users can write (`/dev/shm`,
//! `/tmp`, a hugetlbfs mount): the one rule by which kvtier opens every
//! such file — pool devices, tables, the run directory and what clients
//! publish in it, traces.
//!
//! Anything at a predictable path there may have been planted by another
//! local user: a symbolic link to a file of the victim's, a FIFO that hangs
//! whoever opens it, `/dev/zero`, a directory of the attacker's. So:
//!
//! - a path is opened without following a final symbolic link
//!   (`O_NOFOLLOW`) and without waiting on a FIFO (`O_NONBLOCK`, cleared
//!   once the descriptor is known to name a regular file);
//! - what was opened is judged on the open descriptor (`fstat`), never on
//!   the path again: its type (a regular file, or a DAX device where one is
//!   allowed), its owner and its mode;
//! - a directory is made with `mkdir` and, made or found, opened without
//!   following a link and checked the same way; what lies below it is
//!   opened relative to that descriptor (`openat`), so nobody can swap a
//!   directory of the path for a link meanwhile;
//! - a reader stops at the bytes it allows, whatever `st_size` says.

use std::ffi::CString;
use std::fs::{File, Metadata};
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result, invalid};

/// Whose a file or directory must be for kvtier to use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// This process's effective user.
    Me,
    /// This user, or a group this process is in where the mode gives that
    /// group read and write (a pool shared with a group).
    MeOrSharingGroup,
    /// This user, or this process's effective group where the mode gives
    /// it read and write (a table: supplementary groups such as `wheel` or
    /// `users` are too wide to trust with a model's weights).
    MeOrMyGroup,
    /// Exactly this user: another process's file, as that process's client
    /// entry names its user.
    User(u32),
}

/// What a file must be.
#[derive(Clone, Copy, Debug)]
pub struct FileRule {
    pub owner: Owner,
    /// Mode bits that must be clear: `0o002` (others may not write it),
    /// `0o022` (nor its group), `0o007` (others may not touch it).
    pub forbidden_mode: u32,
    /// Which devices are accepted beside regular files (their owner is not
    /// checked: device nodes are root's, and opening one is the kernel's
    /// check).
    pub devices: Devices,
    /// A file with other hard links is refused (a link planted to another
    /// user's file).
    pub single_link: bool,
}

/// The devices a [`FileRule`] accepts beside regular files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Devices {
    None,
    /// A DAX character device (a table on devdax).
    Dax,
    /// Any character device (an output named `/dev/null`).
    Char,
}

/// What a directory below a base must be.
#[derive(Clone, Copy, Debug)]
pub struct DirRule {
    pub owner: Owner,
    pub forbidden_mode: u32,
}

/// How a file is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    ReadWrite,
    /// Read and write, made with `mode` if missing.
    Create {
        mode: u32,
    },
    /// Read and write, made with `mode`; an existing entry is an error
    /// (`AlreadyExists`).
    CreateNew {
        mode: u32,
    },
}

fn cstring(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| invalid("path", format!("{} holds a NUL byte", p.display())))
}

fn geteuid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// Whether this process's effective or supplementary groups include `gid`.
fn in_my_groups(gid: u32) -> bool {
    // SAFETY: getegid has no preconditions.
    if unsafe { libc::getegid() } == gid {
        return true;
    }
    // SAFETY: a first call with size 0 returns the count.
    let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
    if n <= 0 {
        return false;
    }
    let mut groups = vec![0 as libc::gid_t; n as usize];
    // SAFETY: `groups` holds `n` entries.
    let n = unsafe { libc::getgroups(n, groups.as_mut_ptr()) };
    n > 0 && groups[..n as usize].contains(&gid)
}

fn owner_ok(owner: Owner, meta: &Metadata) -> bool {
    match owner {
        Owner::Me => meta.uid() == geteuid(),
        Owner::MeOrSharingGroup => {
            meta.uid() == geteuid() || (meta.mode() & 0o060 == 0o060 && in_my_groups(meta.gid()))
        }
        Owner::MeOrMyGroup => {
            // SAFETY: getegid has no preconditions.
            meta.uid() == geteuid()
                || (meta.mode() & 0o060 == 0o060 && meta.gid() == unsafe { libc::getegid() })
        }
        Owner::User(u) => meta.uid() == u,
    }
}

fn whose(owner: Owner) -> String {
    match owner {
        Owner::Me => format!("this process's user {}", geteuid()),
        Owner::MeOrSharingGroup => format!(
            "this process's user {}, or a group of its that the mode shares it with",
            geteuid()
        ),
        Owner::MeOrMyGroup => format!(
            "this process's user {}, or its group where the mode shares it with that group",
            geteuid()
        ),
        Owner::User(u) => format!("user {u}"),
    }
}

/// What a file type is, in words.
fn kind_of(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_file() {
        "a regular file"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "not a file"
    }
}

/// Whether the character device `meta` describes is a DAX device (its
/// sysfs node's subsystem is `dax`).
pub fn is_dax(meta: &Metadata) -> bool {
    if !meta.file_type().is_char_device() {
        return false;
    }
    let (major, minor) = (libc::major(meta.rdev()), libc::minor(meta.rdev()));
    std::fs::read_link(format!("/sys/dev/char/{major}:{minor}/subsystem"))
        .ok()
        .and_then(|l| l.file_name().map(|n| n == "dax"))
        .unwrap_or(false)
}

/// Whether `meta`'s owner and mode are what `owner` and `forbidden_mode`
/// allow (a file's or a directory's alike), in words when not.
fn check_owner_and_mode(
    path: &Path,
    meta: &Metadata,
    owner: Owner,
    forbidden_mode: u32,
    arg: &'static str,
) -> Result<()> {
    if !owner_ok(owner, meta) {
        return Err(invalid(
            arg,
            format!(
                "{} belongs to user {} (group {}), not to {}; kvtier does not trust it (remove it, as root if need \
                 be, or name another)",
                path.display(),
                meta.uid(),
                meta.gid(),
                whose(owner)
            ),
        ));
    }
    let mode = meta.mode() & 0o7777;
    if mode & forbidden_mode != 0 {
        return Err(invalid(
            arg,
            format!(
                "{} is open to {} (mode {mode:04o}): it may be written by other users than its owner, under \
                 kvtier; kvtier does not use it",
                path.display(),
                if mode & forbidden_mode & 0o007 != 0 {
                    "other users"
                } else {
                    "its group"
                }
            ),
        ));
    }
    Ok(())
}

/// Checks what the descriptor of `path` names against `rule`.
pub fn check_file(path: &Path, meta: &Metadata, rule: &FileRule, arg: &'static str) -> Result<()> {
    let t = meta.file_type();
    let device = match rule.devices {
        Devices::None => false,
        Devices::Dax => is_dax(meta),
        Devices::Char => t.is_char_device(),
    };
    if !t.is_file() && !device {
        return Err(invalid(
            arg,
            format!(
                "{} is {}; kvtier uses only regular files{} here",
                path.display(),
                kind_of(meta),
                match rule.devices {
                    Devices::None => "",
                    Devices::Dax => " and DAX devices",
                    Devices::Char => " and character devices",
                }
            ),
        ));
    }
    if device {
        return Ok(());
    }
    check_owner_and_mode(path, meta, rule.owner, rule.forbidden_mode, arg)?;
    if rule.single_link && meta.nlink() > 1 {
        return Err(invalid(
            arg,
            format!(
                "{} has {} hard links (a link to another file); kvtier does not trust it",
                path.display(),
                meta.nlink()
            ),
        ));
    }
    Ok(())
}

fn flags(access: Access) -> (libc::c_int, libc::mode_t) {
    let base = libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY;
    match access {
        Access::Read => (base | libc::O_RDONLY, 0),
        Access::ReadWrite => (base | libc::O_RDWR, 0),
        Access::Create { mode } => (base | libc::O_RDWR | libc::O_CREAT, mode as libc::mode_t),
        Access::CreateNew { mode } => (
            base | libc::O_RDWR | libc::O_CREAT | libc::O_EXCL,
            mode as libc::mode_t,
        ),
    }
}

/// The error of an open that failed: a link says so; others keep the
/// system's own words.
fn open_error(path: &Path, arg: &'static str, e: std::io::Error) -> Error {
    if e.raw_os_error() == Some(libc::ELOOP) {
        invalid(
            arg,
            format!(
                "{} is a symbolic link; kvtier does not follow links here (name the file itself)",
                path.display()
            ),
        )
    } else {
        Error::Io {
            context: format!("opening {}", path.display()),
            source: e,
        }
    }
}

/// Clears `O_NONBLOCK` on a descriptor known to be a regular file or a
/// device (reads and writes then behave as usual).
fn set_blocking(f: &File) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor this process owns.
    let fl = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) };
    if fl < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, fl & !libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn open_checked(
    dir: libc::c_int,
    name: &Path,
    shown: &Path,
    access: Access,
    rule: &FileRule,
    arg: &'static str,
) -> Result<(File, Metadata)> {
    let c = cstring(name)?;
    let (fl, mode) = flags(access);
    // SAFETY: a valid C string; the descriptor returned is owned below.
    let fd = unsafe { libc::openat(dir, c.as_ptr(), fl, mode as libc::c_uint) };
    if fd < 0 {
        return Err(open_error(shown, arg, std::io::Error::last_os_error()));
    }
    // SAFETY: a descriptor just opened, owned by nothing else.
    let file = unsafe { File::from_raw_fd(fd) };
    let meta = file.metadata().map_err(|source| Error::Io {
        context: format!("reading {}", shown.display()),
        source,
    })?;
    check_file(shown, &meta, rule, arg)?;
    set_blocking(&file).map_err(|source| Error::Io {
        context: format!("opening {}", shown.display()),
        source,
    })?;
    Ok((file, meta))
}

/// Opens `path` by the rule: no final link followed, no FIFO waited on,
/// type, owner and mode checked on the descriptor.
pub fn open_file(
    path: &Path,
    access: Access,
    rule: &FileRule,
    arg: &'static str,
) -> Result<(File, Metadata)> {
    open_checked(libc::AT_FDCWD, path, path, access, rule, arg)
}

/// Opens `path` by `rule` to read and write, making it with `mode` if it is
/// missing; true when this call made it (`O_EXCL`: a file some other
/// process made first is opened, not claimed). A file removed between the
/// two tries is tried again, a few times.
pub fn open_or_create(
    path: &Path,
    mode: u32,
    rule: &FileRule,
    arg: &'static str,
) -> Result<(File, Metadata, bool)> {
    let is = |e: &Error, kind| matches!(e, Error::Io { source, .. } if source.kind() == kind);
    for _ in 0..8 {
        match open_file(path, Access::CreateNew { mode }, rule, arg) {
            Ok((f, m)) => return Ok((f, m, true)),
            Err(e) if is(&e, std::io::ErrorKind::AlreadyExists) => {}
            Err(e) => return Err(e),
        }
        match open_file(path, Access::ReadWrite, rule, arg) {
            Ok((f, m)) => return Ok((f, m, false)),
            Err(e) if is(&e, std::io::ErrorKind::NotFound) => {} // removed meanwhile
            Err(e) => return Err(e),
        }
    }
    Err(Error::Pool(format!(
        "{} kept being removed and made again while this process opened it; try again",
        path.display()
    )))
}

/// Opens `path` following links (`flags` beside the access mode), without
/// waiting on a FIFO and without opening a device before it is judged: the
/// path is first opened with `O_PATH` (which opens nothing: a device's open
/// has side effects, a watchdog's arms it), its fstat handed to `check`,
/// and only what `check` accepts is opened for real, through that
/// descriptor (`/proc/self/fd`), and found to be the same file.
fn open_followed(
    path: &Path,
    flags: libc::c_int,
    check: impl FnOnce(&Metadata) -> Result<()>,
) -> Result<(File, Metadata)> {
    let opening = |source| Error::Io {
        context: format!("opening {}", path.display()),
        source,
    };
    let c = cstring(path)?;
    // SAFETY: a valid C string; the descriptor is owned below.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(opening(std::io::Error::last_os_error()));
    }
    // SAFETY: just opened, owned by nothing else.
    let probe = unsafe { File::from_raw_fd(fd) };
    let meta = probe.metadata().map_err(|source| Error::Io {
        context: format!("reading {}", path.display()),
        source,
    })?;
    check(&meta)?;
    let again = cstring(Path::new(&format!("/proc/self/fd/{fd}")))?;
    // SAFETY: a valid C string; the descriptor is owned below.
    let fd = unsafe {
        libc::open(
            again.as_ptr(),
            flags | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY,
        )
    };
    if fd < 0 {
        return Err(opening(std::io::Error::last_os_error()));
    }
    // SAFETY: just opened, owned by nothing else.
    let file = unsafe { File::from_raw_fd(fd) };
    let now = file.metadata().map_err(|source| Error::Io {
        context: format!("reading {}", path.display()),
        source,
    })?;
    if (now.dev(), now.ino(), now.rdev()) != (meta.dev(), meta.ino(), meta.rdev()) {
        return Err(invalid(
            "path",
            format!("{} changed while it was opened; try again", path.display()),
        ));
    }
    set_blocking(&file).map_err(opening)?;
    Ok((file, meta))
}

/// Opens a file a user named to read (a trace): links followed, as any
/// reader follows them, but never a wait on a FIFO or a device, and only a
/// regular file accepted.
pub fn open_input(path: &Path, arg: &'static str) -> Result<File> {
    let (file, _) = open_followed(path, libc::O_RDONLY, |meta| {
        if meta.file_type().is_file() {
            return Ok(());
        }
        Err(invalid(
            arg,
            format!(
                "{} is {}, not a regular file",
                path.display(),
                kind_of(meta)
            ),
        ))
    })?;
    Ok(file)
}

/// Opens a DAX device (`/dev/daxX.Y`) to read and write: links followed
/// (udev names devices through them, in a directory only root writes), no
/// wait, and the descriptor judged a DAX character device before anything
/// else is done with it.
pub fn open_dax(path: &Path, arg: &'static str) -> Result<(File, Metadata)> {
    open_followed(path, libc::O_RDWR, |meta| {
        if is_dax(meta) {
            return Ok(());
        }
        Err(invalid(
            arg,
            format!(
                "{} is {}, not a DAX device (devdax)",
                path.display(),
                kind_of(meta)
            ),
        ))
    })
}

/// Creates (or empties) a file a user named to write (a trace, a report):
/// never through a link another user planted at the path (a write would
/// land in the link's target), never a FIFO, never another user's file or
/// one with other hard links; a character device only where the path names
/// it itself.
pub fn create_output(path: &Path, arg: &'static str) -> Result<File> {
    // a character device named itself (/dev/null) is written as it is; the
    // links in /dev (/dev/stdout) are refused with every other link
    let (file, meta) = open_output(path, Devices::Char, arg)?;
    if meta.file_type().is_file() {
        file.set_len(0).map_err(|source| Error::Io {
            context: format!("emptying {}", path.display()),
            source,
        })?;
    }
    Ok(file)
}

/// Opens an output file to read and add to, made if missing and kept if
/// not (the bench's record of builds that hung, which later runs read and
/// extend): by [`create_output`]'s rule, without emptying it, and a
/// regular file only.
pub fn open_output_kept(path: &Path, arg: &'static str) -> Result<File> {
    Ok(open_output(path, Devices::None, arg)?.0)
}

/// The outputs' rule: made if missing, never through a link, a FIFO,
/// another user's file or one with other hard links; `devices` as allowed.
fn open_output(path: &Path, devices: Devices, arg: &'static str) -> Result<(File, Metadata)> {
    let rule = FileRule {
        owner: Owner::Me,
        forbidden_mode: 0,
        devices,
        single_link: true,
    };
    open_file(path, Access::Create { mode: 0o644 }, &rule, arg)
}

/// Reads all of `file` from where it stands, but never more than `max`
/// bytes: None when there is more (a file that grows, `/dev/zero`, a size
/// that `st_size` does not tell).
pub fn read_capped(file: &mut File, max: usize) -> std::io::Result<Option<Vec<u8>>> {
    let mut out = Vec::new();
    file.take(max as u64 + 1).read_to_end(&mut out)?;
    Ok((out.len() <= max).then_some(out))
}

/// An open directory, what lies below it reached through its descriptor.
#[derive(Debug)]
pub struct Dir {
    file: File,
    path: PathBuf,
}

impl Dir {
    /// The directory `path`, as its user configured it (`/dev/shm`, an
    /// environment variable): links followed, made (with `mode`, exactly)
    /// if missing and `create` is set. It must be a directory; if users
    /// other than its owner may write it, it must be sticky (else any of
    /// them could rename what kvtier keeps there). Its owner is not judged:
    /// kvtier keeps nothing directly in it, only in directories below it
    /// that [`Dir::subdir`] checks.
    pub fn base(path: &Path, create: Option<u32>, arg: &'static str) -> Result<Dir> {
        let made = match create {
            Some(mode) => mkdir(libc::AT_FDCWD, path, path, mode)?,
            None => false,
        };
        let dir = Dir::open_at(
            libc::AT_FDCWD,
            path,
            path.to_path_buf(),
            0,
            create.filter(|_| made),
        )
        .map_err(|e| Error::Io {
            context: format!("opening the directory {}", path.display()),
            source: e,
        })?;
        let mode = dir.meta()?.mode() & 0o7777;
        let shared = mode & 0o022 != 0;
        if shared && mode & 0o1000 == 0 {
            return Err(invalid(
                arg,
                format!(
                    "{} (mode {mode:04o}) lets other users rename what kvtier keeps in it; make it sticky \
                     (chmod +t) as /dev/shm is, or name another",
                    path.display(),
                ),
            ));
        }
        Ok(dir)
    }

    /// The directory `name` (one path component) in this one, never a
    /// link; made with `mode` if missing and `create` is set (then this
    /// process's). Checked by `rule`.
    pub fn subdir(
        &self,
        name: &str,
        create: Option<u32>,
        rule: &DirRule,
        arg: &'static str,
    ) -> Result<Dir> {
        let shown = self.path.join(name);
        component(name, &shown, arg)?;
        let made = match create {
            Some(mode) => mkdir(self.file.as_raw_fd(), Path::new(name), &shown, mode)?,
            None => false,
        };
        let dir = Dir::open_at(
            self.file.as_raw_fd(),
            Path::new(name),
            shown.clone(),
            libc::O_NOFOLLOW,
            create.filter(|_| made),
        )
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) | Some(libc::ENOTDIR) => invalid(
                arg,
                format!(
                    "{} is not a directory (a link or a file in its place); kvtier does not follow it",
                    shown.display()
                ),
            ),
            _ => Error::Io {
                context: format!("opening the directory {}", shown.display()),
                source: e,
            },
        })?;
        check_owner_and_mode(
            &dir.path,
            &dir.meta()?,
            rule.owner,
            rule.forbidden_mode,
            arg,
        )?;
        Ok(dir)
    }

    /// Opens the directory `name` relative to `at` (`flags` beside
    /// `O_DIRECTORY`), setting its mode to `made` exactly where this process
    /// has just made it (whatever the umask).
    fn open_at(
        at: libc::c_int,
        name: &Path,
        shown: PathBuf,
        flags: libc::c_int,
        made: Option<u32>,
    ) -> std::io::Result<Dir> {
        let c = CString::new(name.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: a valid C string, relative to a directory descriptor of
        // ours or the working directory.
        let fd = unsafe {
            libc::openat(
                at,
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC | flags,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let dir = Dir {
            // SAFETY: just opened, owned by nothing else.
            file: unsafe { File::from_raw_fd(fd) },
            path: shown,
        };
        if let Some(mode) = made {
            // SAFETY: fchmod on a descriptor of ours.
            if unsafe { libc::fchmod(dir.file.as_raw_fd(), mode as libc::mode_t) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(dir)
    }

    /// Opens the file `name` (one component) in this directory by `rule`.
    pub fn open_file(
        &self,
        name: &str,
        access: Access,
        rule: &FileRule,
        arg: &'static str,
    ) -> Result<(File, Metadata)> {
        let shown = self.path.join(name);
        component(name, &shown, arg)?;
        open_checked(
            self.file.as_raw_fd(),
            Path::new(name),
            &shown,
            access,
            rule,
            arg,
        )
    }

    /// Renames `from` to `to`, both in this directory (replacing `to`
    /// whole, whatever it was: a link is replaced, never followed).
    pub fn rename(&self, from: &str, to: &str) -> std::io::Result<()> {
        let (a, b) = (cstr(from)?, cstr(to)?);
        let fd = self.file.as_raw_fd();
        // SAFETY: valid C strings relative to a directory descriptor of ours.
        if unsafe { libc::renameat(fd, a.as_ptr(), fd, b.as_ptr()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Removes the entry `name` (a file, or with `dir` an empty directory).
    pub fn remove(&self, name: &str, dir: bool) -> std::io::Result<()> {
        let c = cstr(name)?;
        let flag = if dir { libc::AT_REMOVEDIR } else { 0 };
        // SAFETY: a valid C string relative to a directory descriptor of ours.
        if unsafe { libc::unlinkat(self.file.as_raw_fd(), c.as_ptr(), flag) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn meta(&self) -> Result<Metadata> {
        self.file.metadata().map_err(|source| Error::Io {
            context: format!("reading {}", self.path.display()),
            source,
        })
    }
}

fn cstr(name: &str) -> std::io::Result<CString> {
    CString::new(name).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
}

/// `name` as one path component (no `/`, not `.` or `..`, no NUL).
fn component(name: &str, shown: &Path, arg: &'static str) -> Result<CString> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        return Err(invalid(
            arg,
            format!("{} names no single entry", shown.display()),
        ));
    }
    cstring(Path::new(name))
}

/// Makes the directory `name` (relative to `dir`): true if made, false if
/// something was there already (judged by whoever opens it next).
fn mkdir(dir: libc::c_int, name: &Path, shown: &Path, mode: u32) -> Result<bool> {
    let c = cstring(name)?;
    // SAFETY: a valid C string.
    if unsafe { libc::mkdirat(dir, c.as_ptr(), mode as libc::mode_t) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EEXIST) {
        return Ok(false);
    }
    Err(Error::Io {
        context: format!("making the directory {}", shown.display()),
        source: e,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvtier-sharedfs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    const MINE: FileRule = FileRule {
        owner: Owner::Me,
        forbidden_mode: 0o022,
        devices: Devices::None,
        single_link: true,
    };

    fn mkfifo(p: &Path) {
        let c = cstring(p).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    }

    #[test]
    fn fifos_links_devices_and_hard_links_are_refused_without_waiting() {
        let d = scratch("kinds");
        let fifo = d.join("fifo");
        mkfifo(&fifo);
        let t0 = std::time::Instant::now();
        for access in [
            Access::Read,
            Access::ReadWrite,
            Access::Create { mode: 0o600 },
        ] {
            let e = open_file(&fifo, access, &MINE, "x")
                .unwrap_err()
                .to_string();
            assert!(e.contains("is a FIFO"), "{e}");
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
        let target = d.join("target");
        std::fs::write(&target, b"{}").unwrap();
        let link = d.join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = open_file(&link, Access::Read, &MINE, "x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("symbolic link"), "{e}");
        let e = open_file(Path::new("/dev/zero"), Access::Read, &MINE, "x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("a character device"), "{e}");
        let dax_ok = FileRule {
            devices: Devices::Dax,
            ..MINE
        };
        let e = open_file(Path::new("/dev/null"), Access::Read, &dax_ok, "x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("a character device") && e.contains("DAX"), "{e}");
        let hard = d.join("hard");
        std::fs::hard_link(&target, &hard).unwrap();
        let e = open_file(&hard, Access::Read, &MINE, "x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("hard links"), "{e}");
        std::fs::remove_file(&hard).unwrap();
        let (mut f, _) = open_file(&target, Access::Read, &MINE, "x").unwrap();
        assert_eq!(read_capped(&mut f, 2).unwrap(), Some(b"{}".to_vec()));
        let mut zero = File::open("/dev/zero").unwrap();
        assert_eq!(read_capped(&mut zero, 1 << 16).unwrap(), None, "capped");
        std::fs::set_permissions(&target, std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .unwrap();
        let e = open_file(&target, Access::Read, &MINE, "x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("open to other users"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn directories_are_never_followed_and_must_be_their_owners() {
        let d = scratch("dirs");
        let base = Dir::base(&d.join("base"), Some(0o755), "run").unwrap();
        let rule = DirRule {
            owner: Owner::Me,
            forbidden_mode: 0o022,
        };
        let sub = base.subdir("mine", Some(0o755), &rule, "run").unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(sub.path()).unwrap().permissions().mode();
        assert_eq!(
            mode & 0o7777,
            0o755,
            "exactly the mode asked, whatever the umask"
        );
        // a link in a directory's place
        let elsewhere = scratch("dirs-elsewhere");
        std::os::unix::fs::symlink(&elsewhere, d.join("base/linked")).unwrap();
        let e = base
            .subdir("linked", Some(0o755), &rule, "run")
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not follow"), "{e}");
        // a file in its place
        std::fs::write(d.join("base/file"), b"").unwrap();
        assert!(base.subdir("file", Some(0o755), &rule, "run").is_err());
        // one others may write
        std::fs::create_dir(d.join("base/open")).unwrap();
        std::fs::set_permissions(d.join("base/open"), std::fs::Permissions::from_mode(0o777))
            .unwrap();
        let e = base
            .subdir("open", None, &rule, "run")
            .unwrap_err()
            .to_string();
        assert!(e.contains("may be written by other users"), "{e}");
        // another user's
        if geteuid() == 0 {
            let c = cstring(&d.join("base/mine")).unwrap();
            // SAFETY: a valid C string.
            assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
            let e = base
                .subdir("mine", Some(0o755), &rule, "run")
                .unwrap_err()
                .to_string();
            assert!(e.contains("belongs to user 65534"), "{e}");
            assert!(
                base.subdir(
                    "mine",
                    None,
                    &DirRule {
                        owner: Owner::User(65534),
                        ..rule
                    },
                    "run"
                )
                .is_ok()
            );
        }
        // a base others may write without the sticky bit
        std::fs::set_permissions(d.join("base"), std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = Dir::base(&d.join("base"), None, "run")
            .unwrap_err()
            .to_string();
        assert!(e.contains("sticky"), "{e}");
        std::fs::set_permissions(d.join("base"), std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(Dir::base(&d.join("base"), None, "run").is_ok());
        assert!(base.subdir("..", None, &rule, "run").is_err());
        assert!(base.subdir("a/b", None, &rule, "run").is_err());
        let _ = std::fs::remove_dir_all(&d);
        let _ = std::fs::remove_dir_all(&elsewhere);
    }
}
