//! Forged and stale page tables against real pool data, through the real
//! attention kernel (I1, I2). Two live reservations A and B hold written KV;
//! every forged read must fail with the right violation, count exactly one
//! alarm, leave the output buffer untouched, and leave A's and B's attention
//! bit-for-bit what it was. Every test runs over both entry kinds: key and
//! value blocks, and latent entries (one block that is the key and leads
//! with the value).

use kvmesh_kernels::{paged_attention, AttentionShape, GuardViolation, KvEntry, PageRef};
use kvmesh_kvpool::{KvPool, PoolConfig, PoolStats, Reservation, GUARD_VIOLATION_KINDS};

const PAGE: usize = 4;
const LAYERS: usize = 2;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 4;
const KV_DIM: usize = KV_HEADS * HEAD_DIM;
const ENTRIES: [KvEntry; 2] = [KvEntry::KeyValue, KvEntry::Latent];

/// Four query heads over the pool's entries: over latent ones each head's
/// value is the leading 3 of its key's 4 values.
fn shape(entry: KvEntry) -> AttentionShape {
    AttentionShape {
        n_heads: 4,
        n_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        v_dim: match entry {
            KvEntry::KeyValue => HEAD_DIM,
            KvEntry::Latent => HEAD_DIM - 1,
        },
        scale: 0.5,
        window: None,
        softcap: None,
        sinks: None,
    }
}
const Q_STRIDE: usize = 4 * HEAD_DIM;
/// What `out` holds before a call; a failed call must leave it.
const SENTINEL: f32 = 7.25;

/// Deterministic values in [-1, 1), distinct per seed.
fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn pool(entry: KvEntry) -> KvPool {
    let cfg = PoolConfig {
        n_pages: 16,
        ..PoolConfig::for_tokens(0, PAGE, LAYERS, KV_HEADS, HEAD_DIM).with_entry(entry)
    };
    KvPool::new(cfg).expect("pool")
}

/// The V a write hands the pool: `v`, or nothing for latent entries.
fn v_of(pool: &KvPool, v: &[f32]) -> Vec<f32> {
    match pool.config().entry {
        KvEntry::KeyValue => v.to_vec(),
        KvEntry::Latent => Vec::new(),
    }
}

/// Reserves `cap` tokens and writes `n` tokens of seed-derived KV at every
/// layer.
fn written(pool: &KvPool, seed: u64, cap: usize, n: usize) -> Reservation {
    let mut r = pool.reserve(cap).expect("reserve");
    for layer in 0..LAYERS {
        let k = noise(seed * 100 + layer as u64, n * KV_DIM);
        let v = v_of(pool, &noise(seed * 100 + 50 + layer as u64, n * KV_DIM));
        r.write(layer, 0, &k, &v).expect("write");
    }
    assert_eq!(r.written_tokens(0), n);
    r
}

/// Attention of `res`'s reader over `table` for queries at `positions`.
/// On failure, checks that `out` was not touched.
fn attend(
    res: &Reservation,
    table: &[PageRef],
    layer: usize,
    positions: &[usize],
) -> Result<Vec<f32>, GuardViolation> {
    let q = noise(999 + layer as u64, positions.len() * Q_STRIDE);
    let shape = shape(kvmesh_kernels::PagedKv::geometry(&res.reader()).entry);
    let mut out = vec![SENTINEL; positions.len() * 4 * shape.v_dim];
    let r = paged_attention(&res.reader(), table, layer, &shape, &q, positions, &mut out);
    match r {
        Ok(()) => Ok(out),
        Err(v) => {
            assert!(
                out.iter().all(|&x| x == SENTINEL),
                "failed call wrote to out"
            );
            Err(v)
        }
    }
}

/// Every written position of `res`, at every layer.
fn full(res: &Reservation) -> Vec<Vec<f32>> {
    let positions: Vec<usize> = (0..res.written_tokens(0)).collect();
    (0..LAYERS)
        .map(|layer| attend(res, res.table(), layer, &positions).expect("own attention"))
        .collect()
}

/// Bit-for-bit equal. Under Miri, which perturbs `exp` on purpose (its
/// precision is unspecified), within 1e-5.
fn same(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    if cfg!(miri) {
        let close = got
            .iter()
            .flatten()
            .zip(want.iter().flatten())
            .all(|(a, b)| (a - b).abs() <= 1e-5);
        assert!(close && got.concat().len() == want.concat().len(), "{what}");
    } else {
        assert_eq!(got, want, "{what}");
    }
}

struct World {
    pool: KvPool,
    a: Reservation,
    b: Reservation,
    base_a: Vec<Vec<f32>>,
    base_b: Vec<Vec<f32>>,
}

impl World {
    fn new(entry: KvEntry) -> Self {
        let pool = pool(entry);
        let a = written(&pool, 1, 8, 6);
        let b = written(&pool, 2, 8, 5);
        let (base_a, base_b) = (full(&a), full(&b));
        Self {
            pool,
            a,
            b,
            base_a,
            base_b,
        }
    }

    fn assert_unaffected(&self) {
        same(&full(&self.a), &self.base_a, "A's attention changed");
        same(&full(&self.b), &self.base_b, "B's attention changed");
    }

