use super::*;
use crate::gguf::{GgufHeader, GgufValue};
use crate::testing::{
    set_metadata, smollm2_gguf, tiny_gguf_metadata, tiny_text_tokenizer, write_gguf,
    write_hf_tokenizer, TINY_BOS, TINY_EOS,
};

/// SmolLM2-135M-Instruct's chat template (from its GGUF metadata).
pub(super) const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

pub(super) fn tiny(template: Option<&str>, add_bos: bool) -> TextTokenizer {
    tiny_text_tokenizer(template, add_bos)
}

pub(super) fn user(content: &str) -> ChatMessage {
    ChatMessage::new("user", content)
}

#[test]
fn tiny_tokenizer_round_trips_and_maps_special_text() {
    let t = tiny(None, false);
    assert_eq!(t.vocab_size(), 264);
    let hello = t.token_to_id("hello").expect("merged token");
    assert_eq!(t.encode("hello").expect("encode"), vec![hello]);
    let ids = t.encode("<|im_start|>hello<|im_end|>").expect("encode");
    assert_eq!(ids, vec![262, hello, 263]);
    assert_eq!(t.decode(&ids, true).expect("decode"), "hello");
    assert_eq!(
        t.decode(&ids, false).expect("decode"),
        "<|im_start|>hello<|im_end|>"
    );
    let text = "héllo wörld 世界 🙂\n\ttabs";
    assert_eq!(
        t.decode(&t.encode(text).expect("encode"), false)
            .expect("decode"),
        text
    );

    // add_bos prepends once, and not before a text that starts with BOS.
    let with_bos = tiny(None, true);
    assert_eq!(
        with_bos.encode("hello").expect("encode"),
        vec![TINY_BOS, hello]
    );
    assert_eq!(
        with_bos.encode("<s>hello").expect("encode"),
        vec![TINY_BOS, hello]
    );
    assert_eq!(with_bos.encode_raw("hello").expect("encode"), vec![hello]);
}

#[test]
fn stream_decoder_emits_only_whole_characters() {
    let t = tiny(None, false);
    let text = "héllo 世界 🙂!";
    let mut ids = t.encode(text).expect("encode");
    ids.insert(3, 263); // a special token in the middle is skipped
    let mut stream = t.stream_decoder();
    let mut pieces = Vec::new();
    let mut silent_steps = 0;
    for &id in &ids {
        match stream.push(id).expect("push") {
            Some(piece) => {
                assert!(
                    !piece.contains('\u{FFFD}'),
                    "piece {piece:?} has a replacement character"
                );
                pieces.push(piece);
            }
            None => silent_steps += 1,
        }
    }
    if let Some(rest) = stream.finish().expect("finish") {
        pieces.push(rest);
    }
    assert_eq!(pieces.concat(), text);
    assert_eq!(pieces.concat(), t.decode(&ids, true).expect("decode"));
    // One byte per token: é waits one step, 世 and 界 two each, 🙂 three,
    // the special token one.
    assert_eq!(silent_steps, 1 + 2 + 2 + 3 + 1);
    assert!(
        pieces.contains(&"世".to_owned()) && pieces.contains(&"🙂".to_owned()),
        "{pieces:?}"
    );
}

#[test]
fn stream_decoder_flushes_an_incomplete_tail() {
    let t = tiny(None, false);
    let ids = t.encode("a🙂").expect("encode");
    let mut stream = t.stream_decoder();
    assert_eq!(stream.push(ids[0]).expect("push"), Some("a".to_owned()));
    assert_eq!(stream.push(ids[1]).expect("push"), None);
    assert_eq!(
        stream.finish().expect("finish"),
        Some("\u{FFFD}".to_owned())
    );
    assert_eq!(stream.finish().expect("finish"), None);
}

