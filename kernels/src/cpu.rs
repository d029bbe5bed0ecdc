//! The crate-wide choice of CPU kernel path: chosen once per process, read
//! by every kernel.
//!
//! # Paths
//! - [`Path::Avx512`]: AVX-512 F/BW/VL/DQ (with the AVX2, FMA and F16C set).
//! - [`Path::Avx2`]: AVX2, FMA and F16C.
//! - [`Path::Portable`]: plain Rust (`f32::mul_add`), the reference the others
//!   are tested against.
//!
//! # Invariant
//! A path is a property of the process, not of a call: [`select`] fixes it
//! once (a second, different choice is an error), and [`path`] falls back
//! to [`detect`] when nothing was selected, so every kernel of one process
//! runs one path. Where the arithmetic of two paths is the same (quantized
//! matmul, SwiGLU, RMSNorm, f16 conversions: see each module) they agree to
//! the bit; attention's AVX2 and AVX-512 builds agree to the bit with each
//! other, and with the portable build within rounding (see
//! [`crate::attention`]).
//!
//! # Cost
//! [`path`] is one atomic load after the first call.

use std::sync::OnceLock;

use thiserror::Error;

/// What the user asked for (`--cpu-kernels`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CpuKernels {
    /// The best path this CPU runs ([`detect`]).
    #[default]
    Auto,
    /// Force AVX-512 (an error where the CPU lacks it).
    Avx512,
    /// Force AVX2 (an error where the CPU lacks it).
    Avx2,
    /// Force the portable reference.
    Portable,
}

impl CpuKernels {
    /// Every choice, in the order the error message lists them.
    pub const ALL: [CpuKernels; 4] = [Self::Auto, Self::Avx512, Self::Avx2, Self::Portable];

    /// The spelling [`std::str::FromStr`] accepts.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Avx512 => "avx512",
            Self::Avx2 => "avx2",
            Self::Portable => "portable",
        }
    }
}

impl std::fmt::Display for CpuKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CpuKernels {
    type Err = CpuKernelsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|c| c.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| CpuKernelsError::Unknown(s.to_owned()))
    }
}

/// The path that runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Path {
    /// Portable Rust; the reference.
    Portable,
    /// AVX2 + FMA + F16C (x86-64).
    Avx2,
    /// AVX-512 F/BW/VL/DQ on top of the AVX2 set (x86-64).
    Avx512,
}

impl Path {
    /// Name for logs, benchmark output and mesh reports.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
        }
    }

    /// Whether this CPU runs the path (feature detection; cached by the
    /// standard library).
    pub fn available(self) -> bool {
        match self {
            Self::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => {
                Self::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512dq")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx2 | Self::Avx512 => false,
        }
    }

    /// The best path this CPU runs (what [`path`] returns when nothing was
    /// selected). The same as the free function [`detect`].
    pub fn detect() -> Path {
        detect()
    }

    /// Which paths compute the same bits: nodes of one mesh must share
    /// this, so that a transfer carries the KV the decode node would have
    /// computed itself (the router pairs prefill and decode nodes only
    /// when it is equal). AVX2 and AVX-512 give the same bits in every
    /// kernel ("x86-fma"); the portable attention differs within rounding
    /// ("portable").
    pub const fn numerics(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2 | Self::Avx512 => "x86-fma",
        }
    }

    /// The features the path needs, for error messages.
    const fn features(self) -> &'static str {
        match self {
            Self::Portable => "nothing",
            Self::Avx2 => "avx2, fma, f16c",
            Self::Avx512 => "avx512f, avx512bw, avx512vl, avx512dq",
        }
    }
}

