//! `echo` and prompt logprobs through the mesh (router -> decode ->
//! prefill, real gRPC and KV transport): the prompt's scores are computed
//! by the prefill node and must equal the reference engine's
//! (`Engine::prompt_logprobs_reference`, to the bit: the same forward
//! pass and the same log-softmax), whole and streamed, over HTTP and the
//! public gRPC API, with the prefix cache warm or cold. One mesh serves
//! each test.

use kvmesh_integration::http;
use kvmesh_integration::inproc::{InProcessMesh, Options};
use kvmesh_integration::tiny_model_dir;
use kvmesh_model::engine::{Engine, Prompt};
use kvmesh_model::sampling::PromptLogprob;
use kvmesh_proto::v1::generation_client::GenerationClient;
use kvmesh_proto::v1::{generate_request, GenerateRequest, TokenIds};
use serde_json::{json, Value};

/// Long enough to fill whole prefix-cache pages.
const PROMPT: &str = "The quick brown fox jumps over the lazy dog while the cat watches from \
                      the window and the birds sing in the old oak tree by the river bank";

fn engine() -> Engine {
    Engine::load(&tiny_model_dir(), &Options::default().engine).expect("reference engine")
}

fn f(v: &Value) -> f32 {
    v.as_f64().unwrap_or_else(|| panic!("a number: {v}")) as f32
}

/// Completions' logprobs of an echoing choice: the prompt's tokens first
/// (null, then the reference's values, `k` alternatives), text offsets
/// running through the echoed prompt into the completion, and greedy
/// completion tokens that are their position's most likely.
fn check_echo_logprobs(
    lp: &Value,
    e: &Engine,
    ids: &[u32],
    reference: &[PromptLogprob],
    prompt_text: &str,
    k: usize,
) {
    let tok = e.tokenizer();
    let tokens = lp["tokens"].as_array().expect("tokens");
    let lps = lp["token_logprobs"].as_array().expect("token_logprobs");
    let tops = lp["top_logprobs"].as_array().expect("top_logprobs");
    let offsets = lp["text_offset"].as_array().expect("text_offset");
    assert!(tokens.len() > ids.len(), "{lp}");
    assert_eq!(lps[0], Value::Null, "{lp}");
    assert_eq!(tops[0], Value::Null, "{lp}");
    let mut offset = 0u64;
    for (i, &id) in ids.iter().enumerate() {
        let text = tok.decode(&[id], false).expect("decode");
        assert_eq!(tokens[i], json!(text), "prompt token {i}");
        assert_eq!(offsets[i].as_u64(), Some(offset), "prompt token {i}: {lp}");
        offset += text.chars().count() as u64;
        if i == 0 {
            continue;
        }
        let r = &reference[i - 1];
        assert_eq!(
            f(&lps[i]).to_bits(),
            r.logprob.to_bits(),
            "prompt token {i}"
        );
        let top = tops[i].as_object().expect("top map");
        // Keyed by text, the first of the tokens that share one wins.
        let mut seen = std::collections::HashSet::new();
        for &(alt, alp) in r.top.iter().take(k) {
            let name = tok.decode(&[alt], false).expect("decode");
            if seen.insert(name.clone()) {
                assert_eq!(f(&top[&name]).to_bits(), alp.to_bits(), "prompt token {i}");
            }
        }
        assert!(top.len() <= k + 1, "{top:?}");
    }
    // The completion's offsets go on from the echoed text.
    assert_eq!(
        offsets[ids.len()].as_u64(),
        Some(prompt_text.chars().count() as u64),
        "{lp}"
    );
    // Greedy: every generated token is its position's most likely.
    for i in ids.len()..tokens.len() {
        let best = tops[i]
            .as_object()
            .expect("top map")
            .values()
            .map(f)
            .fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(f(&lps[i]), best, "generated token {i}: {lp}");
    }
}

