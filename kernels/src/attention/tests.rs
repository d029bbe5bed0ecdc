//! Paged attention against a dense reference on random inputs. The real pool
//! (with its ownership checks) lives in `kvmesh-kvxfer`, which tests the
//! forged-page cases; here a plain in-memory page store checks only what the
//! kernel asks for, so the tests can see exactly which pages were read.

use std::cell::RefCell;

use super::*;
use crate::paged::KvGeometry;

mod decode_split;
mod f16;

/// Contiguous pages, `written` slots per page, and a log of reads.
struct VecPages {
    geo: KvGeometry,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    generation: Vec<u64>,
    written: Vec<usize>,
    reads: RefCell<Vec<u32>>,
    reported: RefCell<Vec<GuardViolation>>,
    /// When set, the pages as an f16 pool holds them (reads return these).
    half: Option<HalfPages>,
}

/// K and V pages in f16.
type HalfPages = (Vec<Vec<half::f16>>, Vec<Vec<half::f16>>);

impl VecPages {
    /// The same pages as an f16 pool stores them, and as an f32 pool holding
    /// those f16 values: the pair attention must agree on to the bit.
    fn into_f16_pair(mut self) -> (VecPages, VecPages) {
        let round = |pages: &mut Vec<Vec<f32>>| -> Vec<Vec<half::f16>> {
            pages
                .iter_mut()
                .map(|p| {
                    let h: Vec<half::f16> = p.iter().map(|&x| crate::f16_from_f32(x)).collect();
                    p.iter_mut().zip(&h).for_each(|(x, h)| *x = h.to_f32());
                    h
                })
                .collect()
        };
        let (k, v) = (round(&mut self.k), round(&mut self.v));
        let f16 = VecPages {
            geo: self.geo,
            k: self.k.clone(),
            v: self.v.clone(),
            generation: self.generation.clone(),
            written: self.written.clone(),
            reads: RefCell::new(Vec::new()),
            reported: RefCell::new(Vec::new()),
            half: Some((k, v)),
        };
        (f16, self)
    }
}

impl PagedKv for VecPages {
    fn geometry(&self) -> KvGeometry {
        self.geo
    }
    fn read_page(
        &self,
        e: PageRef,
        _layer: usize,
        n: usize,
    ) -> Result<PageSlices<'_>, GuardViolation> {
        let p = e.page as usize;
        if self.generation[p] != e.generation {
            return Err(GuardViolation::StaleGeneration {
                page: e.page,
                expected: e.generation,
                actual: self.generation[p],
            });
        }
        if n > self.written[p] {
            return Err(GuardViolation::Unwritten {
                page: e.page,
                layer: 0,
                requested: n,
                watermark: self.written[p],
            });
        }
        self.reads.borrow_mut().push(e.page);
        let d = self.geo.kv_dim();
        // A latent store keeps no V pages: its reads carry an empty V.
        let nv = if self.geo.entry == crate::KvEntry::Latent {
            0
        } else {
            n * d
        };
        Ok(match &self.half {
            Some((k, v)) => PageSlices {
                k: KvValues::F16(&k[p][..n * d]),
                v: KvValues::F16(&v[p][..nv]),
            },
            None => PageSlices {
                k: KvValues::F32(&self.k[p][..n * d]),
                v: KvValues::F32(&self.v[p][..nv]),
            },
        })
    }
    fn report(&self, v: &GuardViolation) {
        self.reported.borrow_mut().push(v.clone());
    }
}

/// Deterministic pseudo-random values in [-1, 1).
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

/// Dense attention over contiguous K/V `[ctx][kv_dim]`.
fn dense(shape: &AttentionShape, q: &[f32], pos: &[usize], k: &[f32], v: &[f32]) -> Vec<f32> {
    let (nh, nkv, d) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
    let kv_dim = nkv * d;
    let mut out = vec![0.0; q.len()];
    for (t, &p) in pos.iter().enumerate() {
        for h in 0..nh {
            let g = h / (nh / nkv);
            let qv = &q[(t * nh + h) * d..][..d];
            let start = shape.window.map_or(0, |w| (p + 1).saturating_sub(w));
            let scores: Vec<f64> = (start..=p)
                .map(|s| {
                    qv.iter()
                        .zip(&k[s * kv_dim + g * d..][..d])
                        .map(|(a, b)| (*a as f64) * (*b as f64))
                        .sum::<f64>()
                        * shape.scale as f64
                })
                .map(|s| match shape.softcap {
                    Some(cap) => cap as f64 * (s / cap as f64).tanh(),
                    None => s,
                })
                .collect();
            let sink = shape.sinks.as_ref().map(|s| s[h] as f64);
            let m = scores
                .iter()
                .cloned()
                .chain(sink)
                .fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
            for (i, s) in (start..=p).enumerate() {
                for j in 0..d {
                    out[(t * nh + h) * d + j] +=
                        (e[i] / z * v[s * kv_dim + g * d + j] as f64) as f32;
                }
            }
        }
    }
    out
}

