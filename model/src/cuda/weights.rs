//! The model's weights on the device: each matrix as f32 or a half type,
//! stacked where one GEMM serves several (gate and up).

use kvmesh_cuda::cudarc::driver::CudaSlice;
use kvmesh_cuda::gpu::Gpu;
use kvmesh_cuda::ops::{self, WeightDtype};
use kvmesh_cuda::CudaError;

use crate::error::{ModelError, Result};
use crate::weights::Matrix;

/// A weight matrix `[rows, cols]` on the device.
pub(super) enum DevMatrix {
    F32 {
        w: CudaSlice<f32>,
        rows: usize,
        cols: usize,
    },
    Half {
        w: CudaSlice<u16>,
        dtype: WeightDtype,
        rows: usize,
        cols: usize,
    },
}

impl DevMatrix {
    pub(super) fn rows(&self) -> usize {
        match self {
            Self::F32 { rows, .. } | Self::Half { rows, .. } => *rows,
        }
    }

    pub(super) fn bytes(&self) -> usize {
        match self {
            Self::F32 { rows, cols, .. } => rows * cols * 4,
            Self::Half { rows, cols, .. } => rows * cols * 2,
        }
    }

    /// `out[rows, self.rows] = x[rows, cols] * self^T`; `half` is scratch
    /// for the activations converted to the weights' half type.
    pub(super) fn apply(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        rows: usize,
        half: &mut CudaSlice<u16>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        match self {
            Self::F32 { w, rows: n, cols } => ops::gemm_f32(gpu, x, w, rows, *cols, *n, out)?,
            Self::Half {
                w,
                dtype,
                rows: n,
                cols,
            } => {
                ops::f32_to_half(gpu, x, rows * cols, *dtype, half)?;
                ops::gemm_half(gpu, half, w, *dtype, rows, *cols, *n, out)?;
            }
        }
        Ok(())
    }
}

/// Host f32 values of a dense matrix.
fn dense_values(m: &Matrix) -> Result<Vec<f32>> {
    match m {
        Matrix::Dense(t) => t
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| ModelError::Compute {
                detail: e.to_string(),
            }),
        // A block format the device kernels do not decode (the K-quants,
        // Q4_0, Q5_x, F16/BF16 blocks): dequantized on the host by the CPU
        // kernels, once, at load.
        Matrix::Quant(q) => {
            let mut v = vec![0f32; q.rows() * q.cols()];
            for (r, row) in v.chunks_exact_mut(q.cols()).enumerate() {
                q.dequantize_row(r, row);
            }
            Ok(v)
        }
    }
}

/// `parts` stacked by rows on the device: f32 if every part is dense and
/// `dense` is f32; else `dense` (f16 when that is f32), GGUF blocks
/// dequantized on the device and dense parts converted there.
pub(super) fn upload_stacked(
    gpu: &Gpu,
    parts: &[&Matrix],
    dense: WeightDtype,
) -> Result<DevMatrix> {
    let cols = parts.first().map_or(0, |m| m.shape().1);
    let rows: usize = parts.iter().map(|m| m.shape().0).sum();
    if parts.iter().any(|m| m.shape().1 != cols) {
        return Err(ModelError::Compute {
            detail: "stacked matrices of different widths".into(),
        });
    }
    if dense == WeightDtype::F32 && parts.iter().all(|m| matches!(m, Matrix::Dense(_))) {
        let mut all = Vec::with_capacity(rows * cols);
        for m in parts {
            all.extend(dense_values(m)?);
        }
        return Ok(DevMatrix::F32 {
            w: gpu.upload(&all)?,
            rows,
            cols,
        });
    }
    let half = match dense {
        WeightDtype::F32 => WeightDtype::F16,
        d => d,
    };
    let mut w = gpu.zeros::<u16>(rows * cols)?;
    let mut at = 0;
    for m in parts {
        let n = m.shape().0 * cols;
        let part = match m {
            Matrix::Quant(q) if ops::device_format_code(q.format()).is_some() => {
                let blocks = gpu.upload(q.bytes())?;
                let mut h = gpu.zeros::<u16>(n)?;
                ops::dequantize(gpu, &blocks, q.format(), n / 32, half, &mut h)?;
                h
            }
            _ => {
                let f = gpu.upload(&dense_values(m)?)?;
                let mut h = gpu.zeros::<u16>(n)?;
                ops::f32_to_half(gpu, &f, n, half, &mut h)?;
                h
            }
        };
        let mut dst = w.slice_mut(at..at + n);
        gpu.stream()
            .memcpy_dtod(&part, &mut dst)
            .map_err(|e| CudaError::call("cuMemcpyDtoDAsync", e))?;
        at += n;
    }
    Ok(DevMatrix::Half {
        w,
        dtype: half,
        rows,
        cols,
    })
}

pub(super) fn upload_vec(gpu: &Gpu, v: &[f32]) -> Result<CudaSlice<f32>> {
    Ok(gpu.upload(v)?)
}

pub(super) struct DevLayer {
    pub(super) attn_norm: CudaSlice<f32>,
    pub(super) wq: DevMatrix,
    pub(super) wk: DevMatrix,
    pub(super) wv: DevMatrix,
    pub(super) bq: Option<CudaSlice<f32>>,
    pub(super) bk: Option<CudaSlice<f32>>,
    pub(super) bv: Option<CudaSlice<f32>>,
    pub(super) wo: DevMatrix,
    pub(super) mlp_norm: CudaSlice<f32>,
    pub(super) gate_up: DevMatrix,
    pub(super) down: DevMatrix,
}
