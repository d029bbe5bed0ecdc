//! [`ModelError`], the one error type of the model layer.
//!
//! Every variant that comes from a file names the file, and where it applies
//! the field or tensor and the offending value, so a user can act on the
//! message alone. [`ModelError::kind`] is the stable label for metrics.

use std::path::{Path, PathBuf};

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file or directory could not be read (or written).
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file the model needs is not there.
    #[error("missing {what}: {} does not exist", path.display())]
    MissingFile {
        /// Where it was looked for.
        path: PathBuf,
        /// What it is, e.g. `config.json`.
        what: &'static str,
    },
    /// A file is not what it claims to be: bad JSON, a bad GGUF header, a
    /// truncated file.
    #[error("{} is malformed: {detail}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// A required configuration field is absent.
    #[error("{}: missing field `{field}`", path.display())]
    MissingField {
        /// The configuration file.
        path: PathBuf,
        /// The field (a JSON key or a GGUF metadata key).
        field: String,
    },
    /// A configuration field has a value this runtime cannot use.
    #[error("{}: field `{field}` has value {value}, which is invalid: {reason}", path.display())]
    InvalidField {
        /// The configuration file.
        path: PathBuf,
        /// The field.
        field: String,
        /// Its value as written.
        value: String,
        /// Why it is rejected.
        reason: String,
    },
    /// The model is of no family [`crate::arch`] implements (or has a
    /// feature none of them does).
    #[error(
        "{}: unsupported architecture {architecture:?} (supported: {})",
        path.display(),
        crate::arch::Family::supported()
    )]
    UnsupportedArchitecture {
        /// The model file or configuration.
        path: PathBuf,
        /// The architecture (or feature of it) as named by the file.
        architecture: String,
    },
    /// A tensor is stored in a type this runtime cannot run.
    #[error("{}: tensor `{tensor}` has type {dtype}, which kvmesh cannot run (supported: safetensors f32, f16, bf16; GGUF F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4)", path.display())]
    UnsupportedDtype {
        /// The weight file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its dtype as named by the file.
        dtype: String,
    },
    /// A tensor the architecture needs is absent.
    #[error("{}: tensor `{tensor}` is missing", path.display())]
    MissingTensor {
        /// The weight file or directory.
        path: PathBuf,
        /// The tensor.
        tensor: String,
    },
    /// A tensor's shape disagrees with the configuration.
    #[error("{}: tensor `{tensor}` has shape {got:?}, the configuration implies {expected:?}", path.display())]
    ShapeMismatch {
        /// The weight file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Shape implied by the configuration (Hugging Face `[out, in]` order).
        expected: Vec<usize>,
        /// Shape found in the file (same order).
        got: Vec<usize>,
    },
    /// Tokenizing or detokenizing failed.
    #[error("tokenizer: {detail}")]
    Tokenizer {
        /// What failed.
        detail: String,
    },
    /// The chat template is absent, does not compile, or raised an error.
    #[error("chat template: {detail}")]
    ChatTemplate {
        /// What failed.
        detail: String,
    },
    /// The prompt and the requested new tokens do not fit the context.
    #[error(
        "the prompt has {prompt_tokens} tokens and {max_new_tokens} new tokens were requested, \
         {} in all, over the context limit of {limit} tokens",
        prompt_tokens.saturating_add(*max_new_tokens)
    )]
    ContextLengthExceeded {
        /// Tokens in the prompt.
        prompt_tokens: usize,
        /// Tokens requested beyond it.
        max_new_tokens: usize,
        /// The model's (or the pool's) limit.
        limit: usize,
    },
    /// The prompt encodes to no tokens.
    #[error("the prompt is empty: it encodes to no tokens")]
    EmptyPrompt,
    /// The KV pool refused an operation.
    #[error("KV pool: {0}")]
    Kv(#[from] kvmesh_kvpool::PoolError),
    /// A KV read failed its ownership or initialisation check.
    #[error("KV guard: {0}")]
    Guard(#[from] kvmesh_kernels::GuardViolation),
    /// The CUDA device refused or failed (absent, a library missing, a
    /// kernel or copy failed).
    #[error("device: {0}")]
    Device(#[from] kvmesh_cuda::CudaError),
    /// A candle operation failed during a forward pass.
    #[error("compute: {detail}")]
    Compute {
        /// The candle error.
        detail: String,
    },
    /// The default model could not be fetched.
    #[error("cannot fetch the default model: {detail}\n{hint}")]
    Fetch {
        /// What failed.
        detail: String,
        /// How to get the model by hand.
        hint: String,
    },
}

impl ModelError {
    /// A short stable name of the variant, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Io { .. } => "io",
            Self::MissingFile { .. } => "missing_file",
            Self::Malformed { .. } => "malformed",
            Self::MissingField { .. } => "missing_field",
            Self::InvalidField { .. } => "invalid_field",
            Self::UnsupportedArchitecture { .. } => "unsupported_architecture",
            Self::UnsupportedDtype { .. } => "unsupported_dtype",
            Self::MissingTensor { .. } => "missing_tensor",
            Self::ShapeMismatch { .. } => "shape_mismatch",
            Self::Tokenizer { .. } => "tokenizer",
            Self::ChatTemplate { .. } => "chat_template",
            Self::ContextLengthExceeded { .. } => "context_length_exceeded",
            Self::EmptyPrompt => "empty_prompt",
            Self::Kv(_) => "kv",
            Self::Guard(_) => "guard",
            Self::Device(_) => "device",
            Self::Compute { .. } => "compute",
            Self::Fetch { .. } => "fetch",
        }
    }

    /// An [`Io`](Self::Io) error for `path`.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// A [`Malformed`](Self::Malformed) error for `path`.
    pub(crate) fn malformed(path: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        Self::Malformed {
            path: path.into(),
            detail: detail.into(),
        }
    }
}