impl std::fmt::Display for Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a choice of path was refused.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum CpuKernelsError {
    /// Not one of the spellings.
    #[error("unknown CPU kernel path {0:?}: expected auto, avx512, avx2 or portable")]
    Unknown(String),
    /// The CPU lacks the forced path.
    #[error(
        "this CPU has no {} ({}): run with --cpu-kernels {} or auto",
        match .path { Path::Avx512 => "AVX-512", Path::Avx2 => "AVX2", Path::Portable => "portable" },
        .path.features(),
        .fallback
    )]
    Unavailable {
        /// The path asked for.
        path: Path,
        /// The best path this CPU has.
        fallback: Path,
    },
    /// Not one of the activation classes.
    #[error("unknown activation class {0:?}: expected f32 or int8")]
    UnknownActivations(String),
    /// Another activation class was already selected (or used).
    #[error(
        "activation class {current} already in use in this process; cannot switch to {requested}"
    )]
    ActivationsSelected {
        /// The class in use.
        current: Activations,
        /// The class asked for.
        requested: Activations,
    },
    /// Another path was already selected (or used) in this process.
    #[error(
        "CPU kernel path {current} already in use in this process; cannot switch to {requested}"
    )]
    AlreadySelected {
        /// The path in use.
        current: Path,
        /// The path asked for.
        requested: Path,
    },
}

/// The numerics class of the quantized matmuls (`--activations`): f32
/// activations against dequantized weights, or activations quantized to
/// 8 bits per 32 values and multiplied in integers (`quant`'s `i8`
/// module). A property of the process, as the path is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Activations {
    /// f32 activations (the weights' quantization is the only error
    /// against exact f32 weights).
    F32,
    /// 8-bit activations, integer dot products: the default, chosen by
    /// measurement (docs/models.md, "Why int8 is the default").
    #[default]
    Int8,
}

impl Activations {
    /// Every choice.
    pub const ALL: [Activations; 2] = [Self::F32, Self::Int8];

    /// The spelling [`std::str::FromStr`] accepts.
    pub const fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Int8 => "int8",
        }
    }
}

impl std::fmt::Display for Activations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Activations {
    type Err = CpuKernelsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|c| c.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| CpuKernelsError::UnknownActivations(s.to_owned()))
    }
}

/// The class every quantized matmul of this process computes in.
static ACTIVATIONS: OnceLock<Activations> = OnceLock::new();

/// Make `choice` this process's activation class: the same choice again
/// is a no-op, a different one an error (first use wins, as for
/// [`select`]).
pub fn select_activations(choice: Activations) -> Result<Activations, CpuKernelsError> {
    let current = *ACTIVATIONS.get_or_init(|| choice);
    if current == choice {
        Ok(current)
    } else {
        Err(CpuKernelsError::ActivationsSelected {
            current,
            requested: choice,
        })
    }
}

/// The selected activation class, or the default if none was.
#[inline]
pub fn activations() -> Activations {
    *ACTIVATIONS.get_or_init(Activations::default)
}

/// This process's numerics class, what nodes of one mesh must share (see
/// [`Path::numerics`]): the path's, with `-i8` for 8-bit activations
/// (every x86 path and integer dot product gives the same bits there too).
pub fn numerics() -> &'static str {
    match (path().numerics(), activations()) {
        (n, Activations::F32) => n,
        ("portable", Activations::Int8) => "portable-i8",
        (_, Activations::Int8) => "x86-i8",
    }
}

/// The best path this CPU runs.
pub fn detect() -> Path {
    [Path::Avx512, Path::Avx2]
        .into_iter()
        .find(|p| p.available())
        .unwrap_or(Path::Portable)
}

/// The path every kernel of this process runs.
static SELECTED: OnceLock<Path> = OnceLock::new();

/// Resolve `choice` against this CPU without selecting it.
pub fn resolve(choice: CpuKernels) -> Result<Path, CpuKernelsError> {
    let path = match choice {
        CpuKernels::Auto => return Ok(detect()),
        CpuKernels::Avx512 => Path::Avx512,
        CpuKernels::Avx2 => Path::Avx2,
        CpuKernels::Portable => Path::Portable,
    };
    if path.available() {
        Ok(path)
    } else {
        Err(CpuKernelsError::Unavailable {
            path,
            fallback: detect(),
        })
    }
}

/// Resolve `choice` and make it this process's path. Selecting the path
/// already in use is a no-op; a different one is an error (as is one the
/// CPU lacks). A kernel that ran before `select` fixed the path to
/// [`detect`]'s (first use wins), so call this at start.
pub fn select(choice: CpuKernels) -> Result<Path, CpuKernelsError> {
    let requested = resolve(choice)?;
    let current = *SELECTED.get_or_init(|| requested);
    if current == requested {
        Ok(current)
    } else {
        Err(CpuKernelsError::AlreadySelected { current, requested })
    }
}

