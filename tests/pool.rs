//! The pool across processes: shared-file devices (the way tests emulate CXL
//! devices), attach and allocate concurrently, crashes (SIGKILL) at random
//! points, reclamation of dead owners, per-rank interleaving, the
//! non-coherent multi-host mode, and the errors of bad specs and devices.
//!
//! Child processes are this test binary run again with `pool_worker` as the
//! only (ignored) test and its orders in the KVTIER_POOL_WORKER variable.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::pool::{Coherence, Liveness, PoolOptions, RegionState};
use kvtier::{DeviceSpec, LayerFirstLayout, Pool, RegionTicket};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const WORKER_ENV: &str = "KVTIER_POOL_WORKER";

/// A ticket naming region `index`, allocation `epoch`, of `pool`'s own pool
/// (what an owner's `region_ticket` gives, rebuilt where a test passes the
/// two numbers on).
fn ticket(pool: &Pool, index: u32, epoch: u64) -> RegionTicket {
    RegionTicket {
        pool_uuid: pool.uuid(),
        index,
        epoch,
    }
}

/// Small regions: 64-byte entries, 2 layers, 16 tokens (2 KiB, a 4 KiB stride).
fn layout() -> LayerFirstLayout {
    LayerFirstLayout::new(64, 2, 16).unwrap()
}

/// A fresh directory for shared-file devices, on tmpfs where there is one.
struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Dir {
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let d = base.join(format!("kvtier-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    /// `n` file devices of `mib` MiB each.
    fn devices(&self, n: usize, mib: u64) -> Vec<DeviceSpec> {
        (0..n)
            .map(|i| DeviceSpec::file(self.0.join(format!("dev{i}")), mib << 20))
            .collect()
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes a file only its user may read or write, as a pool file is.
fn write_private(path: &std::path::Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
}

fn specs_arg(devices: &[DeviceSpec]) -> String {
    devices
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn parse_specs(s: &str) -> Vec<DeviceSpec> {
    s.split(',').map(|d| d.parse().unwrap()).collect()
}

fn opts(rank: u32, ranks: u32) -> PoolOptions {
    PoolOptions {
        rank,
        ranks,
        ..PoolOptions::default()
    }
}

fn inspect() -> PoolOptions {
    PoolOptions {
        attach: false,
        reclaim_dead: false,
        ..PoolOptions::default()
    }
}

// ---- region contents with a checksum ------------------------------------

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A region's bytes: [seed, owner pid, checksum of the rest, rest...] in
/// layer 0, then layer 1 entirely from the seed.
fn contents(seed: u64, pid: u32) -> Vec<u8> {
    let l = layout();
    let n = l.region_bytes() as usize;
    let mut x = seed;
    let mut bytes = vec![0u8; n];
    for chunk in bytes[24..].chunks_mut(8) {
        chunk.copy_from_slice(&splitmix(&mut x).to_le_bytes()[..chunk.len()]);
    }
    let sum = bytes[24..]
        .iter()
        .fold(0u64, |a, &b| a.wrapping_mul(31).wrapping_add(b as u64));
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    bytes[8..16].copy_from_slice(&(pid as u64).to_le_bytes());
    bytes[16..24].copy_from_slice(&sum.to_le_bytes());
    bytes
}

/// Whether `bytes` are whole contents (any seed, any pid).
fn intact(bytes: &[u8]) -> bool {
    let seed = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let pid = u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as u32;
    bytes == contents(seed, pid)
}

fn write_region(pool: &Pool, r: &kvtier::Region, bytes: &[u8]) {
    let half = bytes.len() / 2;
    pool.write_tokens(r, 0, 0, &bytes[..half]).unwrap();
    pool.write_tokens(r, 1, 0, &bytes[half..]).unwrap();
}

fn read_region(pool: &Pool, r: &kvtier::Region) -> Vec<u8> {
    let mut bytes = vec![0u8; layout().region_bytes() as usize];
    let half = bytes.len() / 2;
    pool.read_tokens(r, 0, 0, &mut bytes[..half]).unwrap();
    pool.read_tokens(r, 1, 0, &mut bytes[half..]).unwrap();
    bytes
}

fn read_ready(pool: &Pool, index: u32) -> Option<Vec<u8>> {
    let mut bytes = vec![0u8; layout().region_bytes() as usize];
    let half = bytes.len() / 2;
    pool.read_ready(index, 0, 0, &mut bytes[..half]).ok()?;
    pool.read_ready(index, 1, 0, &mut bytes[half..]).ok()?;
    Some(bytes)
}

// ---- the worker process --------------------------------------------------

/// Orders (KVTIER_POOL_WORKER): "MODE;DEVICES;ARGS..." with MODE
/// * hold;DEVICES;N;P: allocate N regions, write them, publish P, print
///   "held", then sleep until killed;
/// * place;DEVICES;RANK;RANKS;N: allocate N regions, print their devices;
/// * own;DEVICES: allocate one region, write it, print "owns INDEX EPOCH",
///   wait for a line on stdin, exit normally;
/// * joinregion;DEVICES;INDEX;EPOCH: join that region, print "joined B" (its
///   first byte), wait for a line on stdin, leave it, print "left";
/// * clean;DEVICES;N: allocate and publish N regions, then exit normally;
/// * join;DEVICES;RANK;RANKS: open or create the pool, allocate one region,
///   print "joined UUID DEVICE", wait for a line on stdin, exit normally;
/// * chaos;DEVICES;SEED;MILLIS: random allocate/write/publish/free/verify for
///   MILLIS; exit 3 if a region this process owns ever holds another
///   process's stamp (owned twice), 0 otherwise.
#[test]
#[ignore = "a child process of the multi-process pool tests"]
fn pool_worker() {
    let Ok(orders) = std::env::var(WORKER_ENV) else {
        return;
    };
    // Die with the test that spawned us, whatever becomes of it.
    // SAFETY: prctl(PR_SET_PDEATHSIG) only sets a signal for this process.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let parts: Vec<&str> = orders.split(';').collect();
    let devices = parse_specs(parts[1]);
    let pid = std::process::id();
    match parts[0] {
        "hold" => {
            let pool = Pool::open(devices, PoolOptions::default()).unwrap();
            let (n, p): (usize, usize) = (parts[2].parse().unwrap(), parts[3].parse().unwrap());
            let mut held = Vec::new();
            for i in 0..n {
                let r = pool.alloc_region_for(i as u64).unwrap();
                write_region(&pool, &r, &contents(i as u64 + 1000 * pid as u64, pid));
                if i < p {
                    pool.publish(&r).unwrap();
                }
                held.push(r);
            }
            println!("held");
            std::thread::sleep(Duration::from_secs(60));
        }
        "place" => {
            let (rank, ranks, n): (u32, u32, usize) = (
                parts[2].parse().unwrap(),
                parts[3].parse().unwrap(),
                parts[4].parse().unwrap(),
            );
            let pool = Pool::open(devices, opts(rank, ranks)).unwrap();
            let got: Vec<String> = (0..n)
                .map(|_| pool.alloc_region().unwrap().device().to_string())
                .collect();
            println!("devices {}", got.join(","));
        }
        "join" => {
            let (rank, ranks): (u32, u32) = (parts[2].parse().unwrap(), parts[3].parse().unwrap());
            let pool = Pool::open_or_create(layout(), devices, opts(rank, ranks)).unwrap();
            let region = pool.alloc_region().unwrap();
            let uuid: String = pool.uuid().iter().map(|b| format!("{b:02x}")).collect();
            println!("joined {uuid} {}", region.device());
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).unwrap();
        }
        "own" => {
            let pool = Pool::open(devices, PoolOptions::default()).unwrap();
            let r = pool.alloc_region().unwrap();
            write_region(&pool, &r, &contents(7, pid));
            println!("owns {} {}", r.index(), pool.region_epoch(&r).unwrap());
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).unwrap();
        }
        "joinregion" => {
            let (index, epoch): (u32, u64) = (parts[2].parse().unwrap(), parts[3].parse().unwrap());
            let pool = Pool::open(devices, PoolOptions::default()).unwrap();
            let r = pool.join_region(ticket(&pool, index, epoch)).unwrap();
            // the owner's bytes, read through this process's own mapping
            let first = read_region(&pool, &r)[0];
            println!("joined {first}");
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).unwrap();
            pool.free_region(r).unwrap();
            println!("left");
        }
        "clean" => {
            let pool = Pool::open(devices, PoolOptions::default()).unwrap();
            for i in 0..parts[2].parse().unwrap() {
                // the handle goes; the region stays allocated until the pool drops
                pool.publish(&pool.alloc_region_for(i).unwrap()).unwrap();
            }
            println!("done");
        }
        "chaos" => {
            let seed: u64 = parts[2].parse().unwrap();
            let millis: u64 = parts[3].parse().unwrap();
            let mut rng = StdRng::seed_from_u64(seed);
            let pool = Pool::open(devices, PoolOptions::default()).unwrap();
            let end = Instant::now() + Duration::from_millis(millis);
            let mut mine: Vec<(kvtier::Region, Vec<u8>)> = Vec::new();
            while Instant::now() < end {
                match rng.random_range(0..10) {
                    0..=3 if mine.len() < 6 => match pool.alloc_region() {
                        Ok(r) => {
                            let bytes = contents(rng.random(), pid);
                            write_region(&pool, &r, &bytes);
                            if rng.random_bool(0.6) {
                                pool.publish(&r).unwrap();
                            }
                            mine.push((r, bytes));
                        }
                        Err(e) => assert!(e.to_string().contains("pool is full"), "{e}"),
                    },
                    4..=6 if !mine.is_empty() => {
                        let (r, bytes) = mine.swap_remove(rng.random_range(0..mine.len()));
                        if read_region(&pool, &r) != bytes {
                            eprintln!("region {} changed under its owner {pid}", r.index());
                            std::process::exit(3);
                        }
                        pool.free_region(r).unwrap();
                    }
                    _ => {
                        for (r, bytes) in &mine {
                            if read_region(&pool, r) != *bytes {
                                eprintln!("region {} changed under its owner {pid}", r.index());
                                std::process::exit(3);
                            }
                        }
                    }
                }
            }
        }
        other => panic!("unknown worker mode {other}"),
    }
}

/// A worker process, killed when dropped (a failing test leaves none behind).
struct Worker(Child);

impl std::ops::Deref for Worker {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Worker {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn worker(orders: &str) -> Worker {
    Worker(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "pool_worker",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
                "--quiet",
            ])
            .env(WORKER_ENV, orders)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    )
}

/// A worker in PID and user namespaces of its own (`unshare -Urpf
/// --mount-proc`), as a container sharing the pool's files runs: its pid
/// means nothing here. A machine where unshare cannot run fails the test.
fn worker_in_namespace(orders: &str) -> Worker {
    Worker(
        Command::new("unshare")
            .args(["-Urpf", "--mount-proc", "--kill-child"])
            .arg(std::env::current_exe().unwrap())
            .args([
                "pool_worker",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
                "--quiet",
            ])
            .env(WORKER_ENV, orders)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("unshare runs (user and PID namespaces are needed for this test)"),
    )
}

/// Polls `done` every 20 ms until it holds; fails with `what` after 10 s.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(t0.elapsed() < Duration::from_secs(10), "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for the worker to print a line starting with `prefix`; returns it.
fn wait_line(child: &mut Worker, prefix: &str) -> String {
    let out = child.stdout.as_mut().unwrap();
    let mut reader = BufReader::new(out);
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "worker ended before printing {prefix:?}"
        );
        if line.starts_with(prefix) {
            return line.trim().to_string();
        }
    }
}

