//! The tool-call and reasoning parsers through the gateway over the
//! scripted mesh: the format chosen from the chat template (or set), calls
//! and reasoning whole and streamed, the markers the decoded text keeps,
//! `chat_template_kwargs.enable_thinking`, and reasoning sent back in the
//! conversation.

use kvmesh_tokenizer::testing::tiny_text_tokenizer_with;

use super::*;

/// A ChatML template with `extra` appended to its generation prompt
/// (`auto` reads the format from it).
fn template(extra: &str) -> String {
    format!(
        "{{% for m in messages %}}<|im_start|>{{{{ m.role }}}}\n{{{{ m.content }}}}<|im_end|>\n{{% endfor %}}{{% if add_generation_prompt %}}<|im_start|>assistant\n{extra}{{% endif %}}"
    )
}

/// [`template`] with [`QWEN3`]'s generation prompt, writing an assistant
/// message's `reasoning_content` back as Qwen3's template does.
fn qwen3_template() -> String {
    template(QWEN3).replace(
        "\n{{ m.content }}",
        "\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}",
    )
}

/// Qwen3's generation prompt: a block opened for the model, or closed
/// empty when thinking is off.
const QWEN3: &str =
    "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}";

fn router_with(template: &str, specials: &[&str], cfg: RouterConfig) -> (Arc<FakeMesh>, Router) {
    let mesh = FakeMesh::new(Some(4096));
    let tokenizer =
        tiny_text_tokenizer_with(template, specials, &["<think>", "</think>", "<tool_call>"]);
    let cfg = RouterConfig {
        model_id: "tiny".into(),
        max_model_len: 4096,
        ..cfg
    };
    let r = Router::with_mesh(
        cfg,
        tokenizer,
        Arc::clone(&mesh) as Arc<dyn crate::mesh::Mesh>,
    );
    (mesh, r)
}

fn body(extra: Value) -> String {
    let mut b = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]});
    for (k, v) in extra.as_object().expect("fields") {
        b[k] = v.clone();
    }
    b.to_string()
}

/// The deltas and finish reasons of an SSE body, `[DONE]` left out.
fn deltas(body: &str) -> Vec<(Value, Value)> {
    let frames = sse_data(body);
    assert_eq!(frames.last().map(String::as_str), Some("[DONE]"));
    frames[..frames.len() - 1]
        .iter()
        .map(|f| {
            let v: Value = serde_json::from_str(f).expect("a JSON chunk");
            (
                v["choices"][0]["delta"].clone(),
                v["choices"][0]["finish_reason"].clone(),
            )
        })
        .collect()
}

fn nine_alphanumerics(id: &Value) -> bool {
    id.as_str()
        .is_some_and(|s| s.len() == 9 && s.chars().all(|c| c.is_ascii_alphanumeric()))
}

#[tokio::test]
async fn a_mistral_template_gets_mistral_calls_whole_and_streamed() {
    let (mesh, r) = router_with(&template("{# [TOOL_CALLS] #}"), &["[TOOL_CALLS]"], keyed());
    assert_eq!(r.parsers().tool.name(), "mistral");
    let marker = r.tokenizer().token_to_id("[TOOL_CALLS]").expect("special");
    let call = "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]";
    mesh.play(vec![
        text("Sure. "),
        text(&call[..20]),
        text(&call[20..]),
        done(Finish::Stop, 9),
    ]);
    let (status, v) = send_json(&r, "/v1/chat/completions", &body(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls");
    assert_eq!(c["message"]["content"], "Sure. ");
    assert!(c["message"].get("reasoning_content").is_none(), "{v}");
    let tc = &c["message"]["tool_calls"][0];
    assert!(nine_alphanumerics(&tc["id"]), "{tc}");
    assert_eq!(
        tc["function"],
        json!({"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"})
    );
    // The request reads calls: its decoded text keeps the marker.
    assert_eq!(mesh.received()[0].keep_special, vec![marker]);

    mesh.play(vec![
        text("Sure. [TOOL_"),
        text(&call[6..]),
        done(Finish::Stop, 9),
    ]);
    let (status, sse) = send(
        &r,
        post("/v1/chat/completions", &body(json!({"stream": true}))),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let d = deltas(&sse);
    let id = d[2].0["tool_calls"][0]["id"].clone();
    assert!(nine_alphanumerics(&id), "{id}");
    assert_eq!(
        d,
        [
            (json!({"role": "assistant", "content": ""}), Value::Null),
            (json!({"content": "Sure. "}), Value::Null),
            (
                json!({"tool_calls": [{"index": 0, "id": id, "type": "function",
                    "function": {"name": "get_weather", "arguments": ""}}]}),
                Value::Null
            ),
            (
                json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":\"Paris\"}"}}]}),
                Value::Null
            ),
            (json!({}), json!("tool_calls")),
        ]
    );
    // Without tools nothing is parsed and no marker is kept.
    mesh.play(vec![text("[1, 2]"), done(Finish::Stop, 2)]);
    let plain = json!({"messages": [{"role": "user", "content": "hi"}]}).to_string();
    let (_, v) = send_json(&r, "/v1/chat/completions", &plain).await;
    assert_eq!(v["choices"][0]["message"]["content"], "[1, 2]");
    assert!(mesh.received()[2].keep_special.is_empty());
}

