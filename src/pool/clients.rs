//! The tables and the clients: table entries read and changed with
//! compare-and-swap, who is alive (liveness locks, pid identities), claiming
//! a client slot, and reclaiming what dead clients held.

use std::sync::atomic::{AtomicU64, Ordering};

use super::metadata::{
    ClientControl, ClientEntry, ClientState, OBSERVE, RegionControl, RegionEntry,
};
use super::*;

impl Pool {
    pub(super) fn region_entry(&self, i: u32) -> &RegionEntry {
        debug_assert!(i < self.num_regions);
        // SAFETY: the table holds num_regions entries for the pool's lifetime.
        unsafe { &*self.regions.add(i as usize) }
    }

    pub(super) fn client_entry(&self, i: u32) -> &ClientEntry {
        debug_assert!(i < self.num_clients);
        // SAFETY: the table holds num_clients entries for the pool's lifetime.
        unsafe { &*self.clients.add(i as usize) }
    }

    pub(super) fn load(&self, w: &AtomicU64) -> u64 {
        self.coherence
            .before_read(w as *const AtomicU64 as *const u8, 64);
        w.load(OBSERVE)
    }

    pub(super) fn cas(&self, w: &AtomicU64, current: u64, new: u64, order: Ordering) -> bool {
        let ok = w
            .compare_exchange(current, new, order, Ordering::Acquire)
            .is_ok();
        self.coherence
            .after_write(w as *const AtomicU64 as *const u8, 64);
        ok
    }

    pub(super) fn store(&self, w: &AtomicU64, v: u64) {
        w.store(v, Ordering::Release);
        self.coherence
            .after_write(w as *const AtomicU64 as *const u8, 64);
    }

    pub(super) fn region_control(&self, i: u32) -> Option<RegionControl> {
        RegionControl::decode(self.load(&self.region_entry(i).control))
    }

    /// The user client `i`'s process runs as, where its entry records one.
    pub(super) fn client_uid(&self, i: u32) -> Option<u32> {
        let recorded = (self.load(&self.client_entry(i).pid) >> 32) as u32;
        recorded.checked_sub(1)
    }

    pub(super) fn client_identity(&self, i: u32) -> (ProcessIdentity, u32) {
        let c = self.client_entry(i);
        let pid = self.load(&c.pid) as u32;
        let id = ProcessIdentity {
            pid,
            start_ticks: self.load(&c.start_ticks),
            boot_id: (self.load(&c.boot_hi) as u128) << 64 | self.load(&c.boot_lo) as u128,
        };
        (id, self.load(&c.host) as u32)
    }

    /// Whether client `i`'s process lives, judged without trusting pid
    /// numbers across PID namespaces: its liveness lock held means alive; a
    /// free lock on the very file it locked means dead; otherwise its pid
    /// decides only when it was recorded in this PID namespace, and a holder
    /// that cannot be judged is Unknown (never reclaimed).
    pub(super) fn client_liveness(&self, i: u32) -> Result<Liveness> {
        if self.me.map(|(c, _)| c as u32) == Some(i) {
            return Ok(Liveness::Alive); // this process (its own lock does not show to itself)
        }
        let single_host = self.coherence == Coherence::Coherent;
        let lock = self.lock.as_ref();
        if lock.and_then(|l| l.held_by_another(i)) == Some(true) {
            return Ok(Liveness::Alive);
        }
        let (id, _) = self.client_identity(i);
        if id.pid == 0 {
            return Ok(Liveness::Dead); // claimed, identity never written, no lock held
        }
        if id.boot_id != identity::boot_id()? {
            return id.liveness(single_host); // another boot (or host)
        }
        let e = self.client_entry(i);
        if let Some(l) = lock
            && self.load(&e.lock_id) == l.id()
            && l.held_by_another(i) == Some(false)
        {
            return Ok(Liveness::Dead);
        }
        if self.load(&e.pid_ns) != identity::pid_namespace() {
            return Ok(Liveness::Unknown);
        }
        id.liveness(single_host)
    }

