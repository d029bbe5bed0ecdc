//! A reservation: the pages one sequence holds, its page table, and the
//! write path that advances the written-slot watermarks (I2).

use std::num::NonZeroU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvmesh_kernels::{GuardViolation, KvValues, PageRef};

use crate::cache::{Lease, Namespace, PageKey};
use crate::error::PoolError;
use crate::pool::Shared;
use crate::reader::SeqKv;

/// Who holds a page: minted by the pool from a monotonic counter, one per
/// reservation, never reused, never 0 (0 marks a free page).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerTag(NonZeroU64);

impl OwnerTag {
    pub(crate) fn new(raw: NonZeroU64) -> Self {
        Self(raw)
    }

    /// The raw tag, as stored in page metadata.
    pub fn get(self) -> u64 {
        self.0.get()
    }
}

/// Pages held by one sequence. Not `Clone`: there is exactly one holder.
/// Dropping it releases every page through the pool's one release path
/// (new generation, owner cleared, watermarks reset, scrub or poison), so
/// a reservation ends exactly once (I7).
#[derive(Debug)]
pub struct Reservation {
    shared: Arc<Shared>,
    owner: OwnerTag,
    /// Leased cache pages first (`leases.len()` of them), then the pages
    /// this reservation owns.
    table: Vec<PageRef>,
    /// The cache entries it reads the first pages through, sorted by page
    /// id for the reader's lookup.
    leases: Vec<Lease>,
    /// By page id: the leases in `leases`' order, for the reader.
    by_page: Vec<(u32, u64)>,
    /// What its full pages are, for the cache, when it ends.
    cache_as: Option<(Namespace, Vec<PageKey>)>,
    /// `testing` only: the page table readers see instead of `table`
    /// (writes and release always use the genuine one).
    #[cfg(feature = "testing")]
    forged: Option<Vec<PageRef>>,
}

impl Reservation {
    pub(crate) fn new(shared: Arc<Shared>, owner: OwnerTag, table: Vec<PageRef>) -> Self {
        Self::with_leases(shared, owner, table, Vec::new())
    }

    /// `table` starts with the pages of `leases`, in order.
    pub(crate) fn with_leases(
        shared: Arc<Shared>,
        owner: OwnerTag,
        table: Vec<PageRef>,
        leases: Vec<Lease>,
    ) -> Self {
        let mut by_page: Vec<(u32, u64)> = leases.iter().map(|l| (l.page, l.tag)).collect();
        by_page.sort_unstable();
        Self {
            shared,
            owner,
            table,
            leases,
            by_page,
            cache_as: None,
            #[cfg(feature = "testing")]
            forged: None,
        }
    }

    /// Tokens at the head of the table that come from the prefix cache
    /// (leased, read-only): `page_size` per leased page.
    pub fn cached_tokens(&self) -> usize {
        self.leases.len() * self.shared.cfg().page_size
    }

    /// Names this reservation's full pages for the prefix cache: `keys[i]`
    /// is the key of logical page `i` (its tokens, in `ns`). When the
    /// reservation ends, its pages that are full at every layer, from the
    /// first after its leases, enter the cache under these keys (while the
    /// cache has room and lacks them); the rest are released as always.
    /// Call it again to name more pages (a sequence that grew).
    pub fn cache_as(&mut self, ns: Namespace, keys: Vec<PageKey>) {
        self.cache_as = Some((ns, keys));
    }

    /// Shares this reservation's full pages with other reservations now,
    /// not when it ends: the pages named by [`Reservation::cache_as`] that
    /// are full at every layer, from the first after its leases, enter the
    /// prefix cache as entries this reservation leases (read-only from now
    /// on, like a cached head; [`Reservation::cached_tokens`] grows by
    /// `page_size` per page), while the cache has room and lacks their
    /// keys. What a forked sequence uses: the samples of one prompt lease
    /// the pages the first one received. Returns the pages shared.
    ///
    /// Cost: one lock of the pool, two atomic updates per page.
    pub fn share(&mut self) -> usize {
        let Some((ns, keys)) = &self.cache_as else {
            return 0;
        };
        let added = self
            .shared
            .share(self.owner, &mut self.table, self.leases.len(), *ns, keys);
        let n = added.len();
        self.by_page.extend(added.iter().map(|l| (l.page, l.tag)));
        self.by_page.sort_unstable();
        self.leases.extend(added);
        n
    }

