//! The prefix cache: what enters it, who may read it (I1 with leases, I9
//! namespaces), that shared pages are immutable, and eviction only at zero
//! leases with a new generation and the release fill.

use kvmesh_kernels::{GuardViolation, PageRef, PagedKv};

use super::{attend_at, cfg, tokens};
use crate::{KvPool, Namespace, PageKey, PoolConfig, PoolError, Reservation, POISON_BITS};

fn ns(b: u8) -> Namespace {
    Namespace::from_slice(&[b; 32]).expect("32 bytes")
}

/// Keys of a chain: page `i` of sequence `seq` (a stand-in for the keyed
/// hashes of `kvmesh-prefix`, which the pool treats as opaque).
fn keys(seq: u8, n: usize) -> Vec<PageKey> {
    (0..n)
        .map(|i| {
            let mut b = [seq; 32];
            b[0] = i as u8;
            PageKey::from_slice(&b).expect("32 bytes")
        })
        .collect()
}

fn pool(n_pages: usize, cache_pages: usize) -> KvPool {
    let pool = KvPool::new(cfg(n_pages)).expect("pool");
    pool.set_cache_pages(cache_pages);
    pool
}

/// Writes positions `from..to` of both layers with values of `seed`.
fn fill(r: &mut Reservation, seed: u32, from: usize, to: usize) {
    for layer in 0..2 {
        let (k, v) = (
            tokens(seed + layer as u32, to - from),
            tokens(seed + 7, to - from),
        );
        r.write(layer, from, &k, &v).expect("write");
    }
}

/// A sequence of `tokens` tokens, written, named for the cache, dropped.
fn cache_sequence(pool: &KvPool, ns: Namespace, keys: &[PageKey], tokens: usize) {
    let mut r = pool.reserve(tokens).expect("reserve");
    fill(&mut r, 1, 0, tokens);
    r.cache_as(ns, keys.to_vec());
    drop(r);
}

#[test]
fn full_pages_enter_the_cache_and_a_lease_reads_them_like_the_writer() {
    let pool = pool(8, 8);
    let k = keys(1, 3);
    // 10 tokens: pages 0 and 1 are full, page 2 is partial and private.
    let mut writer = pool.reserve(10).expect("reserve");
    fill(&mut writer, 1, 0, 10);
    let want = attend_at(&writer, writer.table(), 1, 7).expect("writer reads");
    writer.cache_as(ns(1), k.clone());
    drop(writer);
    let s = pool.cache_stats();
    assert_eq!(
        (s.entries, s.leased_pages, s.counters.inserted_pages),
        (2, 0, 2)
    );
    // Two pages are cached, six free; all eight are available.
    assert_eq!((pool.free_pages(), pool.available_pages()), (6, 8));

    let reader = pool.reserve_cached(&ns(1), &k, 12).expect("reserve");
    assert_eq!(reader.cached_tokens(), 8);
    assert_eq!(reader.table().len(), 3);
    assert_eq!(reader.held().len(), 1, "only the third page is its own");
    assert_eq!(pool.cache_stats().leased_pages, 2);
    assert_eq!(pool.available_pages(), 8 - 3);
    let got = attend_at(&reader, reader.table(), 1, 7).expect("leased pages read");
    assert_eq!(got, want, "the same bits as the sequence that wrote them");
    let c = pool.cache_stats().counters;
    assert_eq!((c.lookup_tokens, c.hit_tokens), (12, 8));
}

#[test]
fn another_namespace_never_hits_even_with_the_same_keys() {
    let pool = pool(8, 8);
    let k = keys(1, 2);
    cache_sequence(&pool, ns(1), &k, 8);
    // Keys are keyed hashes over the namespace, so another tenant's keys
    // differ; here they are equal on purpose, and the lookup's comparison
    // of namespaces alone must refuse the hit.
    let other = pool.reserve_cached(&ns(2), &k, 8).expect("reserve");
    assert_eq!(other.cached_tokens(), 0);
    assert_eq!(pool.cache_stats().leased_pages, 0);
    // And it cannot read the cached pages by naming them either.
    let cached = pool
        .reserve_cached(&ns(1), &k, 8)
        .expect("the owner's namespace hits");
    let forged: Vec<PageRef> = cached.table().to_vec();
    let err = other
        .reader()
        .read_page(forged[0], 0, 4)
        .expect_err("no lease, no read");
    assert_eq!(
        err,
        GuardViolation::ForeignPage {
            page: forged[0].page
        }
    );
}

