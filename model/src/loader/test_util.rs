//! Tiny models written to a temporary directory for tests: a Hugging Face
//! directory and a GGUF file, with the f32 tensors the loader should
//! produce from them. The tokenizer and its metadata are the tokenizer
//! crate's fixtures (`kvmesh_tokenizer::testing`); the GGUF files are
//! written by candle's writer, so the tokenizer crate's parser is also
//! tested against a writer that is not its own.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value as GgufValue};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use serde_json::json;

use crate::weights::{permute_qk_rows, plan, Layout};
use crate::ModelConfig;

pub(crate) use kvmesh_tokenizer::testing::{TINY_BOS, TINY_EOS, TINY_VOCAB};

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
    kvmesh_tokenizer::testing::write_hf_tokenizer(dir);

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

/// Metadata of the tiny GGUF model (the tokenizer crate's), as candle's
/// writer takes it.
pub(crate) fn tiny_gguf_metadata() -> Vec<(String, GgufValue)> {
    fn candle(v: kvmesh_tokenizer::GgufValue) -> GgufValue {
        use kvmesh_tokenizer::GgufValue as T;
        match v {
            T::U8(x) => GgufValue::U8(x),
            T::I8(x) => GgufValue::I8(x),
            T::U16(x) => GgufValue::U16(x),
            T::I16(x) => GgufValue::I16(x),
            T::U32(x) => GgufValue::U32(x),
            T::I32(x) => GgufValue::I32(x),
            T::U64(x) => GgufValue::U64(x),
            T::I64(x) => GgufValue::I64(x),
            T::F32(x) => GgufValue::F32(x),
            T::F64(x) => GgufValue::F64(x),
            T::Bool(x) => GgufValue::Bool(x),
            T::String(x) => GgufValue::String(x),
            T::Array(xs) => GgufValue::Array(xs.into_iter().map(candle).collect()),
        }
    }
    kvmesh_tokenizer::testing::tiny_gguf_metadata()
        .into_iter()
        .map(|(k, v)| (k, candle(v)))
        .collect()
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
    kvmesh_tokenizer::testing::smollm2_gguf()
}

#[test]
fn the_tokenizer_crate_looks_for_the_default_model_where_it_is_cached() {
    assert_eq!(
        kvmesh_tokenizer::testing::default_model_path(),
        crate::default_model::cache_dir().join(crate::default_model::DEFAULT_MODEL_FILE)
    );
}
