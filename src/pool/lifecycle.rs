//! Making, opening and destroying a pool: the header written once and
//! checked field by field on every open, the devices mapped, this process
//! attached as a client.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::device::{self, MappedDevice};
use super::metadata::{
    self, ClientEntry, DEVICE_MAGIC, DeviceHeader, DeviceRecord, POOL_MAGIC, PoolHeader,
    RegionEntry, SPEC_BYTES,
};
use super::*;

impl Pool {
    /// A new pool of `layout` regions on one device, with default options.
    pub fn create(layout: LayerFirstLayout, device: DeviceSpec) -> Result<Arc<Pool>> {
        Pool::create_on(layout, vec![device], PoolOptions::default())
    }

    /// Bytes a single-device pool needs to hold `regions` regions of
    /// `layout` (metadata included): its tables, rounded to 2 MiB, and the
    /// regions.
    pub fn device_bytes_for(layout: &LayerFirstLayout, regions: u32) -> Result<u64> {
        if regions == 0 {
            return Err(invalid("regions", "a pool holds at least one region"));
        }
        let too_big = || {
            invalid(
                "regions",
                format!(
                    "{regions} regions of {} B do not fit 64-bit sizes",
                    layout.region_bytes()
                ),
            )
        };
        let stride = layout.region_bytes().next_multiple_of(REGION_ALIGN);
        let data = (regions as u64).checked_mul(stride).ok_or_else(too_big)?;
        // The tables grow with the device (a region table entry per region
        // the device could hold): start from the data plus tables for it,
        // then step up to the first size the plan accepts (a few steps: the
        // tables take 64 B per region of at least 4 KiB).
        let mut bytes = data.checked_add(metadata::DATA_ALIGN).ok_or_else(too_big)?;
        for _ in 0..1 << 20 {
            match metadata::plan_geometry(layout, &[bytes], DEFAULT_CLIENTS) {
                Ok(g) if g.num_regions >= regions => return Ok(bytes),
                Ok(g) => {
                    let short = (regions - g.num_regions) as u64 * stride;
                    bytes = bytes.checked_add(short).ok_or_else(too_big)?;
                }
                Err(_) => {
                    bytes = bytes
                        .checked_add(metadata::DATA_ALIGN)
                        .ok_or_else(too_big)?
                }
            }
        }
        Err(too_big())
    }

    /// A new pool of `layout` regions across `devices`: maps them (creating
    /// or growing files), writes the header, the device table and empty
    /// region and client tables, and attaches this process. Refuses devices
    /// that already hold a pool.
    pub fn create_on(
        layout: LayerFirstLayout,
        devices: Vec<DeviceSpec>,
        options: PoolOptions,
    ) -> Result<Arc<Pool>> {
        check_options(&devices, &options)?;
        if !devices[0].is_shared() {
            return Pool::create_locked(layout, devices, options);
        }
        // Two processes creating on the same shared devices at once: one
        // wins, the other finds the pool and is refused.
        let lock = device::CreateLock::acquire(&devices[0], options.file_mode)?;
        Pool::create_under(lock, layout, devices, options)
    }

    /// Creates the pool holding `lock` (the create lock on the first
    /// device). Which files a failure removes is decided here, under the
    /// lock: the first device's file when the lock's open made it and no
    /// other create has written it since, and the other devices' files that
    /// did not exist yet; never a file another process made or formatted.
    fn create_under(
        lock: device::CreateLock,
        layout: LayerFirstLayout,
        devices: Vec<DeviceSpec>,
        options: PoolOptions,
    ) -> Result<Arc<Pool>> {
        let file_path = |d: &DeviceSpec| match d {
            DeviceSpec::File { path, .. } => Some(path.clone()),
            _ => None,
        };
        let mut new_files: Vec<std::path::PathBuf> = Vec::new();
        // Made by this lock's open, and untouched since: another create may
        // have taken the lock first and formatted the file this one made.
        if lock.created && device::peek_magic(&devices[0])?.is_none_or(|m| m == [0; 8]) {
            new_files.extend(file_path(&devices[0]));
        }
        new_files.extend(
            devices[1..]
                .iter()
                .filter_map(file_path)
                .filter(|p| std::fs::symlink_metadata(p).is_err()),
        );
        let created = Pool::create_locked(layout, devices, options);
        if created.is_err() {
            for path in &new_files {
                let _ = std::fs::remove_file(path);
            }
        }
        drop(lock);
        created
    }