/// The selected path, or [`detect`]'s if nothing was selected (which then
/// stays the path).
#[inline]
pub fn path() -> Path {
    *SELECTED.get_or_init(detect)
}

/// For tests of a forced path: `true` if this CPU runs `path`, else prints
/// `not run: no AVX-512 on this CPU` (or the path's name) and returns
/// `false`, so a skipped test says so instead of passing silently.
pub fn require(path: Path) -> bool {
    if path.available() {
        return true;
    }
    let what = match path {
        Path::Avx512 => "AVX-512",
        Path::Avx2 => "AVX2",
        Path::Portable => "portable",
    };
    eprintln!("not run: no {what} on this CPU");
    false
}

/// Every path this CPU runs, portable first.
pub fn available_paths() -> Vec<Path> {
    [Path::Portable, Path::Avx2, Path::Avx512]
        .into_iter()
        .filter(|p| p.available())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_round_trip_through_display_and_from_str() {
        for c in CpuKernels::ALL {
            assert_eq!(c.to_string().parse::<CpuKernels>(), Ok(c));
        }
        assert_eq!("AVX512".parse::<CpuKernels>(), Ok(CpuKernels::Avx512));
        let err = "sse"
            .parse::<CpuKernels>()
            .expect_err("not a path")
            .to_string();
        assert!(
            err.contains("\"sse\"") && err.contains("auto, avx512, avx2 or portable"),
            "{err}"
        );
        for p in [Path::Portable, Path::Avx2, Path::Avx512] {
            assert_eq!(p.to_string(), p.name());
        }
    }

    #[test]
    fn activation_classes_parse_and_name_their_numerics() {
        for a in Activations::ALL {
            assert_eq!(a.to_string().parse::<Activations>(), Ok(a));
        }
        assert_eq!(" INT8 ".parse::<Activations>(), Ok(Activations::Int8));
        assert_eq!(
            "int4"
                .parse::<Activations>()
                .expect_err("no such class")
                .to_string(),
            "unknown activation class \"int4\": expected f32 or int8"
        );
        // This test binary never selects a class: the default, int8, whose
        // numerics are the path's with `-i8`.
        assert_eq!(activations(), Activations::Int8);
        let want = if path() == Path::Portable {
            "portable-i8"
        } else {
            "x86-i8"
        };
        assert_eq!(numerics(), want);
        assert_eq!(
            select_activations(Activations::F32),
            Err(CpuKernelsError::ActivationsSelected {
                current: Activations::Int8,
                requested: Activations::F32
            })
        );
    }

    #[test]
    fn a_forced_path_the_cpu_lacks_is_refused() {
        for (choice, path) in [
            (CpuKernels::Avx512, Path::Avx512),
            (CpuKernels::Avx2, Path::Avx2),
        ] {
            match resolve(choice) {
                Ok(p) => assert!(p == path && path.available()),
                Err(e) => {
                    assert!(!path.available());
                    let msg = e.to_string();
                    assert!(msg.contains("this CPU has no"), "{msg}");
                    assert!(msg.contains("--cpu-kernels"), "{msg}");
                }
            }
        }
        let e = CpuKernelsError::Unavailable {
            path: Path::Avx512,
            fallback: Path::Avx2,
        };
        assert_eq!(
            e.to_string(),
            "this CPU has no AVX-512 (avx512f, avx512bw, avx512vl, avx512dq): \
             run with --cpu-kernels avx2 or auto"
        );
        assert_eq!(resolve(CpuKernels::Auto), Ok(detect()));
        assert_eq!(resolve(CpuKernels::Portable), Ok(Path::Portable));
    }

    /// The process-global selection: first use wins, the same choice again
    /// is fine, a different one is refused. (The test binary's other tests
    /// pass explicit paths, so fixing the global here changes none of them.)
    #[test]
    fn a_second_different_selection_is_refused() {
        let first = path();
        assert_eq!(first, detect());
        assert_eq!(select(CpuKernels::Auto), Ok(first));
        let other = if first == Path::Portable {
            None
        } else {
            Some(CpuKernels::Portable)
        };
        if let Some(other) = other {
            assert_eq!(
                select(other),
                Err(CpuKernelsError::AlreadySelected {
                    current: first,
                    requested: Path::Portable
                })
            );
        }
        assert_eq!(path(), first);
    }
}
