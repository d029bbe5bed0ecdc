//! I6: what scrubbing and poisoning leave in storage, and that the read
//! checks, not zeroing, are what keep old bytes from being read.

use kvmesh_kernels::{GuardViolation, PagedKv};

use super::{attend_at, cfg, tokens};
use crate::{KvPool, PoolConfig, ScrubMode, POISON_BITS};

fn pool_with(scrub: ScrubMode, poison: bool) -> KvPool {
    KvPool::new(PoolConfig {
        scrub,
        poison,
        ..cfg(2)
    })
    .expect("pool")
}

fn is_canary(page: &[f32]) -> bool {
    page.iter().all(|x| x.to_bits() == POISON_BITS)
}

fn is_zero(page: &[f32]) -> bool {
    page.iter().all(|x| x.to_bits() == 0)
}

/// Reserves one page, fills every slot of every layer, and returns its id.
fn write_and_drop(pool: &KvPool, seed: u32) -> usize {
    let mut r = pool.reserve(4).expect("reserve");
    for layer in 0..2 {
        r.write(layer, 0, &tokens(seed, 4), &tokens(seed + 1, 4))
            .expect("write");
    }
    let page = r.table()[0].page as usize;
    assert!(
        pool.shared().page_copy(page).iter().all(|x| *x >= 1.0),
        "written"
    );
    page
}

#[test]
fn poison_fills_new_and_released_pages_and_allocation_keeps_it() {
    for scrub in [ScrubMode::Off, ScrubMode::OnRelease, ScrubMode::OnAllocate] {
        let pool = pool_with(scrub, true);
        assert!(
            (0..2).all(|p| is_canary(&pool.shared().page_copy(p))),
            "{scrub}: fresh pool"
        );
        let page = write_and_drop(&pool, 1);
        assert!(
            is_canary(&pool.shared().page_copy(page)),
            "{scrub}: released page"
        );
        let r = pool.reserve(4).expect("same page again");
        assert_eq!(r.table()[0].page as usize, page);
        assert!(
            is_canary(&pool.shared().page_copy(page)),
            "{scrub}: allocation must not zero the canary"
        );
    }
}

#[test]
fn poison_catches_a_read_that_slipped_past_the_watermark() {
    let pool = pool_with(ScrubMode::Off, true);
    let mut r = pool.reserve(8).expect("reserve");
    r.write(0, 0, &tokens(1, 2), &tokens(2, 2))
        .expect("2 tokens");
    attend_at(&r, r.table(), 0, 1).expect("written slots read fine: no false alarm");

    // A watermark bug: slots 2..4 claimed written but never were.
    r.force_watermark(0, 0, 4);
    let before = pool.stats();
    let err = attend_at(&r, r.table(), 0, 3).expect_err("canary");
    assert_eq!(
        err,
        GuardViolation::Poisoned {
            page: r.table()[0].page,
            layer: 0
        }
    );
    let after = pool.stats();
    assert_eq!(after.guard_violations, before.guard_violations + 1);
    assert_eq!(after.violations_of("poisoned"), 1);

    // The same bug on a page never written at all (canary from creation).
    r.force_watermark(1, 1, 1);
    let err = r
        .reader()
        .read_page(r.table()[1], 1, 1)
        .expect_err("canary");
    assert_eq!(err.kind(), "poisoned");
    assert_eq!(pool.guard_violations(), after.guard_violations + 1);
}

#[test]
fn without_poison_a_watermark_bug_would_go_unseen() {
    // The contrast that justifies poison mode in debug runs: the same
    // simulated bug in a plain pool reads stale storage without complaint.
    let pool = pool_with(ScrubMode::Off, false);
    let mut r = pool.reserve(4).expect("reserve");
    r.write(0, 0, &tokens(1, 2), &tokens(2, 2))
        .expect("2 tokens");
    r.force_watermark(0, 0, 4);
    attend_at(&r, r.table(), 0, 3).expect("nothing catches it");
    assert_eq!(pool.guard_violations(), 0);
}

