//! A time limit on the timings of builds no GPU has run yet.
//!
//! A kernel that never finishes (a cluster barrier one block never reaches)
//! blocks the bench in a CUDA synchronization for good, and no later point
//! of the run, nor of any later run of the same build, would be measured.
//! The watchdog lets such a timing run for a limit; past it, it names the
//! build in the hung-builds file (`--hung-builds`), says so on stdout and
//! ends the process: the points before it are on disk already (the --json
//! file is written a point at a time), the driver's teardown of the context
//! stops the kernel, and the next run, given the same file, skips the build
//! instead of hanging again (the GPU suite runs several benches in one
//! device command).

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What happens when a guarded timing outlives its limit: by default the
/// build is recorded and the process ends (see the module's doc).
type OnExpiry = Box<dyn Fn(&str) + Send + Sync>;

/// The guarded timing under way: its build and its deadline.
struct Armed {
    what: String,
    deadline: Instant,
}

struct Shared {
    armed: Mutex<Option<Armed>>,
    changed: Condvar,
}

pub(super) struct Watchdog {
    limit: Duration,
    /// Builds the hung-builds file named when the run began.
    hung: Vec<String>,
    shared: Arc<Shared>,
    on_expiry: Arc<OnExpiry>,
    started: std::sync::OnceLock<()>,
}

/// At most this much of a hung-builds file is read (a line a build).
const MAX_FILE_BYTES: usize = 64 << 10;

impl Watchdog {
    /// A watchdog whose guarded timings may take `limit` each; `file`, the
    /// hung-builds file (made if missing), names the builds to skip and
    /// receives the name of one that hangs now.
    pub fn new(file: Option<&Path>, limit: Duration) -> kvtier::Result<Self> {
        let (hung, record) = match file {
            None => (Vec::new(), None),
            Some(path) => {
                let mut f = kvtier::shared_fs::open_output_kept(path, "--hung-builds")?;
                let bytes = kvtier::shared_fs::read_capped(&mut f, MAX_FILE_BYTES)
                    .map_err(|source| kvtier::Error::Io {
                        context: format!("reading {}", path.display()),
                        source,
                    })?
                    .ok_or_else(|| {
                        super::invalid(
                            "--hung-builds",
                            format!("{} is over {MAX_FILE_BYTES} bytes", path.display()),
                        )
                    })?;
                let hung = String::from_utf8_lossy(&bytes)
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .map(str::to_string)
                    .collect();
                (hung, Some((path.to_path_buf(), Mutex::new(f))))
            }
        };
        let on_expiry: OnExpiry = Box::new(move |what: &str| {
            // the process ends next: a failed write is said, not returned
            let shown = record.as_ref().map(|(path, f)| match append(f, what) {
                Ok(()) => format!("; named in {}, which later runs skip", path.display()),
                Err(e) => format!("; could not be named in {}: {e}", path.display()),
            });
            println!(
                "error: {what} did not finish within its time limit (a kernel that never \
                 ends){}; the bench ends here, the points before it written",
                shown.unwrap_or_default()
            );
            let _ = std::io::stdout().flush();
            // _exit, not exit: exit's handlers include the CUDA driver's
            // teardown, which may wait on the very kernel that hangs (the
            // main thread is blocked in a synchronization with it); the
            // kernel ends with the process's context all the same.
            // SAFETY: ends the process; nothing runs after it.
            unsafe { libc::_exit(EXIT_HUNG) }
        });
        Ok(Self::with(limit, hung, on_expiry))
    }

    fn with(limit: Duration, hung: Vec<String>, on_expiry: OnExpiry) -> Self {
        Watchdog {
            limit,
            hung,
            shared: Arc::new(Shared {
                armed: Mutex::new(None),
                changed: Condvar::new(),
            }),
            on_expiry: Arc::new(on_expiry),
            started: std::sync::OnceLock::new(),
        }
    }

    /// Whether the hung-builds file named `what` when the run began.
    pub fn hung_before(&self, what: &str) -> bool {
        self.hung.iter().any(|h| h == what)
    }

    /// Runs `f` (the timing of build `what`) under the time limit.
    pub fn guard<T>(&self, what: &str, f: impl FnOnce() -> T) -> T {
        self.started.get_or_init(|| {
            let (shared, on_expiry) = (self.shared.clone(), self.on_expiry.clone());
            std::thread::Builder::new()
                .name("kvtier-bench-watchdog".into())
                .spawn(move || watch(&shared, &on_expiry))
                .expect("a thread for the bench's watchdog");
        });
        self.set(Some(Armed {
            what: what.to_string(),
            deadline: Instant::now() + self.limit,
        }));
        let out = f();
        self.set(None);
        out
    }

    fn set(&self, armed: Option<Armed>) {
        *self.shared.armed.lock().unwrap_or_else(|e| e.into_inner()) = armed;
        self.shared.changed.notify_all();
    }
}

