//! `kvtier prefix`: inspect and remove prefix stores (pages under string keys
//! in a shared-memory file, SGLang HiCache's storage tier: see the library's
//! `prefix_store` module).

use std::path::PathBuf;
use std::time::Duration;

use clap::Subcommand;
use kvtier::pool::human_size;
use kvtier::prefix_store::{self, PrefixStore};
use serde_json::json;

#[derive(Debug, Subcommand)]
pub enum PrefixCommand {
    /// What a store holds (its namespace, slots, pages held), its counters
    /// for every process together, and the processes that have it open.
    Status {
        /// Prefix store files (`kvtier-hicache-*` in `/dev/shm` for SGLang).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Remove a prefix store file: refused while a process has it open, and
    /// for a file that is not a prefix store.
    Destroy { file: PathBuf },
}

pub fn run(cmd: PrefixCommand) -> kvtier::Result<()> {
    match cmd {
        PrefixCommand::Status { files, json } => status(&files, json),
        PrefixCommand::Destroy { file } => {
            prefix_store::destroy(&file)?;
            println!("removed {}", file.display());
            Ok(())
        }
    }
}

fn status(files: &[PathBuf], as_json: bool) -> kvtier::Result<()> {
    let mut out = Vec::new();
    for f in files {
        let store = PrefixStore::open_existing(f, Duration::from_secs(5))?;
        let (info, st, pages) = (store.info(), store.stats(), store.published());
        // this process's own look is not a holder worth naming
        let me = std::process::id();
        let holders: Vec<u32> = kvtier::table::holders(f)?
            .iter()
            .map(|h| h.pid)
            .filter(|&p| p != me)
            .collect();
        if as_json {
            out.push(json!({
                "file": info.path,
                "namespace": info.namespace,
                "page_bytes": info.page_bytes,
                "slots": info.slots,
                "file_bytes": info.file_bytes,
                "pages": pages,
                "sets": st.sets,
                "hits": st.hits,
                "misses": st.misses,
                "evictions": st.evictions,
                "reclaimed": st.reclaimed,
                "full": st.full,
                "open_in": holders,
            }));
        } else {
            println!("{}: {}", info.path.display(), info.namespace);
            println!(
                "  {} pages held of {} slots of {} (the file: {})",
                pages,
                info.slots,
                human_size(info.page_bytes),
                human_size(info.file_bytes)
            );
            println!(
                "  sets {}, hits {}, misses {}, evictions {}, slots a killed process left and taken back {}, \
                 sets refused as full {}",
                st.sets, st.hits, st.misses, st.evictions, st.reclaimed, st.full
            );
            println!(
                "  open in: {}",
                if holders.is_empty() {
                    "no other process".to_string()
                } else {
                    holders
                        .iter()
                        .map(|p| format!("pid {p}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            );
        }
    }
    if as_json {
        println!("{}", serde_json::Value::Array(out));
    }
    Ok(())
}