/// vLLM's `prompt_logprobs`: null, then per token the prompt's own token
/// (logprob, rank) and the `k` most likely, as the reference has them.
fn check_vllm(pl: &Value, e: &Engine, ids: &[u32], reference: &[PromptLogprob], k: usize) {
    let pl = pl
        .as_array()
        .unwrap_or_else(|| panic!("prompt_logprobs: {pl}"));
    assert_eq!(pl.len(), ids.len());
    assert_eq!(pl[0], Value::Null);
    for (i, r) in reference.iter().enumerate() {
        let m = pl[i + 1].as_object().expect("a map");
        let own = &m[&ids[i + 1].to_string()];
        assert_eq!(
            f(&own["logprob"]).to_bits(),
            r.logprob.to_bits(),
            "position {i}"
        );
        assert_eq!(
            own["rank"].as_u64(),
            Some(u64::from(r.rank)),
            "position {i}"
        );
        let text = e.tokenizer().decode(&[ids[i + 1]], false).expect("decode");
        assert_eq!(own["decoded_token"], json!(text));
        for (j, &(alt, alp)) in r.top.iter().take(k).enumerate() {
            let a = &m[&alt.to_string()];
            assert_eq!(f(&a["logprob"]).to_bits(), alp.to_bits(), "position {i}");
            if alt != ids[i + 1] {
                assert_eq!(a["rank"].as_u64(), Some(j as u64 + 1));
            }
        }
        assert!(m.len() <= k + 1);
    }
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("cached_tokens: {v}"))
}

