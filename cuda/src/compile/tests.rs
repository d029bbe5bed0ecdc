use super::*;
use crate::source::PROGRAMS;

fn v(driver: (u32, u32), nvrtc: (u32, u32), device_arch: u32, archs: &[u32]) -> Versions {
    Versions {
        driver,
        nvrtc,
        device_arch,
        nvrtc_archs: archs.to_vec(),
    }
}

const ARCHS_13: &[u32] = &[75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121];

#[test]
fn same_versions_give_cubin_for_the_device() {
    let t = choose(&v((13, 0), (13, 0), 90, ARCHS_13));
    assert_eq!(
        t,
        Ok(Target {
            kind: CodeKind::Cubin,
            arch: 90
        })
    );
}

#[test]
fn a_newer_minor_nvrtc_gives_cubin_never_ptx() {
    // The PTX version trap: NVRTC 13.5's PTX is refused by a 13.0 driver,
    // its CUBIN loads (minor-version compatibility).
    let t = choose(&v((13, 0), (13, 5), 90, ARCHS_13));
    assert_eq!(
        t,
        Ok(Target {
            kind: CodeKind::Cubin,
            arch: 90
        })
    );
}

#[test]
fn a_device_newer_than_nvrtc_gets_ptx_of_the_newest_arch_below_it() {
    let t = choose(&v((13, 2), (13, 0), 130, ARCHS_13));
    assert_eq!(
        t,
        Ok(Target {
            kind: CodeKind::Ptx,
            arch: 121
        })
    );
}

#[test]
fn a_newer_major_nvrtc_is_refused_naming_the_versions_to_pin() {
    let e = choose(&v((13, 0), (14, 0), 90, ARCHS_13)).expect_err("refused");
    assert!(
        e.contains("NVRTC 14.0 is newer than the driver's CUDA 13.0"),
        "{e}"
    );
    assert!(e.contains("nvidia-cuda-nvrtc==13.0.*"), "{e}");
}

#[test]
fn a_device_older_than_every_nvrtc_arch_is_refused() {
    let e = choose(&v((13, 0), (13, 0), 70, ARCHS_13)).expect_err("refused");
    assert!(e.contains("no architecture at or below sm_70"), "{e}");
}

#[test]
fn targets_print_and_give_nvrtc_options() {
    let c = Target {
        kind: CodeKind::Cubin,
        arch: 90,
    };
    let p = Target {
        kind: CodeKind::Ptx,
        arch: 90,
    };
    assert_eq!(c.to_string(), "CUBIN sm_90");
    assert_eq!(p.to_string(), "PTX compute_90");
    assert_eq!(c.arch_option(), "--gpu-architecture=sm_90");
    assert_eq!(p.arch_option(), "--gpu-architecture=compute_90");
}

#[test]
fn ptxas_report_is_parsed_per_kernel() {
    let log = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'rms_norm' for 'sm_90'
ptxas info    : Function properties for rms_norm
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 18 registers, used 1 barriers, 128 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'qmatvec' for 'sm_90'
ptxas info    : Function properties for qmatvec
    32 bytes stack frame, 28 bytes spill stores, 24 bytes spill loads
ptxas info    : Used 255 registers, 384 bytes cmem[0]
";
    let r = parse_resources(log);
    assert_eq!(
        r,
        vec![
            KernelResources {
                name: "rms_norm".into(),
                registers: 18,
                stack: 0,
                spill_stores: 0,
                spill_loads: 0,
                shared: 128,
            },
            KernelResources {
                name: "qmatvec".into(),
                registers: 255,
                stack: 32,
                spill_stores: 28,
                spill_loads: 24,
                shared: 0,
            },
        ]
    );
    assert!(parse_resources("").is_empty());
}

#[test]
fn the_cache_name_changes_with_source_target_and_compiler() {
    let dir = Path::new("/c");
    let (a, b) = (&PROGRAMS[0], &PROGRAMS[1]);
    let cubin = Target {
        kind: CodeKind::Cubin,
        arch: 90,
    };
    let ptx = Target {
        kind: CodeKind::Ptx,
        arch: 90,
    };
    let base = cache_path(dir, a, cubin, (13, 0));
    assert_eq!(base, cache_path(dir, a, cubin, (13, 0)), "deterministic");
    assert!(base.to_string_lossy().ends_with(".cubin"));
    assert!(base
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with("elementwise-")));
    for other in [
        cache_path(dir, b, cubin, (13, 0)),
        cache_path(dir, a, ptx, (13, 0)),
        cache_path(
            dir,
            a,
            Target {
                kind: CodeKind::Cubin,
                arch: 100,
            },
            (13, 0),
        ),
        cache_path(dir, a, cubin, (13, 1)),
    ] {
        assert_ne!(
            base.file_stem(),
            other.file_stem(),
            "{} vs {}",
            base.display(),
            other.display()
        );
    }
}
