//! [`ModelConfig`]: the shape and hyperparameters of a decoder of one of the
//! families in [`crate::arch`], from a Hugging Face `config.json` (submodule
//! `hf`) or from GGUF metadata (submodule `gguf`); each family reads its own
//! keys through its hooks.
//!
//! Both constructors end in one validation, so every `ModelConfig` in the
//! program has nonzero sizes, a head count divisible by the KV head count and
//! an even head size (in latent attention: an even rope part, and the common
//! head fields agreeing with [`Mla`]): the forward pass relies on these
//! without re-checking.

mod gguf;
pub(crate) mod hf;

use std::path::Path;

use kvmesh_kernels::rope::RopeScaling;
use serde_json::Value;

use crate::arch::mla::{Mla, MlaFieldNames};
use crate::arch::moe::Moe;
use crate::arch::{Block, LayerType};
use crate::error::{ModelError, Result};

/// Hyperparameters of a decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// `architectures[0]` of a `config.json` (e.g. `LlamaForCausalLM`), or
    /// `general.architecture` of a GGUF file (`llama`).
    pub architecture: String,
    /// The family ([`crate::arch`]'s name for it: `llama`, `qwen3`,
    /// `gemma3`, ...), whatever the source format.
    pub family: &'static str,
    /// The forward pass's switches for this family.
    pub block: Block,
    /// Each layer's attention: full, or the sliding window (one entry per
    /// layer).
    pub layer_types: Vec<LayerType>,
    /// Rope base of the [`LayerType::Sliding`] layers where it differs from
    /// [`Self::rope_theta`] (Gemma 3's local layers; no scaling).
    pub local_rope_theta: Option<f32>,
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
    /// Key/value heads; divides `n_heads` (grouped-query attention). 1 in
    /// latent attention: every head reads one shared latent entry.
    pub n_kv_heads: usize,
    /// Size of one head; even (RoPE rotates pairs). In latent attention,
    /// the query head as transformers shapes it (`qk_nope + qk_rope`,
    /// [`Mla::qk_head_dim`]), which may be odd.
    pub head_dim: usize,
    /// The leading dimensions of each head that rope rotates: `head_dim`
    /// but in a family with partial rotary embeddings (GLM-4.5: half);
    /// even, positive, at most `head_dim`. In latent attention, the rope
    /// part's width ([`Mla::qk_rope_dim`]), which is each query head's
    /// trailing part and the shared rope key ([`crate::arch::mla`]).
    pub rotary_dim: usize,
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
    /// Sliding-window span of the [`LayerType::Sliding`] layers; `None`
    /// when every layer is full.
    pub sliding_window: Option<usize>,
    /// Beginning-of-sequence token, if the model names one.
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
    /// The mixture of experts in the MLP slot of its sparse layers, where
    /// the family has one ([`crate::arch::moe`]).
    pub moe: Option<Moe>,
    /// Multi-head latent attention in place of q/k/v (DeepSeek V2 and
    /// V3, [`crate::arch::mla`]); `None`: grouped-query attention.
    pub mla: Option<Mla>,
}

/// The field names that validation errors cite, per source format.
pub(crate) struct FieldNames {
    layer_types: String,
    attn_scale: String,
    attn_softcap: String,
    softcap: String,
    vocab_size: String,
    hidden_size: String,
    intermediate_size: String,
    n_layers: String,
    n_heads: String,
    n_kv_heads: String,
    head_dim: String,
    rotary_dim: String,
    rms_norm_eps: String,
    rope_theta: String,
    max_position_embeddings: String,
    sliding_window: String,
    bos_token_id: String,
    eos_token_id: String,
    mla: MlaFieldNames,
}

impl FieldNames {
    /// The names of a Hugging Face `config.json`.
    pub(crate) fn hf() -> Self {
        Self {
            layer_types: "layer_types".into(),
            attn_scale: "query_pre_attn_scalar".into(),
            attn_softcap: "attn_logit_softcapping".into(),
            softcap: "final_logit_softcapping".into(),
            vocab_size: "vocab_size".into(),
            hidden_size: "hidden_size".into(),
            intermediate_size: "intermediate_size".into(),
            n_layers: "num_hidden_layers".into(),
            n_heads: "num_attention_heads".into(),
            n_kv_heads: "num_key_value_heads".into(),
            head_dim: "head_dim".into(),
            rotary_dim: "partial_rotary_factor".into(),
            rms_norm_eps: "rms_norm_eps".into(),
            rope_theta: "rope_theta".into(),
            max_position_embeddings: "max_position_embeddings".into(),
            sliding_window: "sliding_window".into(),
            bos_token_id: "bos_token_id".into(),
            eos_token_id: "eos_token_id".into(),
            mla: MlaFieldNames::HF,
        }
    }

