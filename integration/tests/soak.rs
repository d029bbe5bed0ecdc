//! `kvmesh soak` for 60 s on the tiny model (CI has two cores): 8
//! concurrent streams of mixed prompts, client disconnects and injected
//! faults against a mesh the command starts itself. It must pass: every
//! completed output equal to the reference engine's, every failing fault a
//! clear error, no page left held once the mesh is idle.

use kvmesh_integration::{run_reported, tiny_model_dir};

/// The number after `label` on the summary line that starts with it.
fn figure(summary: &str, label: &str) -> f64 {
    summary
        .lines()
        .find_map(|l| {
            l.trim_start()
                .strip_prefix(label)
                .filter(|rest| rest.starts_with(' '))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or_else(|| panic!("no {label:?} line in the summary:\n{summary}"))
}

#[test]
fn soak_60s_tcp_with_faults_and_disconnects() {
    let model = tiny_model_dir().to_string_lossy().into_owned();
    let (stdout, v) = run_reported(&[
        "soak",
        "--model",
        &model,
        "--duration",
        "60",
        "--streams",
        "8",
        "--transport",
        "tcp",
    ]);
    for (label, want_positive) in [
        ("requests", true),
        ("completed", true),
        ("faults injected", true),
        ("disconnected", true),
        ("errors as expected", true),
        ("mismatches", false),
        ("unexpected errors", false),
        ("pages leaked", false),
        // The prefix cache is on (serve's default) and the prompts repeat:
        // outputs served from cached pages were among those checked.
        ("cached tokens", true),
    ] {
        let v = figure(&stdout, label);
        if want_positive {
            assert!(v > 0.0, "{label} is {v}:\n{stdout}");
        } else {
            assert_eq!(v, 0.0, "{label}:\n{stdout}");
        }
    }
    assert!(stdout.contains("result: PASS"), "{stdout}");

    assert_eq!(v["pass"], true, "{v}");
    assert_eq!(v["mismatches"].as_array().map(Vec::len), Some(0), "{v}");
    assert_eq!(v["pages_leaked"].as_f64(), Some(0.0), "{v}");
    assert_eq!(v["idle"], true, "{v}");
    assert!(v["rss_start_kib"].as_u64().unwrap_or(0) > 0, "{v}");
    // Both kinds of fault were drawn, and at least one of each kind of
    // node's pages were reported.
    let per_fault = v["per_fault"].as_object().expect("per_fault");
    assert!(per_fault.keys().any(|k| k.ends_with("=duplicate")), "{v}");
    assert!(per_fault.keys().any(|k| k.ends_with("=corrupt")), "{v}");
    let pages = v["pages"].as_object().expect("pages");
    assert!(
        pages.contains_key("decode-0") && pages.contains_key("prefill-0"),
        "{v}"
    );
}
