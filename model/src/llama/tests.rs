//! The quantized forward pass: batch-invariant to the bit (what lets the
//! mesh equal the reference engine), and close to the exact mode.

use candle_core::quantized::GgmlDType;

use crate::arch::Activation;
use crate::engine::{Engine, EngineConfig, Sequence};
use crate::llama::{LogitsWanted, SeqChunk};
use crate::loader::test_util::{smollm2_gguf, write_gguf_model};
use crate::{load_with, Precision};

fn tiny_engine(precision: Precision) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny-q4_1.gguf");
    write_gguf_model(&path, true, GgmlDType::Q4_1, |_, _| {});
    let loaded = load_with(&path, precision).expect("load");
    let engine = Engine::from_loaded(loaded, &EngineConfig::default()).expect("engine");
    (dir, engine)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + seed * 11) % 250 + 3)
        .collect()
}

#[test]
fn quantized_decode_is_the_same_alone_or_batched() {
    let (_dir, e) = tiny_engine(Precision::Quantized);
    assert!(e.model().is_quantized(), "{}", e.model().mode());
    same_alone_or_batched(&e);
}

/// A mixture groups a batch's rows by expert: still every row's logits
/// are those it gets alone, to the bit (the tiny Qwen2-MoE in Q8_0: a
/// shared expert, a dense layer, experts kept in their blocks).
#[test]
fn quantized_mixture_is_the_same_alone_or_batched() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/gguf/tiny-qwen2_moe-Q8_0.gguf");
    let loaded = load_with(&path, Precision::Quantized).expect("load");
    let e = Engine::from_loaded(loaded, &EngineConfig::default()).expect("engine");
    assert!(e.model().config().moe.is_some() && e.model().is_quantized());
    same_alone_or_batched(&e);
}

/// The same for gpt-oss (tiny, Q8_0): sinks and biases in attention,
/// biased router and experts, the clamped SwiGLU, windows of 8 on every
/// other layer (the prompts pass them).
#[test]
fn quantized_gpt_oss_is_the_same_alone_or_batched() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/gguf/tiny-gpt_oss-Q8_0.gguf");
    let loaded = load_with(&path, Precision::Quantized).expect("load");
    let e = Engine::from_loaded(loaded, &EngineConfig::default()).expect("engine");
    let cfg = e.model().config();
    assert!(cfg.moe.is_some() && cfg.block.attn_sinks && e.model().is_quantized());
    same_alone_or_batched(&e);
}

/// Four prompts, each prefilled and decoded 6 greedy steps alone, then
/// all four as one batch: every step's logits equal, bit for bit.
fn same_alone_or_batched(e: &Engine) {
    let prompts = [prompt(5, 1), prompt(17, 2), prompt(9, 3), prompt(30, 4)];
    // Alone: each sequence by itself, 6 greedy steps, every step's logits.
    let mut alone = Vec::new();
    for p in &prompts {
        let mut s = e.admit(p.clone(), 8).expect("admit");
        let mut logits = vec![e.prefill(&mut s).expect("prefill")];
        for _ in 0..6 {
            let next = crate::sampling::argmax(logits.last().expect("logits"));
            let mut out = e.decode_step(&mut [&mut s], &[next]).expect("step");
            logits.push(out.remove(0).expect("row"));
        }
        alone.push(logits);
    }
    // Together: prefilled as one batch, then decoded as one batch.
    let mut seqs: Vec<Sequence> = prompts
        .iter()
        .map(|p| e.admit(p.clone(), 8).expect("admit"))
        .collect();
    let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
    let mut last: Vec<Vec<f32>> = e
        .prefill_batch(&mut refs)
        .expect("batch")
        .into_iter()
        .map(|r| r.expect("row"))
        .collect();
    for step in 0..=6 {
        for (i, (l, a)) in last.iter().zip(&alone).enumerate() {
            assert_eq!(bits(l), bits(&a[step]), "sequence {i}, step {step}");
        }
        if step == 6 {
            break;
        }
        let next: Vec<u32> = last.iter().map(|l| crate::sampling::argmax(l)).collect();
        let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
        last = e
            .decode_step(&mut refs, &next)
            .expect("step")
            .into_iter()
            .map(|r| r.expect("row"))
            .collect();
    }
}

