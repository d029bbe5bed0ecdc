//! Structured output through the mesh (router -> decode -> prefill, real
//! gRPC and KV transport): every constraint spelling, HTTP streamed and
//! not and the public gRPC API; the output parses and validates against
//! its schema (a real JSON Schema validator), and greedy and seeded output
//! equals the reference engine's under the same grammar (so the mask was
//! applied to prefill's first token and every decode step, and decode's
//! matcher resumed where prefill's left it). Refused schemas are 400s
//! naming the field. One mesh serves the whole file.

use kvmesh_integration::http;
use kvmesh_integration::inproc::{InProcessMesh, Options};
use kvmesh_integration::tiny_model_dir;
use kvmesh_model::engine::{Engine, EngineConfig, Prompt};
use kvmesh_model::sampling::SamplingParams;
use kvmesh_model::structured::Constraint;
use kvmesh_model::ChatMessage;
use serde_json::{json, Value};

/// Tokens each answer may take: enough for every schema below (the tiny
/// model's context is 256).
const BUDGET: usize = 120;

fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object",
               "properties": {"name": {"type": "string", "maxLength": 8},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": false}),
        json!({"type": "object",
               "properties": {
                   "color": {"enum": ["red", "green", "blue"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                            "minItems": 1, "maxItems": 3},
                   "inner": {"type": "object",
                             "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -9, "maximum": 9}},
                             "required": ["ok", "n"], "additionalProperties": false}},
               "required": ["color", "tags", "inner"], "additionalProperties": false}),
        json!({"type": "array", "items": {"enum": [1, 2, "three", null]}, "minItems": 2, "maxItems": 4}),
    ]
}

/// Greedy, and seeded with temperature: the two ways a request samples.
fn samplings() -> [(Value, SamplingParams); 2] {
    [
        (json!({"temperature": 0}), SamplingParams::greedy()),
        (
            json!({"temperature": 0.9, "top_p": 0.95, "seed": 1234}),
            SamplingParams {
                temperature: 0.9,
                top_p: 0.95,
                seed: Some(1234),
                ..SamplingParams::default()
            },
        ),
    ]
}

/// `body` whole and streamed: the text of each and the finish reason
/// (the same in both, checked).
fn answer(mesh: &InProcessMesh, path: &str, body: &Value) -> (String, String) {
    let whole = http::complete(&mesh.http, path, body);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (mut text, mut finish) = (String::new(), Value::Null);
    for v in http::stream_chunks(&mesh.http, path, &streamed) {
        text.push_str(&http::choice_text(&v));
        if !v["choices"][0]["finish_reason"].is_null() {
            finish = v["choices"][0]["finish_reason"].clone();
        }
    }
    let finish_whole = &whole["choices"][0]["finish_reason"];
    assert_eq!(&finish, finish_whole, "{body}");
    assert_eq!(
        text,
        http::choice_text(&whole),
        "streamed and whole differ: {body}"
    );
    (text, finish.as_str().unwrap_or_default().to_owned())
}

fn reference(engine: &Engine, prompt: &Prompt, c: &Constraint, p: &SamplingParams) -> String {
    let wire = c.grammar().expect("wire");
    let params = SamplingParams {
        grammar: Some(engine.compile_grammar(&wire).expect("compiles")),
        ..p.clone()
    };
    engine
        .generate(prompt, BUDGET, params, |_| {})
        .expect("reference")
        .text
}

