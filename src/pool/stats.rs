//! What the processes attached to a pool say about their own work (an
//! engine's swap-in counters, say), published beside the pool so that
//! `kvtier pool status` shows it with the pool's occupancy.
//!
//! The pool's own format has no room for it, and needs none: a client
//! writes one small JSON file, replacing it whole (a reader never sees half
//! of one), at `<run dir>/kvtier-<uid>/<pool uuid>/<slot>-<generation>.json`:
//! its user's own directory (no other user writes there, so nobody can
//! plant a link, a FIFO or a forged file in it), named by its client slot
//! and that slot's generation, which no other live client of the pool has
//! (a pid would not do: engines in two PID namespaces may both be pid 1).
//! Readers take only the files of clients the pool's table says are
//! attached, from the directory of the user the table records for each, and
//! trust a file only if that user owns it and the directories above it
//! (see [`crate::shared_fs`]). A client that closes the pool removes its
//! file.
//!
//! The run dir is `KVTIER_RUN_DIR`, else `/dev/shm` (memory, gone at reboot,
//! as the numbers are). Processes that share a pool but not that directory
//! (other hosts, containers without it) do not see each other's.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use super::{ClientInfo, Pool};
use crate::error::{Error, Result, invalid};
use crate::shared_fs::{Access, Devices, Dir, DirRule, FileRule, Owner, read_capped};

/// The largest stats a process publishes (and a reader reads).
pub const MAX_STATS_BYTES: usize = 1 << 20;

/// The directory below which the processes attached to pools publish their
/// stats, each user in a directory of its own (`kvtier-<uid>`).
pub fn run_dir() -> PathBuf {
    std::env::var_os("KVTIER_RUN_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/dev/shm"))
}

/// What a client published, as a reader finds it.
#[derive(Debug, Clone, PartialEq)]
pub enum PublishedStats {
    /// The JSON object it published, and how long ago (seconds, from the
    /// file's time).
    Found {
        stats: serde_json::Value,
        age_s: f64,
    },
    /// A file that is not what a client writes (unreadable, too large, not a
    /// JSON object, or not trusted: another user's, a link, a FIFO): why.
    Unreadable(String),
}

/// The directory of user `uid`'s files in the run dir.
fn user_dir(uid: u32) -> String {
    format!("kvtier-{uid}")
}

fn stats_file(slot: u16, generation: u32) -> String {
    format!("{slot}-{generation}.json")
}

/// Whether `e` says only that something was not there.
fn missing(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
}

