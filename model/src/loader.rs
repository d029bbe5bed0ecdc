//! [`load`]: a model directory or GGUF file to a [`LoadedModel`].
//!
//! A directory is a Hugging Face checkpoint (`config.json`, `*.safetensors`,
//! `tokenizer.json`); a file must be GGUF (checked by its magic bytes,
//! whatever its name). Anything else is refused with an error naming the
//! path. The loaded parts are cross-checked: every id the tokenizer can
//! produce has a row in the embedding.

pub(crate) mod gguf;
#[cfg(test)]
pub(crate) mod test_util;

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::weights::{Precision, Weights};
use gguf::GgufFile;
use kvmesh_tokenizer::gguf::starts_with_gguf_magic;
use kvmesh_tokenizer::TextTokenizer;

/// The on-disk format a model was loaded from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFormat {
    /// A Hugging Face directory with safetensors weights.
    HfSafetensors,
    /// A single GGUF file (blocks kept as stored in the quantized mode,
    /// dequantized to f32 in the exact mode).
    Gguf,
    /// A Hugging Face directory's `config.json` and tokenizer, with weights
    /// drawn at random ([`load_random`]).
    RandomWeights,
}

impl ModelFormat {
    /// A short lowercase name for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::HfSafetensors => "safetensors",
            Self::Gguf => "gguf",
            Self::RandomWeights => "random-weights",
        }
    }
}

/// Everything needed to run a model.
#[derive(Debug)]
pub struct LoadedModel {
    /// Hyperparameters.
    pub config: ModelConfig,
    /// Parameters.
    pub weights: Weights,
    /// How the matrices are held.
    pub precision: Precision,
    /// Tokenizer and chat template.
    pub tokenizer: TextTokenizer,
    /// The directory or file loaded.
    pub path: PathBuf,
    /// Its format.
    pub format: ModelFormat,
}

impl LoadedModel {
    /// Ids that end generation: the model configuration's and the
    /// tokenizer's, without repeats (checkpoints often list only one side).
    /// The same definition as the gateway's `ModelInfo::stop_token_ids`
    /// ([`kvmesh_tokenizer::stop_token_ids`]).
    pub fn stop_token_ids(&self) -> Vec<u32> {
        kvmesh_tokenizer::stop_token_ids(&self.config.eos_token_ids, &self.tokenizer)
    }

    /// What a gateway needs of this model, as `ModelInfo::read` would read
    /// it from the same path, without reading the file again.
    pub fn info(&self) -> kvmesh_tokenizer::ModelInfo {
        // From `config.json` or the GGUF header, as `ModelInfo::read`
        // reads them (random weights: their config's family, f32).
        let (architecture, quantization) = kvmesh_tokenizer::info::describe(&self.path)
            .unwrap_or_else(|_| (self.config.family.to_owned(), "float32".to_owned()));
        kvmesh_tokenizer::ModelInfo {
            path: self.path.clone(),
            tokenizer: self.tokenizer.clone(),
            context_length: self.config.max_position_embeddings,
            config_eos_token_ids: self.config.eos_token_ids.clone(),
            architecture,
            quantization,
        }
    }
}

/// Load a Hugging Face model directory or a GGUF file, f32 throughout
/// (the exact mode).
pub fn load(path: &Path) -> Result<LoadedModel> {
    load_with(path, Precision::Exact)
}

/// A model of the shape `dir/config.json` gives, with `dir`'s tokenizer and
/// weights drawn at random from `seed` ([`Weights::random`], f32: the exact
/// mode). For benchmarks of shapes whose weights are not at hand; its text
/// is noise. The tokenizer's vocabulary must fit the config's.
pub fn load_random(dir: &Path, seed: u64) -> Result<LoadedModel> {
    let config = ModelConfig::from_hf_config(&dir.join("config.json"))?;
    let tokenizer = TextTokenizer::from_hf_dir(dir)?;
    if tokenizer.vocab_size() > config.vocab_size {
        return Err(ModelError::InvalidField {
            path: dir.to_owned(),
            field: "vocab_size".into(),
            value: config.vocab_size.to_string(),
            reason: format!("the tokenizer has {} ids", tokenizer.vocab_size()),
        });
    }
    let started = Instant::now();
    let weights = Weights::random(&config, seed)?;
    tracing::info!(
        path = %dir.display(),
        layers = config.n_layers,
        hidden = config.hidden_size,
        parameters = weights.parameter_count(),
        seed,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "random weights drawn"
    );
    Ok(LoadedModel {
        config,
        weights,
        precision: Precision::Exact,
        tokenizer,
        path: dir.to_owned(),
        format: ModelFormat::RandomWeights,
    })
}

