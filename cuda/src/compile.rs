//! NVRTC: every program compiled to PTX or CUBIN, the choice between the
//! two, the compiler's resource report, and the on-disk cache.
//!
//! # PTX or CUBIN
//! A driver JIT-compiles PTX only of a PTX ISA version it knows: NVRTC 13.5
//! emits `.version 9.5`, which a CUDA 13.0 driver refuses. A CUBIN is
//! machine code for one architecture and loads on any driver of the same
//! major version (CUDA's minor-version compatibility). So ([`choose`]):
//! 1. NVRTC's major version is not above the driver's, and NVRTC knows the
//!    device's architecture: CUBIN for it (no JIT at start, the same code
//!    on every start);
//! 2. else, NVRTC is not newer than the driver: PTX for the newest
//!    architecture NVRTC knows at or below the device's, which the driver
//!    compiles (a device newer than this NVRTC);
//! 3. else nothing loads, and the error says which versions to pin.
//!
//! # Cache
//! A compiled module is kept under `KVMESH_CUDA_CACHE` (default
//! `~/.cache/kvmesh/cuda`), named by the SHA-256 of everything that makes it:
//! the source, the options, NVRTC's version and the target. A changed
//! kernel or compiler is a new name, never a stale module; a file is
//! written under a temporary name and renamed, so a reader never sees half.

use std::ffi::{CStr, CString};
use std::fmt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{CudaError, Result};
use crate::source::Program;
use crate::toolkit;

/// What NVRTC produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CodeKind {
    /// Virtual-architecture assembly, compiled by the driver at load.
    Ptx,
    /// Machine code for one architecture.
    Cubin,
}

/// A compilation target: PTX for `compute_XY`, or CUBIN for `sm_XY`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    /// PTX or CUBIN.
    pub kind: CodeKind,
    /// Architecture as `10 * major + minor` (H100/H200: 90).
    pub arch: u32,
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            CodeKind::Ptx => write!(f, "PTX compute_{}", self.arch),
            CodeKind::Cubin => write!(f, "CUBIN sm_{}", self.arch),
        }
    }
}

impl Target {
    /// NVRTC's architecture option for this target.
    pub fn arch_option(&self) -> String {
        match self.kind {
            CodeKind::Ptx => format!("--gpu-architecture=compute_{}", self.arch),
            CodeKind::Cubin => format!("--gpu-architecture=sm_{}", self.arch),
        }
    }
}

/// What [`choose`] decides from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Versions {
    /// The CUDA version the driver supports, `(major, minor)` (driver 580:
    /// 13.0).
    pub driver: (u32, u32),
    /// NVRTC's CUDA version.
    pub nvrtc: (u32, u32),
    /// The device's architecture (`10 * major + minor`).
    pub device_arch: u32,
    /// The architectures NVRTC can compile CUBIN for.
    pub nvrtc_archs: Vec<u32>,
}

/// PTX or CUBIN for this driver, NVRTC and device (see the module docs).
pub fn choose(v: &Versions) -> std::result::Result<Target, String> {
    if v.nvrtc.0 <= v.driver.0 && v.nvrtc_archs.contains(&v.device_arch) {
        return Ok(Target {
            kind: CodeKind::Cubin,
            arch: v.device_arch,
        });
    }
    if v.nvrtc <= v.driver {
        if let Some(&arch) = v.nvrtc_archs.iter().filter(|&&a| a <= v.device_arch).max() {
            return Ok(Target {
                kind: CodeKind::Ptx,
                arch,
            });
        }
        return Err(format!(
            "NVRTC {}.{} knows no architecture at or below sm_{} (it knows {:?})",
            v.nvrtc.0, v.nvrtc.1, v.device_arch, v.nvrtc_archs
        ));
    }
    Err(format!(
        "NVRTC {}.{} is newer than the driver's CUDA {}.{}, and its PTX would be refused; \
         install the NVRTC of the driver's major version (pip nvidia-cuda-nvrtc=={}.{}.*)",
        v.nvrtc.0, v.nvrtc.1, v.driver.0, v.driver.1, v.driver.0, v.driver.1
    ))
}