// ---- the tests ------------------------------------------------------------

#[test]
fn processes_share_one_pool_through_files() {
    let dir = Dir::new("share");
    let devices = dir.devices(2, 4);
    let a = Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap();
    let b = Pool::open_expecting(devices.clone(), layout(), PoolOptions::default()).unwrap();
    assert_eq!(a.uuid(), b.uuid());
    assert_eq!(a.num_regions(), b.num_regions());
    let total = a.num_regions();
    let ra = a.alloc_region_for(7).unwrap();
    write_region(&a, &ra, &contents(1, 1));
    a.publish(&ra).unwrap();
    assert_eq!(b.free_regions(), total - 1, "b sees a's allocation");
    assert_eq!(
        read_ready(&b, ra.index()).unwrap(),
        contents(1, 1),
        "b reads a's published bytes"
    );
    let rb = b.alloc_region().unwrap();
    assert_ne!(rb.index(), ra.index());
    let infos = b.regions();
    assert_eq!(infos[ra.index() as usize].request, 7);
    // a handle is good only with the pool object that allocated it
    let err = b.free_region(ra).unwrap_err().to_string();
    assert!(err.contains("another pool"), "{err}");
    drop(b);
    assert_eq!(
        a.free_regions(),
        total - 1,
        "b's clean exit freed its region; a still owns one"
    );
}

#[test]
fn a_killed_owner_is_reclaimed_by_the_next_opener() {
    let dir = Dir::new("reclaim");
    let devices = dir.devices(1, 4);
    let creator = Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap();
    let total = creator.num_regions();
    drop(creator);
    let mut child = worker(&format!("hold;{};5;3", specs_arg(&devices)));
    wait_line(&mut child, "held");

    let look = Pool::open(devices.clone(), inspect()).unwrap();
    let owned: Vec<_> = look
        .regions()
        .into_iter()
        .filter(|r| r.state != RegionState::Free)
        .collect();
    assert_eq!(owned.len(), 5);
    assert_eq!(
        owned
            .iter()
            .filter(|r| r.state == RegionState::Ready)
            .count(),
        3
    );
    assert!(
        owned
            .iter()
            .all(|r| r.owner.as_ref().unwrap().liveness == Liveness::Alive)
    );
    assert_eq!(
        look.check().reclaimable_regions,
        0,
        "a live owner's regions are not reclaimable"
    );
    for r in owned.iter().filter(|r| r.state == RegionState::Ready) {
        assert!(intact(&read_ready(&look, r.index).unwrap()));
    }
    // a live owner's regions survive another process's open
    drop(Pool::open(devices.clone(), PoolOptions::default()).unwrap());
    assert_eq!(look.free_regions(), total - 5);

    child.kill().unwrap();
    child.wait().unwrap();
    let report = look.check();
    assert_eq!(report.dead_clients.len(), 1, "{report:?}");
    assert_eq!(report.dead_clients[0].1, child.id());
    assert_eq!(report.reclaimable_regions, 5);
    assert!(report.problems.is_empty());
    let next = Pool::open(devices.clone(), PoolOptions::default()).unwrap();
    assert_eq!(
        next.free_regions(),
        total,
        "the dead owner's regions are back"
    );
    assert!(look.check().dead_clients.is_empty());
}

/// A worker that joins `region` (told its index and epoch), once it has; and
/// the line it printed ("joined B", B the region's first byte).
fn join_in_worker(
    pool: &Pool,
    devices: &[DeviceSpec],
    region: &kvtier::Region,
) -> (Worker, String) {
    let epoch = pool.region_epoch(region).unwrap();
    let mut peer = worker(&format!(
        "joinregion;{};{};{epoch}",
        specs_arg(devices),
        region.index()
    ));
    let line = wait_line(&mut peer, "joined");
    (peer, line)
}

/// Tells a `join_in_worker` worker to leave, and waits for its clean exit.
fn leave_in_worker(peer: &mut Worker) {
    writeln!(peer.stdin.as_mut().unwrap()).unwrap();
    wait_line(peer, "left");
    assert!(peer.wait().unwrap().success());
}

#[test]
fn a_joined_region_is_one_copy_and_outlives_its_dead_owner() {
    let dir = Dir::new("joined-dead");
    let devices = dir.devices(1, 4);
    drop(Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap());
    let mut owner = worker(&format!("own;{}", specs_arg(&devices)));
    let line = wait_line(&mut owner, "owns");
    let f: Vec<u64> = line
        .split(' ')
        .skip(1)
        .map(|x| x.parse().unwrap())
        .collect();
    let (index, epoch) = (f[0] as u32, f[1]);

    let pool = Pool::open(devices.clone(), PoolOptions::default()).unwrap();
    let err = |r: kvtier::Result<kvtier::Region>| r.map(|_| ()).unwrap_err().to_string();
    assert!(err(pool.join_region(ticket(&pool, index, epoch + 1))).contains("is gone"));
    assert!(
        err(pool.join_region(ticket(&pool, pool.num_regions(), epoch))).contains("does not exist")
    );
    let free = (0..pool.num_regions()).find(|&i| i != index).unwrap();
    assert!(err(pool.join_region(ticket(&pool, free, 0))).contains("free"));
    let mine = pool.alloc_region().unwrap();
    let my_epoch = pool.region_epoch(&mine).unwrap();
    assert!(err(pool.join_region(ticket(&pool, mine.index(), my_epoch))).contains("own"));

    let joined = pool.join_region(ticket(&pool, index, epoch)).unwrap();
    assert!(joined.is_joined());
    // one copy: the owner's bytes, and a write here is the owner's too
    assert_eq!(read_region(&pool, &joined), contents(7, owner.id()));
    assert!(!pool.region_joined_elsewhere(&mine).unwrap());
    let look = Pool::open(devices.clone(), inspect()).unwrap();

    owner.kill().unwrap();
    owner.wait().unwrap();
    // the dead owner's region stays while this process maps it
    assert!(
        look.regions()
            .iter()
            .any(|r| r.index == index && r.joined && r.state == RegionState::Allocated)
    );
    assert_eq!(
        look.check().reclaimable_regions,
        0,
        "a joined region is not reclaimable"
    );
    drop(Pool::open(devices.clone(), PoolOptions::default()).unwrap());
    assert_eq!(look.region_state(index).unwrap(), RegionState::Allocated);
    assert_eq!(read_region(&pool, &joined), contents(7, owner.id()));
    // nor does a reclaim by this very process (its own hold is not a lock it sees)
    assert_eq!(pool.reclaim_dead().unwrap().regions, 0);
    assert!(err(pool.join_region(ticket(&pool, index, epoch))).contains("not alive"));

    // the last joiner of a dead owner's region frees it as it leaves
    pool.free_region(joined).unwrap();
    assert_eq!(look.region_state(index).unwrap(), RegionState::Free);
    pool.free_region(mine).unwrap();
}

