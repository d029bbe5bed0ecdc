//! The pool: page metadata, the free list, and the one allocation path and
//! the one release path every page goes through.
//!
//! Per page the pool keeps
//! - a generation: +1 on every allocation and every release, so a free page
//!   is even and an allocated one odd, and a page table entry from an earlier
//!   allocation never matches again (I1). A u64 cannot wrap in practice: a
//!   page reallocated every nanosecond lasts 292 years;
//! - an owner: 0 when free, else the [`OwnerTag`] of the one reservation
//!   holding it;
//! - per layer, a written-slot watermark: slots `0..watermark` were written
//!   for the owner (I2); reset to 0 on release.
//!
//! These are atomics so the read path needs no lock; the free list and the
//! allocation counters sit under a mutex taken once per reserve, grow or
//! release (never per token, never on the read path).
//!
//! # Why the unsafe storage access is sound
//! A page's storage is touched in three places only:
//! - allocation and release fill it (scrub, poison) while it is off the free
//!   list and owned by nobody, so only the allocating or releasing thread
//!   can reach it;
//! - [`crate::Reservation::write`] writes it through `&mut Reservation`,
//!   only for pages on that reservation's own table;
//! - [`crate::SeqKv`]'s `read_page` reads it only after checking that the
//!   page's owner is the reader's owner. A [`crate::SeqKv`] borrows its
//!   reservation, so while the slices live that reservation can neither
//!   write (no `&mut`) nor release (no drop), and no other reservation holds
//!   the page: owner tags are never reused.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::{fmt, num::NonZeroU64};

use kvmesh_kernels::PageRef;

use crate::config::{PoolConfig, ScrubMode};
use crate::error::PoolError;
use crate::reservation::{OwnerTag, Reservation};
use crate::stats::{PoolStats, ViolationCounters};
use crate::storage::{Fill, PoolMemory, Storage, StorageShape};

/// The debug poison canary: a quiet NaN with a payload no arithmetic
/// produces (hardware NaNs are 0x7FC00000 or 0xFFC00000). Compared by bits.
pub const POISON_BITS: u32 = 0x7FDE_ADED;

/// The canary of an f16 pool: a signalling NaN (quiet bit clear), which no
/// f32-to-f16 conversion produces (converted NaNs are quiet).
pub const POISON_BITS_F16: u16 = 0x7DAD;

/// A paged KV pool. Cloning is cheap and shares the pool.
#[derive(Clone, Debug)]
pub struct KvPool {
    shared: Arc<Shared>,
}

/// State shared by the pool handle, its reservations and their readers.
pub(crate) struct Shared {
    cfg: PoolConfig,
    storage: Storage,
    generation: Vec<AtomicU64>,
    owner: Vec<AtomicU64>,
    /// Indexed `page * n_layers + layer`.
    watermarks: Vec<AtomicUsize>,
    state: Mutex<FreeState>,
    pub(crate) violations: ViolationCounters,
}

struct FreeState {
    /// A stack: the page released last is allocated first. That keeps
    /// recently used memory warm and, on purpose, makes reuse of a just
    /// released page the common case, which is the case the generation
    /// check exists for (and the one the tests exercise).
    free: Vec<u32>,
    /// The next owner tag to mint; tags are never reused.
    next_owner: u64,
    allocations: u64,
    releases: u64,
}

impl FreeState {
    fn mint(&mut self) -> Result<OwnerTag, PoolError> {
        let tag = NonZeroU64::new(self.next_owner).ok_or(PoolError::OwnerTagsExhausted)?;
        // At u64::MAX the counter parks at 0, so every later mint fails.
        self.next_owner = self.next_owner.checked_add(1).unwrap_or(0);
        Ok(OwnerTag::new(tag))
    }
}

/// A vector of exactly `items`, `n` of them, or an error instead of an
/// abort if the allocator refuses.
fn try_vec<T>(n: usize, items: impl Iterator<Item = T>) -> Result<Vec<T>, PoolError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| PoolError::OutOfMemory {
        bytes: n.saturating_mul(std::mem::size_of::<T>()),
    })?;
    v.extend(items.take(n));
    Ok(v)
}

impl KvPool {
    /// Validates `cfg` and allocates the pool. Without poison the storage
    /// comes from a zeroed allocation (no up-front pass over it); with
    /// poison every page is filled with the canary first.
    pub fn new(cfg: PoolConfig) -> Result<Self, PoolError> {
        Self::build(cfg, None)
    }