/// Options every program is compiled with (besides the architecture):
/// C++17, no fast-math (`expf`, `sincosf` and division stay IEEE-accurate,
/// so the kernels agree with the CPU reference within rounding).
pub const OPTIONS: &[&str] = &["--std=c++17", "--fmad=true"];

/// One kernel's resources from ptxas (`--ptxas-options=-v`, CUBIN only).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    /// The kernel's name.
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of stack frame.
    pub stack: u32,
    /// Bytes of spill stores.
    pub spill_stores: u32,
    /// Bytes of spill loads.
    pub spill_loads: u32,
    /// Bytes of static shared memory.
    pub shared: u32,
}

/// Parse ptxas's verbose report out of an NVRTC log.
pub fn parse_resources(log: &str) -> Vec<KernelResources> {
    fn number_before(s: &str, unit: &str) -> Option<u32> {
        let at = s.find(unit)?;
        s[..at].split_whitespace().last()?.parse().ok()
    }
    let mut out: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            out.push(KernelResources {
                name: rest.trim().to_owned(),
                ..KernelResources::default()
            });
        } else if let Some(k) = out.last_mut() {
            if line.contains("stack frame") {
                k.stack = number_before(line, "bytes stack frame").unwrap_or(0);
                k.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
                k.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("Used ") && line.contains("registers") {
                k.registers = number_before(line, "registers").unwrap_or(0);
                k.shared = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

/// A compiled program.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The program's name.
    pub program: &'static str,
    /// What it was compiled for.
    pub target: Target,
    /// PTX text or CUBIN bytes.
    pub image: Vec<u8>,
    /// NVRTC's log (warnings; with `verbose`, ptxas's report).
    pub log: String,
    /// Whether it came from the on-disk cache.
    pub cached: bool,
}

impl Compiled {
    /// ptxas's per-kernel report (empty for PTX, or from the cache).
    pub fn resources(&self) -> Vec<KernelResources> {
        parse_resources(&self.log)
    }
}

struct Prog(cudarc::nvrtc::sys::nvrtcProgram);

impl Drop for Prog {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once.
        unsafe {
            cudarc::nvrtc::sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

fn check(call: &'static str, r: cudarc::nvrtc::sys::nvrtcResult) -> Result<()> {
    if r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::call(call, r))
    }
}

/// Compile `program` for `target` (no cache). `verbose` asks ptxas for its
/// resource report (CUBIN).
pub fn compile(program: &'static Program, target: Target, verbose: bool) -> Result<Compiled> {
    use cudarc::nvrtc::sys;
    toolkit::nvrtc()?;
    let src = CString::new(program.source()).map_err(|e| CudaError::BadArgument {
        op: "compile",
        detail: e.to_string(),
    })?;
    let name = CString::new(program.name).map_err(|e| CudaError::BadArgument {
        op: "compile",
        detail: e.to_string(),
    })?;
    let mut raw = std::ptr::null_mut();
    // SAFETY: valid C strings; no headers.
    check("nvrtcCreateProgram", unsafe {
        sys::nvrtcCreateProgram(
            &mut raw,
            src.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    })?;
    let prog = Prog(raw);
    let mut opts: Vec<CString> = OPTIONS
        .iter()
        .map(|o| CString::new(*o))
        .collect::<Result<_, _>>()
        .map_err(|e| CudaError::BadArgument {
            op: "compile",
            detail: e.to_string(),
        })?;
    opts.push(CString::new(target.arch_option()).unwrap_or_default());
    if verbose && target.kind == CodeKind::Cubin {
        opts.push(CString::new("--ptxas-options=-v").unwrap_or_default());
    }
    let ptrs: Vec<*const std::ffi::c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `ptrs` points into `opts`, alive for the call.
    let compiled = unsafe { sys::nvrtcCompileProgram(prog.0, ptrs.len() as i32, ptrs.as_ptr()) };
    let log = program_log(&prog)?;
    if compiled != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::Compile {
            program: program.name,
            target: target.to_string(),
            log,
        });
    }
    let image = match target.kind {
        CodeKind::Ptx => {
            let mut n = 0usize;
            // SAFETY: out-parameter.
            check("nvrtcGetPTXSize", unsafe {
                sys::nvrtcGetPTXSize(prog.0, &mut n)
            })?;
            let mut buf = vec![0u8; n];
            // SAFETY: `buf` has the size NVRTC gave.
            check("nvrtcGetPTX", unsafe {
                sys::nvrtcGetPTX(prog.0, buf.as_mut_ptr().cast())
            })?;
            // PTX is text: drop the terminating NUL.
            while buf.last() == Some(&0) {
                buf.pop();
            }
            buf
        }
        CodeKind::Cubin => {
            let mut n = 0usize;
            // SAFETY: out-parameter.
            check("nvrtcGetCUBINSize", unsafe {
                sys::nvrtcGetCUBINSize(prog.0, &mut n)
            })?;
            let mut buf = vec![0u8; n];
            // SAFETY: as above.
            check("nvrtcGetCUBIN", unsafe {
                sys::nvrtcGetCUBIN(prog.0, buf.as_mut_ptr().cast())
            })?;
            buf
        }
    };
    Ok(Compiled {
        program: program.name,
        target,
        image,
        log,
        cached: false,
    })
}

fn program_log(prog: &Prog) -> Result<String> {
    use cudarc::nvrtc::sys;
    let mut n = 0usize;
    // SAFETY: out-parameter.
    check("nvrtcGetProgramLogSize", unsafe {
        sys::nvrtcGetProgramLogSize(prog.0, &mut n)
    })?;
    let mut buf = vec![0u8; n.max(1)];
    // SAFETY: `buf` has the size NVRTC gave.
    check("nvrtcGetProgramLog", unsafe {
        sys::nvrtcGetProgramLog(prog.0, buf.as_mut_ptr().cast())
    })?;
    Ok(CStr::from_bytes_until_nul(&buf)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default())
}

/// The cache folder: `KVMESH_CUDA_CACHE`, else `~/.cache/kvmesh/cuda`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KVMESH_CUDA_CACHE") {
        return d.into();
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into());
    Path::new(&home).join(".cache/kvmesh/cuda")
}

