//! Tiny models written to a temporary directory for tests: a byte-level BPE
//! tokenizer, a Hugging Face directory and a GGUF file, with the f32 tensors
//! the loader should produce from them.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value as GgufValue};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use serde_json::json;
use tokenizers::models::bpe::BPE;
use tokenizers::AddedToken;

use crate::weights::{permute_qk_rows, plan, Layout};
use crate::ModelConfig;

/// Merges of the tiny tokenizer, in rank order.
pub(crate) const TINY_MERGES: [(&str, &str); 4] =
    [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o")];
/// Special tokens of the tiny tokenizer, after the bytes and merges.
pub(crate) const TINY_SPECIALS: [&str; 4] = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"];
/// 256 byte tokens + 4 merges + 4 specials.
pub(crate) const TINY_VOCAB: usize = 264;
/// Id of `<s>`.
pub(crate) const TINY_BOS: u32 = 260;
/// Id of `</s>`.
pub(crate) const TINY_EOS: u32 = 261;

/// GPT-2's byte-to-character table: printable bytes map to themselves,
/// the rest to code points from 256 up, in byte order.
pub(crate) fn byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            }
        })
        .collect()
}

/// The tiny tokenizer's vocabulary in id order.
pub(crate) fn tiny_tokens() -> Vec<String> {
    let mut tokens: Vec<String> = byte_chars().into_iter().map(String::from).collect();
    tokens.extend(TINY_MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    tokens.extend(TINY_SPECIALS.iter().map(|s| (*s).to_owned()));
    tokens
}

/// A byte-level BPE tokenizer over [`tiny_tokens`].
pub(crate) fn tiny_tokenizer() -> tokenizers::Tokenizer {
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

/// What to write.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TinySpec {
    /// LM head tied to the embedding.
    pub tie: bool,
    /// Qwen2 (q/k/v biases) instead of Llama.
    pub qwen2: bool,
    /// Storage dtype of HF tensors.
    pub dtype: DType,
    /// Number of safetensors files.
    pub shards: usize,
}

impl Default for TinySpec {
    fn default() -> Self {
        Self {
            tie: true,
            qwen2: false,
            dtype: DType::F32,
            shards: 1,
        }
    }
}

/// config.json of the tiny model. Sizes are multiples of 32 so every
/// GGUF block type applies.
pub(crate) fn tiny_config_json(spec: TinySpec) -> serde_json::Value {
    let (model_type, class) = if spec.qwen2 {
        ("qwen2", "Qwen2ForCausalLM")
    } else {
        ("llama", "LlamaForCausalLM")
    };
    json!({
        "architectures": [class], "model_type": model_type,
        "vocab_size": TINY_VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
        "tie_word_embeddings": spec.tie, "bos_token_id": TINY_BOS, "eos_token_id": TINY_EOS
    })
}

/// The tiny model's configuration, as parsed from [`tiny_config_json`].
pub(crate) fn tiny_config(spec: TinySpec) -> ModelConfig {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, tiny_config_json(spec).to_string()).unwrap();
    ModelConfig::from_hf_config(&path).unwrap()
}