#[test]
fn smollm2_chat_template_renders_as_transformers() {
    let t = tiny(Some(SMOLLM2_TEMPLATE), false);
    assert_eq!(
        t.apply_chat_template(&[user("Hi")], true).expect("render"),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let with_system = [ChatMessage::new("system", "Be brief."), user("Hi")];
    assert_eq!(
        t.apply_chat_template(&with_system, false).expect("render"),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    );
}

#[test]
fn chat_template_features_and_failures() {
    // trim_blocks / lstrip_blocks, Python string methods, bos_token.
    let template = "{{ bos_token }}\n{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content.strip().upper() }}]\n    {% endif %}\n{% endfor %}";
    let t = tiny(Some(template), false);
    assert_eq!(
        t.apply_chat_template(&[user("  hi "), ChatMessage::new("assistant", "x")], false)
            .expect("render"),
        "<s>\n[HI]\n"
    );

    let strict = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with the user') }}{% endif %}ok";
    let t = tiny(Some(strict), false);
    assert_eq!(
        t.apply_chat_template(&[user("x")], false).expect("render"),
        "ok"
    );
    match t.apply_chat_template(&[ChatMessage::new("assistant", "x")], false) {
        Err(TokenizerError::ChatTemplate { detail }) => {
            assert!(
                detail.contains("Conversation must start with the user"),
                "{detail}"
            );
        }
        other => panic!("expected ChatTemplate, got {other:?}"),
    }

    let t = tiny(Some("{{ strftime_now('%Y') }}"), false);
    let year: i32 = t
        .apply_chat_template(&[], false)
        .expect("render")
        .parse()
        .expect("a year");
    assert!(year >= 2024);

    let t = tiny(Some("{% for %}"), false);
    assert!(
        matches!(t.apply_chat_template(&[], false), Err(TokenizerError::ChatTemplate { ref detail }) if detail.contains("compile"))
    );

    let t = tiny(None, false);
    match t.apply_chat_template(&[user("x")], true) {
        Err(TokenizerError::ChatTemplate { detail }) => {
            assert!(detail.contains("no chat template"), "{detail}")
        }
        other => panic!("expected ChatTemplate, got {other:?}"),
    }
}

/// A `tokenizer.json` that says to truncate at 8 tokens and pad to 32
/// (as `save_pretrained` may leave it) changes no prompt: every encoding
/// path gives the same ids as the file without those settings.
#[test]
fn truncation_and_padding_in_tokenizer_json_change_no_prompt() {
    let tiny = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/data/tiny-llama/tokenizer.json");
    let plain = std::fs::read_to_string(&tiny).expect("tiny tokenizer.json");
    let mut json: serde_json::Value = serde_json::from_str(&plain).expect("json");
    json["truncation"] = serde_json::json!({"direction": "Right", "max_length": 8,
        "strategy": "LongestFirst", "stride": 0});
    json["padding"] = serde_json::json!({"strategy": {"Fixed": 32}, "direction": "Right",
        "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"});
    let (a, b) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    std::fs::write(a.path().join("tokenizer.json"), &plain).expect("write");
    std::fs::write(b.path().join("tokenizer.json"), json.to_string()).expect("write");
    for dir in [&a, &b] {
        std::fs::copy(
            tiny.with_file_name("tokenizer_config.json"),
            dir.path().join("tokenizer_config.json"),
        )
        .expect("copy tokenizer_config.json");
    }
    let (plain, cut) = (
        TextTokenizer::from_hf_dir(a.path()).expect("load"),
        TextTokenizer::from_hf_dir(b.path()).expect("load"),
    );
    let text = "The quick brown fox jumps over the lazy dog and keeps on running";
    let ids = plain.encode(text).expect("encode");
    assert!(
        ids.len() > 8,
        "the prompt must be longer than the truncation"
    );
    assert_eq!(cut.encode(text).expect("encode"), ids);
    assert_eq!(
        cut.encode_raw(text).expect("encode"),
        plain.encode_raw(text).expect("encode")
    );
    let chat = [user(text)];
    assert_eq!(
        cut.encode_chat(&chat).expect("chat"),
        plain.encode_chat(&chat).expect("chat")
    );
}

#[test]
fn hf_directory_tokenizer_reads_its_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_hf_tokenizer(dir.path());
    let t = TextTokenizer::from_hf_dir(dir.path()).expect("load");
    assert_eq!(
        (t.bos_token(), t.eos_token(), t.eos_token_ids()),
        (Some("<s>"), Some("</s>"), vec![TINY_EOS])
    );
    assert_eq!(
        t.apply_chat_template(&[user("Hi")], true).expect("render"),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let hello = t.token_to_id("hello").expect("token");
    assert_eq!(
        t.encode("hello").expect("encode"),
        vec![hello],
        "add_bos_token is false"
    );

    // add_bos_token, a list-form template, and no tokenizer_config at all.
    let cfg = serde_json::json!({"bos_token": "<s>", "add_bos_token": true,
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]});
    std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).expect("write");
    let t = TextTokenizer::from_hf_dir(dir.path()).expect("load");
    assert_eq!(t.encode("hello").expect("encode"), vec![TINY_BOS, hello]);
    assert_eq!(t.chat_template(), Some("D"));
    assert_eq!(t.eos_token_ids(), Vec::<u32>::new());

    std::fs::remove_file(dir.path().join("tokenizer_config.json")).expect("rm");
    std::fs::write(dir.path().join("chat_template.jinja"), "J").expect("write");
    let t = TextTokenizer::from_hf_dir(dir.path()).expect("load");
    assert_eq!((t.bos_token(), t.chat_template()), (None, Some("J")));

    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        "{\"bos_token\": 5}",
    )
    .expect("write");
    assert!(
        matches!(TextTokenizer::from_hf_dir(dir.path()), Err(TokenizerError::InvalidField { ref field, .. }) if field == "bos_token")
    );
    std::fs::write(dir.path().join("tokenizer_config.json"), "{").expect("write");
    assert_eq!(
        TextTokenizer::from_hf_dir(dir.path())
            .map(|_| ())
            .map_err(|e| e.kind()),
        Err("malformed")
    );
    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 1}").expect("write");
    match TextTokenizer::from_hf_dir(dir.path()) {
        Err(TokenizerError::Malformed { path, .. }) => assert!(path.ends_with("tokenizer.json")),
        other => panic!("expected Malformed, got {other:?}"),
    }
}

