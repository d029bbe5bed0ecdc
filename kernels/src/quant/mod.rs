//! Quantized matrix multiplication over GGUF block formats, used as they are
//! stored in the file (no dequantizing at load).
//!
//! # Formats
//! Weights are rows of blocks, exactly the GGUF bytes (ggml's `block_*`
//! structs, little-endian; `d`, `dmin`, `m` are f16). A value is an integer
//! quant `q` times a scale, plus an offset in some formats; `scalar.rs`
//! defines the decoding and its order of operations (the reference every
//! path equals to the bit, and GGUF's own results, bit for bit):
//!
//! | format | values / bytes | layout | value |
//! |---|---|---|---|
//! | F16, BF16 | 32 / 64 | 32 halves | converted |
//! | Q4_0 | 32 / 18 | `d, qs[16]` | `(q - 8) * d` |
//! | Q4_1 | 32 / 20 | `d, m, qs[16]` | `fma(q, d, m)` |
//! | Q5_0 | 32 / 22 | `d, qh[4], qs[16]` | `(q - 16) * d` |
//! | Q5_1 | 32 / 24 | `d, m, qh[4], qs[16]` | `fma(q, d, m)` |
//! | Q8_0 | 32 / 34 | `d, qs[32]` (i8) | `q * d` |
//! | Q2_K | 256 / 84 | `scales[16], qs[64], d, dmin` | `fma(q, d * sc, -(dmin * m))` per 16 |
//! | Q3_K | 256 / 110 | `hmask[32], qs[64], scales[12], d` | `q * (d * (sc - 32))` per 16 |
//! | Q4_K | 256 / 144 | `d, dmin, scales[12], qs[128]` | `fma(q, d * sc, -(dmin * m))` per 32 |
//! | Q5_K | 256 / 176 | `d, dmin, scales[12], qh[32], qs[128]` | as Q4_K |
//! | Q6_K | 256 / 210 | `ql[128], qh[64], scales[16] (i8), d` | `q * (d * sc)` per 16 |
//! | MXFP4 | 32 / 17 | `e, qs[16]` | `kvalues[code] * 2^(e - 128)` |
//!
//! Legacy blocks put value `i` in the low nibble of `qs[i]` and value
//! `i + 16` in the high one (the fifth bit is bit `i` of `qh`); the
//! K-quants' bit layouts are spelled out in `scalar.rs` (`quants`). MXFP4
//! (OCP microscaling FP4, gpt-oss's experts) packs its 4-bit e2m1 codes as
//! the legacy blocks do; a code's quant is its e2m1 value doubled (ggml's
//! `kvalues_mxfp4`: `0, 1, 2, 3, 4, 6, 8, 12` and their negatives, an
//! integer in `[-12, 12]`) and the scale is the e8m0 byte `e` halved,
//! `2^(e - 128)` (ggml's `GGML_E8M0_TO_FP32_HALF`: a power of two, the
//! subnormals `2^-128` and `2^-127` for `e` = 0 and 1), so `q * s` is
//! exact, or infinite where it reaches `2^128` (only from `e` = 253, as in
//! ggml and gguf-py; a quantizer never writes those for finite weights).
//!
//! Two numerics classes, one per process ([`crate::cpu::activations`]):
//! - **f32 activations** (`gemm.rs`): a call dequantizes each weight once,
//!   in registers or into a small panel buffer, and multiplies in f32 with
//!   fused multiply-adds. The product differs from the `--exact` f32
//!   weights only by the weights' quantization.
//! - **8-bit activations** (`i8.rs`, `--activations int8`): the
//!   activations are quantized per 32 values, multiplied with the weights'
//!   integer quants in exact integer sums (AVX2 `vpmaddubsw`, AVX-VNNI or
//!   AVX-512 VNNI `vpdpbusd`), scaled in f32: as llama.cpp's kernels do,
//!   the activations' rounding is added to the weights'. F16 and BF16
//!   weights take the f32 class's kernels in both.
//!
//! # Determinism
//! In either class, every output element is computed by the same sequence
//! of operations whatever the batch size, the position of its row in the
//! batch, the register tile, the thread, or the path (AVX-512, AVX2 or
//! portable; in the int8 class also the integer dot product): a
//! sequence decodes to the same tokens alone or batched, prompt chunked or
//! whole, and a disaggregated run equals the reference engine token for
//! token.
//!
//! # Cost
//! - One or two activation rows (a decode step of one or two sequences):
//!   each weight block is dequantized in registers and used at once, never
//!   stored (legacy blocks straight from their bytes, K-quants a 32-value
//!   group at a time). F16 and BF16 run at the speed of reading their
//!   bytes; the packed formats are bound by the unpacking and f32
//!   conversion of each weight (about 10-17 Gweights/s per core on the
//!   machine below), which at 0.3-1.1 bytes a weight is less than the
//!   bandwidth: fewer bytes, not proportionally less time.
//! - More rows: each task dequantizes a panel of 16 (from 48 rows, 64)
//!   weight rows into an L1/L2-resident f32 buffer once, then every
//!   activation row passes over it in 3 x 4 register tiles, twelve
//!   independent multiply-add chains, bound by the FMA units: every format
//!   costs about the same there.
//!
//! # Measured
//! `cargo bench -p kvmesh-kernels --bench quant` (`QUANT_BENCH_TABLE=formats`),
//! AVX-512 path, 2 rayon threads, on this project's build machine: 2 cores
//! of an Intel Xeon (Sapphire Rapids class: AVX-512 F/BW/VL/DQ, VNNI, BF16,
//! FP16; 2 MiB L2 per core, 480 MiB L3, so both matrices are cache
//! resident), shared with other jobs during the run (load average 4-5.5:
//! the second core was mostly busy, so the batch-1 times equal one core's
//! and the 512-row GMAC/s are about half an idle machine's 50-58). ms per
//! call (median), GB/s of weight bytes; `copy` is one thread copying the
//! same bytes (about 14.5 GB/s from L3), `x1/copy` the one-row time over it.
//!
//! | format | 576x1536 x1 ms | GB/s | x16 ms | x512 ms | 2048x8192 x1 ms | GB/s | x1/copy | x16 ms | x512 GMAC/s |
//! |---|---|---|---|---|---|---|---|---|---|
//! | Q8_0 (baseline) | 0.053 | 17.9 | 0.315 | 12.8 | 0.954 | 18.7 | 0.78 | 10.4 | 27.3 |
//! | Q4_1 (baseline) | 0.053 | 10.4 | 0.312 | 9.07 | 0.878 | 11.9 | 1.23 | 8.00 | 26.7 |
//! | F16 | 0.037 | 48.2 | 0.280 | 14.4 | 1.192 | 28.1 | 0.52 | 10.7 | 22.7 |
//! | BF16 | 0.038 | 46.3 | 0.325 | 12.3 | 1.295 | 25.9 | 0.56 | 10.4 | 24.9 |
//! | Q4_0 | 0.058 | 8.6 | 0.221 | 12.4 | 1.104 | 8.5 | 1.74 | 8.50 | 26.1 |
//! | Q5_0 | 0.078 | 7.8 | 0.311 | 12.0 | 1.430 | 8.1 | 1.84 | 8.13 | 27.2 |
//! | Q5_1 | 0.073 | 9.1 | 0.331 | 12.5 | 1.317 | 9.6 | 1.54 | 9.71 | 26.2 |
//! | Q2_K | 0.075 | 3.9 | 0.321 | 12.5 | 1.393 | 4.0 | 3.72 | 9.57 | 29.2 |
//! | Q3_K | 0.079 | 4.8 | 0.300 | 12.4 | 1.501 | 4.8 | 2.97 | 8.39 | 30.4 |
//! | Q4_K | 0.076 | 6.5 | 0.335 | 11.5 | 1.442 | 6.5 | 2.21 | 11.8 | 29.6 |
//! | Q5_K | 0.090 | 6.7 | 0.220 | 11.8 | 1.656 | 7.0 | 2.09 | 8.10 | 29.9 |
//! | Q6_K | 0.084 | 8.7 | 0.305 | 8.59 | 1.583 | 8.7 | 1.65 | 9.94 | 29.1 |
//!
//! So at one row every format takes 0.9-1.8x the time of Q8_0 on the same
//! shape (F16/BF16 at 27 GB/s, about what one core reads from L3), and
//! batched calls cost the same for every format. Against the build before
//! the new formats (one core, runs alternated): Q8_0 49152x576 one row
//! 1.66-1.76 ms (before 1.68-1.75), Q4_1 576x1536 0.053 ms (0.053); on
//! the AVX2 path 1.59-1.62 (1.63-1.68) and 0.064 (0.073).
//!
//! MXFP4 (added later; 17 bytes per 32 values against Q4_0's 18) against
//! Q4_0 on the same shapes, the same bench (`QUANT_BENCH=MXFP4`, then
//! `Q4_0`, five alternated rounds, `RAYON_NUM_THREADS=1`, the machine
//! shared): MXFP4's time over Q4_0's, median of the rounds, at 1 / 16 /
//! 512 rows, `[576x1536]` and `[2048x8192]`. f32 class, AVX-512: 0.84-0.85 /
//! 1.03-1.08 / 1.01-1.03; AVX2: 1.04-1.07 / 0.99-1.01 / 0.98-0.99. int8
//! class (AVX-512 VNNI), those shapes and `[3072x576]`, `[49152x576]`:
//! 1.02-1.04 / 1.00-1.03 / 0.99-1.04. Its scales come from a table of the
//! 256 e8m0 bytes (before it, at one row: 1.15-1.2x on AVX2 and in the
//! int8 class).
//!
//! Output rows are split across the rayon pool (every core). The int8
//! class's costs are in `i8.rs`, measured against this class by the same
//! bench (`QUANT_BENCH_TABLE=int8`).
//!
//! # Paths
//! [`crate::cpu::path`] (the process's path, chosen once) picks AVX-512
//! (`x86_512`), AVX2 with FMA and F16C (`x86`), or the portable path
//! (`f32::mul_add`), which is also the reference the fast paths are tested
//! against, to the bit. Nothing depends on the compile-time target, so one
//! binary runs everywhere. [`matmul_with`] runs a chosen path (tests,
//! benchmarks).

