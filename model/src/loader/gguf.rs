//! [`GgufFile`]: one open GGUF file, its parsed header, typed metadata
//! access and tensor reads, with every failure mapped to a [`ModelError`]
//! that names the file.
//!
//! candle's reader checks lengths and counts against the file size, but a
//! few crafted headers still reach a panic inside it (an alignment of 0
//! divides by zero). Every call into it therefore runs under
//! [`guarded`], which turns a panic into [`ModelError::Malformed`]: no file
//! content may bring the process down.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use kvmesh_kernels::quant::{QFormat, QMatrix};

use crate::error::{guarded, ModelError, Result};

/// The four bytes every GGUF file starts with.
pub(crate) const GGUF_MAGIC: &[u8; 4] = b"GGUF";

/// An open GGUF file with its header parsed.
pub(crate) struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("metadata_keys", &self.content.metadata.len())
            .field("tensors", &self.content.tensor_infos.len())
            .finish()
    }
}

impl GgufFile {
    /// Open `path` and parse its header (metadata and tensor directory).
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ModelError::MissingFile {
                path: path.to_owned(),
                what: "GGUF model file",
            },
            _ => ModelError::io(path, e),
        })?;
        // The header is thousands of small reads (one per vocabulary entry).
        let mut reader = BufReader::with_capacity(1 << 20, file);
        let content = guarded(path, "GGUF header", || Content::read(&mut reader))?;
        Ok(Self {
            path: path.to_owned(),
            content,
            reader,
        })
    }

    /// The file this was read from.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata value, if present.
    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    /// A non-negative integer of any GGUF integer type.
    pub(crate) fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        value_u64(v)
            .map(Some)
            .ok_or_else(|| self.invalid(key, v, "expected a non-negative integer"))
    }

    /// A required non-negative integer that fits `usize`.
    pub(crate) fn req_usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.missing(key))
    }

    /// An optional non-negative integer that fits `usize`.
    pub(crate) fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.opt_u64(key)? {
            None => Ok(None),
            Some(n) => usize::try_from(n)
                .map(Some)
                .map_err(|_| self.invalid_text(key, n.to_string(), "too large")),
        }
    }

    /// An optional token id (fits `u32`).
    pub(crate) fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        match self.opt_u64(key)? {
            None => Ok(None),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| self.invalid_text(key, n.to_string(), "too large")),
        }
    }

    /// An optional float (f32 or f64 in the file).
    pub(crate) fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(*x)),
            Some(Value::F64(x)) => Ok(Some(*x as f32)),
            Some(v) => Err(self.invalid(key, v, "expected a number")),
        }
    }

    /// An optional boolean.
    pub(crate) fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.invalid(key, v, "expected a boolean")),
        }
    }

    /// An optional string.
    pub(crate) fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.invalid(key, v, "expected a string")),
        }
    }

    /// An optional array of strings.
    pub(crate) fn opt_str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let Value::Array(items) = v else {
            return Err(self.invalid(key, v, "expected an array of strings"));
        };
        items
            .iter()
            .map(|item| match item {
                Value::String(s) => Ok(s.as_str()),
                other => Err(self.invalid(key, other, "expected an array of strings")),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// An optional array of integers (any GGUF integer type).
    pub(crate) fn opt_int_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let Value::Array(items) = v else {
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

    /// Length of an array value, if `key` holds one.
    pub(crate) fn array_len(&self, key: &str) -> Option<usize> {
        match self.get(key) {
            Some(Value::Array(items)) => Some(items.len()),
            _ => None,
        }
    }

    /// Whether the file has a tensor of this name.
    pub(crate) fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Tensor `name`'s directory entry, after checking its shape is
    /// `expected`.
    fn info(
        &self,
        name: &str,
        expected: &[usize],
    ) -> Result<&candle_core::quantized::gguf_file::TensorInfo> {
        let Some(info) = self.content.tensor_infos.get(name) else {
            return Err(ModelError::MissingTensor {
                path: self.path.clone(),
                tensor: name.to_owned(),
            });
        };
        let got = info.shape.dims();
        if got != expected {
            return Err(ModelError::ShapeMismatch {
                path: self.path.clone(),
                tensor: name.to_owned(),
                expected: expected.to_vec(),
                got: got.to_vec(),
            });
        }
        Ok(info)
    }

    /// Read tensor `name`, check its shape is `expected`, and dequantize it
    /// to a contiguous f32 tensor on the CPU.
    ///
    /// Shapes are in candle's order, which is Hugging Face's: GGUF lists
    /// dimensions innermost first and candle reverses them, so a projection
    /// llama.cpp describes as `[in, out]` reads as `[out, in]` here, with
    /// the data already row-major in that order.
    pub(crate) fn tensor_f32(&mut self, name: &str, expected: &[usize]) -> Result<Tensor> {
        let dtype = self.info(name, expected)?.ggml_dtype;
        let what = format!("tensor `{name}` ({dtype:?})");
        let (content, reader) = (&self.content, &mut self.reader);
        let qtensor = guarded(&self.path, &what, || {
            content.tensor(reader, name, &Device::Cpu)
        })?;
        guarded(&self.path, &what, || qtensor.dequantize(&Device::Cpu))
    }

    /// Read tensor `name` as its GGUF blocks, unconverted, when it is stored
    /// in a format the quantized kernels run (Q4_1, Q8_0); `None` for any
    /// other format. Shape checked as in [`Self::tensor_f32`]; the byte range
    /// is checked against the file's length before reading.
    pub(crate) fn tensor_blocks(
        &mut self,
        name: &str,
        expected: &[usize],
    ) -> Result<Option<QMatrix>> {
        use std::io::{Read, Seek, SeekFrom};
        let info = self.info(name, expected)?;
        let format = match info.ggml_dtype {
            GgmlDType::Q4_1 => QFormat::Q4_1,
            GgmlDType::Q8_0 => QFormat::Q8_0,
            _ => return Ok(None),
        };
        let offset = info.offset;
        let &[rows, cols] = expected else {
            return Ok(None);
        };
        let bad = |reason: String| {
            ModelError::malformed(&self.path, format!("tensor `{name}`: {reason}"))
        };
        if cols % kvmesh_kernels::quant::BLOCK != 0 {
            return Err(bad(format!("{cols} columns is not whole blocks")));
        }
        let len = (rows as u64)
            .checked_mul((cols / kvmesh_kernels::quant::BLOCK) as u64)
            .and_then(|b| b.checked_mul(format.block_bytes() as u64));
        let start = self.content.tensor_data_offset.checked_add(offset);
        let file_len = self
            .reader
            .get_ref()
            .metadata()
            .map_err(|e| ModelError::io(&self.path, e))?
            .len();
        let (Some(len), Some(start)) = (len, start) else {
            return Err(bad("size overflows".into()));
        };
        if start.checked_add(len).is_none_or(|end| end > file_len) {
            return Err(bad(format!(
                "{len} bytes at offset {start} run past the end of the file ({file_len} bytes)"
            )));
        }
        let mut data = vec![0u8; len as usize];
        self.reader
            .seek(SeekFrom::Start(start))
            .and_then(|_| self.reader.read_exact(&mut data))
            .map_err(|e| ModelError::io(&self.path, e))?;
        QMatrix::from_bytes(format, rows, cols, data)
            .map(Some)
            .map_err(|e| bad(e.to_string()))
    }

    fn missing(&self, key: &str) -> ModelError {
        ModelError::MissingField {
            path: self.path.clone(),
            field: key.to_owned(),
        }
    }

    fn invalid(&self, key: &str, v: &Value, reason: &str) -> ModelError {
        self.invalid_text(key, value_text(v), reason)
    }

    fn invalid_text(&self, key: &str, value: String, reason: &str) -> ModelError {
        ModelError::InvalidField {
            path: self.path.clone(),
            field: key.to_owned(),
            value,
            reason: reason.to_owned(),
        }
    }

    pub(crate) fn missing_field(&self, key: &str) -> ModelError {
        self.missing(key)
    }

    pub(crate) fn invalid_field(
        &self,
        key: &str,
        value: impl Into<String>,
        reason: impl Into<String>,
    ) -> ModelError {
        ModelError::InvalidField {
            path: self.path.clone(),
            field: key.to_owned(),
            value: value.into(),
            reason: reason.into(),
        }
    }
}

fn value_u64(v: &Value) -> Option<u64> {
    match *v {
        Value::U64(n) => Some(n),
        _ => value_i64(v).and_then(|n| u64::try_from(n).ok()),
    }
}

fn value_i64(v: &Value) -> Option<i64> {
    match *v {
        Value::U8(n) => Some(n.into()),
        Value::I8(n) => Some(n.into()),
        Value::U16(n) => Some(n.into()),
        Value::I16(n) => Some(n.into()),
        Value::U32(n) => Some(n.into()),
        Value::I32(n) => Some(n.into()),
        Value::U64(n) => i64::try_from(n).ok(),
        Value::I64(n) => Some(n),
        _ => None,
    }
}

/// A metadata value as text for an error message (arrays summarised).
fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) if s.len() > 80 => {
            format!("{:?}...", s.chars().take(77).collect::<String>())
        }
        Value::String(s) => format!("{s:?}"),
        Value::Array(items) => format!("an array of {} values", items.len()),
        Value::Bool(b) => b.to_string(),
        Value::F32(x) => x.to_string(),
        Value::F64(x) => x.to_string(),
        other => value_i64(other).map_or_else(|| format!("{other:?}"), |n| n.to_string()),
    }
}