#[test]
fn echo_and_prompt_logprobs_equal_the_reference_through_the_mesh() {
    let mesh = InProcessMesh::start(&tiny_model_dir(), Options::default()).expect("mesh");
    let e = engine();
    let ids = e.tokenize(&Prompt::Text(PROMPT.into())).expect("tokenize");
    let reference = e.prompt_logprobs_reference(&ids, 20).expect("reference");
    let path = "/v1/completions";

    // Warm the prefix cache with the prompt: a scored request must still
    // compute (and equal) every position, and report nothing cached.
    let plain = json!({"prompt": PROMPT, "max_tokens": 2, "temperature": 0});
    http::complete(&mesh.http, path, &plain);
    let again = http::complete(&mesh.http, path, &plain);
    assert!(cached(&again) > 0, "the cache is warm: {again}");

    let body = json!({
        "prompt": PROMPT, "echo": true, "logprobs": 2, "prompt_logprobs": 3,
        "max_tokens": 6, "temperature": 0,
    });
    let whole = http::complete(&mesh.http, path, &body);
    let c = &whole["choices"][0];
    let text = c["text"].as_str().expect("text");
    assert!(text.starts_with(PROMPT), "{text}");
    check_echo_logprobs(&c["logprobs"], &e, &ids, &reference, PROMPT, 2);
    check_vllm(&c["prompt_logprobs"], &e, &ids, &reference, 3);
    assert_eq!(
        cached(&whole),
        0,
        "a scored prompt takes nothing from the cache"
    );
    // The generated part is what a plain greedy request generates.
    let generated = http::complete(
        &mesh.http,
        path,
        &json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0}),
    );
    assert_eq!(
        &text[PROMPT.len()..],
        generated["choices"][0]["text"].as_str().expect("text")
    );
    // The cache still serves plain requests afterwards.
    assert!(cached(&generated) > 0, "{generated}");

    // Streamed: the first chunk is the echo with the prompt's logprobs
    // and prompt_logprobs; the whole text is the same.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let cs = http::stream_chunks(&mesh.http, path, &streamed);
    let first = &cs[0]["choices"][0];
    assert_eq!(first["text"], json!(PROMPT), "{}", cs[0]);
    check_vllm(&first["prompt_logprobs"], &e, &ids, &reference, 3);
    let mut joined = first["logprobs"].clone();
    for c in &cs[1..] {
        let lp = &c["choices"][0]["logprobs"];
        if lp.is_null() {
            continue;
        }
        for field in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let more = lp[field].as_array().expect("list").clone();
            joined[field].as_array_mut().expect("list").extend(more);
        }
    }
    assert_eq!(
        joined, c["logprobs"],
        "streamed logprobs equal the whole answer's"
    );
    let all: String = cs.iter().map(http::choice_text).collect();
    assert_eq!(all, text);

    // A batch of two prompts (text and token ids), two samples each: each
    // choice echoes its own prompt and carries its own prompt's scores.
    let short = "Hello world, this is a test";
    let short_ids = e.tokenize(&Prompt::Text(short.into())).expect("tokenize");
    let short_ref = e.prompt_logprobs_reference(&short_ids, 20).expect("ref");
    let id_text = e.tokenizer().decode(&short_ids, false).expect("decode");
    let long_id_text = e.tokenizer().decode(&ids, false).expect("decode");
    for stream in [false, true] {
        for prompts in [json!([PROMPT, short]), json!([ids, short_ids])] {
            let body = json!({
                "prompt": prompts, "n": 2, "echo": true, "logprobs": 1,
                "max_tokens": 3, "temperature": 0, "stream": stream,
            });
            let choices: Vec<(usize, String, Value)> = if stream {
                let cs = http::stream_chunks(&mesh.http, path, &body);
                (0..4)
                    .map(|i| {
                        let mine: Vec<&Value> = cs
                            .iter()
                            .filter(|c| c["choices"][0]["index"] == json!(i))
                            .collect();
                        let text = mine.iter().map(|c| http::choice_text(c)).collect();
                        (i, text, mine[0]["choices"][0]["logprobs"].clone())
                    })
                    .collect()
            } else {
                let v = http::complete(&mesh.http, path, &body);
                v["choices"]
                    .as_array()
                    .expect("choices")
                    .iter()
                    .map(|c| {
                        let i = c["index"].as_u64().expect("index") as usize;
                        (
                            i,
                            c["text"].as_str().expect("text").to_owned(),
                            c["logprobs"].clone(),
                        )
                    })
                    .collect()
            };
            assert_eq!(choices.len(), 4);
            for (i, text, lp) in choices {
                let (p_ids, p_ref, p_text) = match (i / 2, prompts[0].is_string()) {
                    (0, true) => (&ids, &reference, PROMPT),
                    (0, false) => (&ids, &reference, long_id_text.as_str()),
                    (_, true) => (&short_ids, &short_ref, short),
                    (_, false) => (&short_ids, &short_ref, id_text.as_str()),
                };
                assert!(text.starts_with(p_text), "choice {i}: {text}");
                let lp_tokens = lp["token_logprobs"].as_array().expect("list");
                assert_eq!(lp_tokens[0], Value::Null, "choice {i}");
                for (j, r) in p_ref.iter().enumerate() {
                    assert_eq!(
                        f(&lp_tokens[j + 1]).to_bits(),
                        r.logprob.to_bits(),
                        "choice {i}"
                    );
                }
                assert!(lp_tokens.len() >= p_ids.len());
            }
        }
    }

    // Chat: vLLM's prompt_logprobs at the top level, for the rendered
    // prompt.
    let msgs = vec![kvmesh_model::ChatMessage::new("user", "Hello there")];
    let chat_ids = e.tokenize(&Prompt::Chat(msgs)).expect("tokenize");
    let chat_ref = e.prompt_logprobs_reference(&chat_ids, 20).expect("ref");
    let chat = json!({
        "messages": [{"role": "user", "content": "Hello there"}],
        "prompt_logprobs": 2, "max_tokens": 3, "temperature": 0,
    });
    let v = http::complete(&mesh.http, "/v1/chat/completions", &chat);
    check_vllm(&v["prompt_logprobs"], &e, &chat_ids, &chat_ref, 2);
    let mut chat_stream = chat.clone();
    chat_stream["stream"] = json!(true);
    let cs = http::stream_chunks(&mesh.http, "/v1/chat/completions", &chat_stream);
    assert_eq!(cs[0]["choices"][0]["delta"]["role"], json!("assistant"));
    check_vllm(&cs[0]["prompt_logprobs"], &e, &chat_ids, &chat_ref, 2);

    // Refusals name their field.
    for (p, body) in [
        (
            "prompt_logprobs",
            json!({"prompt": "hi", "prompt_logprobs": 21}),
        ),
        (
            "prompt_logprobs",
            json!({"prompt": "hi", "prompt_logprobs": -1}),
        ),
        (
            "logprobs",
            json!({"prompt": "hi", "echo": true, "logprobs": 6}),
        ),
        (
            "echo",
            json!({"messages": [{"role": "user", "content": "hi"}], "echo": true}),
        ),
    ] {
        let route = if body.get("messages").is_some() {
            "/v1/chat/completions"
        } else {
            path
        };
        let r = http::post(&mesh.http, route, &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], json!(p), "{body}: {}", r.body);
    }
    mesh.assert_pages_come_back();
}