#[test]
fn quantized_chunked_prefill_equals_whole_prefill() {
    let (_dir, e) = tiny_engine(Precision::Quantized);
    let p = prompt(41, 7);
    let mut whole = e.admit(p.clone(), 1).expect("admit");
    let want = e.prefill(&mut whole).expect("prefill");
    let mut seq = e.admit(p.clone(), 1).expect("admit");
    let mut got = Vec::new();
    for (start, end) in [(0, 16), (16, 17), (17, 41)] {
        let last = end == p.len();
        let mut batch = [SeqChunk {
            tokens: &p[start..end],
            start_pos: start,
            kv: seq.kv_mut(),
            logits: if last {
                LogitsWanted::Last
            } else {
                LogitsWanted::None
            },
        }];
        let mut r = e.model().forward(&mut batch).expect("forward");
        got = r.remove(0).expect("chunk").logits;
    }
    assert_eq!(got.len(), 1);
    assert_eq!(bits(&got[0]), bits(&want));
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

fn top(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
    idx.truncate(k);
    idx
}

/// The quantized mode is an approximation of the exact one: on the tiny
/// model (one block per row) and, when cached, on SmolLM2, the last
/// position's logits point the same way.
#[test]
fn quantized_logits_are_close_to_exact() {
    let (_d1, exact) = tiny_engine(Precision::Exact);
    let (_d2, quant) = tiny_engine(Precision::Quantized);
    assert!(!exact.model().is_quantized());
    let p = prompt(23, 5);
    let a = exact
        .prefill(&mut exact.admit(p.clone(), 1).expect("admit"))
        .expect("exact");
    let b = quant
        .prefill(&mut quant.admit(p, 1).expect("admit"))
        .expect("quantized");
    assert!(cosine(&a, &b) > 0.99, "tiny: cosine {}", cosine(&a, &b));
    assert_ne!(bits(&a), bits(&b), "the modes must actually differ");

    let Some(path) = smollm2_gguf() else {
        eprintln!("SmolLM2 not cached; tiny model only");
        return;
    };
    let cfg = EngineConfig {
        kv_pool_tokens: Some(256),
        max_model_len: Some(256),
        ..EngineConfig::default()
    };
    let exact = Engine::from_loaded(load_with(&path, Precision::Exact).expect("load"), &cfg)
        .expect("engine");
    let quant = Engine::from_loaded(load_with(&path, Precision::Quantized).expect("load"), &cfg)
        .expect("engine");
    let ids = exact
        .tokenizer()
        .encode("The capital of France is Paris. The capital of Italy is")
        .expect("encode");
    let a = exact
        .prefill(&mut exact.admit(ids.clone(), 1).expect("admit"))
        .expect("exact");
    let b = quant
        .prefill(&mut quant.admit(ids, 1).expect("admit"))
        .expect("quantized");
    let c = cosine(&a, &b);
    assert!(c > 0.98, "SmolLM2: cosine {c}");
    let (ta, tb) = (top(&a, 5), top(&b, 5));
    assert!(
        ta.contains(&tb[0]) && tb.contains(&ta[0]),
        "top-5 {ta:?} vs {tb:?}"
    );
}

#[test]
fn gated_rows_in_parallel_equal_the_serial_pass_to_the_bit() {
    // 37 rows of 1536 (over the parallel threshold, an uneven split).
    let (rows, width) = (37, 1536);
    let gate_up: Vec<f32> = (0..rows * 2 * width)
        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 97.0)
        .collect();
    for (act, serial_fn) in [
        (
            Activation::Silu,
            kvmesh_kernels::activation::swiglu as fn(&[f32], usize, &mut [f32]),
        ),
        (Activation::GeluTanh, kvmesh_kernels::activation::geglu_tanh),
    ] {
        let (mut serial, mut split) = (vec![0.0; rows * width], vec![0.0; rows * width]);
        serial_fn(&gate_up, width, &mut serial);
        super::gated_rows(act, &gate_up, width, &mut split);
        assert_eq!(bits(&serial), bits(&split), "{act:?}");
    }
    assert!(rows * width >= super::SWIGLU_PARALLEL);
}

