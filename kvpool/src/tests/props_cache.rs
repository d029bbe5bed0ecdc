//! Property test of the prefix cache: random interleavings of sequences
//! that start from the cache, write their own pages, share them while
//! they run and end (cached or not), of cache bounds changing and of
//! clears, over a small pool. Two namespaces use the same keys on
//! purpose, with different contents, so a cross-namespace hit would read
//! the wrong values.
//!
//! After every step: every position of every live sequence reads back the
//! values its namespace and page key give (cached head included); no page
//! is in two live sequences' own parts; generations move forward and are
//! odd exactly when a page has an owner (a reservation or a cache entry);
//! free + owned + cached == capacity; the cache stays within its bound
//! unless leases hold it above. At the end, clearing the cache frees every
//! page (I7).

use std::collections::HashSet;

use kvmesh_kernels::PagedKv;
use proptest::prelude::*;

use crate::{KvPool, Namespace, PageKey, PoolConfig, Reservation, ScrubMode};

const PS: usize = 2;
const PAGES: usize = 8;
const LAYERS: usize = 2;
const KVD: usize = 2;

#[derive(Clone, Debug)]
enum Op {
    /// A sequence in namespace `ns` of `pages` full pages of chain `chain`
    /// and `tail` more tokens; `cache` says whether it names its pages.
    Start {
        ns: u8,
        chain: u8,
        pages: usize,
        tail: usize,
        cache: bool,
    },
    End(usize),
    /// A live sequence shares its full pages now (a fork's first sample).
    Share(usize),
    Bound(usize),
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u8..2, 0u8..3, 0usize..=3, 0usize..PS, any::<bool>())
            .prop_map(|(ns, chain, pages, tail, cache)| Op::Start { ns, chain, pages, tail, cache }),
        4 => any::<usize>().prop_map(Op::End),
        2 => any::<usize>().prop_map(Op::Share),
        1 => (0usize..=PAGES).prop_map(Op::Bound),
        1 => Just(Op::Clear),
    ]
}

fn namespace(ns: u8) -> Namespace {
    Namespace::from_slice(&[ns + 1; 32]).expect("32 bytes")
}

/// Chains 0 and 1 share their first page; chain 2 shares nothing.
fn key(chain: u8, page: usize) -> PageKey {
    let root = if page == 0 && chain < 2 { 0 } else { chain };
    let mut b = [0u8; 32];
    b[0] = root;
    b[1] = page as u8;
    PageKey::from_slice(&b).expect("32 bytes")
}

/// The K and V of one slot of a page: a function of the namespace, the
/// page's key and the slot, so every copy of a page holds the same values
/// and another namespace's copy other values.
fn values(ns: u8, key: &PageKey, layer: usize, slot: usize) -> [f32; 2 * KVD] {
    let b = key.as_bytes();
    let base = 1.0 + f32::from(ns) * 100.0 + f32::from(b[0]) * 10.0 + f32::from(b[1]);
    let x = base + layer as f32 * 0.25 + slot as f32 * 0.0625;
    [x, x + 0.5, -x, -x - 0.5]
}

struct Live {
    res: Reservation,
    ns: u8,
    keys: Vec<PageKey>,
    /// The values of the private tail page are those of this key.
    tail_key: PageKey,
    tokens: usize,
}

fn start(pool: &KvPool, ns: u8, chain: u8, pages: usize, tail: usize, cache: bool) -> Option<Live> {
    let keys: Vec<PageKey> = (0..pages).map(|p| key(chain, p)).collect();
    let tokens = pages * PS + tail;
    let mut res = pool.reserve_cached(&namespace(ns), &keys, tokens).ok()?;
    // The private tail page's values: keyed as if it were one more page.
    let tail_key = key(chain, pages);
    for layer in 0..LAYERS {
        for pos in res.cached_tokens()..tokens {
            let k = keys.get(pos / PS).unwrap_or(&tail_key);
            let v = values(ns, k, layer, pos % PS);
            res.write(layer, pos, &v[..KVD], &v[KVD..]).ok()?;
        }
    }
    if cache {
        res.cache_as(namespace(ns), keys.clone());
    }
    Some(Live {
        res,
        ns,
        keys,
        tail_key,
        tokens,
    })
}

fn check(pool: &KvPool, lives: &[Live], gens: &mut [u64]) -> Result<(), TestCaseError> {
    super::props::check_generations(pool, gens)?;
    let mut own = HashSet::new();
    for l in lives {
        for e in l.res.held() {
            prop_assert!(own.insert(e.page), "page {} in two live sequences", e.page);
        }
    }
    let stats = pool.stats();
    prop_assert_eq!(
        stats.free_pages + own.len() + stats.cache.entries,
        PAGES,
        "free + owned + cached"
    );
    prop_assert!(stats.cache.entries <= stats.cache.max_pages.max(stats.cache.leased_pages));
    for l in lives {
        let kv = l.res.reader();
        for layer in 0..LAYERS {
            for (lp, e) in l.res.table().iter().enumerate() {
                let slots = (l.tokens - lp * PS).min(PS);
                let s = kv
                    .read_page(*e, layer, slots)
                    .map_err(|v| TestCaseError::fail(format!("page {lp}: {v}")))?;
                let (k, v) = (s.k.to_f32(), s.v.to_f32());
                for slot in 0..slots {
                    let want = values(l.ns, l.keys.get(lp).unwrap_or(&l.tail_key), layer, slot);
                    prop_assert_eq!(
                        &k[slot * KVD..][..KVD],
                        &want[..KVD],
                        "K of page {} slot {}",
                        lp,
                        slot
                    );
                    prop_assert_eq!(
                        &v[slot * KVD..][..KVD],
                        &want[KVD..],
                        "V of page {} slot {}",
                        lp,
                        slot
                    );
                }
            }
        }
    }
    prop_assert_eq!(stats.guard_violations, 0);
    Ok(())
}

fn run(ops: &[Op], poison: bool) -> Result<(), TestCaseError> {
    let pool = KvPool::new(PoolConfig {
        page_size: PS,
        n_pages: PAGES,
        n_layers: LAYERS,
        n_kv_heads: 1,
        head_dim: KVD,
        entry: crate::KvEntry::KeyValue,
        dtype: kvmesh_kernels::KvDtype::F32,
        scrub: ScrubMode::Off,
        poison,
    })
    .expect("pool");
    pool.set_cache_pages(PAGES / 2);
    let mut lives: Vec<Live> = Vec::new();
    let mut gens = vec![0u64; PAGES];
    for op in ops {
        match *op {
            Op::Start {
                ns,
                chain,
                pages,
                tail,
                cache,
            } => {
                if let Some(l) = start(&pool, ns, chain, pages, tail, cache) {
                    lives.push(l);
                }
            }
            Op::End(i) => {
                if !lives.is_empty() {
                    let n = lives.len();
                    drop(lives.swap_remove(i % n));
                }
            }
            Op::Share(i) => {
                if !lives.is_empty() {
                    let n = lives.len();
                    lives[i % n].res.share();
                }
            }
            Op::Bound(b) => pool.set_cache_pages(b),
            Op::Clear => {
                pool.clear_cache();
            }
        }
        check(&pool, &lives, &mut gens)?;
    }
    lives.clear();
    pool.clear_cache();
    prop_assert_eq!(pool.free_pages(), PAGES);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn cache_interleavings_keep_every_invariant(ops in prop::collection::vec(op(), 1..40)) {
        run(&ops, false)?;
    }

    #[test]
    fn cache_interleavings_in_poison_mode(ops in prop::collection::vec(op(), 1..40)) {
        run(&ops, true)?;
    }
}
