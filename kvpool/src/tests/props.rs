//! Property test: random interleavings of reserve, grow, write and drop
//! over a small pool, against a plain model of what each reservation wrote.
//! After every step: generations only move forward and are odd exactly when
//! owned; no page is in two live tables; every live entry matches its page's
//! generation and owner; free + held == capacity; a refused reserve or grow
//! took nothing; every written slot reads back exactly, and the slot above
//! each watermark is refused. At the end, all pages are free (I7).

use std::collections::HashSet;

use kvmesh_kernels::{GuardViolation, PagedKv};
use proptest::prelude::*;

use crate::{KvPool, PoolConfig, PoolError, Reservation, ScrubMode};

const PS: usize = 3;
const PAGES: usize = 6;
const LAYERS: usize = 2;
const KVD: usize = 2;

#[derive(Clone, Debug)]
enum Op {
    Reserve(usize),
    Grow(usize, usize),
    Write {
        idx: usize,
        layer: usize,
        start: usize,
        n: usize,
    },
    Drop(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..=20).prop_map(Op::Reserve),
        1 => (any::<usize>(), 0usize..=20).prop_map(|(i, t)| Op::Grow(i, t)),
        5 => (any::<usize>(), 0..=LAYERS, 0usize..=19, 0usize..=5)
            .prop_map(|(idx, layer, start, n)| Op::Write { idx, layer, start, n }),
        2 => any::<usize>().prop_map(Op::Drop),
    ]
}

/// A live reservation and, per layer and position, the K and V it wrote.
struct Live {
    res: Reservation,
    data: Vec<Vec<Option<[f32; 2 * KVD]>>>,
}

impl Live {
    /// Model watermark: written slots contiguous from slot 0 of the page.
    fn watermark(&self, logical_page: usize, layer: usize) -> usize {
        let page = &self.data[layer][logical_page * PS..(logical_page + 1) * PS];
        page.iter().take_while(|s| s.is_some()).count()
    }

    fn grow_model(&mut self) {
        let cap = self.res.capacity_tokens();
        for layer in &mut self.data {
            layer.resize(cap, None);
        }
    }

    /// The error kind the pool must return for this write, if any.
    fn expected_write(&self, layer: usize, start: usize, n: usize) -> Option<&'static str> {
        if layer >= LAYERS {
            return Some("layer_out_of_range");
        }
        if n == 0 {
            return None;
        }
        if start + n > self.res.capacity_tokens() {
            return Some("position_out_of_range");
        }
        (start % PS > self.watermark(start / PS, layer)).then_some("write_gap")
    }
}

/// Every page's generation moved only forward since `gens` (updated), and
/// is odd exactly while someone owns the page.
pub(super) fn check_generations(pool: &KvPool, gens: &mut [u64]) -> Result<(), TestCaseError> {
    let shared = pool.shared();
    for (p, prev) in gens.iter_mut().enumerate() {
        let (g, owner) = shared.page_state(p);
        prop_assert!(g >= *prev, "page {p} generation went back: {prev} -> {g}");
        prop_assert_eq!(g % 2 == 1, owner != 0, "page {} parity vs owner", p);
        *prev = g;
    }
    Ok(())
}

fn check(pool: &KvPool, lives: &[Live], gens: &mut [u64]) -> Result<(), TestCaseError> {
    check_generations(pool, gens)?;
    let shared = pool.shared();
    let mut seen = HashSet::new();
    for l in lives {
        for e in l.res.table() {
            prop_assert!(seen.insert(e.page), "page {} in two live tables", e.page);
            prop_assert_eq!(
                shared.page_state(e.page as usize),
                (e.generation, l.res.owner().get())
            );
        }
    }
    let owned = (0..PAGES).filter(|&p| shared.page_state(p).1 != 0).count();
    prop_assert_eq!(owned, seen.len());
    let stats = pool.stats();
    prop_assert_eq!(stats.free_pages + seen.len(), PAGES);
    prop_assert_eq!(stats.allocations - stats.releases, seen.len() as u64);

    for l in lives {
        let kv = l.res.reader();
        for layer in 0..LAYERS {
            let mut contiguous = 0;
            let mut gap = false;
            for (lp, e) in l.res.table().iter().enumerate() {
                let wm = l.watermark(lp, layer);
                let s = kv
                    .read_page(*e, layer, wm)
                    .map_err(|v| TestCaseError::fail(v.to_string()))?;
                for slot in 0..wm {
                    let want = l.data[layer][lp * PS + slot].unwrap_or_default();
                    prop_assert_eq!(&s.k.to_f32()[slot * KVD..][..KVD], &want[..KVD]);
                    prop_assert_eq!(&s.v.to_f32()[slot * KVD..][..KVD], &want[KVD..]);
                }
                if wm < PS {
                    let err = kv.read_page(*e, layer, wm + 1).err();
                    let unwritten = matches!(err, Some(GuardViolation::Unwritten { watermark, .. }) if watermark == wm);
                    prop_assert!(unwritten, "{:?}", err);
                }
                if !gap {
                    contiguous += wm;
                    gap = wm < PS;
                }
            }
            prop_assert_eq!(l.res.written_tokens(layer), contiguous);
        }
    }
    if let [a, b, ..] = lives {
        if let Some(&e) = b.res.table().first() {
            let err = a.res.reader().read_page(e, 0, 0).err();
            prop_assert_eq!(err, Some(GuardViolation::ForeignPage { page: e.page }));
        }
    }
    Ok(())
}

