//! `kvtier pool create|status|check|destroy`.

use std::collections::BTreeMap;

use clap::{Args, Subcommand};
use kvtier::pool::{
    Coherence, Liveness, PoolOptions, PublishedStats, RegionInfo, RegionState, human_size,
};
use kvtier::{DeviceSpec, EntryFormat, LayerFirstLayout, Pool};

use super::bench::count;

#[derive(Debug, Subcommand)]
pub enum PoolCommand {
    /// Formats a new pool across the devices.
    Create(CreateArgs),
    /// Devices, capacity, regions per state and per owner, where the
    /// devices' pages are.
    Status(StatusArgs),
    /// Verifies the header and the tables; reports (with --repair, reclaims)
    /// the regions of owners that died.
    Check(CheckArgs),
    /// Invalidates the pool's headers (the bytes and files stay); with
    /// --force, also a pool that cannot be trusted (a corrupt header, a
    /// shrunk device), once no process holds it.
    Destroy(DestroyArgs),
}

#[derive(Debug, Args)]
pub struct DevicesArgs {
    /// A device of the pool, in pool order: file:PATH[:SIZE] or
    /// dax:PATH[:SIZE] (the sizes only at create). Repeat for each device.
    /// Pools on anon: and numa: memory live inside the process that makes
    /// them (through kvtier's API or its SGLang shim), so these commands
    /// neither make nor reach them.
    #[arg(long = "device", required = true)]
    devices: Vec<String>,
    /// For a pool shared by several hosts without hardware coherence: how
    /// many hosts share it, and which one this is.
    #[arg(long, requires = "host")]
    hosts: Option<u32>,
    /// This host's index among --hosts (0 to hosts - 1), the same on every
    /// command this host runs on the pool.
    #[arg(long, requires = "hosts")]
    host: Option<u32>,
}

#[derive(Debug, Args)]
pub struct CreateArgs {
    #[command(flatten)]
    devices: DevicesArgs,
    /// Entry format: fp8-dsa (656 B), bf16-mla (1152 B) or a byte count.
    #[arg(long, default_value = "fp8-dsa")]
    entry: String,
    /// Layers per region.
    #[arg(long)]
    layers: u32,
    /// Tokens per region (a request's capacity).
    #[arg(long)]
    tokens: u32,
    /// Client slots (processes attached at once).
    #[arg(long, default_value_t = kvtier::pool::DEFAULT_CLIENTS)]
    clients: u32,
    /// Permissions of the pool files, in octal: 600 (the default) lets only
    /// this user map the pool, and with it every request's KV; 660 lets the
    /// file's group share it.
    #[arg(long, default_value = "600", value_parser = parse_mode)]
    mode: u32,
}

fn parse_mode(s: &str) -> Result<u32, String> {
    let m = u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .map_err(|_| format!("{s:?} is not an octal mode such as 600 or 660"))?;
    if m > 0o777 || m & 0o600 != 0o600 {
        return Err(format!(
            "{s:?}: the owner needs read and write (6..), and only permission bits (at most 777)"
        ));
    }
    Ok(m)
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    devices: DevicesArgs,
    /// Print one JSON object: occupancy per device and per client, and
    /// where each device's pages are.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    devices: DevicesArgs,
    /// Reclaim the regions of owners that died.
    #[arg(long)]
    repair: bool,
}

#[derive(Debug, Args)]
pub struct DestroyArgs {
    #[command(flatten)]
    devices: DevicesArgs,
    /// Destroy even while processes are attached, or when the pool cannot
    /// be trusted (then only while no process maps its devices).
    #[arg(long)]
    force: bool,
    /// Then remove the `file:` devices' files, which keep their memory (on
    /// tmpfs) until removed; run again on a pool already destroyed, it
    /// removes only files that hold a destroyed pool.
    #[arg(long)]
    remove_files: bool,
}

