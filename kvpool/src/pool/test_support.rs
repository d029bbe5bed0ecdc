//! Test-only access to the pool's internals: page metadata, raw storage,
//! the owner-tag counter and a simulated watermark bug.

use std::sync::atomic::Ordering;

use super::Shared;

impl Shared {
    /// (generation, owner) of `page`, for tests.
    pub(crate) fn page_state(&self, page: usize) -> (u64, u64) {
        (
            self.generation(page).unwrap_or(u64::MAX),
            self.owner(page).unwrap_or(u64::MAX),
        )
    }

    /// Moves the owner-tag counter, to test its exhaustion.
    pub(crate) fn set_next_owner(&self, next: u64) {
        self.lock().next_owner = next;
    }

    /// A copy of a whole page's storage as f32 (an f16 pool's widened),
    /// for the scrub and poison tests. Tests call it only while no write
    /// runs.
    pub(crate) fn page_copy(&self, page: usize) -> Vec<f32> {
        assert!(page < self.cfg.n_pages);
        let mut out = Vec::new();
        // SAFETY: in range; single-threaded tests, no write in flight.
        unsafe { self.storage.page(page) }.extend_f32(&mut out);
        out
    }

    /// Sets the watermark of (`page`, `layer`) without writing anything: a
    /// simulated watermark bug, for the poison tests.
    pub(crate) fn set_watermark(&self, page: usize, layer: usize, slots: usize) {
        if let Some(w) = self.watermark(page, layer) {
            w.store(slots, Ordering::Release);
        }
    }
}
