//! [`ModelInfo`]: what a gateway needs of a model (tokenizer, chat
//! template, context length, the ids that end generation), read without
//! touching a weight.
//!
//! A GGUF file: its header and metadata only ([`GgufHeader`]; the tensor
//! data is never read). A Hugging Face directory: `config.json`,
//! `tokenizer.json`, `tokenizer_config.json` (and a chat template file
//! beside them), never a `*.safetensors`.
//!
//! The rules that turn a configuration into limits and stop ids are
//! defined here once and the model crate's loader uses the same functions
//! ([`hf_eos_token_ids`], [`gguf_eos_token_ids`], [`hf_context_length`],
//! [`gguf_context_length`], [`stop_token_ids`]), so the ids a gateway
//! ends generation at are those the nodes use (`LoadedModel::stop_token_ids`).
//!
//! This reads, it does not validate the model: a checkpoint of an
//! architecture the runtime refuses still yields its tokenizer here, and
//! the nodes refuse it when they load it.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Result, TokenizerError};
use crate::gguf::{starts_with_gguf_magic, GgufHeader};
use crate::text::{invalid, TextTokenizer};

/// Context length of a `config.json` without `max_position_embeddings`
/// (transformers' `LlamaConfig` default).
pub const HF_DEFAULT_CONTEXT_LENGTH: usize = 2048;

/// The GGUF metadata keys whose token ids end generation, in order.
const GGUF_EOS_KEYS: [&str; 3] = [
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
];

/// A model's gateway-side metadata.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// The directory or file read.
    pub path: PathBuf,
    /// Tokenizer, special tokens and chat template.
    pub tokenizer: TextTokenizer,
    /// Context length the model was trained for (`max_position_embeddings`,
    /// `<arch>.context_length`).
    pub context_length: usize,
    /// The ids the model configuration says end generation (`eos_token_id`
    /// of `config.json`; the GGUF EOS, EOT and EOM ids), without the
    /// tokenizer's; see [`ModelInfo::stop_token_ids`].
    pub config_eos_token_ids: Vec<u32>,
    /// The architecture its metadata names (`config.json`'s `model_type`,
    /// GGUF `general.architecture`): `/v1/models` and the logs show it.
    pub architecture: String,
    /// How its weights are stored: a GGUF file's matrix types, most used
    /// first (`Q5_0, Q4_K, Q8_0, Q6_K`), or a directory's `torch_dtype`
    /// (`safetensors bfloat16`).
    pub quantization: String,
}

impl ModelInfo {
    /// Read a Hugging Face model directory or a GGUF file (recognised by
    /// its magic bytes, whatever its name).
    pub fn read(path: &Path) -> Result<Self> {
        let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => TokenizerError::MissingFile {
                path: path.to_owned(),
                what: "model (a Hugging Face model directory or a GGUF file)",
            },
            _ => TokenizerError::io(path, e),
        })?;
        if meta.is_dir() {
            let config_path = path.join("config.json");
            let config = read_json_object(&config_path, "config.json")?;
            Ok(Self {
                path: path.to_owned(),
                tokenizer: TextTokenizer::from_hf_dir(path)?,
                context_length: positive(
                    &config_path,
                    "max_position_embeddings",
                    hf_context_length(&config_path, &config)?,
                )?,
                config_eos_token_ids: hf_eos_token_ids(&config_path, &config)?,
                architecture: hf_architecture(&config),
                quantization: hf_quantization(&config),
            })
        } else {
            if !starts_with_gguf_magic(path)? {
                return Err(not_a_model(path));
            }
            let header = GgufHeader::read(path)?;
            let arch = header
                .opt_str("general.architecture")?
                .ok_or_else(|| header.missing_field("general.architecture"))?;
            let key = format!("{arch}.context_length");
            Ok(Self {
                path: path.to_owned(),
                tokenizer: TextTokenizer::from_gguf(&header)?,
                context_length: positive(path, &key, gguf_context_length(&header, arch)?)?,
                config_eos_token_ids: gguf_eos_token_ids(&header)?,
                architecture: arch.to_owned(),
                quantization: header.matrix_types(),
            })
        }
    }

    /// Ids that end generation: the configuration's, then the tokenizer's
    /// (see [`stop_token_ids`]).
    pub fn stop_token_ids(&self) -> Vec<u32> {
        stop_token_ids(&self.config_eos_token_ids, &self.tokenizer)
    }

    /// `(architecture, quantization)`: what `/v1/models` and the router's
    /// log show of the model.
    pub fn description(&self) -> (String, String) {
        (self.architecture.clone(), self.quantization.clone())
    }

    /// The Jinja chat template, if the model ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.tokenizer.chat_template()
    }
}