#[test]
fn structured_output_through_the_mesh() {
    let mesh = InProcessMesh::start(&tiny_model_dir(), Options::default()).expect("the mesh");
    let engine = Engine::load(&tiny_model_dir(), &EngineConfig::default()).expect("engine");
    let messages = json!([{"role": "user", "content": "Describe a person as JSON."}]);
    let chat = Prompt::Chat(vec![ChatMessage::new("user", "Describe a person as JSON.")]);

    // JSON schemas, both spellings, chat and completions, greedy and
    // seeded: valid output, the reference engine's.
    let mut checked = 0;
    for schema in schemas() {
        let validator = jsonschema::validator_for(&schema).expect("a valid schema");
        let c = Constraint::JsonSchema(schema.clone());
        for (sampling, params) in samplings() {
            let mut chat_body = json!({"messages": messages, "max_tokens": BUDGET,
                "response_format": {"type": "json_schema",
                    "json_schema": {"name": "person", "schema": schema, "strict": true}}});
            let mut plain_body = json!({"prompt": "{\"", "max_tokens": BUDGET,
                "structured_outputs": {"json": schema}});
            for (k, v) in sampling.as_object().expect("fields") {
                chat_body[k] = v.clone();
                plain_body[k] = v.clone();
            }
            for (path, body, prompt) in [
                ("/v1/chat/completions", chat_body, chat.clone()),
                ("/v1/completions", plain_body, Prompt::Text("{\"".into())),
            ] {
                let (text, finish) = answer(&mesh, path, &body);
                assert_eq!(finish, "stop", "the grammar ended it: {text:?}");
                let v: Value = serde_json::from_str(&text)
                    .unwrap_or_else(|e| panic!("{e}: {text:?} under {schema}"));
                assert!(validator.is_valid(&v), "{text} under {schema}");
                assert_eq!(text, reference(&engine, &prompt, &c, &params), "{body}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 12);

    // json_object, regex, choice and Lark, through structured_outputs and
    // response_format.
    let text_prompt = Prompt::Text("Answer:".into());
    for (field, c, check) in [
        (
            json!({"response_format": {"type": "json_object"}}),
            Constraint::JsonObject,
            (|t: &str| serde_json::from_str::<Value>(t).is_ok_and(|v| v.is_object()))
                as fn(&str) -> bool,
        ),
        (
            json!({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,4}"}}),
            Constraint::Regex("[0-9]{3}-[a-z]{2,4}".into()),
            |t: &str| {
                let (d, l) = t.split_at(3.min(t.len()));
                d.len() == 3
                    && d.bytes().all(|b| b.is_ascii_digit())
                    && l.starts_with('-')
                    && (3..=5).contains(&l.len())
                    && l[1..].bytes().all(|b| b.is_ascii_lowercase())
            },
        ),
        (
            json!({"structured_outputs": {"choice": ["positive", "negative", "neutral"]}}),
            Constraint::Choice(vec!["positive".into(), "negative".into(), "neutral".into()]),
            |t: &str| ["positive", "negative", "neutral"].contains(&t),
        ),
        (
            json!({"structured_outputs": {"grammar": "start: \"(\" item (\",\" item)* \")\"\nitem: /[a-c]/"}}),
            Constraint::Lark("start: \"(\" item (\",\" item)* \")\"\nitem: /[a-c]/".into()),
            |t: &str| {
                t.strip_prefix('(')
                    .and_then(|t| t.strip_suffix(')'))
                    .is_some_and(|i| i.split(',').all(|x| ["a", "b", "c"].contains(&x)))
            },
        ),
    ] {
        let (sampling, params) = &samplings()[0];
        let mut body = json!({"prompt": "Answer:", "max_tokens": BUDGET});
        for (k, v) in field
            .as_object()
            .into_iter()
            .chain(sampling.as_object())
            .flatten()
        {
            body[k] = v.clone();
        }
        let (text, finish) = answer(&mesh, "/v1/completions", &body);
        assert_eq!(text, reference(&engine, &text_prompt, &c, params), "{body}");
        // A Lark list or an object may run to the budget; a complete one
        // ends with stop and passes its check.
        if finish == "stop" {
            assert!(check(&text), "{field}: {text:?}");
        } else {
            assert!(
                matches!(c, Constraint::JsonObject | Constraint::Lark(_)),
                "{field}: {text:?}"
            );
        }
    }

    // Refusals: a 400 naming the field, with the library's message.
    for (body, param, says) in [
        (
            json!({"prompt": "x", "response_format": {"type": "json_schema", "json_schema":
                {"name": "n", "schema": {"type": "integer", "minimum": 2, "maximum": 1}}}}),
            "response_format",
            "llguidance",
        ),
        (
            json!({"prompt": "x", "structured_outputs": {"regex": "([a-"}}),
            "structured_outputs",
            "llguidance",
        ),
        (
            json!({"prompt": "x", "ignore_eos": true, "structured_outputs": {"choice": ["a"]}}),
            "ignore_eos",
            "structured_outputs",
        ),
    ] {
        let r = http::post(&mesh.http, "/v1/completions", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let e = &r.json()["error"];
        assert_eq!(e["param"], param, "{e}");
        assert!(
            e["message"].as_str().is_some_and(|m| m.contains(says)),
            "{e}"
        );
    }

    // The public gRPC API: the same constraint, the same tokens.
    mesh.block_on(grpc(&mesh, &engine));
}

async fn grpc(mesh: &InProcessMesh, engine: &Engine) {
    use kvmesh_proto::v1::generation_client::GenerationClient;
    use kvmesh_proto::v1::structured_output::Kind;
    use kvmesh_proto::v1::{generate_request, FinishReason, GenerateRequest, StructuredOutput};
    let mut client = GenerationClient::connect(format!("http://{}", mesh.grpc))
        .await
        .expect("connect");
    let schema = schemas().remove(1);
    let generate = |kind| GenerateRequest {
        input: Some(generate_request::Input::Prompt("{\"".into())),
        max_tokens: BUDGET as u32,
        temperature: Some(0.9),
        top_p: Some(0.95),
        seed: Some(1234),
        structured_output: Some(StructuredOutput { kind: Some(kind) }),
        ..Default::default()
    };
    let mut stream = client
        .generate(generate(Kind::JsonSchema(schema.to_string())))
        .await
        .expect("generate")
        .into_inner();
    let (mut text, mut finish) = (String::new(), 0);
    while let Some(m) = stream.message().await.expect("message") {
        text.push_str(&m.text);
        finish = m.finish_reason;
    }
    assert_eq!(finish, FinishReason::Stop as i32, "{text:?}");
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    assert!(jsonschema::is_valid(&schema, &v), "{text}");
    let (_, seeded) = &samplings()[1];
    let want = reference(
        engine,
        &Prompt::Text("{\"".into()),
        &Constraint::JsonSchema(schema),
        seeded,
    );
    assert_eq!(text, want);
    let refused = client
        .generate(generate(Kind::Regex("(".into())))
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().contains("structured_output"),
        "{refused:?}"
    );
}
