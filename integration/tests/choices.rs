//! Several choices through the mesh (router -> decode -> prefill, real
//! gRPC and KV transport): `n` seeded samples are the reference engine's
//! samples with seeds `seed + i`, whole and streamed, completions and
//! chat; a batch of prompts answers each prompt in prompt-major order; and
//! the later samples of a prompt find its pages in prefill's prefix cache
//! (prefill computes the prompt once) and lease the pages decode received
//! for the first (one transfer). One mesh serves the whole file.

use kvmesh_integration::http;
use kvmesh_integration::inproc::{InProcessMesh, Options};
use kvmesh_integration::tiny_model_dir;
use kvmesh_model::engine::{Engine, EngineConfig, Prompt};
use kvmesh_model::sampling::SamplingParams;
use kvmesh_model::ChatMessage;
use serde_json::{json, Value};

fn complete(mesh: &InProcessMesh, path: &str, body: &Value) -> Value {
    http::complete(&mesh.http, path, body)
}

/// Choice `i`'s text of a whole answer.
fn texts(v: &Value) -> Vec<String> {
    let choices = v["choices"].as_array().expect("choices");
    choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i, "{v}");
            c["text"]
                .as_str()
                .or_else(|| c["message"]["content"].as_str())
                .expect("text")
                .to_owned()
        })
        .collect()
}

/// Each choice's streamed text, by index.
fn streamed_texts(mesh: &InProcessMesh, path: &str, body: &Value, choices: usize) -> Vec<String> {
    let mut out = vec![String::new(); choices];
    for v in http::stream_chunks(&mesh.http, path, body) {
        let i = v["choices"][0]["index"].as_u64().expect("index");
        out[usize::try_from(i).expect("small")].push_str(&http::choice_text(&v));
    }
    out
}

/// Prompt tokens prefill's prefix cache has supplied, read from its pool
/// (not the router's relayed metric, which lags by a load report).
fn prefill_hits(m: &InProcessMesh) -> u64 {
    m.prefill_pool().cache.counters.hit_tokens
}

/// Prompt tokens decode's prefix cache has supplied (leased pages that
/// were not transferred).
fn decode_hits(m: &InProcessMesh) -> u64 {
    m.decode_pool().cache.counters.hit_tokens
}

#[test]
fn n_samples_and_prompt_batches_through_the_mesh() {
    let model = tiny_model_dir();
    let mesh = InProcessMesh::start(&model, Options::default()).expect("mesh");
    let engine = Engine::load(&model, &EngineConfig::default()).expect("engine");
    let sampled = |prompt: &Prompt, seed: u64| {
        engine
            .generate(
                prompt,
                12,
                SamplingParams {
                    temperature: 0.9,
                    top_k: Some(40),
                    seed: Some(seed),
                    ..SamplingParams::default()
                },
                |_| {},
            )
            .expect("reference")
    };

    // n = 3 seeded: sample i is the reference's sample with seed 500 + i.
    let prompt = "The quick brown fox jumps over the lazy dog";
    let user = vec![ChatMessage::new("user", prompt)];
    for (path, reference, input) in [
        (
            "/v1/completions",
            Prompt::Text(prompt.into()),
            json!({"prompt": prompt}),
        ),
        (
            "/v1/chat/completions",
            Prompt::Chat(user),
            json!({"messages": [{"role": "user", "content": prompt}]}),
        ),
    ] {
        let runs: Vec<_> = (0..3).map(|i| sampled(&reference, 500 + i)).collect();
        let want: Vec<String> = runs.iter().map(|r| r.text.clone()).collect();
        assert!(want[0] != want[1] || want[1] != want[2], "{want:?}");
        let mut body =
            json!({"n": 3, "max_tokens": 12, "temperature": 0.9, "top_k": 40, "seed": 500});
        for (k, v) in input.as_object().expect("object") {
            body[k] = v.clone();
        }
        let whole = complete(&mesh, path, &body);
        assert_eq!(texts(&whole), want, "{path}");
        // Usage counts every sample's tokens.
        let tokens: usize = runs.iter().map(|r| r.tokens.len()).sum();
        assert_eq!(whole["usage"]["completion_tokens"], tokens, "{whole}");
        body["stream"] = json!(true);
        assert_eq!(
            streamed_texts(&mesh, path, &body, 3),
            want,
            "{path} streamed"
        );
    }

    // A batch of prompts, greedy, n = 2: choices prompt-major, each the
    // reference's greedy answer to its prompt; the prompts counted once.
    let prompts = ["Once upon a time", "The capital of France is"];
    let greedy = |p: &str| {
        engine
            .generate(
                &Prompt::Text(p.into()),
                8,
                SamplingParams {
                    temperature: 0.0,
                    ..SamplingParams::default()
                },
                |_| {},
            )
            .expect("reference")
            .text
    };
    let v = complete(
        &mesh,
        "/v1/completions",
        &json!({"prompt": prompts, "n": 2, "max_tokens": 8, "temperature": 0}),
    );
    let want: Vec<String> = prompts
        .iter()
        .flat_map(|p| {
            let g = greedy(p);
            [g.clone(), g]
        })
        .collect();
    assert_eq!(texts(&v), want);
    let prompt_tokens: usize = prompts
        .iter()
        .map(|p| engine.tokenizer().encode(p).expect("encode").len())
        .sum();
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens, "{v}");

    // One prefill and one transfer for n samples. Prefill: samples 1 and 2
    // find the prompt's whole pages in its cache, as many tokens as a later
    // repeat finds. Decode: sample 0's sequence shares the pages it
    // received, so samples 1 and 2 lease them while it runs and receive
    // only the page holding the last token.
    let long = "In a quiet village by the sea there lived an old fisherman who \
                told stories to anyone who would listen, and every evening the \
                children gathered on the pier to hear about storms and whales";
    let prefill_before = prefill_hits(&mesh);
    let decode_before = decode_hits(&mesh);
    let bytes_before = mesh.decode_table().kv_bytes_received;
    complete(
        &mesh,
        "/v1/completions",
        &json!({"prompt": long, "n": 3, "max_tokens": 48, "ignore_eos": true, "temperature": 0.7, "seed": 1}),
    );
    let fork_bytes = mesh.decode_table().kv_bytes_received - bytes_before;
    let bytes_before = mesh.decode_table().kv_bytes_received;
    let repeat = complete(
        &mesh,
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 4, "temperature": 0}),
    );
    let repeat_bytes = mesh.decode_table().kv_bytes_received - bytes_before;
    let cached = repeat["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens");
    let prompt_tokens = repeat["usage"]["prompt_tokens"].as_u64().expect("prompt");
    assert!(cached >= 32, "{repeat}");
    assert_eq!(prefill_hits(&mesh), prefill_before + 3 * cached);
    // Decode's hits: samples 1 and 2, then the repeat, each `cached`.
    assert_eq!(decode_hits(&mesh), decode_before + 3 * cached);
    // The repeat received the uncached tail; the three samples the whole
    // prompt once and that tail twice.
    let tail = prompt_tokens - cached;
    assert_eq!(repeat_bytes % tail, 0);
    let per_token = repeat_bytes / tail;
    assert_eq!(fork_bytes, (prompt_tokens + 2 * tail) * per_token);
    mesh.assert_pages_come_back();
}