/// Scatter contiguous K/V into pages following `table` (physical pages in a
/// shuffled order, so the kernel must follow the table).
fn paged(
    geo: KvGeometry,
    table: &[PageRef],
    n_phys: usize,
    k: &[f32],
    v: &[f32],
    ctx: usize,
) -> VecPages {
    let d = geo.kv_dim();
    let mut store = VecPages {
        geo,
        k: vec![vec![0.0; geo.page_size * d]; n_phys],
        v: vec![vec![0.0; geo.page_size * d]; n_phys],
        generation: vec![0; n_phys],
        written: vec![0; n_phys],
        reads: RefCell::new(Vec::new()),
        reported: RefCell::new(Vec::new()),
        half: None,
    };
    for pos in 0..ctx {
        let e = table[pos / geo.page_size];
        let slot = pos % geo.page_size;
        let p = e.page as usize;
        store.generation[p] = e.generation;
        store.k[p][slot * d..][..d].copy_from_slice(&k[pos * d..][..d]);
        store.v[p][slot * d..][..d].copy_from_slice(&v[pos * d..][..d]);
        store.written[p] = store.written[p].max(slot + 1);
    }
    store
}

fn shuffled_table(n: usize, n_phys: usize) -> Vec<PageRef> {
    (0..n)
        .map(|i| PageRef {
            page: ((i * 7 + 3) % n_phys) as u32,
            generation: 2 * i as u64 + 1,
        })
        .collect()
}

/// Shape, page table (scattered among `spare` more physical pages than it
/// needs), the paged store and its K and V for one test case.
type Case = (usize, usize, usize, usize, usize, Option<usize>);

fn setup(
    case: Case,
    spare: usize,
    seed: u64,
) -> (AttentionShape, Vec<PageRef>, VecPages, Vec<f32>, Vec<f32>) {
    let (nh, nkv, d, ps, ctx, window) = case;
    let geo = KvGeometry {
        page_size: ps,
        n_kv_heads: nkv,
        head_dim: d,
        entry: crate::KvEntry::KeyValue,
    };
    let shape = AttentionShape {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: d,
        v_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
        window,
        softcap: None,
        sinks: None,
    };
    let n_pages = ctx.div_ceil(ps);
    let table = shuffled_table(n_pages, n_pages + spare);
    let k = noise(seed, ctx * nkv * d);
    let v = noise(seed + 1, ctx * nkv * d);
    let store = paged(geo, &table, n_pages + spare, &k, &v, ctx);
    (shape, table, store, k, v)
}

#[test]
fn matches_dense_reference_for_prefill_and_decode_shapes() {
    for (nh, nkv, d, ps, ctx, window) in [
        (4, 2, 16, 4, 13usize, None),
        (9, 3, 64, 16, 70, None),
        (8, 8, 8, 1, 5, None),
        (6, 2, 32, 8, 40, Some(9)),
        (9, 3, 64, 16, 83, Some(21)),
        (4, 1, 128, 16, 50, None),
    ] {
        let (mut shape, table, store, k, v) = setup((nh, nkv, d, ps, ctx, window), 5, 1);
        for (path, softcap, sinks) in crate::cpu::available_paths()
            .into_iter()
            .flat_map(|p| SOFTCAPS.map(|c| (p, c)))
            .flat_map(|(p, c)| [false, true].map(|s| (p, c, s)))
        {
            shape.softcap = softcap;
            shape.sinks = sinks.then(|| test_sinks(nh));
            // Prefill: every position; decode: the last one only.
            for positions in [(0..ctx).collect::<Vec<_>>(), vec![ctx - 1]] {
                let q = noise(3, positions.len() * nh * d);
                let mut out = vec![0.0; q.len()];
                paged_attention_with(path, &store, &table, 0, &shape, &q, &positions, &mut out)
                    .expect("valid read");
                let want = dense(&shape, &q, &positions, &k, &v);
                let err = out
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    err < 1e-5,
                    "{path}: max abs error {err} for shape {nh}/{nkv}/{d} page {ps} ctx {ctx} cap {softcap:?} sinks {sinks}"
                );
            }
        }
    }
}

