//! The planted bug `cache-no-lease-check` (testing builds): the cache hands
//! out pages without counting leases, so an allocation evicts and reuses a
//! page a sequence still reads. I1's generation and owner checks are what
//! must refuse every such read: the sequence fails with a counted guard
//! violation instead of attending over another sequence's KV. Its own test
//! binary, since a planted bug holds for the whole process.

use kvmesh_kernels::{GuardViolation, PagedKv};
use kvmesh_kvpool::{KvPool, Namespace, PageKey, PoolConfig};

#[test]
fn an_uncounted_lease_is_caught_by_the_generation_check() {
    kvmesh_faults::plant(kvmesh_faults::PlantedBug::CacheNoLeaseCheck).expect("testing build");
    let pool = KvPool::new(PoolConfig::for_tokens(8, 4, 1, 1, 2)).expect("pool");
    pool.set_cache_pages(2);
    let ns = Namespace::from_slice(&[1; 32]).expect("32 bytes");
    let key = PageKey::from_slice(&[2; 32]).expect("32 bytes");
    let mut writer = pool.reserve(4).expect("reserve");
    writer.write(0, 0, &[1.0; 8], &[2.0; 8]).expect("write");
    writer.cache_as(ns, vec![key]);
    drop(writer);

    let reader = pool.reserve_cached(&ns, &[key], 4).expect("hit");
    assert_eq!(reader.cached_tokens(), 4);
    let entry = reader.table()[0];
    reader
        .reader()
        .read_page(entry, 0, 4)
        .expect("readable while cached");
    // With the lease uncounted the page is evictable: another sequence
    // takes the whole pool and writes its own values.
    let mut other = pool.reserve(8).expect("evicts the 'leased' page");
    other.write(0, 0, &[9.0; 16], &[9.0; 16]).expect("write");
    let err = reader
        .reader()
        .read_page(entry, 0, 4)
        .expect_err("the reused page must not be read");
    assert!(
        matches!(err, GuardViolation::StaleGeneration { .. }),
        "{err:?}"
    );
    assert!(pool.stats().violations_of("stale_generation") >= 1);
}
