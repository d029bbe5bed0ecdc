//! The pool: page metadata, the free list, and the one allocation path and
//! the one release path every page goes through.
//!
//! Per page the pool keeps
//! - a generation: +1 on every allocation and every release, so a free page
//!   is even and an allocated one odd, and a page table entry from an earlier
//!   allocation never matches again (I1); entering the prefix cache adds 2
//!   (still odd: held, by the cache), leaving it 1. A u64 cannot wrap in
//!   practice: a page reallocated every nanosecond lasts 292 years;
//! - an owner: 0 when free, else the [`OwnerTag`] of the one reservation
//!   holding it, or the tag of the cache entry holding it ([`crate::cache`]);
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
//!   page's owner is the reader's owner, or a cache entry the reader's
//!   reservation leases. A [`crate::SeqKv`] borrows its reservation, so
//!   while the slices live that reservation can neither write (no `&mut`)
//!   nor release (no drop), and no other reservation holds the page: owner
//!   tags are never reused. A cached page is written by nobody (it is on no
//!   reservation's writable part) and leaves the cache only at zero leases,
//!   so it cannot change or go while a leasing reader's slices live.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::{fmt, num::NonZeroU64};

use kvmesh_faults::{planted, PlantedBug};
use kvmesh_kernels::PageRef;