#[test]
fn an_owner_cannot_free_a_region_while_a_peer_has_joined_it() {
    let dir = Dir::new("joined-free");
    let devices = dir.devices(1, 4);
    let pool = Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap();
    let total = pool.num_regions();
    let shared = pool.alloc_region().unwrap();
    let other = pool.alloc_region().unwrap();
    write_region(&pool, &shared, &[9u8; 128]);
    let (mut peer, joined) = join_in_worker(&pool, &devices, &shared);
    assert_eq!(joined, "joined 9");
    assert!(pool.region_joined_elsewhere(&shared).unwrap());
    assert!(!pool.region_joined_elsewhere(&other).unwrap());
    pool.free_region(other).unwrap();
    // another opener's reclaim leaves a live owner's joined region alone
    drop(Pool::open(devices.clone(), PoolOptions::default()).unwrap());
    assert_eq!(
        pool.region_state(shared.index()).unwrap(),
        RegionState::Allocated
    );

    let index = shared.index();
    let e = pool.free_region(shared).unwrap_err().to_string();
    assert!(
        e.contains("still mapped by a process that joined it"),
        "{e}"
    );
    assert_eq!(pool.region_state(index).unwrap(), RegionState::Allocated);
    // the refused region goes with its last joiner's leave, the owner alive
    leave_in_worker(&mut peer);
    assert_eq!(pool.region_state(index).unwrap(), RegionState::Free);
    drop(pool);
    let look = Pool::open(devices.clone(), inspect()).unwrap();
    assert_eq!(look.free_regions(), total);
}

#[test]
fn a_region_left_joined_by_a_clean_exit_is_freed_by_its_last_joiner() {
    let dir = Dir::new("joined-orphan");
    let devices = dir.devices(1, 4);
    let pool = Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap();
    let total = pool.num_regions();
    let shared = pool.alloc_region().unwrap();
    let (mut peer, _) = join_in_worker(&pool, &devices, &shared);
    let index = shared.index();
    drop(pool); // the owner exits cleanly while the peer maps the region
    let look = Pool::open(devices.clone(), inspect()).unwrap();
    drop(Pool::open(devices.clone(), PoolOptions::default()).unwrap());
    assert_eq!(
        look.region_state(index).unwrap(),
        RegionState::Allocated,
        "an orphan still held stays"
    );
    leave_in_worker(&mut peer);
    // freed by the joiner as it left, not by a later reclaim
    assert_eq!(look.free_regions(), total);
}

/// Region numbers and epochs repeat from pool to pool (every fresh pool's
/// first allocation of region 0 has the same epoch): a ticket names its
/// pool, so pool A's never maps pool B's bytes, nor does a ticket of a pool
/// destroyed and made again on the same file.
#[test]
fn a_ticket_joins_only_the_pool_it_names() {
    let (da, db) = (Dir::new("ticket-a"), Dir::new("ticket-b"));
    let (devices_a, devices_b) = (da.devices(1, 4), db.devices(1, 4));
    let a = Pool::create_on(layout(), devices_a, PoolOptions::default()).unwrap();
    let b = Pool::create_on(layout(), devices_b.clone(), PoolOptions::default()).unwrap();
    let peer_b = Pool::open(devices_b.clone(), PoolOptions::default()).unwrap();
    let (ra, rb) = (a.alloc_region().unwrap(), b.alloc_region().unwrap());
    let (ta, tb) = (a.region_ticket(&ra).unwrap(), b.region_ticket(&rb).unwrap());
    assert_eq!(
        (ta.index, ta.epoch),
        (tb.index, tb.epoch),
        "the numbers alone repeat"
    );
    let e = peer_b.join_region(ta).unwrap_err().to_string();
    assert!(e.contains("not of this pool"), "{e}");
    let j = peer_b.join_region(tb).unwrap();
    peer_b.free_region(j).unwrap();
    b.free_region(rb).unwrap();
    drop((b, peer_b));
    Pool::destroy(devices_b.clone(), false).unwrap();
    let b2 = Pool::create_on(layout(), devices_b.clone(), PoolOptions::default()).unwrap();
    let peer_b2 = Pool::open(devices_b, PoolOptions::default()).unwrap();
    let r2 = b2.alloc_region().unwrap();
    let t2 = b2.region_ticket(&r2).unwrap();
    assert_eq!((t2.index, t2.epoch), (tb.index, tb.epoch));
    let e = peer_b2.join_region(tb).unwrap_err().to_string();
    assert!(e.contains("not of this pool"), "{e}");
    assert!(peer_b2.join_region(t2).is_ok());
    a.free_region(ra).unwrap();
}

#[test]
fn a_join_racing_its_owners_free_never_holds_a_freed_region() {
    // The owner allocates, tells the joiner (index, epoch), and frees
    // almost at once; the joiner joins whatever it was told. Whoever wins, a joined
    // handle never maps a region that is free (or someone else's).
    use std::sync::atomic::{AtomicBool, Ordering};
    const ROUNDS: u32 = 20_000;
    let dir = Dir::new("join-race");
    // room for every region a refused free leaves allocated
    let devices = dir.devices(1, 256);
    let owner = Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap();
    let peer = Pool::open(devices.clone(), PoolOptions::default()).unwrap();
    let told = Arc::new(std::sync::Mutex::new(None::<(u32, u64)>));
    let done = Arc::new(AtomicBool::new(false));
    let joiner = {
        let (told, done, peer) = (told.clone(), done.clone(), peer.clone());
        std::thread::spawn(move || {
            let (mut joins, mut breaches) = (0u32, 0u32);
            while !done.load(Ordering::Acquire) {
                let Some((index, epoch)) = *told.lock().unwrap() else {
                    continue;
                };
                if let Ok(r) = peer.join_region(ticket(&peer, index, epoch)) {
                    joins += 1;
                    for _ in 0..50 {
                        if peer.region_state(index).unwrap() == RegionState::Free {
                            breaches += 1;
                        }
                    }
                    peer.free_region(r).unwrap();
                }
            }
            (joins, breaches)
        })
    };
    let (mut freed, mut refused) = (0u32, 0u32);
    for _ in 0..ROUNDS {
        let r = owner.alloc_region().unwrap();
        *told.lock().unwrap() = Some((r.index(), owner.region_epoch(&r).unwrap()));
        for _ in 0..20 {
            std::thread::yield_now();
        }
        match owner.free_region(r) {
            Ok(()) => freed += 1,
            Err(e) => {
                assert!(e.to_string().contains("still mapped"), "{e}");
                refused += 1;
            }
        }
    }
    done.store(true, Ordering::Release);
    let (joins, breaches) = joiner.join().unwrap();
    assert_eq!(breaches, 0, "a joined region was freed under its joiner");
    assert_eq!(freed + refused, ROUNDS);
    assert!(joins > 0, "the joiner never joined: the race was not run");
    eprintln!("{joins} joins; {freed} frees, {refused} refused while joined");
}

#[test]
fn a_forked_child_leaves_nothing_of_its_parents_join() {
    let dir = Dir::new("joined-fork");
    let devices = dir.devices(1, 4);
    let owner = Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap();
    let peer = Pool::open(devices.clone(), PoolOptions::default()).unwrap();
    let shared = owner.alloc_region().unwrap();
    let joined = peer
        .join_region(owner.region_ticket(&shared).unwrap())
        .unwrap();
    let index = joined.index();
    let theirs = peer.clone(); // the parent keeps its own
    let code = in_forked_child(move || {
        // the child's copy of the handle: freeing it must not drop the
        // parent's hold (an OFD lock the two share)
        i32::from(theirs.free_region(joined).is_err())
    });
    assert_eq!(code, 0);
    assert!(
        owner.region_joined_elsewhere(&shared).unwrap(),
        "the parent still holds it"
    );
    let e = owner.free_region(shared).unwrap_err().to_string();
    assert!(e.contains("still mapped"), "{e}");
    assert_eq!(owner.region_state(index).unwrap(), RegionState::Allocated);
}

