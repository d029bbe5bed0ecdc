//! [`ModelConfig`] from a Hugging Face `config.json` object.

use std::path::Path;

use kvmesh_kernels::rope::RopeScaling;
use serde_json::{Map, Value};

use super::{ModelConfig, HF_FIELDS, HF_MODEL_TYPES};
use crate::error::{ModelError, Result};

/// A `config.json` object being parsed; errors name `path` and the key.
pub(super) struct HfConfig<'a> {
    pub(super) path: &'a Path,
    pub(super) obj: &'a Map<String, Value>,
}

impl HfConfig<'_> {
    pub(super) fn parse(&self) -> Result<ModelConfig> {
        let (model_type, architecture) = self.architecture()?;

        let n_heads = self.req_usize("num_attention_heads")?;
        let hidden_size = self.req_usize("hidden_size")?;
        let head_dim = match self.opt_usize("head_dim")? {
            Some(d) => d,
            None => {
                if n_heads == 0 || hidden_size % n_heads != 0 {
                    return Err(self.invalid(
                        "num_attention_heads",
                        n_heads.to_string(),
                        format!(
                            "must divide hidden_size ({hidden_size}) when head_dim is not given"
                        ),
                    ));
                }
                hidden_size / n_heads
            }
        };

        if self.get("hidden_act").is_some() {
            let act = self.opt_str("hidden_act")?.unwrap_or_default();
            if act != "silu" {
                return Err(self.invalid(
                    "hidden_act",
                    format!("{act:?}"),
                    "only silu is implemented".into(),
                ));
            }
        }
        if self.opt_bool("mlp_bias")? == Some(true) {
            return Err(self.invalid(
                "mlp_bias",
                "true".into(),
                "MLP biases are not implemented".into(),
            ));
        }
        // Llama and Mistral's `attention_bias` also biases o_proj, which the
        // layer weights have no slot for; Qwen2 biases q, k and v only and
        // has no such key.
        let attention_bias = if model_type == "qwen2" {
            true
        } else {
            if self.opt_bool("attention_bias")? == Some(true) {
                return Err(self.invalid(
                    "attention_bias",
                    "true".into(),
                    "an output-projection bias is not implemented".into(),
                ));
            }
            false
        };

        let n_layers = self.req_usize("num_hidden_layers")?;
        let config = ModelConfig {
            architecture,
            vocab_size: self.req_usize("vocab_size")?,
            hidden_size,
            intermediate_size: self.req_usize("intermediate_size")?,
            n_layers,
            n_heads,
            n_kv_heads: self.opt_usize("num_key_value_heads")?.unwrap_or(n_heads),
            head_dim,
            rms_norm_eps: self.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta: self.opt_f32("rope_theta")?.unwrap_or(10_000.0),
            rope_scaling: self.rope_scaling()?,
            max_position_embeddings: kvmesh_tokenizer::info::hf_context_length(
                self.path, self.obj,
            )?,
            tie_word_embeddings: self.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            attention_bias,
            sliding_window: self.sliding_window(&model_type, n_layers)?,
            bos_token_id: self.opt_token_id("bos_token_id")?,
            eos_token_ids: kvmesh_tokenizer::info::hf_eos_token_ids(self.path, self.obj)?,
        };
        config.validate(self.path, &HF_FIELDS)?;
        Ok(config)
    }

    /// `(model_type, architecture)`; refuses anything outside the family.
    fn architecture(&self) -> Result<(String, String)> {
        let unsupported = |architecture: &str| ModelError::UnsupportedArchitecture {
            path: self.path.to_owned(),
            architecture: architecture.to_owned(),
        };
        let class = match self.get("architectures") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_array().and_then(|list| list.first()) {
                Some(Value::String(s)) => Some(s.as_str()),
                _ => {
                    return Err(self.invalid(
                        "architectures",
                        json_text(v),
                        "expected a list of class names".into(),
                    ))
                }
            },
        };
        let model_type = match (self.opt_str("model_type")?, class) {
            (Some(t), _) => HF_MODEL_TYPES
                .iter()
                .find(|(mt, _)| *mt == t)
                .map(|(mt, _)| *mt)
                .ok_or_else(|| unsupported(t))?,
            (None, Some(c)) => HF_MODEL_TYPES
                .iter()
                .find(|(_, cl)| *cl == c)
                .map(|(mt, _)| *mt)
                .ok_or_else(|| unsupported(c))?,
            (None, None) => return Err(self.missing("model_type")),
        };
        let architecture = match class {
            Some(c) if HF_MODEL_TYPES.iter().any(|(_, cl)| *cl == c) => c.to_owned(),
            Some(c) => return Err(unsupported(c)),
            None => model_type.to_owned(),
        };
        Ok((model_type.to_owned(), architecture))
    }

    fn rope_scaling(&self) -> Result<RopeScaling> {
        let obj = match self.get("rope_scaling") {
            None | Some(Value::Null) => return Ok(RopeScaling::None),
            Some(Value::Object(obj)) => obj,
            Some(other) => {
                return Err(self.invalid(
                    "rope_scaling",
                    json_text(other),
                    "expected an object or null".into(),
                ))
            }
        };
        let (type_key, kind) = match (obj.get("rope_type"), obj.get("type")) {
            (Some(Value::String(s)), _) => ("rope_scaling.rope_type", s.as_str()),
            (None, Some(Value::String(s))) => ("rope_scaling.type", s.as_str()),
            (Some(other), _) | (None, Some(other)) => {
                return Err(self.invalid(
                    "rope_scaling.rope_type",
                    json_text(other),
                    "expected a string".into(),
                ))
            }
            (None, None) => return Err(self.missing("rope_scaling.rope_type")),
        };
        let factor = |key: &str| -> Result<f32> {
            let field = format!("rope_scaling.{key}");
            match obj.get(key) {
                None | Some(Value::Null) => Err(self.missing(&field)),
                Some(v) => match v.as_f64() {
                    Some(x) if x.is_finite() && x > 0.0 => Ok(x as f32),
                    _ => {
                        Err(self.invalid(&field, json_text(v), "expected a positive number".into()))
                    }
                },
            }
        };
        match kind {
            "default" => Ok(RopeScaling::None),
            "linear" => Ok(RopeScaling::Linear {
                factor: factor("factor")?,
            }),
            "llama3" => {
                let low_freq_factor = factor("low_freq_factor")?;
                let high_freq_factor = factor("high_freq_factor")?;
                if high_freq_factor <= low_freq_factor {
                    return Err(self.invalid(
                        "rope_scaling.high_freq_factor",
                        high_freq_factor.to_string(),
                        format!("must exceed low_freq_factor ({low_freq_factor})"),
                    ));
                }
                let original = obj.get("original_max_position_embeddings");
                let original_max_position_embeddings = match original.and_then(Value::as_u64) {
                    Some(n) if n > 0 => usize::try_from(n).unwrap_or(usize::MAX),
                    _ => match original {
                        None | Some(Value::Null) => {
                            return Err(
                                self.missing("rope_scaling.original_max_position_embeddings")
                            )
                        }
                        Some(v) => {
                            return Err(self.invalid(
                                "rope_scaling.original_max_position_embeddings",
                                json_text(v),
                                "expected a positive integer".into(),
                            ))
                        }
                    },
                };
                Ok(RopeScaling::Llama3 {
                    factor: factor("factor")?,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                })
            }
            other => Err(self.invalid(
                type_key,
                format!("{other:?}"),
                "supported RoPE scalings are default, linear and llama3".into(),
            )),
        }
    }

    /// Mistral's window applies to every layer. Qwen2 uses it only when
    /// `use_sliding_window` is true, and then only from layer
    /// `max_window_layers` on: a mix of windowed and full layers is refused.
    fn sliding_window(&self, model_type: &str, n_layers: usize) -> Result<Option<usize>> {
        let window = self.opt_usize("sliding_window")?;
        if model_type == "llama" {
            return Ok(None);
        }
        if model_type == "qwen2" {
            if self.opt_bool("use_sliding_window")? != Some(true) {
                return Ok(None);
            }
            let from_layer = self.opt_usize("max_window_layers")?.unwrap_or(0);
            if from_layer >= n_layers {
                return Ok(None);
            }
            if from_layer > 0 {
                return Err(self.invalid(
                    "max_window_layers",
                    from_layer.to_string(),
                    format!("sliding-window attention on only some of the {n_layers} layers is not implemented"),
                ));
            }
        }
        Ok(window)
    }

    fn opt_token_id(&self, key: &str) -> Result<Option<u32>> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => self.token_id_value(key, v).map(Some),
        }
    }

    fn token_id_value(&self, key: &str, v: &Value) -> Result<u32> {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| {
                self.invalid(
                    key,
                    json_text(v),
                    "expected a token id (a non-negative integer)".into(),
                )
            })
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key)
    }

    fn req_usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.missing(key))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| {
                    self.invalid(key, json_text(v), "expected a non-negative integer".into())
                }),
        }
    }

    fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| self.invalid(key, json_text(v), "expected a number".into())),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.invalid(key, json_text(v), "expected true or false".into())),
        }
    }

    fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.invalid(key, json_text(v), "expected a string".into())),
        }
    }

    fn missing(&self, field: &str) -> ModelError {
        ModelError::MissingField {
            path: self.path.to_owned(),
            field: field.to_owned(),
        }
    }

    fn invalid(&self, field: &str, value: String, reason: String) -> ModelError {
        ModelError::InvalidField {
            path: self.path.to_owned(),
            field: field.to_owned(),
            value,
            reason,
        }
    }
}

/// A JSON value as it would appear in the file, shortened for messages.
fn json_text(v: &Value) -> String {
    let mut s = v.to_string();
    if s.len() > 80 {
        let cut = (0..=77).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
        s.truncate(cut);
        s.push_str("...");
    }
    s
}