fn run(ops: &[Op], scrub: ScrubMode, poison: bool) -> Result<(), TestCaseError> {
    let cfg = PoolConfig {
        scrub,
        poison,
        ..PoolConfig::for_tokens(PAGES * PS, PS, LAYERS, 1, KVD)
    };
    let pool = KvPool::new(cfg).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut lives: Vec<Live> = Vec::new();
    let mut gens = vec![0; PAGES];
    let mut counter = 0.0f32;
    for op in ops {
        match *op {
            Op::Reserve(tokens) => {
                let need = tokens.div_ceil(PS);
                let free = pool.free_pages();
                match pool.reserve(tokens) {
                    Ok(res) => {
                        prop_assert!(need <= free);
                        prop_assert_eq!(res.table().len(), need);
                        let mut l = Live {
                            res,
                            data: vec![Vec::new(); LAYERS],
                        };
                        l.grow_model();
                        lives.push(l);
                    }
                    Err(e) => {
                        prop_assert_eq!(
                            e,
                            PoolError::Exhausted {
                                requested_pages: need,
                                free_pages: free
                            }
                        );
                        prop_assert_eq!(pool.free_pages(), free, "refused reserve took pages");
                    }
                }
            }
            Op::Grow(i, tokens) if !lives.is_empty() => {
                let n = lives.len();
                let l = &mut lives[i % n];
                let before = l.res.table().to_vec();
                let free = pool.free_pages();
                let need = tokens.div_ceil(PS).saturating_sub(before.len());
                match l.res.grow(tokens) {
                    Ok(()) => prop_assert_eq!(&l.res.table()[..before.len()], &before[..]),
                    Err(e) => {
                        prop_assert_eq!(
                            e,
                            PoolError::Exhausted {
                                requested_pages: need,
                                free_pages: free
                            }
                        );
                        prop_assert_eq!(
                            l.res.table(),
                            &before[..],
                            "refused grow changed the table"
                        );
                    }
                }
                l.grow_model();
            }
            Op::Write {
                idx,
                layer,
                start,
                n,
            } if !lives.is_empty() => {
                let len = lives.len();
                let l = &mut lives[idx % len];
                let expected = l.expected_write(layer, start, n);
                let vals: Vec<[f32; 2 * KVD]> = (0..n)
                    .map(|_| {
                        counter += 1.0;
                        [counter, -counter, counter + 0.5, -counter - 0.5]
                    })
                    .collect();
                let k: Vec<f32> = vals.iter().flat_map(|t| t[..KVD].to_vec()).collect();
                let v: Vec<f32> = vals.iter().flat_map(|t| t[KVD..].to_vec()).collect();
                let got = l.res.write(layer, start, &k, &v);
                prop_assert_eq!(
                    got.as_ref().err().map(PoolError::kind),
                    expected,
                    "{:?}",
                    got
                );
                if got.is_ok() && n > 0 {
                    for (j, t) in vals.into_iter().enumerate() {
                        l.data[layer][start + j] = Some(t);
                    }
                }
            }
            Op::Drop(i) if !lives.is_empty() => {
                let n = lives.len();
                lives.swap_remove(i % n);
            }
            _ => {}
        }
        check(&pool, &lives, &mut gens)?;
    }
    lives.clear();
    check(&pool, &lives, &mut gens)?;
    let stats = pool.stats();
    prop_assert_eq!(stats.free_pages, stats.capacity_pages);
    prop_assert_eq!(stats.allocations, stats.releases);
    prop_assert!(gens.iter().all(|g| g % 2 == 0));
    Ok(())
}

fn scrub_mode() -> impl Strategy<Value = ScrubMode> {
    prop_oneof![
        Just(ScrubMode::Off),
        Just(ScrubMode::OnRelease),
        Just(ScrubMode::OnAllocate)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn pool_invariants_hold_under_random_interleavings(
        ops in prop::collection::vec(op(), 1..60),
        scrub in scrub_mode(),
        poison in any::<bool>(),
    ) {
        run(&ops, scrub, poison)?;
    }
}
