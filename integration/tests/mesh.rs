//! The mesh end to end, as `kvmesh serve` wires it, in this process
//! (`InProcessMesh`: router, prefill and decode on port 0, real gRPC and
//! KV transports on loopback), through the OpenAI-compatible gateway.
//! Greedy output through the mesh must equal the reference engine's
//! (`kvmesh generate`) token for token: any stale or foreign KV would
//! change it. A pool too small to start is `kvmesh serve`'s own refusal,
//! so that test runs the binary.

use std::path::Path;

use kvmesh_integration::http::{self, post_streaming};
use kvmesh_integration::inproc::{InProcessMesh, Options};
use kvmesh_integration::{run_kvmesh, texts, tiny_model_dir};
use kvmesh_kvpool::KvDtype;
use kvmesh_kvxfer::transport::TransportKind;
use kvmesh_model::default_model;
use serde_json::{json, Value};

type Mesh = InProcessMesh;

/// The in-process mesh with `opts`.
fn start(model: &Path, opts: Options) -> Mesh {
    InProcessMesh::start(model, opts).unwrap_or_else(|e| panic!("starting the mesh: {e:#}"))
}

const MAX_TOKENS: usize = 24;

/// The reference: `kvmesh generate`, greedy.
fn reference(model: &Path, prompt: &str, chat: bool, max_tokens: usize) -> String {
    kvmesh_integration::reference_text(model, prompt, chat, max_tokens)
}

/// Text through the mesh; `stream` reads SSE deltas. Returns the text and
/// the finish reason.
fn through_mesh(
    mesh: &Mesh,
    prompt: &str,
    chat: bool,
    stream: bool,
    max_tokens: usize,
) -> (String, String) {
    let (path, mut body) = if chat {
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": prompt}]}),
        )
    } else {
        ("/v1/completions", json!({"prompt": prompt}))
    };
    body["max_tokens"] = json!(max_tokens);
    body["temperature"] = json!(0);
    body["stream"] = json!(stream);
    if !stream {
        let r = http::post(&mesh.http, path, &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let c = &v["choices"][0];
        let text = if chat {
            c["message"]["content"].as_str()
        } else {
            c["text"].as_str()
        };
        let usage = &v["usage"];
        assert!(usage["prompt_tokens"].as_u64().unwrap_or(0) > 0, "{v}");
        assert!(
            usage["completion_tokens"].as_u64().unwrap_or(0) <= max_tokens as u64,
            "{v}"
        );
        return (
            text.unwrap_or_default().to_owned(),
            c["finish_reason"].as_str().unwrap_or_default().to_owned(),
        );
    }
    let mut s = post_streaming(&mesh.http, path, &body);
    assert_eq!(s.status, 200);
    let (mut text, mut finish) = (String::new(), String::new());
    while let Some(data) = s.next_event() {
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}"));
        assert!(v.get("error").is_none(), "{v}");
        let c = &v["choices"][0];
        let piece = if chat {
            c["delta"]["content"].as_str()
        } else {
            c["text"].as_str()
        };
        text.push_str(piece.unwrap_or_default());
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_owned();
        }
    }
    (text, finish)
}

const PROMPTS: [&str; 12] = [
    "Hello world",
    "The capital of France is",
    "Once upon a time",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Le chat est",
    "¿Dónde está la biblioteca?",
    "日本語のテキスト",
    "A",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown fox",
    "emoji 😀🎉 and more",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
];

fn differential(mesh: &Mesh, model: &Path, prompts: &[&str], max_tokens: usize) -> usize {
    differential_with(mesh, model, prompts, max_tokens, &[])
}

/// [`differential`] against a reference run with `extra` flags.
fn differential_with(
    mesh: &Mesh,
    model: &Path,
    prompts: &[&str],
    max_tokens: usize,
    extra: &[&str],
) -> usize {
    let mut cases = 0;
    for (i, p) in prompts.iter().enumerate() {
        for chat in [false, true] {
            let want = kvmesh_integration::reference_text_with(model, p, chat, max_tokens, extra);
            let stream = (i + usize::from(chat)) % 2 == 0;
            let (got, finish) = through_mesh(mesh, p, chat, stream, max_tokens);
            assert_eq!(got, want, "prompt {p:?} chat={chat} stream={stream}");
            assert!(finish == "length" || finish == "stop", "{finish}");
            cases += 1;
        }
    }
    cases
}

