//! [`ModelConfig`] from a Hugging Face `config.json` object.

use std::path::Path;

use kvmesh_kernels::rope::{yarn_attention_factor, RopeScaling, Yarn};
use serde_json::{Map, Value};

use super::{FieldNames, ModelConfig};
use crate::arch::{Activation, Block, Family, LayerType};
use crate::error::{ModelError, Result};

/// A `config.json` object being parsed; errors name `path` and the key.
pub(crate) struct HfConfig<'a> {
    pub(crate) path: &'a Path,
    pub(crate) obj: &'a Map<String, Value>,
}

impl HfConfig<'_> {
    pub(super) fn parse(&self) -> Result<ModelConfig> {
        let (family, architecture) = self.architecture()?;

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
        let n_layers = self.req_usize("num_hidden_layers")?;
        super::check_layer_count(self.path, "num_hidden_layers", n_layers)?;
        let (rope_theta, rope_scaling, rotary_factor) =
            self.rope("full_attention", family.partial_rotary)?;
        // transformers' `int(head_dim * partial_rotary_factor)`.
        let rotary_dim = (head_dim as f64 * rotary_factor) as usize;
        let mut config = ModelConfig {
            architecture,
            family: family.name,
            block: Block::llama(head_dim),
            layer_types: self.layer_types(n_layers)?.unwrap_or_default(),
            local_rope_theta: None,
            vocab_size: self.req_usize("vocab_size")?,
            hidden_size,
            intermediate_size: self.req_usize("intermediate_size")?,
            n_layers,
            n_heads,
            n_kv_heads: self.opt_usize("num_key_value_heads")?.unwrap_or(n_heads),
            head_dim,
            rotary_dim,
            rms_norm_eps: self.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: kvmesh_tokenizer::info::hf_context_length(
                self.path, self.obj,
            )?,
            tie_word_embeddings: self.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            attention_bias: false,
            sliding_window: self.opt_usize("sliding_window")?,
            bos_token_id: self.opt_token_id("bos_token_id")?,
            eos_token_ids: kvmesh_tokenizer::info::hf_eos_token_ids(self.path, self.obj)?,
            moe: None,
            mla: None,
        };
        (family.hf)(self, &mut config)?;
        if config.layer_types.is_empty() {
            config.layer_types = vec![LayerType::Full; n_layers];
        }
        if !config.layer_types.contains(&LayerType::Sliding) {
            config.sliding_window = None;
        }
        config.validate(self.path, &FieldNames::hf())?;
        Ok(config)
    }

    /// `(family, architecture)`; refuses anything no family reads.
    fn architecture(&self) -> Result<(&'static Family, String)> {
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
        let model_type = self.opt_str("model_type")?;
        if model_type.is_none() && class.is_none() {
            return Err(self.missing("model_type"));
        }
        let family = Family::by_hf(model_type, class)
            .ok_or_else(|| unsupported(model_type.or(class).unwrap_or_default()))?;
        let architecture = match class {
            Some(c) if family.hf_types.iter().any(|(_, cl)| *cl == c) => c.to_owned(),
            Some(c) => return Err(unsupported(c)),
            None => model_type.unwrap_or(family.name).to_owned(),
        };
        Ok((family, architecture))
    }

    /// `layer_types` (transformers 5 writes it): `full_attention` or
    /// `sliding_attention` per layer; `None` when absent (the family
    /// derives it).
    pub(crate) fn layer_types(&self, n_layers: usize) -> Result<Option<Vec<LayerType>>> {
        let list = match self.get("layer_types") {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::Array(list)) => list,
            Some(v) => {
                return Err(self.invalid(
                    "layer_types",
                    json_text(v),
                    "expected a list of layer types".into(),
                ))
            }
        };
        if list.len() != n_layers {
            return Err(self.invalid(
                "layer_types",
                format!("{} entries", list.len()),
                format!("must have one entry per layer ({n_layers})"),
            ));
        }
        list.iter()
            .map(|v| match v.as_str() {
                Some("full_attention") => Ok(LayerType::Full),
                Some("sliding_attention") => Ok(LayerType::Sliding),
                _ => Err(self.invalid(
                    "layer_types",
                    json_text(v),
                    "supported layer types are full_attention and sliding_attention".into(),
                )),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// The rope base and scaling of layers of `layer_type`: transformers
    /// 5's `rope_parameters` (flat, or one entry per layer type), else the
    /// older `rope_theta` and `rope_scaling` keys; and the partial rotary
    /// factor (`partial_rotary_factor` in the rope parameters or, where
    /// they have none, at the top level; 1 when absent), refused unless
    /// `partial_ok` (the family rotates part of a head).
    pub(crate) fn rope(
        &self,
        layer_type: &str,
        partial_ok: bool,
    ) -> Result<(f32, RopeScaling, f64)> {
        if let Some(Value::Object(params)) = self.get("rope_parameters") {
            let (obj, prefix) = match params.get(layer_type) {
                Some(Value::Object(inner)) => (inner, format!("rope_parameters.{layer_type}")),
                _ => (params, "rope_parameters".to_owned()),
            };
            let factor = self.partial_rotary(obj, &prefix, partial_ok)?;
            let theta_key = format!("{prefix}.rope_theta");
            let theta = match obj.get("rope_theta") {
                None | Some(Value::Null) => self.opt_f32("rope_theta")?.unwrap_or(10_000.0),
                Some(v) => v.as_f64().map(|x| x as f32).ok_or_else(|| {
                    self.invalid(&theta_key, json_text(v), "expected a number".into())
                })?,
            };
            let keys = RopeKeys {
                prefix: &prefix,
                flat: std::ptr::eq(obj, params),
                outer: params,
                outer_name: "rope_parameters",
            };
            return Ok((theta, self.rope_scaling(obj, &keys)?, factor));
        }
        let theta = self.opt_f32("rope_theta")?.unwrap_or(10_000.0);
        let (scaling, factor) = match self.get("rope_scaling") {
            None | Some(Value::Null) => (
                RopeScaling::None,
                self.partial_rotary(&Map::new(), "rope_scaling", partial_ok)?,
            ),
            Some(Value::Object(obj)) => {
                let factor = self.partial_rotary(obj, "rope_scaling", partial_ok)?;
                let keys = RopeKeys {
                    prefix: "rope_scaling",
                    flat: true,
                    outer: obj,
                    outer_name: "rope_scaling",
                };
                (self.rope_scaling(obj, &keys)?, factor)
            }
            Some(other) => {
                return Err(self.invalid(
                    "rope_scaling",
                    json_text(other),
                    "expected an object or null".into(),
                ))
            }
        };
        Ok((theta, scaling, factor))
    }

    /// `partial_rotary_factor`: in the rope parameters `obj` (named
    /// `prefix`), else at the top level (transformers copies the top-level
    /// key into rope parameters that lack it); 1 when absent. Anything but
    /// 1 is refused unless `partial_ok`, and must lie in (0, 1].
    fn partial_rotary(
        &self,
        obj: &Map<String, Value>,
        prefix: &str,
        partial_ok: bool,
    ) -> Result<f64> {
        let (field, value) = match obj.get("partial_rotary_factor") {
            None | Some(Value::Null) => match self.get("partial_rotary_factor") {
                None | Some(Value::Null) => return Ok(1.0),
                Some(v) => ("partial_rotary_factor".to_owned(), v),
            },
            Some(v) => (format!("{prefix}.partial_rotary_factor"), v),
        };
        match value.as_f64() {
            Some(1.0) => Ok(1.0),
            Some(f) if partial_ok && f > 0.0 && f < 1.0 => Ok(f),
            Some(_) if partial_ok => Err(self.invalid(
                &field,
                json_text(value),
                "must be above 0 and at most 1".into(),
            )),
            Some(_) => Err(self.invalid(
                &field,
                json_text(value),
                "partial rotary embeddings are not implemented (every head dimension is rotated)"
                    .into(),
            )),
            None => Err(self.invalid(&field, json_text(value), "expected a number".into())),
        }
    }

    /// Refuse a `hidden_act` (or Gemma's `hidden_activation`) other than
    /// `expected`.
    pub(crate) fn require_activation(&self, expected: Activation) -> Result<()> {
        for key in ["hidden_activation", "hidden_act"] {
            if let Some(act) = self.opt_str(key)? {
                if act != expected.name() {
                    return Err(self.invalid(
                        key,
                        format!("{act:?}"),
                        format!("this family runs {} only", expected.name()),
                    ));
                }
                return Ok(());
            }
        }
        Ok(())
    }

    /// Refuse `key: true` (a feature the forward pass does not have).
    pub(crate) fn refuse_true(&self, key: &str, what: &str) -> Result<()> {
        if self.opt_bool(key)? == Some(true) {
            return Err(self.invalid(key, "true".into(), format!("{what} is not implemented")));
        }
        Ok(())
    }

    fn rope_scaling(&self, obj: &Map<String, Value>, keys: &RopeKeys<'_>) -> Result<RopeScaling> {
        let prefix = keys.prefix;
        let (type_key, kind) = match (obj.get("rope_type"), obj.get("type")) {
            (Some(Value::String(s)), _) => (format!("{prefix}.rope_type"), s.as_str()),
            (None, Some(Value::String(s))) => (format!("{prefix}.type"), s.as_str()),
            (Some(other), _) | (None, Some(other)) => {
                return Err(self.invalid(
                    &format!("{prefix}.rope_type"),
                    json_text(other),
                    "expected a string".into(),
                ))
            }
            // `rope_parameters` with only a base: no scaling.
            (None, None) if prefix != "rope_scaling" => return Ok(RopeScaling::None),
            (None, None) => return Err(self.missing(&format!("{prefix}.rope_type"))),
        };
        let factor = |key: &str| -> Result<f32> {
            let field = format!("{prefix}.{key}");
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
                        &format!("{prefix}.high_freq_factor"),
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
                                self.missing(&format!("{prefix}.original_max_position_embeddings"))
                            )
                        }
                        Some(v) => {
                            return Err(self.invalid(
                                &format!("{prefix}.original_max_position_embeddings"),
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
            "yarn" => self.yarn(obj, keys).map(RopeScaling::Yarn),
            other => Err(self.invalid(
                &type_key,
                format!("{other:?}"),
                format!(
                    "{other} RoPE scaling is not implemented (supported: default, linear, llama3, yarn)"
                ),
            )),
        }
    }

    /// YaRN's parameters with transformers' defaults
    /// (`_compute_yarn_parameters` after `standardize_rope_params`):
    /// - `original_max_position_embeddings`: a top-level key of that name
    ///   wins for flat rope parameters (Phi-3 style), then the rope
    ///   parameters' own, then `max_position_embeddings`;
    /// - `factor` (required; `null` is `max_position_embeddings /
    ///   original`);
    /// - `beta_fast` 32 and `beta_slow` 1 where absent, null or 0;
    /// - `attention_factor`, else [`yarn_attention_factor`] of `factor`
    ///   with `mscale` and `mscale_all_dim`;
    /// - `truncate` (true) from the outer rope parameters, as transformers
    ///   reads it (so per-layer-type parameters always truncate).
    fn yarn(&self, obj: &Map<String, Value>, keys: &RopeKeys<'_>) -> Result<Yarn> {
        let field = |key: &str| format!("{}.{key}", keys.prefix);
        // A positive finite number; `None` where absent or null.
        let positive = |key: &str| -> Result<Option<f64>> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => match v.as_f64() {
                    Some(x) if x.is_finite() && x > 0.0 => Ok(Some(x)),
                    _ => Err(self.invalid(
                        &field(key),
                        json_text(v),
                        "expected a positive number".into(),
                    )),
                },
            }
        };
        // transformers' `get(key) or default`: 0 takes the default too.
        let beta = |key: &str, default: f64| -> Result<f64> {
            if obj.get(key).and_then(Value::as_f64) == Some(0.0) {
                return Ok(default);
            }
            Ok(positive(key)?.unwrap_or(default))
        };
        let context = kvmesh_tokenizer::info::hf_context_length(self.path, self.obj)?;
        let original = self.yarn_original(obj, keys)?.unwrap_or(context);
        let factor = match positive("factor")? {
            Some(f) => f,
            // `null`: the ratio of the context lengths, as transformers
            // does for DeepSeek-style configs.
            None if obj.contains_key("factor") => context as f64 / original.max(1) as f64,
            None => return Err(self.missing(&field("factor"))),
        };
        let attention_factor = match positive("attention_factor")? {
            Some(a) => a as f32,
            None => yarn_attention_factor(factor, positive("mscale")?, positive("mscale_all_dim")?),
        };
        let truncate = match keys.outer.get("truncate") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(self.invalid(
                    &format!("{}.truncate", keys.outer_name),
                    json_text(v),
                    "expected true or false".into(),
                ))
            }
        };
        Ok(Yarn {
            factor,
            original_max_position_embeddings: original,
            beta_fast: beta("beta_fast", 32.0)?,
            beta_slow: beta("beta_slow", 1.0)?,
            truncate,
            attention_factor,
        })
    }

    /// YaRN's original context length as transformers'
    /// `standardize_rope_params` settles it: a top-level
    /// `original_max_position_embeddings` wins for flat rope parameters
    /// (Phi-3 style configs keep it there), then the rope parameters' own;
    /// `None`: neither (`max_position_embeddings` applies).
    fn yarn_original(
        &self,
        obj: &Map<String, Value>,
        keys: &RopeKeys<'_>,
    ) -> Result<Option<usize>> {
        const KEY: &str = "original_max_position_embeddings";
        let top = if keys.flat {
            self.opt_usize(KEY)?
        } else {
            None
        };
        let (field, n) = match (top, obj.get(KEY)) {
            (Some(n), _) => (KEY.to_owned(), n),
            (None, None | Some(Value::Null)) => return Ok(None),
            (None, Some(v)) => {
                let field = format!("{}.{KEY}", keys.prefix);
                let n = v.as_u64().and_then(|n| usize::try_from(n).ok());
                let n = n.ok_or_else(|| {
                    self.invalid(&field, json_text(v), "expected a positive integer".into())
                })?;
                (field, n)
            }
        };
        if n == 0 {
            return Err(self.invalid(&field, "0".into(), "must be positive".into()));
        }
        Ok(Some(n))
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

    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key)
    }

    pub(crate) fn req_usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.missing(key))
    }

    pub(crate) fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
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

    pub(crate) fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| self.invalid(key, json_text(v), "expected a number".into())),
        }
    }

    /// `opt_f32`, but `default` where the key is absent: an explicit
    /// `null` is `None` (transformers' configs distinguish the two: a
    /// missing key takes the class default, `null` turns the feature off).
    pub(crate) fn opt_f32_or(&self, key: &str, default: Option<f32>) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(default),
            Some(_) => self.opt_f32(key),
        }
    }

    pub(crate) fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.invalid(key, json_text(v), "expected true or false".into())),
        }
    }

    pub(crate) fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.invalid(key, json_text(v), "expected a string".into())),
        }
    }

    pub(crate) fn missing(&self, field: &str) -> ModelError {
        ModelError::MissingField {
            path: self.path.to_owned(),
            field: field.to_owned(),
        }
    }

    pub(crate) fn invalid(&self, field: &str, value: String, reason: String) -> ModelError {
        ModelError::InvalidField {
            path: self.path.to_owned(),
            field: field.to_owned(),
            value,
            reason,
        }
    }
}

/// Where one set of rope parameters sits in a `config.json`.
struct RopeKeys<'a> {
    /// Their path, for messages (`rope_parameters.full_attention`).
    prefix: &'a str,
    /// They are the whole `rope_parameters` (or `rope_scaling`), not one
    /// layer type's entry.
    flat: bool,
    /// The whole `rope_parameters` (or `rope_scaling`) object, and its
    /// name.
    outer: &'a Map<String, Value>,
    outer_name: &'a str,
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