#[test]
fn the_cached_head_is_read_only() {
    let pool = pool(8, 8);
    let k = keys(1, 2);
    cache_sequence(&pool, ns(1), &k, 8);
    let mut r = pool.reserve_cached(&ns(1), &k, 12).expect("reserve");
    assert_eq!(r.cached_tokens(), 8);
    let err = r
        .write(0, 4, &tokens(9, 1), &tokens(9, 1))
        .expect_err("position 4 is cached");
    assert_eq!(
        err,
        PoolError::SharedPage {
            position: 4,
            cached: 8
        }
    );
    assert_eq!(err.kind(), "shared_page");
    // Its own page is writable, from the end of the head.
    r.write(0, 8, &tokens(9, 1), &tokens(9, 1))
        .expect("own page");
}

#[test]
fn a_lookup_stops_at_the_first_missing_page_and_leases_never_exceed_the_request() {
    let pool = pool(8, 8);
    let k = keys(1, 3);
    cache_sequence(&pool, ns(1), &k, 12);
    // Another sequence that shares page 0 only.
    let mut diverged = keys(2, 3);
    diverged[0] = k[0];
    let r = pool.reserve_cached(&ns(1), &diverged, 12).expect("reserve");
    assert_eq!(r.cached_tokens(), 4);
    drop(r);
    // A request shorter than the cached chain leases only what it covers.
    let r = pool.reserve_cached(&ns(1), &k, 5).expect("reserve");
    assert_eq!((r.cached_tokens(), r.table().len()), (4, 2));
}

#[test]
fn eviction_waits_for_zero_leases_then_bumps_the_generation_and_fills() {
    let pool = KvPool::new(PoolConfig {
        poison: true,
        ..cfg(3)
    })
    .expect("pool");
    pool.set_cache_pages(3);
    let k = keys(1, 2);
    cache_sequence(&pool, ns(1), &k, 8);
    let holder = pool.reserve_cached(&ns(1), &k, 8).expect("lease both");
    let leased: Vec<PageRef> = holder.table().to_vec();
    // One free page, two leased: a two-page request cannot evict them.
    assert_eq!(pool.available_pages(), 1);
    assert_eq!(
        pool.reserve(8).expect_err("leased pages stay"),
        PoolError::Exhausted {
            requested_pages: 2,
            free_pages: 1
        }
    );
    assert_eq!(pool.clear_cache(), 0, "nothing unleased to clear");
    drop(holder);
    // Now the same request evicts them on demand.
    let taker = pool.reserve(12).expect("evicts both cached pages");
    assert_eq!(pool.cache_stats().entries, 0);
    assert_eq!(pool.cache_stats().counters.evicted_pages, 2);
    // The old lease's table entries are stale: the generation moved.
    for e in &leased {
        let now = pool.shared().page_state(e.page as usize).0;
        assert!(
            now > e.generation,
            "evicted page {} got a new generation",
            e.page
        );
    }
    // The taker's pages passed the release fill (poison) on the way.
    for e in taker.table() {
        assert!(
            pool.shared()
                .page_copy(e.page as usize)
                .iter()
                .all(|x| x.to_bits() == POISON_BITS),
            "page {} was filled before reuse",
            e.page
        );
    }
}

#[test]
fn a_stale_page_table_entry_cannot_read_a_page_evicted_and_reused() {
    let pool = pool(2, 2);
    let k = keys(1, 1);
    cache_sequence(&pool, ns(1), &k, 4);
    let lease = pool.reserve_cached(&ns(1), &k, 4).expect("lease");
    let stale = lease.table()[0];
    drop(lease);
    let mut other = pool.reserve(8).expect("evicts the cached page");
    fill(&mut other, 5, 0, 8);
    // The cached entry's page table entry, replayed, fails the check.
    let page = other
        .table()
        .iter()
        .find(|e| e.page == stale.page)
        .copied()
        .expect("the page was reused");
    assert_ne!(page.generation, stale.generation);
    let err = other
        .reader()
        .read_page(stale, 0, 4)
        .expect_err("stale generation");
    assert!(
        matches!(err, GuardViolation::StaleGeneration { .. }),
        "{err:?}"
    );
}

