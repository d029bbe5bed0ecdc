//! A CUDA device opened for use: context, one compute stream, every kernel
//! module loaded, and a cuBLAS handle on the same stream.
//!
//! Opening checks, in order, and fails with a typed error at the first
//! that is missing: the driver library, the device ordinal, NVRTC, a code
//! target this driver loads ([`crate::compile::choose`]), every program
//! compiled (or found in the cache) and every kernel found. cuBLAS is
//! loaded too; a machine without it can still run the quantized path and
//! every kernel test, and a dense GEMM there says which package is missing.
//!
//! Everything runs on the one stream, in order: page events, KV writes and
//! the reads after them cannot overtake each other.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
};

use crate::compile::{self, Target, Versions};
use crate::device::DeviceSpec;
use crate::error::{CudaError, Result};
use crate::source::PROGRAMS;
use crate::toolkit;

/// What was opened, for logs, `/metrics` labels and the benchmark tables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// `cuda:N`.
    pub spec: DeviceSpec,
    /// The device's name (`NVIDIA H200`).
    pub name: String,
    /// Architecture, `10 * major + minor`.
    pub arch: u32,
    /// The driver's CUDA version.
    pub driver: (u32, u32),
    /// NVRTC's CUDA version.
    pub nvrtc: (u32, u32),
    /// What the kernels were compiled to.
    pub target: Target,
    /// Device memory in bytes.
    pub memory: usize,
}

/// An opened device.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
    blas: Option<cudarc::cublas::CudaBlas>,
    info: DeviceInfo,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

fn driver_version() -> Result<(u32, u32)> {
    let mut v = 0;
    // SAFETY: out-parameter; the driver library is loaded (checked first).
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(CudaError::call("cuDriverGetVersion", r));
    }
    Ok(((v / 1000) as u32, ((v % 1000) / 10) as u32))
}

