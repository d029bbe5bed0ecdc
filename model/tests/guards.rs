//! I1 and I2 through the whole model: a decode batch in which one sequence's
//! page table is forged (a stale generation, a foreign page, a page whose
//! slots were never written) fails that sequence with a typed error, counts
//! exactly one violation, and leaves the other sequences' logits identical
//! to a clean run.

mod common;

use kvmesh_kernels::{GuardViolation, PageRef};
use kvmesh_model::engine::{Engine, EngineConfig, Sequence};
use kvmesh_model::sampling::argmax;
use kvmesh_model::ModelError;

const PROMPTS: [&str; 3] = [
    "The quick brown fox jumps over the lazy dog again and again",
    "Numbers 1 2 3 and letters a b c",
    "A third prompt that shares the batch",
];

fn engine() -> Engine {
    Engine::load(
        &common::tiny_model_dir(),
        &EngineConfig {
            kv_pool_tokens: Some(1024),
            ..EngineConfig::default()
        },
    )
    .expect("load tiny model")
}

/// Admit and prefill the three prompts, returning the sequences and the
/// greedy next token of each.
fn start(engine: &Engine) -> (Vec<Sequence>, Vec<u32>) {
    let mut seqs = Vec::new();
    let mut next = Vec::new();
    for p in PROMPTS {
        let ids = engine.tokenizer().encode(p).expect("encode");
        assert!(ids.len() > 16, "prompt {p:?} must span two pages");
        let mut s = engine.admit(ids, 40).expect("admit");
        next.push(argmax(&engine.prefill(&mut s).expect("prefill")));
        seqs.push(s);
    }
    (seqs, next)
}

fn step(engine: &Engine, seqs: &mut [Sequence], next: &[u32]) -> Vec<Result<Vec<f32>, ModelError>> {
    let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
    engine.decode_step(&mut refs, next).expect("batch runs")
}

/// Run the batch with sequence 0's table forged by `forge`; check that only
/// sequence 0 fails, with the violation `expect` accepts, and that the rest
/// equal the clean run.
fn forged_run(
    forge: impl Fn(&[Sequence]) -> Vec<PageRef>,
    expect: impl Fn(&GuardViolation) -> bool,
) {
    let engine = engine();
    let clean = {
        let (mut seqs, next) = start(&engine);
        step(&engine, &mut seqs, &next)
            .into_iter()
            .map(|r| r.expect("clean step"))
            .collect::<Vec<_>>()
    };
    assert_eq!(engine.pool().free_pages(), engine.pool().capacity_pages());

    let (mut seqs, next) = start(&engine);
    let forged = forge(&seqs);
    seqs[0].kv_mut().forge_table(forged);
    let before = engine.pool().guard_violations();
    let results = step(&engine, &mut seqs, &next);
    assert_eq!(
        engine.pool().guard_violations(),
        before + 1,
        "exactly one violation is counted"
    );
    match &results[0] {
        Err(ModelError::Guard(v)) => assert!(expect(v), "unexpected violation {v:?}"),
        other => panic!("the forged sequence must fail with a guard violation, got {other:?}"),
    }
    for i in 1..PROMPTS.len() {
        let got = results[i]
            .as_ref()
            .expect("the other sequences are unaffected");
        let diff = got
            .iter()
            .zip(&clean[i])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            diff <= 1e-5,
            "sequence {i} changed by {diff} next to a forged one"
        );
    }
    drop(seqs);
    assert_eq!(
        engine.pool().free_pages(),
        engine.pool().capacity_pages(),
        "pages leaked"
    );
}

#[test]
fn stale_generation_fails_only_its_sequence() {
    forged_run(
        |seqs| {
            let mut t = seqs[0].kv().table().to_vec();
            t[0].generation += 2;
            t
        },
        |v| matches!(v, GuardViolation::StaleGeneration { .. }),
    );
}

#[test]
fn foreign_page_fails_only_its_sequence() {
    forged_run(
        |seqs| {
            let mut t = seqs[0].kv().table().to_vec();
            t[0] = seqs[1].kv().table()[0];
            t
        },
        |v| matches!(v, GuardViolation::ForeignPage { .. }),
    );
}

#[test]
fn unwritten_page_fails_only_its_sequence() {
    forged_run(
        |seqs| {
            // The sequence's own last page: owned, right generation, but no
            // slot of it was written yet.
            let mut t = seqs[0].kv().table().to_vec();
            let last = *t.last().expect("pages");
            t[0] = last;
            t
        },
        |v| matches!(v, GuardViolation::Unwritten { .. }),
    );
}
