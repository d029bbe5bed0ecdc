//! Tools through the gateway over the scripted mesh: the definitions in the
//! prompt, calls parsed from the text (whole and streamed), the grammar of
//! a constrained choice, and refusals by name.

use super::*;

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
}

fn chat(extra: Value) -> String {
    let mut b =
        json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools()});
    for (k, v) in extra.as_object().expect("fields") {
        b[k] = v.clone();
    }
    b.to_string()
}

/// A router over `mesh` as `mesh::fake::router` makes one, with a wider
/// window: the Hermes preamble is long in the tiny model's tokens.
fn roomy(mesh: &Arc<FakeMesh>) -> Router {
    let cfg = RouterConfig {
        model_id: "tiny-llama".into(),
        max_model_len: 4096,
        ..keyed()
    };
    let mesh = Arc::clone(mesh) as Arc<dyn crate::mesh::Mesh>;
    Router::with_mesh(cfg, crate::mesh::fake::tiny_tokenizer(), mesh)
}

const CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

#[tokio::test]
async fn auto_parses_calls_and_the_prompt_offers_the_tools() {
    let mesh = FakeMesh::new(Some(4096));
    let r = roomy(&mesh);
    mesh.play(vec![
        text(&CALL[..20]),
        text(&CALL[20..]),
        done(Finish::Stop, 9),
    ]);
    let (status, v) = send_json(&r, "/v1/chat/completions", &chat(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls");
    assert_eq!(c["message"]["content"], Value::Null);
    let call = &c["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().expect("id").starts_with("call_"));
    assert_eq!(call["function"]["name"], "get_weather");
    assert_eq!(call["function"]["arguments"], "{\"city\":\"Paris\"}");
    // The tiny model's template does not read `tools`: the Hermes preamble.
    let job = &mesh.received()[0];
    let prompt = r
        .tokenizer()
        .decode(&job.prompt_ids, false)
        .expect("decode");
    assert!(prompt.contains("<tools>\n{"), "{prompt}");
    assert!(
        prompt.contains("\"description\":\"Weather now\""),
        "{prompt}"
    );
    assert!(job.sampling.grammar.is_empty(), "auto constrains nothing");

    // A multi-turn: the call and its answer go back to the model.
    mesh.play(vec![text("Sunny."), done(Finish::Stop, 2)]);
    let turn = json!({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": tools()});
    let (status, v) = send_json(&r, "/v1/chat/completions", &turn.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "Sunny.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let prompt = r
        .tokenizer()
        .decode(&mesh.received()[1].prompt_ids, false)
        .expect("decode");
    assert!(prompt.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>"), "{prompt}");
    assert!(
        prompt.contains("<tool_response>\nsunny\n</tool_response>"),
        "{prompt}"
    );
}

#[tokio::test]
async fn a_stream_holds_back_the_opening_and_sends_call_deltas() {
    let mesh = FakeMesh::new(Some(4096));
    let r = roomy(&mesh);
    mesh.play(vec![
        text("Sure <tool"),
        text(&CALL[5..30]),
        text(&CALL[30..]),
        text(" bye"),
        done(Finish::Stop, 9),
    ]);
    let (status, body) = send(
        &r,
        post("/v1/chat/completions", &chat(json!({"stream": true}))),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let frames = sse_data(&body);
    let deltas: Vec<(Value, Value)> = frames[..frames.len() - 1]
        .iter()
        .map(|f| {
            let v: Value = serde_json::from_str(f).expect("a JSON chunk");
            (
                v["choices"][0]["delta"].clone(),
                v["choices"][0]["finish_reason"].clone(),
            )
        })
        .collect();
    let id = deltas[2].0["tool_calls"][0]["id"].clone();
    assert_eq!(
        deltas,
        [
            (json!({"role": "assistant", "content": ""}), Value::Null),
            (json!({"content": "Sure "}), Value::Null),
            (
                json!({"tool_calls": [{"index": 0, "id": id, "type": "function",
                "function": {"name": "get_weather", "arguments": ""}}]}),
                Value::Null
            ),
            (
                json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":\"Paris\"}"}}]}),
                Value::Null
            ),
            (json!({"content": " bye"}), Value::Null),
            (json!({}), json!("tool_calls")),
        ]
    );
}

#[tokio::test]
async fn named_and_required_are_grammars_and_their_output_is_calls() {
    let mesh = FakeMesh::new(Some(4096));
    let r = roomy(&mesh);
    let named = json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "stream": true});
    mesh.play(vec![
        text("{\"city\":"),
        text("\"Oslo\"}"),
        done(Finish::Stop, 5),
    ]);
    let (status, body) = send(&r, post("/v1/chat/completions", &chat(named))).await;
    assert_eq!(status, StatusCode::OK);
    assert!(!mesh.received()[0].sampling.grammar.is_empty());
    let frames = sse_data(&body);
    let calls: Vec<Value> = frames[1..frames.len() - 2]
        .iter()
        .map(|f| {
            serde_json::from_str::<Value>(f).expect("chunk")["choices"][0]["delta"]["tool_calls"][0]
                .clone()
        })
        .collect();
    assert_eq!(
        calls[0]["function"],
        json!({"name": "get_weather", "arguments": ""})
    );
    assert_eq!(
        calls[1],
        json!({"index": 0, "function": {"arguments": "{\"city\":"}})
    );
    assert_eq!(
        calls[2],
        json!({"index": 0, "function": {"arguments": "\"Oslo\"}"}})
    );
    assert!(frames[frames.len() - 2].contains("\"finish_reason\":\"tool_calls\""));

    mesh.play(vec![
        text("[{\"name\":\"get_weather\",\"parameters\":{\"city\":\"Rome\"}}]"),
        done(Finish::Stop, 9),
    ]);
    let (status, v) = send_json(
        &r,
        "/v1/chat/completions",
        &chat(json!({"tool_choice": "required"})),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(!mesh.received()[1].sampling.grammar.is_empty());
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls");
    assert_eq!(
        c["message"]["tool_calls"][0]["function"]["arguments"],
        "{\"city\":\"Rome\"}"
    );

    // none: no parsing, the tools still offered.
    mesh.play(vec![text(CALL), done(Finish::Stop, 9)]);
    let (_, v) = send_json(
        &r,
        "/v1/chat/completions",
        &chat(json!({"tool_choice": "none"})),
    )
    .await;
    assert_eq!(v["choices"][0]["message"]["content"], CALL);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let prompt = r
        .tokenizer()
        .decode(&mesh.received()[2].prompt_ids, false)
        .expect("decode");
    assert!(prompt.contains("<tools>"), "{prompt}");
}

#[tokio::test]
async fn tool_refusals_name_their_field() {
    let mesh = FakeMesh::new(Some(4096));
    let r = roomy(&mesh);
    let user = json!({"role": "user", "content": "hi"});
    for (b, param) in [
        (chat(json!({"tool_choice": "required", "response_format": {"type": "json_object"}})), "tool_choice"),
        (chat(json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}})), "tool_choice"),
        (chat(json!({"tool_choice": "required", "ignore_eos": true})), "ignore_eos"),
        (chat(json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]})), "tools"),
        (json!({"messages": [user, {"role": "tool", "content": "42"}]}).to_string(), "messages"),
        (json!({"messages": [user, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
            "function": {"name": "f", "arguments": "{not json"}}]}]}).to_string(), "messages"),
        (json!({"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}]}]}).to_string(), "messages"),
        (json!({"messages": [user], "parallel_tool_calls": false}).to_string(), "parallel_tool_calls"),
        (json!({"prompt": "hi", "tools": tools()}).to_string(), "tools"),
    ] {
        let path = if b.contains("\"prompt\"") { "/v1/completions" } else { "/v1/chat/completions" };
        let (status, v) = send_json(&r, path, &b).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{b}: {v}");
        assert_eq!(v["error"]["param"], param, "{b}: {v}");
    }
    // tool_choice none leaves response_format in force.
    mesh.play(vec![text("{}"), done(Finish::Stop, 1)]);
    let (status, _) = send_json(
        &r,
        "/v1/chat/completions",
        &chat(json!({"tool_choice": "none", "response_format": {"type": "json_object"}})),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(!mesh.received()[0].sampling.grammar.is_empty());
    assert!(mesh.received().len() == 1, "refusals reach no node");
}
