//! The page-event stream (`crate::observer`) is enough to mirror the
//! pool's page state: a mirror that applies the events in order (what the
//! device pool does on its stream) has, after every operation of random
//! interleavings of reserve, write, cache, release, evict and clear, the
//! host's generation for every page, zero watermarks exactly where the
//! events reset them, and the host's contents where the events fill.

use std::sync::{Arc, Mutex};

use proptest::prelude::*;

use super::{cfg, tokens};
use crate::{
    KvPool, Namespace, PageEvent, PageFill, PageKey, PageObserver, PoolConfig, Reservation,
    ScrubMode,
};

#[derive(Debug, Default)]
struct Recorder(Mutex<Vec<PageEvent>>);

impl PageObserver for Recorder {
    fn page_event(&self, event: PageEvent) {
        self.0.lock().expect("recorder lock").push(event);
    }
}

/// What the device keeps per page: generation, whether the watermarks
/// are known zero, and the last fill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mirror {
    generation: u64,
    fill: PageFill,
}

fn apply(mirror: &mut [Mirror], events: &mut Vec<PageEvent>) {
    for e in events.drain(..) {
        let m = &mut mirror[e.page() as usize];
        m.generation = e.generation();
        match e {
            PageEvent::Allocated { fill, .. } | PageEvent::Freed { fill, .. } => {
                if fill != PageFill::Keep {
                    m.fill = fill;
                }
            }
            PageEvent::Retagged { .. } => {}
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Reserve {
        tokens: usize,
        cached_chain: Option<u8>,
    },
    Release {
        which: usize,
        cache_chain: Option<u8>,
    },
    ClearCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1usize..12, proptest::option::of(0u8..3)).prop_map(|(tokens, cached_chain)| Op::Reserve {
            tokens,
            cached_chain
        }),
        (0usize..8, proptest::option::of(0u8..3))
            .prop_map(|(which, cache_chain)| Op::Release { which, cache_chain }),
        Just(Op::ClearCache),
    ]
}

fn keys(chain: u8, n: usize) -> Vec<PageKey> {
    (0..n)
        .map(|i| {
            let mut b = [chain; 32];
            b[0] = i as u8;
            PageKey::from_slice(&b).expect("32 bytes")
        })
        .collect()
}

fn ns() -> Namespace {
    Namespace::from_slice(&[9; 32]).expect("32 bytes")
}

fn run(cfg: PoolConfig, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let rec = Arc::new(Recorder::default());
    let pool = KvPool::new(cfg.clone()).expect("pool");
    pool.set_observer(rec.clone()).expect("observer");
    pool.set_cache_pages(4);
    let initial = if cfg.poison {
        PageFill::Canary
    } else {
        PageFill::Zero
    };
    let mut mirror = vec![
        Mirror {
            generation: 0,
            fill: initial
        };
        cfg.n_pages
    ];
    let mut live: Vec<Reservation> = Vec::new();
    for op in ops {
        match op {
            Op::Reserve {
                tokens: n,
                cached_chain,
            } => {
                let r = match cached_chain {
                    Some(c) => pool.reserve_cached(&ns(), &keys(c, n / cfg.page_size), n),
                    None => pool.reserve(n),
                };
                if let Ok(mut r) = r {
                    let from = r.cached_tokens();
                    for layer in 0..cfg.n_layers {
                        let (k, v) = (tokens(layer as u32, n - from), tokens(7, n - from));
                        r.write(layer, from, &k, &v).expect("write");
                    }
                    live.push(r);
                }
            }
            Op::Release { which, cache_chain } => {
                if !live.is_empty() {
                    let mut r = live.swap_remove(which % live.len());
                    if let Some(c) = cache_chain {
                        let full = r.written_tokens(0) / cfg.page_size;
                        r.cache_as(ns(), keys(c, full));
                    }
                    drop(r);
                }
            }
            Op::ClearCache => {
                pool.clear_cache();
            }
        }
        apply(&mut mirror, &mut rec.0.lock().expect("lock"));
        for (p, m) in mirror.iter().enumerate() {
            let (generation, owner) = pool.shared().page_state(p);
            prop_assert_eq!(m.generation, generation, "page {}: mirror generation", p);
            if owner == 0 && m.fill != PageFill::Keep {
                // A free page holds what its last fill put there.
                let want = match m.fill {
                    PageFill::Canary => f32::from_bits(crate::POISON_BITS).to_bits(),
                    _ => 0,
                };
                if cfg.poison || cfg.scrub == ScrubMode::OnRelease {
                    prop_assert!(
                        pool.shared()
                            .page_copy(p)
                            .iter()
                            .all(|v| v.to_bits() == want),
                        "page {}: free page contents",
                        p
                    );
                }
            }
        }
    }
    Ok(())
}

#[test]
fn an_observer_is_taken_once_and_only_before_the_first_allocation() {
    let pool = KvPool::new(cfg(4)).expect("pool");
    pool.set_observer(Arc::new(Recorder::default()))
        .expect("first");
    assert!(matches!(
        pool.set_observer(Arc::new(Recorder::default())),
        Err(crate::PoolError::ObserverTooLate)
    ));
    let used = KvPool::new(cfg(4)).expect("pool");
    drop(used.reserve(3).expect("reserve"));
    assert!(matches!(
        used.set_observer(Arc::new(Recorder::default())),
        Err(crate::PoolError::ObserverTooLate)
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn the_event_stream_mirrors_generations_and_fills(
        ops in proptest::collection::vec(op(), 1..40),
        mode in 0usize..3,
    ) {
        let base = cfg(8);
        let cfg = match mode {
            0 => base,
            1 => PoolConfig { scrub: ScrubMode::OnRelease, ..base },
            _ => PoolConfig { poison: true, ..base },
        };
        run(cfg, ops)?;
    }
}