    /// Like [`KvPool::new`], with the storage in memory the caller hands
    /// in (a shared-memory mapping that writer processes on this host write
    /// one-sided: `kvmesh_kvxfer::shm::shared_pool` makes one). `memory`
    /// must hold at least [`PoolConfig::bytes`].
    pub fn new_in(cfg: PoolConfig, memory: Arc<dyn PoolMemory>) -> Result<Self, PoolError> {
        Self::build(cfg, Some(memory))
    }

    fn build(cfg: PoolConfig, memory: Option<Arc<dyn PoolMemory>>) -> Result<Self, PoolError> {
        cfg.validate()?;
        let shape = StorageShape {
            n_pages: cfg.n_pages,
            n_layers: cfg.n_layers,
            page_size: cfg.page_size,
            kv_dim: cfg.geometry().kv_dim(),
            dtype: cfg.dtype,
        };
        let fill = if cfg.poison { Fill::Canary } else { Fill::Zero };
        let storage = match memory {
            None => Storage::try_new(shape, fill)?,
            Some(m) => Storage::try_new_in(shape, fill, m)?,
        };
        let n_pages = cfg.n_pages;
        let zeros = || std::iter::repeat_with(|| AtomicU64::new(0));
        let generation = try_vec(n_pages, zeros())?;
        let owner = try_vec(n_pages, zeros())?;
        let n_marks = n_pages * cfg.n_layers;
        let watermarks = try_vec(n_marks, std::iter::repeat_with(|| AtomicUsize::new(0)))?;
        // Reversed, so the first allocation gets pages 0, 1, 2, ...
        // `validate` bounds n_pages by u32::MAX, so every id converts.
        let free = try_vec(
            n_pages,
            (0..n_pages).rev().filter_map(|p| u32::try_from(p).ok()),
        )?;
        let state = Mutex::new(FreeState {
            free,
            next_owner: 1,
            allocations: 0,
            releases: 0,
        });
        let shared = Shared {
            cfg,
            storage,
            generation,
            owner,
            watermarks,
            state,
            violations: ViolationCounters::default(),
        };
        Ok(Self {
            shared: Arc::new(shared),
        })
    }

    /// The configuration the pool was built with.
    pub fn config(&self) -> &PoolConfig {
        &self.shared.cfg
    }

    /// Pages in the pool.
    pub fn capacity_pages(&self) -> usize {
        self.shared.cfg.n_pages
    }

    /// Tokens the pool holds when full: `n_pages * page_size`.
    pub fn capacity_tokens(&self) -> usize {
        self.shared.cfg.n_pages * self.shared.cfg.page_size
    }

    /// Pages on the free list now.
    pub fn free_pages(&self) -> usize {
        self.shared.lock().free.len()
    }

    /// Reserves pages for `tokens` tokens (`ceil(tokens / page_size)`
    /// pages; 0 tokens is an empty reservation that can `grow`). No partial
    /// grants: either every page or [`PoolError::Exhausted`] and nothing
    /// taken.
    pub fn reserve(&self, tokens: usize) -> Result<Reservation, PoolError> {
        let n = tokens.div_ceil(self.shared.cfg.page_size);
        let (owner, table) = self.shared.allocate(None, n)?;
        Ok(Reservation::new(Arc::clone(&self.shared), owner, table))
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PoolStats {
        let (free_pages, allocations, releases) = {
            let st = self.shared.lock();
            (st.free.len(), st.allocations, st.releases)
        };
        PoolStats {
            capacity_pages: self.capacity_pages(),
            free_pages,
            allocations,
            releases,
            guard_violations: self.shared.violations.total(),
            guard_violations_by_kind: self.shared.violations.by_kind(),
        }
    }

    /// Guard violations returned by readers of this pool so far.
    pub fn guard_violations(&self) -> u64 {
        self.shared.violations.total()
    }

    #[cfg(test)]
    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }
}

impl Shared {
    pub(crate) fn cfg(&self) -> &PoolConfig {
        &self.cfg
    }

