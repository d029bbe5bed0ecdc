//! The prefix cache: full KV pages kept after their sequence ends, keyed
//! by [`PageKey`] inside a [`Namespace`], shared read-only by the
//! sequences that lease them (`design/prefix-cache.md`, rules 3-5).
//!
//! # States of a page
//! A page is free, owned by one reservation (writable by it alone), or
//! *cached*: owned by a cache entry, whose tag is minted when the page
//! enters the cache like any reservation's. A cached page
//! - is full: every layer's watermark is at the page size, checked when it
//!   enters, and it is never written again ([`crate::Reservation::write`]
//!   and the landing path refuse its positions);
//! - is read by a reservation only while that reservation holds a *lease*
//!   on it, taken by [`crate::KvPool::reserve_cached`]; the checked reader
//!   admits a page owned by a cache entry only if its reservation leases
//!   that entry (I1, extended), at the generation in its page table;
//! - leaves the cache only at zero leases (evicted least recently used
//!   first, deepest first among equals: a chain loses its tail before its
//!   head), and leaving bumps its generation and applies the pool's
//!   release fill (scrub, poison), as a release does.
//!
//! Entering bumps the generation too, so the page table of the reservation
//! that wrote the page can never read it again: only leases can.
//!
//! # Namespaces
//! A lookup walks the request's page keys from the first and stops at the
//! first key that is absent **or whose entry belongs to another
//! namespace**: keys are keyed hashes that already include the namespace,
//! and the comparison makes a cross-tenant hit impossible even if two keys
//! collided.
//!
//! # Bounds and costs
//! The cache holds at most [`crate::KvPool::set_cache_pages`] pages (off,
//! 0, by default). Unleased cached pages count as available: an allocation
//! that finds too few free pages evicts them on demand, so the cache never
//! refuses a reservation that an empty cache would have admitted.
//! Everything here runs under the pool's one mutex, once per reserve and
//! per release (a hash lookup and a B-tree update per page), never on the
//! read path.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};

use kvmesh_faults::{planted, PlantedBug};

pub use kvmesh_cacheid::{Namespace, PageKey};

/// A cache entry: one cached page.
#[derive(Debug)]
pub(crate) struct Entry {
    pub ns: Namespace,
    pub page: u32,
    /// The owner tag the page carries while cached.
    pub tag: u64,
    /// The page's generation while cached.
    pub generation: u64,
    pub leases: u32,
    /// Last use (lookup, lease release, insertion), from `CacheState::clock`.
    pub stamp: u64,
    /// Its page's index in the sequence (0 for the first page).
    pub depth: u32,
}

/// The eviction order: oldest stamp first, then deepest.
type LruKey = (u64, Reverse<u32>, PageKey);

/// Cache bookkeeping, under the pool's mutex.
#[derive(Debug, Default)]
pub(crate) struct CacheState {
    /// Most pages the cache may hold (0: the cache is off).
    pub max_pages: usize,
    pub entries: HashMap<PageKey, Entry>,
    /// Entries with no lease, in eviction order: only these can go.
    lru: BTreeSet<LruKey>,
    clock: u64,
    /// Changes whenever the set of entries does (an insertion or an
    /// eviction): lets a router that has seen the set skip it next time.
    /// Starts at a value taken from the clock, so a restarted node does not
    /// repeat the epochs its predecessor reported.
    pub epoch: u64,
    pub counters: CacheCounters,
}

/// Cumulative counts, reported in [`crate::PoolStats::cache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheCounters {
    /// Prompt tokens looked up (full pages the caller offered, in tokens).
    pub lookup_tokens: u64,
    /// Tokens found: leased pages, in tokens.
    pub hit_tokens: u64,
    /// Pages that entered the cache.
    pub inserted_pages: u64,
    /// Pages evicted (to make room or on demand by an allocation).
    pub evicted_pages: u64,
}

/// A snapshot of the cache, in [`crate::PoolStats::cache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// The bound on cached pages (0: off).
    pub max_pages: usize,
    /// Pages cached now (entries).
    pub entries: usize,
    /// Cached pages at least one reservation leases now.
    pub leased_pages: usize,
    /// The counters.
    pub counters: CacheCounters,
}

impl CacheStats {
    /// Every field by its metric name (without prefix), counters first:
    /// what a node's load report carries.
    pub fn fields(&self) -> [(&'static str, u64); 7] {
        let c = &self.counters;
        [
            ("lookup_tokens", c.lookup_tokens),
            ("hit_tokens", c.hit_tokens),
            ("inserted_pages", c.inserted_pages),
            ("evicted_pages", c.evicted_pages),
            ("entries", self.entries as u64),
            ("leased_pages", self.leased_pages as u64),
            ("max_pages", self.max_pages as u64),
        ]
    }

    /// [`Self::fields`] as the map a node's load report carries.
    pub fn report(&self) -> std::collections::HashMap<String, u64> {
        self.fields()
            .into_iter()
            .map(|(k, n)| (k.to_owned(), n))
            .collect()
    }
}

/// What a node tells routers of its cache ([`crate::KvPool::cache_index`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheIndex {
    /// Changes whenever the set of cached pages does.
    pub epoch: u64,
    /// Every cached page's [`PageKey::routing_id`]; `None` when the caller
    /// already holds this epoch's set.
    pub ids: Option<Vec<u64>>,
}

