//! What the processes attached to a pool say about their own work (an
//! engine's swap-in counters, say), published beside the pool so that
//! `kvtier pool status` shows it with the pool's occupancy.
//!
//! The pool's own format has no room for it, and needs none: a process
//! writes one small JSON file, `<run dir>/<pool uuid>/<pid>.json`, replacing
//! it whole (a reader never sees half of one), and readers take only the
//! files of clients the pool's table says are attached. The run dir is
//! `KVTIER_RUN_DIR`, else `/dev/shm/kvtier` (memory, gone at reboot, as the
//! numbers are). Processes that share a pool but not that directory (other
//! hosts, containers without it) do not see each other's.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use super::Pool;
use crate::error::{Error, Result, invalid};

/// The largest stats a process publishes (and a reader reads).
pub const MAX_STATS_BYTES: usize = 1 << 20;

/// Where the processes attached to pools publish their stats.
pub fn run_dir() -> PathBuf {
    std::env::var_os("KVTIER_RUN_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/dev/shm/kvtier"))
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
    /// JSON object): why.
    Unreadable(String),
}

impl Pool {
    fn stats_dir(&self, run: &Path) -> PathBuf {
        let uuid: String = self.uuid().iter().map(|b| format!("{b:02x}")).collect();
        run.join(uuid)
    }

    /// Publishes this process's stats for readers of the pool: `json` must
    /// be a JSON object of at most [`MAX_STATS_BYTES`]; it replaces what the
    /// process published before. Not for the per-layer path (a file write).
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
        let dir = self.stats_dir(run);
        let io = |what: &str, source: std::io::Error| Error::Io {
            context: format!("{what} {}", dir.display()),
            source,
        };
        make_shared_dir(run).map_err(|e| io("creating", e))?;
        make_shared_dir(&dir).map_err(|e| io("creating", e))?;
        let pid = std::process::id();
        let tmp = dir.join(format!(".{pid}.json.tmp"));
        let path = dir.join(format!("{pid}.json"));
        let write = || -> std::io::Result<()> {
            use std::os::unix::fs::OpenOptionsExt;
            // a fresh file of this process's, never one a link points to
            // (the directory is everyone's): a stale one (a crash between
            // create and rename) is removed first, the link itself if it is one
            let _ = std::fs::remove_file(&tmp);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o644)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&tmp)?;
            f.write_all(json.as_bytes())?;
            std::fs::rename(&tmp, &path)
        };
        write().map_err(|e| io("publishing into", e))
    }

    /// What the process `pid` published for this pool (None: nothing).
    pub fn published_stats(&self, pid: u32) -> Option<PublishedStats> {
        self.published_stats_in(&run_dir(), pid)
    }

    fn published_stats_in(&self, run: &Path, pid: u32) -> Option<PublishedStats> {
        let path = self.stats_dir(run).join(format!("{pid}.json"));
        let meta = std::fs::metadata(&path).ok()?;
        if meta.len() > MAX_STATS_BYTES as u64 {
            return Some(PublishedStats::Unreadable(format!(
                "{} is {} bytes; a client publishes at most {MAX_STATS_BYTES}",
                path.display(),
                meta.len()
            )));
        }
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) => {
                return Some(PublishedStats::Unreadable(format!(
                    "{}: {e}",
                    path.display()
                )));
            }
        };
        Some(match serde_json::from_str::<serde_json::Value>(&text) {
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

/// Creates `dir` if needed, writable by every user with the sticky bit (as
/// /tmp), so that processes of other users attached to the same pool
/// publish beside each other.
fn make_shared_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::create_dir(dir) {
        Ok(()) => std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayerFirstLayout;
    use crate::pool::DeviceSpec;

    #[test]
    fn published_stats_round_trip_and_bad_ones_are_refused_or_reported() {
        let dir = std::env::temp_dir().join(format!("kvtier-stats-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let run = dir.join("run");
        let layout = LayerFirstLayout::new(64, 2, 16).unwrap();
        let pool = Pool::create(layout, DeviceSpec::Anon { bytes: 4 << 20 }).unwrap();
        let me = std::process::id();
        assert_eq!(pool.published_stats_in(&run, me), None);
        pool.publish_stats_in(&run, r#"{"hits": 7}"#).unwrap();
        pool.publish_stats_in(&run, r#"{"hits": 9}"#).unwrap();
        match pool.published_stats_in(&run, me) {
            Some(PublishedStats::Found { stats, age_s }) => {
                assert_eq!(stats, serde_json::json!({"hits": 9}), "the newest replaces");
                assert!((0.0..60.0).contains(&age_s), "{age_s}");
            }
            other => panic!("{other:?}"),
        }
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&run).unwrap().permissions().mode();
        assert_eq!(
            mode & 0o7777,
            0o1777,
            "every user publishes beside the others"
        );
        for bad in ["[1]", "{", "", "7"] {
            let e = pool.publish_stats_in(&run, bad).unwrap_err();
            assert!(e.to_string().contains("stats"), "{bad:?}: {e}");
        }
        let big = format!(r#"{{"x": "{}"}}"#, "y".repeat(MAX_STATS_BYTES));
        assert!(pool.publish_stats_in(&run, &big).is_err());
        assert_eq!(
            pool.published_stats_in(&run, 1),
            None,
            "another pid published nothing"
        );
        // files no client writes are reported, never trusted
        let file = pool.stats_dir(&run).join("2.json");
        std::fs::write(&file, "{half").unwrap();
        assert!(matches!(
            pool.published_stats_in(&run, 2),
            Some(PublishedStats::Unreadable(_))
        ));
        std::fs::write(&file, vec![b' '; MAX_STATS_BYTES + 1]).unwrap();
        // a link planted where this process writes its next file is not followed
        let tmp = pool.stats_dir(&run).join(format!(".{me}.json.tmp"));
        let target = dir.join("target");
        std::fs::write(&target, "untouched").unwrap();
        std::os::unix::fs::symlink(&target, &tmp).unwrap();
        pool.publish_stats_in(&run, r#"{"hits": 10}"#).unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "untouched");
        match pool.published_stats_in(&run, 2) {
            Some(PublishedStats::Unreadable(why)) => assert!(why.contains("at most"), "{why}"),
            other => panic!("{other:?}"),
        }
        drop(pool);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