    /// [`Pool::create_on`], the caller holding the create lock (or the
    /// devices being private).
    pub(super) fn create_locked(
        layout: LayerFirstLayout,
        devices: Vec<DeviceSpec>,
        options: PoolOptions,
    ) -> Result<Arc<Pool>> {
        if options.clients == 0 || options.clients > MAX_CLIENTS {
            return Err(invalid(
                "clients",
                format!("{} is outside 1..={MAX_CLIENTS}", options.clients),
            ));
        }
        // The geometry, from the sizes the devices are given, before any is
        // mapped or allocated: a refused pool reserves nothing.
        let sized = |d: &DeviceSpec| !matches!(d, DeviceSpec::File { bytes: None, .. });
        if devices.iter().all(sized)
            && let Ok(sizes) = devices
                .iter()
                .map(|d| d.capacity().map(|c| c.bytes))
                .collect::<Result<Vec<u64>>>()
        {
            for (d, &size) in devices.iter().zip(&sizes) {
                check_device_size(d, size)?;
            }
            metadata::plan_geometry(&layout, &sizes, options.clients)?;
        }
        let maps: Vec<MappedDevice> = devices
            .iter()
            .map(|d| {
                MappedDevice::map_with(d, MapMode::Create, options.file_mode, options.host_pages)
            })
            .collect::<Result<_>>()?;
        for m in &maps {
            check_device_size(m.spec(), m.len() as u64)?;
            // SAFETY: the mapping holds at least DATA_ALIGN bytes.
            let magic = unsafe { std::ptr::read_volatile(m.ptr() as *const [u8; 8]) };
            if m.spec().is_shared() && (magic == POOL_MAGIC || magic == DEVICE_MAGIC) {
                return Err(Error::Pool(format!(
                    "{} already holds a kvtier pool; destroy it first (kvtier pool destroy)",
                    m.spec()
                )));
            }
        }
        // Any device, in any place of the new pool, that a live client of
        // an old pool (destroyed with force) still maps: its bytes are that
        // process's regions.
        for m in &maps {
            if let Some(f) = m.file()
                && identity::in_use(f, MAX_CLIENTS)
            {
                return Err(Error::Pool(format!(
                    "{} is still mapped by processes attached to the pool that was there; stop them before \
                     creating a new pool on it",
                    m.spec()
                )));
            }
        }
        let sizes: Vec<u64> = maps.iter().map(|m| m.len() as u64).collect();
        let g = metadata::plan_geometry(&layout, &sizes, options.clients)?;
        let hosts = match options.coherence {
            Coherence::Coherent => 0,
            Coherence::NonCoherent { hosts, .. } => hosts,
        };
        let mut header = PoolHeader {
            magic: [0; 8],
            version: VERSION,
            header_bytes: size_of::<PoolHeader>() as u32,
            uuid: rand::random(),
            entry_bytes: layout.entry_bytes(),
            layers: layout.layers(),
            tokens_per_region: layout.tokens_per_region(),
            num_devices: devices.len() as u32,
            region_stride: g.region_stride,
            num_regions: g.num_regions,
            num_clients: options.clients,
            hosts,
            checksum: 0,
            region_table_offset: g.region_table_offset,
            client_table_offset: g.client_table_offset,
            created_unix_ns: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0),
            devices: [DeviceRecord {
                bytes: 0,
                data_offset: 0,
                first_region: 0,
                num_regions: 0,
                spec_len: 0,
                _pad: 0,
                spec: [0; SPEC_BYTES],
            }; MAX_DEVICES],
        };
        for (i, (spec, &(data_offset, first_region, num_regions))) in
            devices.iter().zip(&g.devices).enumerate()
        {
            let text = spec.identity();
            if text.len() > SPEC_BYTES {
                return Err(invalid(
                    "device",
                    format!("{text:?} is longer than {SPEC_BYTES} bytes"),
                ));
            }
            let rec = &mut header.devices[i];
            rec.bytes = sizes[i];
            rec.data_offset = data_offset;
            rec.first_region = first_region;
            rec.num_regions = num_regions;
            rec.spec_len = text.len() as u32;
            rec.spec[..text.len()].copy_from_slice(text.as_bytes());
        }
        header.checksum = metadata::header_checksum(&header);
        let coherence = options.coherence;
        // Zero the tables, write the device headers, then the pool header,
        // each magic last, so that no opener sees a half-written pool.
        let base = maps[0].ptr();
        let meta_len = (g.client_table_offset + 64 * options.clients as u64) as usize;
        // SAFETY: the geometry puts header and tables inside device 0's metadata area.
        unsafe { base.write_bytes(0, meta_len) };
        coherence.after_write(base, meta_len);
        for (i, m) in maps.iter().enumerate().skip(1) {
            let dh = DeviceHeader {
                magic: [0; 8],
                version: VERSION,
                index: i as u32,
                uuid: header.uuid,
            };
            // SAFETY: device i is at least DATA_ALIGN bytes (it holds a region past it, or none at all).
            unsafe { std::ptr::write_volatile(m.ptr() as *mut DeviceHeader, dh) };
            std::sync::atomic::fence(Ordering::SeqCst);
            unsafe { std::ptr::write_volatile(m.ptr() as *mut [u8; 8], DEVICE_MAGIC) };
            coherence.after_write(m.ptr(), size_of::<DeviceHeader>());
        }
        // SAFETY: device 0 holds the header (the geometry put the tables after it).
        unsafe { std::ptr::write_volatile(base as *mut PoolHeader, header) };
        std::sync::atomic::fence(Ordering::SeqCst);
        unsafe { std::ptr::write_volatile(base as *mut [u8; 8], POOL_MAGIC) };
        coherence.after_write(base, size_of::<PoolHeader>());
        Pool::attach(maps, &options)
    }

    /// Attaches to an existing pool on `devices` (in the order it was created
    /// with; sizes may be left out): checks the header, the device table and
    /// every device header, registers this process as a client, and reclaims
    /// the regions of clients whose process died.
    pub fn open(devices: Vec<DeviceSpec>, options: PoolOptions) -> Result<Arc<Pool>> {
        check_options(&devices, &options)?;
        let maps: Vec<MappedDevice> = devices
            .iter()
            .map(|d| MappedDevice::map(d, MapMode::Open))
            .collect::<Result<_>>()?;
        Pool::attach(maps, &options)
    }

    /// Opens the pool on `devices`, or creates it with `layout` when the
    /// first device holds none: how processes that start together (the ranks
    /// of one server) share a pool, the first to arrive creating it. The
    /// decision is serialised with an exclusive `flock` on the first device,
    /// which holds among the processes of one host; hosts that share memory
    /// through a CXL switch create the pool beforehand (`kvtier pool create`).
    /// An existing pool serves `layout` when its regions have room for it
    /// (see [`Pool::open_expecting`]). Private devices (`anon:`, `numa:`)
    /// cannot be shared, so for them this creates a new pool.
    pub fn open_or_create(
        layout: LayerFirstLayout,
        devices: Vec<DeviceSpec>,
        options: PoolOptions,
    ) -> Result<Arc<Pool>> {
        check_options(&devices, &options)?;
        if !devices[0].is_shared() {
            return Pool::create_locked(layout, devices, options);
        }
        let lock = device::CreateLock::acquire(&devices[0], options.file_mode)?;
        if device::peek_magic(&devices[0])? == Some(POOL_MAGIC) {
            Pool::open_expecting(devices, layout, options)
        } else {
            Pool::create_under(lock, layout, devices, options)
        }
    }

    /// [`Pool::open`] for regions of `layout`: the pool's own, or any whose
    /// bytes fit its regions. A region is `region_stride` bytes, and a process
    /// may lay them out with a smaller layout of its own: the stages of a
    /// pipeline-parallel server hold different layer ranges, and share one
    /// pool whose regions were sized for the largest stage. The handle then
    /// addresses regions (and reports their size) with `layout`; processes
    /// that share a region's bytes must use the same layout.
    pub fn open_expecting(
        devices: Vec<DeviceSpec>,
        layout: LayerFirstLayout,
        options: PoolOptions,
    ) -> Result<Arc<Pool>> {
        let mut pool = Pool::open(devices, options)?;
        if pool.layout == layout {
            return Ok(pool);
        }
        if layout.region_bytes() > pool.region_stride {
            return Err(Error::Pool(format!(
                "the pool's regions hold {} (made for entries of {} B × {} layers × {} tokens); this process \
                 needs {} for entries of {} B × {} layers × {} tokens: create the pool for the largest layout \
                 that will use it (under pipeline parallelism, the stage with the most layers)",
                human_size(pool.region_stride),
                pool.layout.entry_bytes(),
                pool.layout.layers(),
                pool.layout.tokens_per_region(),
                human_size(layout.region_bytes()),
                layout.entry_bytes(),
                layout.layers(),
                layout.tokens_per_region()
            )));
        }
        Arc::get_mut(&mut pool)
            .expect("a pool just opened has one handle")
            .layout = layout;
        Ok(pool)
    }

    /// Invalidates the pool on `devices`: marks every device header destroyed
    /// so that it no longer opens and a new pool may reuse the files (the
    /// bytes stay). Refuses while other live processes are attached, unless
    /// `force`. For a pool shared by several hosts, see
    /// [`Pool::destroy_with`].
    pub fn destroy(devices: Vec<DeviceSpec>, force: bool) -> Result<()> {
        Pool::destroy_with(devices, force, Coherence::Coherent).map(|_| ())
    }

    /// [`Pool::destroy`] for a pool of `coherence` (several hosts: this
    /// host's index among them). A pool that cannot be opened because it
    /// cannot be trusted (a corrupt or overwritten header, a shrunk device, a
    /// device table that does not match) is destroyed only with `force`, and
    /// only while no process holds any of its devices: then the headers of
    /// the devices that still carry a kvtier pool's magic are cleared, and
    /// what was found is returned (Some), for the operator to read. A device
    /// that holds no kvtier pool is never written.
    pub fn destroy_with(
        devices: Vec<DeviceSpec>,
        force: bool,
        coherence: Coherence,
    ) -> Result<Option<String>> {
        let options = PoolOptions {
            attach: false,
            reclaim_dead: false,
            coherence,
            ..PoolOptions::default()
        };
        let pool = match Pool::open(devices.clone(), options) {
            Ok(pool) => pool,
            Err(Error::Pool(found)) if untrusted_pool(&devices) => {
                if !force {
                    return Err(Error::Pool(format!(
                        "{found}; `kvtier pool destroy --force` clears its headers once no process holds it"
                    )));
                }
                return wipe_untrusted(&devices, found).map(Some);
            }
            Err(e) => return Err(e),
        };
        let live: Vec<u32> = pool
            .clients_info()
            .into_iter()
            .filter(|c| c.liveness == Liveness::Alive)
            .map(|c| c.pid)
            .collect();
        if !live.is_empty() && !force {
            return Err(Error::Pool(format!(
                "processes {live:?} are attached to the pool; stop them, or destroy with force"
            )));
        }
        for d in pool.devices.iter().rev() {
            // SAFETY: every device starts with an 8-byte magic.
            unsafe {
                std::ptr::write_volatile(d.map.ptr() as *mut [u8; 8], device::DESTROYED_MAGIC)
            };
            pool.coherence.after_write(d.map.ptr(), 8);
        }
        Ok(None)
    }

    /// Removes the files of `file:` devices that hold a destroyed pool
    /// (what [`Pool::destroy`] leaves: the header cleared, the file and its
    /// memory still there), and returns their paths. A file that holds
    /// anything else (a live pool, another program's bytes) is refused
    /// before anything is removed; `dax:` devices stay (a device is not a
    /// file to remove).
    pub fn remove_destroyed_files(devices: &[DeviceSpec]) -> Result<Vec<std::path::PathBuf>> {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let mut sure = Vec::new();
        // each file's create lock, held until it is removed: a create that
        // would format the destroyed file again waits, and finds it gone
        let mut locks = Vec::new();
        for d in devices {
            let DeviceSpec::File { path, .. } = d else {
                continue;
            };
            let lock = device::CreateLock::acquire(d, device::DEFAULT_FILE_MODE)?;
            if lock.created {
                // it was gone: this lock's open made it, and nothing else has
                let _ = std::fs::remove_file(path);
                return Err(Error::Pool(format!(
                    "{} does not exist; nothing was removed",
                    path.display()
                )));
            }
            locks.push(lock);
            let (file, meta) = crate::shared_fs::open_file(
                path,
                crate::shared_fs::Access::ReadWrite,
                &device::POOL_FILE,
                "device",
            )?;
            let mut head = [0u8; 8];
            let n = file.read_at(&mut head, 0).map_err(|source| Error::Io {
                context: format!("reading {}", path.display()),
                source,
            })?;
            if n < 8 || head != device::DESTROYED_MAGIC {
                return Err(Error::Pool(format!(
                    "{} holds no destroyed pool (destroy the pool first); nothing was removed",
                    path.display()
                )));
            }
            sure.push((path.clone(), meta));
        }
        let mut removed = Vec::new();
        for (path, meta) in sure {
            // still the file judged above, not one put in its place since
            match std::fs::symlink_metadata(&path) {
                Ok(now) if now.dev() == meta.dev() && now.ino() == meta.ino() => {}
                _ => {
                    return Err(Error::Pool(format!(
                        "{} changed while it was being removed; nothing more was removed",
                        path.display()
                    )));
                }
            }
            std::fs::remove_file(&path).map_err(|source| Error::Io {
                context: format!("removing {}", path.display()),
                source,
            })?;
            removed.push(path);
        }
        drop(locks);
        Ok(removed)
    }

    pub(super) fn attach(maps: Vec<MappedDevice>, options: &PoolOptions) -> Result<Arc<Pool>> {
        let spec0 = maps[0].spec().clone();
        if maps[0].len() < size_of::<PoolHeader>() {
            return Err(Error::Pool(format!(
                "{spec0} is too small to hold a pool header"
            )));
        }
        let base = maps[0].ptr();
        options.coherence.before_read(base, size_of::<PoolHeader>());
        // SAFETY: the mapping holds a header-sized prefix (checked above).
        let h = unsafe { std::ptr::read_volatile(base as *const PoolHeader) };
        if h.magic == DEVICE_MAGIC {
            // SAFETY: as above; a device header is a prefix of the header's size.
            let dh = unsafe { std::ptr::read_volatile(base as *const DeviceHeader) };
            return Err(Error::Pool(format!(
                "{spec0} is device {} of a pool, not its first; give all of the pool's devices, in order",
                dh.index
            )));
        }
        if h.magic == device::DESTROYED_MAGIC {
            return Err(Error::Pool(format!(
                "no kvtier pool on {spec0}: the pool there was destroyed (create one with kvtier pool create)"
            )));
        }
        if h.magic != POOL_MAGIC {
            return Err(Error::Pool(format!(
                "no kvtier pool on {spec0} (create one with kvtier pool create)"
            )));
        }
        if h.version != VERSION {
            return Err(Error::Pool(format!(
                "the pool on {spec0} has format version {}; this kvtier reads version {VERSION}",
                h.version
            )));
        }
        let corrupt = |what: String| Error::Pool(format!("corrupt pool header on {spec0}: {what}"));
        if metadata::header_checksum(&h) != h.checksum {
            return Err(corrupt(
                "its checksum does not match (the header was overwritten); the pool cannot be trusted".into(),
            ));
        }
        let layout = LayerFirstLayout::new(h.entry_bytes, h.layers, h.tokens_per_region)
            .map_err(|e| corrupt(e.to_string()))?;
        check_header_geometry(&h, maps[0].len() as u64).map_err(corrupt)?;
        if h.region_stride < layout.region_bytes() || !h.region_stride.is_multiple_of(REGION_ALIGN)
        {
            return Err(Error::Pool(format!(
                "corrupt pool header on {spec0}: regions {} B apart cannot hold {} B each",
                h.region_stride,
                layout.region_bytes()
            )));
        }
        if h.num_devices as usize != maps.len() || h.num_devices as usize > MAX_DEVICES {
            return Err(Error::Pool(format!(
                "the pool spans {} device{}; {} {} given",
                h.num_devices,
                if h.num_devices == 1 { "" } else { "s" },
                maps.len(),
                if maps.len() == 1 { "was" } else { "were" }
            )));
        }
        match (h.hosts, options.coherence) {
            (0, Coherence::Coherent) => {}
            (0, _) => {
                return Err(invalid(
                    "coherence",
                    "this pool was created for one host (coherent memory)",
                ));
            }
            (n, Coherence::NonCoherent { hosts, .. }) if hosts == n => {}
            (n, _) => {
                return Err(invalid(
                    "coherence",
                    format!(
                        "this pool is shared by {n} hosts without hardware coherence; give this host's index"
                    ),
                ));
            }
        }
        let mut devices = Vec::new();
        for (i, map) in maps.into_iter().enumerate() {
            let rec = h.devices[i];
            let recorded = metadata::record_spec(&rec);
            if recorded != map.spec().identity() {
                return Err(Error::Pool(format!(
                    "device {i} of the pool is {recorded}, not {}",
                    map.spec()
                )));
            }
            if i > 0 {
                options
                    .coherence
                    .before_read(map.ptr(), size_of::<DeviceHeader>());
                // SAFETY: devices hold at least their data offset (checked below) >= the header.
                let dh = unsafe { std::ptr::read_volatile(map.ptr() as *const DeviceHeader) };
                if dh.magic != DEVICE_MAGIC || dh.uuid != h.uuid || dh.index != i as u32 {
                    return Err(Error::Pool(format!(
                        "{} is not device {i} of this pool",
                        map.spec()
                    )));
                }
            }
            // checked by check_header_geometry: no overflow
            let end = rec.data_offset + rec.num_regions as u64 * h.region_stride;
            if (map.len() as u64) < end {
                return Err(Error::Pool(format!(
                    "{} is {}; the pool's regions on it need {}",
                    map.spec(),
                    human_size(map.len() as u64),
                    human_size(end)
                )));
            }
            devices.push(PoolDevice {
                data_offset: rec.data_offset,
                first_region: rec.first_region,
                num_regions: rec.num_regions,
                bytes: rec.bytes,
                registration: Mutex::new(None),
                map,
            });
        }
        let placement = RoundRobinPlacement::new(options.rank, options.ranks, devices.len() as u32)
            .ok_or_else(|| {
                invalid(
                    "rank",
                    format!("rank {} of {} ranks", options.rank, options.ranks),
                )
            })?;
        let mut pool = Pool {
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            layout,
            region_stride: h.region_stride,
            num_regions: h.num_regions,
            num_clients: h.num_clients,
            uuid: h.uuid,
            coherence: options.coherence,
            // SAFETY: the header's offsets lie inside device 0's metadata area.
            regions: unsafe { base.add(h.region_table_offset as usize) } as *const RegionEntry,
            clients: unsafe { base.add(h.client_table_offset as usize) } as *const ClientEntry,
            me: None,
            published_stats: Default::default(),
            opened_by: std::process::id(),
            lock: match devices.first().and_then(|d| d.map.file()) {
                Some(f) => Some(identity::ClientLock::new(f)?),
                None => None,
            },
            joined: Mutex::new(Default::default()),
            placement: Mutex::new(placement),
            register_flags: options.register_flags,
            devices,
        };
        if options.reclaim_dead {
            pool.reclaim_dead()?;
        }
        if options.attach {
            pool.me = Some(pool.claim_client()?);
            for d in &pool.devices {
                if let Some(f) = d.map.file() {
                    identity::mark_holder(f)?;
                }
            }
        }
        Ok(Arc::new(pool))
    }
}

