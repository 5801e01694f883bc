//! `kvtier table`: load, attach, inspect and destroy tables (large read-only
//! arrays in shared memory, loaded once per host: see the library's `table`
//! module).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use kvtier::pool::{human_size, parse_size};
use kvtier::table::{self, Load, TableStore};
use serde_json::json;

#[derive(Debug, Subcommand)]
pub enum TableCommand {
    /// Load a table (or resume a load a killed loader left): from files,
    /// concatenated, or a synthetic pattern; nothing to do when it is loaded.
    Load(LoadArgs),
    /// Attach to a loaded table as a reader: how long it took, and with
    /// --verify-synthetic whether its bytes are the synthetic pattern.
    Attach(AttachArgs),
    /// Key, size, state, readers and loader, and page backing of tables.
    Status {
        /// Table files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Remove a table file: refused while a reader or loader holds it.
    Destroy { file: PathBuf },
}

#[derive(Debug, Args)]
pub struct Where {
    /// The table's file (on tmpfs or hugetlbfs, or a devdax device).
    #[arg(long, conflicts_with = "store", required_unless_present = "store")]
    file: Option<PathBuf>,
    /// A directory of tables: the key's file in it.
    #[arg(long)]
    store: Option<PathBuf>,
    /// The table's key: model, table, shape, dtype and a fingerprint of the
    /// files it comes from (another key never attaches to its bytes).
    #[arg(long)]
    key: String,
    /// Seconds to wait for another process's lock.
    #[arg(long, default_value_t = 30.0)]
    wait: f64,
}

impl Where {
    fn path(&self) -> PathBuf {
        match (&self.file, &self.store) {
            (Some(f), _) => f.clone(),
            (None, Some(d)) => TableStore::new(d).path_of(&self.key),
            (None, None) => unreachable!("clap requires one"),
        }
    }

    fn wait(&self) -> kvtier::Result<Duration> {
        Duration::try_from_secs_f64(self.wait).map_err(|_| kvtier::Error::InvalidArgument {
            arg: "--wait",
            msg: format!("{} is not a number of seconds", self.wait),
        })
    }
}

#[derive(Debug, Args)]
pub struct LoadArgs {
    #[command(flatten)]
    at: Where,
    /// Files whose bytes, concatenated, are the table.
    #[arg(
        long,
        value_delimiter = ',',
        conflicts_with = "synthetic",
        required_unless_present = "synthetic"
    )]
    from: Vec<PathBuf>,
    /// A synthetic table of this size (a pattern of the key, for trying
    /// tables and timing them).
    #[arg(long)]
    synthetic: Option<String>,
    /// For tests: stop (as if killed) after writing this many chunks.
    #[arg(long, hide = true)]
    pause_after_chunks: Option<u64>,
}

#[derive(Debug, Args)]
pub struct AttachArgs {
    #[command(flatten)]
    at: Where,
    /// Check every byte against the synthetic pattern of the key.
    #[arg(long)]
    verify_synthetic: bool,
    /// Stay attached this many seconds (a reader others can see).
    #[arg(long, default_value_t = 0.0)]
    hold: f64,
}

pub fn run(cmd: TableCommand) -> kvtier::Result<()> {
    match cmd {
        TableCommand::Load(a) => load(a),
        TableCommand::Attach(a) => attach(a),
        TableCommand::Status { files, json } => status(&files, json),
        TableCommand::Destroy { file } => {
            table::destroy(&file)?;
            println!("destroyed {}", file.display());
            Ok(())
        }
    }
}

