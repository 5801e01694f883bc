//! What the pool can say about itself: geometry, devices, regions and
//! owners, and the consistency check.

use super::metadata::{ClientControl, ClientState, RegionControl};
use super::*;

impl Pool {
    /// The layout of every region.
    pub fn layout(&self) -> LayerFirstLayout {
        self.layout
    }

    /// Regions in the pool.
    pub fn num_regions(&self) -> u32 {
        self.num_regions
    }

    /// Regions not allocated (in every partition).
    pub fn free_regions(&self) -> u32 {
        (0..self.num_regions)
            .filter(|&r| {
                self.region_control(r)
                    .is_some_and(|c| c.state == RegionState::Free)
            })
            .count() as u32
    }

    /// Bytes between consecutive region bases.
    pub fn region_stride(&self) -> u64 {
        self.region_stride
    }

    /// The pool's id (random, set at creation).
    pub fn uuid(&self) -> [u8; 16] {
        self.uuid
    }

    /// Bytes of this process's mappings of the devices that 2 MiB (or
    /// larger) pages back (/proc/self/smaps): every touched byte of a
    /// hugetlbfs file, the transparent huge pages of anonymous and NUMA
    /// memory ([`HostPages`]). Untouched memory counts as none.
    pub fn huge_page_bytes(&self) -> Result<u64> {
        self.devices.iter().map(|d| d.map.huge_page_bytes()).sum()
    }

