//! Regions: allocation (placed per rank round-robin), publication, freeing,
//! reading and writing their bytes, their host and device addresses.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::metadata::{ClientControl, ClientState, PUBLISH, RegionControl};
use super::*;

/// How long an owner's free waits for a hold on its region to go before it
/// calls the region joined: far longer than a failed join holds (its second
/// check, microseconds), far shorter than a real joiner's stay.
const FAILED_JOIN_GRACE: std::time::Duration = std::time::Duration::from_millis(50);

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Pool {
    /// This process's client slot and generation: what every region it
    /// allocates, publishes or frees is marked with. A forked child has none
    /// through its parent's handle.
    pub(super) fn owner(&self) -> Result<(u16, u32)> {
        if self.forked() {
            return Err(Error::Pool(format!(
                "this pool handle belongs to process {}, which opened the pool; process {} (a fork of it) \
                 must open the pool itself to allocate, publish or free regions",
                self.opened_by,
                std::process::id()
            )));
        }
        self.me
            .ok_or_else(|| invalid("pool", "was opened for inspection only (attach = false)"))
    }

    /// Whether this process is a fork of the one that opened the pool.
    pub(super) fn forked(&self) -> bool {
        std::process::id() != self.opened_by
    }

    /// The control word of a region this process holds in `state`.
    fn mine(&self, state: RegionState) -> Result<u64> {
        let (client, generation) = self.owner()?;
        Ok(RegionControl {
            state,
            client,
            generation,
        }
        .encode())
    }

    pub(super) fn device_has_free(&self, d: u32) -> bool {
        let dev = &self.devices[d as usize];
        (dev.first_region..dev.first_region + dev.num_regions)
            .filter(|&r| self.coherence.owns(r))
            .any(|r| {
                self.region_control(r)
                    .is_some_and(|c| c.state == RegionState::Free)
            })
    }

    /// Takes a free region on the device this rank's placement picks.
    pub fn alloc_region(&self) -> Result<Region> {
        self.alloc_region_for(0)
    }

    /// Takes a free region for request `request` (an id of the caller's,
    /// shown by `kvtier pool status`).
    pub fn alloc_region_for(&self, request: u64) -> Result<Region> {
        let mine = self.mine(RegionState::Allocated)?;
        loop {
            let d = self
                .placement
                .lock()
                .unwrap()
                .next(|d| self.device_has_free(d))
                .ok_or_else(|| {
                    Error::Pool(format!(
                        "pool is full: all {} regions are allocated",
                        self.num_regions
                    ))
                })?;
            let dev = &self.devices[d as usize];
            for r in (dev.first_region..dev.first_region + dev.num_regions)
                .filter(|&r| self.coherence.owns(r))
            {
                let e = self.region_entry(r);
                if self.load(&e.control) == RegionControl::FREE.encode()
                    && self.cas(
                        &e.control,
                        RegionControl::FREE.encode(),
                        mine,
                        Ordering::AcqRel,
                    )
                {
                    e.epoch.fetch_add(1, Ordering::AcqRel);
                    self.coherence
                        .after_write(&e.epoch as *const AtomicU64 as *const u8, 8);
                    self.store(&e.request, request);
                    return Ok(Region {
                        pool: self.id,
                        index: r,
                        device: d,
                        joined: false,
                    });
                }
            }
            // others took that device's free regions meanwhile: place again
        }
    }

    /// Publishes a region: its bytes have been written (by this process, or
    /// by a kernel whose completion the caller awaited), and readers may
    /// trust them from now on.
    pub fn publish(&self, region: &Region) -> Result<()> {
        self.check_region(region)?;
        if region.joined {
            return Err(Error::Pool(format!(
                "region {} was joined here: only its owner publishes it",
                region.index
            )));
        }
        let from = self.mine(RegionState::Allocated)?;
        let to = self.mine(RegionState::Ready)?;
        if self.cas(&self.region_entry(region.index).control, from, to, PUBLISH) {
            Ok(())
        } else if self.load(&self.region_entry(region.index).control) == to {
            Err(Error::Pool(format!(
                "region {} is already published (a region is published once per allocation)",
                region.index
            )))
        } else {
            Err(self.not_owned(region, "publish"))
        }
    }

    /// The epoch of region `region`: an opaque value naming this allocation
    /// of it, as [`Pool::join_region`] takes it (read it after allocating,
    /// before telling the joiners). It is the region's allocation epoch
    /// (moved by every allocation and by every free its owner attempts) with
    /// the owner's client slot and generation, so no later allocation of the
    /// region has it, whoever makes it, even in the instant before that
    /// allocation moves the epoch.
    pub fn region_epoch(&self, region: &Region) -> Result<u64> {
        self.check_region(region)?;
        self.ticket(region.index)
            .ok_or_else(|| self.not_owned(region, "name"))
    }

    /// What the processes that join `region` are told: this pool's uuid,
    /// the region and [`Pool::region_epoch`].
    pub fn region_ticket(&self, region: &Region) -> Result<RegionTicket> {
        Ok(RegionTicket {
            pool_uuid: self.uuid(),
            index: region.index,
            epoch: self.region_epoch(region)?,
        })
    }

    /// Region `index`'s current epoch as [`Pool::region_epoch`] gives it;
    /// None when it is free or its entry is corrupt.
    pub(super) fn ticket(&self, index: u32) -> Option<u64> {
        let c = self.region_control(index)?;
        let epoch = self.load(&self.region_entry(index).epoch);
        (c.state != RegionState::Free).then_some(
            (epoch & 0xffff_ffff) << 32 | (c.client as u64) << 16 | (c.generation as u64 & 0xffff),
        )
    }

    /// Maps the region `ticket` names ([`Pool::region_ticket`] of its
    /// owner's handle), which another process allocated and still owns: one
    /// copy shared by processes that read and write it together (the ranks
    /// of a tensor-parallel group, say). The owner passes the ticket over
    /// its own channel. A ticket of another pool is refused, also one of a
    /// pool destroyed and made again on the same devices (a new pool has a
    /// new uuid): region numbers and epochs alone repeat from pool to pool.
    ///
    /// While any handle of this process holds the region, so does a lock of
    /// this process's (one byte of the first device, which the kernel drops
    /// when the process goes): no reclaim frees a region a live process has
    /// joined, and its owner's [`Pool::free_region`] leaves the freeing to
    /// the last joiner to leave. A region whose owner exited or died while
    /// joined is freed by the last joiner to leave too (or, if that one
    /// dies, by the next reclaim).
    ///
    /// Needs a pool on `file:` or `dax:` devices, its processes on one host
    /// (the holds are one kernel's file locks: a joiner on another host is
    /// invisible to this host's frees and reclaims). Give the handle back
    /// with [`Pool::free_region`]; a handle dropped without it keeps its
    /// hold until the pool handle goes. A forked child shares its parent's
    /// holds (one lock of one open file): the child's free of a joined
    /// handle does nothing, and the parent's last leave drops both.
    pub fn join_region(&self, ticket: RegionTicket) -> Result<Region> {
        let RegionTicket {
            pool_uuid,
            index,
            epoch,
        } = ticket;
        if pool_uuid != self.uuid() {
            return Err(invalid(
                "ticket",
                format!(
                    "names a region of pool {}, not of this pool {} (a pool made again on the same devices is \
                     another pool); ask the owner for a ticket of this one",
                    hex(&pool_uuid),
                    hex(&self.uuid())
                ),
            ));
        }
        let (me, _) = self.owner()?;
        self.check_index(index)?;
        let Some(lock) = self.lock.as_ref() else {
            return Err(invalid(
                "pool",
                "its devices are private to one process: a region is shared between processes only in a pool on \
                 file: or dax: devices",
            ));
        };
        if self.coherence != Coherence::Coherent {
            return Err(invalid(
                "pool",
                "spans hosts without hardware coherence: a shared region's holds are one host's file locks",
            ));
        }
        // The owner must be alive after this hold is taken: a reclaimer frees
        // only a dead (or departed) owner's regions, and checks the holds
        // after it has judged the owner, so it sees this one; an owner's own
        // free moves the epoch before it looks (`free_unjoined`).
        let owned_by_live_owner = || -> Result<()> {
            let c = self
                .region_control(index)
                .ok_or_else(|| Error::Pool(format!("region {index}'s table entry is corrupt")))?;
            if c.state == RegionState::Free || self.ticket(index) != Some(epoch) {
                return Err(Error::Pool(format!(
                    "region {index} allocation {epoch:#x} is gone (the region is {}); its owner freed it or \
                     tried to, or died",
                    if c.state == RegionState::Free {
                        "free"
                    } else {
                        "allocated again, or named anew"
                    }
                )));
            }
            if c.client == me {
                return Err(invalid(
                    "index",
                    format!(
                        "region {index} is this pool handle's own; use the handle alloc_region gave"
                    ),
                ));
            }
            let slot = || {
                ClientControl::decode(self.load(&self.client_entry(c.client as u32).control))
                    .is_some_and(|o| o.state == ClientState::Live && o.generation == c.generation)
            };
            // the slot read again after the liveness: not reclaimed and
            // claimed by another process in between
            let live = slot()
                && self
                    .client_liveness(c.client as u32)
                    .unwrap_or(Liveness::Unknown)
                    == Liveness::Alive
                && slot();
            if !live {
                return Err(Error::Pool(format!(
                    "region {index}'s owner (client slot {}) is not alive: a region is joined only while its \
                     owner lives",
                    c.client
                )));
            }
            Ok(())
        };
        owned_by_live_owner()?;
        {
            let mut joined = self.joined.lock().unwrap();
            match joined.get_mut(&index) {
                Some(n) => *n += 1,
                None => {
                    lock.hold_region(index)?;
                    joined.insert(index, 1);
                }
            }
        }
        #[cfg(test)]
        tests::after_hold(self, index);
        let region = Region {
            pool: self.id,
            index,
            device: self.device_of(index) as u32,
            joined: true,
        };
        if let Err(e) = owned_by_live_owner() {
            self.leave(&region);
            return Err(e);
        }
        Ok(region)
    }

    /// Drops one of this process's handles on a joined region. The last
    /// gives up the hold, and frees the region when its owner is gone (dead,
    /// or exited while it was joined) and no other joiner holds it.
    fn leave(&self, region: &Region) {
        let mut joined = self.joined.lock().unwrap();
        let Some(n) = joined.get_mut(&region.index) else {
            return;
        };
        *n -= 1;
        if *n > 0 {
            return;
        }
        joined.remove(&region.index);
        if let Some(lock) = &self.lock {
            lock.release_region(region.index);
        }
        drop(joined);
        // after the release: an owner whose free saw this hold recorded its
        // wish before it looked at the holds again (free_region)
        std::sync::atomic::fence(Ordering::SeqCst);
        let e = self.region_entry(region.index);
        let w = self.load(&e.control);
        let freeing = self.load(&e.freeing);
        if let Some(c) = RegionControl::decode(w)
            && c.state != RegionState::Free
            && (c.client as u32) < self.num_clients
            && (self.owner_info(c).liveness == Liveness::Dead
                || (freeing != 0 && self.ticket(region.index) == Some(freeing)))
        {
            self.free_unjoined(region.index, w, false);
        }
    }

    /// Whether a process other than through this handle maps region `index`
    /// (a joiner): a region it holds is never freed.
    pub(super) fn held_by_joiner(&self, index: u32) -> bool {
        self.joined.lock().unwrap().contains_key(&index)
            || self
                .lock
                .as_ref()
                .is_some_and(|l| l.region_held_by_another(index))
    }

    /// Whether another process (or another pool handle of this one) has
    /// joined `region` and holds it now.
    pub fn region_joined_elsewhere(&self, region: &Region) -> Result<bool> {
        self.check_region(region)?;
        Ok(self
            .lock
            .as_ref()
            .is_some_and(|l| l.region_held_by_another(region.index)))
    }

    /// Returns a region to the pool; a joined region's handle leaves it to
    /// its owner. An owner's region that another process has joined is not
    /// freed while it is held: an error says so, the handle is gone, and the
    /// region stays allocated until the last process that joined it leaves,
    /// which frees it (or, wait for [`Pool::region_joined_elsewhere`] to
    /// turn false first). A hold that goes within 50 ms (a join that is
    /// failing) does not count.
    pub fn free_region(&self, region: Region) -> Result<()> {
        self.check_region(&region)?;
        if region.joined {
            // a forked child shares its parent's hold (an OFD lock): it
            // leaves nothing through the parent's handle
            if !self.forked() {
                self.leave(&region);
            }
            return Ok(());
        }
        let w = self.load(&self.region_entry(region.index).control);
        let (allocated, ready) = (
            self.mine(RegionState::Allocated)?,
            self.mine(RegionState::Ready)?,
        );
        if w != allocated && w != ready {
            return Err(self.not_owned(&region, "free"));
        }
        if self.free_unjoined(region.index, w, true) {
            return Ok(());
        }
        // A hold seen now is a joiner's that read the epoch before it moved
        // (it stays) or one that is about to find the epoch moved and let go
        // (a failed join holds for the moment between its two checks): give
        // the second kind a little time before calling the region joined.
        let deadline = std::time::Instant::now() + FAILED_JOIN_GRACE;
        let mut pause = std::time::Duration::from_micros(10);
        for tries in 0u32.. {
            if std::time::Instant::now() >= deadline {
                break;
            }
            // a failed join lets go microseconds after it took hold: yield
            // first, then sleep longer and longer
            if tries < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(pause);
                pause = (pause * 2).min(std::time::Duration::from_millis(2));
            }
            if self.load(&self.region_entry(region.index).control) != w {
                break;
            }
            if self.free_unjoined(region.index, w, false) {
                return Ok(());
            }
        }
        // Still held: the wish is recorded for the last holder to leave
        // (leave), then the holds are looked at once more, so that a holder
        // that left in between is not missed by both sides.
        if self.load(&self.region_entry(region.index).control) == w
            && let Some(ticket) = self.ticket(region.index)
        {
            let e = self.region_entry(region.index);
            e.freeing.store(ticket, Ordering::SeqCst);
            self.coherence
                .after_write(&e.freeing as *const AtomicU64 as *const u8, 8);
            // freed here, or by the holder leaving just now (it found the wish)
            if self.free_unjoined(region.index, w, false)
                || self.load(&self.region_entry(region.index).control) != w
            {
                return Ok(());
            }
        }
        if self.load(&self.region_entry(region.index).control) != w {
            return Err(self.not_owned(&region, "free"));
        }
        Err(Error::Pool(format!(
            "region {} is still mapped by a process that joined it, so it stays allocated until the last process \
             that joined it leaves, which frees it (this handle is gone)",
            region.index
        )))
    }

    pub(super) fn not_owned(&self, region: &Region, what: &str) -> Error {
        let now = match self.region_control(region.index).map(|c| c.state) {
            Some(RegionState::Free) => "it is free",
            Some(RegionState::Allocated) => "it is allocated, not yet published",
            Some(RegionState::Ready) => "it is published",
            None => "its table entry is corrupt",
        };
        Error::Pool(format!(
            "cannot {what} region {}: this process does not own it ({now}); a dead owner's regions are \
             reclaimed, so it may have been reclaimed from a process judged dead",
            region.index
        ))
    }

    pub(super) fn check_region(&self, region: &Region) -> Result<()> {
        if region.pool != self.id || region.index >= self.num_regions {
            return Err(invalid("region", "belongs to another pool"));
        }
        Ok(())
    }

    /// Refuses a region index past the pool's regions.
    fn check_index(&self, index: u32) -> Result<()> {
        if index >= self.num_regions {
            return Err(invalid(
                "index",
                format!(
                    "region {index} does not exist; the pool has {}",
                    self.num_regions
                ),
            ));
        }
        Ok(())
    }

    /// The state of region `index` (e.g. to poll for READY).
    pub fn region_state(&self, index: u32) -> Result<RegionState> {
        if index >= self.num_regions {
            return Err(invalid(
                "index",
                format!("{index} is beyond the pool's {} regions", self.num_regions),
            ));
        }
        self.region_control(index)
            .map(|c| c.state)
            .ok_or_else(|| Error::Pool(format!("region {index}'s table entry is corrupt")))
    }

    /// Writes consecutive entries of one layer of a region this process
    /// owns, starting at `first_token`; `data` holds whole entries.
    pub fn write_tokens(
        &self,
        region: &Region,
        layer: u32,
        first_token: u32,
        data: &[u8],
    ) -> Result<()> {
        self.check_region(region)?;
        let owner = self.owner()?;
        match self.region_control(region.index) {
            Some(c) if c.state != RegionState::Free && (c.client, c.generation) == owner => {}
            _ => return Err(self.not_owned(region, "write")),
        }
        let at = self.token_range(region.index, layer, first_token, data.len(), "data")?;
        // SAFETY: token_range checked that the bytes lie inside the region's
        // device mapping; the source is a distinct Rust slice.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), at, data.len()) };
        self.coherence.after_write(at, data.len());
        Ok(())
    }

    /// Reads consecutive entries of one layer of a region this process owns.
    pub fn read_tokens(
        &self,
        region: &Region,
        layer: u32,
        first_token: u32,
        out: &mut [u8],
    ) -> Result<()> {
        self.check_region(region)?;
        self.read_at(region.index, layer, first_token, out)
    }

    /// Reads consecutive entries of one layer of region `index`, which must be
    /// READY (published by its owner, whoever that is) from before the read
    /// to after it: a region freed or reallocated meanwhile (its bytes may
    /// be another owner's, half written) is an error, never torn bytes.
    pub fn read_ready(
        &self,
        index: u32,
        layer: u32,
        first_token: u32,
        out: &mut [u8],
    ) -> Result<()> {
        self.check_index(index)?;
        let e = self.region_entry(index);
        let seen = || (self.load(&e.control), self.load(&e.epoch));
        let before = seen();
        if RegionControl::decode(before.0).map(|c| c.state) != Some(RegionState::Ready) {
            return Err(Error::Pool(format!(
                "region {index} is not READY; its bytes may be partial"
            )));
        }
        self.read_at(index, layer, first_token, out)?;
        // the bytes are read before the words are looked at again
        std::sync::atomic::fence(Ordering::Acquire);
        if seen() != before {
            return Err(Error::Pool(format!(
                "region {index} was freed or reallocated while it was read; read it again if it is READY"
            )));
        }
        Ok(())
    }

    pub(super) fn read_at(
        &self,
        index: u32,
        layer: u32,
        first_token: u32,
        out: &mut [u8],
    ) -> Result<()> {
        let at = self.token_range(index, layer, first_token, out.len(), "out")?;
        self.coherence.before_read(at, out.len());
        // SAFETY: as in write_tokens.
        unsafe { std::ptr::copy_nonoverlapping(at, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// The host address of whole entries of one layer, all checked.
    pub(super) fn token_range(
        &self,
        index: u32,
        layer: u32,
        first_token: u32,
        len: usize,
        arg: &'static str,
    ) -> Result<*mut u8> {
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
        Ok((self.host_addr(index) + in_region) as *mut u8)
    }

    pub(super) fn device_of(&self, index: u32) -> usize {
        self.devices.partition_point(|d| d.first_region <= index) - 1
    }

    pub(super) fn host_addr(&self, index: u32) -> u64 {
        let d = &self.devices[self.device_of(index)];
        d.map.ptr() as u64 + d.data_offset + (index - d.first_region) as u64 * self.region_stride
    }

    /// The host address of a region's first byte.
    pub fn region_host_addr(&self, region: &Region) -> Result<u64> {
        self.check_region(region)?;
        Ok(self.host_addr(region.index))
    }

    /// The address at which `dev`'s kernels see a region's first byte,
    /// registering its device with the driver the first time.
    pub fn region_device_addr(&self, region: &Region, dev: &Arc<CudaDevice>) -> Result<u64> {
        self.check_region(region)?;
        let d = self.device_of(region.index);
        let base = self.register_device(d, dev)?;
        let pd = &self.devices[d];
        Ok(base + pd.data_offset + (region.index - pd.first_region) as u64 * self.region_stride)
    }

    /// Registers every device with `dev` (portable, device-mapped, or the
    /// flags in the pool options).
    pub fn register_all(&self, dev: &Arc<CudaDevice>) -> Result<()> {
        for d in 0..self.devices.len() {
            self.register_device(d, dev)?;
        }
        Ok(())
    }

    /// The device address of byte 0 of device `d`, registering it once.
    pub(super) fn register_device(&self, d: usize, dev: &Arc<CudaDevice>) -> Result<u64> {
        let pd = &self.devices[d];
        let mut reg = pd.registration.lock().unwrap();
        if let Some(r) = reg.as_ref() {
            // Portable registrations are visible in every context; under
            // unified addressing the device address is the same in all.
            return Ok(r.device_addr());
        }
        // SAFETY: the mapping outlives the registration (field order), and
        // each device is registered once.
        let r = unsafe { HostRegistration::register(dev, pd.map.ptr(), pd.map.len(), self.register_flags) }.map_err(|e| {
            Error::Pool(format!(
                "registering {} ({}) with the GPU failed ({e}); check the memlock limit (ulimit -l); a file on \
                 a disk filesystem or FS-DAX cannot be pinned (use tmpfs, hugetlbfs, a dax: device or a numa: \
                 node); memory someone else registered already (an engine's host pool) is refused as such",
                pd.map.spec(),
                format_size(pd.map.len() as u64)
            ))
        })?;
        let addr = r.device_addr();
        *reg = Some(r);
        Ok(addr)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    /// What a test makes happen between a join's hold and its second look
    /// at the region (its owner's free, say).
    type Hook = Box<dyn Fn(&Pool, u32)>;

    thread_local! {
        static AFTER_HOLD: RefCell<Option<Hook>> = const { RefCell::new(None) };
    }

    pub(super) fn after_hold(pool: &Pool, index: u32) {
        AFTER_HOLD.with(|h| {
            if let Some(f) = h.borrow().as_ref() {
                f(pool, index)
            }
        });
    }

    /// An owner frees a region a live joiner holds: refused, and the
    /// joiner's leave frees it (it is not left allocated to a live owner
    /// that gave it up); a joiner that dies instead leaves it to a reclaim.
    #[test]
    fn a_refused_free_is_done_by_the_last_joiner_to_leave() {
        let (path, [owner, other, joiner]) = handles("wish");
        let r = owner.alloc_region().unwrap();
        let index = r.index();
        let j = joiner
            .join_region(owner.region_ticket(&r).unwrap())
            .unwrap();
        let e = owner.free_region(r).unwrap_err().to_string();
        assert!(
            e.contains("until the last process that joined it leaves"),
            "{e}"
        );
        assert_eq!(owner.region_state(index).unwrap(), RegionState::Allocated);
        joiner.free_region(j).unwrap();
        assert_eq!(owner.region_state(index).unwrap(), RegionState::Free);
        // the wish names that allocation only: the next one is the owner's
        let r2 = owner.alloc_region().unwrap();
        assert_eq!(r2.index(), index);
        let j2 = joiner
            .join_region(owner.region_ticket(&r2).unwrap())
            .unwrap();
        joiner.free_region(j2).unwrap();
        assert_eq!(owner.region_state(index).unwrap(), RegionState::Allocated);
        // a joiner gone without leaving (its hold dropped by the kernel,
        // no leave run): the next reclaim does what it would have done
        let j3 = joiner
            .join_region(owner.region_ticket(&r2).unwrap())
            .unwrap();
        assert!(owner.free_region(r2).is_err());
        joiner.joined.lock().unwrap().clear();
        joiner.lock.as_ref().unwrap().release_region(index);
        let _ = j3; // dropped without a leave, as a process that died leaves it
        assert_eq!(owner.region_state(index).unwrap(), RegionState::Allocated);
        assert_eq!(other.reclaim_dead().unwrap().regions, 1);
        assert_eq!(owner.region_state(index).unwrap(), RegionState::Free);
        drop((owner, other, joiner));
        drop(path);
    }

    /// The owner frees its region in the instant a join holds it but has not
    /// yet seen the epoch move: the join fails, and the free, which saw its
    /// hold, still frees the region (a failed join leaves no trace).
    #[test]
    fn a_failed_join_leaves_its_owners_free_to_free() {
        let (path, [owner, _, joiner]) = handles("failed-join");
        let r = owner.alloc_region().unwrap();
        let index = r.index();
        let ticket = owner.region_ticket(&r).unwrap();
        let freeing = std::sync::Mutex::new(Some((owner.clone(), r)));
        let free = Arc::new(std::sync::Mutex::new(None));
        let started = free.clone();
        AFTER_HOLD.with(|h| {
            *h.borrow_mut() = Some(Box::new(move |pool: &Pool, index: u32| {
                let Some((owner, r)) = freeing.lock().unwrap().take() else {
                    return;
                };
                let epoch = || pool.load(&pool.region_entry(index).epoch);
                let before = epoch();
                let t = std::thread::spawn(move || owner.free_region(r));
                // the join goes on once the free has moved the epoch (and
                // so sees this hold)
                while epoch() == before {
                    std::thread::yield_now();
                }
                *started.lock().unwrap() = Some(t);
            }))
        });
        let e = joiner.join_region(ticket).unwrap_err().to_string();
        AFTER_HOLD.with(|h| *h.borrow_mut() = None);
        assert!(e.contains("is gone"), "{e}");
        // the free returns Ok (the hold went within its grace) or, on a
        // machine slow enough, an error saying the joiner frees it; either
        // way the failed join's leave left nothing allocated
        let freed = free.lock().unwrap().take().unwrap().join().unwrap();
        if let Err(e) = freed {
            assert!(
                e.to_string().contains("last process that joined it leaves"),
                "{e}"
            );
        }
        assert_eq!(owner.region_state(index).unwrap(), RegionState::Free);
        drop((owner, joiner));
        drop(path);
    }

    /// The device file of [`handles`], removed when the test ends, a failed
    /// one included.
    struct ScratchFile(std::path::PathBuf);

    impl Drop for ScratchFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// Three handles on one file device: an owner, a second process's
    /// handle, a joiner (each its own open file, as separate processes).
    fn handles(name: &str) -> (ScratchFile, [Arc<Pool>; 3]) {
        let path = std::path::Path::new("/dev/shm")
            .join(format!("kvtier-join-{name}-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let spec = DeviceSpec::file(&path, 8 << 20);
        let layout = LayerFirstLayout::new(64, 2, 16).unwrap();
        let open = || Pool::open(vec![spec.clone()], PoolOptions::default()).unwrap();
        let file = ScratchFile(path);
        let first = Pool::create_on(layout, vec![spec.clone()], PoolOptions::default()).unwrap();
        (file, [first, open(), open()])
    }

    #[test]
    fn an_epoch_never_names_a_later_allocation_even_before_its_epoch_moves() {
        let (path, [owner, other, joiner]) = handles("aba");
        let r = owner.alloc_region().unwrap();
        let told = owner.region_epoch(&r).unwrap();
        // The region freed by a reclaim (which leaves the epoch as it is) and
        // taken by another process, caught between its compare-and-swap and
        // its epoch's move: the control word is the new owner's, the epoch
        // the old one.
        let e = owner.region_entry(r.index());
        let theirs = other.mine(RegionState::Allocated).unwrap();
        owner.store(&e.control, theirs);
        let told = RegionTicket {
            epoch: told,
            ..owner.region_ticket(&r).unwrap()
        };
        let err = joiner.join_region(told).unwrap_err().to_string();
        assert!(err.contains("is gone"), "{err}");
        // and the same owner allocating it again after its own free
        owner.store(&e.control, owner.mine(RegionState::Allocated).unwrap());
        let again = owner.region_epoch(&r).unwrap();
        let index = r.index();
        owner.free_region(r).unwrap();
        let r2 = owner.alloc_region().unwrap();
        assert_eq!(r2.index(), index, "the first free region again");
        e.epoch.fetch_sub(1, Ordering::SeqCst); // before its epoch's move
        let err = joiner
            .join_region(RegionTicket {
                epoch: again,
                ..owner.region_ticket(&r2).unwrap()
            })
            .unwrap_err()
            .to_string();
        assert!(err.contains("is gone"), "{err}");
        e.epoch.fetch_add(1, Ordering::SeqCst);
        let j = joiner
            .join_region(owner.region_ticket(&r2).unwrap())
            .unwrap();
        assert_eq!(
            joiner.publish(&j).unwrap_err().to_string(),
            format!(
                "pool: region {} was joined here: only its owner publishes it",
                j.index()
            )
        );
        joiner.free_region(j).unwrap();
        owner.free_region(r2).unwrap();
        drop(path);
    }
}