    /// The names of GGUF metadata keys of architecture `arch`.
    pub(crate) fn gguf(arch: &str) -> Self {
        let key = |k: &str| format!("{arch}.{k}");
        Self {
            layer_types: key("attention.sliding_window_pattern"),
            attn_scale: key("attention.scale"),
            attn_softcap: key("attn_logit_softcapping"),
            softcap: key("final_logit_softcapping"),
            vocab_size: key("vocab_size"),
            hidden_size: key("embedding_length"),
            intermediate_size: key("feed_forward_length"),
            n_layers: key("block_count"),
            n_heads: key("attention.head_count"),
            n_kv_heads: key("attention.head_count_kv"),
            head_dim: key("attention.key_length"),
            rotary_dim: key("rope.dimension_count"),
            rms_norm_eps: key("attention.layer_norm_rms_epsilon"),
            rope_theta: key("rope.freq_base"),
            max_position_embeddings: key("context_length"),
            sliding_window: key("attention.sliding_window"),
            bos_token_id: "tokenizer.ggml.bos_token_id".into(),
            eos_token_id: "tokenizer.ggml.eos_token_id".into(),
            mla: MlaFieldNames::GGUF,
        }
    }
}

/// More layers than any released model has by far; a larger count means a
/// corrupt file, and refusing it bounds what loading allocates up front.
const MAX_LAYERS: usize = 4096;

/// Refuse a layer count over [`MAX_LAYERS`] before anything is sized by it
/// (per-layer lists are built before [`ModelConfig::validate`] runs).
pub(crate) fn check_layer_count(path: &Path, field: &str, n_layers: usize) -> Result<()> {
    if n_layers > MAX_LAYERS {
        return Err(ModelError::InvalidField {
            path: path.to_owned(),
            field: field.to_owned(),
            value: n_layers.to_string(),
            reason: format!("more than {MAX_LAYERS} layers; the file is likely corrupt"),
        });
    }
    Ok(())
}

impl ModelConfig {
    /// A KV pool of at least `tokens` slots in pages of `page_size` for
    /// this model: its layers, and the entry its attention caches per token
    /// and layer (key-value heads, or latent attention's one latent entry:
    /// [`Mla::entry_dim`] values), with
    /// `kvmesh_kvpool::PoolConfig::for_tokens`'s defaults otherwise (f32
    /// values, scrub and poison off).
    pub fn pool_config(&self, tokens: usize, page_size: usize) -> kvmesh_kvpool::PoolConfig {
        use kvmesh_kvpool::{KvEntry, PoolConfig};
        match &self.mla {
            Some(m) => PoolConfig::for_tokens(tokens, page_size, self.n_layers, 1, m.entry_dim())
                .with_entry(KvEntry::Latent),
            None => PoolConfig::for_tokens(
                tokens,
                page_size,
                self.n_layers,
                self.n_kv_heads,
                self.head_dim,
            ),
        }
    }

