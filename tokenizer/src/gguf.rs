//! [`GgufHeader`]: a GGUF file's header (version, key/value metadata and
//! tensor directory) parsed without reading any tensor data, with typed
//! metadata access whose failures name the file and the key (submodule
//! `metadata`).
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
use metadata::{value_text, value_u64};

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

    /// Forget the metadata entries whose key starts with `prefix` (say the
    /// `tokenizer.ggml.` arrays once the tokenizer is built: for a
    /// 262k-token vocabulary, tens of MB that would otherwise stay while
    /// the tensors are read). Reading such a key afterwards finds nothing.
    pub fn forget_metadata(&mut self, prefix: &str) {
        self.metadata.retain(|k, _| !k.starts_with(prefix));
        self.metadata.shrink_to_fit();
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

    /// How the file's matrices (tensors of two or more dimensions) are
    /// stored: their ggml type names, most matrices first (`Q5_0, Q4_K,
    /// Q8_0, Q6_K`).
    pub fn matrix_types(&self) -> String {
        let mut counts: HashMap<u32, usize> = HashMap::new();
        for t in self.tensors.values().filter(|t| t.dims.len() >= 2) {
            *counts.entry(t.ggml_type).or_default() += 1;
        }
        let mut by_count: Vec<(u32, usize)> = counts.into_iter().collect();
        by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let names: Vec<String> = by_count.iter().map(|(c, _)| ggml_type_name(*c)).collect();
        names.join(", ")
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

mod metadata;

#[cfg(test)]
mod tests;

/// A ggml type's name (`Q4_K`), or `ggml type N` for a code this table
/// does not know.
pub fn ggml_type_name(code: u32) -> String {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
    ];
    match NAMES.get(code as usize) {
        Some(n) if !matches!(*n, "Q4_2" | "Q4_3") => (*n).to_owned(),
        _ => format!("ggml type {code}"),
    }
}
