//! Reservations: grants, growth, writes and their typed refusals, release.

use kvmesh_kernels::PagedKv;

use super::{cfg, tokens, KV_DIM};
use crate::{KvPool, PoolConfig, PoolError};

fn pool(n_pages: usize) -> KvPool {
    KvPool::new(cfg(n_pages)).expect("pool")
}

#[test]
fn exhausted_is_all_or_nothing_and_names_both_numbers() {
    let pool = pool(3);
    assert_eq!((pool.capacity_pages(), pool.capacity_tokens()), (3, 12));
    let err = pool.reserve(13).expect_err("4 pages > 3");
    assert_eq!(
        err,
        PoolError::Exhausted {
            requested_pages: 4,
            free_pages: 3
        }
    );
    assert_eq!(err.kind(), "exhausted");
    let msg = err.to_string();
    assert!(
        msg.contains("4 pages requested") && msg.contains("3 free"),
        "{msg}"
    );
    assert_eq!(pool.free_pages(), 3);
    assert_eq!(pool.stats().allocations, 0);

    let mut a = pool.reserve(8).expect("2 pages");
    let table = a.table().to_vec();
    assert_eq!(
        pool.reserve(5).expect_err("2 > 1"),
        PoolError::Exhausted {
            requested_pages: 2,
            free_pages: 1
        }
    );
    assert_eq!(
        a.grow(16).expect_err("2 more > 1"),
        PoolError::Exhausted {
            requested_pages: 2,
            free_pages: 1
        }
    );
    assert_eq!(a.table(), &table[..]);
    assert_eq!(pool.free_pages(), 1);
    assert_eq!(
        pool.reserve(usize::MAX).expect_err("absurd").kind(),
        "exhausted"
    );
    a.grow(12).expect("1 more page");
    assert_eq!((a.capacity_tokens(), pool.free_pages()), (12, 0));
    a.grow(3).expect("shrinking is a no-op");
    assert_eq!(a.table()[..2], table[..]);
}

#[test]
fn writes_span_pages_and_read_back() {
    let pool = pool(4);
    let mut r = pool.reserve(10).expect("3 pages");
    let k = tokens(1, 6);
    let v = tokens(2, 6);
    r.write(1, 0, &k, &v).expect("write 0..6");
    assert_eq!(
        (
            r.written_tokens(1),
            r.written_tokens(0),
            r.written_tokens(9)
        ),
        (6, 0, 0)
    );
    let kv = r.reader();
    let p0 = kv.read_page(r.table()[0], 1, 4).expect("page 0");
    let p1 = kv.read_page(r.table()[1], 1, 2).expect("page 1");
    assert_eq!([p0.k.to_f32(), p1.k.to_f32()].concat(), k);
    assert_eq!([p0.v.to_f32(), p1.v.to_f32()].concat(), v);

    // Rewriting below the watermark is allowed and keeps the watermark.
    let k2 = tokens(3, 2);
    r.write(1, 1, &k2, &k2).expect("rewrite 1..3");
    assert_eq!(r.written_tokens(1), 6);
    assert_eq!(
        &r.reader()
            .read_page(r.table()[0], 1, 4)
            .expect("page 0")
            .k
            .to_f32()[KV_DIM..3 * KV_DIM],
        &k2[..]
    );
    // A page may be filled before the one before it is complete (transfers
    // land out of order); written_tokens counts only the contiguous prefix.
    r.write(0, 8, &tokens(4, 2), &tokens(5, 2))
        .expect("page 2, slot 0");
    assert_eq!(r.written_tokens(0), 0);
    // An empty write is a no-op anywhere.
    r.write(0, 1000, &[], &[]).expect("empty");
}