    /// Takes a free client slot of this host and records this process in it.
    pub(super) fn claim_client(&self) -> Result<(u16, u32)> {
        let me = ProcessIdentity::current()?;
        for attempt in 0..2 {
            for i in (0..self.num_clients).filter(|&i| self.coherence.owns(i)) {
                let e = self.client_entry(i);
                let w = self.load(&e.control);
                let Some(c) = ClientControl::decode(w) else {
                    continue;
                };
                if c.state != ClientState::Free {
                    continue;
                }
                let generation = c.generation.wrapping_add(1);
                let claiming = ClientControl {
                    state: ClientState::Claiming,
                    generation,
                }
                .encode();
                if !self.cas(&e.control, w, claiming, Ordering::AcqRel) {
                    continue;
                }
                if let Some(l) = &self.lock
                    && !l.take(i)?
                {
                    // a live process still holds the slot's lock: leave it
                    self.cas(&e.control, claiming, w, Ordering::AcqRel);
                    continue;
                }
                self.store(&e.pid_ns, identity::pid_namespace());
                self.store(&e.lock_id, self.lock.as_ref().map_or(0, |l| l.id()));
                self.store(&e.pid, 0);
                self.store(&e.start_ticks, me.start_ticks);
                self.store(&e.boot_lo, me.boot_id as u64);
                self.store(&e.boot_hi, (me.boot_id >> 64) as u64);
                self.store(
                    &e.host,
                    match self.coherence {
                        Coherence::Coherent => 0,
                        Coherence::NonCoherent { host, .. } => host as u64,
                    },
                );
                // last: a pid marks the identity complete; the user above it
                // (plus one: 0 is "not recorded", as older clients leave it)
                // names whose files this client's are (`Pool::client_uid`)
                let uid = identity::effective_uid().wrapping_add(1) as u64;
                self.store(&e.pid, me.pid as u64 | uid << 32);
                let live = ClientControl {
                    state: ClientState::Live,
                    generation,
                }
                .encode();
                #[cfg(test)]
                tests::before_live(self, i);
                if self.cas(&e.control, claiming, live, Ordering::AcqRel) {
                    return Ok((i as u16, generation));
                }
                // a reclaimer judged the half-claimed slot dead: give its
                // lock back (holding it would keep the slot from every
                // claimer while this process lives) and take another
                if let Some(l) = &self.lock {
                    l.release(i);
                }
            }
            if attempt == 0 {
                self.reclaim_dead()?;
            }
        }
        Err(Error::Pool(format!(
            "all {} client slots are taken by live processes",
            self.num_clients
        )))
    }

    /// Frees the regions of clients whose process died (or whose slot has
    /// been freed or reused since), and those client slots. Only this host's
    /// partition is touched. Concurrent reclaimers are harmless: every change
    /// is a compare-and-swap from the dead owner's exact word.
    pub fn reclaim_dead(&self) -> Result<Reclaimed> {
        let mut out = Reclaimed::default();
        for i in (0..self.num_clients).filter(|&i| self.coherence.owns(i)) {
            if self.me.map(|(c, _)| c as u32) == Some(i) {
                continue;
            }
            let e = self.client_entry(i);
            let w = self.load(&e.control);
            let Some(c) = ClientControl::decode(w) else {
                continue;
            };
            let reclaiming = ClientControl {
                state: ClientState::Reclaiming,
                generation: c.generation,
            }
            .encode();
            let take = match c.state {
                ClientState::Free => false,
                ClientState::Reclaiming => true, // a reclaimer died or is at work: (re)do it
                ClientState::Live | ClientState::Claiming => {
                    // a holder that cannot be judged stays
                    self.client_liveness(i).unwrap_or(Liveness::Unknown) == Liveness::Dead
                        && self.cas(&e.control, w, reclaiming, Ordering::AcqRel)
                }
            };
            if take {
                out.regions += self.free_regions_of(i as u16, c.generation, false);
                let free = ClientControl {
                    state: ClientState::Free,
                    generation: c.generation,
                }
                .encode();
                if self.cas(&e.control, reclaiming, free, Ordering::AcqRel) {
                    out.clients += 1;
                }
            }
        }
        out.regions += self.free_orphans();
        Ok(out)
    }

    /// Frees every region of this partition owned by (client, generation)
    /// that no joiner holds; `by_owner`: this process is that client (its
    /// clean exit), not a reclaimer of a dead one.
    pub(super) fn free_regions_of(&self, client: u16, generation: u32, by_owner: bool) -> u32 {
        let mut n = 0;
        for r in (0..self.num_regions).filter(|&r| self.coherence.owns(r)) {
            let w = self.load(&self.region_entry(r).control);
            if let Some(c) = RegionControl::decode(w)
                && c.state != RegionState::Free
                && c.client == client
                && c.generation == generation
                && self.free_unjoined(r, w, by_owner)
            {
                n += 1;
            }
        }
        n
    }

