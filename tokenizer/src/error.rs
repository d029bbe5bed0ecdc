//! [`TokenizerError`], the one error type of this crate.
//!
//! Its variants are the model layer's for the same failures (the model
//! crate maps each to the `ModelError` variant of the same name), so a
//! message names the file, the field and the offending value whichever
//! crate reports it. [`TokenizerError::kind`] is the stable metric label.

use std::path::PathBuf;

/// Everything that can go wrong reading a tokenizer or a model's metadata,
/// tokenizing, or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file or directory could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file the tokenizer or metadata needs is not there.
    #[error("missing {what}: {} does not exist", path.display())]
    MissingFile {
        /// Where it was looked for.
        path: PathBuf,
        /// What it is, e.g. `tokenizer.json`.
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
    /// A required field is absent.
    #[error("{}: missing field `{field}`", path.display())]
    MissingField {
        /// The file.
        path: PathBuf,
        /// The field (a JSON key or a GGUF metadata key).
        field: String,
    },
    /// A field has a value that cannot be used.
    #[error("{}: field `{field}` has value {value}, which is invalid: {reason}", path.display())]
    InvalidField {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
        /// Its value as written.
        value: String,
        /// Why it is rejected.
        reason: String,
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
}

impl TokenizerError {
    /// A short stable name of the variant, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Io { .. } => "io",
            Self::MissingFile { .. } => "missing_file",
            Self::Malformed { .. } => "malformed",
            Self::MissingField { .. } => "missing_field",
            Self::InvalidField { .. } => "invalid_field",
            Self::Tokenizer { .. } => "tokenizer",
            Self::ChatTemplate { .. } => "chat_template",
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

/// Result with [`TokenizerError`] as the default error.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_file_and_field_and_kinds_are_stable() {
        let e = TokenizerError::InvalidField {
            path: "/m/tokenizer_config.json".into(),
            field: "bos_token".into(),
            value: "5".into(),
            reason: "expected a string".into(),
        };
        let msg = e.to_string();
        assert!(
            msg.contains("/m/tokenizer_config.json")
                && msg.contains("bos_token")
                && msg.contains('5'),
            "{msg}"
        );
        assert_eq!(e.kind(), "invalid_field");
        let e = TokenizerError::io("/nope", std::io::Error::from(std::io::ErrorKind::NotFound));
        assert!(e.to_string().starts_with("cannot read /nope: "), "{e}");
        assert_eq!(TokenizerError::malformed("/x", "bad").kind(), "malformed");
    }
}