#[tokio::test]
async fn llama3_json_set_by_name_reads_a_json_answer_as_calls() {
    let cfg = RouterConfig {
        tool_call_parser: "llama3_json".parse().expect("known"),
        ..keyed()
    };
    let (mesh, r) = router_with(&template(""), &["<|python_tag|>"], cfg);
    mesh.play(vec![
        text("<|python_tag|>{\"name\": \"get_weather\", \"parameters\": "),
        text("{\"city\": \"Rome\"}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}"),
        done(Finish::Stop, 20),
    ]);
    let (status, sse) = send(
        &r,
        post("/v1/chat/completions", &body(json!({"stream": true}))),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let d = deltas(&sse);
    let calls: Vec<&Value> = d.iter().filter_map(|(d, _)| d.get("tool_calls")).collect();
    assert_eq!(calls.len(), 4, "{d:?}");
    assert_eq!(calls[0][0]["function"]["name"], "get_weather");
    assert_eq!(calls[1][0]["function"]["arguments"], "{\"city\":\"Rome\"}");
    assert_eq!(calls[2][0]["index"], 1);
    assert_eq!(calls[3][0]["function"]["arguments"], "{\"city\":\"Oslo\"}");
    assert!(
        d.iter()
            .all(|(d, _)| d.get("content").is_none_or(|c| c == "")),
        "no markup in content: {d:?}"
    );
    // A plain answer is content.
    mesh.play(vec![text("It is sunny."), done(Finish::Stop, 4)]);
    let (_, v) = send_json(&r, "/v1/chat/completions", &body(json!({}))).await;
    assert_eq!(v["choices"][0]["message"]["content"], "It is sunny.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn reasoning_is_its_own_field_and_the_tools_read_the_answer_after_it() {
    let (mesh, r) = router_with(&qwen3_template(), &[], keyed());
    assert_eq!(
        (
            r.parsers().tool.name(),
            r.parsers().reasoning.map(|p| p.name())
        ),
        ("hermes", Some("qwen3"))
    );
    let answer = "I should look it up.</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    mesh.play(vec![text(answer), done(Finish::Stop, 30)]);
    let (status, v) = send_json(&r, "/v1/chat/completions", &body(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "I should look it up.");
    assert_eq!(m["content"], Value::Null);
    assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");

    // Streamed: reasoning deltas while the block is open, in pieces that
    // cut the tags.
    mesh.play(vec![
        text("Hmm, "),
        text("Paris.</thi"),
        text("nk>\n\nIt is "),
        text("sunny."),
        done(Finish::Stop, 9),
    ]);
    let plain = json!({"messages": [{"role": "user", "content": "Weather?"}], "stream": true});
    let (_, sse) = send(&r, post("/v1/chat/completions", &plain.to_string())).await;
    let d: Vec<Value> = deltas(&sse).into_iter().map(|(d, _)| d).collect();
    assert_eq!(
        d,
        [
            json!({"role": "assistant", "content": ""}),
            json!({"reasoning_content": "Hmm, "}),
            json!({"reasoning_content": "Paris."}),
            json!({"content": "It is "}),
            json!({"content": "sunny."}),
            json!({}),
        ]
    );
    // Cut by the budget inside the block: all reasoning, content null.
    mesh.play(vec![text("Still thinking"), done(Finish::Length, 3)]);
    let plain = json!({"messages": [{"role": "user", "content": "Weather?"}]});
    let (_, v) = send_json(&r, "/v1/chat/completions", &plain.to_string()).await;
    let m = &v["choices"][0]["message"];
    assert_eq!(
        (&m["reasoning_content"], &m["content"]),
        (&json!("Still thinking"), &Value::Null)
    );
}

#[tokio::test]
async fn enable_thinking_false_reaches_the_template_and_turns_reasoning_off() {
    let (mesh, r) = router_with(&qwen3_template(), &[], keyed());
    mesh.play(vec![text("<think>x</think>y"), done(Finish::Stop, 3)]);
    let b = json!({"messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": false}});
    let (status, v) = send_json(&r, "/v1/chat/completions", &b.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!(m["content"], "<think>x</think>y");
    assert!(m.get("reasoning_content").is_none(), "{m}");
    let prompt = r
        .tokenizer()
        .decode(&mesh.received()[0].prompt_ids, false)
        .expect("decode");
    assert!(
        prompt.ends_with("assistant\n<think>\n\n</think>\n\n"),
        "{prompt:?}"
    );
    // A constrained answer reads no reasoning either.
    mesh.play(vec![text("{}"), done(Finish::Stop, 1)]);
    let b = json!({"messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_object"}});
    let (_, v) = send_json(&r, "/v1/chat/completions", &b.to_string()).await;
    assert_eq!(v["choices"][0]["message"]["content"], "{}");
    // Other template arguments are refused by name, not dropped.
    for kwargs in [
        json!({"add_vision_id": true}),
        json!({"enable_thinking": "no"}),
        json!([1]),
    ] {
        let b = json!({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs});
        let (status, v) = send_json(&r, "/v1/chat/completions", &b.to_string()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
        assert_eq!(v["error"]["param"], "chat_template_kwargs", "{v}");
    }
    let (status, v) = send_json(
        &r,
        "/v1/completions",
        &json!({"prompt": "hi", "chat_template_kwargs": {}}).to_string(),
    )
    .await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (StatusCode::BAD_REQUEST, &json!("chat_template_kwargs"))
    );
    assert_eq!(mesh.received().len(), 2, "refusals reach no node");
}

#[tokio::test]
async fn reasoning_sent_back_in_the_conversation_reaches_the_template() {
    let (mesh, r) = router_with(&qwen3_template(), &[], keyed());
    mesh.play(vec![text("ok</think>Fine."), done(Finish::Stop, 3)]);
    let turn = |reasoning: &str| {
        json!({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": reasoning},
            {"role": "user", "content": "and?"}]})
        .to_string()
    };
    let (status, v) = send_json(&r, "/v1/chat/completions", &turn("greet back")).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let prompt = r
        .tokenizer()
        .decode(&mesh.received()[0].prompt_ids, false)
        .expect("decode");
    assert!(
        prompt.contains("<think>greet back</think>Hello."),
        "{prompt:?}"
    );
    // It is template text: special-token text in it is refused.
    let (status, v) = send_json(&r, "/v1/chat/completions", &turn("x<|im_end|>")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["param"], "messages");
    // vLLM's newer name for the field is read too.
    mesh.play(vec![text("ok</think>Fine."), done(Finish::Stop, 3)]);
    let b = json!({"messages": [{"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello.", "reasoning": "again"}, {"role": "user", "content": "?"}]});
    let (status, _) = send_json(&r, "/v1/chat/completions", &b.to_string()).await;
    assert_eq!(status, StatusCode::OK);
}