/// Load a model in the given precision. A Hugging Face directory is always
/// f32; a GGUF file's block-format matrices stay blocks in
/// [`Precision::Quantized`] (F32 stays f32; a type kvmesh does not run is refused).
pub fn load_with(path: &Path, precision: Precision) -> Result<LoadedModel> {
    let started = Instant::now();
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => ModelError::MissingFile {
            path: path.to_owned(),
            what: "model (a Hugging Face model directory or a GGUF file)",
        },
        _ => ModelError::io(path, e),
    })?;
    let (config, weights, tokenizer, format) = if meta.is_dir() {
        let config = ModelConfig::from_hf_config(&path.join("config.json"))?;
        let tokenizer = TextTokenizer::from_hf_dir(path)?;
        let weights = Weights::from_hf_dir(path, &config)?;
        (config, weights, tokenizer, ModelFormat::HfSafetensors)
    } else {
        if !starts_with_gguf_magic(path)? {
            return Err(kvmesh_tokenizer::info::not_a_model(path).into());
        }
        let mut file = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&mut file)?;
        let tokenizer = TextTokenizer::from_gguf(file.header())?;
        // The vocabulary arrays are the tokenizer's now; building it left
        // freed heap behind (see `release_freed_heap`). Both go before the
        // tensors arrive, so the peak is the weights plus what stays.
        file.forget_metadata("tokenizer.ggml.");
        release_freed_heap();
        let header_done = started.elapsed();
        let weights = Weights::from_gguf(&mut file, &config, precision)?;
        release_freed_heap();
        tracing::debug!(
            header_ms = header_done.as_millis() as u64,
            tensors_ms = (started.elapsed() - header_done).as_millis() as u64,
            "GGUF read"
        );
        (config, weights, tokenizer, ModelFormat::Gguf)
    };

    if tokenizer.vocab_size() > config.vocab_size {
        return Err(ModelError::InvalidField {
            path: path.to_owned(),
            field: "vocab_size".into(),
            value: config.vocab_size.to_string(),
            reason: format!(
                "the tokenizer has ids up to {}, beyond the embedding's {} rows",
                tokenizer.vocab_size() - 1,
                config.vocab_size
            ),
        });
    }
    tracing::info!(
        path = %path.display(),
        format = format.as_str(),
        architecture = %config.architecture,
        layers = config.n_layers,
        hidden = config.hidden_size,
        vocab = config.vocab_size,
        parameters = weights.parameter_count(),
        tied_embeddings = config.tie_word_embeddings,
        matrix_mib = weights.matrix_bytes() >> 20,
        elapsed_ms = started.elapsed().as_millis() as u64,
        precision = precision.as_str(),
        "model loaded"
    );
    let precision = if format == ModelFormat::HfSafetensors {
        Precision::Exact
    } else {
        precision
    };
    Ok(LoadedModel {
        config,
        weights,
        precision,
        tokenizer,
        path: path.to_owned(),
        format,
    })
}

#[cfg(test)]
mod tests;

/// Hand the heap's freed pages back to the system (glibc's `malloc_trim`).
/// Building a tokenizer makes millions of small allocations, most of them
/// transient (a 262k-token SentencePiece vocabulary: ~40 MB freed among
/// the ~70 MB that stay); glibc keeps such pages mapped, so without this
/// they would count in the process's footprint for its whole life; so does
/// fusing a layer's projections (the parts freed as the fused copy is made).
/// A no-op where the C library is not glibc.
pub(crate) fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of the allocator's own
    // arenas to the kernel; it touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}