#[test]
fn threads_of_one_joiner_never_drop_each_others_hold() {
    // Two threads of one pool handle join and leave one region: while one
    // holds a joined handle, the owner sees the region held.
    use std::sync::atomic::{AtomicU64, Ordering};
    let dir = Dir::new("joined-threads");
    let devices = dir.devices(1, 4);
    let owner = Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap();
    let peer = Pool::open(devices.clone(), PoolOptions::default()).unwrap();
    let r = Arc::new(owner.alloc_region().unwrap());
    let (index, epoch) = (r.index(), owner.region_epoch(&r).unwrap());
    let lost = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let (peer, owner, r, lost) = (peer.clone(), owner.clone(), r.clone(), lost.clone());
            std::thread::spawn(move || {
                for _ in 0..100_000 {
                    let j = peer.join_region(ticket(&peer, index, epoch)).unwrap();
                    if !owner.region_joined_elsewhere(&r).unwrap() {
                        lost.fetch_add(1, Ordering::Relaxed);
                    }
                    peer.free_region(j).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(
        lost.load(Ordering::Relaxed),
        0,
        "a joined handle whose hold the owner did not see"
    );
}

#[test]
fn an_owners_exit_racing_its_last_joiners_leave_leaves_no_orphan() {
    let dir = Dir::new("joined-exit-race");
    let devices = dir.devices(1, 4);
    let no_reclaim = PoolOptions {
        reclaim_dead: false,
        ..PoolOptions::default()
    };
    let first = Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap();
    let look = Pool::open(devices.clone(), inspect()).unwrap();
    let total = look.num_regions();
    let peer = Pool::open(devices.clone(), no_reclaim.clone()).unwrap();
    drop(first);
    for i in 0..3000 {
        let owner = Pool::open(devices.clone(), no_reclaim.clone()).unwrap();
        // the owner's handle goes without a free (as after a refused one)
        let r = owner.alloc_region().unwrap();
        let j = peer.join_region(owner.region_ticket(&r).unwrap()).unwrap();
        let both = std::sync::Barrier::new(2);
        std::thread::scope(|s| {
            s.spawn(|| {
                both.wait();
                drop(owner);
            });
            s.spawn(|| {
                both.wait();
                for _ in 0..(i % 50) {
                    std::hint::spin_loop();
                }
                peer.free_region(j).unwrap();
            });
        });
        assert_eq!(
            look.free_regions(),
            total,
            "round {i}: the region stayed allocated, nobody holding it"
        );
    }
}

#[test]
fn private_devices_share_no_region() {
    let pool = Pool::create_on(
        layout(),
        vec![DeviceSpec::Anon { bytes: 8 << 20 }],
        PoolOptions::default(),
    )
    .unwrap();
    let r = pool.alloc_region().unwrap();
    let e = pool
        .join_region(ticket(&pool, r.index(), 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("file: or dax:"), "{e}");
}

#[test]
fn a_clean_exit_frees_its_regions() {
    let dir = Dir::new("clean");
    let devices = dir.devices(1, 4);
    let pool = Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap();
    let total = pool.num_regions();
    let mut child = worker(&format!("clean;{};4", specs_arg(&devices)));
    wait_line(&mut child, "done");
    assert!(child.wait().unwrap().success());
    assert_eq!(pool.free_regions(), total);
    assert!(
        pool.clients_info()
            .iter()
            .all(|c| c.pid == std::process::id()),
        "only this process is attached"
    );
}

#[test]
fn ranks_interleave_over_devices_across_processes() {
    let dir = Dir::new("interleave");
    let devices = dir.devices(4, 4);
    let pool = Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap();
    let mut children: Vec<Worker> = (0..2)
        .map(|rank| worker(&format!("place;{};{rank};2;4", specs_arg(&devices))))
        .collect();
    let lines: Vec<String> = children
        .iter_mut()
        .map(|c| wait_line(c, "devices"))
        .collect();
    for c in &mut children {
        assert!(c.wait().unwrap().success());
    }
    assert_eq!(lines, vec!["devices 0,2,0,2", "devices 1,3,1,3"]);
    assert_eq!(
        pool.free_regions(),
        pool.num_regions(),
        "the workers exited cleanly"
    );
}

#[test]
fn ranks_starting_together_create_one_pool_and_interleave() {
    let dir = Dir::new("join");
    let devices = dir.devices(3, 4);
    let ranks = 6;
    // No pool yet: every rank races to create it.
    let mut children: Vec<Worker> = (0..ranks)
        .map(|rank| worker(&format!("join;{};{rank};{ranks}", specs_arg(&devices))))
        .collect();
    let lines: Vec<Vec<String>> = children
        .iter_mut()
        .map(|c| {
            wait_line(c, "joined")
                .split(' ')
                .map(String::from)
                .collect()
        })
        .collect();
    let uuids: std::collections::HashSet<&str> = lines.iter().map(|l| l[1].as_str()).collect();
    assert_eq!(uuids.len(), 1, "one pool, created once: {lines:?}");
    let placed: Vec<&str> = lines.iter().map(|l| l[2].as_str()).collect();
    assert_eq!(
        placed,
        vec!["0", "1", "2", "0", "1", "2"],
        "rank r → device r mod 3"
    );
    let pool = Pool::open_expecting(devices.clone(), layout(), inspect()).unwrap();
    let uuid: String = pool.uuid().iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(uuid, lines[0][1]);
    assert_eq!(pool.free_regions(), pool.num_regions() - ranks);
    for c in &mut children {
        writeln!(c.stdin.as_mut().unwrap()).unwrap();
        assert!(c.wait().unwrap().success());
    }
    assert_eq!(
        pool.free_regions(),
        pool.num_regions(),
        "clean exits free their regions"
    );

    // An existing pool whose regions are too small for a layout is refused,
    // not overwritten.
    let other = LayerFirstLayout::new(64, 8, 16).unwrap();
    let err = pool_error(Pool::open_or_create(other, devices.clone(), opts(0, 1)));
    assert!(err.contains("this process needs 8 KiB"), "{err}");
    // Private devices are never shared: a new pool each time.
    let anon = vec![DeviceSpec::Anon {
        bytes: Pool::device_bytes_for(&layout(), 1).unwrap(),
    }];
    let a = Pool::open_or_create(layout(), anon.clone(), opts(0, 1)).unwrap();
    let b = Pool::open_or_create(layout(), anon, opts(0, 1)).unwrap();
    assert_ne!(a.uuid(), b.uuid());
}

#[test]
fn full_devices_are_skipped_and_a_full_pool_says_so() {
    let dir = Dir::new("full");
    let devices = dir.devices(2, 4);
    let pool = Pool::create_on(layout(), devices, opts(0, 1)).unwrap();
    let per = pool.devices().iter().map(|d| d.regions).collect::<Vec<_>>();
    let mut got = Vec::new();
    while let Ok(r) = pool.alloc_region() {
        got.push(r.device()); // the handle goes, the region stays allocated
    }
    assert_eq!(got.len() as u32, pool.num_regions());
    for (d, &n) in per.iter().enumerate() {
        assert_eq!(got.iter().filter(|&&g| g == d as u32).count() as u32, n);
    }
    let err = pool.alloc_region().unwrap_err().to_string();
    assert!(err.contains("pool is full"), "{err}");
}

/// Six processes allocating, writing, publishing and freeing at once, killed
/// (SIGKILL) at random points and replaced, for about three seconds.
/// Afterwards every READY region holds whole bytes, no worker ever saw its
/// region change under it (a region owned twice), and every region of a
/// dead worker is reclaimed.
#[test]
fn crashes_at_random_points_leak_nothing_and_publish_nothing_partial() {
    let dir = Dir::new("chaos");
    let devices = dir.devices(3, 4);
    let creator = Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap();
    let total = creator.num_regions();
    drop(creator);
    let spec = specs_arg(&devices);
    let mut rng = StdRng::seed_from_u64(42);
    let mut seed = 0u64;
    // every other worker runs in PID and user namespaces of its own
    let mut spawn = |rng: &mut StdRng| {
        seed += 1;
        let orders = format!("chaos;{spec};{seed};{}", rng.random_range(300..1500));
        if seed.is_multiple_of(2) {
            worker_in_namespace(&orders)
        } else {
            worker(&orders)
        }
    };
    let mut workers: Vec<Worker> = (0..6).map(|_| spawn(&mut rng)).collect();
    let (mut killed, mut finished) = (0, 0);
    // three seconds in CI; KVTIER_CHAOS_SECS for a long run
    let secs = std::env::var("KVTIER_CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(rng.random_range(20..120)));
        let i = rng.random_range(0..workers.len());
        match workers[i].try_wait().unwrap() {
            Some(status) => {
                assert!(
                    status.success(),
                    "a worker found a region owned twice or failed: {status}"
                );
                finished += 1;
            }
            None => {
                workers[i].kill().unwrap();
                workers[i].wait().unwrap();
                killed += 1;
            }
        }
        workers[i] = spawn(&mut rng);
    }
    // the first three run to their end (checking exit codes), the rest die
    for (i, mut w) in workers.into_iter().enumerate() {
        if i < 3 {
            let status = w.wait().unwrap();
            assert!(
                status.success(),
                "a worker found a region owned twice or failed: {status}"
            );
            finished += 1;
        } else {
            let _ = w.kill();
            let _ = w.wait();
            killed += 1;
        }
    }
    assert!(
        killed > 5 && finished > 0,
        "killed {killed}, finished {finished}"
    );

    // a namespaced worker dies a moment after its unshare
    wait_until("every worker has exited", || {
        Pool::open(devices.clone(), inspect())
            .unwrap()
            .regions()
            .iter()
            .all(|r| {
                r.owner
                    .as_ref()
                    .is_none_or(|o| o.liveness == Liveness::Dead)
            })
    });
    let look = Pool::open(devices.clone(), inspect()).unwrap();
    let report = look.check();
    assert!(report.problems.is_empty(), "{report:?}");
    for r in look.regions() {
        if r.state == RegionState::Ready {
            assert!(
                intact(&read_ready(&look, r.index).unwrap()),
                "region {} is READY with partial bytes",
                r.index
            );
        }
        if let Some(o) = &r.owner {
            assert_eq!(o.liveness, Liveness::Dead, "every worker has exited: {r:?}");
        }
    }
    let next = Pool::open(devices, PoolOptions::default()).unwrap();
    assert_eq!(
        next.free_regions(),
        total,
        "every dead worker's regions were reclaimed"
    );
    assert!(next.check().dead_clients.is_empty());
}

#[test]
fn non_coherent_hosts_allocate_from_their_own_partitions() {
    let dir = Dir::new("hosts");
    let devices = dir.devices(1, 4);
    let host = |h| PoolOptions {
        coherence: Coherence::NonCoherent { hosts: 2, host: h },
        ..PoolOptions::default()
    };
    let h0 = Pool::create_on(layout(), devices.clone(), host(0)).unwrap();
    let h1 = Pool::open(devices.clone(), host(1)).unwrap();
    let a: Vec<_> = (0..3).map(|_| h0.alloc_region().unwrap()).collect();
    let b: Vec<_> = (0..3).map(|_| h1.alloc_region().unwrap()).collect();
    assert!(a.iter().all(|r| r.index() % 2 == 0) && b.iter().all(|r| r.index() % 2 == 1));
    write_region(&h0, &a[0], &contents(9, 9));
    h0.publish(&a[0]).unwrap();
    assert_eq!(
        read_ready(&h1, a[0].index()).unwrap(),
        contents(9, 9),
        "published bytes reach the other host"
    );
    let err = Pool::open(devices.clone(), PoolOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("shared by 2 hosts"), "{err}");
    let err = Pool::open(
        devices,
        PoolOptions {
            coherence: Coherence::NonCoherent { hosts: 3, host: 0 },
            ..PoolOptions::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("shared by 2 hosts"), "{err}");
}

fn pool_error(r: kvtier::Result<Arc<Pool>>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_devices_and_mismatched_pools_give_clear_errors() {
    let dir = Dir::new("errors");
    let devices = dir.devices(2, 4);
    // no pool yet (a file of this user's alone: one open to others is refused first)
    write_private(&dir.0.join("dev0"), &vec![0u8; 4 << 20]);
    let err = pool_error(Pool::open(
        vec![DeviceSpec::File {
            path: dir.0.join("dev0"),
            bytes: None,
        }],
        PoolOptions::default(),
    ));
    assert!(err.contains("no kvtier pool"), "{err}");
    let err = pool_error(Pool::open(
        vec![DeviceSpec::File {
            path: dir.0.join("missing"),
            bytes: None,
        }],
        PoolOptions::default(),
    ));
    assert!(err.contains("missing"), "{err}");
    // a new file without a size: said so, and no file left behind
    let err = pool_error(Pool::create_on(
        layout(),
        vec![DeviceSpec::File {
            path: dir.0.join("unsized"),
            bytes: None,
        }],
        PoolOptions::default(),
    ));
    assert!(err.contains("needs a size"), "{err}");
    assert!(!dir.0.join("unsized").exists());
    // too small
    let err = pool_error(Pool::create_on(
        layout(),
        vec![DeviceSpec::file(dir.0.join("tiny"), 1 << 20)],
        PoolOptions::default(),
    ));
    assert!(
        err.contains("is 1 MiB; a pool device holds at least 2 MiB"),
        "{err}"
    );
    let big = LayerFirstLayout::new(1024, 64, 1024).unwrap(); // 64 MiB regions
    let err = pool_error(Pool::create_on(
        big,
        devices.clone(),
        PoolOptions::default(),
    ));
    assert!(err.contains("hold no region"), "{err}");

    let pool = Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap();
    // a second create over a live pool is refused, and corrupts nothing
    let err = pool_error(Pool::create_on(
        layout(),
        devices.clone(),
        PoolOptions::default(),
    ));
    assert!(err.contains("already holds a kvtier pool"), "{err}");
    let other = LayerFirstLayout::new(656, 2, 16).unwrap();
    let err = pool_error(Pool::open_expecting(
        devices.clone(),
        other,
        PoolOptions::default(),
    ));
    assert!(err.contains("656 B"), "{err}");
    let err = pool_error(Pool::open(devices[..1].to_vec(), PoolOptions::default()));
    assert!(err.contains("spans 2 devices; 1 was given"), "{err}");
    let swapped = vec![devices[1].clone(), devices[0].clone()];
    let err = pool_error(Pool::open(swapped, PoolOptions::default()));
    assert!(
        err.contains("is device 1 of a pool, not its first"),
        "{err}"
    );
    // a device of another pool
    let dir2 = Dir::new("errors-other");
    let foreign = dir2.devices(2, 4);
    drop(Pool::create_on(layout(), foreign.clone(), PoolOptions::default()).unwrap());
    std::fs::copy(
        foreign[1].to_string().split(':').nth(1).unwrap(),
        dir.0.join("dev1-foreign"),
    )
    .unwrap();
    let mixed = vec![
        devices[0].clone(),
        DeviceSpec::File {
            path: dir.0.join("dev1-foreign"),
            bytes: None,
        },
    ];
    let err = pool_error(Pool::open(mixed, PoolOptions::default()));
    assert!(err.contains("device 1 of the pool is"), "{err}");
    // a pool of another format version
    let f = dir.0.join("dev0");
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[8] = 99;
    write_private(&dir.0.join("future"), &bytes);
    let err = pool_error(Pool::open(
        vec![DeviceSpec::File {
            path: dir.0.join("future"),
            bytes: None,
        }],
        PoolOptions::default(),
    ));
    assert!(err.contains("format version 99"), "{err}");
    // after all this the pool is intact
    let again = Pool::open_expecting(devices.clone(), layout(), PoolOptions::default()).unwrap();
    assert!(again.check().problems.is_empty());
    assert_eq!(again.num_regions(), pool.num_regions());
    // destroy: refused while others are attached, then the pool is gone
    let err = Pool::destroy(devices.clone(), false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("attached"), "{err}");
    drop((pool, again));
    Pool::destroy(devices.clone(), false).unwrap();
    let err = pool_error(Pool::open(devices, PoolOptions::default()));
    assert!(err.contains("no kvtier pool"), "{err}");
}

/// Pipeline-parallel stages hold different layer ranges: stages sharing one
/// pool each lay its regions out with a layout of their own, as long as the
/// regions (sized for the largest stage) have room.
#[test]
fn pipeline_stages_share_one_pool_with_layouts_of_their_own() {
    let dir = Dir::new("pipeline");
    let devices = dir.devices(2, 4);
    // entries of 1 KiB, 4 tokens: a layer is 4 KiB, so a 3-layer region
    // fills its 12 KiB stride exactly
    let stage0 = LayerFirstLayout::new(1024, 3, 4).unwrap();
    let stage1 = LayerFirstLayout::new(1024, 2, 4).unwrap();
    let a = Pool::open_or_create(stage0, devices.clone(), opts(0, 2)).unwrap();
    let b = Pool::open_or_create(stage1, devices.clone(), opts(1, 2)).unwrap();
    assert_eq!((a.uuid(), a.region_stride()), (b.uuid(), 12288), "one pool");
    assert_eq!(
        (a.layout(), b.layout()),
        (stage0, stage1),
        "each stage its own layout"
    );
    let (ra, rb) = (a.alloc_region().unwrap(), b.alloc_region().unwrap());
    assert_ne!(ra.index(), rb.index());
    // each writes every token of every layer of its own region
    let fill = |pool: &Pool, r: &kvtier::Region, l: LayerFirstLayout, tag: u8| {
        for layer in 0..l.layers() {
            let bytes = vec![tag + layer as u8; (l.entry_bytes() * l.tokens_per_region()) as usize];
            pool.write_tokens(r, layer, 0, &bytes).unwrap();
        }
    };
    fill(&a, &ra, stage0, 10);
    fill(&b, &rb, stage1, 20);
    for (pool, r, l, tag) in [(&a, &ra, stage0, 10u8), (&b, &rb, stage1, 20)] {
        for layer in 0..l.layers() {
            let mut got = vec![0u8; (l.entry_bytes() * l.tokens_per_region()) as usize];
            pool.read_tokens(r, layer, 0, &mut got).unwrap();
            assert!(
                got.iter().all(|&x| x == tag + layer as u8),
                "layer {layer} of {tag}"
            );
        }
        // nothing past the layout's last layer is addressable
        let mut one = vec![0u8; 1024];
        assert!(pool.read_tokens(r, l.layers(), 0, &mut one).is_err());
    }
    // a stage with more layers than the regions hold is refused
    let stage2 = LayerFirstLayout::new(1024, 4, 4).unwrap();
    let err = pool_error(Pool::open_or_create(stage2, devices.clone(), opts(0, 2)));
    assert!(
        err.contains("regions hold 12 KiB")
            && err.contains("needs 16 KiB")
            && err.contains("most layers"),
        "{err}"
    );
}

/// A header whose regions could not hold its own layout is reported as
/// corrupt, never followed; so is any header changed after creation (its
/// checksum).
#[test]
fn a_header_with_overlapping_regions_is_refused() {
    use kvtier::pool::metadata::{PoolHeader, header_checksum};
    let dir = Dir::new("stride");
    let devices = dir.devices(1, 4);
    drop(Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap());
    let DeviceSpec::File { path, .. } = &devices[0] else {
        unreachable!()
    };
    let pristine = std::fs::read(path).unwrap();
    let rewrite = |edit: &dyn Fn(&mut PoolHeader), reseal: bool| {
        let mut bytes = pristine.clone();
        // SAFETY: the file starts with a PoolHeader (plain data).
        let mut h: PoolHeader =
            unsafe { std::ptr::read_unaligned(bytes.as_ptr() as *const PoolHeader) };
        edit(&mut h);
        if reseal {
            h.checksum = header_checksum(&h);
        }
        // SAFETY: as above.
        unsafe { std::ptr::write_unaligned(bytes.as_mut_ptr() as *mut PoolHeader, h) };
        write_private(path, &bytes);
        pool_error(Pool::open(devices.clone(), inspect()))
    };
    for stride in [1024u64, 4097] {
        let err = rewrite(&|h| h.region_stride = stride, true);
        assert!(err.contains("corrupt pool header"), "{err}");
    }
    let err = rewrite(&|h| h.layers = 200, false);
    assert!(err.contains("checksum does not match"), "{err}");
    let err = rewrite(&|h| h.client_table_offset = 1 << 40, true);
    assert!(err.contains("corrupt pool header"), "{err}");
    let err = rewrite(&|h| h.region_table_offset += 64, true);
    assert!(err.contains("tables at"), "{err}");
    let err = rewrite(&|h| h.num_regions += 1, true);
    assert!(err.contains("corrupt pool header"), "{err}");
    let err = rewrite(&|h| h.devices[0].num_regions = u32::MAX, true);
    assert!(err.contains("does not fit its device"), "{err}");
}

/// Pool files: created 0600 (or the mode asked for), never through a
/// symbolic link, never over a file that holds something else or belongs to
/// another user; a destroyed pool's files may be reused; two creates at once
/// make one pool; a file that shrank is refused.
#[test]
fn pool_files_are_private_and_never_clobbered() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = Dir::new("files");
    let path = dir.0.join("kv");
    let spec = DeviceSpec::file(&path, 4 << 20);
    let pool = Pool::create_on(layout(), vec![spec.clone()], PoolOptions::default()).unwrap();
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    drop(pool);
    Pool::destroy(vec![spec.clone()], false).unwrap();
    let err = pool_error(Pool::open(vec![spec.clone()], inspect()));
    assert!(err.contains("was destroyed"), "{err}");
    // a destroyed pool's file is reused, here with a group's mode
    let group = PoolOptions {
        file_mode: 0o660,
        ..PoolOptions::default()
    };
    drop(Pool::create_on(layout(), vec![spec.clone()], group.clone()).unwrap());
    let shared = dir.0.join("group");
    drop(Pool::create_on(layout(), vec![DeviceSpec::file(&shared, 4 << 20)], group).unwrap());
    assert_eq!(
        std::fs::metadata(&shared).unwrap().permissions().mode() & 0o777,
        0o660
    );

    // a symbolic link is refused, to create and to open
    let link = dir.0.join("link");
    std::os::unix::fs::symlink(&path, &link).unwrap();
    for r in [
        Pool::create_on(
            layout(),
            vec![DeviceSpec::file(&link, 4 << 20)],
            PoolOptions::default(),
        ),
        Pool::open(vec![DeviceSpec::file(&link, 4 << 20)], inspect()),
        Pool::open_or_create(
            layout(),
            vec![DeviceSpec::file(&link, 4 << 20)],
            PoolOptions::default(),
        ),
    ] {
        let err = pool_error(r);
        assert!(err.contains("is a symbolic link"), "{err}");
    }
    // a file holding something else is left alone
    let other = dir.0.join("notes.txt");
    std::fs::write(&other, b"precious").unwrap();
    let err = pool_error(Pool::create_on(
        layout(),
        vec![DeviceSpec::file(&other, 4 << 20)],
        PoolOptions::default(),
    ));
    assert!(err.contains("not a kvtier pool"), "{err}");
    assert_eq!(std::fs::read(&other).unwrap(), b"precious");
    // a create that fails removes the files it made
    for spec in [
        DeviceSpec::file(dir.0.join("tiny"), 1 << 20),
        DeviceSpec::File {
            path: dir.0.join("sizeless"),
            bytes: None,
        },
    ] {
        let DeviceSpec::File { path, .. } = &spec else {
            unreachable!()
        };
        assert!(Pool::create_on(layout(), vec![spec.clone()], PoolOptions::default()).is_err());
        assert!(!path.exists(), "{} was left behind", path.display());
    }
    // a directory is not a device
    let err = pool_error(Pool::create_on(
        layout(),
        vec![DeviceSpec::file(&dir.0, 4 << 20)],
        PoolOptions::default(),
    ));
    assert!(
        err.contains("not a regular file") || err.contains("Is a directory"),
        "{err}"
    );
    // another user's file (only root can make one to try)
    // SAFETY: geteuid and chown have no memory preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let theirs = dir.0.join("theirs");
        std::fs::write(&theirs, b"").unwrap();
        let c = std::ffi::CString::new(theirs.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
        let err = pool_error(Pool::create_on(
            layout(),
            vec![DeviceSpec::file(&theirs, 4 << 20)],
            PoolOptions::default(),
        ));
        assert!(err.contains("belongs to user 65534"), "{err}");
        assert_eq!(std::fs::metadata(&theirs).unwrap().uid(), 65534);
    }

    // two creates at once: one pool, one refusal
    let race = DeviceSpec::file(dir.0.join("race"), 4 << 20);
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let race = race.clone();
                s.spawn(move || {
                    Pool::create_on(layout(), vec![race], PoolOptions::default())
                        .map(drop)
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        results.iter().filter(|r| r.is_ok()).count(),
        1,
        "{results:?}"
    );
    for e in results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(e.contains("already holds a kvtier pool"), "{e}");
    }

    // a file that shrank (a closed pool) is refused, not mapped past its end
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(3 << 20).unwrap();
    let err = pool_error(Pool::open(
        vec![DeviceSpec::File {
            path: path.clone(),
            bytes: None,
        }],
        inspect(),
    ));
    assert!(
        err.contains("corrupt pool header") || err.contains("need"),
        "{err}"
    );
}

/// A holder in another PID namespace (a container sharing the pool's files)
/// is alive for as long as it runs, whatever its pid means here: its
/// regions are not reclaimed while it lives, and are once it is gone. Runs
/// the worker under `unshare -Urpf` (unprivileged user and PID namespaces);
/// a machine where that cannot run fails the test.
#[test]
fn a_holder_in_another_pid_namespace_is_not_reclaimed_while_it_lives() {
    let dir = Dir::new("pidns");
    let devices = dir.devices(1, 4);
    drop(Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap());
    let orders = format!("hold;{};2;1", specs_arg(&devices));
    let mut holder = worker_in_namespace(&orders);
    wait_line(&mut holder, "held");
    let total = {
        let p = Pool::open(devices.clone(), inspect()).unwrap();
        p.num_regions()
    };
    for _ in 0..3 {
        // an opener reclaims the dead; a check --repair too
        let p = Pool::open(devices.clone(), PoolOptions::default()).unwrap();
        assert_eq!(
            p.free_regions(),
            total - 2,
            "the live holder keeps its regions"
        );
        assert_eq!(p.check().reclaimable_regions, 0);
        assert_eq!(p.reclaim_dead().unwrap().regions, 0);
    }
    drop(holder);
    // the holder dies with unshare (--kill-child), a moment after it
    wait_until("a holder that is gone is reclaimed", || {
        Pool::open(devices.clone(), PoolOptions::default())
            .unwrap()
            .free_regions()
            == total
    });
}

/// A reader never gets torn bytes with Ok: one region, freed, reallocated
/// and rewritten (each time with one byte value throughout) as fast as a
/// writer can, while readers read whole layers of it with `read_ready`.
#[test]
fn read_ready_never_returns_a_torn_region() {
    let dir = Dir::new("seqlock");
    let l = LayerFirstLayout::new(1024, 1, 256).unwrap(); // 256 KiB regions
    let devices = vec![DeviceSpec::file(dir.0.join("dev0"), 4 << 20)];
    let writer = Pool::create_on(l, devices.clone(), PoolOptions::default()).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (ok, torn, refused) = std::thread::scope(|s| {
        s.spawn(|| {
            let mut v = 0u8;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let r = writer.alloc_region().unwrap();
                v = v.wrapping_add(1);
                writer.write_tokens(&r, 0, 0, &vec![v; 256 * 1024]).unwrap();
                writer.publish(&r).unwrap();
                // READY a moment, for the readers to find it so
                std::thread::sleep(Duration::from_micros(100));
                writer.free_region(r).unwrap();
            }
        });
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let devices = devices.clone();
                let stop = &stop;
                s.spawn(move || {
                    let reader = Pool::open(devices, PoolOptions::default()).unwrap();
                    let mut buf = vec![0u8; 256 * 1024];
                    let (mut ok, mut torn, mut refused) = (0u64, 0u64, 0u64);
                    let t0 = Instant::now();
                    while t0.elapsed() < Duration::from_millis(1500) {
                        for index in 0..reader.num_regions() {
                            match reader.read_ready(index, 0, 0, &mut buf) {
                                Ok(()) if buf.iter().all(|&b| b == buf[0]) => ok += 1,
                                Ok(()) => torn += 1,
                                Err(_) => refused += 1,
                            }
                        }
                    }
                    stop.store(true, std::sync::atomic::Ordering::Relaxed);
                    (ok, torn, refused)
                })
            })
            .collect();
        readers
            .into_iter()
            .map(|h| h.join().unwrap())
            .fold((0, 0, 0), |a, b| (a.0 + b.0, a.1 + b.1, a.2 + b.2))
    });
    eprintln!("{ok} whole reads, {torn} torn, {refused} refused");
    assert_eq!(
        torn, 0,
        "{torn} reads returned torn bytes with Ok ({ok} whole, {refused} refused)"
    );
    assert!(
        ok > 0 && refused > 0,
        "the race is exercised: {ok} whole, {refused} refused"
    );
}

/// A new pool on `devices`, as another process would open it.
fn created_then_opened(devices: &[DeviceSpec]) -> Arc<Pool> {
    drop(Pool::create_on(layout(), devices.to_vec(), PoolOptions::default()).unwrap());
    Pool::open(devices.to_vec(), PoolOptions::default()).unwrap()
}

/// A pool destroyed with force while processes are attached cannot be
/// created anew under them (they would write into regions handed to others).
#[test]
fn a_new_pool_is_refused_while_the_old_ones_holders_live() {
    let dir = Dir::new("recreate");
    let devices = dir.devices(1, 4);
    let holder = created_then_opened(&devices);
    let _r = holder.alloc_region().unwrap();
    let err = Pool::destroy(devices.clone(), false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("are attached"), "{err}");
    Pool::destroy(devices.clone(), true).unwrap();
    let err = pool_error(Pool::create_on(
        layout(),
        devices.clone(),
        PoolOptions::default(),
    ));
    assert!(err.contains("still mapped by processes attached"), "{err}");
    drop(holder);
    drop(Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap());
}

// ---- forks: a child acts through its parent's handle never ------------------

/// Forks; the child runs `child` and exits with its code without returning
/// into the test harness. Returns the child's exit code.
fn in_forked_child(child: impl FnOnce() -> i32) -> i32 {
    // SAFETY: the child runs `child` and _exit()s; it never returns here.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(child)).unwrap_or(101);
        // SAFETY: ends the child at once, running no other destructor.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    }
}

/// What a parent holds in a pool: `n` allocated regions, written and
/// published.
fn parent_with_regions(dir: &Dir, n: usize) -> (Vec<DeviceSpec>, Arc<Pool>, Vec<kvtier::Region>) {
    let devices = dir.devices(1, 4);
    let pool = Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap();
    let regions: Vec<_> = (0..n)
        .map(|i| {
            let r = pool.alloc_region().unwrap();
            write_region(&pool, &r, &contents(i as u64 + 1, std::process::id()));
            pool.publish(&r).unwrap();
            r
        })
        .collect();
    (devices, pool, regions)
}

/// The parent's regions are still its own, READY and intact, its slot live,
/// and a new opener (which reclaims the dead) takes none of them.
fn parent_intact(devices: &[DeviceSpec], pool: &Pool, regions: &[kvtier::Region]) {
    let me = std::process::id();
    let infos = pool.regions();
    for r in regions {
        let info = &infos[r.index() as usize];
        assert_eq!(
            info.state,
            RegionState::Ready,
            "region {} was freed: {info:?}",
            r.index()
        );
        assert_eq!(info.owner.as_ref().map(|o| o.pid), Some(me), "{info:?}");
        assert!(
            intact(&read_region(pool, r)),
            "region {} was overwritten",
            r.index()
        );
    }
    assert!(pool.check().dead_clients.is_empty(), "{:?}", pool.check());
    let other = Pool::open(devices.to_vec(), PoolOptions::default()).unwrap();
    let taken: Vec<_> = (0..other.free_regions())
        .map(|_| other.alloc_region().unwrap())
        .collect();
    assert!(
        taken
            .iter()
            .all(|t| regions.iter().all(|r| r.index() != t.index()))
    );
    for t in taken {
        other.free_region(t).unwrap();
    }
}

#[test]
fn a_forked_child_that_exits_normally_frees_none_of_its_parents_regions() {
    let dir = Dir::new("fork-exit");
    let (devices, pool, regions) = parent_with_regions(&dir, 3);
    let mut held = Some((pool, regions));
    let code = in_forked_child(|| {
        // a normal exit drops everything the child inherited: here the only
        // handle to the pool, so the pool's own drop runs in the child
        let (pool, regions) = held.take().unwrap();
        assert_eq!(Arc::strong_count(&pool), 1);
        drop(regions);
        drop(pool);
        0
    });
    assert_eq!(code, 0);
    let (pool, regions) = held.unwrap();
    parent_intact(&devices, &pool, &regions);
    // and the parent's own clean exit still frees them
    let total = pool.num_regions();
    drop(pool);
    let after = Pool::open(devices, inspect()).unwrap();
    assert_eq!(after.free_regions(), total);
}

#[test]
fn a_forked_child_cannot_act_through_its_parents_handle_but_may_open_its_own() {
    let dir = Dir::new("fork-alloc");
    let (devices, pool, regions) = parent_with_regions(&dir, 2);
    let child_devices = devices.clone();
    let code = in_forked_child(|| {
        let refused = |what: &str, r: kvtier::Result<()>| match r {
            Err(e) if e.to_string().contains("must open the pool itself") => 0,
            other => {
                eprintln!("{what} through the parent's handle: {other:?}");
                1
            }
        };
        let mut code = refused("alloc", pool.alloc_region().map(|_| ()));
        code |= refused("publish", pool.publish(&regions[0]));
        // a forged handle to the parent's region: free must be refused too
        let forged: kvtier::Region = unsafe { std::ptr::read(&regions[1]) };
        code |= refused("free", pool.free_region(forged));
        // its own pool handle works, under its own identity
        let own = Pool::open(child_devices.clone(), PoolOptions::default()).unwrap();
        let r = own.alloc_region().unwrap();
        let mine = own.regions()[r.index() as usize]
            .owner
            .as_ref()
            .map(|o| o.pid);
        code |= (mine != Some(std::process::id())) as i32;
        own.free_region(r).unwrap();
        code
    });
    assert_eq!(code, 0);
    parent_intact(&devices, &pool, &regions);
}

#[test]
fn a_killed_forked_child_leaves_its_parents_regions_alone() {
    let dir = Dir::new("fork-kill");
    let (devices, pool, regions) = parent_with_regions(&dir, 2);
    // SAFETY: the child only sleeps until it is killed.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        loop {
            // SAFETY: no preconditions.
            unsafe { libc::pause() };
        }
    }
    // SAFETY: signals and reaps the child just forked.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        let mut status = 0;
        assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
    }
    parent_intact(&devices, &pool, &regions);
}