/// The forward pass's activation buffers belong to the model, not to the
/// pool thread that ran it: passes one after another, each on whichever
/// thread of a 4-thread pool takes it (as the mesh's compute threads hand
/// theirs to the global pool), leave one workspace, sized for the largest
/// pass, not one per thread that ever ran a large batch (the soak's idle
/// memory growing in steps, issue 15).
#[test]
fn passes_on_many_pool_threads_keep_one_workspace_sized_for_the_largest() {
    let (_dir, e) = tiny_engine(Precision::Quantized);
    assert!(e.model().workspace_floats().is_empty(), "no pass yet");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .expect("pool");
    let pass = |n: usize, seed: u32| {
        let mut s = e.admit(prompt(n, seed), 2).expect("admit");
        pool.install(|| e.prefill(&mut s)).expect("prefill");
    };
    pass(30, 1);
    let largest = e.model().workspace_floats();
    assert_eq!(largest.len(), 1, "{largest:?}");
    for i in 0..16 {
        // Smaller and equal passes, from a fresh OS thread each time too.
        let n = [5, 30, 17, 9][i % 4];
        std::thread::scope(|t| {
            t.spawn(|| pass(n, i as u32 + 2));
        });
        assert_eq!(
            e.model().workspace_floats(),
            largest,
            "pass {i} ({n} tokens)"
        );
    }
    // Passes at the same time each need their own; they are kept for the
    // next such burst, never more than ran at once.
    std::thread::scope(|t| {
        for i in 0..3 {
            let pass = &pass;
            t.spawn(move || pass(30, 40 + i));
        }
    });
    let after = e.model().workspace_floats();
    assert!((1..=3).contains(&after.len()), "{after:?}");
}