#[cfg(target_arch = "x86_64")]
mod ahead;
mod gemm;
mod i8;
#[cfg(target_arch = "x86_64")]
mod i8_x86;
#[cfg(target_arch = "x86_64")]
mod i8_x86_256;
#[cfg(target_arch = "x86_64")]
mod i8_x86_512;
#[cfg(target_arch = "x86_64")]
mod i8_x86_pairs;
#[cfg(target_arch = "x86_64")]
mod i8_x86_row;
mod lines;
mod matrix;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_512;
#[cfg(target_arch = "x86_64")]
mod x86_512_blocks;
#[cfg(target_arch = "x86_64")]
mod x86_blocks;

use thiserror::Error;

pub use crate::cpu::{Activations, Path};
pub use i8::Dot;
pub use matrix::QMatrix;

/// Widest inner dimension the kernels take: 32,768 columns, beyond any
/// Llama-family hidden or intermediate size (rows of blocks this long keep
/// a panel of 64 weight rows within 8 MiB).
pub const MAX_COLS: usize = 32 * 1024;

/// Values per group: every format is decoded 32 values at a time (one
/// legacy block, an eighth of a K-quant super-block, or 32 halves).
pub(crate) const GROUP: usize = 32;

/// A GGUF weight format the kernels run directly, as its bytes.
#[allow(non_camel_case_types)] // GGUF's spelling
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QFormat {
    /// IEEE half precision, taken in blocks of 32 values (64 bytes).
    F16,
    /// bfloat16, taken in blocks of 32 values (64 bytes).
    BF16,
    /// 4-bit, per-block scale: `(q - 8) * d`.
    Q4_0,
    /// 4-bit with a per-block scale and minimum: `q * d + m`.
    Q4_1,
    /// 5-bit, per-block scale: `(q - 16) * d`.
    Q5_0,
    /// 5-bit with a per-block scale and minimum: `q * d + m`.
    Q5_1,
    /// 8-bit, per-block scale: `q * d`.
    Q8_0,
    /// K-quant, 2-bit, 4-bit scales and minimums per 16 values.
    Q2_K,
    /// K-quant, 3-bit, 6-bit scales per 16 values.
    Q3_K,
    /// K-quant, 4-bit, 6-bit scales and minimums per 32 values.
    Q4_K,
    /// K-quant, 5-bit, 6-bit scales and minimums per 32 values.
    Q5_K,
    /// K-quant, 6-bit, 8-bit scales per 16 values.
    Q6_K,
    /// OCP microscaling FP4: 4-bit e2m1 codes, one e8m0 (power of two)
    /// scale per 32 values: `kvalues[code] * 2^(e - 128)`.
    MXFP4,
}