#[test]
fn write_refusals_are_typed_and_write_nothing() {
    let pool = pool(4);
    let mut r = pool.reserve(5).expect("2 pages, capacity 8");
    let t = tokens(1, 2);
    let cases = [
        (
            r.write(0, 1, &t, &t),
            PoolError::WriteGap {
                page: r.table()[0].page,
                layer: 0,
                slot: 1,
                watermark: 0,
            },
        ),
        (
            r.write(2, 0, &t, &t),
            PoolError::LayerOutOfRange {
                layer: 2,
                n_layers: 2,
            },
        ),
        (
            r.write(0, 0, &t[..3], &t[..3]),
            PoolError::BadLength {
                field: "k",
                expected: 4,
                got: 3,
            },
        ),
        (
            r.write(0, 0, &t, &t[..2]),
            PoolError::BadLength {
                field: "v",
                expected: 4,
                got: 2,
            },
        ),
        (
            r.write(0, 7, &t, &t),
            PoolError::PositionOutOfRange {
                position: 8,
                capacity: 8,
            },
        ),
        (
            r.write(0, 9, &t, &t),
            PoolError::PositionOutOfRange {
                position: 9,
                capacity: 8,
            },
        ),
        (
            r.write(0, usize::MAX, &t, &t),
            PoolError::PositionOutOfRange {
                position: usize::MAX,
                capacity: 8,
            },
        ),
    ];
    for (got, want) in cases {
        assert_eq!(got, Err(want));
    }
    assert_eq!((r.written_tokens(0), r.written_tokens(1)), (0, 0));

    r.write(0, 0, &t, &t).expect("0..2");
    let err = r.write(0, 3, &t, &t).expect_err("gap at slot 2");
    assert_eq!(
        err,
        PoolError::WriteGap {
            page: r.table()[0].page,
            layer: 0,
            slot: 3,
            watermark: 2
        }
    );
    assert_eq!(err.kind(), "write_gap");
    assert!(
        err.to_string().contains("slot 3") && err.to_string().contains("watermark 2"),
        "{err}"
    );
    r.write(0, 2, &tokens(2, 6), &tokens(2, 6))
        .expect("2..8 exactly fills the capacity");
    assert_eq!(r.written_tokens(0), 8);
    let msg = PoolError::BadLength {
        field: "k",
        expected: 4,
        got: 3,
    }
    .to_string();
    assert!(
        msg.contains("k has 3") && msg.contains("expected 4"),
        "{msg}"
    );
}

#[test]
fn drop_releases_exactly_once_with_new_generations() {
    let pool = pool(4);
    let mut a = pool.reserve(8).expect("a");
    let b = pool.reserve(4).expect("b");
    a.write(0, 0, &tokens(1, 5), &tokens(1, 5)).expect("write");
    assert_ne!(a.owner(), b.owner());
    let shared = pool.shared();
    for e in a.table() {
        assert_eq!(
            shared.page_state(e.page as usize),
            (e.generation, a.owner().get())
        );
        assert_eq!(e.generation % 2, 1, "allocated pages have odd generations");
    }
    let a_table = a.table().to_vec();
    drop(a);
    for e in &a_table {
        let p = e.page as usize;
        assert_eq!(shared.page_state(p), (e.generation + 1, 0));
        assert_eq!(
            shared
                .watermark(p, 0)
                .map(|w| w.load(std::sync::atomic::Ordering::Relaxed)),
            Some(0)
        );
    }
    // A second release of the same table (impossible through the API) is a
    // no-op: the pages are no longer owned by that tag.
    shared.release(b.owner(), &a_table);
    assert_eq!(pool.free_pages(), 3);
    let c = pool.reserve(8).expect("c reuses a's pages");
    assert_eq!(
        c.table().iter().map(|e| e.page).collect::<Vec<_>>(),
        a_table.iter().map(|e| e.page).collect::<Vec<_>>()
    );
    assert_eq!(c.written_tokens(0), 0, "watermarks reset on release");
    drop((b, c));
    let stats = pool.stats();
    assert_eq!((stats.free_pages, stats.capacity_pages), (4, 4));
    assert_eq!((stats.allocations, stats.releases), (5, 5));
}

#[test]
fn reservations_outlive_the_pool_handle() {
    let pool = pool(2);
    let watcher = pool.clone();
    let mut r = pool.reserve(4).expect("r");
    drop(pool);
    r.write(0, 0, &tokens(1, 1), &tokens(1, 1)).expect("write");
    drop(r);
    assert_eq!(watcher.free_pages(), 2);
}

#[test]
fn owner_tags_are_never_reused() {
    let pool = pool(2);
    let a = pool.reserve(4).expect("a").owner();
    let b = pool.reserve(4).expect("b").owner();
    assert!(b > a);
    pool.shared().set_next_owner(u64::MAX);
    let last = pool.reserve(4).expect("tag u64::MAX");
    assert_eq!(last.owner().get(), u64::MAX);
    assert_eq!(
        pool.reserve(0).expect_err("no tags left"),
        PoolError::OwnerTagsExhausted
    );
    assert_eq!(pool.free_pages(), 1);
    // Growing an existing reservation needs no new tag.
    let mut last = last;
    last.grow(8).expect("grow");
}

#[test]
fn absurd_sizes_are_errors_not_aborts() {
    // 2^50 bytes: valid arithmetic, more than any address space.
    let cfg = PoolConfig {
        page_size: 256,
        n_pages: 1 << 20,
        n_layers: 1 << 10,
        n_kv_heads: 1,
        head_dim: 1 << 9,
        entry: crate::KvEntry::KeyValue,
        ..cfg(1)
    };
    assert_eq!(cfg.bytes(), 1 << 50);
    let err = KvPool::new(cfg).expect_err("no petabyte");
    assert_eq!(err, PoolError::OutOfMemory { bytes: 1 << 50 });
    assert!(
        err.to_string().contains(&(1usize << 50).to_string()),
        "{err}"
    );
    let bad = PoolConfig {
        head_dim: 0,
        entry: crate::KvEntry::KeyValue,
        ..super::cfg(1)
    };
    assert_eq!(
        KvPool::new(bad).expect_err("invalid").kind(),
        "invalid_config"
    );
}

