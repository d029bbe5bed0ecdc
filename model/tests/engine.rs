//! The reference engine's admission (I3 at the engine) and generation
//! contract, on the committed tiny model.

mod common;

use kvmesh_kvpool::PoolError;
use kvmesh_model::engine::{Engine, EngineConfig, FinishReason, Prompt};
use kvmesh_model::sampling::SamplingParams;
use kvmesh_model::{ChatMessage, ModelError};

fn engine(cfg: EngineConfig) -> Engine {
    Engine::load(&common::tiny_model_dir(), &cfg).expect("load tiny model")
}

#[test]
fn admission_refuses_before_allocating() {
    let e = engine(EngineConfig {
        kv_pool_tokens: Some(64),
        max_model_len: Some(100),
        ..EngineConfig::default()
    });
    let cap = e.pool().capacity_pages();

    assert!(matches!(
        e.admit(Vec::new(), 4),
        Err(ModelError::EmptyPrompt)
    ));

    let err = e
        .admit(vec![5; 90], 20)
        .expect_err("over the context limit");
    match &err {
        ModelError::ContextLengthExceeded {
            prompt_tokens: 90,
            max_new_tokens: 20,
            limit: 100,
        } => {}
        other => panic!("unexpected {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("90") && msg.contains("20") && msg.contains("100"),
        "message must give the numbers: {msg}"
    );

    // Fits the context but not the pool: the pool refuses whole.
    match e.admit(vec![5; 60], 20) {
        Err(ModelError::Kv(PoolError::Exhausted { .. })) => {}
        other => panic!("expected an exhausted pool, got {other:?}"),
    }
    assert_eq!(
        e.pool().free_pages(),
        cap,
        "a refused admission must hold no page"
    );

    let seq = e.admit(vec![5; 10], 6).expect("fits");
    assert_eq!(
        e.pool().free_pages(),
        cap - 1,
        "16 tokens take one page of 16"
    );
    drop(seq);
    assert_eq!(e.pool().free_pages(), cap);
}

#[test]
fn max_model_len_above_the_model_is_refused() {
    let err = Engine::load(
        &common::tiny_model_dir(),
        &EngineConfig {
            max_model_len: Some(10_000),
            ..EngineConfig::default()
        },
    )
    .expect_err("the tiny model has 256 positions");
    assert!(err.to_string().contains("256"), "{err}");
}

#[test]
fn generation_streams_its_text_and_stops_at_the_limit() {
    let e = engine(EngineConfig::default());
    let mut pieces = Vec::new();
    let out = e
        .generate(
            &Prompt::Text("The quick brown fox".into()),
            20,
            SamplingParams::greedy(),
            |p| pieces.push(p.to_owned()),
        )
        .expect("generate");
    assert_eq!(
        pieces.concat(),
        out.text,
        "streamed pieces add up to the text"
    );
    assert!(out.tokens.len() <= 20);
    if out.finish_reason == FinishReason::Length {
        assert_eq!(out.tokens.len(), 20);
    }
    assert_eq!(
        out.text,
        e.tokenizer().decode(&out.tokens, true).expect("decode")
    );
    assert_eq!(e.pool().free_pages(), e.pool().capacity_pages());

    // Greedy is deterministic; a chat prompt goes through the template.
    let again = e
        .generate(
            &Prompt::Text("The quick brown fox".into()),
            20,
            SamplingParams::greedy(),
            |_| {},
        )
        .expect("generate");
    assert_eq!(again.tokens, out.tokens);
    let chat = e
        .generate(
            &Prompt::Chat(vec![ChatMessage::new("user", "hello")]),
            4,
            SamplingParams::greedy(),
            |_| {},
        )
        .expect("chat generate");
    let rendered = e
        .tokenizer()
        .apply_chat_template(&[ChatMessage::new("user", "hello")], true)
        .expect("template");
    assert_eq!(
        chat.prompt_tokens,
        e.tokenizer().encode_raw(&rendered).expect("encode").len()
    );
}

#[test]
fn bad_sampling_parameters_are_refused_by_name() {
    let e = engine(EngineConfig::default());
    let bad = SamplingParams {
        top_p: 0.0,
        ..SamplingParams::greedy()
    };
    let err = e
        .generate(&Prompt::Text("hi".into()), 4, bad, |_| {})
        .expect_err("top_p 0");
    assert!(err.to_string().contains("top_p"), "{err}");
}

/// Sliding windows and the pool (`docs/models.md`, "Decoder families"):
/// pages that have left every layer's window stay the sequence's until it
/// is released, and admission reserves every token for every layer. The
/// tiny Mistral attends a window of 16 positions on every layer; a
/// 100-token prompt and 20 generated tokens leave most of its pages
/// outside every window.
#[test]
fn pages_that_left_every_window_are_kept_until_release() {
    let e = Engine::load(
        &common::tiny_family_dir("mistral"),
        &EngineConfig {
            kv_pool_tokens: Some(256),
            page_size: 4,
            ..EngineConfig::default()
        },
    )
    .expect("load tiny mistral");
    let cfg = e.model().config();
    assert_eq!(cfg.sliding_window, Some(16));
    let cap = e.pool().capacity_pages();
    let prompt: Vec<u32> = (0..100u32).map(|i| 3 + i % 400).collect();
    let mut seq = e.admit(prompt, 20).expect("admit");
    // 120 tokens in pages of 4, reserved up front.
    let held = cap - e.pool().free_pages();
    assert_eq!(held, 30);
    let mut logits = e.prefill(&mut seq).expect("prefill");
    for _ in 0..20 {
        let next = kvmesh_model::sampling::argmax(&logits);
        logits = e
            .decode_step(&mut [&mut seq], &[next])
            .expect("step")
            .pop()
            .expect("one")
            .expect("decode");
        // Nothing given back while the sequence lives, though positions
        // below `len - 16` are outside every layer's window.
        assert_eq!(cap - e.pool().free_pages(), held);
    }
    drop(seq);
    assert_eq!(e.pool().free_pages(), cap, "all given back on release");
}

/// The prefix cache's model tag names the model by its weights, not its
/// file: the same model under another name has the same identity, another
/// model (or the same in another precision) another.
#[test]
fn identity_is_the_weights_not_the_file_name() {
    let copy = tempfile::tempdir().expect("tempdir");
    for entry in std::fs::read_dir(common::tiny_model_dir()).expect("list") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), copy.path().join(entry.file_name())).expect("copy");
    }
    let load = |path: &std::path::Path| {
        Engine::load(path, &EngineConfig::default())
            .expect("load")
            .identity()
            .to_owned()
    };
    let original = load(&common::tiny_model_dir());
    assert!(
        original.starts_with("llama-") && original.ends_with("@Exact"),
        "{original}"
    );
    assert_eq!(load(copy.path()), original);
    assert_ne!(load(&common::tiny_family_dir("mistral")), original);
}