#[test]
fn the_bound_holds_and_the_oldest_chain_goes_first_tail_first() {
    let pool = pool(8, 3);
    let (a, b) = (keys(1, 2), keys(2, 2));
    cache_sequence(&pool, ns(1), &a, 8);
    cache_sequence(&pool, ns(1), &b, 8);
    // Room for 3: b's second page pushed out a's tail (the oldest chain,
    // its deepest page first).
    let s = pool.cache_stats();
    assert_eq!((s.entries, s.counters.evicted_pages), (3, 1));
    let r = pool.reserve_cached(&ns(1), &a, 8).expect("reserve");
    assert_eq!(r.cached_tokens(), 4, "a's head survived, its tail went");
    drop(r);
    let r = pool.reserve_cached(&ns(1), &b, 8).expect("reserve");
    assert_eq!(r.cached_tokens(), 8, "the newer chain is whole");
    drop(r);
    // Lowering the bound evicts down to it.
    pool.set_cache_pages(1);
    assert_eq!(pool.cache_stats().entries, 1);
}

#[test]
fn partly_written_pages_and_pages_after_a_gap_stay_private() {
    let pool = pool(8, 8);
    let k = keys(1, 3);
    let mut r = pool.reserve(12).expect("reserve");
    fill(&mut r, 1, 0, 12);
    // Page 1's layer 1 is short of the page: it is not full at every layer.
    r.force_watermark(1, 1, 3);
    r.cache_as(ns(1), k.clone());
    drop(r);
    assert_eq!(
        pool.cache_stats().entries,
        1,
        "page 0 only; page 2 follows a gap"
    );
    assert_eq!(pool.available_pages(), 8);
}

#[test]
fn a_second_copy_of_cached_tokens_is_released_and_the_chain_goes_on() {
    let pool = pool(8, 8);
    let k = keys(1, 3);
    cache_sequence(&pool, ns(1), &k[..1], 4);
    // A sequence that computed page 0 again, without a lease, and page 1.
    cache_sequence(&pool, ns(1), &k[..2], 8);
    let s = pool.cache_stats();
    assert_eq!((s.entries, s.counters.inserted_pages), (2, 2));
    assert_eq!(pool.free_pages(), 6, "the duplicate page went back");
    let r = pool.reserve_cached(&ns(1), &k, 12).expect("reserve");
    assert_eq!(r.cached_tokens(), 8);
}

#[test]
fn every_page_comes_back_free_or_cached_and_clear_frees_the_cache() {
    let pool = pool(6, 6);
    let k = keys(1, 2);
    for round in 0..4u32 {
        let mut r = pool.reserve_cached(&ns(1), &k, 10).expect("reserve");
        let from = r.cached_tokens();
        fill(&mut r, round, from, 10);
        r.cache_as(ns(1), k.clone());
        // A reader of the whole sequence: cached head and own tail.
        attend_at(&r, r.table(), 0, 9).expect("reads");
        drop(r);
    }
    let s = pool.stats();
    assert_eq!(s.free_pages + s.cache.entries, s.capacity_pages);
    assert_eq!(s.cache.counters.hit_tokens, 3 * 8);
    assert_eq!(pool.clear_cache(), 2);
    assert_eq!(pool.free_pages(), pool.capacity_pages());
    assert_eq!(s.guard_violations, 0);
}

#[test]
fn with_the_cache_off_nothing_is_kept() {
    let pool = pool(4, 0);
    let k = keys(1, 1);
    cache_sequence(&pool, ns(1), &k, 4);
    assert_eq!(pool.cache_stats().entries, 0);
    assert_eq!(pool.free_pages(), 4);
    let r = pool.reserve_cached(&ns(1), &k, 4).expect("reserve");
    assert_eq!(r.cached_tokens(), 0);
}

#[test]
fn the_index_routers_see_changes_epoch_with_every_entry_in_or_out() {
    let pool = pool(8, 2);
    let empty = pool.cache_index(0);
    assert_eq!(empty.ids, Some(Vec::new()));
    // Nothing changed: the caller that knows this epoch gets no ids.
    assert_eq!(pool.cache_index(empty.epoch).ids, None);
    let k = keys(1, 2);
    cache_sequence(&pool, ns(1), &k, 17);
    let full = pool.cache_index(empty.epoch);
    assert_ne!(full.epoch, empty.epoch);
    let mut ids = full.ids.clone().expect("a new epoch sends the set");
    ids.sort_unstable();
    let mut want: Vec<u64> = k.iter().map(PageKey::routing_id).collect();
    want.sort_unstable();
    assert_eq!(ids, want);
    // An eviction (another chain over the bound of 2) is a change too.
    cache_sequence(&pool, ns(1), &keys(2, 1), 9);
    let after = pool.cache_index(full.epoch);
    assert_ne!(after.epoch, full.epoch);
    assert_eq!(after.ids.map(|v| v.len()), Some(2));
    assert_eq!(pool.clear_cache(), 2);
    assert_eq!(pool.cache_index(after.epoch).ids, Some(Vec::new()));
}

