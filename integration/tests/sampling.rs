//! Sampling and logprobs through the mesh, as a client sets them in an
//! OpenAI body (router -> decode -> prefill, real gRPC and KV transport):
//! each setting takes effect, seeded output with every setting at once
//! equals the reference engine's, logprobs arrive whole and streamed, and
//! fields the gateway does not implement are refused by name. One mesh
//! serves the whole file.

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

fn chunks(mesh: &InProcessMesh, path: &str, body: &Value) -> Vec<Value> {
    http::stream_chunks(&mesh.http, path, body)
}

fn streamed_text(cs: &[Value]) -> String {
    cs.iter().map(http::choice_text).collect()
}

fn usage(v: &Value, field: &str) -> u64 {
    v["usage"][field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field}: {v}"))
}

#[test]
fn sampling_settings_take_effect_through_the_mesh() {
    let model = tiny_model_dir();
    let mesh = InProcessMesh::start(&model, Options::default()).expect("mesh");
    let engine = Engine::load(&model, &EngineConfig::default()).expect("engine");
    let tok = engine.tokenizer();
    let prompt = "The quick brown fox";

    // Seeded sampling with every setting at once equals the reference
    // engine's (one sampler's tokens, though prefill drew the first and
    // decode the rest), whole and streamed, completions and chat.
    let bias_id = tok.encode_raw(" the").expect("encode")[0];
    let params = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: Some(30),
        min_p: 0.02,
        seed: Some(1234),
        presence_penalty: 0.4,
        frequency_penalty: 0.6,
        repetition_penalty: 1.3,
        logit_bias: vec![(bias_id, 3.0)],
        min_tokens: 4,
        logprobs: None,
        grammar: None,
    };
    let body = |extra: Value| {
        let mut b = json!({
            "max_tokens": 20, "temperature": 0.9, "top_p": 0.95, "top_k": 30, "min_p": 0.02,
            "seed": 1234, "presence_penalty": 0.4, "frequency_penalty": 0.6,
            "repetition_penalty": 1.3, "logit_bias": {bias_id.to_string(): 3.0}, "min_tokens": 4,
        });
        for (k, v) in extra.as_object().expect("object") {
            b[k] = v.clone();
        }
        b
    };
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
        let want = engine
            .generate(&reference, 20, params.clone(), |_| {})
            .expect("reference");
        assert!(want.tokens.len() >= 4, "min_tokens: {want:?}");
        let whole = complete(&mesh, path, &body(input.clone()));
        assert_eq!(http::choice_text(&whole), want.text, "{path}");
        assert_eq!(usage(&whole, "completion_tokens"), want.tokens.len() as u64);
        let mut streamed = body(input.clone());
        streamed["stream"] = json!(true);
        assert_eq!(
            streamed_text(&chunks(&mesh, path, &streamed)),
            want.text,
            "{path} streamed"
        );
        // Another seed, another answer (the seed is honoured, not fixed).
        let mut other = body(input);
        other["seed"] = json!(99);
        let other = engine
            .generate(
                &reference,
                20,
                SamplingParams {
                    seed: Some(99),
                    ..params.clone()
                },
                |_| {},
            )
            .expect("reference");
        assert_ne!(other.text, want.text, "two seeds gave one answer");
    }

    // A +100 bias forces its token: every token is it.
    let a = tok.encode_raw("a").expect("encode");
    assert_eq!(a.len(), 1);
    let forced = complete(
        &mesh,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 3,
                "ignore_eos": true, "logit_bias": {a[0].to_string(): 100}}),
    );
    assert_eq!(http::choice_text(&forced), "a".repeat(6));

    // stop_token_ids end the answer; min_tokens holds them off.
    let greedy = engine
        .generate(
            &Prompt::Text(prompt.into()),
            12,
            SamplingParams::greedy(),
            |_| {},
        )
        .expect("reference");
    let first = greedy.tokens[0];
    let stopped = complete(
        &mesh,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop_token_ids": [first]}),
    );
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop", "{stopped}");
    assert_eq!(usage(&stopped, "completion_tokens"), 0, "{stopped}");
    let held = complete(
        &mesh,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0,
                "stop_token_ids": [first], "min_tokens": 5}),
    );
    assert!(usage(&held, "completion_tokens") >= 5, "{held}");

    // A frequency penalty lowers repeats (greedy, 48 tokens): fewer
    // repeated tokens, more distinct ones.
    let answer = |penalty: f64| {
        let v = complete(
            &mesh,
            "/v1/completions",
            &json!({"prompt": "1, 2, 3, 4,", "max_tokens": 48, "temperature": 0,
                    "ignore_eos": true, "frequency_penalty": penalty, "logprobs": 0}),
        );
        let toks: Vec<String> = v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .filter_map(|t| t.as_str().map(str::to_owned))
            .collect();
        assert_eq!(toks.len(), 48, "{v}");
        toks
    };
    let distinct = |t: &[String]| t.iter().collect::<std::collections::HashSet<_>>().len();
    let (plain, penalized) = (answer(0.0), answer(2.0));
    assert!(
        distinct(&plain) < 40,
        "the plain answer repeats too little to show a penalty: {plain:?}"
    );
    assert!(
        distinct(&penalized) > distinct(&plain),
        "penalized {penalized:?} vs plain {plain:?}"
    );

    // Logprobs, completions shape: one entry per token, the chosen token
    // first among greedy alternatives, offsets that add up.
    let v = complete(
        &mesh,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true, "logprobs": 3}),
    );
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(tokens.len(), 8, "{v}");
    assert_eq!(tokens.concat(), http::choice_text(&v));
    let mut offset = 0;
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][i], offset);
        offset += t.chars().count();
        let chosen = lp["token_logprobs"][i].as_f64().expect("logprob");
        assert!(chosen <= 0.0);
        let top = lp["top_logprobs"][i].as_object().expect("top");
        assert!((3..=4).contains(&top.len()), "{top:?}");
        let best = top
            .values()
            .filter_map(Value::as_f64)
            .fold(f64::MIN, f64::max);
        assert_eq!(chosen, best, "greedy: the chosen token is the most likely");
    }

    // Chat shape, streamed: entries across chunks, five alternatives each,
    // most likely first, the first being the chosen one (greedy).
    let cs = chunks(
        &mesh,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                "temperature": 0, "logprobs": true, "top_logprobs": 5, "stream": true}),
    );
    let entries: Vec<Value> = cs
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .cloned()
        .collect();
    let done = cs.last().expect("chunks");
    assert_eq!(entries.len() as u64, usage(done, "completion_tokens"));
    for e in &entries {
        let top = e["top_logprobs"].as_array().expect("top");
        assert_eq!(top.len(), 5, "{e}");
        assert_eq!(top[0]["logprob"], e["logprob"], "{e}");
        assert_eq!(top[0]["token"], e["token"], "{e}");
        for w in top.windows(2) {
            assert!(w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64(), "{e}");
        }
        let bytes: Vec<u8> = e["bytes"]
            .as_array()
            .expect("bytes")
            .iter()
            .filter_map(|b| b.as_u64().map(|b| b as u8))
            .collect();
        assert_eq!(bytes, e["token"].as_str().unwrap_or_default().as_bytes());
    }
    assert_eq!(
        entries
            .iter()
            .filter_map(|e| e["token"].as_str())
            .collect::<String>(),
        streamed_text(&cs)
    );

    // A prompt of token ids is the prompt those ids are.
    let ids = tok.encode(prompt).expect("encode");
    let by_text = complete(
        &mesh,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}),
    );
    let by_ids = complete(
        &mesh,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(http::choice_text(&by_ids), http::choice_text(&by_text));
    assert_eq!(usage(&by_ids, "prompt_tokens"), ids.len() as u64);

    // Echo opens the answer with the prompt; include_usage false leaves
    // usage out of the stream.
    let echoed = complete(
        &mesh,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "echo": true}),
    );
    assert_eq!(
        http::choice_text(&echoed),
        format!("{prompt}{}", http::choice_text(&by_text))
    );
    let quiet = chunks(
        &mesh,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 4, "stream": true,
                "stream_options": {"include_usage": false}}),
    );
    assert!(quiet.iter().all(|c| c.get("usage").is_none()), "{quiet:?}");

    // Nothing is dropped without a word: unknown and unimplemented fields,
    // unknown roles, and tool messages are refused, by name.
    for (path, body, param) in [
        (
            "/v1/completions",
            json!({"prompt": prompt, "best_of": 2}),
            "best_of",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "guided_json": {"type": "object"}}),
            "guided_json",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": []}),
            "tools",
        ),
        (
            "/v1/completions",
            json!({"prompt": prompt, "request_id": "mine"}),
            "request_id",
        ),
        (
            "/v1/completions",
            json!({"prompt": prompt, "frobnicate": true}),
            "body",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "tool", "content": "42"}]}),
            "messages",
        ),
        (
            "/v1/completions",
            json!({"prompt": prompt, "logit_bias": {"x": 1}}),
            "logit_bias",
        ),
    ] {
        let r = http::post(&mesh.http, path, &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{body}: {}", r.body);
    }
    mesh.assert_pages_come_back();
}
