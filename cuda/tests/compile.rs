//! Every kernel compiles with the pinned NVRTC, to PTX for compute_90 and
//! to a CUBIN for sm_90 (H100/H200), with no error, no warning that NVRTC
//! calls an error, and no register spill; ptxas's per-kernel resources
//! are printed (`cargo test -p kvmesh-cuda --test compile -- --nocapture`).
//!
//! Runs wherever libnvrtc is found ([`kvmesh_cuda::toolkit::search_dirs`]:
//! `scripts/test.sh` pip-installs the pinned `nvidia-cuda-nvrtc` wheel into
//! `~/.cache/kvmesh/cuda-venv`). Without it the test prints "not run: no
//! NVRTC" and passes, unless `KVMESH_REQUIRE_NVRTC=1` (set by
//! `scripts/test.sh`, so CI cannot pass it by not having the compiler).

use kvmesh_cuda::compile::{self, CodeKind, Target};
use kvmesh_cuda::source::PROGRAMS;
use kvmesh_cuda::toolkit;

fn nvrtc_or_skip() -> bool {
    match toolkit::nvrtc() {
        Ok(()) => true,
        Err(e) => {
            assert!(
                std::env::var("KVMESH_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "KVMESH_REQUIRE_NVRTC=1 and NVRTC is missing: {e}"
            );
            eprintln!("not run: no NVRTC ({e})");
            false
        }
    }
}

#[test]
fn every_kernel_compiles_to_ptx_and_sm90_cubin_without_spills() {
    if !nvrtc_or_skip() {
        return;
    }
    let version = toolkit::nvrtc_version().expect("nvrtc version");
    let archs = toolkit::nvrtc_archs().expect("nvrtc archs");
    assert!(
        archs.contains(&90),
        "NVRTC {version:?} does not know sm_90: {archs:?}"
    );
    println!("NVRTC {}.{}", version.0, version.1);
    println!(
        "{:<16} {:<28} {:>5} {:>6} {:>7} {:>7} {:>6}",
        "program", "kernel", "regs", "stack", "spill-s", "spill-l", "smem"
    );
    let mut kernels_seen = 0;
    for p in PROGRAMS {
        let ptx = compile::compile(
            p,
            Target {
                kind: CodeKind::Ptx,
                arch: 90,
            },
            false,
        )
        .unwrap_or_else(|e| panic!("{} to PTX: {e}", p.name));
        let text = String::from_utf8(ptx.image.clone()).expect("PTX is text");
        assert!(
            text.contains(".target sm_90"),
            "{}: PTX for another target",
            p.name
        );
        for k in p.kernels {
            assert!(
                text.contains(&format!(".entry {k}(")),
                "{}: no entry {k} in the PTX",
                p.name
            );
        }
        let cubin = compile::compile(
            p,
            Target {
                kind: CodeKind::Cubin,
                arch: 90,
            },
            true,
        )
        .unwrap_or_else(|e| panic!("{} to sm_90 CUBIN: {e}", p.name));
        assert_eq!(
            &cubin.image[..4],
            b"\x7fELF",
            "{}: a CUBIN is an ELF image",
            p.name
        );
        let res = cubin.resources();
        for k in p.kernels {
            let r = res.iter().find(|r| r.name == *k).unwrap_or_else(|| {
                panic!("{}: ptxas reported nothing for {k}:\n{}", p.name, cubin.log)
            });
            println!(
                "{:<16} {:<28} {:>5} {:>6} {:>7} {:>7} {:>6}",
                p.name, k, r.registers, r.stack, r.spill_stores, r.spill_loads, r.shared
            );
            assert!(r.registers > 0, "{k}: no register count in\n{}", cubin.log);
            assert_eq!(
                (r.spill_stores, r.spill_loads),
                (0, 0),
                "{k} spills registers:\n{}",
                cubin.log
            );
            kernels_seen += 1;
        }
    }
    assert_eq!(
        kernels_seen,
        PROGRAMS.iter().map(|p| p.kernels.len()).sum::<usize>()
    );
}

#[test]
fn the_cache_returns_what_was_compiled_and_names_it_by_content() {
    if !nvrtc_or_skip() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("kvmesh-cuda-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let p = &PROGRAMS[0];
    let t = Target {
        kind: CodeKind::Cubin,
        arch: 90,
    };
    let first = compile::compile_cached(p, t, &dir).expect("compile");
    assert!(!first.cached);
    let second = compile::compile_cached(p, t, &dir).expect("cached");
    assert!(second.cached, "the second compile comes from the cache");
    assert_eq!(first.image, second.image);
    // Another target is another file.
    let ptx = compile::compile_cached(
        p,
        Target {
            kind: CodeKind::Ptx,
            arch: 90,
        },
        &dir,
    )
    .expect("ptx");
    assert!(!ptx.cached);
    assert_eq!(std::fs::read_dir(&dir).expect("dir").count(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}