impl Pool {
    fn uuid_hex(&self) -> String {
        self.uuid().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Publishes this client's stats for readers of the pool: `json` must
    /// be a JSON object of at most [`MAX_STATS_BYTES`]; it replaces what this
    /// handle published before. Not for the per-layer path (a file write).
    pub fn publish_stats(&self, json: &str) -> Result<()> {
        self.publish_stats_in(&run_dir(), json)
    }

    fn publish_stats_in(&self, run: &Path, json: &str) -> Result<()> {
        if json.len() > MAX_STATS_BYTES {
            return Err(invalid(
                "stats",
                format!("{} bytes; at most {MAX_STATS_BYTES}", json.len()),
            ));
        }
        match serde_json::from_str::<serde_json::Value>(json) {
            Ok(serde_json::Value::Object(_)) => {}
            Ok(_) => return Err(invalid("stats", "is JSON but not an object")),
            Err(e) => return Err(invalid("stats", format!("is not JSON: {e}"))),
        }
        let (slot, generation) = self.owner()?;
        let name = stats_file(slot, generation);
        let write = || -> Result<()> {
            let [_, _, dir] = self.my_stats_dirs(run, true)?;
            // a fresh file in this user's own directory (a stale one, from a
            // crash between create and rename, is removed first)
            let tmp = format!(".{name}.tmp");
            let _ = dir.remove(&tmp, false);
            let (mut f, _) =
                dir.open_file(&tmp, Access::CreateNew { mode: 0o644 }, &MY_FILE, "stats")?;
            let io = |source| Error::Io {
                context: format!("publishing into {}", dir.path().display()),
                source,
            };
            f.set_permissions(std::fs::Permissions::from_mode(0o644))
                .map_err(io)?;
            f.write_all(json.as_bytes()).map_err(io)?;
            dir.rename(&tmp, &name).map_err(io)
        };
        // again if another handle of this user's removed the pool's
        // directory meanwhile (its last client closing): a few times, as
        // each try makes the directories anew
        let mut result = write();
        for _ in 0..4 {
            match &result {
                Err(e) if missing(e) => result = write(),
                _ => break,
            }
        }
        result?;
        *self.published_stats.lock().unwrap() = Some(run.to_path_buf());
        Ok(())
    }

    /// The run dir, this user's directory in it and this pool's in that
    /// (made if `create`).
    fn my_stats_dirs(&self, run: &Path, create: bool) -> Result<[Dir; 3]> {
        let uid = super::identity::effective_uid();
        let mode = create.then_some(0o755);
        let base = Dir::base(run, create.then_some(0o1777), "KVTIER_RUN_DIR")?;
        let user = base.subdir(&user_dir(uid), mode, &MY_DIR, "run dir")?;
        let pool = user.subdir(&self.uuid_hex(), mode, &MY_DIR, "run dir")?;
        Ok([base, user, pool])
    }

    /// Removes what this handle published (a clean close); nothing to say
    /// if that fails: the file is stale once the client has gone.
    pub(super) fn unpublish_stats(&self) {
        let Some(run) = self
            .published_stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return;
        };
        let Ok((slot, generation)) = self.owner() else {
            return;
        };
        if let Ok([base, user, pool]) = self.my_stats_dirs(&run, false) {
            let _ = pool.remove(&stats_file(slot, generation), false);
            drop(pool);
            // the pool's directory too, once no client of this user's has a
            // file in it (removing a directory that is not empty fails),
            // and this user's, once empty (a publisher of this user's that
            // loses either meanwhile makes it again: see publish_stats_in)
            let _ = user.remove(&self.uuid_hex(), true);
            let _ = base.remove(&user_dir(super::identity::effective_uid()), true);
        }
    }

    /// What client `client` published for this pool (None: nothing, or a
    /// client of an older kvtier, which records no user to trust).
    pub fn published_stats(&self, client: &ClientInfo) -> Option<PublishedStats> {
        self.published_stats_in(&run_dir(), client)
    }

    fn published_stats_in(&self, run: &Path, client: &ClientInfo) -> Option<PublishedStats> {
        let uid = client.uid?;
        let untrusted = |e: Error| {
            Some(PublishedStats::Unreadable(match e {
                Error::InvalidArgument { msg, .. } => format!("untrusted: {msg}"),
                e => e.to_string(),
            }))
        };
        macro_rules! step {
            ($e:expr) => {
                match $e {
                    Ok(x) => x,
                    Err(e) if missing(&e) => return None,
                    Err(e) => return untrusted(e),
                }
            };
        }
        let theirs = DirRule {
            owner: Owner::User(uid),
            forbidden_mode: 0o022,
        };
        let base = step!(Dir::base(run, None, "KVTIER_RUN_DIR"));
        let user = step!(base.subdir(&user_dir(uid), None, &theirs, "run dir"));
        let dir = step!(user.subdir(&self.uuid_hex(), None, &theirs, "run dir"));
        let rule = FileRule {
            owner: Owner::User(uid),
            forbidden_mode: 0o022,
            devices: Devices::None,
            single_link: true,
        };
        let name = stats_file(client.slot, client.generation);
        let (mut f, meta) = step!(dir.open_file(&name, Access::Read, &rule, "stats"));
        let path = dir.path().join(&name);
        let text = match read_capped(&mut f, MAX_STATS_BYTES) {
            Ok(Some(t)) => t,
            Ok(None) => {
                return Some(PublishedStats::Unreadable(format!(
                    "{} holds more than {MAX_STATS_BYTES} bytes, the most a client publishes",
                    path.display()
                )));
            }
            Err(e) => {
                return Some(PublishedStats::Unreadable(format!(
                    "{}: {e}",
                    path.display()
                )));
            }
        };
        Some(match serde_json::from_slice::<serde_json::Value>(&text) {
            Ok(stats @ serde_json::Value::Object(_)) => {
                let age_s = meta
                    .modified()
                    .ok()
                    .and_then(|m| SystemTime::now().duration_since(m).ok())
                    .map_or(0.0, |d| d.as_secs_f64());
                PublishedStats::Found { stats, age_s }
            }
            _ => PublishedStats::Unreadable(format!("{} is not a JSON object", path.display())),
        })
    }
}

