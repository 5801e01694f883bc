//! The pool: one memory device cut into equal layer-first request regions,
//! registered with the GPU so that kernels address it directly.
//!
//! This is the in-process pool of the foundation: regions are handed out by a
//! free list in this process. Shared metadata in the pool itself (several
//! processes and hosts on one pool) builds on it.

mod device;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use device::MappedDevice;
pub use device::{DeviceSpec, format_size, parse_size};

use crate::cuda::{CudaDevice, HostRegistration, REGISTER_FLAGS};
use crate::error::{Error, Result, invalid};
use crate::layout::LayerFirstLayout;

/// Regions start on this boundary (a page), so region bases are 16-byte
/// aligned and the per-entry alignment depends on the entry size alone.
pub const REGION_ALIGN: u64 = 4096;

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// A pool of request regions on one memory device.
pub struct Pool {
    id: u64,
    layout: LayerFirstLayout,
    region_stride: u64,
    num_regions: u32,
    free: Mutex<Vec<u32>>,
    // Dropped before `device`: unregister, then unmap.
    registration: Mutex<Option<HostRegistration>>,
    device: MappedDevice,
}

/// One request's region: `layers × tokens_per_region × entry_bytes`, laid out
/// layer-first. Owned; give it back with [`Pool::free_region`].
#[derive(Debug, PartialEq, Eq)]
pub struct Region {
    pool: u64,
    index: u32,
}

impl Region {
    /// The region's index in its pool.
    pub fn index(&self) -> u32 {
        self.index
    }
}

impl Pool {
    /// Maps `device` and cuts it into as many regions of `layout` as fit.
    pub fn create(layout: LayerFirstLayout, device: DeviceSpec) -> Result<Arc<Pool>> {
        let region_stride = layout.region_bytes().next_multiple_of(REGION_ALIGN);
        let num_regions = device.bytes() / region_stride;
        if num_regions == 0 {
            return Err(Error::Pool(format!(
                "device {device} holds no region: one region of this layout ({} layers × {} tokens × {} B) \
                 needs {}",
                layout.layers(),
                layout.tokens_per_region(),
                layout.entry_bytes(),
                format_size(region_stride)
            )));
        }
        let num_regions = u32::try_from(num_regions).map_err(|_| {
            invalid(
                "device",
                format!("{num_regions} regions exceed the 2^32 a pool indexes"),
            )
        })?;
        let device = MappedDevice::map(&device)?;
        Ok(Arc::new(Pool {
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            layout,
            region_stride,
            num_regions,
            free: Mutex::new((0..num_regions).rev().collect()),
            registration: Mutex::new(None),
            device,
        }))
    }

    /// The layout of every region.
    pub fn layout(&self) -> LayerFirstLayout {
        self.layout
    }

    /// The device the pool lives on.
    pub fn device_spec(&self) -> &DeviceSpec {
        self.device.spec()
    }

    /// Regions in the pool.
    pub fn num_regions(&self) -> u32 {
        self.num_regions
    }

    /// Regions not allocated.
    pub fn free_regions(&self) -> u32 {
        self.free.lock().unwrap().len() as u32
    }

    /// Bytes between consecutive region bases.
    pub fn region_stride(&self) -> u64 {
        self.region_stride
    }

    /// Takes a free region (the lowest-numbered one first).
    pub fn alloc_region(&self) -> Result<Region> {
        let index = self.free.lock().unwrap().pop().ok_or_else(|| {
            Error::Pool(format!(
                "pool is full: all {} regions are allocated",
                self.num_regions
            ))
        })?;
        Ok(Region {
            pool: self.id,
            index,
        })
    }

    /// Returns a region to the pool.
    pub fn free_region(&self, region: Region) -> Result<()> {
        self.check_region(&region)?;
        self.free.lock().unwrap().push(region.index);
        Ok(())
    }