impl DevicesArgs {
    /// The devices, each one a pool command can reach: a pool on `anon:` or
    /// `numa:` memory lives in the process that made it (it would vanish as
    /// `pool create` exits, and no other process can open it).
    fn shared_specs(&self) -> kvtier::Result<Vec<DeviceSpec>> {
        self.devices
            .iter()
            .map(|d| {
                let spec: DeviceSpec = d.parse()?;
                if !spec.is_shared() {
                    return Err(kvtier::Error::InvalidArgument {
                        arg: "--device",
                        msg: format!(
                            "{d}: a pool on anon: or numa: memory lives only inside the process that makes it \
                             (an engine through kvtier's API or its SGLang shim), so `kvtier pool` commands \
                             cannot create one that outlives them or reach one; they take file: and dax: devices"
                        ),
                    });
                }
                Ok(spec)
            })
            .collect()
    }

    fn options(&self, attach: bool, reclaim: bool) -> PoolOptions {
        let coherence = match (self.hosts, self.host) {
            (Some(hosts), Some(host)) => Coherence::NonCoherent { hosts, host },
            _ => Coherence::Coherent,
        };
        PoolOptions {
            coherence,
            attach,
            reclaim_dead: reclaim,
            ..PoolOptions::default()
        }
    }
}

pub fn run(cmd: PoolCommand) -> kvtier::Result<()> {
    run_command(cmd).map_err(in_the_users_words)
}

/// The library names arguments as its API does; here the user typed flags.
fn in_the_users_words(e: kvtier::Error) -> kvtier::Error {
    let flag = |arg: &str| match arg {
        "coherence" => Some("--hosts/--host"),
        "entry_bytes" | "entry format" => Some("--entry"),
        "layers" => Some("--layers"),
        "tokens_per_region" => Some("--tokens"),
        "clients" => Some("--clients"),
        "rank" => Some("--rank"),
        "mode" => Some("--mode"),
        _ => None,
    };
    match e {
        kvtier::Error::InvalidArgument { arg, msg } => match flag(arg) {
            Some(f) => kvtier::Error::InvalidArgument { arg: f, msg },
            None => kvtier::Error::InvalidArgument { arg, msg },
        },
        kvtier::Error::Pool(msg) => kvtier::Error::Pool(msg.replace(
            "or destroy with force",
            "or run `kvtier pool destroy --force`",
        )),
        other => other,
    }
}

