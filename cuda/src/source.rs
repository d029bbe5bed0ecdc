//! The kernels' CUDA C sources, embedded in the binary.
//!
//! Each program is one `.cu` file of `src/kernels/` with `common.cuh`
//! prepended (types, the f16/bf16 conversions, the violation record), so
//! NVRTC compiles it with no include path and no CUDA header: a machine
//! needs only libnvrtc to build every kernel.

/// One NVRTC program: a `.cu` file and the kernels it defines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Program {
    /// The file's name (`attention.cu`).
    pub name: &'static str,
    /// Its text, without the common prelude.
    pub body: &'static str,
    /// The `extern "C"` kernels it defines: all of them are looked up at
    /// load, so a kernel renamed in the source fails at start, not mid-run.
    pub kernels: &'static [&'static str],
}

/// Shared by every program.
pub const COMMON: &str = include_str!("kernels/common.cuh");

/// Every program, in the order the modules are loaded.
pub const PROGRAMS: &[Program] = &[
    Program {
        name: "elementwise.cu",
        body: include_str!("kernels/elementwise.cu"),
        kernels: &[
            "embedding",
            "rms_norm",
            "rope",
            "swiglu",
            "add_into",
            "add_bias",
            "f32_to_half",
            "gather_rows",
        ],
    },
    Program {
        name: "kv.cu",
        body: include_str!("kernels/kv.cu"),
        kernels: &["page_events", "kv_write"],
    },
    Program {
        name: "attention.cu",
        body: include_str!("kernels/attention.cu"),
        kernels: &["paged_attention", "paged_attention_unchecked"],
    },
    Program {
        name: "quant.cu",
        body: include_str!("kernels/quant.cu"),
        kernels: &["dequantize", "qmatvec"],
    },
    Program {
        name: "sample.cu",
        body: include_str!("kernels/sample.cu"),
        kernels: &["argmax_rows"],
    },
];

impl Program {
    /// The whole source NVRTC compiles: the prelude, then the file.
    pub fn source(&self) -> String {
        format!("{COMMON}\n#line 1 \"{}\"\n{}", self.name, self.body)
    }
}

/// The program that defines `kernel`, if any.
pub fn program_of(kernel: &str) -> Option<&'static Program> {
    PROGRAMS.iter().find(|p| p.kernels.contains(&kernel))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_kernel_is_defined_extern_c_in_its_file_and_named_once() {
        let mut seen = std::collections::HashSet::new();
        for p in PROGRAMS {
            for k in p.kernels {
                assert!(seen.insert(*k), "{k} listed twice");
                let defined = p.body.lines().any(|l| {
                    l.contains(&format!(" {k}(")) || l.trim_start().starts_with(&format!("{k}("))
                });
                assert!(defined, "{k} is not defined in {}", p.name);
            }
            // And no extern "C" kernel of the file is missing from the list.
            let mut lines = p.body.lines().peekable();
            while let Some(l) = lines.next() {
                if !l.starts_with("extern \"C\" __global__") {
                    continue;
                }
                // `__launch_bounds__(..)` is not the name; the name may
                // be on the next line.
                let mut decl = l.to_owned();
                if let Some(at) = decl.find("__launch_bounds__(") {
                    let close = decl[at..].find(')').map_or(decl.len(), |c| at + c + 1);
                    decl.replace_range(at..close, "");
                }
                if !decl.contains('(') {
                    decl = lines.next().unwrap_or_default().to_owned();
                }
                let name = decl
                    .split('(')
                    .next()
                    .and_then(|s| s.split_whitespace().last())
                    .unwrap_or_default()
                    .to_owned();
                assert!(
                    p.kernels.contains(&name.as_str()),
                    "{name} of {} is not listed",
                    p.name
                );
            }
        }
        assert_eq!(program_of("kv_write").map(|p| p.name), Some("kv.cu"));
        assert_eq!(program_of("nope"), None);
    }
}