/// Whether `a` and `b` hold the same bits, value by value.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// One sink per head, from well below the tests' scores (about +-1) to
/// well above them, so some heads give the sink most of their weight and
/// others almost none.
fn test_sinks(n_heads: usize) -> Arc<[f32]> {
    (0..n_heads)
        .map(|h| -3.0 + 6.0 * h as f32 / n_heads.max(2).saturating_sub(1) as f32)
        .collect()
}

/// A sink takes a share of each head's softmax (so a path that ignored it
/// would fail the dense comparison above), by head: a sink far below every
/// score changes the output by rounding only, one far above it leaves
/// almost nothing.
#[test]
fn sinks_take_their_share_of_the_softmax() {
    let (mut shape, table, store, _, _) = setup((9, 3, 64, 16, 70, Some(21)), 5, 1);
    let positions: Vec<usize> = (0..70).collect();
    let q = noise(3, positions.len() * 9 * 64);
    let mut run = |sinks: Option<Arc<[f32]>>| {
        shape.sinks = sinks;
        let mut out = vec![0.0; q.len()];
        paged_attention(&store, &table, 0, &shape, &q, &positions, &mut out).expect("valid read");
        out
    };
    let diff = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    };
    let plain = run(None);
    assert!(diff(&plain, &run(Some(test_sinks(9)))) > 1e-2);
    assert!(diff(&plain, &run(Some(vec![-1e4; 9].into()))) < 1e-6);
    let drowned = run(Some(vec![60.0; 9].into()));
    assert!(drowned.iter().all(|x| x.abs() < 1e-20));
    assert_eq!(with_sink(1.0, None), (1.0, 0.0));
    assert_eq!(with_sink(1.0, Some(3.0)), (3.0, 1.0));
    assert!(with_sink(1.0, Some(f32::NAN)).1.is_nan());
}

/// Soft-capping with a cap small enough to saturate some of the tests'
/// scores (about +-1 before the cap), and none.
const SOFTCAPS: [Option<f32>; 2] = [None, Some(0.6)];

/// The cap changes the result where scores reach it (so a path that
/// ignored it would fail the dense comparison above), and a cap far above
/// every score changes it by rounding only.
#[test]
fn softcap_changes_attention_where_scores_reach_it() {
    let (mut shape, table, store, _, _) = setup((9, 3, 64, 16, 70, Some(21)), 5, 1);
    let positions: Vec<usize> = (0..70).collect();
    let q = noise(3, positions.len() * 9 * 64);
    let mut run = |cap: Option<f32>| {
        shape.softcap = cap;
        let mut out = vec![0.0; q.len()];
        paged_attention(&store, &table, 0, &shape, &q, &positions, &mut out).expect("valid read");
        out
    };
    let diff = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    };
    let plain = run(None);
    assert!(diff(&plain, &run(Some(0.6))) > 1e-3);
    assert!(diff(&plain, &run(Some(1e4))) < 1e-6);
    assert_eq!(softcap(3.0, None), 3.0);
    assert_eq!(softcap(0.0, Some(50.0)), 0.0);
    assert!((softcap(1e9, Some(50.0)) - 50.0).abs() < 1e-4);
    assert!((softcap(-1e9, Some(50.0)) + 50.0).abs() < 1e-4);
}

#[test]
fn violation_reads_nothing_and_leaves_output_untouched() {
    let geo = KvGeometry {
        page_size: 4,
        n_kv_heads: 1,
        head_dim: 8,
        entry: crate::KvEntry::KeyValue,
    };
    let shape = AttentionShape {
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 8,
        v_dim: 8,
        scale: 0.3,
        window: None,
        softcap: None,
        sinks: None,
    };
    let table = shuffled_table(3, 6);
    let k = noise(5, 12 * 8);
    let store = paged(geo, &table, 6, &k, &k, 12);
    let mut forged = table.clone();
    forged[2].generation += 2;
    let q = noise(6, 2 * 8);
    let mut out = vec![42.0; q.len()];
    let err = paged_attention(&store, &forged, 0, &shape, &q, &[11], &mut out)
        .expect_err("stale generation must fail");
    assert!(matches!(err, GuardViolation::StaleGeneration { .. }));
    assert!(
        out.iter().all(|&x| x == 42.0),
        "output written despite a violation"
    );
    // A read one slot past what was written fails on I2.
    let err = paged_attention(&store, &table, 0, &shape, &q, &[12], &mut out)
        .expect_err("past the table");
    assert!(matches!(err, GuardViolation::TableTooShort { .. }));
    assert_eq!(
        *store.reported.borrow(),
        vec![err],
        "the kernel reports what it refuses itself"
    );
}

