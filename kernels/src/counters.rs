//! Lock-free counters indexed by a fixed list of kind labels: the one
//! mechanism behind every "refused, by kind" metric of the mesh: the
//! guard-violation alarm (by [`crate::GuardViolation::kind`], in
//! `kvmesh-kvpool`), the KV wire's reject counters (`kvmesh-kvwire`), the
//! mesh-authentication refusals (`kvmesh-meshauth`) and the reservation
//! table's outcomes (`kvmesh-kvxfer`). It lives here, at the bottom of the
//! graph, so those crates share one definition without depending on each
//! other. Each owner maps its error variants to indices with an exhaustive
//! match, so a new variant fails to compile instead of going uncounted.

use std::sync::atomic::{AtomicU64, Ordering};

/// `N` counters, one per label of a `[&str; N]` list held by the owner.
#[derive(Debug)]
pub struct KindCounters<const N: usize> {
    counts: [AtomicU64; N],
}

impl<const N: usize> Default for KindCounters<N> {
    fn default() -> Self {
        Self {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl<const N: usize> KindCounters<N> {
    /// Count one event of kind `index`.
    pub fn bump(&self, index: usize) {
        self.counts[index].fetch_add(1, Ordering::Relaxed);
    }

    /// Count one event of the kind named `kind`, one of `labels` (a name
    /// not in the list is a bug: caught in debug builds, ignored in
    /// release).
    pub fn bump_label(&self, labels: &[&'static str; N], kind: &str) {
        let i = labels.iter().position(|k| *k == kind);
        debug_assert!(i.is_some(), "unlisted counter label {kind}");
        if let Some(i) = i {
            self.bump(i);
        }
    }

    /// Events of all kinds.
    pub fn total(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// Events of the kind named `kind` (0 for a name not in `labels`).
    pub fn get(&self, labels: &[&'static str; N], kind: &str) -> u64 {
        labels
            .iter()
            .position(|k| *k == kind)
            .map_or(0, |i| self.counts[i].load(Ordering::Relaxed))
    }

    /// Every label with its count, zeros included. Each count is read
    /// atomically, the array as a whole is not.
    pub fn by_kind(&self, labels: &[&'static str; N]) -> [(&'static str, u64); N] {
        std::array::from_fn(|i| (labels[i], self.counts[i].load(Ordering::Relaxed)))
    }
}
