//! [`GgufFile`]: one open GGUF file, its header as parsed by
//! `kvmesh_tokenizer::gguf` (the workspace's one GGUF parser), and the
//! tensor reads its directory points at, with every failure mapped to a
//! [`ModelError`] that names the file.
//!
//! A tensor's byte range is checked against the file's length before
//! anything is allocated or read. Converting blocks to f32 goes through
//! candle's dequantization under [`guarded`], which turns an error or a
//! panic inside it into [`ModelError::Malformed`]: no file content may
//! bring the process down. A block format candle lacks (MXFP4) is
//! converted by the kernels' own dequantization, after the same length
//! checks ([`QMatrix::from_bytes`]), which no byte value can make panic.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use kvmesh_kernels::huge::{self, HugeMem};
use kvmesh_kernels::quant::{QFormat, QMatrix};
use kvmesh_tokenizer::gguf::{GgufHeader, TensorInfo};

use crate::error::{guarded, ModelError, Result};

/// An open GGUF file with its header parsed. Metadata access is the
/// header's ([`GgufHeader`], through `Deref`): its errors convert into
/// [`ModelError`] with `?`.
pub(crate) struct GgufFile {
    header: GgufHeader,
    reader: BufReader<File>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.header.fmt(f)
    }
}

impl std::ops::Deref for GgufFile {
    type Target = GgufHeader;

    fn deref(&self) -> &GgufHeader {
        &self.header
    }
}

/// candle's type for a ggml type code (the codes of `ggml.h`).
/// The ggml type code of f32.
const GGML_F32: u32 = 0;

/// A ggml type's name for messages (`IQ4_NL`).
fn ggml_type_name(code: u32) -> String {
    kvmesh_tokenizer::gguf::ggml_type_name(code)
}

