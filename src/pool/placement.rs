//! Per-rank round-robin interleaving over a pool's memory devices.
//!
//! With `n` devices and `R` GPU ranks, rank `r` places its requests on devices
//! `r mod n`, `(r + R) mod n`, `(r + 2R) mod n`, ... so ranks running at the
//! same time read over different links. When that cycle covers only some
//! devices (gcd(R, n) > 1) and all of those are full, the other devices follow,
//! in order from `r`. A full device is skipped; when every device is full,
//! there is no placement.

/// The placement policy of one rank: a small state machine, no memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoundRobinPlacement {
    rank: u32,
    ranks: u32,
    devices: u32,
    /// Position in the rank's cycle of the next placement.
    cursor: u64,
}

impl RoundRobinPlacement {
    /// Rank `rank` of `ranks`, over `devices` devices (all at least 1).
    pub fn new(rank: u32, ranks: u32, devices: u32) -> Option<Self> {
        (ranks >= 1 && rank < ranks && devices >= 1).then_some(RoundRobinPlacement {
            rank,
            ranks,
            devices,
            cursor: 0,
        })
    }

    /// The devices this rank uses, in its round-robin order (each once).
    pub fn cycle(&self) -> Vec<u32> {
        let mut cycle = Vec::new();
        for i in 0..self.devices as u64 {
            let d = ((self.rank as u64 + i * self.ranks as u64) % self.devices as u64) as u32;
            if cycle.contains(&d) {
                break;
            }
            cycle.push(d);
        }
        cycle
    }

    /// The device for the next region: the next device of the rank's cycle
    /// with room, else the first device with room outside the cycle (from
    /// the rank's own onwards), else None. Advances the cycle past the device
    /// it returns from the cycle.
    pub fn next(&mut self, has_room: impl Fn(u32) -> bool) -> Option<u32> {
        let cycle = self.cycle();
        let len = cycle.len() as u64;
        for step in 0..len {
            let d = cycle[((self.cursor + step) % len) as usize];
            if has_room(d) {
                self.cursor = (self.cursor + step + 1) % len;
                return Some(d);
            }
        }
        (0..self.devices)
            .map(|i| (self.rank + i) % self.devices)
            .find(|d| !cycle.contains(d) && has_room(*d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(
        p: &mut RoundRobinPlacement,
        n: usize,
        room: impl Fn(u32) -> bool + Copy,
    ) -> Vec<Option<u32>> {
        (0..n).map(|_| p.next(room)).collect()
    }

    #[test]
    fn ranks_start_on_different_devices() {
        // 4 devices, 2 ranks: rank 0 alternates 0, 2; rank 1 alternates 1, 3
        let mut r0 = RoundRobinPlacement::new(0, 2, 4).unwrap();
        let mut r1 = RoundRobinPlacement::new(1, 2, 4).unwrap();
        assert_eq!(
            take(&mut r0, 4, |_| true),
            [Some(0), Some(2), Some(0), Some(2)]
        );
        assert_eq!(
            take(&mut r1, 4, |_| true),
            [Some(1), Some(3), Some(1), Some(3)]
        );
        // 4 devices, 4 ranks: each rank keeps its own device
        for r in 0..4 {
            let mut p = RoundRobinPlacement::new(r, 4, 4).unwrap();
            assert_eq!(take(&mut p, 3, |_| true), [Some(r); 3]);
        }
        // 3 devices, 2 ranks: gcd 1, every rank cycles through all devices
        let mut p = RoundRobinPlacement::new(1, 2, 3).unwrap();
        assert_eq!(p.cycle(), vec![1, 0, 2]);
        assert_eq!(
            take(&mut p, 4, |_| true),
            [Some(1), Some(0), Some(2), Some(1)]
        );
    }

    #[test]
    fn full_devices_are_skipped_then_others_used_then_none() {
        let mut p = RoundRobinPlacement::new(0, 2, 4).unwrap();
        assert_eq!(
            take(&mut p, 2, |d| d != 2),
            [Some(0), Some(0)],
            "device 2 full: stay on 0"
        );
        assert_eq!(
            p.next(|d| d == 1 || d == 3),
            Some(1),
            "own cycle full: other devices, from the rank's"
        );
        assert_eq!(p.next(|d| d == 3), Some(3));
        assert_eq!(p.next(|_| false), None, "pool full");
    }

    #[test]
    fn one_rank_one_device_and_bad_shapes() {
        let mut p = RoundRobinPlacement::new(0, 1, 1).unwrap();
        assert_eq!(take(&mut p, 2, |_| true), [Some(0), Some(0)]);
        assert!(RoundRobinPlacement::new(2, 2, 4).is_none());
        assert!(RoundRobinPlacement::new(0, 0, 4).is_none());
        assert!(RoundRobinPlacement::new(0, 1, 0).is_none());
    }
}