#[test]
fn a_numa_pools_pages_are_reported_where_they_are() {
    let layout = layout();
    let bytes = Pool::device_bytes_for(&layout, 8).unwrap();
    let spec: DeviceSpec = format!("numa:0:{bytes}").parse().unwrap();
    let pool = Pool::create_on(layout, vec![spec], PoolOptions::default()).unwrap();
    let regions: Vec<_> = (0..8).map(|_| pool.alloc_region().unwrap()).collect();
    for (i, r) in regions.iter().enumerate() {
        write_region(&pool, r, &contents(i as u64, 1));
    }
    let r = pool.residency(0, 64).unwrap();
    assert_eq!(r.sampled, 64);
    let present: u32 = r.by_node.iter().map(|(_, c)| c).sum();
    assert!(present > 0 && present + r.not_present == 64, "{r:?}");
    assert!(
        r.by_node.iter().all(|(node, _)| *node == 0),
        "bound to node 0: {r:?}"
    );
    assert_eq!(pool.placement_problem(0).unwrap(), None);
    assert!(pool.residency(1, 8).is_err(), "no device 1");
    // a file device: its pages are somewhere, and it names no node to check
    let dir = Dir::new("residency");
    let file = Pool::create_on(layout, dir.devices(1, 4), PoolOptions::default()).unwrap();
    let r = file.residency(0, 16).unwrap();
    assert_eq!(r.sampled, 16);
    assert_eq!(file.placement_problem(0).unwrap(), None);
}