/// The rule for this process's own directories in the run dir.
const MY_DIR: DirRule = DirRule {
    owner: Owner::Me,
    forbidden_mode: 0o022,
};

/// The rule for this process's own files in its run directory.
const MY_FILE: FileRule = FileRule {
    owner: Owner::Me,
    forbidden_mode: 0o022,
    devices: Devices::None,
    single_link: true,
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayerFirstLayout;
    use crate::pool::{DeviceSpec, PoolOptions};

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvtier-stats-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn me(pool: &Pool) -> ClientInfo {
        let (slot, _) = pool.me.unwrap();
        pool.clients_info()
            .into_iter()
            .find(|c| c.slot == slot)
            .unwrap()
    }

    fn found(p: Option<PublishedStats>) -> serde_json::Value {
        match p {
            Some(PublishedStats::Found { stats, age_s }) => {
                assert!((0.0..60.0).contains(&age_s), "{age_s}");
                stats
            }
            other => panic!("{other:?}"),
        }
    }

    fn unreadable(p: Option<PublishedStats>) -> String {
        match p {
            Some(PublishedStats::Unreadable(why)) => why,
            other => panic!("{other:?}"),
        }
    }

    fn chown(p: &Path, uid: u32) {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(
            unsafe { libc::lchown(c.as_ptr(), uid, uid) },
            0,
            "needs root"
        );
    }

    fn is_root() -> bool {
        super::super::identity::effective_uid() == 0
    }

    #[test]
    fn published_stats_round_trip_and_bad_ones_are_refused() {
        let dir = scratch("round");
        let run = dir.join("run");
        let layout = LayerFirstLayout::new(64, 2, 16).unwrap();
        let pool = Pool::create(layout, DeviceSpec::Anon { bytes: 4 << 20 }).unwrap();
        let info = me(&pool);
        assert_eq!(info.uid, Some(super::super::identity::effective_uid()));
        assert_eq!(pool.published_stats_in(&run, &info), None);
        pool.publish_stats_in(&run, r#"{"hits": 7}"#).unwrap();
        pool.publish_stats_in(&run, r#"{"hits": 9}"#).unwrap();
        assert_eq!(
            found(pool.published_stats_in(&run, &info)),
            serde_json::json!({"hits": 9}),
            "the newest replaces"
        );
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(
            mode(&run),
            0o1777,
            "a run dir made here is everyone's, sticky"
        );
        let mine = run.join(user_dir(info.uid.unwrap()));
        let file = mine
            .join(pool.uuid_hex())
            .join(stats_file(info.slot, info.generation));
        assert_eq!((mode(&mine), mode(&file)), (0o755, 0o644));
        for bad in ["[1]", "{", "", "7"] {
            let e = pool.publish_stats_in(&run, bad).unwrap_err();
            assert!(e.to_string().contains("stats"), "{bad:?}: {e}");
        }
        let big = format!(r#"{{"x": "{}"}}"#, "y".repeat(MAX_STATS_BYTES));
        assert!(pool.publish_stats_in(&run, &big).is_err());
        // a client of an older kvtier records no user: nothing to trust
        let old = ClientInfo {
            uid: None,
            ..info.clone()
        };
        assert_eq!(pool.published_stats_in(&run, &old), None);
        // what no client writes is reported, never trusted
        std::fs::write(&file, "{half").unwrap();
        assert!(unreadable(pool.published_stats_in(&run, &info)).contains("not a JSON object"));
        std::fs::write(&file, vec![b' '; MAX_STATS_BYTES + 1]).unwrap();
        assert!(unreadable(pool.published_stats_in(&run, &info)).contains("more than"));
        // a clean close takes its file, and the pool's directory with it
        pool.publish_stats_in(&run, r#"{"hits": 10}"#).unwrap();
        let pool_dir = file.parent().unwrap().to_path_buf();
        drop(pool);
        assert!(!file.exists() && !pool_dir.exists() && !mine.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Two clients of one pool in one process (as engines in two PID
    /// namespaces would share a pid) publish two files, each read as its own.
    #[test]
    fn two_clients_with_one_pid_publish_apart() {
        let dir = scratch("two");
        let run = dir.join("run");
        let spec = DeviceSpec::file(dir.join("dev"), 8 << 20);
        let layout = LayerFirstLayout::new(64, 2, 16).unwrap();
        let a = Pool::create_on(layout, vec![spec.clone()], PoolOptions::default()).unwrap();
        let b = Pool::open(vec![spec], PoolOptions::default()).unwrap();
        let (ia, ib) = (me(&a), me(&b));
        assert_eq!(ia.pid, ib.pid);
        a.publish_stats_in(&run, r#"{"engine": "a"}"#).unwrap();
        b.publish_stats_in(&run, r#"{"engine": "b"}"#).unwrap();
        assert_eq!(found(a.published_stats_in(&run, &ia))["engine"], "a");
        assert_eq!(found(a.published_stats_in(&run, &ib))["engine"], "b");
        drop((a, b));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// What another user plants in or around the run dir: never followed,
    /// never waited on, never trusted.
    #[test]
    fn planted_directories_links_fifos_and_forged_files_are_refused() {
        let dir = scratch("planted");
        let run = dir.join("run");
        let layout = LayerFirstLayout::new(64, 2, 16).unwrap();
        let pool = Pool::create(layout, DeviceSpec::Anon { bytes: 4 << 20 }).unwrap();
        let info = me(&pool);
        let uid = info.uid.unwrap();
        let mine = run.join(user_dir(uid));
        let name = stats_file(info.slot, info.generation);

        // a run dir others may write that is not sticky
        std::fs::create_dir(&run).unwrap();
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = pool.publish_stats_in(&run, "{}").unwrap_err().to_string();
        assert!(e.contains("sticky"), "{e}");
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o1777)).unwrap();

        // this user's directory is a link to another place: not followed,
        // nothing written there
        let elsewhere = dir.join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &mine).unwrap();
        let e = pool.publish_stats_in(&run, "{}").unwrap_err().to_string();
        assert!(e.contains("does not follow"), "{e}");
        assert!(unreadable(pool.published_stats_in(&run, &info)).starts_with("untrusted"));
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
        std::fs::remove_file(&mine).unwrap();

        pool.publish_stats_in(&run, r#"{"hits": 1}"#).unwrap();
        let pool_dir = mine.join(pool.uuid_hex());
        let file = pool_dir.join(&name);
        // a FIFO where the client's file is: reported at once, never waited on
        std::fs::remove_file(&file).unwrap();
        let c = std::ffi::CString::new(file.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        let t0 = std::time::Instant::now();
        assert!(unreadable(pool.published_stats_in(&run, &info)).contains("FIFO"));
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
        // a link to /dev/zero or to a file of another's: never read
        std::fs::remove_file(&file).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &file).unwrap();
        assert!(unreadable(pool.published_stats_in(&run, &info)).contains("symbolic link"));
        // a hard link to a file of this user's elsewhere
        std::fs::remove_file(&file).unwrap();
        let secret = dir.join("secret.json");
        std::fs::write(&secret, r#"{"secret": 1}"#).unwrap();
        std::fs::hard_link(&secret, &file).unwrap();
        assert!(unreadable(pool.published_stats_in(&run, &info)).contains("hard links"));
        std::fs::remove_file(&file).unwrap();
        // the next publish replaces whatever stands there
        pool.publish_stats_in(&run, r#"{"hits": 2}"#).unwrap();
        assert_eq!(found(pool.published_stats_in(&run, &info))["hits"], 2);

        if is_root() {
            // a forged file: another user's, where this client's should be
            chown(&file, 65534);
            let why = unreadable(pool.published_stats_in(&run, &info));
            assert!(
                why.starts_with("untrusted") && why.contains("belongs to user 65534"),
                "{why}"
            );
            std::fs::remove_file(&file).unwrap();
            // a directory another user made first in this user's name: this
            // user publishes nothing into it, and its files are not trusted
            std::fs::remove_dir(&pool_dir).unwrap();
            std::fs::remove_dir(&mine).unwrap();
            std::fs::create_dir(&mine).unwrap();
            chown(&mine, 65534);
            let e = pool.publish_stats_in(&run, "{}").unwrap_err().to_string();
            assert!(e.contains("belongs to user 65534"), "{e}");
            assert_eq!(std::fs::read_dir(&mine).unwrap().count(), 0);
            assert!(unreadable(pool.published_stats_in(&run, &info)).starts_with("untrusted"));
        }
        drop(pool);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