/// `config.json`'s `model_type` ([`ModelInfo::architecture`]).
pub fn hf_architecture(config: &Map<String, Value>) -> String {
    config
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("unknown")
        .to_owned()
}

/// `safetensors` and `config.json`'s `torch_dtype` (or transformers 5's
/// `dtype`) ([`ModelInfo::quantization`]).
pub fn hf_quantization(config: &Map<String, Value>) -> String {
    let dtype = config
        .get("torch_dtype")
        .or_else(|| config.get("dtype"))
        .and_then(Value::as_str)
        .unwrap_or("float32");
    format!("safetensors {dtype}")
}

/// [`ModelInfo::architecture`] and [`ModelInfo::quantization`] of a model
/// directory or GGUF file, read from `config.json` or the GGUF header only.
pub fn describe(path: &Path) -> Result<(String, String)> {
    if path.is_dir() {
        let config = read_json_object(&path.join("config.json"), "config.json")?;
        return Ok((hf_architecture(&config), hf_quantization(&config)));
    }
    let header = GgufHeader::read(path)?;
    let arch = header
        .opt_str("general.architecture")?
        .ok_or_else(|| header.missing_field("general.architecture"))?
        .to_owned();
    Ok((arch, header.matrix_types()))
}

/// The error for a file that is neither a directory nor a GGUF file.
pub fn not_a_model(path: &Path) -> TokenizerError {
    TokenizerError::malformed(
        path,
        "not a model: expected a Hugging Face model directory or a GGUF file, and this file \
         does not start with the GGUF magic bytes",
    )
}

/// Ids that end generation: the model configuration's, then the
/// tokenizer's, without repeats (checkpoints often list only one side).
/// The one definition, for the nodes and the gateway alike.
pub fn stop_token_ids(config_eos_token_ids: &[u32], tokenizer: &TextTokenizer) -> Vec<u32> {
    let mut ids = config_eos_token_ids.to_vec();
    for id in tokenizer.eos_token_ids() {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// `eos_token_id` of a `config.json` object (`path` for messages): a token
/// id, a list of them, or absent; adjacent repeats dropped.
pub fn hf_eos_token_ids(path: &Path, config: &Map<String, Value>) -> Result<Vec<u32>> {
    let token_id = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| {
                invalid(
                    path,
                    "eos_token_id",
                    v,
                    "expected a token id (a non-negative integer)",
                )
            })
    };
    let mut ids = Vec::new();
    match config.get("eos_token_id") {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) => {
            for v in list {
                ids.push(token_id(v)?);
            }
        }
        Some(v) => ids.push(token_id(v)?),
    }
    ids.dedup();
    Ok(ids)
}

/// `max_position_embeddings` of a `config.json` object, or
/// [`HF_DEFAULT_CONTEXT_LENGTH`] when absent.
pub fn hf_context_length(path: &Path, config: &Map<String, Value>) -> Result<usize> {
    match config.get("max_position_embeddings") {
        None | Some(Value::Null) => Ok(HF_DEFAULT_CONTEXT_LENGTH),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| {
                invalid(
                    path,
                    "max_position_embeddings",
                    v,
                    "expected a non-negative integer",
                )
            }),
    }
}

/// The EOS, EOT and EOM ids of a GGUF file's metadata, in that order,
/// without repeats.
pub fn gguf_eos_token_ids(g: &GgufHeader) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for key in GGUF_EOS_KEYS {
        if let Some(id) = g.opt_u32(key)? {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    Ok(ids)
}

/// `<arch>.context_length` of a GGUF file's metadata (required).
pub fn gguf_context_length(g: &GgufHeader, arch: &str) -> Result<usize> {
    g.req_usize(&format!("{arch}.context_length"))
}

fn positive(path: &Path, field: &str, n: usize) -> Result<usize> {
    if n == 0 {
        return Err(TokenizerError::InvalidField {
            path: path.to_owned(),
            field: field.to_owned(),
            value: "0".into(),
            reason: "must be positive".into(),
        });
    }
    Ok(n)
}

fn read_json_object(path: &Path, what: &'static str) -> Result<Map<String, Value>> {
    let text = std::fs::read_to_string(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => TokenizerError::MissingFile {
            path: path.to_owned(),
            what,
        },
        _ => TokenizerError::io(path, e),
    })?;
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(_) => Err(TokenizerError::malformed(
            path,
            "the top level is not a JSON object",
        )),
        Err(e) => Err(TokenizerError::malformed(
            path,
            format!("not valid JSON: {e}"),
        )),
    }
}

#[cfg(test)]
mod tests;