#[test]
fn scrub_on_release_zeroes_released_pages() {
    let pool = pool_with(ScrubMode::OnRelease, false);
    let page = write_and_drop(&pool, 1);
    assert!(is_zero(&pool.shared().page_copy(page)));
}

#[test]
fn scrub_on_allocate_zeroes_at_the_next_allocation() {
    let pool = pool_with(ScrubMode::OnAllocate, false);
    let page = write_and_drop(&pool, 1);
    assert!(
        pool.shared().page_copy(page).iter().all(|x| *x >= 1.0),
        "release leaves the bytes"
    );
    let r = pool.reserve(4).expect("same page");
    assert_eq!(r.table()[0].page as usize, page);
    assert!(is_zero(&pool.shared().page_copy(page)));
}

#[test]
fn scrub_off_keeps_old_bytes_and_the_checks_still_refuse_them() {
    let pool = pool_with(ScrubMode::Off, false);
    let page = write_and_drop(&pool, 1);
    let old = pool.shared().page_copy(page);
    let mut d = pool.reserve(4).expect("same page");
    assert_eq!(d.table()[0].page as usize, page);
    assert_eq!(
        pool.shared().page_copy(page),
        old,
        "the previous owner's KV is still there"
    );

    // ... and D cannot read a single slot of it.
    let err = attend_at(&d, d.table(), 0, 0).expect_err("unwritten");
    assert_eq!(
        err,
        GuardViolation::Unwritten {
            page: page as u32,
            layer: 0,
            requested: 1,
            watermark: 0
        }
    );
    assert_eq!(
        d.reader()
            .read_page(d.table()[0], 1, 4)
            .expect_err("unwritten")
            .kind(),
        "unwritten"
    );
    assert_eq!(pool.stats().violations_of("unwritten"), 2);
    // Once D writes a slot, it reads exactly that slot, its own.
    d.write(0, 0, &tokens(9, 1), &tokens(9, 1)).expect("write");
    let kv = d.reader();
    let s = kv.read_page(d.table()[0], 0, 1).expect("own slot");
    assert_eq!(s.k.to_f32(), tokens(9, 1));
}

/// Cost of zeroing one page of the default model's shape (30 layers, 16
/// slots, 3 KV heads of 64) against the allocation itself. Run with
/// `cargo test -p kvmesh-kvxfer --release --lib -- --ignored scrub_cost --nocapture`.
/// Measured about 100 µs per 720 KiB page scrubbed, 20-35 ns unscrubbed (see
/// [`crate::ScrubMode`]).
#[test]
#[ignore = "timing, run by hand"]
fn scrub_cost() {
    // 64 pages of 720 KiB (45 MiB, beyond the caches), all reserved and
    // released per cycle, so each fill streams from memory.
    let (pages, cycles) = (64, 50);
    for scrub in [ScrubMode::Off, ScrubMode::OnRelease, ScrubMode::OnAllocate] {
        let cfg = PoolConfig {
            scrub,
            ..PoolConfig::for_tokens(pages * 16, 16, 30, 3, 64)
        };
        let page_kib = cfg.bytes() / cfg.n_pages / 1024;
        let pool = KvPool::new(cfg).expect("pool");
        // First touch of fresh memory is paid once per pool, not per cycle.
        let mut warm = pool.reserve(pages * 16).expect("all");
        for layer in 0..30 {
            let t = vec![1.0; pages * 16 * 192];
            warm.write(layer, 0, &t, &t).expect("touch");
        }
        drop(warm);
        let t = std::time::Instant::now();
        for _ in 0..cycles {
            drop(pool.reserve(pages * 16).expect("all"));
        }
        let per_page = t.elapsed() / (cycles * pages) as u32;
        println!("scrub {scrub:<12} page {page_kib} KiB: {per_page:?} per page allocate+release");
    }
}