/// The cache file of `program` for `target` under NVRTC `version`.
pub fn cache_path(dir: &Path, program: &Program, target: Target, version: (u32, u32)) -> PathBuf {
    let mut h = Sha256::new();
    h.update(program.source().as_bytes());
    for o in OPTIONS {
        h.update([0]);
        h.update(o.as_bytes());
    }
    h.update(
        format!(
            "\0nvrtc {}.{}\0{}",
            version.0,
            version.1,
            target.arch_option()
        )
        .as_bytes(),
    );
    let key: String = h
        .finalize()
        .iter()
        .take(12)
        .map(|b| format!("{b:02x}"))
        .collect();
    let stem = program.name.trim_end_matches(".cu");
    let ext = match target.kind {
        CodeKind::Ptx => "ptx",
        CodeKind::Cubin => "cubin",
    };
    dir.join(format!("{stem}-{key}.{ext}"))
}

/// [`compile`] through the on-disk cache in `dir`.
pub fn compile_cached(program: &'static Program, target: Target, dir: &Path) -> Result<Compiled> {
    let version = toolkit::nvrtc_version()?;
    let path = cache_path(dir, program, target, version);
    if let Ok(image) = std::fs::read(&path) {
        if !image.is_empty() {
            return Ok(Compiled {
                program: program.name,
                target,
                image,
                log: String::new(),
                cached: true,
            });
        }
    }
    let compiled = compile(program, target, false)?;
    let io = |source| CudaError::Cache {
        path: path.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, &compiled.image).map_err(io)?;
    std::fs::rename(&tmp, &path).map_err(io)?;
    Ok(compiled)
}

#[cfg(test)]
mod tests;
