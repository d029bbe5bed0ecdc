//! Tools through the mesh (router -> decode -> prefill, real gRPC and KV
//! transport) on SmolLM2-135M-Instruct (the default model: its chat
//! template does not read `tools`, so the gateway renders them the Hermes
//! way; the tiny model's 256-token window cannot hold that preamble).
//! `required` and a named function are grammars: the output always parses
//! into calls whose arguments validate against the tool's schema (a real
//! JSON Schema validator), over HTTP streamed and not and over the public
//! gRPC API. Skipped with a note when the model is not fetched.

use std::path::PathBuf;

use kvmesh_integration::http;
use kvmesh_integration::inproc::{InProcessMesh, Options};
use kvmesh_proto::v1::generation_client::GenerationClient;
use kvmesh_proto::v1::{
    generate_request, tool_choice, Chat, ChatMessage, FinishReason, GenerateRequest, Tool,
    ToolChoice, ToolChoiceMode,
};
use serde_json::{json, Value};

const BUDGET: u32 = 80;

/// SmolLM2-135M-Instruct (`kvmesh fetch-model`'s), if it is there: tools
/// need its window (the tiny model's 256 tokens cannot hold the tools
/// preamble).
fn smollm2() -> Option<PathBuf> {
    kvmesh_model::default_model::cached_default_model().or_else(|| {
        eprintln!(
            "note: SmolLM2 is not fetched; the tools test is skipped (run `kvmesh fetch-model`)"
        );
        None
    })
}

fn weather_schema() -> Value {
    json!({"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": false})
}

fn time_schema() -> Value {
    json!({"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
           "required": ["zone"], "additionalProperties": false})
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
            "parameters": weather_schema(), "strict": true}},
        {"type": "function", "function": {"name": "get_time", "description": "Current time in a zone",
            "parameters": time_schema()}},
    ])
}

/// Each call (name, arguments) of a response, whole or streamed (the
/// deltas put together by index), and its finish reason.
fn calls_whole(v: &Value) -> (Vec<(String, String)>, String) {
    let c = &v["choices"][0];
    let calls = c["message"]["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("no tool calls: {v}"))
        .iter()
        .map(|t| {
            assert!(t["id"].as_str().is_some_and(|id| id.starts_with("call_")));
            assert_eq!(t["type"], "function");
            (
                t["function"]["name"].as_str().expect("name").to_owned(),
                t["function"]["arguments"]
                    .as_str()
                    .expect("arguments")
                    .to_owned(),
            )
        })
        .collect();
    (
        calls,
        c["finish_reason"].as_str().unwrap_or_default().to_owned(),
    )
}

fn calls_streamed(chunks: &[Value]) -> (Vec<(String, String)>, String) {
    let (mut calls, mut finish): (Vec<(String, String)>, String) = (Vec::new(), String::new());
    for v in chunks {
        let c = &v["choices"][0];
        for d in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = d["index"].as_u64().expect("index") as usize;
            if let Some(name) = d["function"]["name"].as_str() {
                assert!(d["id"].as_str().is_some_and(|id| id.starts_with("call_")));
                assert_eq!(i, calls.len(), "calls open in order");
                calls.push((name.to_owned(), String::new()));
            }
            calls[i]
                .1
                .push_str(d["function"]["arguments"].as_str().unwrap_or_default());
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_owned();
        }
    }
    (calls, finish)
}

/// Every call names a tool and its arguments validate against its schema.
fn assert_valid(calls: &[(String, String)], only: Option<&str>) {
    assert!(!calls.is_empty());
    for (name, args) in calls {
        if let Some(only) = only {
            assert_eq!(name, only);
        }
        let schema = match name.as_str() {
            "get_weather" => weather_schema(),
            "get_time" => time_schema(),
            other => panic!("unknown function {other}"),
        };
        let v: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{e}: {args}"));
        let validator = jsonschema::validator_for(&schema).expect("a valid schema");
        assert!(validator.is_valid(&v), "{args} under {schema}");
    }
}