/// The formats' GGML type ids (`enum ggml_type` in ggml.h,
/// `GGMLQuantizationType` in gguf-py), also the kernels' compile-time
/// format parameter (`const F: u8`).
pub(crate) mod code {
    pub const F16: u8 = 1;
    pub const Q4_0: u8 = 2;
    pub const Q4_1: u8 = 3;
    pub const Q5_0: u8 = 6;
    pub const Q5_1: u8 = 7;
    pub const Q8_0: u8 = 8;
    pub const Q2_K: u8 = 10;
    pub const Q3_K: u8 = 11;
    pub const Q4_K: u8 = 12;
    pub const Q5_K: u8 = 13;
    pub const Q6_K: u8 = 14;
    pub const BF16: u8 = 30;
    pub const MXFP4: u8 = 39;
}

/// `$body` with `$F` a `const u8` holding `$format`'s [`code`], so a kernel
/// generic over `const F: u8` is monomorphized per format and its format
/// tests fold away.
macro_rules! with_format {
    ($format:expr, $F:ident => $body:expr) => {{
        use $crate::quant::{code as c, QFormat as Q};
        match $format {
            Q::F16 => {
                const $F: u8 = c::F16;
                $body
            }
            Q::BF16 => {
                const $F: u8 = c::BF16;
                $body
            }
            Q::Q4_0 => {
                const $F: u8 = c::Q4_0;
                $body
            }
            Q::Q4_1 => {
                const $F: u8 = c::Q4_1;
                $body
            }
            Q::Q5_0 => {
                const $F: u8 = c::Q5_0;
                $body
            }
            Q::Q5_1 => {
                const $F: u8 = c::Q5_1;
                $body
            }
            Q::Q8_0 => {
                const $F: u8 = c::Q8_0;
                $body
            }
            Q::Q2_K => {
                const $F: u8 = c::Q2_K;
                $body
            }
            Q::Q3_K => {
                const $F: u8 = c::Q3_K;
                $body
            }
            Q::Q4_K => {
                const $F: u8 = c::Q4_K;
                $body
            }
            Q::Q5_K => {
                const $F: u8 = c::Q5_K;
                $body
            }
            Q::Q6_K => {
                const $F: u8 = c::Q6_K;
                $body
            }
            Q::MXFP4 => {
                const $F: u8 = c::MXFP4;
                $body
            }
        }
    }};
}
pub(crate) use with_format;

