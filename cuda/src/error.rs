//! The CUDA layer's one error type.

use thiserror::Error;

/// Why a CUDA operation could not be done. Every variant says what to do
/// about it; none is a panic.
#[derive(Debug, Error)]
pub enum CudaError {
    /// `--device cuda` on a machine whose driver library cannot be loaded.
    #[error("CUDA was asked for ({asked}) but the NVIDIA driver library (libcuda.so.1) is not on this machine: run on a GPU machine, or use --device cpu")]
    NoDriver {
        /// The device asked for.
        asked: String,
    },
    /// The driver is there but has no such device.
    #[error("CUDA device {ordinal} was asked for but the driver reports {count} device(s): pick one of cuda:0..cuda:{count} (exclusive), or --device cpu")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver sees.
        count: usize,
    },
    /// A CUDA library the backend needs (NVRTC, cuBLAS) was not found.
    #[error("{library} was not found (looked in: {searched}); install the pip package {package}, or point KVMESH_CUDA_LIB_DIR at the folder that holds it")]
    MissingLibrary {
        /// The library's file name.
        library: &'static str,
        /// The folders looked in (and the loader's path).
        searched: String,
        /// The pip package that provides it.
        package: &'static str,
    },
    /// NVRTC refused a kernel source; the compiler's log says why.
    #[error("NVRTC could not compile {program} for {target}: {log}")]
    Compile {
        /// The program (one `.cu` file).
        program: &'static str,
        /// PTX or CUBIN and the architecture.
        target: String,
        /// The compiler's log.
        log: String,
    },
    /// No code object this NVRTC can make will load on this driver.
    #[error("no usable code for {device}: {reason}")]
    NoTarget {
        /// The device's name and architecture.
        device: String,
        /// Why neither PTX nor CUBIN works.
        reason: String,
    },
    /// The model cannot run on the CUDA backend (a shape its kernels do not
    /// take).
    #[error("the CUDA backend cannot run this model: {0}")]
    Unsupported(String),
    /// A call to the driver, NVRTC or cuBLAS failed.
    #[error("CUDA {call} failed: {detail}")]
    Call {
        /// What was called.
        call: &'static str,
        /// The library's error.
        detail: String,
    },
    /// The on-disk kernel cache could not be read or written.
    #[error("kernel cache {path}: {source}")]
    Cache {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A weight format the device kernels do not decode (they take Q4_1 and
    /// Q8_0; the CPU kernels take every format of `kvmesh_kernels::quant`).
    #[error("format {format} has no device {op} kernel (the device kernels take Q4_1 and Q8_0)")]
    NoDeviceKernel {
        /// The operation (`dequantize`, `qmatvec`).
        op: &'static str,
        /// The format's GGUF name.
        format: &'static str,
    },
    /// A host argument that the kernels cannot take (a caller bug, reported
    /// instead of launching on bad sizes).
    #[error("bad argument to {op}: {detail}")]
    BadArgument {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },
}

/// The CUDA layer's result.
pub type Result<T, E = CudaError> = std::result::Result<T, E>;

impl CudaError {
    /// A failed library call, with the library's own error text.
    pub fn call(call: &'static str, e: impl std::fmt::Debug) -> Self {
        Self::Call {
            call,
            detail: format!("{e:?}"),
        }
    }
}