    /// Runs `f`, which must make exactly one guarded read fail with `kind`.
    fn expect_one(&self, kind: &str, f: impl FnOnce() -> GuardViolation) -> GuardViolation {
        let before = self.pool.stats();
        let v = f();
        assert_eq!(v.kind(), kind, "{v}");
        let after = self.pool.stats();
        assert_eq!(after.guard_violations, before.guard_violations + 1);
        assert_eq!(self.pool.guard_violations(), after.guard_violations);
        for k in GUARD_VIOLATION_KINDS {
            let want = before.violations_of(k) + u64::from(k == kind);
            assert_eq!(after.violations_of(k), want, "counter {k}");
        }
        v
    }
}

#[test]
fn stale_generation_after_reuse_is_refused() {
    for entry in ENTRIES {
        let w = World::new(entry);
        let c = written(&w.pool, 3, PAGE, 3);
        let c_table = c.table().to_vec();
        drop(c);
        let d = written(&w.pool, 4, PAGE, 3);
        // The free list is LIFO: D got C's physical page, under a new generation.
        assert_eq!(d.table()[0].page, c_table[0].page);
        assert_eq!(d.table()[0].generation, c_table[0].generation + 2);

        let v = w.expect_one("stale_generation", || {
            attend(&d, &c_table, 0, &[0, 1, 2]).expect_err("stale")
        });
        assert_eq!(
            v,
            GuardViolation::StaleGeneration {
                page: c_table[0].page,
                expected: c_table[0].generation,
                actual: d.table()[0].generation,
            }
        );
        // Through anyone else's reader it is just as stale.
        w.expect_one("stale_generation", || {
            attend(&w.a, &c_table, 1, &[0]).expect_err("stale")
        });
        w.assert_unaffected();
        // D itself reads its own page fine.
        attend(&d, d.table(), 0, &[0, 1, 2]).expect("D's own table");
    }
}

#[test]
fn foreign_page_is_refused() {
    for entry in ENTRIES {
        let w = World::new(entry);
        let mut forged = w.a.table().to_vec();
        forged[1] = w.b.table()[0];
        // B's page 0 is fully written, so only ownership can stop this read.
        let v = w.expect_one("foreign_page", || {
            attend(&w.a, &forged, 0, &[4, 5]).expect_err("foreign")
        });
        assert_eq!(
            v,
            GuardViolation::ForeignPage {
                page: w.b.table()[0].page
            }
        );
        // A table made entirely of B's entries, read by A, fails on the first.
        let v = w.expect_one("foreign_page", || {
            attend(&w.a, w.b.table(), 1, &[0, 1]).expect_err("foreign")
        });
        assert_eq!(
            v,
            GuardViolation::ForeignPage {
                page: w.b.table()[0].page
            }
        );
        w.assert_unaffected();
    }
}

#[test]
fn read_past_watermark_is_refused() {
    for entry in ENTRIES {
        let w = World::new(entry);
        // A wrote 6 tokens: page 1 has slots 0..2; position 6 needs slot 2.
        for (layer, pos) in [(0, 6), (1, 7)] {
            let v = w.expect_one("unwritten", || {
                attend(&w.a, w.a.table(), layer, &[pos]).expect_err("unwritten")
            });
            assert_eq!(
                v,
                GuardViolation::Unwritten {
                    page: w.a.table()[1].page,
                    layer,
                    requested: pos - PAGE + 1,
                    watermark: 2
                }
            );
        }
        w.assert_unaffected();
    }
}

#[test]
fn out_of_range_page_and_layer_are_refused() {
    for entry in ENTRIES {
        let w = World::new(entry);
        let mut forged = w.a.table().to_vec();
        forged[0].page = 999;
        let v = w.expect_one("page_out_of_range", || {
            attend(&w.a, &forged, 0, &[0]).expect_err("range")
        });
        assert_eq!(
            v,
            GuardViolation::PageOutOfRange {
                page: 999,
                n_pages: 16
            }
        );
        let v = w.expect_one("layer_out_of_range", || {
            attend(&w.a, w.a.table(), LAYERS, &[0]).expect_err("layer")
        });
        assert_eq!(
            v,
            GuardViolation::LayerOutOfRange {
                layer: LAYERS,
                n_layers: LAYERS
            }
        );
        w.assert_unaffected();
    }
}

#[test]
fn concurrent_readers_see_their_own_kv_while_pages_churn() {
    for entry in ENTRIES {
        let w = World::new(entry);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    for _ in 0..50 {
                        w.assert_unaffected();
                    }
                });
            }
            s.spawn(|| {
                for i in 0..200 {
                    let mut c = w.pool.reserve(2 * PAGE).expect("reserve");
                    let k = noise(i, 2 * PAGE * KV_DIM);
                    c.write(0, 0, &k, &v_of(&w.pool, &k)).expect("write");
                    let mut forged = w.a.table().to_vec();
                    forged[0] = c.table()[0];
                    assert!(attend(&w.a, &forged, 0, &[0]).is_err());
                }
            });
        });
        let stats = w.pool.stats();
        assert_eq!(stats.violations_of("foreign_page"), 200);
        drop(w.a);
        drop(w.b);
        assert_lifetimes_closed(&w.pool.stats());
    }
}

/// I7: with every reservation dropped, all pages are free again.
fn assert_lifetimes_closed(stats: &PoolStats) {
    assert_eq!(stats.free_pages, stats.capacity_pages);
    assert_eq!(stats.allocations, stats.releases);
}