impl QFormat {
    /// Every format, in GGML type id order.
    pub const ALL: [QFormat; 13] = [
        Self::F16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q2_K,
        Self::Q3_K,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
        Self::BF16,
        Self::MXFP4,
    ];

    /// The format of a GGML type id (a GGUF tensor's `type`), or `None`
    /// for a type the kernels do not run (F32, Q8_1, Q8_K, the IQ and TQ
    /// families, NVFP4, ...).
    pub const fn from_ggml_type(code: u32) -> Option<QFormat> {
        let mut i = 0;
        while i < Self::ALL.len() {
            if Self::ALL[i].ggml_type() == code {
                return Some(Self::ALL[i]);
            }
            i += 1;
        }
        None
    }

    /// The GGML type id.
    pub const fn ggml_type(self) -> u32 {
        self.code() as u32
    }

    /// The kernels' compile-time format parameter (the GGML type id).
    pub(crate) const fn code(self) -> u8 {
        match self {
            Self::F16 => code::F16,
            Self::BF16 => code::BF16,
            Self::Q4_0 => code::Q4_0,
            Self::Q4_1 => code::Q4_1,
            Self::Q5_0 => code::Q5_0,
            Self::Q5_1 => code::Q5_1,
            Self::Q8_0 => code::Q8_0,
            Self::Q2_K => code::Q2_K,
            Self::Q3_K => code::Q3_K,
            Self::Q4_K => code::Q4_K,
            Self::Q5_K => code::Q5_K,
            Self::Q6_K => code::Q6_K,
            Self::MXFP4 => code::MXFP4,
        }
    }

