//! Where the CUDA libraries come from, and loading them.
//!
//! cudarc opens libcuda, libnvrtc and libcublas by name on first use (and
//! panics if it cannot): every path into it goes through this module first,
//! which finds the library, loads it by its full path (so cudarc's later
//! load by name finds the same, already loaded, library), and turns a
//! missing one into a typed [`CudaError`].
//!
//! Search order for NVRTC and cuBLAS (the driver's libcuda always comes from
//! the loader's own path, where the NVIDIA driver installs it):
//! 1. `KVMESH_CUDA_LIB_DIR` (a `:`-separated list);
//! 2. the `nvidia/cu13/lib` folder of pip's NVIDIA wheels
//!    (`nvidia-cuda-nvrtc`, `nvidia-cublas`) in the active virtual
//!    environment, kvmesh's own `~/.cache/kvmesh/cuda-venv` (what
//!    `scripts/test.sh` installs), and the usual Python prefixes;
//! 3. `/usr/local/cuda/lib64` (a CUDA toolkit);
//! 4. the loader's path (`LD_LIBRARY_PATH`, `ldconfig`).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::error::{CudaError, Result};

/// NVRTC's file name for the CUDA 13 generation.
pub const NVRTC: &str = "libnvrtc.so.13";
/// cuBLAS's.
pub const CUBLAS: &str = "libcublas.so.13";
/// cuBLASLt's (cuBLAS needs it).
pub const CUBLAS_LT: &str = "libcublasLt.so.13";

/// The folders searched, in order (those that exist).
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(list) = std::env::var_os("KVMESH_CUDA_LIB_DIR") {
        dirs.extend(std::env::split_paths(&list));
    }
    let mut prefixes: Vec<PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        prefixes.push(v.into());
    }
    if let Some(home) = std::env::var_os("KVMESH_HOME") {
        prefixes.push(Path::new(&home).join("cuda-venv"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        prefixes.push(Path::new(&home).join(".cache/kvmesh/cuda-venv"));
        prefixes.push(Path::new(&home).join(".local"));
    }
    for p in ["/opt/torch/.venv", "/usr/local", "/usr"] {
        prefixes.push(p.into());
    }
    for prefix in prefixes {
        let lib = prefix.join("lib");
        let Ok(entries) = std::fs::read_dir(&lib) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pythons.sort();
        for py in pythons {
            for site in ["site-packages", "dist-packages"] {
                dirs.push(py.join(site).join("nvidia/cu13/lib"));
            }
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    dirs.retain(|d| d.is_dir());
    dirs.dedup();
    dirs
}

/// The first searched folder holding `file`.
pub fn find(file: &str) -> Option<PathBuf> {
    search_dirs()
        .into_iter()
        .map(|d| d.join(file))
        .find(|p| p.is_file())
}

/// Load a library by full path for the rest of the process (`RTLD_GLOBAL`,
/// never closed), so a later `dlopen` of its name returns it.
fn preload(path: &Path) -> Result<()> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading a vendor library runs its initialisers; these are
    // NVIDIA's, which cudarc would load anyway.
    let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| CudaError::call("dlopen", e))?;
    std::mem::forget(lib);
    Ok(())
}

fn searched() -> String {
    let mut s: Vec<String> = search_dirs()
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    s.push("the loader's path".into());
    s.join(", ")
}

/// Make NVRTC loadable: preloaded from the search folders (with the
/// builtins library it opens itself), or already on the loader's path.
pub fn nvrtc() -> Result<()> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    let r = DONE.get_or_init(|| {
        if let Some(path) = find(NVRTC) {
            // NVRTC opens `libnvrtc-builtins.so.13.N` itself, by name:
            // loaded first, from the same folder, it is found.
            if let Some(dir) = path.parent() {
                if let Ok(entries) = std::fs::read_dir(dir) {
                    for e in entries.flatten() {
                        let n = e.file_name().to_string_lossy().into_owned();
                        if n.starts_with("libnvrtc-builtins.so.13") {
                            preload(&e.path()).map_err(|e| e.to_string())?;
                        }
                    }
                }
            }
            preload(&path).map_err(|e| e.to_string())?;
        }
        // SAFETY: probing loads the library by name and drops it.
        if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            Ok(())
        } else {
            Err(searched())
        }
    });
    r.clone().map_err(|searched| CudaError::MissingLibrary {
        library: NVRTC,
        searched,
        package: "nvidia-cuda-nvrtc",
    })
}

/// Make cuBLAS loadable (and cuBLASLt, which it needs).
pub fn cublas() -> Result<()> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    let r = DONE.get_or_init(|| {
        if let Some(lt) = find(CUBLAS_LT) {
            preload(&lt).map_err(|e| e.to_string())?;
        }
        if let Some(path) = find(CUBLAS) {
            preload(&path).map_err(|e| e.to_string())?;
        }
        // SAFETY: as above.
        if unsafe { cudarc::cublas::sys::is_culib_present() } {
            Ok(())
        } else {
            Err(searched())
        }
    });
    r.clone().map_err(|searched| CudaError::MissingLibrary {
        library: CUBLAS,
        searched,
        package: "nvidia-cublas",
    })
}

/// Whether the NVIDIA driver's library can be loaded (a GPU machine).
pub fn driver_present() -> bool {
    // SAFETY: probing loads the library by name and drops it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// NVRTC's CUDA version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(u32, u32)> {
    nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters; the library is loaded (above).
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::call("nvrtcVersion", r));
    }
    Ok((major.max(0) as u32, minor.max(0) as u32))
}

/// The architectures this NVRTC can compile CUBIN for (`90` = sm_90).
pub fn nvrtc_archs() -> Result<Vec<u32>> {
    nvrtc()?;
    let mut n = 0;
    // SAFETY: out-parameter; the library is loaded.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcGetNumSupportedArchs(&mut n) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::call("nvrtcGetNumSupportedArchs", r));
    }
    let mut archs = vec![0i32; n.max(0) as usize];
    // SAFETY: `archs` holds the count NVRTC gave.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::call("nvrtcGetSupportedArchs", r));
    }
    Ok(archs.into_iter().map(|a| a.max(0) as u32).collect())
}