#[test]
fn a_live_sequence_shares_its_full_pages_and_a_fork_reads_them_while_it_runs() {
    let pool = pool(8, 8);
    let k = keys(1, 3);
    // 10 tokens in 3 pages of 4: pages 0 and 1 full, page 2 partial.
    let mut first = pool.reserve(12).expect("reserve");
    fill(&mut first, 1, 0, 10);
    let want = attend_at(&first, first.table(), 1, 7).expect("reads");
    first.cache_as(ns(1), k.clone());
    assert_eq!(first.share(), 2, "the two full pages, not the partial one");
    assert_eq!(first.cached_tokens(), 8);
    assert_eq!(first.held().len(), 1);
    let s = pool.cache_stats();
    assert_eq!((s.entries, s.leased_pages), (2, 2));
    // Shared pages are read-only for their writer too; its own page is not.
    assert_eq!(
        first.write(0, 7, &tokens(9, 1), &tokens(9, 1)),
        Err(PoolError::SharedPage {
            position: 7,
            cached: 8
        })
    );
    first
        .write(0, 10, &tokens(9, 1), &tokens(9, 1))
        .expect("the partial page stays its own");
    fill(&mut first, 3, 10, 11);
    assert_eq!(
        attend_at(&first, first.table(), 1, 7).expect("reads after sharing"),
        want,
        "the writer reads its shared pages at their new generation"
    );

    // A fork in the same namespace leases them while the first runs.
    let fork = pool.reserve_cached(&ns(1), &k, 12).expect("fork");
    assert_eq!(fork.cached_tokens(), 8);
    assert_eq!(fork.table()[..2], first.table()[..2]);
    assert_eq!(
        attend_at(&fork, fork.table(), 1, 7).expect("fork reads"),
        want
    );
    // Another tenant gets nothing.
    assert_eq!(
        pool.reserve_cached(&ns(2), &k, 12)
            .expect("reserve")
            .cached_tokens(),
        0
    );
    // Sharing again adds nothing: the partial page is still partial.
    assert_eq!(first.share(), 0);

    // While either holds a lease, nothing can evict the pages.
    drop(first);
    assert_eq!(pool.cache_stats().leased_pages, 2);
    assert_eq!(pool.cache_stats().entries, 2);
    drop(fork);
    let s = pool.stats();
    assert_eq!((s.cache.entries, s.cache.leased_pages), (2, 0));
    assert_eq!(s.free_pages + s.cache.entries, s.capacity_pages);
    assert_eq!(s.guard_violations, 0);
    // And then they are evictable as any cached page.
    assert_eq!(pool.clear_cache(), 2);
    assert_eq!(pool.free_pages(), 8);
}

#[test]
fn sharing_stops_at_a_cached_key_at_the_bound_and_with_the_cache_off() {
    // Another sequence cached page 0's key first: the run cannot start.
    let pool = pool(8, 8);
    let k = keys(1, 2);
    cache_sequence(&pool, ns(1), &k[..1], 4);
    let mut r = pool.reserve(8).expect("reserve");
    fill(&mut r, 2, 0, 8);
    r.cache_as(ns(1), k.clone());
    assert_eq!(r.share(), 0);
    drop(r);

    // A bound of one page, held by a leased entry: one page at most, and
    // a leased entry is never evicted for room.
    let pool = pool_with_bound(1);
    let mut a = pool.reserve(8).expect("reserve");
    fill(&mut a, 1, 0, 8);
    a.cache_as(ns(1), keys(3, 2));
    assert_eq!(a.share(), 1);
    let mut b = pool.reserve(8).expect("reserve");
    fill(&mut b, 1, 0, 8);
    b.cache_as(ns(1), keys(4, 2));
    assert_eq!(b.share(), 0, "the only entry is leased");
    drop(a);
    // Now the entry has no lease: it makes room for b's first page.
    assert_eq!(b.share(), 1);
    assert_eq!(pool.cache_stats().counters.evicted_pages, 1);
    drop(b);

    // Off, or never named: nothing is shared.
    let pool = pool_with_bound(0);
    let mut r = pool.reserve(8).expect("reserve");
    fill(&mut r, 1, 0, 8);
    assert_eq!(r.share(), 0, "not named");
    r.cache_as(ns(1), keys(5, 2));
    assert_eq!(r.share(), 0, "the cache is off");
    assert_eq!(r.cached_tokens(), 0);
}

/// [`pool`] with 8 pages, for tests whose locals shadow the name.
fn pool_with_bound(cache_pages: usize) -> KvPool {
    pool(8, cache_pages)
}