fn run_command(cmd: PoolCommand) -> kvtier::Result<()> {
    match cmd {
        PoolCommand::Create(a) => {
            let entry = a.entry.parse::<EntryFormat>()?.bytes();
            let layout = LayerFirstLayout::new(entry, a.layers, a.tokens)?;
            let options = PoolOptions {
                clients: a.clients,
                file_mode: a.mode,
                ..a.devices.options(false, false)
            };
            let specs = a.devices.shared_specs()?;
            for warning in specs.iter().filter_map(|s| s.placement_warning()) {
                eprintln!("warning: {warning}");
            }
            let pool = Pool::create_on(layout, specs, options)?;
            println!(
                "created pool {} on {}: {} of {} ({} B × {} layers × {} tokens)",
                hex(&pool.uuid()),
                count(pool.devices().len() as u64, "device", "devices"),
                count(pool.num_regions(), "region", "regions"),
                human_size(pool.region_stride()),
                entry,
                a.layers,
                a.tokens
            );
            Ok(())
        }
        PoolCommand::Status(a) => {
            let pool = Pool::open(a.devices.shared_specs()?, a.devices.options(false, false))?;
            if a.json {
                println!("{}", status_json(&pool));
            } else {
                print_status(&pool);
            }
            Ok(())
        }
        PoolCommand::Check(a) => {
            let pool = Pool::open(a.devices.shared_specs()?, a.devices.options(false, false))?;
            let report = pool.check();
            println!("pool {}: header and device table valid", hex(&pool.uuid()));
            for p in &report.problems {
                println!("problem: {p}");
            }
            for (client, pid) in &report.dead_clients {
                println!("dead owner: client slot {client} (pid {pid})");
            }
            println!(
                "{} of dead owners {} reclaimable",
                count(report.reclaimable_regions as u64, "region", "regions"),
                if report.reclaimable_regions == 1 {
                    "is"
                } else {
                    "are"
                }
            );
            if a.repair {
                let freed = pool.reclaim_dead()?;
                println!(
                    "repaired: reclaimed {} and {}",
                    count(freed.clients as u64, "client slot", "client slots"),
                    count(freed.regions as u64, "region", "regions")
                );
            } else if report.reclaimable_regions > 0 || !report.dead_clients.is_empty() {
                println!("run again with --repair to reclaim them");
            }
            if report.problems.is_empty() {
                Ok(())
            } else {
                Err(kvtier::Error::Pool(format!(
                    "{} in the tables",
                    count(
                        report.problems.len() as u64,
                        "inconsistency",
                        "inconsistencies"
                    )
                )))
            }
        }
        PoolCommand::Destroy(a) => {
            let coherence = a.devices.options(false, false).coherence;
            let specs = a.devices.shared_specs()?;
            // a pool destroyed already: with --remove-files, its files go
            let destroyed = a.remove_files
                && specs
                    .iter()
                    .all(|d| kvtier::pool::is_destroyed(d).unwrap_or(false));
            if !destroyed {
                if let Some(found) = Pool::destroy_with(specs.clone(), a.force, coherence)? {
                    println!("found: {found}");
                }
                println!("destroyed: the headers are cleared");
            }
            if a.remove_files {
                for path in Pool::remove_destroyed_files(&specs)? {
                    println!("removed {}", path.display());
                }
            } else if specs.iter().any(|d| matches!(d, DeviceSpec::File { .. })) {
                println!(
                    "the file: devices' files remain, and on tmpfs hold their memory: `kvtier pool destroy --remove-files` \
                     with the same devices removes them"
                );
            }
            Ok(())
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Each owner's (client, pid): its liveness and its regions allocated and
/// published.
fn owners_of(regions: &[RegionInfo]) -> BTreeMap<(u16, u32), (Liveness, usize, usize)> {
    let mut owners = BTreeMap::new();
    for r in regions {
        if let Some(o) = &r.owner {
            let e = owners
                .entry((o.client, o.pid))
                .or_insert((o.liveness, 0, 0));
            match r.state {
                RegionState::Ready => e.2 += 1,
                _ => e.1 += 1,
            }
        }
    }
    owners
}

/// What `pool status --json` prints: the geometry, occupancy per device and
/// per client (its regions allocated and published), and each device's
/// sampled pages by NUMA node.
fn status_json(pool: &Pool) -> serde_json::Value {
    use serde_json::json;
    let l = pool.layout();
    let regions = pool.regions();
    let count = |d: Option<u32>, s: RegionState| {
        regions
            .iter()
            .filter(|r| d.is_none_or(|d| r.device == d) && r.state == s)
            .count()
    };
    let devices: Vec<serde_json::Value> = pool
        .devices()
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let i = i as u32;
            let sample = pool.residency(i, 256).ok();
            let residency = sample.as_ref().map(|r| {
                json!({
                    "sampled_pages": r.sampled,
                    "pages_by_node": r.by_node.iter().map(|(n, c)| (n.to_string(), json!(c)))
                        .collect::<serde_json::Map<_, _>>(),
                    "pages_not_present": r.not_present,
                })
            });
            json!({
                "index": i,
                "spec": d.spec,
                "bytes": d.bytes,
                "regions": d.regions,
                "free": count(Some(i), RegionState::Free),
                "allocated": count(Some(i), RegionState::Allocated),
                "ready": count(Some(i), RegionState::Ready),
                "residency": residency,
                "warning": sample.and_then(|r| pool.placement_problem_of(i, &r).ok().flatten()),
            })
        })
        .collect();
    let mut owners = owners_of(&regions);
    let liveness = |l: Liveness| match l {
        Liveness::Alive => "alive",
        Liveness::Dead => "dead",
        Liveness::Unknown => "unknown",
    };
    let mut clients: Vec<serde_json::Value> = pool
        .clients_info()
        .into_iter()
        .map(|info| {
            let (client, pid, live) = (info.slot, info.pid, info.liveness);
            let (_, allocated, ready) = owners.remove(&(client, pid)).unwrap_or((live, 0, 0));
            let mut c = json!({"client": client, "generation": info.generation, "pid": pid, "uid": info.uid, "liveness": liveness(live), "allocated": allocated, "ready": ready});
            // what a live client published about its own work (its swap-in
            // counters, from the SGLang shim); a dead one's file is stale
            if live != Liveness::Dead {
                match pool.published_stats(&info) {
                    Some(PublishedStats::Found { stats, age_s }) => {
                        c["published"] = stats;
                        c["published_age_s"] = json!((age_s * 10.0).round() / 10.0);
                    }
                    Some(PublishedStats::Unreadable(why)) => c["published_error"] = json!(why),
                    None => {}
                }
            }
            c
        })
        .collect();
    // owners no longer attached (dead, reclaimable)
    clients.extend(owners.into_iter().map(|((client, pid), (live, allocated, ready))| {
        json!({"client": client, "pid": pid, "liveness": liveness(live), "allocated": allocated, "ready": ready})
    }));
    json!({
        "uuid": hex(&pool.uuid()),
        "format_version": kvtier::pool::VERSION,
        "layout": {"entry_bytes": l.entry_bytes(), "layers": l.layers(), "tokens_per_region": l.tokens_per_region()},
        "region_stride": pool.region_stride(),
        "regions": {
            "total": regions.len(),
            "free": count(None, RegionState::Free),
            "allocated": count(None, RegionState::Allocated),
            "ready": count(None, RegionState::Ready),
            "joined": regions.iter().filter(|r| r.joined).count(),
        },
        "devices": devices,
        "clients": clients,
    })
}

fn print_status(pool: &Pool) {
    let l = pool.layout();
    println!(
        "pool {} (format v{}), regions of {} B × {} layers × {} tokens ({} each)",
        hex(&pool.uuid()),
        kvtier::pool::VERSION,
        l.entry_bytes(),
        l.layers(),
        l.tokens_per_region(),
        human_size(pool.region_stride())
    );
    let regions = pool.regions();
    println!("devices:");
    println!(
        "  {:>2}  {:<40} {:>10}  {:>7}  {:>7}  requests (the tags of the requests holding regions there; the SGLang shim \
         tags a rank's host pool with the rank)",
        "#", "device", "size", "regions", "free"
    );
    for (i, d) in pool.devices().iter().enumerate() {
        let requests: std::collections::BTreeSet<u64> = regions
            .iter()
            .filter(|r| r.device == i as u32 && r.owner.is_some())
            .map(|r| r.request)
            .collect();
        let requests = if requests.is_empty() {
            "-".to_string()
        } else {
            let mut list: Vec<String> = requests.iter().take(8).map(|r| r.to_string()).collect();
            if requests.len() > 8 {
                list.push(format!("… ({} in all)", requests.len()));
            }
            list.join(", ")
        };
        println!(
            "  {i:>2}  {:<40} {:>10}  {:>7}  {:>7}  {requests}",
            d.spec,
            human_size(d.bytes),
            d.regions,
            d.free
        );
    }
    for i in 0..pool.devices().len() as u32 {
        match pool.residency(i, 256) {
            Ok(r) => {
                println!(
                    "  {i:>2}  pages (of {} sampled): {}",
                    r.sampled,
                    r.describe()
                );
                if let Ok(Some(problem)) = pool.placement_problem_of(i, &r) {
                    println!("  {i:>2}  warning: {problem}");
                }
            }
            Err(e) => println!("  {i:>2}  pages: {e}"),
        }
    }
    let count = |s: RegionState| regions.iter().filter(|r| r.state == s).count();
    println!(
        "regions: {} total, {} free, {} allocated, {} ready; {} of {} used",
        regions.len(),
        count(RegionState::Free),
        count(RegionState::Allocated),
        count(RegionState::Ready),
        human_size((regions.len() - count(RegionState::Free)) as u64 * pool.region_stride()),
        human_size(regions.len() as u64 * pool.region_stride()),
    );
    let joined = regions.iter().filter(|r| r.joined).count();
    if joined > 0 {
        println!(
            "shared: {joined} allocated regions are joined by other processes (kept, even from a dead owner, \
             while they map them)"
        );
    }
    let owners = owners_of(&regions);
    let attached = pool.clients_info();
    println!("clients attached: {}", attached.len());
    if !owners.is_empty() {
        println!("owners:");
        for ((client, pid), (live, allocated, ready)) in owners {
            let state = match live {
                Liveness::Alive => "alive",
                Liveness::Dead => "dead (reclaimable)",
                Liveness::Unknown => "unknown (another host or PID namespace)",
            };
            println!(
                "  client {client:>4}  pid {pid:>8}  {state:<24} {allocated} allocated, {ready} ready"
            );
        }
    }
}