pub(super) fn smollm2() -> Option<TextTokenizer> {
    let path = smollm2_gguf()?;
    let file = GgufHeader::read(&path).expect("open GGUF");
    Some(TextTokenizer::from_gguf(&file).expect("tokenizer"))
}

/// Ids from transformers' tokenizer for SmolLM2-135M-Instruct.
const SMOLLM2_IDS: [(&str, &[u32]); 6] = [
    ("The capital of France is", &[504, 3575, 282, 4649, 314]),
    ("<|im_start|>user\nHi<|im_end|>", &[1, 4093, 198, 26843, 2]),
    ("12345", &[33, 34, 35, 36, 37]),
    (
        "héllo 世界 🙂",
        &[88, 2756, 31394, 216, 7906, 240, 178, 239, 230, 47526],
    ),
    (
        "  multiple   spaces\n\nand\ttabs",
        &[216, 2701, 256, 5600, 198, 198, 397, 197, 100, 7366],
    ),
    (
        "I'm don't 3.14159 x=1+2",
        &[
            57, 5248, 1326, 982, 216, 35, 30, 33, 36, 33, 37, 41, 1792, 45, 33, 27, 34,
        ],
    ),
];

#[test]
fn smollm2_gguf_tokenizer_matches_transformers() {
    let Some(t) = smollm2() else { return };
    assert_eq!(t.vocab_size(), 49152);
    for (text, want) in SMOLLM2_IDS {
        let ids = t.encode(text).expect("encode");
        assert_eq!(ids, want, "{text:?}");
        assert_eq!(t.decode(&ids, false).expect("decode"), text);
    }
    let digits = t.encode("12345").expect("encode");
    for (id, d) in digits.iter().zip(["1", "2", "3", "4", "5"]) {
        assert_eq!(t.decode(&[*id], false).expect("decode"), d);
    }
    assert_eq!(
        (t.bos_token(), t.eos_token(), t.eos_token_ids()),
        (Some("<|im_start|>"), Some("<|im_end|>"), vec![2, 0])
    );
    assert_eq!(t.token_to_id("<|endoftext|>"), Some(0));
    assert_eq!(
        t.decode(&[1, 4093, 198, 26843, 2], true).expect("decode"),
        "user\nHi"
    );
    let rendered = t.apply_chat_template(&[user("Hi")], true).expect("render");
    assert!(rendered.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
    let ids = t.encode_raw(&rendered).expect("encode");
    assert_eq!(
        ids.iter().filter(|&&i| i == 1).count(),
        3,
        "three <|im_start|> tokens"
    );
}

#[test]
fn smollm2_stream_decoder_on_multibyte_text() {
    let Some(t) = smollm2() else { return };
    let text = "héllo 世界 🙂 — ½ café";
    let ids = t.encode(text).expect("encode");
    let mut stream = t.stream_decoder();
    let mut out = String::new();
    for &id in &ids {
        if let Some(piece) = stream.push(id).expect("push") {
            assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
            out.push_str(&piece);
        }
    }
    out.push_str(&stream.finish().expect("finish").unwrap_or_default());
    assert_eq!(out, text);
    assert_eq!(out, t.decode(&ids, true).expect("decode"));
}

#[test]
fn gguf_vocabulary_errors_name_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.gguf");
    let with = |key: &str, v: GgufValue| {
        let mut md = tiny_gguf_metadata();
        set_metadata(&mut md, key, v);
        write_gguf(&path, &md);
        TextTokenizer::from_gguf(&GgufHeader::read(&path).expect("open"))
    };
    assert!(
        matches!(with("tokenizer.ggml.model", GgufValue::String("bert".into())), Err(TokenizerError::InvalidField { ref field, ref value, ref reason, .. }) if field == "tokenizer.ggml.model" && value == "\"bert\"" && reason.contains("gpt2") && reason.contains("llama"))
    );
    // An unknown pre-tokenizer is named, with every supported one.
    match with(
        "tokenizer.ggml.pre",
        GgufValue::String("deepseek-llm".into()),
    ) {
        Err(TokenizerError::InvalidField {
            field,
            value,
            reason,
            ..
        }) => {
            assert_eq!(
                (field.as_str(), value.as_str()),
                ("tokenizer.ggml.pre", "\"deepseek-llm\"")
            );
            for name in [
                "qwen2",
                "llama-bpe",
                "llama3",
                "gpt2",
                "smollm",
                "default",
                "tekken",
            ] {
                assert!(reason.contains(name), "{reason}");
            }
        }
        other => panic!("expected InvalidField, got {other:?}"),
    }
    assert!(
        matches!(with("tokenizer.ggml.merges", GgufValue::Array(vec![GgufValue::String("nospace".into())])), Err(TokenizerError::InvalidField { ref field, .. }) if field == "tokenizer.ggml.merges[0]")
    );
    assert!(
        matches!(with("tokenizer.ggml.unknown_token_id", GgufValue::U32(264)), Err(TokenizerError::InvalidField { ref field, .. }) if field == "tokenizer.ggml.unknown_token_id")
    );
    assert!(
        matches!(with("tokenizer.ggml.eos_token_id", GgufValue::U32(100_000)), Err(TokenizerError::InvalidField { ref field, .. }) if field == "tokenizer.ggml.eos_token_id")
    );
    let t = with("tokenizer.ggml.eot_token_id", GgufValue::U32(263)).expect("eot");
    assert_eq!(
        t.eos_token_ids(),
        vec![TINY_EOS, 263],
        "EOT ends generation too"
    );
}