    /// The devices, in pool order.
    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.devices
            .iter()
            .map(|d| DeviceInfo {
                spec: d.map.spec().to_string(),
                bytes: d.bytes,
                regions: d.num_regions,
                free: (d.first_region..d.first_region + d.num_regions)
                    .filter(|&r| {
                        self.region_control(r)
                            .is_some_and(|c| c.state == RegionState::Free)
                    })
                    .count() as u32,
            })
            .collect()
    }

    /// Where device `device`'s pages are: up to `samples` pages spread over
    /// its mapping, asked of the kernel (`move_pages` without moving). Pages
    /// never touched are counted as not present. Read after registering with
    /// a GPU, this says whether the registration moved them (a `numa:`
    /// device on movable memory: see [`Pool::placement_problem`]).
    pub fn residency(&self, device: u32, samples: u32) -> Result<Residency> {
        let d = self
            .devices
            .get(device as usize)
            .ok_or_else(|| invalid("device", format!("{device} of {}", self.devices.len())))?;
        let page = 4096usize;
        let pages = d.map.len() / page;
        let n = (samples as usize).clamp(1, pages.max(1));
        let mut addrs: Vec<*mut libc::c_void> = (0..n)
            // SAFETY: each offset is inside the mapping.
            .map(|i| unsafe { d.map.ptr().add(i * pages / n * page) } as *mut libc::c_void)
            .collect();
        let mut status = vec![0i32; n];
        // SAFETY: move_pages with a null node list only reports each page's
        // node into `status`; both arrays hold `n` entries.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_move_pages,
                0,
                n as libc::c_ulong,
                addrs.as_mut_ptr(),
                std::ptr::null::<i32>(),
                status.as_mut_ptr(),
                0,
            )
        };
        if rc != 0 {
            return Err(Error::Io {
                context: format!(
                    "asking where the pages of {} are (move_pages)",
                    d.map.spec()
                ),
                source: std::io::Error::last_os_error(),
            });
        }
        let mut r = Residency {
            sampled: n as u32,
            ..Residency::default()
        };
        for s in status {
            if s >= 0 {
                match r.by_node.iter_mut().find(|(node, _)| *node == s as u32) {
                    Some((_, count)) => *count += 1,
                    None => r.by_node.push((s as u32, 1)),
                }
            } else {
                r.not_present += 1;
            }
        }
        r.by_node.sort();
        Ok(r)
    }

    /// For a `numa:` device, whether the sampled pages that are present sit
    /// on other nodes than the device names (a registration migrated them
    /// off movable memory), said as the problem; None when they are where
    /// they belong, or for other devices.
    pub fn placement_problem(&self, device: u32) -> Result<Option<String>> {
        let r = self.residency(device, 256)?;
        self.placement_problem_of(device, &r)
    }

    /// [`Pool::placement_problem`] from a sample already taken with
    /// [`Pool::residency`] (a report that prints the sample too asks the
    /// kernel once).
    pub fn placement_problem_of(&self, device: u32, r: &Residency) -> Result<Option<String>> {
        let d = self
            .devices
            .get(device as usize)
            .ok_or_else(|| invalid("device", format!("{device} of {}", self.devices.len())))?;
        let DeviceSpec::Numa { nodes, .. } = d.map.spec() else {
            return Ok(None);
        };
        let elsewhere: u32 = r
            .by_node
            .iter()
            .filter(|(n, _)| !nodes.contains(n))
            .map(|(_, c)| c)
            .sum();
        Ok((elsewhere > 0).then(|| {
            format!(
                "{}: {elsewhere} of {} sampled pages are not on the device's node(s) ({}); the memory is \
                 likely onlined as movable, and registering it with a GPU migrated them",
                d.map.spec(),
                r.sampled - r.not_present,
                r.describe()
            )
        }))
    }

    /// Every region's state and owner.
    pub fn regions(&self) -> Vec<RegionInfo> {
        (0..self.num_regions)
            .filter_map(|r| {
                let c = self.region_control(r)?;
                let owner = (c.state != RegionState::Free).then(|| self.owner_info(c));
                Some(RegionInfo {
                    index: r,
                    device: self.device_of(r) as u32,
                    state: c.state,
                    owner,
                    request: self.load(&self.region_entry(r).request),
                    joined: c.state != RegionState::Free && self.held_by_joiner(r),
                })
            })
            .collect()
    }

    pub(super) fn owner_info(&self, c: RegionControl) -> OwnerInfo {
        if c.client as u32 >= self.num_clients {
            return OwnerInfo {
                client: c.client,
                pid: 0,
                liveness: Liveness::Dead,
            };
        }
        let slot = ClientControl::decode(self.load(&self.client_entry(c.client as u32).control));
        let (id, _) = self.client_identity(c.client as u32);
        let liveness = match slot {
            Some(s)
                if s.generation == c.generation
                    && matches!(s.state, ClientState::Live | ClientState::Claiming) =>
            {
                self.client_liveness(c.client as u32)
                    .unwrap_or(Liveness::Unknown)
            }
            _ => Liveness::Dead,
        };
        OwnerInfo {
            client: c.client,
            pid: id.pid,
            liveness,
        }
    }

    /// The clients attached to the pool (claiming or live).
    pub fn clients_info(&self) -> Vec<ClientInfo> {
        (0..self.num_clients)
            .filter_map(|i| {
                let c = ClientControl::decode(self.load(&self.client_entry(i).control))?;
                (c.state != ClientState::Free).then(|| ClientInfo {
                    slot: i as u16,
                    generation: c.generation,
                    pid: self.client_identity(i).0.pid,
                    uid: self.client_uid(i),
                    liveness: self.client_liveness(i).unwrap_or(Liveness::Unknown),
                })
            })
            .collect()
    }

    /// Verifies the region and client tables: every word decodes and names a
    /// client slot that exists; lists dead clients and reclaimable regions.
    pub fn check(&self) -> CheckReport {
        let mut report = CheckReport::default();
        for i in 0..self.num_clients {
            match ClientControl::decode(self.load(&self.client_entry(i).control)) {
                None => report
                    .problems
                    .push(format!("client slot {i} holds an unknown state")),
                Some(c)
                    if c.state != ClientState::Free
                        && self.client_liveness(i).unwrap_or(Liveness::Unknown)
                            == Liveness::Dead =>
                {
                    report
                        .dead_clients
                        .push((i as u16, self.client_identity(i).0.pid));
                }
                _ => {}
            }
        }
        for r in 0..self.num_regions {
            match self.region_control(r) {
                None => report
                    .problems
                    .push(format!("region {r} holds an unknown state")),
                Some(c) if c.state != RegionState::Free => {
                    if c.client as u32 >= self.num_clients {
                        report.problems.push(format!(
                            "region {r} names client slot {}, which does not exist",
                            c.client
                        ));
                    } else if self.owner_info(c).liveness == Liveness::Dead
                        && !self.held_by_joiner(r)
                    {
                        report.reclaimable_regions += 1;
                    }
                }
                _ => {}
            }
        }
        report
    }
}
