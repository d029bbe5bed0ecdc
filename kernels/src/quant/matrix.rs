//! [`QMatrix`]: a matrix of GGUF blocks as the kernels take it, its
//! checked constructors, and where its blocks live (as loaded, or in huge
//! pages for streaming: [`crate::huge`]).

use super::{QFormat, QuantError, MAX_COLS};

/// A `[rows, cols]` weight matrix of GGUF blocks, row-major: row `r` is
/// `cols / format.block_values()` consecutive blocks.
#[derive(Clone)]
pub struct QMatrix {
    pub(super) format: QFormat,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) data: Blocks,
}

/// Where a [`QMatrix`]'s blocks live: as loaded, or copied into huge
/// pages for streaming ([`QMatrix::in_huge_pages`]).
#[derive(Clone)]
pub(super) enum Blocks {
    Heap(Vec<u8>),
    Huge(crate::huge::HugeBytes),
}

impl std::ops::Deref for Blocks {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Heap(v) => v,
            Self::Huge(h) => h,
        }
    }
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QMatrix")
            .field("format", &self.format)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

/// So [`super::matmul_each`] takes matrices, references and `Arc`s alike.
impl AsRef<QMatrix> for QMatrix {
    fn as_ref(&self) -> &QMatrix {
        self
    }
}

impl QMatrix {
    /// Wrap GGUF bytes of a `[rows, cols]` matrix (checked lengths).
    pub fn from_bytes(
        format: QFormat,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
    ) -> Result<Self, QuantError> {
        Self::checked(format, rows, cols, Blocks::Heap(data))
    }

    /// Wrap GGUF bytes already in huge pages (a large tensor read straight
    /// into them: [`crate::huge::OWN_FROM`]); checked as [`Self::from_bytes`].
    pub fn from_huge(
        format: QFormat,
        rows: usize,
        cols: usize,
        data: crate::huge::HugeBytes,
    ) -> Result<Self, QuantError> {
        Self::checked(format, rows, cols, Blocks::Huge(data))
    }

    fn checked(
        format: QFormat,
        rows: usize,
        cols: usize,
        data: Blocks,
    ) -> Result<Self, QuantError> {
        let block = format.block_values();
        if !cols.is_multiple_of(block) || cols > MAX_COLS {
            return Err(QuantError::Columns {
                format: format.name(),
                block,
                cols,
            });
        }
        let expected = rows
            .checked_mul(cols / block)
            .and_then(|b| b.checked_mul(format.block_bytes()));
        if expected != Some(data.len()) {
            return Err(QuantError::Length {
                format: format.name(),
                rows,
                cols,
                expected: expected.unwrap_or(usize::MAX),
                got: data.len(),
            });
        }
        Ok(Self {
            format,
            rows,
            cols,
            data,
        })
    }

    /// The same matrix with its blocks in 2 MiB huge pages
    /// ([`crate::huge`]): what a model streams every step. Blocks already
    /// there are shared, others copied; where the OS refuses the memory,
    /// the same matrix as it is.
    pub fn in_huge_pages(&self) -> Self {
        if matches!(self.data, Blocks::Huge(_)) {
            return self.clone();
        }
        match crate::huge::place(&self.data) {
            Some(h) => Self {
                format: self.format,
                rows: self.rows,
                cols: self.cols,
                data: Blocks::Huge(h),
            },
            None => self.clone(),
        }
    }

    /// Block format.
    pub fn format(&self) -> QFormat {
        self.format
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The GGUF blocks as stored, row-major (what a device copy uploads).
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// Bytes held (what one call reads).
    pub fn byte_len(&self) -> usize {
        self.data.len()
    }

    /// Bytes of one row of blocks.
    pub(super) fn row_bytes(&self) -> usize {
        self.format.row_bytes(self.cols)
    }

    /// The blocks of row `r`.
    pub(super) fn row(&self, r: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.data[r * n..(r + 1) * n]
    }

    /// Reorder rows: row `i` of the result is row `order[i]` of `self`
    /// (used to undo llama.cpp's Q/K row permutation at load; whole rows
    /// move, blocks are not touched). `order` must be a permutation.
    pub fn permute_rows(&self, order: &[usize]) -> Self {
        assert_eq!(order.len(), self.rows, "a permutation of every row");
        let mut data = Vec::with_capacity(self.data.len());
        for &r in order {
            data.extend_from_slice(self.row(r));
        }
        Self {
            format: self.format,
            rows: self.rows,
            cols: self.cols,
            data: Blocks::Heap(data),
        }
    }

    /// [`Self::stack`] straight into huge pages ([`Self::in_huge_pages`]),
    /// with no stacked buffer in between (what a model builds its
    /// projections with); on the heap where the OS refuses the memory.
    pub fn stack_in_huge_pages(parts: &[&QMatrix]) -> Result<Self, QuantError> {
        Self::stack_into(parts, |bytes| match crate::huge::place_all(bytes) {
            Some(h) => Blocks::Huge(h),
            None => Blocks::Heap(bytes.concat()),
        })
    }

    /// Stack matrices of one format and width by rows (Q, K and V as one
    /// projection: one pass, one activation quantization, one dispatch).
    pub fn stack(parts: &[&QMatrix]) -> Result<Self, QuantError> {
        Self::stack_into(parts, |bytes| Blocks::Heap(bytes.concat()))
    }

    /// `parts` checked for one format and width, their blocks in order
    /// made into one matrix's by `blocks`.
    fn stack_into(
        parts: &[&QMatrix],
        blocks: impl FnOnce(&[&[u8]]) -> Blocks,
    ) -> Result<Self, QuantError> {
        let Some(first) = parts.first() else {
            return Err(QuantError::Length {
                format: "stack",
                rows: 0,
                cols: 0,
                expected: 1,
                got: 0,
            });
        };
        let mut rows = 0;
        for p in parts {
            if p.format != first.format || p.cols != first.cols {
                return Err(QuantError::Stack {
                    a: first.format.name(),
                    a_cols: first.cols,
                    b: p.format.name(),
                    b_cols: p.cols,
                });
            }
            rows += p.rows;
        }
        let bytes: Vec<&[u8]> = parts.iter().map(|p| &*p.data).collect();
        Ok(Self {
            format: first.format,
            rows,
            cols: first.cols,
            data: blocks(&bytes),
        })
    }

    /// Dequantize row `r` into `out` (`cols` values): embedding lookups,
    /// and the exact reference in tests.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols, "one row of output");
        crate::cpu::path().dequantize(self.format, self.row(r), out);
    }
}