#[test]
fn tool_calls_through_the_mesh() {
    let Some(model) = smollm2() else { return };
    let mesh = InProcessMesh::start(&model, Options::default()).expect("the mesh");
    let messages = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    let path = "/v1/chat/completions";
    for (choice, only) in [
        (
            json!({"type": "function", "function": {"name": "get_weather"}}),
            Some("get_weather"),
        ),
        (json!("required"), None),
    ] {
        let body = json!({"messages": messages, "tools": tools(), "tool_choice": choice,
            "max_tokens": BUDGET, "temperature": 0});
        let whole = http::complete(&mesh.http, path, &body);
        let (calls, finish) = calls_whole(&whole);
        assert_eq!(finish, "tool_calls", "{whole}");
        assert_valid(&calls, only);
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (s_calls, s_finish) = calls_streamed(&http::stream_chunks(&mesh.http, path, &streamed));
        assert_eq!(
            (s_calls, s_finish),
            (calls, finish),
            "greedy: stream equals whole"
        );
    }

    // A second turn: the call and its answer rendered back; none parses
    // nothing.
    let turn = json!({"messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}],
        "tools": tools(), "tool_choice": "none", "max_tokens": 16, "temperature": 0});
    let v = http::complete(&mesh.http, path, &turn);
    assert!(
        v["choices"][0]["message"].get("tool_calls").is_none(),
        "{v}"
    );
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");

    mesh.block_on(grpc_tools(&mesh));
    mesh.assert_pages_come_back();
}

async fn grpc_tools(mesh: &InProcessMesh) {
    let mut client = GenerationClient::connect(format!("http://{}", mesh.grpc))
        .await
        .expect("connect");
    let tools = vec![
        Tool {
            name: "get_weather".into(),
            description: "Current weather in a city".into(),
            parameters: weather_schema().to_string(),
            strict: Some(true),
        },
        Tool {
            name: "get_time".into(),
            description: String::new(),
            parameters: time_schema().to_string(),
            strict: None,
        },
    ];
    for (kind, only) in [
        (
            tool_choice::Kind::Function("get_time".into()),
            Some("get_time"),
        ),
        (
            tool_choice::Kind::Mode(ToolChoiceMode::Required as i32),
            None,
        ),
    ] {
        let mut stream = client
            .generate(GenerateRequest {
                input: Some(generate_request::Input::Chat(Chat {
                    messages: vec![ChatMessage {
                        role: "user".into(),
                        content: "What time is it in Tokyo?".into(),
                        ..Default::default()
                    }],
                })),
                max_tokens: BUDGET,
                temperature: Some(0.0),
                tools: tools.clone(),
                tool_choice: Some(ToolChoice { kind: Some(kind) }),
                ..Default::default()
            })
            .await
            .expect("generate")
            .into_inner();
        let (mut calls, mut finish): (Vec<(String, String)>, i32) = (Vec::new(), 0);
        while let Some(m) = stream.message().await.expect("message") {
            assert!(
                m.text.is_empty(),
                "a constrained choice is all calls: {:?}",
                m.text
            );
            for c in m.tool_calls {
                if !c.name.is_empty() {
                    assert!(c.id.starts_with("call_"));
                    calls.push((c.name, String::new()));
                }
                calls[c.index as usize].1.push_str(&c.arguments);
            }
            if m.finish_reason != 0 {
                finish = m.finish_reason;
            }
        }
        assert_eq!(finish, FinishReason::ToolCalls as i32);
        assert_valid(&calls, only);
    }
    // A named function not among the tools: INVALID_ARGUMENT.
    let err = client
        .generate(GenerateRequest {
            input: Some(generate_request::Input::Chat(Chat {
                messages: vec![ChatMessage {
                    role: "user".into(),
                    content: "hi".into(),
                    ..Default::default()
                }],
            })),
            tools,
            tool_choice: Some(ToolChoice {
                kind: Some(tool_choice::Kind::Function("nope".into())),
            }),
            ..Default::default()
        })
        .await
        .expect_err("refused");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("tool_choice"), "{}", err.message());
}
