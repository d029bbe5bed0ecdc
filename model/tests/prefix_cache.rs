//! The engine with the prefix cache on (tiny model and, where it is in the
//! cache, the default model): a repeated prompt starts from its cached
//! pages and decodes the same tokens as without the cache; the next turn of
//! a conversation finds the pages of the previous turn's answer; another
//! namespace finds nothing.
//!
//! Bits: with the default model's quantized matrices (kvmesh's own kernels,
//! whose arithmetic does not depend on how many rows a call has) a cached
//! prefix changes no bit of any logit. The tiny model runs f32 matrices
//! through candle's GEMM, whose summation order depends on the number of
//! rows, so computing a prompt's suffix alone (after a cached head) rounds
//! differently from computing the whole prompt: the logits agree to
//! [`F32_TOLERANCE`], the tokens exactly.

mod common;

use kvmesh_kvpool::Namespace;
use kvmesh_meshauth::MeshSecret;
use kvmesh_model::engine::{Engine, EngineConfig};
use kvmesh_model::sampling::argmax;
use kvmesh_prefix::CacheKeys;

fn engine(path: &std::path::Path, cached: bool) -> Engine {
    let e = Engine::load(
        path,
        &EngineConfig {
            kv_pool_tokens: Some(1024),
            max_model_len: Some(256),
            ..EngineConfig::default()
        },
    )
    .expect("load");
    if cached {
        let keys = CacheKeys::new(&MeshSecret::generate().expect("secret"));
        e.with_prefix_cache(keys, 0.5)
    } else {
        e
    }
}

/// Greedy: the generated tokens and every step's logits.
fn run(
    e: &Engine,
    ns: Option<Namespace>,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, Vec<Vec<f32>>, usize) {
    let mut seq = match ns {
        Some(ns) => e.admit_in(ns, prompt.to_vec(), n).expect("admit"),
        None => e.admit(prompt.to_vec(), n).expect("admit"),
    };
    let cached = seq.cached_len();
    let mut logits = vec![e.prefill(&mut seq).expect("prefill")];
    let mut out = Vec::new();
    for _ in 0..n {
        let tok = argmax(logits.last().expect("logits"));
        out.push(tok);
        if out.len() == n {
            break;
        }
        let next = e.decode_step(&mut [&mut seq], &[tok]).expect("step");
        logits.push(next.into_iter().next().expect("one").expect("logits"));
    }
    (out, logits, cached)
}

/// The largest difference between f32-GEMM logits of a prompt computed
/// whole and computed after a cached head (measured: about 6e-5 on logits
/// of magnitude 10-20).
const F32_TOLERANCE: f32 = 1e-3;

fn close(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| (p - q).abs() <= F32_TOLERANCE)
        })
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 1 + (i * 7 + salt) % 200).collect()
}

fn ns(b: u8) -> Namespace {
    Namespace::from_slice(&[b; 32]).expect("32 bytes")
}

#[test]
fn a_repeat_starts_from_the_cache_and_decodes_the_same_bits() {
    let dir = common::tiny_model_dir();
    let plain = engine(&dir, false);
    let cached = engine(&dir, true);
    let p = prompt(40, 3);
    let (want, want_logits, _) = run(&plain, None, &p, 12);
    let (first, first_logits, hit) = run(&cached, Some(ns(1)), &p, 12);
    assert_eq!(hit, 0, "a cold cache");
    // 40 tokens in pages of 16: two full pages before the last token's.
    let (again, again_logits, hit) = run(&cached, Some(ns(1)), &p, 12);
    assert_eq!(hit, 32, "the repeat leases both full pages");
    assert_eq!(first, want);
    assert_eq!(again, want);
    assert_eq!(first_logits, want_logits, "a cold cache changes no bit");
    assert!(
        close(&again_logits, &want_logits),
        "a cached prefix: f32 rounding only"
    );
    // Another tenant's namespace: nothing.
    let (other, _, hit) = run(&cached, Some(ns(2)), &p, 12);
    assert_eq!((hit, &other), (0, &want));
    let c = cached.pool().cache_stats();
    assert_eq!(c.leased_pages, 0);
    assert!(c.entries >= 2, "{c:?}");
    assert_eq!(cached.pool().stats().guard_violations, 0);
}

#[test]
fn the_next_turn_finds_the_previous_answer() {
    let dir = common::tiny_model_dir();
    let plain = engine(&dir, false);
    let cached = engine(&dir, true);
    let p = prompt(20, 5);
    // Turn 1 writes 20 prompt tokens and 30 generated (the last one's KV
    // is never written): 49 positions, three full pages.
    let (answer, _, _) = run(&cached, Some(ns(1)), &p, 30);
    let mut turn2 = p.clone();
    turn2.extend(&answer);
    turn2.extend(prompt(9, 11));
    let (want, want_logits, _) = run(&plain, None, &turn2, 8);
    let (got, got_logits, hit) = run(&cached, Some(ns(1)), &turn2, 8);
    assert_eq!(hit, 48, "pages of the prompt and of the answer");
    assert_eq!(got, want);
    assert!(close(&got_logits, &want_logits));
}

#[test]
fn with_the_default_model_a_cached_prefix_changes_no_bit() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let plain = engine(&path, false);
    let cached = engine(&path, true);
    let p = prompt(70, 1);
    let (want, want_logits, _) = run(&plain, None, &p, 16);
    let _ = run(&cached, Some(ns(1)), &p, 16);
    let (got, got_logits, hit) = run(&cached, Some(ns(1)), &p, 16);
    assert_eq!(hit, 64);
    assert_eq!(got, want);
    assert!(
        got_logits == want_logits,
        "quantized kernels: not one bit changes"
    );
}