#[test]
fn mesh_output_equals_the_reference_engine_tcp() {
    let model = tiny_model_dir();
    let mesh = start(
        &model,
        Options {
            transport: TransportKind::Tcp,
            ..Options::default()
        },
    );
    let cases = differential(&mesh, &model, &PROMPTS, MAX_TOKENS);
    assert!(cases >= 20);
    assert_clean_end(&mesh, cases);
    // And the drain, as on SIGTERM, finds nothing left behind.
    let drained = mesh.shutdown().unwrap_or_else(|e| panic!("drain: {e:#}"));
    assert!(drained.decode.is_clean(), "{}", drained.decode);
    assert!(drained.prefill.is_clean(), "{}", drained.prefill);
}

/// Every one of `cases` requests completed its reservation on the decode
/// node, every page is free again, and no read was refused.
fn assert_clean_end(mesh: &Mesh, cases: usize) {
    mesh.wait_completed(cases as u64);
    mesh.assert_pages_come_back();
    assert_eq!(mesh.decode_pool().guard_violations, 0);
    assert_eq!(
        mesh.metric("kvmesh_node_kv_guard_violations_total{node=\"decode-0\"}"),
        Some(0.0)
    );
}

#[test]
fn mesh_output_equals_the_reference_engine_shm() {
    let model = tiny_model_dir();
    let mesh = start(
        &model,
        Options {
            transport: TransportKind::Shm,
            ..Options::default()
        },
    );
    differential(&mesh, &model, &PROMPTS[..4], MAX_TOKENS);
    mesh.assert_pages_come_back();
}

#[test]
fn mesh_output_equals_the_reference_engine_ucx() {
    if let Err(e) = TransportKind::Ucx.available() {
        eprintln!("not run: {e}");
        return;
    }
    let model = tiny_model_dir();
    let mesh = start(
        &model,
        Options {
            transport: TransportKind::Ucx,
            ..Options::default()
        },
    );
    let cases = differential(&mesh, &model, &PROMPTS[..6], MAX_TOKENS);
    assert_clean_end(&mesh, cases);
}

/// The same over f16 KV pools (`--kv-cache-dtype f16`, what a quantized
/// model gets by default) on both transports: prefill's f16 pages travel as
/// f16 (frames, or one-sided writes into the mapping or through UCX), their checksums cover
/// the f16 bytes, and decode attends over them; the reference engine keeps
/// f16 too, so the output still matches token for token.
#[test]
fn mesh_output_equals_the_reference_engine_with_f16_kv() {
    let model = tiny_model_dir();
    let f16 = ["--kv-cache-dtype", "f16"];
    for transport in TransportKind::ALL {
        if let Err(e) = transport.available() {
            eprintln!("{transport}: not run ({e})");
            continue;
        }
        let mut opts = Options {
            transport,
            ..Options::default()
        };
        opts.engine.kv_dtype = Some(KvDtype::F16);
        let mesh = start(&model, opts);
        let cases = differential_with(&mesh, &model, &PROMPTS[..5], MAX_TOKENS, &f16);
        assert_clean_end(&mesh, cases);
    }
}

/// The incident: nodes whose pools are smaller than the context window,
/// started with --allow-small-pool, and a prompt that fits the window but
/// not the pools. The router refuses it at once with both numbers; no node
/// reserved anything; a request that fits still runs correctly.
#[test]
fn over_length_for_the_pool_is_refused_before_any_node_is_called() {
    let model = tiny_model_dir();
    let mut opts = Options {
        allow_small_pool: true,
        ..Options::default()
    };
    opts.engine.kv_pool_tokens = Some(64);
    let mesh = start(&model, opts);
    let prompt = "word ".repeat(40);
    let r = http::post(
        &mesh.http,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 30, "temperature": 0}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let v = r.json();
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("64") && msg.contains("30 in the completion"),
        "{msg}"
    );
    assert_eq!(mesh.decode_table().granted, 0);
    assert_eq!(
        mesh.metric("kvmesh_node_reservations_granted_total{node=\"decode-0\"}"),
        Some(0.0)
    );
    assert_eq!(
        mesh.metric("kvmesh_requests_rejected_total{reason=\"context_length_exceeded\"}"),
        Some(1.0)
    );
    mesh.assert_pages_come_back();
    // Over the window itself (256) is refused the same way.
    let r = http::post(
        &mesh.http,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 300}),
    );
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (400, json!("context_length_exceeded"))
    );
    // What fits runs, and equals the reference.
    let want = reference(&model, "Hello world", false, 8);
    let (got, _) = through_mesh(&mesh, "Hello world", false, false, 8);
    assert_eq!(got, want);
    mesh.assert_pages_come_back();
}

