//! kvmesh's counters by kind: lock-free event counts indexed by a fixed
//! list of kind labels, the one mechanism behind every "refused, by kind"
//! metric of the mesh: the guard-violation alarm (by
//! `kvmesh_kernels::GuardViolation::kind`, in `kvmesh-kvpool`), the KV
//! wire's reject counters (`kvmesh-kvwire`), the mesh-authentication
//! refusals (`kvmesh-meshauth`) and the reservation table's outcomes
//! (`kvmesh-kvxfer`).
//!
//! # Layout
//! One type, [`KindCounters`]. It is a crate of its own, with no
//! dependencies, because its users sit in layers that must not link each
//! other (the pool never links the wire, the wire never links the pool)
//! and none of them needs the compute kernels for it.
//!
//! # Invariants
//! Each owner holds the `[&str; N]` list of labels and maps its error
//! variants to indices with an exhaustive match, so a new variant fails to
//! compile instead of going uncounted. A count is one relaxed atomic add.

#![deny(missing_docs)]

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

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: [&str; 3] = ["a", "b", "c"];

    #[test]
    fn counts_by_index_and_by_label() {
        let c = KindCounters::<3>::default();
        c.bump(0);
        c.bump_label(&KINDS, "c");
        c.bump_label(&KINDS, "c");
        assert_eq!(c.total(), 3);
        assert_eq!((c.get(&KINDS, "a"), c.get(&KINDS, "c")), (1, 2));
        assert_eq!(c.get(&KINDS, "unlisted"), 0);
        assert_eq!(c.by_kind(&KINDS), [("a", 1), ("b", 0), ("c", 2)]);
    }
}
