//! [`ModelConfig`]: the shape and hyperparameters of a Llama-family model,
//! from a Hugging Face `config.json` (submodule `hf`) or from
//! GGUF metadata (submodule `gguf`).
//!
//! Both constructors end in one validation, so every `ModelConfig` in the
//! program has nonzero sizes, a head count divisible by the KV head count and
//! an even head size: the forward pass relies on these without re-checking.

mod gguf;
mod hf;

use std::path::Path;

use kvmesh_kernels::rope::RopeScaling;
use serde_json::Value;

use crate::error::{ModelError, Result};

/// Hyperparameters of a Llama-family decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// `architectures[0]` of a `config.json` (e.g. `LlamaForCausalLM`), or
    /// `general.architecture` of a GGUF file (`llama`).
    pub architecture: String,
    /// Rows of the embedding and of the LM head. At least the tokenizer's
    /// vocabulary (checked by the loader); may be larger (padding).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's gate and up projections.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads; divides `n_heads` (grouped-query attention).
    pub n_kv_heads: usize,
    /// Size of one head; even (RoPE rotates pairs).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// RoPE frequency scaling.
    pub rope_scaling: RopeScaling,
    /// Context length the model was trained for.
    pub max_position_embeddings: usize,
    /// The LM head is the embedding matrix.
    pub tie_word_embeddings: bool,
    /// The q, k and v projections have biases (Qwen2). The output
    /// projection never has one here: configurations that ask for it are
    /// refused.
    pub attention_bias: bool,
    /// Sliding-window attention span (Mistral), applied to every layer.
    pub sliding_window: Option<usize>,
    /// Beginning-of-sequence token, if the model names one.
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
}

/// The field names that validation errors cite, per source format.
pub(crate) struct FieldNames {
    vocab_size: &'static str,
    hidden_size: &'static str,
    intermediate_size: &'static str,
    n_layers: &'static str,
    n_heads: &'static str,
    n_kv_heads: &'static str,
    head_dim: &'static str,
    rms_norm_eps: &'static str,
    rope_theta: &'static str,
    max_position_embeddings: &'static str,
    sliding_window: &'static str,
    bos_token_id: &'static str,
    eos_token_id: &'static str,
}

const HF_FIELDS: FieldNames = FieldNames {
    vocab_size: "vocab_size",
    hidden_size: "hidden_size",
    intermediate_size: "intermediate_size",
    n_layers: "num_hidden_layers",
    n_heads: "num_attention_heads",
    n_kv_heads: "num_key_value_heads",
    head_dim: "head_dim",
    rms_norm_eps: "rms_norm_eps",
    rope_theta: "rope_theta",
    max_position_embeddings: "max_position_embeddings",
    sliding_window: "sliding_window",
    bos_token_id: "bos_token_id",
    eos_token_id: "eos_token_id",
};

/// More layers than any released model has by far; a larger count means a
/// corrupt file, and refusing it bounds what loading allocates up front.
const MAX_LAYERS: usize = 4096;

/// `model_type` values accepted, with the class name each implies.
const HF_MODEL_TYPES: [(&str, &str); 3] = [
    ("llama", "LlamaForCausalLM"),
    ("mistral", "MistralForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
];

impl ModelConfig {
    /// Parse and validate a Hugging Face `config.json`.
    ///
    /// Accepts `model_type` llama, mistral and qwen2. Defaults follow
    /// transformers' config classes where a checkpoint may omit a field
    /// (`num_key_value_heads`, `head_dim`, `rope_theta`, `rms_norm_eps`,
    /// `max_position_embeddings`, `tie_word_embeddings`); the sizes that
    /// define the model are required.
    pub fn from_hf_config(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ModelError::MissingFile {
                path: path.to_owned(),
                what: "config.json",
            },
            _ => ModelError::io(path, e),
        })?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::malformed(path, format!("not valid JSON: {e}")))?;
        let Value::Object(obj) = value else {
            return Err(ModelError::malformed(
                path,
                "the top level is not a JSON object",
            ));
        };
        hf::HfConfig { path, obj: &obj }.parse()
    }

    /// Check the invariants the rest of the crate relies on; `names` are the
    /// field names of the source format, cited in errors.
    pub(crate) fn validate(&self, path: &Path, names: &FieldNames) -> Result<()> {
        let invalid = |field: &str, value: String, reason: &str| ModelError::InvalidField {
            path: path.to_owned(),
            field: field.to_owned(),
            value,
            reason: reason.to_owned(),
        };
        for (field, v) in [
            (names.vocab_size, self.vocab_size),
            (names.hidden_size, self.hidden_size),
            (names.intermediate_size, self.intermediate_size),
            (names.n_layers, self.n_layers),
            (names.n_heads, self.n_heads),
            (names.n_kv_heads, self.n_kv_heads),
            (names.head_dim, self.head_dim),
            (names.max_position_embeddings, self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(invalid(field, "0".into(), "must be positive"));
            }
        }
        if self.n_layers > MAX_LAYERS {
            return Err(invalid(
                names.n_layers,
                self.n_layers.to_string(),
                &format!("more than {MAX_LAYERS} layers; the file is likely corrupt"),
            ));
        }
        // Every tensor's size in bytes must be representable, so that shape
        // arithmetic downstream cannot overflow whatever the file says.
        let fits = |dims: &[usize]| {
            dims.iter()
                .try_fold(4usize, |acc, &d| acc.checked_mul(d))
                .is_some()
        };
        for (field, value, dims) in [
            (
                names.vocab_size,
                self.vocab_size,
                [self.vocab_size, self.hidden_size, 1],
            ),
            (
                names.n_heads,
                self.n_heads,
                [self.n_heads, self.head_dim, self.hidden_size],
            ),
            (
                names.intermediate_size,
                self.intermediate_size,
                [self.intermediate_size, self.hidden_size, 1],
            ),
        ] {
            if !fits(&dims) {
                return Err(invalid(
                    field,
                    value.to_string(),
                    "the tensor sizes it implies overflow",
                ));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(invalid(
                names.n_kv_heads,
                self.n_kv_heads.to_string(),
                &format!(
                    "must divide the number of attention heads ({})",
                    self.n_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(invalid(
                names.head_dim,
                self.head_dim.to_string(),
                "must be even (RoPE rotates pairs)",
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(invalid(
                names.rms_norm_eps,
                self.rms_norm_eps.to_string(),
                "must be a positive number",
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(invalid(
                names.rope_theta,
                self.rope_theta.to_string(),
                "must be a positive number",
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(invalid(
                names.sliding_window,
                "0".into(),
                "must be positive or null",
            ));
        }
        if let Some(bos) = self
            .bos_token_id
            .filter(|&id| id as usize >= self.vocab_size)
        {
            return Err(invalid(
                names.bos_token_id,
                bos.to_string(),
                "is not below the vocabulary size",
            ));
        }
        if let Some(eos) = self
            .eos_token_ids
            .iter()
            .find(|&&id| id as usize >= self.vocab_size)
        {
            return Err(invalid(
                names.eos_token_id,
                eos.to_string(),
                "is not below the vocabulary size",
            ));
        }
        Ok(())
    }

    /// Rows of `W_q` (`n_heads * head_dim`).
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Rows of `W_k` and `W_v` (`n_kv_heads * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

#[cfg(test)]
mod tests;
