//! The scheduler on the committed tiny model: output equal to
//! `Engine::generate`, chunking, the no-stall property (from the step log,
//! never from timings), cancellation and admission.
//!
//! Tests that need a known batch composition hold every page of the pool
//! while they submit, wait until the actor has queued all requests, then
//! release the pages: the actor admits them in one pass.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_kvpool::Reservation;

use super::*;
use crate::engine::{EngineConfig, Prompt};

fn tiny(kv_pool_tokens: usize) -> Arc<Engine> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny-llama");
    let cfg = EngineConfig {
        kv_pool_tokens: Some(kv_pool_tokens),
        ..EngineConfig::default()
    };
    Arc::new(Engine::load(&dir, &cfg).expect("load the tiny model"))
}

/// A prompt of `n` ids drawn from `seed` (no special tokens: ids 3..512).
fn prompt(n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            3 + (x % 509) as u32
        })
        .collect()
}

/// Every page of the pool, so nothing is admitted until it is dropped.
fn hold_pool(engine: &Engine) -> Reservation {
    engine
        .pool()
        .reserve(engine.pool().capacity_tokens())
        .expect("an idle pool")
}

/// Waits (bounded) until the actor has queued `n` requests.
fn wait_queued(s: &Scheduler, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.queued() != n {
        assert!(
            Instant::now() < deadline,
            "the actor never queued {n} requests (has {})",
            s.queued()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// All of a request's events: its tokens and how it ended.
#[derive(Debug, PartialEq)]
enum Outcome {
    Finished(Vec<u32>, FinishReason),
    Failed(Vec<u32>, String),
}

fn collect(rx: &Receiver<SchedEvent>) -> Outcome {
    let mut tokens = Vec::new();
    loop {
        match rx.recv().expect("a final event before the channel closes") {
            SchedEvent::Token { id, .. } => tokens.push(id),
            SchedEvent::Finished { reason, .. } => return Outcome::Finished(tokens, reason),
            SchedEvent::Failed { error, .. } => return Outcome::Failed(tokens, error),
        }
    }
}

fn reference(engine: &Engine, p: &[u32], max_new: usize) -> Outcome {
    let g = engine
        .generate(
            &Prompt::Tokens(p.to_vec()),
            max_new,
            SamplingParams::greedy(),
            |_| {},
        )
        .expect("generate");
    Outcome::Finished(g.tokens, g.finish_reason)
}

fn config(step_tokens: usize, max_running: usize) -> SchedulerConfig {
    SchedulerConfig {
        step_tokens,
        max_running,
        queue: 64,
    }
}

#[test]
fn plan_gives_every_decoder_one_token_and_the_rest_to_the_oldest_prompts() {
    use Need::{Decode, Prefill};
    assert_eq!(
        plan_step(&[Prefill(10), Decode, Prefill(3), Decode], 8),
        vec![6, 1, 0, 1]
    );
    assert_eq!(
        plan_step(&[Prefill(2), Prefill(3), Decode], 8),
        vec![2, 3, 1]
    );
    assert_eq!(plan_step(&[Decode, Decode], 2), vec![1, 1]);
    assert_eq!(plan_step(&[Decode, Prefill(5)], 2), vec![1, 1]);
    assert!(plan_step(&[], 8).is_empty());
}

#[test]
fn config_errors_name_the_field() {
    let e = config(4, 8)
        .validate()
        .expect_err("step_tokens < max_running");
    assert!(e.to_string().contains("step_tokens") && e.to_string().contains("max_running"));
    let e = config(8, 0).validate().expect_err("no running slot");
    assert!(e.to_string().contains("max_running"), "{e}");
    let e = SchedulerConfig {
        queue: 0,
        ..SchedulerConfig::default()
    }
    .validate()
    .expect_err("no queue");
    assert!(e.to_string().contains("queue"), "{e}");
}

#[test]
fn invalid_submissions_are_refused_at_once() {
    let engine = tiny(512);
    let s = Scheduler::start(Arc::clone(&engine), config(32, 4)).expect("start");
    let greedy = SamplingParams::greedy();
    assert!(matches!(
        s.submit(Vec::new(), 4, greedy.clone()),
        Err(SchedError::Model(ModelError::EmptyPrompt))
    ));
    let e = s
        .submit(vec![5, 9999], 4, greedy.clone())
        .expect_err("id 9999");
    assert!(e.to_string().contains("9999"), "{e}");
    let e = s
        .submit(prompt(200, 1), 100, greedy.clone())
        .expect_err("over 256");
    assert!(
        matches!(
            e,
            SchedError::Model(ModelError::ContextLengthExceeded { .. })
        ),
        "{e}"
    );
    let bad = SamplingParams {
        top_p: 0.0,
        ..greedy
    };
    let e = s.submit(prompt(4, 1), 4, bad).expect_err("top_p 0");
    assert!(e.to_string().contains("top_p"), "{e}");
}

/// (a) Concurrent requests of different prompt lengths, batched, give
/// exactly what `generate` gives for each alone.
#[test]
fn concurrent_requests_equal_generate_one_at_a_time() {
    let engine = tiny(1024);
    let prompts: Vec<Vec<u32>> = [3, 17, 40, 90]
        .iter()
        .enumerate()
        .map(|(i, &n)| prompt(n, i as u64 + 11))
        .collect();
    let want: Vec<Outcome> = prompts.iter().map(|p| reference(&engine, p, 16)).collect();

    let s = Scheduler::start(Arc::clone(&engine), SchedulerConfig::default()).expect("start");
    let held = hold_pool(&engine);
    let rxs: Vec<_> = prompts
        .iter()
        .map(|p| {
            s.submit(p.clone(), 16, SamplingParams::greedy())
                .expect("submit")
        })
        .collect();
    wait_queued(&s, prompts.len());
    drop(held);
    let got: Vec<Outcome> = rxs.iter().map(collect).collect();
    assert_eq!(got, want);

    // They ran together: the first step holds all four whole prompts.
    let log = s.step_log();
    let first = &log[0];
    assert_eq!(
        first
            .prefill
            .iter()
            .map(|c| (c.request, c.tokens, c.last))
            .collect::<Vec<_>>(),
        vec![(0, 3, true), (1, 17, true), (2, 40, true), (3, 90, true)]
    );
    assert_eq!(engine.pool().free_pages(), engine.pool().capacity_pages());
}

/// (b) With a budget of 8 tokens a step, a long prompt runs in chunks of
/// at most 8 and the output is still `generate`'s.
#[test]
fn a_long_prompt_runs_in_chunks_with_the_same_output() {
    let engine = tiny(1024);
    let long = prompt(150, 5);
    let short = prompt(6, 6);
    let want = [
        reference(&engine, &long, 12),
        reference(&engine, &short, 12),
    ];

    let s = Scheduler::start(Arc::clone(&engine), config(8, 4)).expect("start");
    let held = hold_pool(&engine);
    let rx_long = s
        .submit(long.clone(), 12, SamplingParams::greedy())
        .expect("submit");
    let rx_short = s
        .submit(short.clone(), 12, SamplingParams::greedy())
        .expect("submit");
    wait_queued(&s, 2);
    drop(held);
    assert_eq!([collect(&rx_long), collect(&rx_short)], want);

    let log = s.step_log();
    assert!(log.iter().all(|r| r.tokens() <= 8), "{log:?}");
    let chunks: Vec<ChunkRecord> = log
        .iter()
        .flat_map(|r| r.prefill.iter().copied())
        .filter(|c| c.request == 0)
        .collect();
    assert!(chunks.len() >= 150 / 8, "{chunks:?}");
    assert_eq!(chunks.iter().map(|c| c.tokens).sum::<usize>(), 150);
    assert_eq!(chunks.iter().filter(|c| c.last).count(), 1);
    assert!(chunks.last().is_some_and(|c| c.last));
}

/// (c) The no-stall property, structurally: from the step after a
/// sequence's first token until its last, it runs a decode token in every
/// step, also in the steps that run another prompt's chunks.
#[test]
fn a_decoding_sequence_gets_a_token_every_step_while_a_long_prompt_prefills() {
    let engine = tiny(512);
    let s = Scheduler::start(Arc::clone(&engine), config(8, 4)).expect("start");
    let held = hold_pool(&engine);
    let a = s
        .submit_request(SchedRequest {
            prompt: prompt(4, 21),
            max_new_tokens: 60,
            sampling: SamplingParams::greedy(),
            ignore_eos: true,
        })
        .expect("submit a");
    let b = s
        .submit(prompt(200, 22), 4, SamplingParams::greedy())
        .expect("submit b");
    wait_queued(&s, 2);
    drop(held);
    let Outcome::Finished(a_tokens, FinishReason::Length) = collect(&a) else {
        panic!("a must run to its budget");
    };
    assert_eq!(a_tokens.len(), 60);
    assert!(matches!(collect(&b), Outcome::Finished(..)));

    let log = s.step_log();
    assert!(log.iter().all(|r| r.tokens() <= 8), "{log:?}");
    // A's prompt fits the first step; its 59 decode tokens follow in the
    // next 59 steps, one each, without a gap.
    let first = log
        .iter()
        .position(|r| r.prefill.iter().any(|c| c.request == 0 && c.last))
        .expect("a's last chunk");
    let decode_steps: Vec<usize> = (0..log.len())
        .filter(|&i| log[i].decode.contains(&0))
        .collect();
    assert_eq!(
        decode_steps,
        (first + 1..first + 60).collect::<Vec<_>>(),
        "a missed a step"
    );
    // B's prompt ran in many chunks, and most of them beside A's tokens.
    let b_steps: Vec<usize> = (0..log.len())
        .filter(|&i| log[i].prefill.iter().any(|c| c.request == 1))
        .collect();
    let shared = b_steps.iter().filter(|i| decode_steps.contains(i)).count();
    assert!(b_steps.len() >= 200 / 8, "{b_steps:?}");
    assert!(
        shared + 1 >= b_steps.len(),
        "{b_steps:?} vs {decode_steps:?}"
    );
}

/// (d) A dropped receiver cancels the request and its pages come back:
/// once before admission, once mid-stream.
#[test]
fn dropping_the_receiver_frees_the_pages() {
    let engine = tiny(512);
    let cap = engine.pool().capacity_pages();
    let s = Scheduler::start(Arc::clone(&engine), config(32, 4)).expect("start");
    let long_request = |seed| SchedRequest {
        prompt: prompt(5, seed),
        max_new_tokens: 200,
        sampling: SamplingParams::greedy(),
        ignore_eos: true,
    };

    // Dropped while queued: noticed at its first token, in the step that
    // also runs `b`'s prompt.
    let held = hold_pool(&engine);
    let a = s.submit_request(long_request(31)).expect("submit a");
    let b = s
        .submit(prompt(5, 32), 2, SamplingParams::greedy())
        .expect("b");
    wait_queued(&s, 2);
    drop(a);
    drop(held);
    assert!(matches!(collect(&b), Outcome::Finished(..)));
    assert_eq!(engine.pool().free_pages(), cap);
    let a_decodes = s
        .step_log()
        .iter()
        .filter(|r| r.decode.contains(&0))
        .count();
    assert_eq!(a_decodes, 0, "a ran on after its receiver was dropped");

    // Dropped after its first token.
    let c = s.submit_request(long_request(33)).expect("submit c");
    assert!(matches!(c.recv(), Ok(SchedEvent::Token { .. })));
    drop(c);
    let d = s
        .submit(prompt(5, 34), 2, SamplingParams::greedy())
        .expect("d");
    assert!(matches!(collect(&d), Outcome::Finished(..)));
    assert_eq!(engine.pool().free_pages(), cap);
}

/// (e) A request that can never fit the pool fails at once; one that fits
/// once pages come back waits, then completes as `generate` would.
#[test]
fn never_fitting_fails_and_fitting_later_waits() {
    // 128 token slots: 8 pages of 16, under the context of 256.
    let engine = tiny(128);
    let p = prompt(20, 41);
    let want = reference(&engine, &p, 10);
    let s = Scheduler::start(Arc::clone(&engine), config(32, 4)).expect("start");
    let held = hold_pool(&engine);
    let fits_later = s
        .submit(p.clone(), 10, SamplingParams::greedy())
        .expect("submit");
    let never = s
        .submit(prompt(100, 42), 100, SamplingParams::greedy())
        .expect("within the context limit");
    match collect(&never) {
        Outcome::Failed(tokens, error) => {
            assert!(tokens.is_empty());
            assert!(
                error.contains("13 KV pages") && error.contains("has 8"),
                "{error}"
            );
        }
        other => panic!("expected a failure, got {other:?}"),
    }
    wait_queued(&s, 1);
    assert!(
        matches!(fits_later.try_recv(), Err(mpsc::TryRecvError::Empty)),
        "nothing can run while the pool is held"
    );
    drop(held);
    assert_eq!(collect(&fits_later), want);
}

/// `ignore_eos`: a prompt whose greedy output stops early runs to exactly
/// its budget, its first tokens the same as without.
#[test]
fn ignore_eos_generates_exactly_the_budget() {
    let engine = tiny(512);
    let max_new = 24;
    let (p, stopped) = (0..400)
        .find_map(|seed| {
            let p = prompt(3 + (seed as usize % 20), 1000 + seed);
            match reference(&engine, &p, max_new) {
                Outcome::Finished(t, FinishReason::Stop) => Some((p, t)),
                _ => None,
            }
        })
        .expect("some prompt whose greedy output ends at an end-of-sequence token");
    let s = Scheduler::start(Arc::clone(&engine), config(32, 4)).expect("start");
    let rx = s
        .submit_request(SchedRequest {
            prompt: p.clone(),
            max_new_tokens: max_new,
            sampling: SamplingParams::greedy(),
            ignore_eos: true,
        })
        .expect("submit");
    let Outcome::Finished(tokens, FinishReason::Length) = collect(&rx) else {
        panic!("must run to its budget");
    };
    assert_eq!(tokens.len(), max_new);
    assert_eq!(tokens[..stopped.len()], stopped[..]);
    assert!(engine.eos_token_ids().contains(&tokens[stopped.len()]));
    // Without it, the scheduler stops where generate stops.
    let rx = s
        .submit(p, max_new, SamplingParams::greedy())
        .expect("submit");
    assert_eq!(collect(&rx), Outcome::Finished(stopped, FinishReason::Stop));
}

/// Dropping the handle fails what is queued and running; `shutdown` lets
/// it finish.
#[test]
fn drop_fails_in_flight_and_shutdown_drains() {
    let engine = tiny(512);
    let s = Scheduler::start(Arc::clone(&engine), config(32, 4)).expect("start");
    let held = hold_pool(&engine);
    let rx = s
        .submit(prompt(5, 51), 4, SamplingParams::greedy())
        .expect("submit");
    wait_queued(&s, 1);
    drop(s);
    drop(held);
    assert!(matches!(collect(&rx), Outcome::Failed(t, _) if t.is_empty()));

    let s = Scheduler::start(Arc::clone(&engine), config(32, 4)).expect("start");
    let p = prompt(5, 52);
    let rx = s
        .submit(p.clone(), 6, SamplingParams::greedy())
        .expect("submit");
    s.shutdown();
    assert_eq!(collect(&rx), reference(&engine, &p, 6));
}
