//! Typed launches of every kernel (one function per kernel, sizes checked
//! against the buffers before launching), and the GEMMs through cuBLAS.
//!
//! Every function queues work on the device's stream and returns; nothing
//! here waits, except where a result is copied back.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use kvmesh_kernels::quant::QFormat;

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::table::Violation;

/// Element type of a weight buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightDtype {
    /// f32 (the exact mode).
    F32 = 0,
    /// IEEE half.
    F16 = 1,
    /// bfloat16.
    Bf16 = 2,
}

/// A weight dtype name that is not f32, f16 or bf16.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("weight dtype {0:?}: expected f32, f16 or bf16")]
pub struct ParseWeightDtypeError(pub String);

impl std::str::FromStr for WeightDtype {
    type Err = ParseWeightDtypeError;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            "bf16" => Ok(Self::Bf16),
            other => Err(ParseWeightDtypeError(other.to_owned())),
        }
    }
}

impl std::fmt::Display for WeightDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl WeightDtype {
    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
        }
    }

    /// Name for logs and tables.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
        }
    }
}

/// The device kernels' code for a GGUF block format (`Q4_1`, `Q8_0` in
/// `quant.cu`), or `None` for a format they do not decode (every other
/// format of [`QFormat`] runs on the CPU kernels only).
pub fn device_format_code(format: QFormat) -> Option<u32> {
    match format {
        QFormat::Q4_1 => Some(0),
        QFormat::Q8_0 => Some(1),
        _ => None,
    }
}

/// [`device_format_code`], or the error that names the format and `op`.
fn format_code(op: &'static str, format: QFormat) -> Result<u32> {
    device_format_code(format).ok_or(CudaError::NoDeviceKernel {
        op,
        format: format.name(),
    })
}

/// Most activation rows [`qmatvec`] takes (`MV_MAX_ROWS` in `quant.cu`).
pub const QMATVEC_MAX_ROWS: usize = 8;
/// Threads per attention block (`ATT_WARPS * 32`).
pub const ATTENTION_THREADS: u32 = 128;
/// Largest head the attention kernel takes (`MAX_R * 32`).
pub const MAX_HEAD_DIM: usize = 256;

fn bad(op: &'static str, detail: String) -> CudaError {
    CudaError::BadArgument { op, detail }
}

fn need<T>(op: &'static str, what: &str, buf: &CudaSlice<T>, n: usize) -> Result<()> {
    if buf.len() < n {
        return Err(bad(
            op,
            format!("{what} holds {} values, {n} needed", buf.len()),
        ));
    }
    Ok(())
}

fn u32_of(op: &'static str, what: &str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| {
        bad(
            op,
            format!("{what} = {n} does not fit the kernel's 32-bit size"),
        )
    })
}