    /// The format of a [`Self::code`] (kernels generic over `const F: u8`).
    pub(crate) const fn of_code(f: u8) -> QFormat {
        match Self::from_ggml_type(f as u32) {
            Some(format) => format,
            None => panic!("not a format code"),
        }
    }

    /// Values per block: 256 for the K-quants, 32 for the others.
    pub const fn block_values(self) -> usize {
        match self {
            Self::Q2_K | Self::Q3_K | Self::Q4_K | Self::Q5_K | Self::Q6_K => 256,
            _ => GROUP,
        }
    }

    /// Bytes per block (GGUF's `type_size`; 64 for 32 halves).
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::F16 | Self::BF16 => 64,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q2_K => 84,
            Self::Q3_K => 110,
            Self::Q4_K => 144,
            Self::Q5_K => 176,
            Self::Q6_K => 210,
            Self::MXFP4 => 17,
        }
    }

    /// The format's name as GGUF tools write it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q2_K => "Q2_K",
            Self::Q3_K => "Q3_K",
            Self::Q4_K => "Q4_K",
            Self::Q5_K => "Q5_K",
            Self::Q6_K => "Q6_K",
            Self::MXFP4 => "MXFP4",
        }
    }

    /// Whether values are quants times scales (every format but F16 and
    /// BF16, which are converted).
    pub(crate) const fn is_quantized(self) -> bool {
        !matches!(self, Self::F16 | Self::BF16)
    }

    /// Whether a value adds an offset (`fma(q, s, o)`; else `q * s`).
    pub(crate) const fn has_offset(self) -> bool {
        matches!(
            self,
            Self::Q4_1 | Self::Q5_1 | Self::Q2_K | Self::Q4_K | Self::Q5_K
        )
    }

    /// Values sharing one scale (and offset): 16 in Q2_K, Q3_K and Q6_K,
    /// 32 in the others (a legacy or MXFP4 block is one).
    pub(crate) const fn sub_block(self) -> usize {
        match self {
            Self::Q2_K | Self::Q3_K | Self::Q6_K => 16,
            _ => GROUP,
        }
    }

    /// Bytes of a matrix row of `cols` values (whole blocks).
    pub const fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_values() * self.block_bytes()
    }
}