impl Gpu {
    /// Open `spec` (a CUDA device). See the module docs for what is checked.
    pub fn open(spec: DeviceSpec) -> Result<Arc<Self>> {
        let DeviceSpec::Cuda(ordinal) = spec else {
            return Err(CudaError::BadArgument {
                op: "Gpu::open",
                detail: "the cpu device has no GPU to open".into(),
            });
        };
        if !toolkit::driver_present() {
            return Err(CudaError::NoDriver {
                asked: spec.to_string(),
            });
        }
        cudarc::driver::result::init().map_err(|e| CudaError::call("cuInit", e))?;
        let count =
            CudaContext::device_count().map_err(|e| CudaError::call("cuDeviceGetCount", e))?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaError::NoDevice {
                ordinal,
                count: count.max(0) as usize,
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::call("cuCtxCreate", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| CudaError::call("cuDeviceGetAttribute", e))?;
        let arch = (major.max(0) * 10 + minor.max(0)) as u32;
        let name = ctx
            .name()
            .map_err(|e| CudaError::call("cuDeviceGetName", e))?;
        let memory = ctx
            .total_mem()
            .map_err(|e| CudaError::call("cuDeviceTotalMem", e))?;
        let versions = Versions {
            driver: driver_version()?,
            nvrtc: toolkit::nvrtc_version()?,
            device_arch: arch,
            nvrtc_archs: toolkit::nvrtc_archs()?,
        };
        let target = compile::choose(&versions).map_err(|reason| CudaError::NoTarget {
            device: format!("{name} (sm_{arch})"),
            reason,
        })?;
        let stream = ctx
            .new_stream()
            .map_err(|e| CudaError::call("cuStreamCreate", e))?;
        let cache = compile::cache_dir();
        let mut functions = HashMap::new();
        for p in PROGRAMS {
            let c = compile::compile_cached(p, target, &cache)?;
            let image = match target.kind {
                compile::CodeKind::Ptx => {
                    cudarc::nvrtc::Ptx::from_src(String::from_utf8_lossy(&c.image).into_owned())
                }
                compile::CodeKind::Cubin => cudarc::nvrtc::Ptx::from_binary(c.image),
            };
            let module = ctx
                .load_module(image)
                .map_err(|e| CudaError::call("cuModuleLoadData", e))?;
            for k in p.kernels {
                let f = module
                    .load_function(k)
                    .map_err(|e| CudaError::call("cuModuleGetFunction", format!("{k}: {e:?}")))?;
                functions.insert(*k, f);
            }
        }
        let blas = match toolkit::cublas() {
            Ok(()) => Some(
                cudarc::cublas::CudaBlas::new(stream.clone())
                    .map_err(|e| CudaError::call("cublasCreate", e))?,
            ),
            Err(e) => {
                tracing::warn!(error = %e, "cuBLAS not loaded: dense GEMMs will refuse to run");
                None
            }
        };
        let info = DeviceInfo {
            spec,
            name,
            arch,
            driver: versions.driver,
            nvrtc: versions.nvrtc,
            target,
            memory,
        };
        tracing::info!(device = %spec, name = %info.name, arch, target = %target, "CUDA device opened");
        Ok(Arc::new(Self {
            ctx,
            stream,
            functions,
            blas,
            info,
        }))
    }

    /// What was opened.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The compute stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A loaded kernel.
    pub fn function(&self, name: &'static str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| CudaError::BadArgument {
                op: "function",
                detail: format!("no kernel {name}"),
            })
    }

    /// cuBLAS, or the error saying it is missing.
    pub fn blas(&self) -> Result<&cudarc::cublas::CudaBlas> {
        self.blas.as_ref().ok_or(CudaError::MissingLibrary {
            library: toolkit::CUBLAS,
            searched: "see the log at start".into(),
            package: "nvidia-cublas",
        })
    }

    /// A copy of `host` on the device.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        self.stream
            .clone_htod(host)
            .map_err(|e| CudaError::call("cuMemcpyHtoD", e))
    }

    /// `n` zeroed values on the device.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros(n.max(1))
            .map_err(|e| CudaError::call("cuMemAlloc", e))
    }

    /// A copy of `d` on the host (waits for the stream).
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        d: &impl DevicePtr<T>,
    ) -> Result<Vec<T>> {
        self.stream
            .clone_dtoh(d)
            .map_err(|e| CudaError::call("cuMemcpyDtoH", e))
    }

    /// Copy `host` into the start of `d`.
    pub fn write<T: DeviceRepr>(&self, host: &[T], d: &mut CudaSlice<T>) -> Result<()> {
        if host.is_empty() {
            return Ok(());
        }
        let mut view = d.slice_mut(..host.len());
        self.stream
            .memcpy_htod(host, &mut view)
            .map_err(|e| CudaError::call("cuMemcpyHtoD", e))
    }

    /// Device memory bandwidth as a copy measures it: bytes read plus
    /// bytes written per second (GB/s), copying one `bytes` buffer into
    /// another (filled first, not zeros), best of 5 timings of 10 copies
    /// each after a warm-up. The ceiling the benchmarks put the decode
    /// step's weight streaming against; costs `2 * bytes` of device memory
    /// while it runs.
    pub fn copy_gbps(&self, bytes: usize) -> Result<f64> {
        let n = (bytes / 4).max(1);
        let fill: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let src = self.upload(&fill)?;
        let mut dst = self.zeros::<u32>(n)?;
        let copy = |dst: &mut CudaSlice<u32>| {
            self.stream
                .memcpy_dtod(&src, dst)
                .map_err(|e| CudaError::call("cuMemcpyDtoDAsync", e))
        };
        copy(&mut dst)?;
        self.sync()?;
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t = std::time::Instant::now();
            for _ in 0..10 {
                copy(&mut dst)?;
            }
            self.sync()?;
            best = best.min(t.elapsed().as_secs_f64() / 10.0);
        }
        Ok(2.0 * (n * 4) as f64 / best / 1e9)
    }

    /// Wait for everything queued so far.
    pub fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| CudaError::call("cuStreamSynchronize", e))
    }
}
