//! Corrupted pools are reported, never followed: random byte corruptions of
//! a pool's header and tables (fixed seeds, a fixed number of cases) must
//! give an error or a pool whose every inspection and allocation works;
//! nothing may crash. Then the CLI's `pool status` and `pool check` on
//! corrupted pools, in child processes: an exit status, never a signal.

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Command;

use kvtier::pool::PoolOptions;
use kvtier::{DeviceSpec, LayerFirstLayout, Pool};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A pool on one 4 MiB file with three regions held (by a handle this
/// process leaks, so their owner is alive), and its pristine bytes.
fn pristine(name: &str) -> (PathBuf, DeviceSpec, Vec<u8>) {
    let dir = std::env::temp_dir().join(format!("kvtier-fuzz-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("dev0");
    let spec = DeviceSpec::file(&path, 4 << 20);
    let layout = LayerFirstLayout::new(64, 2, 16).unwrap();
    let pool = Pool::create_on(layout, vec![spec.clone()], PoolOptions::default()).unwrap();
    for r in 0..3 {
        pool.alloc_region_for(r).unwrap();
    }
    // the regions stay held: a pool frees them when it is dropped
    std::mem::forget(pool);
    let bytes = std::fs::read(&path).unwrap();
    (path, spec, bytes)
}

/// Flips 1 to 8 random bytes among the first `span` bytes.
fn corrupt(rng: &mut StdRng, bytes: &[u8], span: usize) -> Vec<u8> {
    let mut b = bytes.to_vec();
    for _ in 0..rng.random_range(1..=8) {
        let at = rng.random_range(0..span);
        b[at] = rng.random();
    }
    b
}

fn inspect() -> PoolOptions {
    PoolOptions {
        attach: false,
        reclaim_dead: false,
        ..PoolOptions::default()
    }
}

#[test]
fn corrupted_pools_are_reported_not_followed() {
    let (path, spec, bytes) = pristine("lib");
    // the header (3808 B), the region table and the client table
    let span = 64 << 10;
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let (mut refused, mut opened) = (0, 0);
    for case in 0..2000 {
        std::fs::write(&path, corrupt(&mut rng, &bytes, span)).unwrap();
        for options in [inspect(), PoolOptions::default()] {
            match Pool::open(vec![spec.clone()], options) {
                Err(e) => {
                    assert!(!e.to_string().is_empty(), "case {case}");
                    refused += 1;
                }
                Ok(pool) => {
                    opened += 1;
                    let _ = (
                        pool.devices(),
                        pool.regions(),
                        pool.clients_info(),
                        pool.free_regions(),
                    );
                    let _ = pool.check();
                    if let Ok(r) = pool.alloc_region() {
                        let mut buf = vec![0u8; 64];
                        let _ = pool.write_tokens(&r, 0, 0, &buf);
                        let _ = pool.read_tokens(&r, 1, 15, &mut buf);
                        let _ = pool.publish(&r);
                        let _ = pool.free_region(r);
                    }
                }
            }
        }
    }
    eprintln!("{refused} refused, {opened} opened");
    assert!(refused > 0 && opened > 0, "the cases reach both outcomes");
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

#[test]
fn the_cli_reports_corrupted_pools_without_crashing() {
    let (path, spec, bytes) = pristine("cli");
    let mut rng = StdRng::seed_from_u64(0xc11);
    for case in 0..40 {
        // the header, where a wrong offset or count would send a reader astray
        std::fs::write(&path, corrupt(&mut rng, &bytes, 4096)).unwrap();
        for cmd in ["status", "check"] {
            let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
                .args(["pool", cmd, "--device", &spec.to_string()])
                .output()
                .unwrap();
            assert!(
                out.status.signal().is_none(),
                "case {case}: `kvtier pool {cmd}` died of signal {:?}: {}",
                out.status.signal(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}