/// Without --allow-small-pool, a pool that cannot hold one max-context
/// request is refused at startup, naming both numbers and the flags.
#[test]
fn a_small_pool_is_refused_at_startup() {
    let model = tiny_model_dir().to_string_lossy().into_owned();
    let out = run_kvmesh(
        &[
            "serve",
            "--model",
            &model,
            "--kv-pool-tokens",
            "64",
            "--http-port",
            "0",
            "--grpc-port",
            "0",
        ],
        &[],
    );
    let (_, stderr) = texts(&out);
    assert!(!out.status.success());
    for needle in [
        "64",
        "256",
        "--kv-pool-tokens",
        "--max-model-len",
        "--allow-small-pool",
    ] {
        assert!(stderr.contains(needle), "{needle} missing from: {stderr}");
    }
}

#[test]
fn bad_requests_get_openai_style_errors() {
    let mesh = start(&tiny_model_dir(), Options::default());
    for (body, param) in [
        (json!({"prompt": "x", "temperature": 9}), "temperature"),
        (json!({"prompt": "x", "top_p": 0}), "top_p"),
        (json!({"prompt": "x", "n": 17}), "n"),
        (json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
        (json!({"max_tokens": 3}), "prompt"),
    ] {
        let r = http::post(&mesh.http, "/v1/completions", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body);
    }
    let r = http::request(
        &mesh.http,
        "POST",
        "/v1/chat/completions",
        Some("{not json"),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    let r = http::post(
        &mesh.http,
        "/v1/completions",
        &json!({"model": "nope", "prompt": "x"}),
    );
    assert_eq!(r.status, 404);
    let models = http::get(&mesh.http, "/v1/models").json();
    assert_eq!(models["data"][0]["id"], "tiny-llama");
    assert_eq!(models["data"][0]["architecture"], "llama");
    assert_eq!(models["data"][0]["quantization"], "safetensors float32");
}

/// The default model through the mesh: Paris, and a client that leaves
/// mid-stream gets its pages back on both nodes.
#[test]
fn default_model_through_the_mesh() {
    let Some(model) = default_model::cached_default_model() else {
        eprintln!("note: default model not cached; skipped (run `kvmesh fetch-model`)");
        return;
    };
    let mut opts = Options::default();
    opts.engine.max_model_len = Some(1024);
    let mesh = start(&model, opts);
    let (text, _) = through_mesh(&mesh, "The capital of France is", false, false, 8);
    assert_eq!(
        text,
        reference(&model, "The capital of France is", false, 8)
    );
    assert!(text.contains("Paris"), "{text}");
    let want = reference(&model, "What is the capital of France?", true, 12);
    let (got, _) = through_mesh(&mesh, "What is the capital of France?", true, true, 12);
    assert_eq!(got, want);

    let mut s = post_streaming(
        &mesh.http,
        "/v1/completions",
        &json!({"prompt": "Once upon a time, in a land far away,", "max_tokens": 400, "temperature": 0, "stream": true}),
    );
    assert_eq!(s.status, 200);
    for _ in 0..3 {
        let ev = s.next_event().expect("an event");
        assert!(ev.contains("\"text\""), "{ev}");
    }
    drop(s);
    mesh.wait_until("the router counted the client gone", |m| {
        m.metric("kvmesh_requests_total{outcome=\"client_gone\"}") == Some(1.0)
    });
    mesh.assert_pages_come_back();
}

/// Stop strings end the text before the first match, with finish reason
/// `stop`; a seed makes sampling reproducible across requests.
#[test]
fn stop_strings_and_seeded_sampling() {
    let model = tiny_model_dir();
    let mesh = start(&model, Options::default());
    let full = reference(&model, "Hello world", false, MAX_TOKENS);
    // A stop string from the middle of the reference text.
    let chars: Vec<char> = full.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let cut = &full[..full.find(&stop).expect("stop occurs")];
    for stream in [false, true] {
        let body = json!({"prompt": "Hello world", "max_tokens": MAX_TOKENS, "temperature": 0, "stop": [stop.clone()], "stream": stream});
        let (text, finish) = if stream {
            let mut s = post_streaming(&mesh.http, "/v1/completions", &body);
            let (mut text, mut finish) = (String::new(), String::new());
            while let Some(d) = s.next_event() {
                if d == "[DONE]" {
                    break;
                }
                let v: Value = serde_json::from_str(&d).expect("json");
                text.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
                if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
                    finish = f.to_owned();
                }
            }
            (text, finish)
        } else {
            let v = http::post(&mesh.http, "/v1/completions", &body).json();
            (
                v["choices"][0]["text"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                v["choices"][0]["finish_reason"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        };
        assert_eq!(
            (text.as_str(), finish.as_str()),
            (cut, "stop"),
            "stream={stream}"
        );
    }
    // Sampling with a seed: the same text as the reference engine with that
    // seed (prefill draws the first token, decode continues the stream).
    let sampled = |seed: u64| {
        let v = http::post(
            &mesh.http,
            "/v1/completions",
            &json!({"prompt": "Hello world", "max_tokens": 16, "temperature": 1.0, "seed": seed}),
        )
        .json();
        v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    let m = model.to_string_lossy().into_owned();
    let out = run_kvmesh(
        &[
            "generate",
            "--model",
            &m,
            "--prompt",
            "Hello world",
            "--max-tokens",
            "16",
            "--temperature",
            "1",
            "--seed",
            "7",
        ],
        &[],
    );
    let want = texts(&out).0;
    assert_eq!(sampled(7), want.strip_suffix('\n').unwrap_or(&want));
    assert_eq!(sampled(7), sampled(7));
    mesh.assert_pages_come_back();
}

/// API keys: with keys configured, a request without a known key gets 401
/// (UNAUTHENTICATED over gRPC) and nothing else happens; a known key works;
/// `/metrics` needs a key with the metrics scope.
#[test]
fn api_keys_gate_every_request() {
    let mesh = start(
        &tiny_model_dir(),
        Options {
            api_keys: vec![
                ("sk-alpha-1".into(), "alpha".into()),
                ("sk-beta-2".into(), "beta".into()),
            ],
            ..Options::default()
        },
    );
    let body = json!({"prompt": "Hello world", "max_tokens": 4, "temperature": 0});
    for auth in [
        None,
        Some("Bearer sk-wrong"),
        Some("sk-alpha-1"),
        Some("Bearer "),
    ] {
        let r = http::request_with(
            &mesh.http,
            "POST",
            "/v1/completions",
            Some(&body.to_string()),
            auth,
        );
        assert_eq!(r.status, 401, "{auth:?}: {}", r.body);
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    }
    let r = http::request_with(&mesh.http, "GET", "/v1/models", None, None);
    assert_eq!(r.status, 401);
    assert_eq!(
        mesh.metric("kvmesh_requests_rejected_total{reason=\"unauthenticated\"}"),
        Some(5.0)
    );
    assert_eq!(mesh.decode_table().granted, 0);
    assert_eq!(
        mesh.metric("kvmesh_node_reservations_granted_total{node=\"decode-0\"}"),
        Some(0.0)
    );
    for key in ["sk-alpha-1", "sk-beta-2"] {
        let r = http::request_with(
            &mesh.http,
            "POST",
            "/v1/completions",
            Some(&body.to_string()),
            Some(&format!("Bearer {key}")),
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }
    mesh.wait_until("two reservations granted", |m| {
        m.decode_table().granted == 2
    });
    // Probes stay open.
    assert_eq!(http::get(&mesh.http, "/health").status, 200);
    // /metrics names the nodes, their versions and caches: only a key with
    // the metrics scope reads it (issue 35 item 5); an inference key gets
    // 403, no key 401. It carries no tenant's figure.
    let scrape = |auth: Option<&str>| http::request_with(&mesh.http, "GET", "/metrics", None, auth);
    assert_eq!(scrape(None).status, 401);
    let r = scrape(Some("Bearer sk-alpha-1"));
    assert_eq!(r.status, 403, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "insufficient_scope");
    let text = mesh.metrics();
    assert!(text.contains("kvmesh_node_up"), "{text}");
    for tenant in ["alpha", "beta", "scraper"] {
        assert!(!text.contains(tenant), "/metrics names tenant {tenant}");
    }
    // A scraper's key runs no inference.
    let r = http::request_with(
        &mesh.http,
        "POST",
        "/v1/completions",
        Some(&body.to_string()),
        Some(&format!("Bearer {}", http::SCRAPE_KEY)),
    );
    assert_eq!(r.status, 403, "{}", r.body);
}

/// Every decoder family through the mesh (prefill ships its KV, decode
/// generates): greedy text equal to `kvmesh generate`'s, on the tiny
/// random-weight model of each family (every `tiny-*` directory, in
/// safetensors; the Llama with YaRN scaling and the four mixtures of
/// experts too), and on the tiny Gemma 2, Gemma 3, Qwen3 and the mixtures
/// as quantized GGUF files (the mixtures' experts kept in their blocks). Their windows (8 to 24 positions) are shorter than the long
/// prompt, so a window layer that read a slot it should not, or a decode
/// node attending pages prefill did not write, would change the text.
#[test]
fn every_family_through_the_mesh_equals_the_reference_engine() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data");
    // Every tiny model directory: a family added with its tiny model is
    // run here without a change to this test.
    let mut models: Vec<std::path::PathBuf> = std::fs::read_dir(&data)
        .expect("model/tests/data")
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_dir()
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("tiny-"))
        })
        .collect();
    models.sort();
    for family in [
        "gemma2",
        "gemma3",
        "llama",
        "mistral",
        "phi3",
        "qwen2",
        "qwen3",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "glm4_moe",
        "gpt_oss",
        "deepseek_v2",
        "deepseek_v3",
    ] {
        assert!(
            models.iter().any(|m| m.ends_with(format!("tiny-{family}"))),
            "no tiny-{family} in {}",
            data.display()
        );
    }
    models.push(data.join("gguf/tiny-gemma2-Q8_0.gguf"));
    models.push(data.join("gguf/tiny-gemma3-Q8_0.gguf"));
    models.push(data.join("gguf/tiny-qwen3-Q4_0.gguf"));
    models.push(data.join("gguf/tiny-mixtral-Q4_0.gguf"));
    models.push(data.join("gguf/tiny-qwen2_moe-Q8_0.gguf"));
    models.push(data.join("gguf/tiny-qwen3_moe-Q4_0.gguf"));
    models.push(data.join("gguf/tiny-glm4_moe-Q8_0.gguf"));
    models.push(data.join("gguf/tiny-gpt_oss-Q8_0.gguf"));
    // Latent attention: the pages decode receives are latent entries.
    models.push(data.join("gguf/tiny-deepseek_v2-Q4_0.gguf"));
    models.push(data.join("gguf/tiny-deepseek_v3-Q8_0.gguf"));
    let prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[9], PROMPTS[11]];
    for model in &models {
        let mesh = start(model, Options::default());
        let cases = differential(&mesh, model, &prompts, MAX_TOKENS);
        assert_clean_end(&mesh, cases);
        let drained = mesh.shutdown().unwrap_or_else(|e| panic!("drain: {e:#}"));
        assert!(
            drained.decode.is_clean(),
            "{}: {}",
            model.display(),
            drained.decode
        );
    }
}

/// A `tokenizer.json` that truncates at 8 tokens (as `save_pretrained`
/// may leave one) cuts no prompt on any path through the mesh: `/tokenize`
/// counts every token of a long prompt, a completion and a chat prefill
/// them all (usage), and a prompt past the context is refused with 400,
/// not cut to fit.
#[test]
fn a_truncating_tokenizer_json_cuts_no_prompt() {
    let src = tiny_model_dir();
    let dir = tempfile::tempdir().expect("tempdir");
    for entry in std::fs::read_dir(&src).expect("tiny model").flatten() {
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).expect("copy");
    }
    let path = dir.path().join("tokenizer.json");
    let mut tok: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    tok["truncation"] = json!({"direction": "Right", "max_length": 8,
        "strategy": "LongestFirst", "stride": 0});
    std::fs::write(&path, tok.to_string()).expect("write");

    let mesh = start(dir.path(), Options::default());
    let prompt = PROMPTS[9];
    let r = http::post(&mesh.http, "/tokenize", &json!({"prompt": prompt}));
    assert_eq!(r.status, 200, "{}", r.body);
    let count = r.json()["count"].as_u64().expect("count");
    assert!(count >= 20, "{count} tokens: the prompt must be long");
    let r = http::post(
        &mesh.http,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["usage"]["prompt_tokens"],
        json!(count),
        "{}",
        r.body
    );
    let messages = json!([{"role": "user", "content": prompt}]);
    let r = http::post(&mesh.http, "/tokenize", &json!({"messages": messages}));
    let chat_count = r.json()["count"].as_u64().expect("count");
    assert!(chat_count > count, "{}", r.body);
    let r = http::post(
        &mesh.http,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["usage"]["prompt_tokens"],
        json!(chat_count),
        "{}",
        r.body
    );
    // Past the context (256 positions): refused, never cut to fit.
    let long = prompt.repeat(40);
    let r = http::post(
        &mesh.http,
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 2}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_clean_end(&mesh, 2);
}
