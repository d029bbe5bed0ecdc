//! Golden files (transformers' outputs) and the checks against them,
//! with each numerics class's tolerance.

use kvmesh_kvpool::Namespace;
use kvmesh_model::engine::{Engine, Sequence};
use kvmesh_model::sampling::argmax;
use kvmesh_model::ChatMessage;
use serde::Deserialize;

/// How close a numerics class must come to the reference: a logit of
/// magnitude `x` within `abs + rel * |x|`; greedy tokens equal up to the
/// first step whose reference top-2 gap is below `gap_tie` (below that,
/// the class's own rounding may legitimately flip the argmax).
pub struct Tolerance {
    pub abs: f32,
    pub rel: f32,
    pub gap_tie: f32,
}

impl Tolerance {
    fn logit(&self, x: f32) -> f32 {
        self.abs + self.rel * x.abs()
    }
}

/// The f32 classes (f32 activations; the exact mode, and quantized weights
/// against the reference on the same dequantized weights): summation
/// order only.
pub const F32: Tolerance = Tolerance {
    abs: 2e-3,
    rel: 2e-4,
    gap_tie: 0.01,
};

#[derive(Deserialize)]
pub struct Golden {
    pub model: String,
    tokenize: Vec<TokenizeCase>,
    chat: Vec<ChatCase>,
    pub greedy: Vec<GreedyCase>,
}

#[derive(Deserialize)]
struct TokenizeCase {
    text: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct ChatCase {
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    rendered: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
pub struct GreedyCase {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub tokens: Vec<u32>,
    pub steps: Vec<Step>,
}

#[derive(Deserialize)]
pub struct Step {
    pub top: Vec<(u32, f32)>,
    pub gap: f32,
}

pub fn read_golden(name: &str) -> Golden {
    let path = super::golden_path(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("bad golden file {}: {e}", path.display()))
}

pub fn check_tokenizer(engine: &Engine, g: &Golden) {
    let tok = engine.tokenizer();
    for case in &g.tokenize {
        assert_eq!(
            tok.encode(&case.text).expect("encode"),
            case.ids,
            "{}: token ids of {:?}",
            g.model,
            case.text
        );
    }
    for case in &g.chat {
        let rendered = tok
            .apply_chat_template(&case.messages, case.add_generation_prompt)
            .expect("template");
        assert_eq!(
            rendered, case.rendered,
            "{}: chat template rendering",
            g.model
        );
        assert_eq!(
            tok.encode(&rendered).expect("encode"),
            case.ids,
            "{}: chat token ids",
            g.model
        );
    }
}

/// Greedy tokens and logits against the reference; returns the worst logit
/// error seen, as a fraction of its tolerance.
/// `ns`: admitted in that prefix-cache namespace (the cache's pages are
/// looked up and kept), or `None`: plainly.
pub fn check_greedy(engine: &Engine, g: &Golden, ns: Option<Namespace>, tol: &Tolerance) -> f32 {
    let mut worst = 0.0f32;
    for case in &g.greedy {
        assert_eq!(
            engine.tokenizer().encode(&case.prompt).expect("encode"),
            case.prompt_ids,
            "{}: prompt ids",
            g.model
        );
        let n = case.tokens.len();

        // Teacher-forced on the reference tokens, comparing logits every
        // step. Until the first near-tie the fed tokens are exactly what our
        // own greedy choice would have fed, so this is also the free-running
        // greedy check, at half the cost.
        let mut seq = match ns {
            Some(ns) => engine.admit_in(ns, case.prompt_ids.clone(), n),
            None => engine.admit(case.prompt_ids.clone(), n),
        }
        .expect("admit");
        let mut logits = engine.prefill(&mut seq).expect("prefill");
        let mut free_running = true;
        for (i, step) in case.steps.iter().enumerate() {
            free_running &= step.gap >= tol.gap_tie;
            if free_running {
                let ours = argmax(&logits);
                assert_eq!(
                    ours, case.tokens[i],
                    "{}: greedy token {i} of {:?} (reference gap {})",
                    g.model, case.prompt, step.gap
                );
            }
            for &(id, want) in &step.top {
                let got = logits[id as usize];
                let err = (got - want).abs();
                worst = worst.max(err / tol.logit(want));
                assert!(
                    err <= tol.logit(want),
                    "{}: step {i} of {:?}: logit of token {id} is {got}, reference {want}",
                    g.model,
                    case.prompt
                );
            }
            if i + 1 < n {
                logits = decode_one(engine, &mut seq, case.tokens[i]);
            }
        }
    }
    worst
}

pub fn decode_one(engine: &Engine, seq: &mut Sequence, token: u32) -> Vec<f32> {
    let mut r = engine
        .decode_step(&mut [seq], &[token])
        .expect("decode step");
    r.pop().expect("one result").expect("decode")
}

/// A real GGUF in the quantized mode: every matrix stays in its GGUF
/// blocks, dequantized in registers to the same f32 values gguf-py gets
/// (the kernels' ground truth), with the process's activation class
/// (f32 unless the test binary selected int8) and an f32 KV pool.
pub fn quantized_engine_for(path: &std::path::Path) -> Engine {
    let engine = Engine::load(
        path,
        &kvmesh_model::engine::EngineConfig {
            kv_pool_tokens: Some(4096),
            precision: kvmesh_model::Precision::Quantized,
            kv_dtype: Some(kvmesh_kvpool::KvDtype::F32),
            ..kvmesh_model::engine::EngineConfig::default()
        },
    )
    .expect("load quantized");
    assert!(engine.model().is_quantized());
    engine
}