    pub(crate) fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The lock never guards a half-done update (its sections only move
    /// page ids between vectors and add to counters, none of which can
    /// panic), so a poisoned lock is still consistent and is used as is.
    fn lock(&self) -> MutexGuard<'_, FreeState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Current generation of `page`, `None` if out of range.
    pub(crate) fn generation(&self, page: usize) -> Option<u64> {
        self.generation.get(page).map(|g| g.load(Ordering::Acquire))
    }

    /// Current owner of `page` (0: free), `None` if out of range.
    pub(crate) fn owner(&self, page: usize) -> Option<u64> {
        self.owner.get(page).map(|o| o.load(Ordering::Acquire))
    }

    /// The written-slot watermark of (`page`, `layer`), `None` if either is
    /// out of range.
    pub(crate) fn watermark(&self, page: usize, layer: usize) -> Option<&AtomicUsize> {
        if layer >= self.cfg.n_layers {
            return None;
        }
        self.watermarks
            .get(page.checked_mul(self.cfg.n_layers)?.checked_add(layer)?)
    }

    /// The one allocation path: `n` pages for `owner` (a new tag when
    /// `None`), all or none.
    pub(crate) fn allocate(
        &self,
        owner: Option<OwnerTag>,
        n: usize,
    ) -> Result<(OwnerTag, Vec<PageRef>), PoolError> {
        let (owner, pages) = {
            let mut st = self.lock();
            let free = st.free.len();
            if n > free {
                return Err(PoolError::Exhausted {
                    requested_pages: n,
                    free_pages: free,
                });
            }
            let owner = match owner {
                Some(o) => o,
                None => st.mint()?,
            };
            let pages = st.free.split_off(free - n);
            st.allocations += n as u64;
            (owner, pages)
        };
        // The pages are off the free list and owned by nobody: only this
        // thread can reach them until the owner is published below.
        let zero = self.cfg.scrub == ScrubMode::OnAllocate && !self.cfg.poison;
        let mut table = Vec::with_capacity(n);
        for &id in pages.iter().rev() {
            let p = id as usize;
            if zero {
                // SAFETY: `p` came from the free list, so it is in range, and
                // it is exclusively ours (see above).
                unsafe { self.storage.fill_page(p, Fill::Zero) };
            }
            let generation = self.generation[p]
                .fetch_add(1, Ordering::AcqRel)
                .wrapping_add(1);
            self.owner[p].store(owner.get(), Ordering::Release);
            table.push(PageRef {
                page: id,
                generation,
            });
        }
        Ok((owner, table))
    }

    /// The one release path (I7): every page of `table` still held by
    /// `owner` gets a new generation, loses its owner and watermarks, is
    /// scrubbed or poisoned per the config, and rejoins the free list. A page
    /// not held by `owner` is left alone, so releasing twice frees once.
    pub(crate) fn release(&self, owner: OwnerTag, table: &[PageRef]) {
        let n_layers = self.cfg.n_layers;
        let fill = if self.cfg.poison {
            Some(Fill::Canary)
        } else if self.cfg.scrub == ScrubMode::OnRelease {
            Some(Fill::Zero)
        } else {
            None
        };
        let mut freed = Vec::with_capacity(table.len());
        for e in table {
            let p = e.page as usize;
            let claimed = self.owner.get(p).is_some_and(|o| {
                o.compare_exchange(owner.get(), 0, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            });
            if !claimed {
                continue;
            }
            self.generation[p].fetch_add(1, Ordering::AcqRel);
            for w in &self.watermarks[p * n_layers..(p + 1) * n_layers] {
                w.store(0, Ordering::Release);
            }
            if let Some(value) = fill {
                // SAFETY: `p` is in range (it had an owner slot) and we just
                // took it from its owner, whose `Reservation` is being
                // dropped: nobody else can reach it until it is on the free
                // list.
                unsafe { self.storage.fill_page(p, value) };
            }
            freed.push(e.page);
        }
        let mut st = self.lock();
        st.releases += freed.len() as u64;
        // Reversed so that the next allocation of the same size gets the
        // pages back in table order.
        st.free.extend(freed.iter().rev());
    }

    /// (generation, owner) of `page`, for tests.
    #[cfg(test)]
    pub(crate) fn page_state(&self, page: usize) -> (u64, u64) {
        (
            self.generation(page).unwrap_or(u64::MAX),
            self.owner(page).unwrap_or(u64::MAX),
        )
    }

    /// Moves the owner-tag counter, to test its exhaustion.
    #[cfg(test)]
    pub(crate) fn set_next_owner(&self, next: u64) {
        self.lock().next_owner = next;
    }

    /// A copy of a whole page's storage as f32 (an f16 pool's widened),
    /// for the scrub and poison tests. Tests call it only while no write
    /// runs.
    #[cfg(test)]
    pub(crate) fn page_copy(&self, page: usize) -> Vec<f32> {
        assert!(page < self.cfg.n_pages);
        let mut out = Vec::new();
        // SAFETY: in range; single-threaded tests, no write in flight.
        unsafe { self.storage.page(page) }.extend_f32(&mut out);
        out
    }

    /// Sets the watermark of (`page`, `layer`) without writing anything: a
    /// simulated watermark bug, for the poison tests.
    #[cfg(test)]
    pub(crate) fn set_watermark(&self, page: usize, layer: usize, slots: usize) {
        if let Some(w) = self.watermark(page, layer) {
            w.store(slots, Ordering::Release);
        }
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("cfg", &self.cfg)
            .field("storage", &self.storage)
            .finish_non_exhaustive()
    }
}
