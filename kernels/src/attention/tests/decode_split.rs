//! A parallel decode step splits each KV head's query heads into runs when
//! the KV heads are fewer than the threads (`decode_runs`): the same bits
//! in every pool size, and the bits of that position in a whole prompt.

use super::*;

#[test]
fn runs_give_every_thread_a_task_with_the_fewest_splits() {
    // (group, KV heads, threads) -> runs per KV head.
    for (group, kv, threads, want) in [
        (4, 1, 2, 2),  // Gemma 3 270M on two threads
        (4, 1, 3, 4),  // no divisor of 4 between: one query head a run
        (3, 3, 2, 1),  // SmolLM2: three KV heads already cover two threads
        (7, 2, 2, 1),  // Qwen2.5 0.5B
        (7, 2, 16, 7), // more threads than query heads: one a run
        (4, 8, 16, 2), // Llama 3 8B on sixteen threads
        (1, 1, 8, 1),  // multi-head attention: nothing to split
    ] {
        assert_eq!(
            decode_runs(group, kv, threads),
            want,
            "group {group}, {kv} KV heads, {threads} threads"
        );
    }
}

/// The last position of a whole prompt and the same position as a
/// decode step, on the calling thread's pool. (The page store is not
/// `Sync`: each pool builds its own, from the same seeds.)
fn prompt_and_step(nh: usize, nkv: usize, d: usize, ctx: usize, sinks: bool) -> [Vec<f32>; 2] {
    let (mut shape, table, store, _, _) = setup((nh, nkv, d, 16, ctx, None), 2, 9);
    shape.sinks = sinks.then(|| test_sinks(nh));
    let q = noise(10, ctx * nh * d);
    let at = |positions: std::ops::Range<usize>| {
        let mut out = vec![0.0; positions.len() * nh * d];
        let qs = &q[positions.start * nh * d..positions.end * nh * d];
        let positions: Vec<usize> = positions.collect();
        paged_attention(&store, &table, 0, &shape, qs, &positions, &mut out).expect("valid read");
        out
    };
    let prompt = at(0..ctx);
    [prompt[(ctx - 1) * nh * d..].to_vec(), at(ctx - 1..ctx)]
}

#[test]
fn a_decode_step_gives_the_same_bits_in_every_pool_and_as_in_a_prompt() {
    // Contexts long enough for the step to run in parallel
    // (`PARALLEL_THRESHOLD` multiply-adds), head sizes of the real models.
    for (nh, nkv, d, ctx, sinks) in [
        (4, 1, 256, 160usize, false),
        (4, 1, 64, 600, true),
        (9, 3, 64, 320, false),
        (14, 2, 64, 200, true),
        (6, 2, 40, 700, false),
    ] {
        assert!(nh * ctx * d >= PARALLEL_THRESHOLD, "a parallel case");
        let mut first: Option<Vec<f32>> = None;
        for threads in [1, 2, 3, 4, 8] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("pool");
            let [last, step] = pool.install(|| prompt_and_step(nh, nkv, d, ctx, sinks));
            assert!(
                same_bits(&step, &last),
                "{nh}/{nkv}/{d} at {ctx}, {threads} threads: the step differs from the prompt's last position"
            );
            let first = first.get_or_insert_with(|| step.clone());
            assert!(
                same_bits(&step, first),
                "{nh}/{nkv}/{d} at {ctx}: {threads} threads differ from one"
            );
        }
    }
}