    /// This reservation's owner tag.
    pub fn owner(&self) -> OwnerTag {
        self.owner
    }

    /// The page table: entry `i` covers positions `i * page_size ..
    /// (i + 1) * page_size`.
    pub fn table(&self) -> &[PageRef] {
        #[cfg(feature = "testing")]
        if let Some(forged) = &self.forged {
            return forged;
        }
        &self.table
    }

    /// `testing` only: make [`Reservation::table`] return `entries` (a
    /// forged page table, as a bug elsewhere might produce) so a test can
    /// show that the read path refuses it. The pages actually held, which
    /// writes use and drop releases, do not change.
    #[cfg(feature = "testing")]
    pub fn forge_table(&mut self, entries: Vec<PageRef>) {
        self.forged = Some(entries);
    }

    /// Injected fault (`step:N=corrupt`, see `kvmesh_faults`): from now on
    /// this reservation's readers see a page table whose first entry carries
    /// a wrong generation, as a bug in page-table handling might produce;
    /// the next attention read must refuse it (I1). Writes and release keep
    /// using the pages actually held. Returns whether it was applied (never
    /// outside testing builds).
    pub fn corrupt_page_table(&mut self) -> bool {
        #[cfg(feature = "testing")]
        {
            let mut table = self.table().to_vec();
            if let Some(first) = table.first_mut() {
                first.generation = first.generation.wrapping_add(1);
                self.forge_table(table);
                return true;
            }
        }
        false
    }

    /// The dtype of the pool's values.
    pub fn dtype(&self) -> kvmesh_kernels::KvDtype {
        self.shared.cfg().dtype
    }

    /// Tokens the pages cover: `table().len() * page_size`.
    pub fn capacity_tokens(&self) -> usize {
        self.table.len() * self.shared.cfg().page_size
    }

    /// Ensures room for `tokens` tokens, all or nothing: on
    /// [`PoolError::Exhausted`] the table is unchanged.
    pub fn grow(&mut self, tokens: usize) -> Result<(), PoolError> {
        let need = tokens
            .div_ceil(self.shared.cfg().page_size)
            .saturating_sub(self.table.len());
        if need == 0 {
            return Ok(());
        }
        let (_, pages) = self.shared.allocate(Some(self.owner), need)?;
        self.table.extend(pages);
        Ok(())
    }

    /// Writes K and V of the consecutive positions `start_pos..` at `layer`
    /// (`k.len() == v.len() == n * kv_dim`, slot-major; a latent pool
    /// stores keys only, and `v` must be empty), spanning pages as
    /// needed, and raises each touched page's watermark for `layer`.
    ///
    /// All checks come first; on error nothing was written. Refused: a
    /// layer out of range, lengths that are not whole tokens or differ, a
    /// position past [`Reservation::capacity_tokens`], and a start slot above
    /// its page's watermark (slots `0..watermark` of a page are written,
    /// contiguously; rewriting below the watermark is allowed, leaving a gap
    /// is not). Pages may be filled in any order: the watermark is per page,
    /// which suits transfers that land pages out of order.
    ///
    /// Cost: one copy of the data, O(pages touched) atomic updates.
    pub fn write(
        &mut self,
        layer: usize,
        start_pos: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), PoolError> {
        let cfg = self.shared.cfg();
        let (page_size, n_layers) = (cfg.page_size, cfg.n_layers);
        let kv_dim = cfg.geometry().kv_dim();
        if layer >= n_layers {
            return Err(PoolError::LayerOutOfRange { layer, n_layers });
        }
        if !k.len().is_multiple_of(kv_dim) {
            let expected = k.len().div_ceil(kv_dim).saturating_mul(kv_dim);
            return Err(PoolError::BadLength {
                field: "k",
                expected,
                got: k.len(),
            });
        }
        let v_len = if cfg.entry.blocks() == 2 { k.len() } else { 0 };
        if v.len() != v_len {
            return Err(PoolError::BadLength {
                field: "v",
                expected: v_len,
                got: v.len(),
            });
        }
        let n = k.len() / kv_dim;
        if n == 0 {
            return Ok(());
        }
        let capacity = self.capacity_tokens();
        let end = match start_pos.checked_add(n) {
            Some(end) if end <= capacity => end,
            _ => {
                return Err(PoolError::PositionOutOfRange {
                    position: start_pos.max(capacity),
                    capacity,
                })
            }
        };
        // The cached head is shared and immutable.
        let cached = self.cached_tokens();
        if start_pos < cached {
            return Err(PoolError::SharedPage {
                position: start_pos,
                cached,
            });
        }
        // Only the first page can start above slot 0; later pages start at
        // slot 0, which never leaves a gap.
        let first = self.table[start_pos / page_size].page;
        let slot = start_pos % page_size;
        let watermark = self.watermark_of(first, layer);
        if slot > watermark {
            return Err(PoolError::WriteGap {
                page: first,
                layer,
                slot,
                watermark,
            });
        }

        let mut pos = start_pos;
        while pos < end {
            let entry = self.table[pos / page_size];
            let slot = pos % page_size;
            let take = (page_size - slot).min(end - pos);
            let range = (pos - start_pos) * kv_dim..(pos - start_pos + take) * kv_dim;
            let page = entry.page as usize;
            debug_assert_eq!(self.shared.owner(page), Some(self.owner.get()));
            debug_assert_eq!(self.shared.generation(page), Some(entry.generation));
            // SAFETY: the page is on our table, so it is in range and owned by
            // us; `&mut self` rules out our own readers, and no other
            // reservation can read or write it (see `crate::pool`). The slot
            // range ends within the page: `slot + take <= page_size`.
            unsafe {
                self.shared.storage().write(
                    page,
                    layer,
                    slot,
                    KvValues::F32(&k[range.clone()]),
                    KvValues::F32(if v.is_empty() { &[] } else { &v[range] }),
                )
            };
            if let Some(w) = self.shared.watermark(page, layer) {
                w.fetch_max(slot + take, Ordering::AcqRel);
            }
            pos += take;
        }
        Ok(())
    }