    /// Frees region `r` from control word `w` unless a joiner holds it.
    ///
    /// A join checks the region after taking its hold; a reclaimer checks
    /// the holds after judging the owner dead, and a join succeeds only
    /// while the owner lives, so one of the two sees the other. The owner
    /// freeing its own region (`by_owner`) has no such order: it moves the
    /// region's epoch first, so that a join that checked the region before
    /// the move had taken its hold before it too (and is seen here), and one
    /// that checks after sees another epoch and fails.
    pub(super) fn free_unjoined(&self, r: u32, w: u64, by_owner: bool) -> bool {
        let e = self.region_entry(r);
        if by_owner {
            e.epoch.fetch_add(1, Ordering::SeqCst);
            self.coherence
                .after_write(&e.epoch as *const AtomicU64 as *const u8, 8);
        }
        !self.held_by_joiner(r)
            && self.cas(
                &e.control,
                w,
                RegionControl::FREE.encode(),
                Ordering::AcqRel,
            )
    }

    /// Frees regions whose owning slot is free or was claimed again since.
    pub(super) fn free_orphans(&self) -> u32 {
        let mut n = 0;
        for r in (0..self.num_regions).filter(|&r| self.coherence.owns(r)) {
            let e = self.region_entry(r);
            let w = self.load(&e.control);
            let Some(c) = RegionControl::decode(w) else {
                continue;
            };
            if c.state == RegionState::Free || c.client as u32 >= self.num_clients {
                continue;
            }
            let owner =
                ClientControl::decode(self.load(&self.client_entry(c.client as u32).control));
            let orphan = match owner {
                Some(o) => o.generation != c.generation || o.state == ClientState::Free,
                None => false,
            };
            // or one whose owner asked to free it while a joiner held it, the
            // joiner since gone without leaving (it died)
            let freeing = self.load(&e.freeing);
            let wished = freeing != 0 && self.ticket(r) == Some(freeing);
            if (orphan || wished) && self.free_unjoined(r, w, false) {
                n += 1;
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    /// What a test makes happen between a claim's lock and its last
    /// compare-and-swap (a reclaimer at work, say).
    type Hook = Box<dyn Fn(&Pool, u32)>;

    thread_local! {
        static BEFORE_LIVE: RefCell<Option<Hook>> = const { RefCell::new(None) };
    }

    pub(super) fn before_live(pool: &Pool, slot: u32) {
        BEFORE_LIVE.with(|h| {
            if let Some(f) = h.borrow().as_ref() {
                f(pool, slot)
            }
        });
    }

    #[test]
    fn a_claim_that_loses_its_slot_to_a_reclaimer_gives_the_slots_lock_back() {
        let dir = std::env::temp_dir().join(format!("kvtier-halfclaim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let devices = vec![DeviceSpec::file(dir.join("dev0"), 4 << 20)];
        let layout = LayerFirstLayout::new(64, 2, 16).unwrap();
        drop(Pool::create_on(layout, devices.clone(), PoolOptions::default()).unwrap());
        // the first slot a claim tries is taken from under it, as a
        // reclaimer that judged it dead would (Claiming -> Reclaiming)
        BEFORE_LIVE.with(|h| {
            *h.borrow_mut() = Some(Box::new(|pool: &Pool, slot: u32| {
                let e = pool.client_entry(slot);
                let w = pool.load(&e.control);
                let c = ClientControl::decode(w).unwrap();
                if c.state == ClientState::Claiming && slot == 0 {
                    let reclaiming = ClientControl {
                        state: ClientState::Reclaiming,
                        generation: c.generation,
                    };
                    assert!(pool.cas(&e.control, w, reclaiming.encode(), Ordering::AcqRel));
                }
            }))
        });
        let pool = Pool::open(devices.clone(), PoolOptions::default()).unwrap();
        BEFORE_LIVE.with(|h| *h.borrow_mut() = None);
        assert_eq!(pool.me.map(|m| m.0), Some(1), "it took the next slot");
        // seen from another open file: slot 1's lock is held, slot 0's not
        let other = identity::ClientLock::new(pool.devices[0].map.file().unwrap()).unwrap();
        let probe = std::fs::File::open(dir.join("dev0")).unwrap();
        let probe = identity::ClientLock::new(&probe).unwrap();
        drop(other);
        assert_eq!(probe.held_by_another(1), Some(true));
        assert_eq!(
            probe.held_by_another(0),
            Some(false),
            "the lost slot's lock was kept"
        );
        drop(pool);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