#[test]
fn sliding_window_skips_pages_outside_every_window() {
    let geo = KvGeometry {
        page_size: 4,
        n_kv_heads: 1,
        head_dim: 4,
        entry: crate::KvEntry::KeyValue,
    };
    let shape = AttentionShape {
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 4,
        v_dim: 4,
        scale: 0.5,
        window: Some(4),
        softcap: None,
        sinks: None,
    };
    let table = shuffled_table(4, 4);
    let k = noise(8, 16 * 4);
    let store = paged(geo, &table, 4, &k, &k, 16);
    let q = noise(9, 4);
    let mut out = vec![0.0; 4];
    paged_attention(&store, &table, 0, &shape, &q, &[15], &mut out).expect("valid read");
    assert_eq!(
        *store.reads.borrow(),
        vec![table[3].page],
        "only the last page is in the window"
    );
}

/// A query's output is the same to the bit alone (a decode step) as in a
/// block of any prompt chunk, windowed or not, soft-capped or not: what
/// keeps the mesh equal to the reference engine.
#[test]
fn a_query_computes_the_same_bits_alone_and_in_any_block() {
    for (nh, nkv, d, ps, ctx, window) in [
        (9, 3, 64, 16, 70usize, None),
        (9, 3, 64, 16, 70, Some(13)),
        (6, 2, 32, 8, 41, Some(40)),
        (4, 4, 16, 4, 23, None),
    ] {
        let (mut shape, table, store, _, _) = setup((nh, nkv, d, ps, ctx, window), 3, 4);
        shape.softcap = if window.is_some() { Some(0.6) } else { None };
        // Sinks on the cases without a cap and on one with it.
        shape.sinks = (window.is_none() || nh == 6).then(|| test_sinks(nh));
        let q = noise(6, ctx * nh * d);
        let run = |from: usize, to: usize| {
            let positions: Vec<usize> = (from..to).collect();
            let mut out = vec![0.0; positions.len() * nh * d];
            paged_attention(
                &store,
                &table,
                0,
                &shape,
                &q[from * nh * d..to * nh * d],
                &positions,
                &mut out,
            )
            .expect("valid read");
            out
        };
        let whole = run(0, ctx);
        for (from, to) in [
            (0, 1),
            (5, 6),
            (ctx - 1, ctx),
            (3, 22),
            (17, ctx),
            (1, ctx - 2),
        ] {
            let part = run(from, to);
            let same = same_bits(&part, &whole[from * nh * d..to * nh * d]);
            assert!(same, "positions {from}..{to} differ from the whole prompt ({nh}/{nkv}/{d}, window {window:?})");
        }
    }
}

/// The AVX-512 build computes the AVX2 build's bits: tiled head sizes
/// (multiples of 32) and the generic block's (16, 8, 40), f32 and f16
/// pools, windows, soft-capped or not, with sinks or not, prefill chunks and single decode
/// queries; and within
/// the AVX-512 path a query's bits do not depend on its block.
#[test]
fn avx512_attention_equals_avx2_to_the_bit() {
    use crate::cpu::Path;
    if !crate::cpu::require(Path::Avx512) {
        return;
    }
    for (nh, nkv, d, ps, ctx, window) in [
        (9, 3, 64, 16, 70usize, None),
        (9, 3, 64, 16, 83, Some(21)),
        (4, 1, 128, 16, 50, None),
        (6, 2, 32, 8, 41, Some(40)),
        (14, 2, 64, 16, 37, None),
        (4, 2, 16, 4, 13, None),
        (8, 8, 8, 1, 5, None),
        (5, 5, 40, 4, 19, Some(7)),
    ] {
        let (mut shape, table, store, _, _) = setup((nh, nkv, d, ps, ctx, window), 7, 3);
        let (f16, f32) = store.into_f16_pair();
        for (pages, softcap, sinks) in [&f16, &f32]
            .into_iter()
            .flat_map(|p| SOFTCAPS.map(|c| (p, c)))
            .flat_map(|(p, c)| [false, true].map(|s| (p, c, s)))
        {
            shape.softcap = softcap;
            shape.sinks = sinks.then(|| test_sinks(nh));
            let q = noise(12, ctx * nh * d);
            let run = |path: Path, from: usize, to: usize| {
                let positions: Vec<usize> = (from..to).collect();
                let mut out = vec![0.0; positions.len() * nh * d];
                paged_attention_with(
                    path,
                    pages,
                    &table,
                    0,
                    &shape,
                    &q[from * nh * d..to * nh * d],
                    &positions,
                    &mut out,
                )
                .expect("valid read");
                out
            };
            // The first element whose bits differ, if any.
            let differ = |a: &[f32], b: &[f32]| {
                assert_eq!(a.len(), b.len());
                a.iter()
                    .zip(b)
                    .position(|(x, y)| x.to_bits() != y.to_bits())
            };
            let whole = run(Path::Avx512, 0, ctx);
            assert_eq!(
                differ(&whole, &run(Path::Avx2, 0, ctx)),
                None,
                "({nh}/{nkv}/{d}, window {window:?}, cap {softcap:?}, sinks {sinks}) prefill"
            );
            for (from, to) in [(0, 1), (ctx - 1, ctx), (3, ctx / 2 + 3), (ctx / 3, ctx)] {
                let part = run(Path::Avx512, from, to);
                assert_eq!(
                    differ(&part, &run(Path::Avx2, from, to)),
                    None,
                    "({nh}/{nkv}/{d}) {from}..{to}"
                );
                assert_eq!(
                    differ(&part, &whole[from * nh * d..to * nh * d]),
                    None,
                    "({nh}/{nkv}/{d}) {from}..{to} alone vs whole"
                );
            }
        }
    }
}