// ---- other users' files, and two creates at once ---------------------------

fn chown(path: &std::path::Path, uid: u32, gid: u32) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(
        unsafe { libc::chown(c.as_ptr(), uid, gid) },
        0,
        "chown needs root"
    );
}

fn chmod(path: &std::path::Path, mode: u32) {
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
}

/// Runs `f` on a thread and fails the test if it takes longer than `secs`.
fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(f()).unwrap());
    rx.recv_timeout(Duration::from_secs(secs))
        .unwrap_or_else(|_| panic!("still waiting after {secs} s"))
}

#[test]
fn pool_files_of_other_users_or_open_to_others_are_refused() {
    // SAFETY: no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test changes file owners: run it as root (CI does)"
    );
    let dir = Dir::new("trust");
    let devices = dir.devices(1, 4);
    let path = dir.0.join("dev0");
    drop(Pool::create_on(layout(), devices.clone(), PoolOptions::default()).unwrap());
    let open = |d: &Vec<DeviceSpec>| pool_error(Pool::open(d.clone(), PoolOptions::default()));
    let open_or_create = |d: &Vec<DeviceSpec>| {
        pool_error(Pool::open_or_create(
            layout(),
            d.clone(),
            PoolOptions::default(),
        ))
    };
    // a pool file any user may read or write: its KV is not private
    for mode in [0o666, 0o644, 0o604] {
        chmod(&path, mode);
        for err in [open(&devices), open_or_create(&devices)] {
            assert!(err.contains("is open to other users"), "{mode:o}: {err}");
        }
    }
    chmod(&path, 0o600);
    drop(Pool::open(devices.clone(), PoolOptions::default()).unwrap());
    // another user's file, planted at the path
    chown(&path, 65534, 65534);
    for err in [open(&devices), open_or_create(&devices)] {
        assert!(err.contains("belongs to user 65534"), "{err}");
    }
    // ... shared with this process's group: usable when the mode says so
    // SAFETY: no preconditions.
    let my_gid = unsafe { libc::getegid() };
    chown(&path, 65534, my_gid);
    assert!(
        open(&devices).contains("belongs to user 65534"),
        "mode 0600 shares nothing"
    );
    chmod(&path, 0o660);
    drop(Pool::open(devices.clone(), PoolOptions::default()).unwrap());
    // another user's file whose owner holds a lock on it: refused at once,
    // not a wait for a lock it must never take
    chown(&path, 65534, 65534);
    let holder = std::fs::File::open(&path).unwrap();
    // SAFETY: flock on a descriptor this test owns.
    assert_eq!(
        unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&holder), libc::LOCK_EX) },
        0
    );
    let d = devices.clone();
    let err = within(20, move || {
        pool_error(Pool::create_on(layout(), d, PoolOptions::default()))
    });
    assert!(err.contains("belongs to user 65534"), "{err}");
    let d = devices.clone();
    let err = within(20, move || {
        pool_error(Pool::open_or_create(layout(), d, PoolOptions::default()))
    });
    assert!(err.contains("belongs to user 65534"), "{err}");
    drop(holder);
    // modes that open the pool's files to other users are refused at create
    for mode in [0o666, 0o644, 0o777, 0o4600] {
        let options = PoolOptions {
            file_mode: mode,
            ..PoolOptions::default()
        };
        let err = pool_error(Pool::create_on(
            layout(),
            dir.devices(2, 4)[1..].to_vec(),
            options,
        ));
        assert!(err.contains("user and group only"), "{mode:o}: {err}");
        assert!(
            !dir.0.join("dev1").exists(),
            "a refused create makes no file"
        );
    }
}