/// The synthetic table's 8-byte word `i` (splitmix64 of the index and the
/// key's hash): cheap to make and to check, different for every key.
fn synthetic_word(seed: u64, i: u64) -> u64 {
    let mut z = (i ^ seed).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn seed_of(key: &str) -> u64 {
    table::fnv1a(&[key.as_bytes()])
}

/// The synthetic bytes `offset..offset + out.len()` (offset a multiple of 8).
fn synthetic_bytes(seed: u64, offset: u64, out: &mut [u8]) {
    for (j, w) in out.chunks_mut(8).enumerate() {
        let word = synthetic_word(seed, offset / 8 + j as u64).to_le_bytes();
        w.copy_from_slice(&word[..w.len()]);
    }
}

fn load(a: LoadArgs) -> kvtier::Result<()> {
    let path = a.at.path();
    let (size, sources) = match &a.synthetic {
        Some(s) => (parse_size(s)?, Vec::new()),
        None => {
            let mut sizes = Vec::new();
            for f in &a.from {
                let m = std::fs::metadata(f).map_err(|source| kvtier::Error::Io {
                    context: format!("reading {}", f.display()),
                    source,
                })?;
                sizes.push((f.clone(), m.len()));
            }
            (sizes.iter().map(|s| s.1).sum(), sizes)
        }
    };
    let t0 = Instant::now();
    let mut loader = match table::load(&path, &a.at.key, size, a.at.wait()?)? {
        Load::Ready => {
            println!(
                "{} is loaded already ({}): nothing to do",
                path.display(),
                human_size(size)
            );
            return Ok(());
        }
        Load::Filling(l) => l,
    };
    let (done_before, chunks) = loader.progress();
    let chunk = loader.chunk_bytes() as usize;
    let seed = seed_of(&a.at.key);
    let mut buf = vec![0u8; chunk];
    let mut written = 0u64;
    let mut files: Vec<(std::fs::File, u64, u64)> = Vec::new(); // file, first byte, len
    let mut at = 0;
    for (f, len) in &sources {
        let file = std::fs::File::open(f).map_err(|source| kvtier::Error::Io {
            context: format!("opening {}", f.display()),
            source,
        })?;
        files.push((file, at, *len));
        at += len;
    }
    for range in loader.missing() {
        let mut off = range.start;
        while off < range.end {
            let n = ((range.end - off) as usize).min(chunk);
            let piece = &mut buf[..n];
            if a.synthetic.is_some() {
                synthetic_bytes(seed, off, piece);
            } else {
                read_concatenated(&files, off, piece)?;
            }
            loader.write(off, piece)?;
            written += n as u64;
            off += n as u64;
            if let Some(stop) = a.pause_after_chunks
                && loader.progress().0 >= stop
            {
                println!("paused after {stop} chunks");
                // as a killed loader would leave it: not published
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
    }
    loader.publish()?;
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "loaded {} into {} in {secs:.2} s ({:.2} GB/s){}",
        human_size(written),
        path.display(),
        written as f64 / secs / 1e9,
        if done_before > 0 {
            format!("; resumed: {done_before} of {chunks} chunks were written before")
        } else {
            String::new()
        }
    );
    Ok(())
}

/// Reads the bytes at `offset` of the files concatenated.
fn read_concatenated(
    files: &[(std::fs::File, u64, u64)],
    offset: u64,
    out: &mut [u8],
) -> kvtier::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut done = 0usize;
    while done < out.len() {
        let at = offset + done as u64;
        let (f, first, len) = files
            .iter()
            .find(|(_, first, len)| at >= *first && at < first + len)
            .expect("offset inside the files");
        let n = ((first + len - at) as usize).min(out.len() - done);
        f.read_exact_at(&mut out[done..done + n], at - first)
            .map_err(|source| kvtier::Error::Io {
                context: format!("reading the table's source at byte {at}"),
                source,
            })?;
        done += n;
    }
    Ok(())
}

fn attach(a: AttachArgs) -> kvtier::Result<()> {
    let path = a.at.path();
    let t0 = Instant::now();
    let t = table::Table::attach(&path, &a.at.key, a.at.wait()?)?;
    let attach_s = t0.elapsed().as_secs_f64();
    println!(
        "attached to {} ({}) in {:.2} ms",
        path.display(),
        human_size(t.data().len() as u64),
        attach_s * 1e3
    );
    if a.verify_synthetic {
        let seed = seed_of(&a.at.key);
        let data = t.data();
        let mut want = vec![0u8; 1 << 20];
        for (n, piece) in data.chunks(1 << 20).enumerate() {
            let off = (n << 20) as u64;
            synthetic_bytes(seed, off, &mut want[..piece.len()]);
            if piece != &want[..piece.len()] {
                return Err(kvtier::Error::Pool(format!(
                    "{}: the bytes at {off}.. are not the synthetic pattern of {:?}",
                    path.display(),
                    a.at.key
                )));
            }
        }
        println!("every byte is the synthetic pattern");
    }
    if a.hold > 0.0 {
        println!("holding it for {} s", a.hold);
        std::thread::sleep(Duration::from_secs_f64(a.hold));
    }
    Ok(())
}

fn status(files: &[PathBuf], as_json: bool) -> kvtier::Result<()> {
    let mut out = Vec::new();
    for f in files {
        let s = table::status(f)?;
        if as_json {
            out.push(json!({
                "file": s.path,
                "key": s.key,
                "data_bytes": s.data_bytes,
                "state": if s.ready { "ready" } else { "filling" },
                "chunks_written": s.chunks_done,
                "chunks": s.chunks,
                "readers": s.holders.iter().filter(|h| !h.exclusive).map(|h| h.pid).collect::<Vec<_>>(),
                "loader": s.holders.iter().find(|h| h.exclusive).map(|h| h.pid),
                "backing": s.backing.to_string(),
            }));
        } else {
            let readers: Vec<String> = s
                .holders
                .iter()
                .filter(|h| !h.exclusive)
                .map(|h| h.pid.to_string())
                .collect();
            println!("{}: {:?}", s.path.display(), s.key);
            println!(
                "  {}, {}; readers: {}{}",
                human_size(s.data_bytes),
                if s.ready {
                    "ready".to_string()
                } else {
                    format!("filling ({} of {} chunks written)", s.chunks_done, s.chunks)
                },
                if readers.is_empty() {
                    "none".into()
                } else {
                    readers.join(", ")
                },
                match s.holders.iter().find(|h| h.exclusive) {
                    Some(l) => format!("; loader: pid {}", l.pid),
                    None => String::new(),
                }
            );
            println!("  backing: {}", s.backing);
        }
    }
    if as_json {
        println!("{}", serde_json::Value::Array(out));
    }
    Ok(())
}
