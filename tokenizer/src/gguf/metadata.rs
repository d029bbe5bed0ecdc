//! Typed access to a [`GgufHeader`]'s metadata: each accessor names the
//! file and the key when the value is absent or of the wrong type.

use super::{GgufHeader, GgufValue};
use crate::error::{Result, TokenizerError};

impl GgufHeader {
    /// A metadata value, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// Every metadata key, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.metadata.keys().map(String::as_str)
    }

    /// A non-negative integer of any GGUF integer type.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        value_u64(v)
            .map(Some)
            .ok_or_else(|| self.invalid(key, v, "expected a non-negative integer"))
    }

    /// A required non-negative integer that fits `usize`.
    pub fn req_usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.missing_field(key))
    }

    /// An optional non-negative integer that fits `usize`.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.opt_u64(key)? {
            None => Ok(None),
            Some(n) => usize::try_from(n)
                .map(Some)
                .map_err(|_| self.invalid_field(key, n.to_string(), "too large")),
        }
    }

    /// An optional token id (fits `u32`).
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        match self.opt_u64(key)? {
            None => Ok(None),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| self.invalid_field(key, n.to_string(), "too large")),
        }
    }

    /// An optional float (f32 or f64 in the file).
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::F32(x)) => Ok(Some(*x)),
            Some(GgufValue::F64(x)) => Ok(Some(*x as f32)),
            Some(v) => Err(self.invalid(key, v, "expected a number")),
        }
    }

    /// An optional boolean.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.invalid(key, v, "expected a boolean")),
        }
    }

    /// An optional string.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.invalid(key, v, "expected a string")),
        }
    }

    /// An optional array of strings.
    pub fn opt_str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let GgufValue::Array(items) = v else {
            return Err(self.invalid(key, v, "expected an array of strings"));
        };
        items
            .iter()
            .map(|item| match item {
                GgufValue::String(s) => Ok(s.as_str()),
                other => Err(self.invalid(key, other, "expected an array of strings")),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// An optional array of integers (any GGUF integer type).
    pub fn opt_int_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let GgufValue::Array(items) = v else {
            return Err(self.invalid(key, v, "expected an array of integers"));
        };
        items
            .iter()
            .map(|item| {
                value_i64(item)
                    .ok_or_else(|| self.invalid(key, item, "expected an array of integers"))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// An optional array of numbers as f32: floats, or integers (llama.cpp
    /// accepts `tokenizer.ggml.scores` as either). A NaN is refused: it
    /// has no place in an order.
    pub fn opt_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let GgufValue::Array(items) = v else {
            return Err(self.invalid(key, v, "expected an array of numbers"));
        };
        items
            .iter()
            .map(|item| {
                let x = match *item {
                    GgufValue::F32(x) => Some(x),
                    GgufValue::F64(x) => Some(x as f32),
                    _ => value_i64(item).map(|n| n as f32),
                };
                x.filter(|x| !x.is_nan()).ok_or_else(|| {
                    self.invalid(key, item, "expected an array of numbers (not NaN)")
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// Length of an array value, if `key` holds one.
    pub fn array_len(&self, key: &str) -> Option<usize> {
        match self.get(key) {
            Some(GgufValue::Array(items)) => Some(items.len()),
            _ => None,
        }
    }

    /// A [`TokenizerError::MissingField`] for `key` in this file.
    pub fn missing_field(&self, key: &str) -> TokenizerError {
        TokenizerError::MissingField {
            path: self.path.clone(),
            field: key.to_owned(),
        }
    }

    /// A [`TokenizerError::InvalidField`] for `key` in this file.
    pub fn invalid_field(
        &self,
        key: &str,
        value: impl Into<String>,
        reason: impl Into<String>,
    ) -> TokenizerError {
        TokenizerError::InvalidField {
            path: self.path.clone(),
            field: key.to_owned(),
            value: value.into(),
            reason: reason.into(),
        }
    }

    fn invalid(&self, key: &str, v: &GgufValue, reason: &str) -> TokenizerError {
        self.invalid_field(key, value_text(v), reason)
    }
}

pub(super) fn value_u64(v: &GgufValue) -> Option<u64> {
    match *v {
        GgufValue::U64(n) => Some(n),
        _ => value_i64(v).and_then(|n| u64::try_from(n).ok()),
    }
}

fn value_i64(v: &GgufValue) -> Option<i64> {
    match *v {
        GgufValue::U8(n) => Some(n.into()),
        GgufValue::I8(n) => Some(n.into()),
        GgufValue::U16(n) => Some(n.into()),
        GgufValue::I16(n) => Some(n.into()),
        GgufValue::U32(n) => Some(n.into()),
        GgufValue::I32(n) => Some(n.into()),
        GgufValue::U64(n) => i64::try_from(n).ok(),
        GgufValue::I64(n) => Some(n),
        _ => None,
    }
}

/// A metadata value as text for an error message (arrays summarised).
pub(super) fn value_text(v: &GgufValue) -> String {
    match v {
        GgufValue::String(s) if s.len() > 80 => {
            format!("{:?}...", s.chars().take(77).collect::<String>())
        }
        GgufValue::String(s) => format!("{s:?}"),
        GgufValue::Array(items) => format!("an array of {} values", items.len()),
        GgufValue::Bool(b) => b.to_string(),
        GgufValue::F32(x) => x.to_string(),
        GgufValue::F64(x) => x.to_string(),
        other => value_i64(other).map_or_else(|| format!("{other:?}"), |n| n.to_string()),
    }
}