    /// Tokens written at `layer`, counted contiguously from position 0 (0
    /// for a layer out of range).
    pub fn written_tokens(&self, layer: usize) -> usize {
        let page_size = self.shared.cfg().page_size;
        let mut total = 0;
        for e in &self.table {
            let w = self.watermark_of(e.page, layer);
            total += w;
            if w < page_size {
                break;
            }
        }
        total
    }

    /// I2 before a sequence is adopted: the first `tokens` positions must
    /// be written at every layer. The first hole is counted as a guard
    /// violation (kind `unwritten`) and returned; nothing was read.
    pub fn require_written(&self, tokens: usize) -> Result<(), GuardViolation> {
        let page_size = self.shared.cfg().page_size;
        for layer in 0..self.shared.cfg().n_layers {
            for (i, e) in self.table.iter().enumerate() {
                let before = i * page_size;
                if before >= tokens {
                    break;
                }
                let requested = (tokens - before).min(page_size);
                let watermark = self.watermark_of(e.page, layer);
                if watermark < requested {
                    let v = GuardViolation::Unwritten {
                        page: e.page,
                        layer,
                        requested,
                        watermark,
                    };
                    self.shared.violations.record(&v);
                    return Err(v);
                }
            }
        }
        Ok(())
    }

    /// The checked reader for this reservation: every page it returns has
    /// passed the I1 and I2 checks against this reservation's owner.
    pub fn reader(&self) -> SeqKv<'_> {
        SeqKv::new(&self.shared, self.owner, &self.by_page)
    }

    fn watermark_of(&self, page: u32, layer: usize) -> usize {
        self.shared
            .watermark(page as usize, layer)
            .map_or(0, |w| w.load(Ordering::Acquire))
    }

    /// The pool this reservation's pages belong to.
    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }

    /// The pages this reservation owns (never a forged table, never its
    /// leased cache pages): what a grant lists, what transfers land in and
    /// what release frees. Logical page `i` of `held()` covers positions
    /// from `cached_tokens() + i * page_size`.
    pub fn held(&self) -> &[PageRef] {
        &self.table[self.leases.len()..]
    }

    /// Sets a page's watermark without writing: a simulated watermark bug.
    #[cfg(test)]
    pub(crate) fn force_watermark(&self, logical_page: usize, layer: usize, slots: usize) {
        if let Some(e) = self.table.get(logical_page) {
            self.shared.set_watermark(e.page as usize, layer, slots);
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut table = std::mem::take(&mut self.table);
        let leases = std::mem::take(&mut self.leases);
        if leases.is_empty() && self.cache_as.is_none() {
            self.shared.release(self.owner, &table);
        } else {
            self.shared
                .finish(self.owner, &mut table, &leases, self.cache_as.take());
        }
    }
}