/// A grid-stride launch over `n` elements.
fn linear(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn rows_cfg(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn launched(
    r: std::result::Result<
        Option<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>,
        cudarc::driver::DriverError,
    >,
    k: &'static str,
) -> Result<()> {
    r.map(|_| ()).map_err(|e| CudaError::call(k, e))
}

/// `out[t] = table[ids[t]]` (`[rows, hidden]` f32) from a table of `dtype`.
#[allow(clippy::too_many_arguments)]
pub fn embedding<T>(
    gpu: &Gpu,
    table: &CudaSlice<T>,
    dtype: WeightDtype,
    ids: &CudaSlice<u32>,
    rows: usize,
    vocab: usize,
    hidden: usize,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    const OP: &str = "embedding";
    need(OP, "ids", ids, rows)?;
    need(OP, "out", out, rows * hidden)?;
    if table.len() * std::mem::size_of::<T>() < vocab * hidden * dtype.size() {
        return Err(bad(OP, "the table is smaller than vocab x hidden".into()));
    }
    if rows == 0 {
        return Ok(());
    }
    let (dt, r, v, h) = (
        dtype as u32,
        u32_of(OP, "rows", rows)?,
        u32_of(OP, "vocab", vocab)?,
        u32_of(OP, "hidden", hidden)?,
    );
    let f = gpu.function("embedding")?;
    let mut b = gpu.stream().launch_builder(f);
    b.arg(table)
        .arg(&dt)
        .arg(ids)
        .arg(&r)
        .arg(&v)
        .arg(&h)
        .arg(out);
    // SAFETY: sizes checked above against the kernel's indexing.
    launched(unsafe { b.launch(rows_cfg(rows, 256)) }, "embedding")
}

/// RMSNorm of each `d`-wide row of `x` into `out`.
pub fn rms_norm(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    rows: usize,
    d: usize,
    eps: f32,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    const OP: &str = "rms_norm";
    need(OP, "x", x, rows * d)?;
    need(OP, "w", w, d)?;
    need(OP, "out", out, rows * d)?;
    if rows == 0 {
        return Ok(());
    }
    let (r, dd) = (u32_of(OP, "rows", rows)?, u32_of(OP, "d", d)?);
    let f = gpu.function("rms_norm")?;
    let mut b = gpu.stream().launch_builder(f);
    b.arg(x).arg(w).arg(&r).arg(&dd).arg(&eps).arg(out);
    // SAFETY: sizes checked.
    launched(unsafe { b.launch(rows_cfg(rows, 256)) }, OP)
}

/// RoPE in place over `[rows, n_heads, head_dim]`; layout 0 rotate-half, 1
/// interleaved.
#[allow(clippy::too_many_arguments)]
pub fn rope(
    gpu: &Gpu,
    x: &mut CudaSlice<f32>,
    pos: &CudaSlice<u32>,
    inv_freq: &CudaSlice<f32>,
    rows: usize,
    n_heads: usize,
    head_dim: usize,
    interleaved: bool,
) -> Result<()> {
    const OP: &str = "rope";
    need(OP, "x", x, rows * n_heads * head_dim)?;
    need(OP, "pos", pos, rows)?;
    need(OP, "inv_freq", inv_freq, head_dim / 2)?;
    if rows == 0 {
        return Ok(());
    }
    let (r, h, d, l) = (
        u32_of(OP, "rows", rows)?,
        u32_of(OP, "heads", n_heads)?,
        u32_of(OP, "head_dim", head_dim)?,
        u32::from(interleaved),
    );
    let f = gpu.function("rope")?;
    let mut b = gpu.stream().launch_builder(f);
    b.arg(x)
        .arg(pos)
        .arg(inv_freq)
        .arg(&r)
        .arg(&h)
        .arg(&d)
        .arg(&l);
    // SAFETY: sizes checked.
    launched(
        unsafe { b.launch(linear(rows * n_heads * head_dim / 2)) },
        OP,
    )
}

/// `out = silu(g) * u` from `[rows, 2 * width]` rows `[g | u]`.
pub fn swiglu(
    gpu: &Gpu,
    gate_up: &CudaSlice<f32>,
    rows: usize,
    width: usize,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    const OP: &str = "swiglu";
    need(OP, "gate_up", gate_up, rows * 2 * width)?;
    need(OP, "out", out, rows * width)?;
    if rows * width == 0 {
        return Ok(());
    }
    let (r, w) = (u32_of(OP, "rows", rows)?, u32_of(OP, "width", width)?);
    let f = gpu.function("swiglu")?;
    let mut b = gpu.stream().launch_builder(f);
    b.arg(gate_up).arg(&r).arg(&w).arg(out);
    // SAFETY: sizes checked.
    launched(unsafe { b.launch(linear(rows * width)) }, OP)
}

/// `x += y` over the first `n` values.
pub fn add_into(gpu: &Gpu, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<()> {
    const OP: &str = "add_into";
    need(OP, "x", x, n)?;
    need(OP, "y", y, n)?;
    if n == 0 {
        return Ok(());
    }
    let nn = n as u64;
    let f = gpu.function("add_into")?;
    let mut b = gpu.stream().launch_builder(f);
    b.arg(x).arg(y).arg(&nn);
    // SAFETY: sizes checked.
    launched(unsafe { b.launch(linear(n)) }, OP)
}

/// `bias` added to each `d`-wide row.
pub fn add_bias(
    gpu: &Gpu,
    x: &mut CudaSlice<f32>,
    bias: &CudaSlice<f32>,
    rows: usize,
    d: usize,
) -> Result<()> {
    const OP: &str = "add_bias";
    need(OP, "x", x, rows * d)?;
    need(OP, "bias", bias, d)?;
    if rows * d == 0 {
        return Ok(());
    }
    let (r, dd) = (u32_of(OP, "rows", rows)?, u32_of(OP, "d", d)?);
    let f = gpu.function("add_bias")?;
    let mut b = gpu.stream().launch_builder(f);
    b.arg(x).arg(bias).arg(&r).arg(&dd);
    // SAFETY: sizes checked.
    launched(unsafe { b.launch(linear(rows * d)) }, OP)
}

/// The first `n` values of `x` as f16 or bf16 (round to nearest even).
pub fn f32_to_half(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    n: usize,
    dtype: WeightDtype,
    out: &mut CudaSlice<u16>,
) -> Result<()> {
    const OP: &str = "f32_to_half";
    need(OP, "x", x, n)?;
    need(OP, "out", out, n)?;
    if dtype == WeightDtype::F32 {
        return Err(bad(OP, "f32 is not a half type".into()));
    }
    if n == 0 {
        return Ok(());
    }
    let (nn, dt) = (n as u64, dtype as u32);
    let f = gpu.function("f32_to_half")?;
    let mut b = gpu.stream().launch_builder(f);
    b.arg(x).arg(&nn).arg(&dt).arg(out);
    // SAFETY: sizes checked.
    launched(unsafe { b.launch(linear(n)) }, OP)
}

/// Rows `sel` of `x` (`d` wide) into `out`.
pub fn gather_rows(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    sel: &CudaSlice<u32>,
    n_sel: usize,
    d: usize,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    const OP: &str = "gather_rows";
    need(OP, "sel", sel, n_sel)?;
    need(OP, "out", out, n_sel * d)?;
    if n_sel == 0 {
        return Ok(());
    }
    let (n, dd) = (u32_of(OP, "rows", n_sel)?, u32_of(OP, "d", d)?);
    let f = gpu.function("gather_rows")?;
    let mut b = gpu.stream().launch_builder(f);
    b.arg(x).arg(sel).arg(&n).arg(&dd).arg(out);
    // SAFETY: sizes checked (`sel` values are rows the host computed).
    launched(unsafe { b.launch(rows_cfg(n_sel, 256)) }, OP)
}

/// Every value of `n_blocks` GGUF blocks (of 32 values: Q4_1 or Q8_0; any
/// other format is [`CudaError::NoDeviceKernel`]) into `out` (f32, f16 or
/// bf16).
pub fn dequantize<T>(
    gpu: &Gpu,
    blocks: &CudaSlice<u8>,
    format: QFormat,
    n_blocks: usize,
    dtype: WeightDtype,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    const OP: &str = "dequantize";
    let fm = format_code(OP, format)?;
    need(OP, "blocks", blocks, n_blocks * format.block_bytes())?;
    if out.len() * std::mem::size_of::<T>() < n_blocks * 32 * dtype.size() {
        return Err(bad(OP, "out is smaller than the values".into()));
    }
    if n_blocks == 0 {
        return Ok(());
    }
    let (nb, dt) = (n_blocks as u64, dtype as u32);
    let f = gpu.function("dequantize")?;
    let mut b = gpu.stream().launch_builder(f);
    b.arg(blocks).arg(&fm).arg(&nb).arg(&dt).arg(out);
    // SAFETY: sizes checked.
    launched(unsafe { b.launch(linear(n_blocks * 32)) }, OP)
}

/// `out[t, r] = sum_k x[t, k] * w[r, k]` over GGUF blocks (Q4_1 or Q8_0;
/// any other format is [`CudaError::NoDeviceKernel`]), for at most
/// [`QMATVEC_MAX_ROWS`] activation rows.
#[allow(clippy::too_many_arguments)]
pub fn qmatvec(
    gpu: &Gpu,
    w: &CudaSlice<u8>,
    format: QFormat,
    out_rows: usize,
    cols: usize,
    x: &CudaSlice<f32>,
    rows: usize,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    const OP: &str = "qmatvec";
    let fm = format_code(OP, format)?;
    if rows > QMATVEC_MAX_ROWS || !cols.is_multiple_of(32) {
        return Err(bad(
            OP,
            format!(
                "{rows} rows of {cols} columns (at most {QMATVEC_MAX_ROWS} rows, whole blocks)"
            ),
        ));
    }
    need(OP, "w", w, out_rows * cols / 32 * format.block_bytes())?;
    need(OP, "x", x, rows * cols)?;
    need(OP, "out", out, rows * out_rows)?;
    if rows == 0 || out_rows == 0 {
        return Ok(());
    }
    let (o, c, r) = (
        u32_of(OP, "out_rows", out_rows)?,
        u32_of(OP, "cols", cols)?,
        rows as u32,
    );
    let f = gpu.function("qmatvec")?;
    let mut b = gpu.stream().launch_builder(f);
    b.arg(w).arg(&fm).arg(&o).arg(&c).arg(x).arg(&r).arg(out);
    let cfg = LaunchConfig {
        grid_dim: (out_rows.div_ceil(8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: sizes checked.
    launched(unsafe { b.launch(cfg) }, OP)
}

/// The greedy token of each row.
pub fn argmax_rows(
    gpu: &Gpu,
    logits: &CudaSlice<f32>,
    rows: usize,
    vocab: usize,
    out: &mut CudaSlice<u32>,
) -> Result<()> {
    const OP: &str = "argmax_rows";
    need(OP, "logits", logits, rows * vocab)?;
    need(OP, "out", out, rows)?;
    if rows == 0 || vocab == 0 {
        return Ok(());
    }
    let (r, v) = (u32_of(OP, "rows", rows)?, u32_of(OP, "vocab", vocab)?);
    let f = gpu.function("argmax_rows")?;
    let mut b = gpu.stream().launch_builder(f);
    b.arg(logits).arg(&r).arg(&v).arg(out);
    // SAFETY: sizes checked.
    launched(unsafe { b.launch(rows_cfg(rows, 256)) }, OP)
}

/// What the KV kernels index a step's sequences with: the packed tables
/// (`crate::table::PackedTables`) and one record per chunk, on the device.
#[derive(Debug)]
pub struct StepTables {
    /// Packed entries.
    pub entries: CudaSlice<u64>,
    /// Each chunk's first entry.
    pub offsets: CudaSlice<u32>,
    /// Each chunk's entry count.
    pub lens: CudaSlice<u32>,
    /// Each chunk's first row in the step's activations.
    pub row0: CudaSlice<u32>,
    /// Each chunk's row count.
    pub rows: CudaSlice<u32>,
    /// Each chunk's first position.
    pub start: CudaSlice<u32>,
    /// Each row's chunk.
    pub tok_chunk: CudaSlice<u32>,
    /// Each row's position.
    pub tok_pos: CudaSlice<u32>,
    /// One record per chunk (8 `u32`s each), zero at the step's start.
    pub violations: CudaSlice<u32>,
    /// Chunks.
    pub n_chunks: usize,
    /// Rows.
    pub n_rows: usize,
}

/// One sequence's share of a step, on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkSpec {
    /// The sequence's table.
    pub table: Vec<kvmesh_kernels::paged::PageRef>,
    /// Position of the chunk's first token.
    pub start: usize,
    /// Tokens in the chunk.
    pub rows: usize,
    /// Positions of the sequence's head held in shared pages (leased from
    /// the prefix cache: `Reservation::cached_tokens`), which no write may
    /// touch. A chunk starting below it is refused before the step's
    /// first kernel ([`initial_records`]).
    pub cached: usize,
}

/// Each chunk's violation record at the start of a step, as `u32`s: zero,
/// or for a chunk that would write a position of its sequence's shared
/// head, [`Violation::shared_page`], the check the CPU pool's
/// `Reservation::write_kv` makes (`PoolError::SharedPage`). `kv_write`
/// writes nothing for a chunk whose record is set, and attention gives it
/// zeros, so a shared page is refused before any value is written, on
/// the host, at no cost to the kernels.
pub fn initial_records(chunks: &[ChunkSpec]) -> Vec<u32> {
    let mut words = Vec::with_capacity(chunks.len() * 8);
    for c in chunks {
        let record = if c.rows > 0 && c.start < c.cached {
            Violation::shared_page(
                u32::try_from(c.start).unwrap_or(u32::MAX),
                u32::try_from(c.cached).unwrap_or(u32::MAX),
            )
        } else {
            Violation::default()
        };
        words.extend(record.to_words());
    }
    words
}

impl StepTables {
    /// Upload a step's tables and row maps.
    pub fn new(gpu: &Gpu, chunks: &[ChunkSpec]) -> Result<Self> {
        const OP: &str = "StepTables";
        let packed = crate::table::PackedTables::new(chunks.iter().map(|c| &c.table[..]));
        let (mut row0, mut rows, mut start, mut tok_chunk, mut tok_pos) =
            (vec![], vec![], vec![], vec![], vec![]);
        let mut at = 0usize;
        for (i, c) in chunks.iter().enumerate() {
            row0.push(u32_of(OP, "row", at)?);
            rows.push(u32_of(OP, "rows", c.rows)?);
            start.push(u32_of(OP, "position", c.start)?);
            for t in 0..c.rows {
                tok_chunk.push(i as u32);
                tok_pos.push(u32_of(OP, "position", c.start + t)?);
            }
            at += c.rows;
        }
        Ok(Self {
            entries: gpu.upload(&packed.entries)?,
            offsets: gpu.upload(&packed.offsets)?,
            lens: gpu.upload(&packed.lens)?,
            row0: gpu.upload(&row0)?,
            rows: gpu.upload(&rows)?,
            start: gpu.upload(&start)?,
            tok_chunk: gpu.upload(&tok_chunk)?,
            tok_pos: gpu.upload(&tok_pos)?,
            violations: gpu.upload(&initial_records(chunks))?,
            n_chunks: chunks.len(),
            n_rows: at,
        })
    }

    /// Each chunk's record (waits for the stream).
    pub fn violations(&self, gpu: &Gpu) -> Result<Vec<Violation>> {
        let words = gpu.download(&self.violations)?;
        Ok(words
            .chunks(8)
            .take(self.n_chunks)
            .map(Violation::from_words)
            .collect())
    }
}

/// `out[rows, n] = x[rows, k] * w[n, k]^T` (row-major), f32 in and out:
/// cuBLAS in full f32 (`CUBLAS_COMPUTE_32F`, no TF32): the exact mode.
pub fn gemm_f32(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    rows: usize,
    k: usize,
    n: usize,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    use cudarc::cublas::sys::cudaDataType::CUDA_R_32F;
    gemm_ex(gpu, "gemm_f32", x, w, CUDA_R_32F, (rows, k, n), out)
}

/// `out[rows, n] = x[rows, k] * w[n, k]^T` with `w` and `x_half` in f16 or
/// bf16 (`x` converted by [`f32_to_half`] first) and f32 out, accumulated
/// in f32 (cuBLAS GemmEx, `CUBLAS_COMPUTE_32F`).
#[allow(clippy::too_many_arguments)]
pub fn gemm_half(
    gpu: &Gpu,
    x_half: &CudaSlice<u16>,
    w: &CudaSlice<u16>,
    dtype: WeightDtype,
    rows: usize,
    k: usize,
    n: usize,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    use cudarc::cublas::sys::cudaDataType;
    let ty = match dtype {
        WeightDtype::F16 => cudaDataType::CUDA_R_16F,
        WeightDtype::Bf16 => cudaDataType::CUDA_R_16BF,
        WeightDtype::F32 => return Err(bad("gemm_half", "f32 weights go through gemm_f32".into())),
    };
    gemm_ex(gpu, "gemm_half", x_half, w, ty, (rows, k, n), out)
}

/// The one cuBLAS call: `x` and `w` of type `ty`, f32 out, f32 compute.
///
/// cuBLAS is column-major: the row-major `out` is the column-major
/// `n x rows` matrix `W * X^T`, where the row-major `[n, k]` weights read
/// column-major are `W^T` (so `transa = T`, `lda = k`) and the row-major
/// `[rows, k]` activations are `X^T` as they lie (`transb = N`, `ldb = k`).
fn gemm_ex<T>(
    gpu: &Gpu,
    op: &'static str,
    x: &CudaSlice<T>,
    w: &CudaSlice<T>,
    ty: cudarc::cublas::sys::cudaDataType,
    (rows, k, n): (usize, usize, usize),
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    use cudarc::cublas::sys;
    need(op, "x", x, rows * k)?;
    need(op, "w", w, n * k)?;
    need(op, "out", out, rows * n)?;
    if rows * n == 0 {
        return Ok(());
    }
    let blas = gpu.blas()?;
    let (m, nn, kk) = (i32_of(op, n)?, i32_of(op, rows)?, i32_of(op, k)?);
    let (alpha, beta) = (1.0f32, 0.0f32);
    let stream = gpu.stream();
    let (wp, _g1) = w.device_ptr(stream);
    let (xp, _g2) = x.device_ptr(stream);
    let (outp, _g3) = out.device_ptr_mut(stream);
    // SAFETY: every buffer is at least the size the dimensions read or
    // write (checked above); the scalars are f32 as the compute type says.
    let st = unsafe {
        sys::cublasGemmEx(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_T,
            sys::cublasOperation_t::CUBLAS_OP_N,
            m,
            nn,
            kk,
            (&alpha as *const f32).cast(),
            wp as *const std::ffi::c_void,
            ty,
            kk,
            xp as *const std::ffi::c_void,
            ty,
            kk,
            (&beta as *const f32).cast(),
            outp as *mut std::ffi::c_void,
            sys::cudaDataType::CUDA_R_32F,
            m,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    blas_ok(op, st)
}

fn i32_of(op: &'static str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| bad(op, format!("dimension {n} is past cuBLAS's 32-bit sizes")))
}

fn blas_ok(call: &'static str, st: cudarc::cublas::sys::cublasStatus_t) -> Result<()> {
    if st == cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::call(call, st))
    }
}

#[cfg(test)]
mod tests;