    /// Parse and validate a Hugging Face `config.json`.
    ///
    /// Accepts the `model_type`s of `arch::FAMILIES`. Defaults follow
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
            (names.vocab_size.as_str(), self.vocab_size),
            (names.hidden_size.as_str(), self.hidden_size),
            (names.intermediate_size.as_str(), self.intermediate_size),
            (names.n_layers.as_str(), self.n_layers),
            (names.n_heads.as_str(), self.n_heads),
            (names.n_kv_heads.as_str(), self.n_kv_heads),
            (names.head_dim.as_str(), self.head_dim),
            (
                names.max_position_embeddings.as_str(),
                self.max_position_embeddings,
            ),
        ] {
            if v == 0 {
                return Err(invalid(field, "0".into(), "must be positive"));
            }
        }
        if self.n_layers > MAX_LAYERS {
            return Err(invalid(
                names.n_layers.as_str(),
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
                names.vocab_size.as_str(),
                self.vocab_size,
                [self.vocab_size, self.hidden_size, 1],
            ),
            (
                names.n_heads.as_str(),
                self.n_heads,
                [self.n_heads, self.head_dim, self.hidden_size],
            ),
            (
                names.intermediate_size.as_str(),
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
                names.n_kv_heads.as_str(),
                self.n_kv_heads.to_string(),
                &format!(
                    "must divide the number of attention heads ({})",
                    self.n_heads
                ),
            ));
        }
        if let Some(mla) = &self.mla {
            self.validate_mla(mla, path, names)?;
        } else if !self.head_dim.is_multiple_of(2) {
            return Err(invalid(
                names.head_dim.as_str(),
                self.head_dim.to_string(),
                "must be even (RoPE rotates pairs)",
            ));
        }
        if self.rotary_dim == 0
            || self.rotary_dim > self.head_dim
            || !self.rotary_dim.is_multiple_of(2)
        {
            return Err(invalid(
                names.rotary_dim.as_str(),
                self.rotary_dim.to_string(),
                &format!(
                    "the rotated dimensions must be even, positive and at most the head size ({})",
                    self.head_dim
                ),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(invalid(
                names.rms_norm_eps.as_str(),
                self.rms_norm_eps.to_string(),
                "must be a positive number",
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(invalid(
                names.rope_theta.as_str(),
                self.rope_theta.to_string(),
                "must be a positive number",
            ));
        }
        if matches!(self.rope_scaling, RopeScaling::Yarn(_)) && self.rope_theta <= 1.0 {
            // YaRN measures rotations in `ln(theta)`.
            return Err(invalid(
                names.rope_theta.as_str(),
                self.rope_theta.to_string(),
                "YaRN scaling needs a base above 1",
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(invalid(
                names.sliding_window.as_str(),
                "0".into(),
                "must be positive or null",
            ));
        }
        if self.layer_types.len() != self.n_layers {
            return Err(invalid(
                names.layer_types.as_str(),
                format!("{} entries", self.layer_types.len()),
                &format!("must have one entry per layer ({})", self.n_layers),
            ));
        }
        if self.sliding_window.is_none() && self.layer_types.contains(&LayerType::Sliding) {
            return Err(invalid(
                names.sliding_window.as_str(),
                "null".into(),
                "sliding-window layers need a window size",
            ));
        }
        for (field, v) in [
            (names.rope_theta.as_str(), self.local_rope_theta),
            (names.attn_scale.as_str(), Some(self.block.attn_scale)),
            (names.attn_softcap.as_str(), self.block.attn_softcap),
            (names.softcap.as_str(), self.block.final_softcap),
        ] {
            if v.is_some_and(|v| !(v.is_finite() && v > 0.0)) {
                return Err(invalid(
                    field,
                    format!("{v:?}"),
                    "must be a positive number",
                ));
            }
        }
        if let Some(moe) = &self.moe {
            moe.validate(path, self.n_layers)?;
        }
        if let Some(bos) = self
            .bos_token_id
            .filter(|&id| id as usize >= self.vocab_size)
        {
            return Err(invalid(
                names.bos_token_id.as_str(),
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
                names.eos_token_id.as_str(),
                eos.to_string(),
                "is not below the vocabulary size",
            ));
        }
        Ok(())
    }

    /// Latent attention's sizes and how the common fields restate them
    /// (set together by the family's hooks; checked here so that no
    /// configuration reaches the weights with them apart).
    fn validate_mla(&self, mla: &Mla, path: &Path, names: &FieldNames) -> Result<()> {
        mla.validate(path, &names.mla)?;
        let apart = |field: &str, value: usize, expected: usize| ModelError::InvalidField {
            path: path.to_owned(),
            field: field.to_owned(),
            value: value.to_string(),
            reason: format!("latent attention implies {expected}"),
        };
        if self.head_dim != mla.qk_head_dim() {
            return Err(apart(&names.head_dim, self.head_dim, mla.qk_head_dim()));
        }
        if self.rotary_dim != mla.qk_rope_dim {
            return Err(apart(&names.rotary_dim, self.rotary_dim, mla.qk_rope_dim));
        }
        if self.n_kv_heads != 1 {
            return Err(apart(&names.n_kv_heads, self.n_kv_heads, 1));
        }
        let fits = [
            self.n_heads.checked_mul(mla.qk_head_dim() + mla.v_head_dim),
            self.n_heads.checked_mul(mla.v_head_dim),
        ]
        .iter()
        .all(|n| {
            n.and_then(|n| n.checked_mul(self.hidden_size.max(mla.kv_lora_rank)))
                .and_then(|n| n.checked_mul(4))
                .is_some()
        });
        if !fits {
            return Err(ModelError::InvalidField {
                path: path.to_owned(),
                field: names.n_heads.clone(),
                value: self.n_heads.to_string(),
                reason: "the latent attention tensor sizes it implies overflow".into(),
            });
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

    /// Columns of the output projection: `n_heads * head_dim`, or in
    /// latent attention `n_heads * v_head_dim`.
    pub fn o_dim(&self) -> usize {
        match &self.mla {
            Some(m) => self.n_heads * m.v_head_dim,
            None => self.q_dim(),
        }
    }
}

#[cfg(test)]
mod tests;