/// Latent entries (multi-head latent attention): one stored vector per
/// token that is the key, whose leading `v_dim` values are the value;
/// every query head shares it. Every path, a prompt and a decode step, f32
/// and f16 pools, against a dense reference that reads the value out of
/// the key; and a read past the watermark still fails with nothing written.
#[test]
fn latent_entries_are_the_key_and_lead_with_the_value() {
    let (nh, d, v_dim, ps, ctx): (usize, usize, usize, usize, usize) = (6, 40, 32, 4, 23);
    let geo = KvGeometry {
        page_size: ps,
        n_kv_heads: 1,
        head_dim: d,
        entry: crate::KvEntry::Latent,
    };
    let shape = AttentionShape {
        n_heads: nh,
        n_kv_heads: 1,
        head_dim: d,
        v_dim,
        scale: 0.2,
        window: None,
        softcap: None,
        sinks: None,
    };
    let n_pages = ctx.div_ceil(ps);
    let table = shuffled_table(n_pages, n_pages + 3);
    let k = noise(11, ctx * d);
    let mut store = paged(geo, &table, n_pages + 3, &k, &k, ctx);
    // A latent pool stores no V block.
    store.v.iter_mut().for_each(Vec::clear);
    let (f16, f32s) = store.into_f16_pair();
    for (store, what) in [(&f32s, "f32"), (&f16, "f16")] {
        // The reference reads K as the pool holds it (f16-rounded for both:
        // `into_f16_pair` rounds the f32 twin too).
        let k: Vec<f32> = (0..ctx)
            .flat_map(|p| {
                let e = table[p / ps];
                f32s.k[e.page as usize][(p % ps) * d..][..d].to_vec()
            })
            .collect();
        for path in crate::cpu::available_paths() {
            for positions in [(0..ctx).collect::<Vec<_>>(), vec![ctx - 1]] {
                let q = noise(12, positions.len() * nh * d);
                let mut out = vec![0.0; positions.len() * nh * v_dim];
                paged_attention_with(path, store, &table, 0, &shape, &q, &positions, &mut out)
                    .expect("valid read");
                let mut want = vec![0.0f32; out.len()];
                for (t, &p) in positions.iter().enumerate() {
                    for h in 0..nh {
                        let qv = &q[(t * nh + h) * d..][..d];
                        let s: Vec<f64> = (0..=p)
                            .map(|j| {
                                let kj = &k[j * d..][..d];
                                qv.iter()
                                    .zip(kj)
                                    .map(|(a, b)| *a as f64 * *b as f64)
                                    .sum::<f64>()
                                    * 0.2
                            })
                            .collect();
                        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                        for (j, sj) in s.iter().enumerate() {
                            let w = (sj - m).exp() / z;
                            for c in 0..v_dim {
                                want[(t * nh + h) * v_dim + c] += (w * k[j * d + c] as f64) as f32;
                            }
                        }
                    }
                }
                let err = out
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(err < 1e-5, "{path} {what}: max abs error {err}");
            }
        }
    }
    // I2 holds as for key-value pools: one slot past the written ones.
    let mut out = vec![7.0; nh * v_dim];
    let q = noise(13, nh * d);
    let mut short = table.clone();
    short.truncate(n_pages - 1);
    let err = paged_attention(&f32s, &short, 0, &shape, &q, &[ctx - 1], &mut out)
        .expect_err("past the table");
    assert!(matches!(err, GuardViolation::TableTooShort { .. }));
    assert!(out.iter().all(|&x| x == 7.0));
}
