use super::*;
use crate::gguf::GgufValue;
use crate::testing::{
    set_metadata, smollm2_gguf, tiny_gguf_metadata, write_gguf, write_hf_tokenizer, TINY_BOS,
    TINY_EOS,
};

fn write_config(dir: &Path, config: serde_json::Value) {
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write");
}

#[test]
fn a_hugging_face_directory_is_read_from_its_json_files_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_hf_tokenizer(dir.path());
    write_config(
        dir.path(),
        serde_json::json!({"model_type": "llama", "max_position_embeddings": 128,
            "eos_token_id": [TINY_EOS, 262, 262]}),
    );
    // A weight file that is not one: never opened.
    std::fs::write(dir.path().join("model.safetensors"), "not weights").expect("write");
    let info = ModelInfo::read(dir.path()).expect("read");
    assert_eq!(info.context_length, 128);
    assert_eq!(info.config_eos_token_ids, vec![TINY_EOS, 262]);
    assert_eq!(
        info.stop_token_ids(),
        vec![TINY_EOS, 262],
        "the tokenizer's </s> is already there"
    );
    assert!(info
        .chat_template()
        .is_some_and(|t| t.contains("<|im_start|>")));
    assert_eq!(info.tokenizer.token_to_id("<s>"), Some(TINY_BOS));

    // Defaults, and errors that name the field.
    write_config(dir.path(), serde_json::json!({"model_type": "llama"}));
    let info = ModelInfo::read(dir.path()).expect("read");
    assert_eq!(info.context_length, HF_DEFAULT_CONTEXT_LENGTH);
    assert_eq!(
        (info.config_eos_token_ids.clone(), info.stop_token_ids()),
        (vec![], vec![TINY_EOS])
    );
    for (config, field) in [
        (serde_json::json!({"eos_token_id": "two"}), "eos_token_id"),
        (
            serde_json::json!({"max_position_embeddings": -1}),
            "max_position_embeddings",
        ),
        (
            serde_json::json!({"max_position_embeddings": 0}),
            "max_position_embeddings",
        ),
    ] {
        write_config(dir.path(), config);
        match ModelInfo::read(dir.path()) {
            Err(TokenizerError::InvalidField { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: expected InvalidField, got {other:?}"),
        }
    }
    std::fs::remove_file(dir.path().join("config.json")).expect("rm");
    assert!(matches!(
        ModelInfo::read(dir.path()),
        Err(TokenizerError::MissingFile {
            what: "config.json",
            ..
        })
    ));
}

#[test]
fn a_gguf_file_is_read_from_its_header() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.gguf");
    let mut md = tiny_gguf_metadata();
    set_metadata(&mut md, "tokenizer.ggml.eot_token_id", GgufValue::U32(263));
    set_metadata(
        &mut md,
        "tokenizer.ggml.eom_token_id",
        GgufValue::U32(TINY_EOS),
    );
    write_gguf(&path, &md);
    let info = ModelInfo::read(&path).expect("read");
    assert_eq!(info.context_length, 128);
    assert_eq!(info.config_eos_token_ids, vec![TINY_EOS, 263]);
    assert_eq!(info.stop_token_ids(), vec![TINY_EOS, 263]);
    assert_eq!(
        info.chat_template(),
        Some("{% for m in messages %}{{ m.content }}{% endfor %}")
    );

    // The context length key follows the architecture.
    set_metadata(
        &mut md,
        "general.architecture",
        GgufValue::String("qwen2".into()),
    );
    write_gguf(&path, &md);
    assert!(
        matches!(ModelInfo::read(&path), Err(TokenizerError::MissingField { ref field, .. }) if field == "qwen2.context_length")
    );
    set_metadata(&mut md, "qwen2.context_length", GgufValue::U64(32768));
    write_gguf(&path, &md);
    assert_eq!(
        ModelInfo::read(&path).map(|i| i.context_length).ok(),
        Some(32768)
    );

    let text = dir.path().join("notes.gguf");
    std::fs::write(&text, "hello, not a model").expect("write");
    assert!(matches!(
        ModelInfo::read(&text),
        Err(TokenizerError::Malformed { .. })
    ));
    let missing = dir.path().join("nope");
    assert!(matches!(
        ModelInfo::read(&missing),
        Err(TokenizerError::MissingFile { .. })
    ));
}

#[test]
fn stop_ids_are_the_configuration_s_then_the_tokenizer_s() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_hf_tokenizer(dir.path());
    let t = TextTokenizer::from_hf_dir(dir.path()).expect("tokenizer");
    assert_eq!(t.eos_token_ids(), vec![TINY_EOS]);
    assert_eq!(stop_token_ids(&[], &t), vec![TINY_EOS]);
    assert_eq!(stop_token_ids(&[7, 3], &t), vec![7, 3, TINY_EOS]);
    assert_eq!(stop_token_ids(&[TINY_EOS, 7], &t), vec![TINY_EOS, 7]);
}

#[test]
fn smollm2_metadata_without_its_weights() {
    let Some(path) = smollm2_gguf() else { return };
    let info = ModelInfo::read(&path).expect("read");
    assert_eq!(info.context_length, 8192);
    // <|im_end|>, and <|endoftext|> (a control token that ends a turn).
    assert_eq!(info.stop_token_ids(), vec![2, 0]);
    assert_eq!(info.tokenizer.vocab_size(), 49152);
}