fn ggml_dtype(code: u32) -> Option<GgmlDType> {
    Some(match code {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
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
        let header = GgufHeader::from_reader(path, &mut reader)?;
        Ok(Self { header, reader })
    }

    /// The parsed header.
    pub(crate) fn header(&self) -> &GgufHeader {
        &self.header
    }

    /// Forget the metadata under `prefix` ([`GgufHeader::forget_metadata`]).
    pub(crate) fn forget_metadata(&mut self, prefix: &str) {
        self.header.forget_metadata(prefix);
    }

    fn path_buf(&self) -> PathBuf {
        self.header.path().to_owned()
    }

    /// Tensor `name`'s directory entry, after checking its shape is
    /// `expected`.
    fn info(&self, name: &str, expected: &[usize]) -> Result<&TensorInfo> {
        let Some(info) = self.header.tensor(name) else {
            return Err(ModelError::MissingTensor {
                path: self.path_buf(),
                tensor: name.to_owned(),
            });
        };
        if info.dims != expected {
            return Err(ModelError::ShapeMismatch {
                path: self.path_buf(),
                tensor: name.to_owned(),
                expected: expected.to_vec(),
                got: info.dims.clone(),
            });
        }
        Ok(info)
    }

    /// The `len` bytes of tensor `name` at `offset` in the data section,
    /// after checking they lie inside the file.
    fn read_data(&mut self, name: &str, offset: u64, len: u64) -> Result<Vec<u8>> {
        let start = self.start(name, offset, len)?;
        let mut data = vec![0u8; len as usize];
        self.read_at(name, start, &mut data)?;
        Ok(data)
    }

    /// Where the `len` bytes of tensor `name` at `offset` in the data
    /// section start in the file, if they lie inside it.
    fn start(&self, name: &str, offset: u64, len: u64) -> Result<u64> {
        let start = self.header.tensor_data_offset().checked_add(offset);
        let file_len = self.header.file_len();
        let Some(start) = start else {
            return Err(self.bad(name, "size overflows".into()));
        };
        if start.checked_add(len).is_none_or(|end| end > file_len) {
            return Err(self.bad(
                name,
                format!(
                    "{len} bytes at offset {start} run past the end of the file ({file_len} bytes)"
                ),
            ));
        }
        Ok(start)
    }

    /// `data.len()` bytes of tensor `name` from `start` (checked by
    /// [`Self::start`]).
    fn read_at(&mut self, name: &str, start: u64, data: &mut [u8]) -> Result<()> {
        self.reader
            .seek(SeekFrom::Start(start))
            .and_then(|_| self.reader.read_exact(data))
            .map_err(|e| match e.kind() {
                // The file shrank since its header was read.
                std::io::ErrorKind::UnexpectedEof => {
                    ModelError::malformed(self.header.path(), format!("tensor `{name}`: {e}"))
                }
                _ => ModelError::io(self.header.path(), e),
            })
    }

    fn bad(&self, name: &str, reason: String) -> ModelError {
        ModelError::malformed(self.header.path(), format!("tensor `{name}`: {reason}"))
    }

    /// Read tensor `name`, check its shape is `expected`, and dequantize it
    /// to a contiguous f32 tensor on the CPU.
    ///
    /// Shapes are in Hugging Face's order (see [`TensorInfo::dims`]), with
    /// the data already row-major in that order.
    pub(crate) fn tensor_f32(&mut self, name: &str, expected: &[usize]) -> Result<Tensor> {
        let info = self.info(name, expected)?;
        let (code, offset, dims) = (info.ggml_type, info.offset, info.dims.clone());
        let Some(dtype) = ggml_dtype(code) else {
            // A block format candle does not decode (MXFP4): the kernels'
            // dequantization, the reference their matmuls equal.
            if let Some(format) = QFormat::from_ggml_type(code) {
                return self.dequantized(name, offset, format, &dims);
            }
            return Err(ModelError::UnsupportedDtype {
                path: self.path_buf(),
                tensor: name.to_owned(),
                dtype: ggml_type_name(code),
            });
        };
        let elems = dims
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| self.bad(name, "size overflows".into()))?;
        if elems % dtype.block_size() != 0 {
            return Err(self.bad(
                name,
                format!(
                    "{elems} values is not whole blocks of {} ({dtype:?})",
                    dtype.block_size()
                ),
            ));
        }
        let len = (elems / dtype.block_size()) as u64 * dtype.type_size() as u64;
        let data = self.read_data(name, offset, len)?;
        let what = format!("tensor `{name}` ({dtype:?})");
        let path = self.header.path();
        let qtensor = guarded(path, &what, || {
            qtensor_from_ggml(dtype, &data, dims, &Device::Cpu)
        })?;
        guarded(path, &what, || qtensor.dequantize(&Device::Cpu))
    }

    /// Read matrix `name` as its GGUF blocks, unconverted, when it is stored
    /// in a block format ([`QFormat`]: F16, BF16, Q4_0..Q8_0, Q2_K..Q6_K,
    /// MXFP4);
    /// `None` for F32, for F16 and BF16 rows that are not whole 32-value
    /// panels (read as f32 instead), and for a tensor that is not a matrix
    /// or a stack of them. Any other
    /// type is refused, naming the tensor and its type, rather than widened
    /// to f32. Shape checked as in [`Self::tensor_f32`]; the byte range is
    /// checked against the file's length before reading.
    pub(crate) fn tensor_blocks(
        &mut self,
        name: &str,
        expected: &[usize],
    ) -> Result<Option<QMatrix>> {
        let info = self.info(name, expected)?;
        let code = info.ggml_type;
        let offset = info.offset;
        // A stack of matrices (`[experts, rows, cols]`) is read as one
        // matrix of all their rows.
        let (rows, cols) = match expected {
            [lead @ .., rows, cols] if lead.len() <= 1 => (
                lead.iter()
                    .try_fold(*rows, |acc, &d| acc.checked_mul(d))
                    .ok_or_else(|| self.bad(name, "size overflows".into()))?,
                *cols,
            ),
            _ => return Ok(None),
        };
        let format = match QFormat::from_ggml_type(code) {
            Some(f) => f,
            None if code == GGML_F32 => return Ok(None),
            None => {
                return Err(ModelError::UnsupportedDtype {
                    path: self.path_buf(),
                    tensor: name.to_owned(),
                    dtype: ggml_type_name(code),
                })
            }
        };
        // ggml's F16 and BF16 have no blocks (a value each); the kernels
        // take them in 32-value panels. Rows narrower than whole panels
        // (llama.cpp's F16 fallback for a tensor too narrow to quantize,
        // such as a small model's `attn_k_b`) are widened to f32 instead,
        // exactly; any other format's rows are whole blocks or malformed.
        if matches!(format, QFormat::F16 | QFormat::BF16)
            && !cols.is_multiple_of(format.block_values())
        {
            return Ok(None);
        }
        self.blocks(name, offset, format, rows, cols).map(Some)
    }

    /// The `rows x cols` blocks of tensor `name` (format `format`, at
    /// `offset` in the data section): whole blocks per row, the byte range
    /// checked against the file before it is read.
    fn blocks(
        &mut self,
        name: &str,
        offset: u64,
        format: QFormat,
        rows: usize,
        cols: usize,
    ) -> Result<QMatrix> {
        let block = format.block_values();
        if !cols.is_multiple_of(block) {
            return Err(self.bad(
                name,
                format!("{cols} columns is not whole {block}-value {format} blocks"),
            ));
        }
        let len = (rows as u64)
            .checked_mul((cols / block) as u64)
            .and_then(|b| b.checked_mul(format.block_bytes() as u64))
            .ok_or_else(|| self.bad(name, "size overflows".into()))?;
        // A large matrix goes straight into huge pages, where the model
        // streams it from (`kvmesh_kernels::huge`): no second copy at load.
        let start = self.start(name, offset, len)?;
        let huge = usize::try_from(len)
            .ok()
            .filter(|&n| n > huge::OWN_FROM)
            .and_then(HugeMem::zeroed);
        let m = match huge {
            Some(mut mem) => {
                self.read_at(name, start, mem.as_mut_slice())?;
                QMatrix::from_huge(format, rows, cols, mem.into())
            }
            None => {
                let mut data = vec![0u8; len as usize];
                self.read_at(name, start, &mut data)?;
                QMatrix::from_bytes(format, rows, cols, data)
            }
        };
        m.map_err(|e| self.bad(name, e.to_string()))
    }

    /// Tensor `name` of a block format candle does not decode, as f32 of
    /// shape `dims` (its last dimension the rows' width): each row
    /// dequantized by the kernels ([`QMatrix::dequantize_row`], the values
    /// the quantized matmuls multiply with, to the bit).
    fn dequantized(
        &mut self,
        name: &str,
        offset: u64,
        format: QFormat,
        dims: &[usize],
    ) -> Result<Tensor> {
        let (cols, lead) = match dims.split_last() {
            Some((&cols, lead)) => (cols, lead),
            None => (1, &[][..]),
        };
        let rows = lead
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| self.bad(name, "size overflows".into()))?;
        let q = self.blocks(name, offset, format, rows, cols)?;
        let mut values = vec![0.0f32; rows * cols];
        for (r, row) in values.chunks_exact_mut(cols.max(1)).enumerate() {
            q.dequantize_row(r, row);
        }
        Tensor::from_vec(values, dims.to_vec(), &Device::Cpu)
            .map_err(|e| self.bad(name, e.to_string()))
    }
}