/// Deterministic tensor values in roughly [-0.5, 0.5), distinct per `seed`.
pub(crate) fn values(shape: &[usize], seed: usize) -> Tensor {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|i| ((i * 7919 + seed * 104_729) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// The tensors of the tiny model in HF naming, f32 (what loading yields).
pub(crate) fn tiny_tensors(config: &ModelConfig) -> Vec<(String, Tensor)> {
    plan(config, Layout::Hf)
        .into_iter()
        .enumerate()
        .map(|(seed, (name, shape))| {
            let t = values(&shape, seed);
            (name, t)
        })
        .collect()
}

/// Write a tiny HF model directory; returns the f32 tensors it holds,
/// rounded through `spec.dtype`.
pub(crate) fn write_hf_model(dir: &Path, spec: TinySpec) -> HashMap<String, Tensor> {
    std::fs::write(dir.join("config.json"), tiny_config_json(spec).to_string()).unwrap();
    tiny_tokenizer()
        .save(dir.join("tokenizer.json"), false)
        .unwrap();
    let tokenizer_config = json!({
        "bos_token": {"content": "<s>", "special": true}, "eos_token": "</s>", "add_bos_token": false,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        tokenizer_config.to_string(),
    )
    .unwrap();

    let config = tiny_config(spec);
    let tensors = tiny_tensors(&config);
    let shards = spec.shards.max(1);
    let per_shard = tensors.len().div_ceil(shards);
    let mut expected = HashMap::new();
    for (i, chunk) in tensors.chunks(per_shard).enumerate() {
        let stored: HashMap<String, Tensor> = chunk
            .iter()
            .map(|(n, t)| (n.clone(), t.to_dtype(spec.dtype).unwrap()))
            .collect();
        for (n, t) in &stored {
            expected.insert(n.clone(), t.to_dtype(DType::F32).unwrap());
        }
        let name = if shards == 1 {
            "model.safetensors".to_owned()
        } else {
            format!("model-{:05}-of-{shards:05}.safetensors", i + 1)
        };
        candle_core::safetensors::save(&stored, dir.join(name)).unwrap();
    }
    expected
}

/// GGUF name of an HF tensor name.
pub(crate) fn gguf_name(hf: &str) -> String {
    let fixed = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
        return (*g).to_owned();
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, part) = rest.split_once('.').unwrap();
    let part = match part {
        "input_layernorm.weight" => "attn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        other => panic!("no GGUF name for {other}"),
    };
    format!("blk.{layer}.{part}")
}

/// Metadata of the tiny GGUF model.
pub(crate) fn tiny_gguf_metadata() -> Vec<(String, GgufValue)> {
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

/// Write a tiny GGUF model with 2-D weights stored as `matrix_dtype` (norms
/// stay F32, as llama.cpp keeps them), Q and K rows permuted as llama.cpp's
/// converter does. `edit` may change the metadata and tensors first.
/// Returns the f32 tensors in HF naming and rotate-half order that loading
/// should yield.
pub(crate) fn write_gguf_model(
    path: &Path,
    tie: bool,
    matrix_dtype: GgmlDType,
    edit: impl FnOnce(&mut Vec<(String, GgufValue)>, &mut Vec<(String, QTensor)>),
) -> HashMap<String, Tensor> {
    let spec = TinySpec {
        tie,
        ..TinySpec::default()
    };
    let config = tiny_config(spec);
    let mut expected = HashMap::new();
    let mut tensors = Vec::new();
    for (name, t) in tiny_tensors(&config) {
        let dtype = if t.rank() == 1 {
            GgmlDType::F32
        } else {
            matrix_dtype
        };
        let stored = if name.ends_with("q_proj.weight") {
            permute_qk_rows(&t, config.n_heads, config.head_dim).unwrap()
        } else if name.ends_with("k_proj.weight") {
            permute_qk_rows(&t, config.n_kv_heads, config.head_dim).unwrap()
        } else {
            t.clone()
        };
        let q = QTensor::quantize(&stored, dtype).unwrap();
        // Quantization is per row, so it commutes with the row permutation:
        // the expected value is the quantization round trip of the original.
        let roundtrip = QTensor::quantize(&t, dtype)
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap();
        expected.insert(name.clone(), roundtrip);
        tensors.push((gguf_name(&name), q));
    }
    let mut metadata = tiny_gguf_metadata();
    edit(&mut metadata, &mut tensors);
    let md: Vec<(&str, &GgufValue)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut file, &md, &ts).unwrap();
    expected
}

/// Largest absolute difference between two tensors of the same shape.
pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The default model in the cache, or `None` with a note (tests on it skip).
pub(crate) fn smollm2_gguf() -> Option<std::path::PathBuf> {
    let path = crate::default_model::cache_dir().join(crate::default_model::DEFAULT_MODEL_FILE);
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
