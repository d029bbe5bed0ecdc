//! The checked read path: [`SeqKv`], the pool's [`PagedKv`], through which
//! attention reads every page. This is where I1 and I2 are enforced.

use std::sync::atomic::Ordering;

use kvmesh_kernels::{GuardViolation, KvDtype, KvGeometry, PageRef, PageSlices, PagedKv};

use crate::pool::{Shared, POISON_BITS, POISON_BITS_F16};
use crate::reservation::OwnerTag;

/// Read access to the pool on behalf of one reservation, borrowed from it by
/// [`crate::Reservation::reader`]. It returns a page only if the page is
/// that reservation's; the borrow keeps the reservation from writing or
/// releasing the page while the returned slices live.
#[derive(Clone, Copy, Debug)]
pub struct SeqKv<'a> {
    shared: &'a Shared,
    owner: OwnerTag,
    /// (page, cache entry tag) of every cache page the reservation leases,
    /// sorted by page.
    leases: &'a [(u32, u64)],
}

impl<'a> SeqKv<'a> {
    pub(crate) fn new(shared: &'a Shared, owner: OwnerTag, leases: &'a [(u32, u64)]) -> Self {
        Self {
            shared,
            owner,
            leases,
        }
    }

    /// Whether `page`, owned by `owner`, is this reader's: its own, or a
    /// cache entry its reservation leases.
    fn admits(&self, page: u32, owner: u64) -> bool {
        owner == self.owner.get()
            || self
                .leases
                .binary_search_by_key(&page, |&(p, _)| p)
                .is_ok_and(|i| self.leases[i].1 == owner)
    }

    /// The owner every page read must belong to.
    pub fn owner(&self) -> OwnerTag {
        self.owner
    }

    /// The checks, in order, then the data. Touches no storage unless every
    /// metadata check passed.
    fn check(
        &self,
        entry: PageRef,
        layer: usize,
        n_slots: usize,
    ) -> Result<PageSlices<'a>, GuardViolation> {
        let shared = self.shared;
        let cfg = shared.cfg();
        if layer >= cfg.n_layers {
            return Err(GuardViolation::LayerOutOfRange {
                layer,
                n_layers: cfg.n_layers,
            });
        }
        let page = entry.page;
        let p = page as usize;
        let (Some(actual), Some(owner)) = (shared.generation(p), shared.owner(p)) else {
            // `validate` caps the pool at u32::MAX pages.
            let n_pages = u32::try_from(cfg.n_pages).unwrap_or(u32::MAX);
            return Err(GuardViolation::PageOutOfRange { page, n_pages });
        };
        // Measuring the checks' cost only (testing builds): keep range and
        // owner, which the read's safety needs; skip the rest.
        if kvmesh_faults::planted(kvmesh_faults::PlantedBug::NoKvChecks)
            && self.admits(page, owner)
            && n_slots <= cfg.page_size
        {
            // SAFETY: as below: range checked, the page is this reader's
            // (owner checked), `n_slots <= page_size`.
            return Ok(unsafe { shared.storage().read(p, layer, n_slots) });
        }
        if actual != entry.generation {
            return Err(GuardViolation::StaleGeneration {
                page,
                expected: entry.generation,
                actual,
            });
        }
        if !self.admits(page, owner) {
            return Err(GuardViolation::ForeignPage { page });
        }
        let watermark = shared
            .watermark(p, layer)
            .map_or(0, |w| w.load(Ordering::Acquire));
        if n_slots > watermark {
            return Err(GuardViolation::Unwritten {
                page,
                layer,
                requested: n_slots,
                watermark,
            });
        }
        // SAFETY: `p` and `layer` are in range, `n_slots <= watermark <=
        // page_size`, and the page is owned by the reservation this reader
        // borrows (`'a`), which can neither write nor release it while the
        // borrow lasts; no other reservation can reach it (crate::pool); or
        // it is a cache page that reservation leases, which nobody writes
        // and which stays cached while the lease lasts (crate::cache).
        let slices = unsafe { shared.storage().read(p, layer, n_slots) };
        let canary = match cfg.dtype {
            KvDtype::F32 => POISON_BITS,
            KvDtype::F16 => u32::from(POISON_BITS_F16),
        };
        if cfg.poison && (slices.k.contains_bits(canary) || slices.v.contains_bits(canary)) {
            return Err(GuardViolation::Poisoned { page, layer });
        }
        Ok(slices)
    }
}

impl PagedKv for SeqKv<'_> {
    fn geometry(&self) -> KvGeometry {
        self.shared.cfg().geometry()
    }

    /// Checks, in this order: layer in range, page in range, generation
    /// equal to `entry.generation`, owner equal to this reader's (or the
    /// tag of a cache entry its reservation leases), `n_slots`
    /// within the (page, layer) watermark; in poison mode, no canary in the
    /// slots. Every violation is counted in the pool's stats before it is
    /// returned. Cost: four atomic loads; plus an O(n_slots * kv_dim) scan
    /// in poison mode.
    fn read_page(
        &self,
        entry: PageRef,
        layer: usize,
        n_slots: usize,
    ) -> Result<PageSlices<'_>, GuardViolation> {
        self.check(entry, layer, n_slots)
            .inspect_err(|v| self.shared.violations.record(v))
    }

    fn report(&self, violation: &GuardViolation) {
        self.shared.violations.record(violation);
    }
}
