//! `kvtier info`.

use kvtier::cuda::{self, DriverStatus, FatbinImage, KernelBuild};

pub fn run() -> kvtier::Result<()> {
    println!("kvtier {}", env!("CARGO_PKG_VERSION"));

    match cuda::kernels::BUILD {
        KernelBuild::Built {
            nvcc,
            nvcc_version,
            sass,
            ptx,
        } => {
            println!("kernels:   built by nvcc {nvcc_version} ({nvcc})");
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
                "driver:    CUDA {}.{}, {devices} GPU(s)",
                version / 1000,
                (version % 1000) / 10
            );
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

    println!("pool devices:");
    println!("  anon:SIZE          anonymous memory (the default)");
    println!("  file:PATH:SIZE     a shared file on tmpfs or hugetlbfs");
    let dax = dax_devices();
    if dax.is_empty() {
        println!("  (no /dev/dax* character devices on this machine)");
    } else {
        println!("  DAX devices present: {}", dax.join(", "));
    }
    Ok(())
}

fn dax_devices() -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir("/dev")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("dax"))
                .map(|n| format!("/dev/{n}"))
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}