/// Run a call into candle's file readers, mapping its error, and any panic
/// a crafted file provokes inside it, to [`ModelError::Malformed`] naming
/// `path` and `what` was being read.
///
/// The panic is caught so that no file content can bring the process down;
/// the default hook still prints it to stderr, which is acceptable for a
/// load-time failure.
pub(crate) fn guarded<T>(
    path: &Path,
    what: &str,
    f: impl FnOnce() -> candle_core::Result<T>,
) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(ModelError::malformed(
            path,
            format!("cannot read the {what}: {e}"),
        )),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_owned());
            Err(ModelError::malformed(
                path,
                format!("cannot read the {what}: the reader failed ({msg})"),
            ))
        }
    }
}

impl From<kvmesh_tokenizer::TokenizerError> for ModelError {
    /// Variant to the variant of the same name: a tokenizer or metadata
    /// failure reads, and is matched, the same whichever crate found it.
    fn from(e: kvmesh_tokenizer::TokenizerError) -> Self {
        use kvmesh_tokenizer::TokenizerError as T;
        match e {
            T::Io { path, source } => Self::Io { path, source },
            T::MissingFile { path, what } => Self::MissingFile { path, what },
            T::Malformed { path, detail } => Self::Malformed { path, detail },
            T::MissingField { path, field } => Self::MissingField { path, field },
            T::InvalidField {
                path,
                field,
                value,
                reason,
            } => Self::InvalidField {
                path,
                field,
                value,
                reason,
            },
            T::Tokenizer { detail } => Self::Tokenizer { detail },
            T::ChatTemplate { detail } => Self::ChatTemplate { detail },
        }
    }
}

/// Result with [`ModelError`] as the default error.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_file_field_and_numbers() {
        let e = ModelError::InvalidField {
            path: "/m/config.json".into(),
            field: "rope_scaling.rope_type".into(),
            value: "\"longrope\"".into(),
            reason: "longrope RoPE scaling is not implemented".into(),
        };
        let msg = e.to_string();
        assert!(
            msg.contains("/m/config.json")
                && msg.contains("rope_scaling.rope_type")
                && msg.contains("longrope"),
            "{msg}"
        );
        assert_eq!(e.kind(), "invalid_field");

        let e = ModelError::ContextLengthExceeded {
            prompt_tokens: 100,
            max_new_tokens: 30,
            limit: 120,
        };
        let msg = e.to_string();
        for n in ["100", "30", "130", "120"] {
            assert!(msg.contains(n), "{msg} lacks {n}");
        }
        assert_eq!(e.kind(), "context_length_exceeded");

        let e = ModelError::io("/nope", std::io::Error::from(std::io::ErrorKind::NotFound));
        assert!(e.to_string().starts_with("cannot read /nope: "), "{e}");
        assert_eq!(ModelError::EmptyPrompt.kind(), "empty_prompt");
    }
}