#[test]
fn public_grpc_api_echoes_and_scores_the_prompt() {
    let mesh = InProcessMesh::start(&tiny_model_dir(), Options::default()).expect("mesh");
    let e = engine();
    let ids = e.tokenize(&Prompt::Text(PROMPT.into())).expect("tokenize");
    let reference = e.prompt_logprobs_reference(&ids, 20).expect("reference");
    let id_text = e.tokenizer().decode(&ids, false).expect("decode");
    mesh.block_on(async {
        let mut client = GenerationClient::connect(format!("http://{}", mesh.grpc))
            .await
            .expect("connect");
        for (input, echoed) in [
            (generate_request::Input::Prompt(PROMPT.into()), PROMPT),
            (
                generate_request::Input::TokenIds(TokenIds { ids: ids.clone() }),
                id_text.as_str(),
            ),
        ] {
            let mut stream = client
                .generate(GenerateRequest {
                    input: Some(input),
                    max_tokens: 4,
                    temperature: Some(0.0),
                    echo: true,
                    prompt_logprobs: Some(4),
                    n: 2,
                    ..Default::default()
                })
                .await
                .expect("generate")
                .into_inner();
            let mut firsts = [None, None];
            while let Some(msg) = stream.message().await.expect("message") {
                let i = msg.index as usize;
                if firsts[i].is_none() {
                    firsts[i] = Some(msg.clone());
                } else {
                    assert!(msg.prompt_text.is_empty() && msg.prompt_logprobs.is_empty());
                }
                if let Some(u) = &msg.usage {
                    if i == 0 {
                        assert_eq!(u.cached_tokens, 0, "a scored prompt is computed whole");
                    }
                }
            }
            for first in firsts {
                let first = first.expect("each sample has messages");
                assert_eq!(first.prompt_text, echoed);
                let pl = &first.prompt_logprobs;
                assert_eq!(pl.len(), ids.len());
                assert_eq!((pl[0].token_id, pl[0].logprob), (ids[0], 0.0));
                assert!(pl[0].top_logprobs.is_empty());
                for (j, r) in reference.iter().enumerate() {
                    let got = &pl[j + 1];
                    assert_eq!(got.token_id, ids[j + 1]);
                    assert_eq!(got.logprob.to_bits(), r.logprob.to_bits(), "position {j}");
                    let top: Vec<(u32, u32)> = got
                        .top_logprobs
                        .iter()
                        .map(|t| (t.token_id, t.logprob.to_bits()))
                        .collect();
                    let want: Vec<(u32, u32)> = r.top[..4]
                        .iter()
                        .map(|&(id, lp)| (id, lp.to_bits()))
                        .collect();
                    assert_eq!(top, want, "position {j}");
                }
            }
        }
        // Out of range, and echo of a chat: typed refusals naming the field.
        for (req, field) in [
            (
                GenerateRequest {
                    input: Some(generate_request::Input::Prompt("hi".into())),
                    prompt_logprobs: Some(21),
                    ..Default::default()
                },
                "prompt_logprobs",
            ),
            (
                GenerateRequest {
                    input: Some(generate_request::Input::Chat(kvmesh_proto::v1::Chat {
                        messages: vec![kvmesh_proto::v1::ChatMessage {
                            role: "user".into(),
                            content: "hi".into(),
                            ..Default::default()
                        }],
                    })),
                    echo: true,
                    ..Default::default()
                },
                "echo",
            ),
        ] {
            let err = client.generate(req).await.expect_err("refused");
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
            assert!(err.message().contains(field), "{err}");
        }
    });
    mesh.assert_pages_come_back();
}