use crate::cache::{CacheIndex, CacheState, CacheStats, Entry, Lease, Namespace, PageKey};
use crate::config::{PoolConfig, ScrubMode};
use crate::error::PoolError;
use crate::observer::{PageEvent, PageFill, PageObserver};
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
    /// Told of every page event (a device pool's mirror), if any; set
    /// once, before the first allocation ([`KvPool::set_observer`]).
    observer: std::sync::OnceLock<Arc<dyn PageObserver>>,
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
    /// The prefix cache's entries and eviction order.
    cache: CacheState,
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

    /// Tell `observer` of every page event from now on
    /// ([`crate::observer`]): how a device pool mirrors this pool's
    /// generations and watermarks. Only a pool that has never allocated a
    /// page takes one (so the observer knows every page's state: all free,
    /// generation 0, filled as at creation), and only one.
    pub fn set_observer(&self, observer: Arc<dyn PageObserver>) -> Result<(), PoolError> {
        let st = self.shared.lock();
        if st.allocations > 0 || st.releases > 0 {
            return Err(PoolError::ObserverTooLate);
        }
        let set = self.shared.observer.set(observer).is_ok();
        drop(st);
        if set {
            Ok(())
        } else {
            Err(PoolError::ObserverTooLate)
        }
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
            blocks: cfg.entry.blocks(),
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
            cache: CacheState::new(),
        });
        let shared = Shared {
            cfg,
            storage,
            generation,
            owner,
            watermarks,
            observer: std::sync::OnceLock::new(),
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

    /// Pages a reservation can get now: free, plus cached pages nobody
    /// leases (an allocation evicts those on demand). What admission and
    /// load reports count.
    pub fn available_pages(&self) -> usize {
        let st = self.shared.lock();
        st.free.len() + st.cache.evictable()
    }

    /// Lets the prefix cache hold up to `pages` pages (0 turns it off; off
    /// by default). Lowering the bound evicts unleased entries down to it
    /// where it can; leased ones stay until their leases end.
    pub fn set_cache_pages(&self, pages: usize) {
        let victims = {
            let mut st = self.shared.lock();
            st.cache.max_pages = pages.min(self.shared.cfg.n_pages);
            st.cache.trim()
        };
        self.shared.free_evicted(victims);
    }

    /// Evicts every cached page nobody leases; returns how many.
    pub fn clear_cache(&self) -> usize {
        let victims = {
            let mut st = self.shared.lock();
            std::iter::from_fn(|| st.cache.evict_one()).collect::<Vec<_>>()
        };
        let n = victims.len();
        self.shared.free_evicted(victims);
        n
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

    /// Like [`KvPool::reserve`], first leasing the longest run of `keys`
    /// (the request's full-page keys, from the first) that the cache holds
    /// in namespace `ns`: those pages head the page table, readable and
    /// never writable, and only the rest is allocated.
    /// [`Reservation::cached_tokens`] says how many tokens the leases
    /// cover. With the cache off, or nothing cached, this is `reserve`.
    /// All or nothing: on [`PoolError::Exhausted`] no lease is kept.
    pub fn reserve_cached(
        &self,
        ns: &Namespace,
        keys: &[PageKey],
        tokens: usize,
    ) -> Result<Reservation, PoolError> {
        let page_size = self.shared.cfg.page_size;
        let n = tokens.div_ceil(page_size);
        // Only full pages of the request can be cached ones.
        let keys = &keys[..keys.len().min(tokens / page_size)];
        let (owner, leases, table) = {
            let mut st = self.shared.lock();
            let leased = st.cache.lease_prefix(ns, keys);
            st.cache.counters.lookup_tokens += (keys.len() * page_size) as u64;
            st.cache.counters.hit_tokens += (leased.len() * page_size) as u64;
            match self.shared.take_locked(&mut st, None, n - leased.len()) {
                Ok((owner, pages, victims)) => {
                    let leases: Vec<Lease> = leased.iter().map(|(l, _)| *l).collect();
                    let mut table: Vec<PageRef> = leased
                        .iter()
                        .map(|(l, generation)| PageRef {
                            page: l.page,
                            generation: *generation,
                        })
                        .collect();
                    drop(st);
                    table.extend(self.shared.hand_out(owner, &pages, victims));
                    (owner, leases, table)
                }
                Err(e) => {
                    let leases: Vec<Lease> = leased.iter().map(|(l, _)| *l).collect();
                    st.cache.unlease(&leases);
                    return Err(e);
                }
            }
        };
        Ok(Reservation::with_leases(
            Arc::clone(&self.shared),
            owner,
            table,
            leases,
        ))
    }

    /// A snapshot of the cache's state and counters.
    pub fn cache_stats(&self) -> CacheStats {
        self.shared.lock().cache.stats()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PoolStats {
        let (free_pages, allocations, releases, cache) = {
            let st = self.shared.lock();
            (st.free.len(), st.allocations, st.releases, st.cache.stats())
        };
        PoolStats {
            capacity_pages: self.capacity_pages(),
            free_pages,
            cache,
            allocations,
            releases,
            guard_violations: self.shared.violations.total(),
            guard_violations_by_kind: self.shared.violations.by_kind(),
        }
    }

    /// What routers learn of the cache: its epoch, and the routing ids of
    /// its pages unless the caller's `known` epoch is current. Costs one
    /// lock and, when the set changed, 8 bytes per cached page.
    pub fn cache_index(&self, known: u64) -> CacheIndex {
        self.shared.lock().cache.index(known)
    }

    /// Count a violation found outside this pool's own readers (a device
    /// kernel's record, decoded), so every refused read raises the same
    /// alarm metric whichever side caught it.
    pub fn report_guard_violation(&self, violation: &kvmesh_kernels::GuardViolation) {
        self.shared.violations.record(violation);
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
    /// `None`), all or none. Evicts unleased cached pages when the free
    /// list is short.
    pub(crate) fn allocate(
        &self,
        owner: Option<OwnerTag>,
        n: usize,
    ) -> Result<(OwnerTag, Vec<PageRef>), PoolError> {
        let (owner, pages, victims) = {
            let mut st = self.lock();
            self.take_locked(&mut st, owner, n)?
        };
        let table = self.hand_out(owner, &pages, victims);
        Ok((owner, table))
    }

    /// Under the lock: takes `n` pages off the free list, and what is
    /// missing from the cache's unleased entries (detached here, freed by
    /// [`Self::hand_out`]), or refuses with nothing changed.
    fn take_locked(
        &self,
        st: &mut FreeState,
        owner: Option<OwnerTag>,
        n: usize,
    ) -> Result<(OwnerTag, Vec<u32>, Vec<Entry>), PoolError> {
        let free = st.free.len();
        let short = n.saturating_sub(free);
        if short > st.cache.evictable() {
            return Err(PoolError::Exhausted {
                requested_pages: n,
                free_pages: free + st.cache.evictable(),
            });
        }
        let owner = match owner {
            Some(o) => o,
            None => st.mint()?,
        };
        let victims: Vec<Entry> = (0..short).filter_map(|_| st.cache.evict_one()).collect();
        let pages = st.free.split_off(free - (n - short));
        st.allocations += n as u64;
        // Evicted pages count as released and allocated again.
        st.releases += victims.len() as u64;
        Ok((owner, pages, victims))
    }

    /// Outside the lock: frees the evicted `victims`' metadata, then gives
    /// them and `pages` (taken off the free list) to `owner`, in that order.
    fn hand_out(&self, owner: OwnerTag, pages: &[u32], victims: Vec<Entry>) -> Vec<PageRef> {
        let mut ids: Vec<u32> = pages.iter().rev().copied().collect();
        for e in victims {
            self.detach_evicted(&e);
            ids.push(e.page);
        }
        // The pages are off the free list and owned by nobody: only this
        // thread can reach them until the owner is published below.
        let zero = self.cfg.scrub == ScrubMode::OnAllocate && !self.cfg.poison;
        let mut table = Vec::with_capacity(ids.len());
        for id in ids {
            let p = id as usize;
            if zero {
                // SAFETY: `p` came from the free list or an evicted entry,
                // so it is in range, and it is exclusively ours (see above).
                unsafe { self.storage.fill_page(p, Fill::Zero) };
            }
            let generation = self.generation[p]
                .fetch_add(1, Ordering::AcqRel)
                .wrapping_add(1);
            self.tell(PageEvent::Allocated {
                page: id,
                generation,
                fill: if zero { PageFill::Zero } else { PageFill::Keep },
            });
            self.owner[p].store(owner.get(), Ordering::Release);
            table.push(PageRef {
                page: id,
                generation,
            });
        }
        table
    }

    /// Reports `event` to the observer, if there is one.
    fn tell(&self, event: PageEvent) {
        if let Some(o) = self.observer.get() {
            o.page_event(event);
        }
    }

    /// The fill a page gets when it leaves its holder (release, eviction).
    fn release_fill(&self) -> Option<Fill> {
        if self.cfg.poison {
            Some(Fill::Canary)
        } else if self.cfg.scrub == ScrubMode::OnRelease {
            Some(Fill::Zero)
        } else {
            None
        }
    }

    /// An entry taken out of the cache (no lease, not in the cache any
    /// more): its page loses the entry's owner tag, gets a new generation,
    /// loses its watermarks and gets the release fill. The caller then
    /// frees or reallocates the page.
    fn detach_evicted(&self, e: &Entry) {
        let p = e.page as usize;
        let claimed = self.owner[p]
            .compare_exchange(e.tag, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        debug_assert!(claimed, "a cached page is owned by its entry");
        let generation = self.generation[p]
            .fetch_add(1, Ordering::AcqRel)
            .wrapping_add(1);
        let n_layers = self.cfg.n_layers;
        for w in &self.watermarks[p * n_layers..(p + 1) * n_layers] {
            w.store(0, Ordering::Release);
        }
        let fill = self.release_fill();
        if let Some(value) = fill {
            // SAFETY: in range; no lease holds the page and it left the
            // cache under the lock, so nobody else can reach it.
            unsafe { self.storage.fill_page(p, value) };
        }
        self.tell(PageEvent::Freed {
            page: e.page,
            generation,
            fill: page_fill(fill),
        });
    }

    /// Frees evicted entries' pages onto the free list.
    fn free_evicted(&self, victims: Vec<Entry>) {
        if victims.is_empty() {
            return;
        }
        for e in &victims {
            self.detach_evicted(e);
        }
        let mut st = self.lock();
        st.releases += victims.len() as u64;
        st.free.extend(victims.iter().map(|e| e.page));
    }

    /// Whether every layer of `page` is written to the full page.
    fn page_full(&self, page: usize) -> bool {
        let n_layers = self.cfg.n_layers;
        self.watermarks[page * n_layers..(page + 1) * n_layers]
            .iter()
            .all(|w| w.load(Ordering::Acquire) >= self.cfg.page_size)
    }

    /// Whether `owner` holds `entry`'s page at its generation and the page
    /// is full at every layer: what may enter the cache.
    fn holds_full(&self, owner: OwnerTag, entry: PageRef) -> bool {
        let p = entry.page as usize;
        self.owner.get(p).map(|o| o.load(Ordering::Acquire)) == Some(owner.get())
            && self.generation(p) == Some(entry.generation)
            && self.page_full(p)
    }

    /// The one release path (I7): every page of `table` still held by
    /// `owner` gets a new generation, loses its owner and watermarks, is
    /// scrubbed or poisoned per the config, and rejoins the free list. A page
    /// not held by `owner` is left alone, so releasing twice frees once.
    pub(crate) fn release(&self, owner: OwnerTag, table: &[PageRef]) {
        let n_layers = self.cfg.n_layers;
        let fill = self.release_fill();
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
            let generation = self.generation[p]
                .fetch_add(1, Ordering::AcqRel)
                .wrapping_add(1);
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
            self.tell(PageEvent::Freed {
                page: e.page,
                generation,
                fill: page_fill(fill),
            });
            freed.push(e.page);
        }
        let mut st = self.lock();
        st.releases += freed.len() as u64;
        // Reversed so that the next allocation of the same size gets the
        // pages back in table order.
        st.free.extend(freed.iter().rev());
    }
}

mod publish;
#[cfg(test)]
mod test_support;

fn page_fill(fill: Option<Fill>) -> PageFill {
    match fill {
        None => PageFill::Keep,
        Some(Fill::Zero) => PageFill::Zero,
        Some(Fill::Canary) => PageFill::Canary,
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