/// Adds `what` as a line at the end of the hung-builds file.
fn append(f: &Mutex<std::fs::File>, what: &str) -> std::io::Result<()> {
    let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
    f.seek(SeekFrom::End(0))?;
    writeln!(f, "{what}")?;
    f.sync_data()
}

/// The exit status of a bench the watchdog ended (EX_TEMPFAIL: a later run
/// skips the build).
pub(super) const EXIT_HUNG: i32 = 75;

/// The watchdog's thread: waits for a guarded timing's deadline; a timing
/// disarmed (or re-armed) before it is not one that hung.
fn watch(shared: &Shared, on_expiry: &OnExpiry) {
    let mut armed = shared.armed.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let wait = match &*armed {
            None => None,
            Some(a) => {
                let now = Instant::now();
                if now >= a.deadline {
                    let what = a.what.clone();
                    // expired once: fires once
                    *armed = None;
                    drop(armed);
                    on_expiry(&what);
                    armed = shared.armed.lock().unwrap_or_else(|e| e.into_inner());
                    continue;
                }
                Some(a.deadline - now)
            }
        };
        armed = match wait {
            None => shared
                .changed
                .wait(armed)
                .unwrap_or_else(|e| e.into_inner()),
            Some(d) => {
                shared
                    .changed
                    .wait_timeout(armed, d)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
        };
    }
}

/// Reads a whole small file (for the tests).
#[cfg(test)]
fn read(path: &Path) -> String {
    use std::io::Read;
    let mut s = String::new();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_string(&mut s))
        .unwrap();
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn a_timing_past_its_limit_is_reported_once_and_others_are_not() {
        let fired = Arc::new(Mutex::new(Vec::<String>::new()));
        let seen = fired.clone();
        let dog = Watchdog::with(
            Duration::from_millis(100),
            Vec::new(),
            Box::new(move |what| seen.lock().unwrap().push(what.to_string())),
        );
        // within the limit: nothing
        assert_eq!(dog.guard("quick", || 7), 7);
        std::thread::sleep(Duration::from_millis(250));
        assert!(fired.lock().unwrap().is_empty());
        // past it: named once, while it still runs
        let calls = AtomicUsize::new(0);
        dog.guard("split planner", || {
            calls.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(400));
        });
        assert_eq!(*fired.lock().unwrap(), ["split planner"]);
        assert_eq!(calls.load(Ordering::Relaxed), 1);
        // a guard after it starts afresh
        dog.guard("quick", || ());
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(fired.lock().unwrap().len(), 1);
    }

    /// The real expiry, in a child process (it ends the process): the
    /// build named in the file, the message, exit status 75, at about the
    /// limit.
    #[test]
    fn a_hung_timing_is_named_in_the_file_and_ends_the_process() {
        const CHILD: &str = "KVTIER_WATCHDOG_TEST_FILE";
        if let Some(path) = std::env::var_os(CHILD) {
            let dog = Watchdog::new(Some(Path::new(&path)), Duration::from_millis(300)).unwrap();
            dog.guard("split planner", || {
                std::thread::sleep(Duration::from_secs(30))
            });
            unreachable!("the watchdog let a hung timing return");
        }
        let dir = std::env::temp_dir().join(format!("kvtier-watchdog-exit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("hung.txt");
        std::fs::write(&path, "few-miss planner, cluster build\n").unwrap();
        let began = Instant::now();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "bench::watchdog::tests::a_hung_timing_is_named_in_the_file_and_ends_the_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, &path)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(EXIT_HUNG), "{stdout}");
        assert!(
            began.elapsed() < Duration::from_secs(20),
            "{:?}",
            began.elapsed()
        );
        assert!(
            stdout.contains("error: split planner did not finish within its time limit"),
            "{stdout}"
        );
        assert_eq!(
            read(&path),
            "few-miss planner, cluster build\nsplit planner\n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_hung_builds_file_is_read_and_kept() {
        let dir = std::env::temp_dir().join(format!("kvtier-watchdog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("hung.txt");
        // missing: made, empty, nothing skipped
        let dog = Watchdog::new(Some(&path), Duration::from_secs(60)).unwrap();
        assert!(!dog.hung_before("split planner"));
        assert_eq!(read(&path), "");
        std::fs::write(&path, "few-miss planner, cluster build\n\nsplit planner\n").unwrap();
        let dog = Watchdog::new(Some(&path), Duration::from_secs(60)).unwrap();
        assert!(dog.hung_before("split planner"));
        assert!(dog.hung_before("few-miss planner, cluster build"));
        assert!(!dog.hung_before("few-miss planner"));
        // opening does not empty it; a build that hangs is added at its end
        let f = Mutex::new(kvtier::shared_fs::open_output_kept(&path, "--hung-builds").unwrap());
        append(&f, "few-miss planner, fixed-shape build").unwrap();
        assert_eq!(
            read(&path),
            "few-miss planner, cluster build\n\nsplit planner\nfew-miss planner, fixed-shape build\n"
        );
        // a link planted at the path is refused
        let link = dir.join("link.txt");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(Watchdog::new(Some(&link), Duration::from_secs(60)).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