/// Prompt logprobs (`LogitsWanted::Prompt`, blocked by `SCORE_ROWS`)
/// against the whole logits matrix: the reference engine's function equals
/// them to the bit, and a log-softmax computed here in f64 from the same
/// rows agrees to rounding. 75 tokens: blocks of 32, 32 and 10.
#[test]
fn prompt_logprobs_equal_the_reference_and_a_direct_log_softmax() {
    for precision in [Precision::Quantized, Precision::Exact] {
        let (_dir, e) = tiny_engine(precision);
        let p = prompt(75, 5);
        let mut plain = e.admit(p.clone(), 1).expect("admit");
        let last = e.prefill(&mut plain).expect("prefill");
        drop(plain);
        let mut seq = e.admit(p.clone(), 1).expect("admit");
        seq.score_prompt(5).expect("score");
        let scored_last = e.prefill(&mut seq).expect("prefill");
        // Scoring changes nothing of what the sequence samples from.
        assert_eq!(bits(&scored_last), bits(&last));
        let got = seq.take_prompt_logprobs();
        drop(seq);
        assert_eq!(got.len(), p.len() - 1);
        let reference = e.prompt_logprobs_reference(&p, 5).expect("reference");
        for (i, (g, r)) in got.iter().zip(&reference).enumerate() {
            assert_eq!(g.logprob.to_bits(), r.logprob.to_bits(), "position {i}");
            assert_eq!(g.rank, r.rank, "position {i}");
            assert_eq!(g.top.len(), 5);
            for (a, b) in g.top.iter().zip(&r.top) {
                assert_eq!((a.0, a.1.to_bits()), (b.0, b.1.to_bits()), "position {i}");
            }
        }
        // Directly: every row's logits, log-softmax in f64.
        let mut whole = e.admit(p.clone(), 1).expect("admit");
        let rows = {
            let mut batch = [SeqChunk {
                tokens: &p,
                start_pos: 0,
                kv: whole.kv_mut(),
                logits: LogitsWanted::All,
            }];
            e.model()
                .forward(&mut batch)
                .expect("forward")
                .remove(0)
                .expect("chunk")
                .logits
        };
        for (i, g) in got.iter().enumerate() {
            let row = &rows[i];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&l| (l as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            let next = p[i + 1] as usize;
            let direct = row[next] as f64 - lse;
            assert!(
                (direct - g.logprob as f64).abs() < 1e-4,
                "position {i}: {direct} vs {}",
                g.logprob
            );
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let ids: Vec<u32> = order[..5].iter().map(|&j| j as u32).collect();
            assert_eq!(
                g.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                ids,
                "position {i}"
            );
            let rank = order.iter().position(|&j| j == next).expect("in vocab");
            assert!(g.rank as usize <= rank + 1, "position {i}");
            assert!(g.logprob <= 0.0 && g.top[0].1 >= g.logprob);
        }
    }
}

/// Scored and unscored prompts in one batch: each gets what it gets alone.
#[test]
fn prompt_logprobs_are_the_same_batched() {
    let (_dir, e) = tiny_engine(Precision::Quantized);
    let prompts = [prompt(40, 1), prompt(9, 2), prompt(33, 3)];
    let mut seqs: Vec<Sequence> = prompts
        .iter()
        .map(|p| e.admit(p.clone(), 1).expect("admit"))
        .collect();
    seqs[0].score_prompt(3).expect("score");
    seqs[2].score_prompt(0).expect("score");
    let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
    let last = e.prefill_batch(&mut refs).expect("batch");
    let got: Vec<_> = seqs
        .iter_mut()
        .map(Sequence::take_prompt_logprobs)
        .collect();
    drop(seqs);
    for (i, (l, got)) in last.into_iter().zip(got).enumerate() {
        let l = l.expect("row");
        let mut alone = e.admit(prompts[i].clone(), 1).expect("admit");
        assert_eq!(bits(&l), bits(&e.prefill(&mut alone).expect("prefill")));
        drop(alone);
        match i {
            1 => assert!(got.is_empty()),
            _ => {
                let k = if i == 0 { 3 } else { 0 };
                assert_eq!(
                    got,
                    e.prompt_logprobs_reference(&prompts[i], k).expect("ref")
                );
            }
        }
    }
}

/// A prefill's multiply-adds count the vocabulary's projection once: one
/// token is a decode token's count, each further token adds the layers'.
#[test]
fn a_prefill_counts_the_vocabulary_once() {
    let (_dir, e) = tiny_engine(Precision::Quantized);
    let m = e.model();
    let cfg = m.config();
    let vocab = cfg.vocab_size * cfg.hidden_size;
    assert!(
        m.matmul_params() > vocab,
        "{} <= {vocab}",
        m.matmul_params()
    );
    assert_eq!(m.prefill_matmul_params(0), 0);
    assert_eq!(m.prefill_matmul_params(1), m.matmul_params());
    assert_eq!(
        m.prefill_matmul_params(512),
        512 * (m.matmul_params() - vocab) + vocab
    );
}

/// A tied head keeps one copy of its blocks: the embedding looks its rows
/// up in the head's (the copy in huge pages), not in the loaded ones,
/// which would double the largest matrix of a small model (Gemma 3 270M's
/// 178 MB); an untied head's embedding is its own matrix.
#[test]
fn a_tied_head_and_the_embedding_share_one_copy() {
    for tie in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tiny-q4_1.gguf");
        write_gguf_model(&path, tie, GgmlDType::Q4_1, |_, _| {});
        let loaded = load_with(&path, Precision::Quantized).expect("load");
        let engine = Engine::from_loaded(loaded, &EngineConfig::default()).expect("engine");
        let m = engine.model();
        let head = m.lm_head.quant_matrix().expect("a quantized head");
        let shared = match &m.embed {
            crate::weights::Matrix::Quant(e) => std::sync::Arc::ptr_eq(e, head),
            crate::weights::Matrix::Dense(_) => false,
        };
        assert_eq!(shared, tie, "tied: {tie}");
    }
}