#[test]
fn the_losing_create_of_two_at_once_removes_nothing_of_the_winners() {
    let dir = Dir::new("race");
    for round in 0..1000 {
        let devices = vec![DeviceSpec::file(dir.0.join(format!("p{round}")), 4 << 20)];
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let runs: Vec<_> = (0..2)
            .map(|_| {
                let (devices, barrier) = (devices.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    Pool::create_on(layout(), devices, PoolOptions::default())
                })
            })
            .collect();
        let results: Vec<_> = runs.into_iter().map(|t| t.join().unwrap()).collect();
        let winners: Vec<&Arc<Pool>> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        let loser = results
            .iter()
            .find_map(|r| r.as_ref().err())
            .unwrap()
            .to_string();
        assert!(
            loser.contains("already holds a kvtier pool"),
            "round {round}: {loser}"
        );
        // the winner's pool is the one at the path, whole
        let at_path = Pool::open(devices.clone(), inspect()).unwrap_or_else(|e| {
            panic!("round {round}: the winner's pool is gone from the path: {e}")
        });
        assert_eq!(at_path.uuid(), winners[0].uuid(), "round {round}");
    }
}

// ---- reserve what is promised -----------------------------------------------

/// A tmpfs of `mib` MiB mounted for the test (needs root), unmounted on drop.
struct SmallTmpfs(PathBuf);