/// A device of `bytes` can hold a pool's header (or a device header), then
/// regions.
fn check_device_size(spec: &DeviceSpec, bytes: u64) -> Result<()> {
    if bytes < metadata::DATA_ALIGN {
        return Err(Error::Pool(format!(
            "{spec} is {}; a pool device holds at least {} (its header, then regions)",
            human_size(bytes),
            human_size(metadata::DATA_ALIGN)
        )));
    }
    Ok(())
}

/// Whether the first device carries a kvtier pool's magic: an open that
/// failed there found a pool it could not trust, not a device without one.
fn untrusted_pool(devices: &[DeviceSpec]) -> bool {
    devices[0].is_shared() && device::peek_magic(&devices[0]).ok().flatten() == Some(POOL_MAGIC)
}

/// Clears the headers of a pool that cannot be opened (`found` says why),
/// once no live process holds any of its devices.
fn wipe_untrusted(devices: &[DeviceSpec], found: String) -> Result<String> {
    let maps: Vec<MappedDevice> = devices
        .iter()
        .map(|d| MappedDevice::map(d, MapMode::Open))
        .collect::<Result<_>>()?;
    for m in &maps {
        if let Some(f) = m.file()
            && identity::in_use(f, MAX_CLIENTS)
        {
            return Err(Error::Pool(format!(
                "{found}; and processes still map {}: stop them before destroying the pool",
                m.spec()
            )));
        }
    }
    for m in &maps {
        if m.len() < 8 {
            continue;
        }
        // SAFETY: the mapping holds at least 8 bytes.
        let magic = unsafe { std::ptr::read_volatile(m.ptr() as *const [u8; 8]) };
        if magic == POOL_MAGIC || magic == DEVICE_MAGIC {
            // SAFETY: as above.
            unsafe { std::ptr::write_volatile(m.ptr() as *mut [u8; 8], device::DESTROYED_MAGIC) };
        }
    }
    Ok(found)
}