    /// Writes consecutive entries of one layer, starting at `first_token`;
    /// `data` holds whole entries.
    pub fn write_tokens(
        &self,
        region: &Region,
        layer: u32,
        first_token: u32,
        data: &[u8],
    ) -> Result<()> {
        let offset = self.token_range(region, layer, first_token, data.len(), "data")?;
        // SAFETY: token_range checked that offset..offset+len lies inside the
        // mapping; the source is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.device.ptr().add(offset), data.len())
        };
        Ok(())
    }

    /// Reads consecutive entries of one layer, starting at `first_token`;
    /// `out` holds whole entries.
    pub fn read_tokens(
        &self,
        region: &Region,
        layer: u32,
        first_token: u32,
        out: &mut [u8],
    ) -> Result<()> {
        let offset = self.token_range(region, layer, first_token, out.len(), "out")?;
        // SAFETY: as in write_tokens.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.device.ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// Byte offset of a region's first byte from the pool's first byte.
    pub fn region_offset(&self, region: &Region) -> Result<u64> {
        self.check_region(region)?;
        Ok(region.index as u64 * self.region_stride)
    }

    /// The host address of a region's first byte.
    pub fn region_host_addr(&self, region: &Region) -> Result<u64> {
        Ok(self.device.ptr() as u64 + self.region_offset(region)?)
    }

    /// The address at which `dev`'s kernels see byte 0 of the pool,
    /// registering the pool's memory with the driver (portable, device-mapped)
    /// the first time.
    pub fn device_base(&self, dev: &Arc<CudaDevice>) -> Result<u64> {
        let mut reg = self.registration.lock().unwrap();
        match reg.as_ref() {
            // Portable registrations are visible in every context; under
            // unified addressing the device address is the same in all of them.
            Some(r) => Ok(r.device_addr()),
            None => {
                // SAFETY: the mapping outlives the registration (field order),
                // and this pool registers its mapping once.
                let r = unsafe {
                    HostRegistration::register(dev, self.device.ptr(), self.device.len(), REGISTER_FLAGS)
                }
                .map_err(|e| {
                    Error::Pool(format!(
                        "registering {} of pool memory with the GPU failed ({e}); check the memlock \
                         limit (ulimit -l) for this user",
                        format_size(self.device.len() as u64)
                    ))
                })?;
                let addr = r.device_addr();
                *reg = Some(r);
                Ok(addr)
            }
        }
    }

    pub(crate) fn check_region(&self, region: &Region) -> Result<()> {
        if region.pool != self.id || region.index >= self.num_regions {
            return Err(invalid("region", "belongs to another pool"));
        }
        Ok(())
    }

    /// Byte offset in the mapping of `len` bytes of whole entries of one
    /// layer starting at `first_token`, all checked.
    fn token_range(
        &self,
        region: &Region,
        layer: u32,
        first_token: u32,
        len: usize,
        arg: &'static str,
    ) -> Result<usize> {
        self.check_region(region)?;
        let entry = self.layout.entry_bytes() as usize;
        if !len.is_multiple_of(entry) {
            return Err(invalid(
                arg,
                format!("{len} bytes is not a whole number of {entry}-byte entries"),
            ));
        }
        let tokens = (len / entry) as u64;
        if first_token as u64 + tokens > self.layout.tokens_per_region() as u64 {
            return Err(invalid(
                arg,
                format!(
                    "tokens {first_token}..{} run past the region capacity of {}",
                    first_token as u64 + tokens,
                    self.layout.tokens_per_region()
                ),
            ));
        }
        let in_region = self.layout.layer_offset(layer)? + first_token as u64 * entry as u64;
        Ok((region.index as u64 * self.region_stride + in_region) as usize)
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("device", self.device.spec())
            .field("layout", &self.layout)
            .field("num_regions", &self.num_regions)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small_pool(regions: u64) -> Arc<Pool> {
        let layout = LayerFirstLayout::new(584, 2, 10).unwrap();
        let stride = layout.region_bytes().next_multiple_of(REGION_ALIGN);
        Pool::create(
            layout,
            DeviceSpec::Anon {
                bytes: regions * stride,
            },
        )
        .unwrap()
    }

    #[test]
    fn allocates_until_full_then_says_so() {
        let pool = small_pool(3);
        assert_eq!(pool.num_regions(), 3);
        let regions: Vec<_> = (0..3).map(|_| pool.alloc_region().unwrap()).collect();
        assert_eq!(
            regions.iter().map(Region::index).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        let err = pool.alloc_region().unwrap_err().to_string();
        assert!(err.contains("pool is full"), "{err}");
        pool.free_region(regions.into_iter().nth(1).unwrap())
            .unwrap();
        assert_eq!(pool.alloc_region().unwrap().index(), 1);
    }

    #[test]
    fn too_small_device_is_refused() {
        let layout = LayerFirstLayout::new(656, 61, 131072).unwrap();
        let err = Pool::create(layout, DeviceSpec::Anon { bytes: 1 << 30 })
            .unwrap_err()
            .to_string();
        assert!(err.contains("holds no region"), "{err}");
    }

    #[test]
    fn foreign_regions_are_refused() {
        let (a, b) = (small_pool(1), small_pool(1));
        let r = a.alloc_region().unwrap();
        assert!(b.write_tokens(&r, 0, 0, &[0; 584]).is_err());
        assert!(b.free_region(r).is_err());
    }

    #[test]
    fn token_io_is_layer_first_and_checked() {
        let pool = small_pool(2);
        let _r0 = pool.alloc_region().unwrap();
        let r1 = pool.alloc_region().unwrap();
        let data: Vec<u8> = (0..3 * 584).map(|i| i as u8).collect();
        pool.write_tokens(&r1, 1, 7, &data).unwrap();
        let mut back = vec![0u8; 3 * 584];
        pool.read_tokens(&r1, 1, 7, &mut back).unwrap();
        assert_eq!(back, data);
        // the bytes sit at region 1, layer 1, token 7
        let addr = pool.region_host_addr(&r1).unwrap() + pool.layout().entry_offset(1, 7).unwrap();
        assert_eq!(unsafe { *(addr as *const u8) }, 0);
        assert_eq!(unsafe { *((addr + 1) as *const u8) }, 1);
        assert!(
            pool.write_tokens(&r1, 1, 8, &data).is_err(),
            "runs past capacity"
        );
        assert!(
            pool.write_tokens(&r1, 2, 0, &data[..584]).is_err(),
            "no layer 2"
        );
        assert!(
            pool.write_tokens(&r1, 0, 0, &data[..100]).is_err(),
            "partial entry"
        );
    }

    #[test]
    fn shared_file_device_is_shared() {
        let dir = std::env::temp_dir().join(format!("kvtier-pool-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pool");
        let layout = LayerFirstLayout::new(8, 1, 512).unwrap();
        let spec = DeviceSpec::File {
            path: path.clone(),
            bytes: 2 * REGION_ALIGN,
        };
        let a = Pool::create(layout, spec.clone()).unwrap();
        let b = Pool::create(layout, spec).unwrap();
        let (ra, rb) = (a.alloc_region().unwrap(), b.alloc_region().unwrap());
        a.write_tokens(&ra, 0, 3, &[9, 8, 7, 6, 5, 4, 3, 2])
            .unwrap();
        let mut out = [0u8; 8];
        b.read_tokens(&rb, 0, 3, &mut out).unwrap();
        assert_eq!(
            out,
            [9, 8, 7, 6, 5, 4, 3, 2],
            "second mapping of the file sees the write"
        );
        drop((a, b));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
