//! [`GgufHeader`]: a GGUF file's header (version, key/value metadata and
//! tensor directory) parsed without reading any tensor data, with typed
//! metadata access whose failures name the file and the key.
//!
//! This is the one GGUF parser of the workspace: the gateway reads a
//! model's tokenizer and limits through it without touching the weights,
//! and the model crate reads the tensor data the directory points at
//! (`kvmesh_model::loader::gguf`).
//!
//! Layout of a file (little-endian; version 1 has 32-bit lengths and
//! counts, versions 2 and 3 64-bit): `GGUF`, version u32, tensor count,
//! metadata count; per metadata entry a string key, a u32 value type and
//! the value (arrays: element type u32, length, elements); per tensor a
//! string name, a u32 dimension count, the dimensions (innermost first),
//! a u32 ggml type and a u64 offset into the data section, which starts at
//! the next multiple of `general.alignment` (default 32).
//!
//! No file content may bring the process down or make it allocate more
//! than the file holds: every length and count is checked against the
//! bytes left before anything is allocated, nesting is bounded, and an
//! alignment of 0 is refused.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::error::{Result, TokenizerError};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";

/// Alignment of the tensor data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Longest string and largest array accepted (llama.cpp's limits).
const MAX_LENGTH: u64 = 1 << 30;
/// Deepest nesting of arrays accepted.
const MAX_DEPTH: usize = 64;
/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)] // The variants are the GGUF value types by name.
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

/// One tensor's directory entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Dimensions outermost first (Hugging Face's order: the file lists
    /// them innermost first), so a projection llama.cpp describes as
    /// `[in, out]` reads `[out, in]`, with the data row-major in that order.
    pub dims: Vec<usize>,
    /// The ggml type code (0 = F32, 1 = F16, 2 = Q4_0, 3 = Q4_1, 8 = Q8_0...).
    pub ggml_type: u32,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
}

/// A GGUF file's parsed header.
#[derive(Clone)]
pub struct GgufHeader {
    path: PathBuf,
    version: u32,
    metadata: HashMap<String, GgufValue>,
    tensors: HashMap<String, TensorInfo>,
    tensor_data_offset: u64,
    file_len: u64,
}

impl std::fmt::Debug for GgufHeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufHeader")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Whether the file begins with `GGUF`; a file shorter than that does not.
pub fn starts_with_gguf_magic(path: &Path) -> Result<bool> {
    let mut file = File::open(path).map_err(|e| TokenizerError::io(path, e))?;
    let mut magic = [0u8; 4];
    let mut filled = 0;
    while filled < magic.len() {
        match file.read(&mut magic[filled..]) {
            Ok(0) => return Ok(false),
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(TokenizerError::io(path, e)),
        }
    }
    Ok(&magic == GGUF_MAGIC)
}

impl GgufHeader {
    /// Open `path` and parse its header; reads nothing past the tensor
    /// directory.
    pub fn read(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => TokenizerError::MissingFile {
                path: path.to_owned(),
                what: "GGUF model file",
            },
            _ => TokenizerError::io(path, e),
        })?;
        // The header is thousands of small reads (one per vocabulary entry).
        let mut reader = BufReader::with_capacity(1 << 20, file);
        Self::from_reader(path, &mut reader)
    }

    /// Parse the header from `reader`, positioned at the start of the file
    /// `path` names (used in messages). Leaves the reader after the tensor
    /// directory.
    pub fn from_reader<R: Read + Seek>(path: &Path, reader: &mut R) -> Result<Self> {
        let bad = |detail: String| {
            TokenizerError::malformed(path, format!("cannot read the GGUF header: {detail}"))
        };
        let file_len = reader
            .seek(SeekFrom::End(0))
            .and_then(|len| reader.seek(SeekFrom::Start(0)).map(|_| len))
            .map_err(|e| TokenizerError::io(path, e))?;
        let mut r = Parser {
            inner: reader,
            pos: 0,
            file_len,
            wide: true,
        };
        r.parse(file_len).map_err(bad).map(|mut h| {
            h.path = path.to_owned();
            h
        })
    }

    /// The file this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (1, 2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The file's length in bytes when the header was read.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// Where the tensor data section starts, from the start of the file.
    pub fn tensor_data_offset(&self) -> u64 {
        self.tensor_data_offset
    }

    /// A tensor's directory entry, if the file has that tensor.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// Whether the file has a tensor of this name.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Number of tensors in the directory.
    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// A metadata value, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
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

/// The header parser: counts its position so every length can be checked
/// against what is left of the file before anything is allocated.
struct Parser<'r, R> {
    inner: &'r mut R,
    pos: u64,
    file_len: u64,
    /// Lengths and counts are u64 (versions 2 and 3), not u32 (version 1).
    wide: bool,
}

type ParseResult<T> = std::result::Result<T, String>;