/// Whether a header's tables and device records describe a pool that fits
/// its first device of `dev0_len` bytes: every offset and count is checked,
/// with checked arithmetic, before anything is read through them.
fn check_header_geometry(h: &PoolHeader, dev0_len: u64) -> std::result::Result<(), String> {
    let n = h.num_devices as usize;
    if n == 0 || n > MAX_DEVICES {
        return Err(format!("{n} devices"));
    }
    if h.header_bytes as usize != size_of::<PoolHeader>() {
        return Err(format!("a header of {} B", h.header_bytes));
    }
    if h.num_clients == 0 || h.num_clients > MAX_CLIENTS {
        return Err(format!("{} client slots", h.num_clients));
    }
    let region_table = (size_of::<PoolHeader>() as u64).next_multiple_of(64);
    let table_end = |offset: u64, entries: u32| offset.checked_add(64 * entries as u64);
    let regions_end = table_end(h.region_table_offset, h.num_regions);
    let clients_end = table_end(h.client_table_offset, h.num_clients);
    let (Some(regions_end), Some(clients_end)) = (regions_end, clients_end) else {
        return Err("tables past the end of the address space".into());
    };
    if h.region_table_offset != region_table
        || h.client_table_offset < regions_end
        || !h.client_table_offset.is_multiple_of(64)
    {
        return Err(format!(
            "tables at {} and {} for {} regions",
            h.region_table_offset, h.client_table_offset, h.num_regions
        ));
    }
    let mut next_region = 0u64;
    for (i, rec) in h.devices[..n].iter().enumerate() {
        let min_offset = if i == 0 {
            clients_end
        } else {
            metadata::DATA_ALIGN
        };
        let end = (rec.num_regions as u64)
            .checked_mul(h.region_stride)
            .and_then(|b| b.checked_add(rec.data_offset));
        if rec.data_offset < min_offset
            || !rec.data_offset.is_multiple_of(metadata::DATA_ALIGN)
            || rec.first_region as u64 != next_region
            || end.is_none_or(|e| e > rec.bytes)
            || rec.spec_len as usize > SPEC_BYTES
        {
            return Err(format!("the record of device {i} does not fit its device"));
        }
        next_region += rec.num_regions as u64;
    }
    if next_region != h.num_regions as u64 {
        return Err(format!(
            "{} regions; the devices hold {next_region}",
            h.num_regions
        ));
    }
    if h.devices[0].data_offset > dev0_len {
        return Err(format!("device 0 is {dev0_len} B, less than its tables"));
    }
    Ok(())
}