impl std::fmt::Display for QFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a quantized matrix could not be built.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum QuantError {
    /// The inner dimension is not a whole number of blocks, or too wide.
    #[error(
        "{format} matrix of {cols} columns: not a multiple of its {block}-value block, or over {}",
        MAX_COLS
    )]
    Columns {
        /// Format name.
        format: &'static str,
        /// The format's values per block.
        block: usize,
        /// The inner dimension.
        cols: usize,
    },
    /// The byte count does not match the shape.
    #[error("{format} matrix [{rows}, {cols}] needs {expected} bytes, got {got}")]
    Length {
        /// Format name.
        format: &'static str,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// Bytes the shape needs.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// Matrices joined by rows must agree in format and columns.
    #[error("cannot stack a {a} matrix of {a_cols} columns with a {b} matrix of {b_cols}")]
    Stack {
        /// First format.
        a: &'static str,
        /// Its columns.
        a_cols: usize,
        /// Second format.
        b: &'static str,
        /// Its columns.
        b_cols: usize,
    },
}

/// Which implementation runs: the crate-wide [`Path`] (kept under this
/// name for callers of the quantized kernels; `Kernel::detect()` is the
/// best path of this CPU, [`crate::cpu::path`] the one in use).
pub use crate::cpu::Path as Kernel;

/// `out[t, r] = sum_k x[t, k] * w[r, k]` for every activation row `t` and
/// weight row `r`: `x` is `[rows, w.cols()]` and `out` `[rows, w.rows()]`,
/// both row-major.
///
/// # Panics
/// If the slice lengths disagree with the shapes (a caller bug).
pub fn matmul(w: &QMatrix, x: &[f32], rows: usize, out: &mut [f32]) {
    let path = crate::cpu::path();
    match crate::cpu::activations() {
        Activations::F32 => gemm::matmul(path, w, x, rows, out),
        Activations::Int8 => i8::matmul(path, w, x, rows, out),
    }
}

/// `x` through each of `ws` (one input width) into `outs[i]` (`[rows,
/// ws[i].rows()]`): one [`matmul`] each, to the bit, but in the
/// 8-bit-activation class the activations are quantized once for all of
/// them (a layer's Q, K and V of different block formats share one input).
///
/// # Panics
/// As [`matmul`], and if `outs` and `ws` differ in length.
pub fn matmul_each<W: AsRef<QMatrix>>(ws: &[W], x: &[f32], rows: usize, outs: &mut [&mut [f32]]) {
    assert_eq!(ws.len(), outs.len(), "one output per matrix");
    let path = crate::cpu::path();
    match crate::cpu::activations() {
        Activations::Int8 if ws.iter().all(|w| w.as_ref().format.is_quantized()) => {
            i8::matmul_each_dot(i8::Dot::of(path), ws, x, rows, outs);
        }
        _ => {
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                matmul(w.as_ref(), x, rows, out);
            }
        }
    }
}

/// [`matmul`] in the f32 class with a chosen path (tests and benchmarks
/// compare them).
///
/// # Panics
/// If this CPU lacks `kernel` ([`Path::available`]).
pub fn matmul_with(kernel: Path, w: &QMatrix, x: &[f32], rows: usize, out: &mut [f32]) {
    gemm::matmul(kernel, w, x, rows, out);
}

/// [`matmul`] in the 8-bit-activation class with a chosen integer dot
/// product (tests and benchmarks compare them; F16 and BF16 take the f32
/// class's kernels on this process's path).
///
/// # Panics
/// If this CPU lacks `dot` ([`Dot::available`]).
pub fn matmul_int8_with(dot: Dot, w: &QMatrix, x: &[f32], rows: usize, out: &mut [f32]) {
    if w.format.is_quantized() {
        i8::matmul_dot(dot, w, x, rows, out);
    } else {
        gemm::matmul(crate::cpu::path(), w, x, rows, out);
    }
}

#[cfg(test)]
mod tests;