/// Publishing a transfer never raises a watermark past what landed (the
/// receiver-checked bound): with page 1 of a two-page prompt missing in
/// layer 0, reads of page 0 work and the first read of page 1 in layer 0
/// is refused as unwritten, whatever the claimed prompt length; without
/// the bound (one-sided transports) the claim is published.
#[test]
fn publish_is_bounded_by_what_landed() {
    use kvmesh_kernels::{GuardViolation, KvValues};
    let pool = pool(2);
    let mut res = pool.reserve(8).expect("2 pages");
    let table = res.table().to_vec();
    let payload = |n: usize| -> Vec<f32> {
        let k = tokens(1, n);
        let v = tokens(2, n);
        k.iter().chain(&v).copied().collect()
    };
    // Page 0: both layers, all 4 slots. Page 1: layer 1 only.
    for layer in 0..2 {
        res.land(0, layer..layer + 1, 0..4, KvValues::F32(&payload(4)))
            .expect("land page 0");
    }
    res.land(1, 1..2, 0..4, KvValues::F32(&payload(4)))
        .expect("land page 1, layer 1");
    // Landed slots per (page, layer), as the reservation table records them.
    let landed = [4u32, 4, 0, 4];
    res.publish_prompt(8, Some(&landed));
    assert!(super::attend_at(&res, &table, 0, 3).is_ok());
    let e = super::attend_at(&res, &table, 0, 7).expect_err("hole in layer 0");
    assert!(matches!(e, GuardViolation::Unwritten { .. }), "{e:?}");
    assert!(super::attend_at(&res, &table, 1, 7).is_ok());
    assert!(pool.stats().guard_violations >= 1);
    drop(res);
    // Unbounded (one-sided): the claim is what gets published.
    let mut res = pool.reserve(8).expect("2 pages again");
    let table = res.table().to_vec();
    res.publish_prompt(8, None);
    assert!(super::attend_at(&res, &table, 0, 7).is_ok());
}

/// A latent pool (one block per layer: the key, whose leading values are
/// the value) stores half a key-value pool's bytes, takes writes and
/// landings of keys only, refuses a V it cannot hold (nothing written),
/// and reads back with an empty V under the same watermark checks.
#[test]
fn latent_entries_store_keys_only_under_the_same_checks() {
    let pool = KvPool::new(cfg(4).with_entry(crate::KvEntry::Latent)).expect("pool");
    assert_eq!(pool.config().bytes() * 2, cfg(4).bytes());
    let mut r = pool.reserve(8).expect("2 pages");
    let k = tokens(1, 6);
    let err = r.write(0, 0, &k, &k).expect_err("a V on a latent pool");
    assert!(
        matches!(
            err,
            PoolError::BadLength {
                field: "v",
                expected: 0,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(r.written_tokens(0), 0, "nothing written");
    r.write(0, 0, &k, &[]).expect("keys only");
    assert_eq!(r.written_tokens(0), 6);
    let kv = r.reader();
    let p0 = kv.read_page(r.table()[0], 0, 4).expect("page 0");
    let p1 = kv.read_page(r.table()[1], 0, 2).expect("page 1");
    assert_eq!([p0.k.to_f32(), p1.k.to_f32()].concat(), k);
    assert!(p0.v.is_empty() && p1.v.is_empty());
    // I2: slot 2 of page 1 was never written.
    assert!(kv.read_page(r.table()[1], 0, 3).is_err());
    // I2 per layer: layer 1 is unwritten.
    assert!(kv.read_page(r.table()[0], 1, 1).is_err());

    // A frame's payload for a latent page is keys only: one block per
    // layer. A key-value-sized payload is refused whole.
    let one = tokens(5, 4);
    let two: Vec<f32> = [one.clone(), tokens(6, 4)].concat();
    let values = kvmesh_kernels::KvValues::F32(&two);
    assert!(r.land(1, 1..2, 0..4, values).is_err());
    let values = kvmesh_kernels::KvValues::F32(&one);
    r.land(1, 1..2, 0..4, values).expect("keys of one layer");
    let mut seen = Vec::new();
    r.visit_landed(1, 4, |k, v| {
        assert!(v.is_empty());
        seen.push(k.to_f32());
    })
    .expect("in range");
    assert_eq!(seen[1], one);
}