impl SmallTmpfs {
    fn mount(name: &str, mib: u64) -> SmallTmpfs {
        // SAFETY: no preconditions.
        assert_eq!(
            unsafe { libc::geteuid() },
            0,
            "this test mounts a tmpfs: run it as root (CI does)"
        );
        let dir = std::env::temp_dir().join(format!("kvtier-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let c = |s: &str| std::ffi::CString::new(s).unwrap();
        let (src, target, fs, data) = (
            c("tmpfs"),
            c(dir.to_str().unwrap()),
            c("tmpfs"),
            c(&format!("size={mib}m,mode=0700")),
        );
        // SAFETY: valid C strings; data is tmpfs's option string.
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                fs.as_ptr(),
                0,
                data.as_ptr().cast(),
            )
        };
        assert_eq!(rc, 0, "mount: {}", std::io::Error::last_os_error());
        SmallTmpfs(dir)
    }
}

impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let c = std::ffi::CString::new(self.0.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string naming the mount this test made.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn a_pool_larger_than_its_filesystem_is_a_clean_error_at_create() {
    let fs = SmallTmpfs::mount("small", 8);
    let file = |name: &str, mib: u64| vec![DeviceSpec::file(fs.0.join(name), mib << 20)];
    // far too large: refused before anything is written, no file left
    for mib in [64, 9] {
        let err = pool_error(Pool::create_on(
            layout(),
            file("big", mib),
            PoolOptions::default(),
        ));
        assert!(
            err.contains("needs") && err.contains("free"),
            "{mib} MiB: {err}"
        );
        assert!(!fs.0.join("big").exists(), "a failed create leaves no file");
    }
    // one that fits is allocated whole at create: the rest of the filesystem
    // cannot hold a second like it, and the first is whole
    let pool = Pool::create_on(layout(), file("a", 5), PoolOptions::default()).unwrap();
    let err = pool_error(Pool::create_on(
        layout(),
        file("b", 5),
        PoolOptions::default(),
    ));
    assert!(err.contains("needs") || err.contains("too little"), "{err}");
    assert!(!fs.0.join("b").exists());
    let regions: Vec<_> = (0..pool.num_regions())
        .map(|_| pool.alloc_region().unwrap())
        .collect();
    for (i, r) in regions.iter().enumerate() {
        write_region(&pool, r, &contents(i as u64, 7)); // would be SIGBUS on a sparse file
    }
    // the open_or_create path too
    let err = pool_error(Pool::open_or_create(
        layout(),
        file("c", 16),
        PoolOptions::default(),
    ));
    assert!(err.contains("needs"), "{err}");
    assert!(!fs.0.join("c").exists());
}

#[test]
fn a_numa_device_larger_than_its_node_is_refused() {
    // 164 MB regions: a geometry that fits the size, so the node is what refuses
    let big = LayerFirstLayout::new(656, 61, 4096).unwrap();
    let err = pool_error(Pool::create_on(
        big,
        vec!["numa:0:512TiB".parse().unwrap()],
        PoolOptions::default(),
    ));
    assert!(
        err.contains("NUMA node 0 has") && err.contains("less than the 512.0 TiB asked for"),
        "{err}"
    );
}

#[test]
fn a_new_pool_is_refused_on_any_device_a_live_holder_of_the_old_one_maps() {
    let dir = Dir::new("recreate-any");
    let devices = dir.devices(2, 4);
    let holder = created_then_opened(&devices);
    let _regions: Vec<_> = (0..holder.num_regions())
        .map(|_| holder.alloc_region().unwrap())
        .collect();
    Pool::destroy(devices.clone(), true).unwrap();
    let (a, b) = (devices[0].clone(), devices[1].clone());
    // the old pool's devices in another order, or its second device alone
    for new in [vec![b.clone(), a.clone()], vec![b.clone()], vec![a.clone()]] {
        let err = pool_error(Pool::create_on(
            layout(),
            new.clone(),
            PoolOptions::default(),
        ));
        assert!(
            err.contains("still mapped by processes attached"),
            "{new:?}: {err}"
        );
    }
    drop(_regions);
    drop(holder);
    drop(Pool::create_on(layout(), vec![b, a], PoolOptions::default()).unwrap());
}

/// One file named twice (however it is spelled) is refused by name, before
/// anything is mapped; it said "is not device 1 of this pool".
#[test]
fn a_device_named_twice_is_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("kvtier-twice-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let layout = LayerFirstLayout::new(64, 2, 16).unwrap();
    let a = DeviceSpec::file(dir.join("a"), 4 << 20);
    let also_a = DeviceSpec::file(dir.join(".").join("a"), 4 << 20);
    let e = pool_error(Pool::create_on(
        layout,
        vec![a.clone(), a.clone()],
        PoolOptions::default(),
    ));
    assert!(e.contains("is named twice (devices 0 and 1)"), "{e}");
    drop(Pool::create_on(layout, vec![a.clone()], PoolOptions::default()).unwrap());
    let e = pool_error(Pool::open(vec![a.clone(), also_a], PoolOptions::default()));
    assert!(e.contains("named twice"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// Publishing twice says so; a region this process no longer holds is
/// described in words (it printed "its state is Some(Ready)").
#[test]
fn publishing_twice_and_foreign_regions_are_said_in_words() {
    let layout = LayerFirstLayout::new(64, 2, 16).unwrap();
    let pool = Pool::create(layout, DeviceSpec::Anon { bytes: 4 << 20 }).unwrap();
    let r = pool.alloc_region().unwrap();
    pool.publish(&r).unwrap();
    let e = pool.publish(&r).unwrap_err().to_string();
    assert!(
        e.contains(&format!("region {} is already published", r.index())),
        "{e}"
    );
    assert!(!e.contains("Some("), "{e}");
}

/// The smaps entry of this process's mapping that holds `addr`: its VmFlags
/// and its AnonHugePages in bytes.
fn smaps_of(addr: u64) -> (String, u64) {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut found = false;
    let (mut flags, mut anon_huge) = (String::new(), 0u64);
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-')
            && let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16))
        {
            if found {
                break;
            }
            found = (lo..hi).contains(&addr);
            continue;
        }
        if !found {
            continue;
        }
        if let Some(f) = line.strip_prefix("VmFlags:") {
            flags = f.trim().to_string();
        }
        if let Some(kb) = line.strip_prefix("AnonHugePages:") {
            anon_huge = 1024
                * kb.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap();
        }
    }
    assert!(found, "no mapping holds {addr:#x}");
    (flags, anon_huge)
}

/// HostPages::Transparent asks the kernel for transparent huge pages for an
/// anonymous pool before it is touched (smaps: the mapping's VmFlags carry
/// "hg"), and Pool::huge_page_bytes reports what the kernel gave, as smaps
/// does (at least the huge pages of the mapping that holds the region, which
/// its "hg" flag keeps apart from its neighbours); the default asks nothing
/// (its mapping may merge with a neighbour's: only an answer is asked of
/// huge_page_bytes).
#[test]
fn anonymous_pools_ask_for_transparent_huge_pages_when_told() {
    let layout = LayerFirstLayout::new(65536, 2, 256).unwrap(); // 32 MiB regions
    let bytes = Pool::device_bytes_for(&layout, 2).unwrap();
    for pages in [kvtier::HostPages::Base, kvtier::HostPages::Transparent] {
        let options = PoolOptions {
            host_pages: pages,
            ..PoolOptions::default()
        };
        let pool = Pool::create_on(layout, vec![DeviceSpec::Anon { bytes }], options).unwrap();
        let r = pool.alloc_region().unwrap();
        let ones = vec![1u8; layout.layer_bytes() as usize];
        pool.write_tokens(&r, 0, 0, &ones).unwrap();
        pool.write_tokens(&r, 1, 0, &ones).unwrap();
        let (flags, anon_huge) = smaps_of(pool.region_host_addr(&r).unwrap());
        let advised = flags.split_whitespace().any(|f| f == "hg");
        assert_eq!(
            advised,
            pages == kvtier::HostPages::Transparent,
            "{pages:?}: {flags}"
        );
        let huge = pool.huge_page_bytes().unwrap();
        assert!(huge <= bytes, "{pages:?}: {huge} of {bytes} bytes");
        if pages == kvtier::HostPages::Transparent {
            assert!(huge >= anon_huge, "{pages:?}: {huge} < {anon_huge}");
        }
        // where the kernel has transparent huge pages for madvised memory
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        println!(
            "{pages:?}: {anon_huge} B of huge pages (THP {})",
            thp.trim()
        );
    }
}
