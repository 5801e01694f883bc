//! `kvtier info`.

use kvtier::cuda::{self, DriverStatus, FatbinImage, KernelBuild};

pub fn run() -> kvtier::Result<()> {
    println!("kvtier {}", kvtier::VERSION);

    match cuda::kernels::BUILD {
        KernelBuild::Built {
            compiler,
            path,
            sass,
            ptx,
            ..
        } => {
            // The compiler's path where it still exists here (a checkout's
            // build); a wheel's was pip's temporary build environment.
            if std::path::Path::new(path).exists() {
                println!("kernels:   built by {compiler} ({path})");
            } else {
                println!("kernels:   built by {compiler}");
            }
            println!(
                "           SASS for {}, PTX fallback {ptx}",
                sass.join(", ")
            );
            let images = cuda::kernels::fatbin_images(cuda::kernels::fatbin()?)?;
            let listed: Vec<String> = images
                .iter()
                .map(|i| match i {
                    FatbinImage::Sass { arch } => format!("sm_{arch}"),
                    FatbinImage::Ptx { arch } => format!("compute_{arch} (PTX)"),
                })
                .collect();
            println!("           embedded fatbin holds: {}", listed.join(", "));
            if let Some(needed) = cuda::kernels::BUILD.driver_needed() {
                println!(
                    "           the SASS needs {}",
                    cuda::kernels::describe_requirement(needed)
                );
            }
            if let Some(needed) = cuda::kernels::BUILD.ptx_driver_needed() {
                println!(
                    "           a GPU with no SASS here runs the PTX, which needs {}",
                    cuda::kernels::describe_requirement(needed)
                );
            }
        }
        KernelBuild::NotBuilt { reason } => println!("kernels:   NOT BUILT: {reason}"),
    }

    match cuda::probe_driver() {
        DriverStatus::Missing => {
            println!(
                "driver:    none (libcuda.so could not be loaded); the CPU executor is available"
            )
        }
        DriverStatus::InitFailed(why) => println!("driver:    present but unusable: {why}"),
        DriverStatus::Ready { version, devices } => {
            println!(
                "driver:    CUDA {}.{}, {}",
                version / 1000,
                (version % 1000) / 10,
                super::bench::count(devices as u64, "GPU", "GPUs")
            );
            if let Some(why) = cuda::kernels::driver_too_old(version, &cuda::kernels::BUILD) {
                println!("           {why}");
            }
            for ordinal in 0..devices as usize {
                match kvtier::CudaDevice::open(ordinal) {
                    Ok(d) => {
                        let (ma, mi) = d.compute_capability();
                        println!(
                            "  GPU {ordinal}:   {} (sm_{ma}{mi}, {} SMs), kernels loaded",
                            d.name(),
                            d.sm_count()
                        );
                    }
                    Err(e) => println!("  GPU {ordinal}:   not usable by kvtier: {e}"),
                }
            }
        }
    }

    println!("pool devices (kvtier pool create --device SPEC ...):");
    println!("  anon:SIZE              anonymous memory of one process (the default)");
    println!("  file:PATH:SIZE         a shared file on tmpfs or hugetlbfs, for several processes");
    println!("  numa:NODE:SIZE         memory bound to a NUMA node (CXL memory onlined as a node)");
    println!("  numa:NODE+NODE:SIZE    memory interleaved page by page over NUMA nodes");
    println!("  dax:PATH[:SIZE]        a devdax character device (CXL memory in devdax mode)");
    for (node, cpus, mem) in numa_nodes() {
        let cxl_hint = if cpus.is_empty() {
            "  (no CPUs: CXL or other far memory?)"
        } else {
            ""
        };
        println!(
            "  NUMA node {node}: {mem}, CPUs {}{cxl_hint}",
            if cpus.is_empty() { "none" } else { &cpus }
        );
        let movable =
            kvtier::pool::device_capacity(&format!("numa:{node}")).map_or(0, |c| c.movable_bytes);
        if movable > 0 {
            println!(
                "    warning: {} of it is onlined as movable (ZONE_MOVABLE): a GPU registration of a pool there \
                 migrates its pages to another node; online it as normal memory (daxctl online-memory \
                 --no-movable) or use it as a dax: device",
                kvtier::pool::human_size(movable)
            );
        }
    }
    let dax = dax_devices();
    if dax.is_empty() {
        println!("  no /dev/dax* devices on this machine");
    }
    for d in dax {
        println!("  {d}");
    }
    Ok(())
}

/// (node, CPU list, memory) of every NUMA node in sysfs.
fn numa_nodes() -> Vec<(u32, String, String)> {
    let dir = std::path::Path::new("/sys/devices/system/node");
    kvtier::pool::numa_nodes(std::path::Path::new("/sys"))
        .into_iter()
        .map(|n| {
            let node = dir.join(format!("node{n}"));
            let cpus = std::fs::read_to_string(node.join("cpulist"))
                .unwrap_or_default()
                .trim()
                .to_string();
            let mem = std::fs::read_to_string(node.join("meminfo"))
                .ok()
                .and_then(|m| {
                    let line = m.lines().find(|l| l.contains("MemTotal"))?;
                    let kib: u64 = line.split_whitespace().rev().nth(1)?.parse().ok()?;
                    Some(format!("{:.1} GiB", kib as f64 / (1u64 << 20) as f64))
                })
                .unwrap_or_else(|| "unknown size".into());
            (n, cpus, mem)
        })
        .collect()
}

fn dax_devices() -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir("/dev")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("dax"))
                .map(|n| {
                    let size = std::fs::read_to_string(format!("/sys/bus/dax/devices/{n}/size"))
                        .ok()
                        .and_then(|s| s.trim().parse().ok())
                        .map(kvtier::pool::format_size)
                        .unwrap_or_else(|| "size unknown".into());
                    format!("/dev/{n} ({size})")
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}