impl<R: Read> Parser<'_, R> {
    fn parse(&mut self, file_len: u64) -> ParseResult<GgufHeader> {
        let magic: [u8; 4] = self.bytes()?;
        if &magic != GGUF_MAGIC {
            return Err(format!(
                "the file starts with {magic:?}, not the GGUF magic"
            ));
        }
        let version = self.u32()?;
        self.wide = match version {
            1 => false,
            2 | 3 => true,
            v => {
                return Err(format!(
                    "unsupported GGUF version {v} (1, 2 and 3 are read)"
                ))
            }
        };
        let tensor_count = self.length()?;
        let metadata_count = self.length()?;
        // Each entry takes at least a length prefix and a type code plus
        // one byte (metadata) or a name prefix, a dimension count, a type
        // and an offset (tensors): a count the file cannot hold is refused
        // before any map is sized by it.
        let prefix = self.prefix_len();
        let needed = metadata_count
            .saturating_mul(prefix + 4 + 1)
            .saturating_add(tensor_count.saturating_mul(prefix + 4 + 4 + 8));
        if needed > self.left() {
            return Err(format!(
                "the header declares {tensor_count} tensors and {metadata_count} metadata \
                 entries, at least {needed} bytes, but {} bytes are left",
                self.left()
            ));
        }
        let mut metadata = HashMap::with_capacity(metadata_count as usize);
        for _ in 0..metadata_count {
            let key = self.string()?;
            let ty = self.u32()?;
            let value = self
                .value(ty, 0)
                .map_err(|e| format!("metadata `{key}`: {e}"))?;
            metadata.insert(key, value);
        }
        let mut tensors = HashMap::with_capacity(tensor_count as usize);
        for _ in 0..tensor_count {
            let name = self.string()?;
            let n_dims = self.u32()?;
            if n_dims > MAX_DIMS {
                return Err(format!(
                    "tensor `{name}` has {n_dims} dimensions, at most {MAX_DIMS} are allowed"
                ));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                let d = self.length()?;
                dims.push(usize::try_from(d).map_err(|_| {
                    format!("tensor `{name}`: dimension {d} does not fit this machine")
                })?);
            }
            dims.reverse();
            let ggml_type = self.u32()?;
            let offset = self.u64()?;
            tensors.insert(
                name,
                TensorInfo {
                    dims,
                    ggml_type,
                    offset,
                },
            );
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match value_u64(v) {
                Some(a) if a > 0 => a,
                _ => {
                    return Err(format!(
                        "general.alignment is {}: expected a positive integer",
                        value_text(v)
                    ))
                }
            },
        };
        let tensor_data_offset = self
            .pos
            .div_ceil(alignment)
            .checked_mul(alignment)
            .ok_or_else(|| format!("general.alignment {alignment} overflows the data offset"))?;
        Ok(GgufHeader {
            path: PathBuf::new(),
            version,
            metadata,
            tensors,
            tensor_data_offset,
            file_len,
        })
    }

    fn left(&self) -> u64 {
        self.file_len.saturating_sub(self.pos)
    }

    fn prefix_len(&self) -> u64 {
        if self.wide {
            8
        } else {
            4
        }
    }

    fn bytes<const N: usize>(&mut self) -> ParseResult<[u8; N]> {
        let mut buf = [0u8; N];
        self.inner.read_exact(&mut buf).map_err(|e| {
            format!(
                "{} bytes at offset {} ({e}; the file has {} bytes)",
                N, self.pos, self.file_len
            )
        })?;
        self.pos += N as u64;
        Ok(buf)
    }

    fn u32(&mut self) -> ParseResult<u32> {
        self.bytes().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> ParseResult<u64> {
        self.bytes().map(u64::from_le_bytes)
    }

    /// A length or count: u32 in version 1, u64 after.
    fn length(&mut self) -> ParseResult<u64> {
        if self.wide {
            self.u64()
        } else {
            self.u32().map(u64::from)
        }
    }

    fn string(&mut self) -> ParseResult<String> {
        let len = self.length()?;
        if len > MAX_LENGTH || len > self.left() {
            return Err(format!(
                "a string of {len} bytes at offset {}, with {} bytes left (at most {MAX_LENGTH})",
                self.pos,
                self.left()
            ));
        }
        let mut buf = vec![0u8; len as usize];
        self.inner
            .read_exact(&mut buf)
            .map_err(|e| format!("a string at offset {}: {e}", self.pos))?;
        self.pos += len;
        // Strings should not be NUL-terminated, but some writers do it;
        // invalid UTF-8 is kept visible rather than refused, as llama.cpp does.
        while buf.last() == Some(&0) {
            buf.pop();
        }
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    /// Fewest bytes a value of type `ty` takes, to bound an array's length.
    fn min_size(&self, ty: u32) -> u64 {
        match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 => self.prefix_len(),
            9 => 4 + self.prefix_len(),
            _ => 8,
        }
    }

    fn value(&mut self, ty: u32, depth: usize) -> ParseResult<GgufValue> {
        if depth > MAX_DEPTH {
            return Err(format!("arrays nested deeper than {MAX_DEPTH}"));
        }
        Ok(match ty {
            0 => GgufValue::U8(u8::from_le_bytes(self.bytes()?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.bytes()?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.bytes()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.bytes()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.bytes()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.bytes()?)),
            7 => match u8::from_le_bytes(self.bytes()?) {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(format!("a boolean of value {b}")),
            },
            8 => GgufValue::String(self.string()?),
            9 => {
                let elem = self.u32()?;
                let len = self.length()?;
                let needed = len.saturating_mul(self.min_size(elem));
                if len > MAX_LENGTH || needed > self.left() {
                    return Err(format!(
                        "an array of {len} values needs at least {needed} bytes, {} are left \
                         (at most {MAX_LENGTH} values)",
                        self.left()
                    ));
                }
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(elem, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.bytes()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.bytes()?)),
            other => return Err(format!("unknown value type {other}")),
        })
    }
}

fn value_u64(v: &GgufValue) -> Option<u64> {
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
fn value_text(v: &GgufValue) -> String {
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

#[cfg(test)]
mod tests;
