//! Counters: allocations, releases and guard violations (the I1/I2 alarm
//! metric, total and by [`GuardViolation::kind`]).

use kvmesh_counters::KindCounters;
use kvmesh_kernels::GuardViolation;

/// Every [`GuardViolation::kind`], in the order of
/// [`PoolStats::guard_violations_by_kind`].
pub const GUARD_VIOLATION_KINDS: [&str; 7] = [
    "page_out_of_range",
    "stale_generation",
    "foreign_page",
    "unwritten",
    "table_too_short",
    "poisoned",
    "layer_out_of_range",
];

/// Index of `v`'s kind in [`GUARD_VIOLATION_KINDS`]. An exhaustive match, so
/// a new kernel variant fails to compile here instead of going uncounted.
fn kind_index(v: &GuardViolation) -> usize {
    match v {
        GuardViolation::PageOutOfRange { .. } => 0,
        GuardViolation::StaleGeneration { .. } => 1,
        GuardViolation::ForeignPage { .. } => 2,
        GuardViolation::Unwritten { .. } => 3,
        GuardViolation::TableTooShort { .. } => 4,
        GuardViolation::Poisoned { .. } => 5,
        GuardViolation::LayerOutOfRange { .. } => 6,
    }
}

/// Guard-violation counters, lock-free so the read path never blocks.
#[derive(Debug, Default)]
pub(crate) struct ViolationCounters(KindCounters<{ GUARD_VIOLATION_KINDS.len() }>);

impl ViolationCounters {
    pub fn record(&self, v: &GuardViolation) {
        self.0.bump(kind_index(v));
    }

    pub fn total(&self) -> u64 {
        self.0.total()
    }

    pub fn by_kind(&self) -> [(&'static str, u64); GUARD_VIOLATION_KINDS.len()] {
        self.0.by_kind(&GUARD_VIOLATION_KINDS)
    }
}

/// A snapshot of a pool's counters. Each field is read atomically, the
/// snapshot as a whole is not: under concurrent use the fields may be from
/// slightly different moments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolStats {
    /// Pages in the pool.
    pub capacity_pages: usize,
    /// Pages on the free list.
    pub free_pages: usize,
    /// The prefix cache (its unleased pages are available too:
    /// [`crate::KvPool::available_pages`]).
    pub cache: crate::cache::CacheStats,
    /// Pages handed out since creation (by `reserve` and `grow`).
    pub allocations: u64,
    /// Pages returned since creation (an eviction counts as one).
    /// `allocations - releases` is the number of pages held by
    /// reservations or the cache, `capacity_pages - free_pages`.
    pub releases: u64,
    /// Guard violations returned by readers of this pool, all kinds.
    pub guard_violations: u64,
    /// The same, per [`GuardViolation::kind`], every kind listed (zeros
    /// included) in the order of [`GUARD_VIOLATION_KINDS`].
    pub guard_violations_by_kind: [(&'static str, u64); GUARD_VIOLATION_KINDS.len()],
}

impl PoolStats {
    /// Pages a reservation could get: free, plus cached pages no sequence
    /// leases (an allocation evicts those on demand). With no reservation
    /// open this is the whole pool, cache or not: what leak checks compare.
    pub fn available_pages(&self) -> usize {
        self.free_pages + self.cache.entries - self.cache.leased_pages
    }

    /// Violations of one kind (0 for a name that is not a kind).
    pub fn violations_of(&self, kind: &str) -> u64 {
        self.guard_violations_by_kind
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |(_, n)| *n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_table_matches_the_kernel_names() {
        let all = [
            GuardViolation::PageOutOfRange {
                page: 0,
                n_pages: 0,
            },
            GuardViolation::StaleGeneration {
                page: 0,
                expected: 0,
                actual: 0,
            },
            GuardViolation::ForeignPage { page: 0 },
            GuardViolation::Unwritten {
                page: 0,
                layer: 0,
                requested: 0,
                watermark: 0,
            },
            GuardViolation::TableTooShort {
                position: 0,
                needed: 0,
                len: 0,
            },
            GuardViolation::Poisoned { page: 0, layer: 0 },
            GuardViolation::LayerOutOfRange {
                layer: 0,
                n_layers: 0,
            },
        ];
        let c = ViolationCounters::default();
        for v in &all {
            assert_eq!(GUARD_VIOLATION_KINDS[kind_index(v)], v.kind());
            c.record(v);
        }
        assert_eq!(c.total(), 7);
        assert!(c.by_kind().iter().all(|&(_, n)| n == 1));
    }
}