fn check_options(devices: &[DeviceSpec], o: &PoolOptions) -> Result<()> {
    if devices.is_empty() || devices.len() > MAX_DEVICES {
        return Err(invalid(
            "devices",
            format!(
                "{} given; a pool spans 1..={MAX_DEVICES} devices",
                devices.len()
            ),
        ));
    }
    // One file (or DAX device) named twice would be two devices of the pool
    // on the same bytes: refused by name, before anything is mapped.
    let mut seen: Vec<(std::path::PathBuf, usize)> = Vec::new();
    for (i, d) in devices.iter().enumerate() {
        let (DeviceSpec::File { path, .. } | DeviceSpec::Dax { path, .. }) = d else {
            continue;
        };
        let key = std::fs::canonicalize(path).unwrap_or_else(|_| path.clone());
        if let Some((_, first)) = seen.iter().find(|(p, _)| *p == key) {
            return Err(invalid(
                "devices",
                format!(
                    "{} is named twice (devices {first} and {i}); name each device once",
                    d.identity()
                ),
            ));
        }
        seen.push((key, i));
    }
    if let Coherence::NonCoherent { hosts, host } = o.coherence {
        if !metadata::non_coherent_supported() {
            return Err(invalid(
                "coherence",
                "non-coherent multi-host mode is implemented for x86_64 only",
            ));
        }
        if hosts == 0 || host >= hosts {
            return Err(invalid(
                "coherence",
                format!("host {host} of {hosts} hosts"),
            ));
        }
    }
    if o.file_mode & !0o770 != 0 {
        return Err(invalid(
            "mode",
            format!(
                "{:04o}: a pool's files are for their user and group only (0600, or 0660 for a group of \
                 users); other users could read every request's KV",
                o.file_mode
            ),
        ));
    }
    if o.ranks == 0 || o.rank >= o.ranks {
        return Err(invalid(
            "rank",
            format!("rank {} of {} ranks", o.rank, o.ranks),
        ));
    }
    Ok(())
}