/// A lease one reservation holds: the page it reads through it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Lease {
    pub key: PageKey,
    pub page: u32,
    pub tag: u64,
}

impl CacheState {
    /// An empty, disabled cache whose epochs start from the clock.
    pub fn new() -> Self {
        Self {
            epoch: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64),
            ..Self::default()
        }
    }

    pub fn enabled(&self) -> bool {
        self.max_pages > 0
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Sets the stamp of every entry of `keys` that is still cached,
    /// keeping the eviction set in step (an entry with leases is not in
    /// it). One stamp for the whole chain, so a page is never older than
    /// the pages after it.
    fn touch(&mut self, keys: impl Iterator<Item = PageKey>) {
        let now = self.tick();
        for key in keys {
            if let Some(e) = self.entries.get_mut(&key) {
                if e.leases == 0 {
                    self.lru.remove(&(e.stamp, Reverse(e.depth), key));
                    self.lru.insert((now, Reverse(e.depth), key));
                }
                e.stamp = now;
            }
        }
    }

    /// Leases the longest run of `keys`, from the first, cached in `ns`.
    /// Returns the leases with each page's cached generation.
    pub fn lease_prefix(&mut self, ns: &Namespace, keys: &[PageKey]) -> Vec<(Lease, u64)> {
        let mut out = Vec::new();
        if !self.enabled() {
            return out;
        }
        for key in keys {
            let Some(e) = self.entries.get_mut(key) else {
                break;
            };
            // Rule 3: the namespace is compared, not only the key.
            if e.ns != *ns {
                break;
            }
            if planted(PlantedBug::CacheNoLeaseCheck) {
                // The planted bug: a lease nobody counts.
            } else {
                if e.leases == 0 {
                    self.lru.remove(&(e.stamp, Reverse(e.depth), *key));
                }
                e.leases += 1;
            }
            out.push((
                Lease {
                    key: *key,
                    page: e.page,
                    tag: e.tag,
                },
                e.generation,
            ));
        }
        self.touch(out.iter().map(|(l, _)| l.key));
        out
    }

    /// Gives back `leases` (one reservation's, on its release).
    pub fn unlease(&mut self, leases: &[Lease]) {
        for l in leases {
            if planted(PlantedBug::CacheNoLeaseCheck) {
                break;
            }
            if let Some(e) = self.entries.get_mut(&l.key) {
                if e.tag != l.tag {
                    // Unreachable while leases are counted: an entry with
                    // a lease is never evicted, so the key names the
                    // leased page still.
                    continue;
                }
                e.leases = e.leases.saturating_sub(1);
                if e.leases == 0 {
                    self.lru.insert((e.stamp, Reverse(e.depth), l.key));
                }
            }
        }
        self.touch(leases.iter().map(|l| l.key));
    }

    /// Pages an allocation could take from the cache now.
    pub fn evictable(&self) -> usize {
        self.lru.len()
    }

    /// Cached pages at least one reservation leases.
    pub fn leased(&self) -> usize {
        self.entries.len() - self.lru.len()
    }

    /// Removes the least recently used unleased entry and returns it.
    pub fn evict_one(&mut self) -> Option<Entry> {
        let (_, _, key) = self.lru.pop_first()?;
        let e = self.entries.remove(&key)?;
        self.counters.evicted_pages += 1;
        self.epoch = self.epoch.wrapping_add(1);
        Some(e)
    }

    /// Evicts unleased entries, least recently used first, until the cache
    /// is within its bound (or only leased entries are left); returns them.
    pub fn trim(&mut self) -> Vec<Entry> {
        let mut out = Vec::new();
        while self.entries.len() > self.max_pages {
            match self.evict_one() {
                Some(e) => out.push(e),
                None => break,
            }
        }
        out
    }

    /// Whether an entry for `key` exists.
    pub fn contains(&self, key: &PageKey) -> bool {
        self.entries.contains_key(key)
    }

    /// Whether one more page fits under the bound.
    pub fn has_room(&self) -> bool {
        self.entries.len() < self.max_pages
    }

    /// Adds an entry (the caller moved the page to `tag` at `generation`);
    /// evictable only while it has no lease.
    pub fn insert(&mut self, key: PageKey, e: Entry) {
        if e.leases == 0 {
            self.lru.insert((e.stamp, Reverse(e.depth), key));
        }
        self.entries.insert(key, e);
        self.counters.inserted_pages += 1;
        self.epoch = self.epoch.wrapping_add(1);
    }

    /// The stamp a new entry gets (then [`Self::touch`] its chain).
    pub fn now(&mut self) -> u64 {
        self.tick()
    }

    /// Touches the chain of keys that a finished sequence left cached.
    pub fn touch_chain(&mut self, keys: &[PageKey]) {
        self.touch(keys.iter().copied());
    }

    /// The epoch, and unless it is `known`, the [`PageKey::routing_id`] of
    /// every entry (unordered).
    pub fn index(&self, known: u64) -> CacheIndex {
        CacheIndex {
            epoch: self.epoch,
            ids: (known != self.epoch)
                .then(|| self.entries.keys().map(PageKey::routing_id).collect()),
        }
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            max_pages: self.max_pages,
            entries: self.entries.len(),
            leased_pages: self.leased(),
            counters: self.counters,
        }
    }
}
