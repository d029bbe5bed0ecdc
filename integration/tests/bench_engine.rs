//! `kvmesh bench-engine` on a shape whose weights are drawn at random
//! (`--random-weights`, what the GPU script runs on the Llama-3-8B shape),
//! and the flags it refuses rather than ignore.

use kvmesh_integration::{run_kvmesh, texts, tiny_model_dir};
use serde_json::Value;

/// A directory with the tiny model's config and tokenizer and no weights.
fn shape_only() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ] {
        std::fs::copy(tiny_model_dir().join(f), dir.path().join(f)).expect("copy");
    }
    dir
}

/// `bench-engine --json` on the tiny model's shape with random weights
/// (seed 3) and `activations`, a 32-token prompt and batches 1 and 2 of
/// two tokens, once: its JSON object.
fn bench_random(activations: &str) -> Value {
    let dir = shape_only();
    let d = dir.path().to_str().expect("utf-8");
    let args = [
        "bench-engine",
        "--model",
        d,
        "--random-weights",
        "3",
        "--prompt-tokens",
        "32",
        "--batch",
        "1,2",
        "--decode-tokens",
        "2",
        "--repeats",
        "1",
        "--activations",
        activations,
        "--json",
    ];
    let out = run_kvmesh(&args, &[]);
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "{stderr}");
    serde_json::from_str(stdout.trim()).expect("one JSON object")
}

#[test]
fn random_weights_of_a_shape_are_benchmarked() {
    let v = bench_random("f32");
    assert_eq!(v["prefill_tokens"], 32);
    assert!(
        v["prefill_tokens_per_s"].as_f64().is_some_and(|r| r > 0.0),
        "{v}"
    );
    let batches: Vec<u64> = v["decode"]
        .as_array()
        .expect("decode")
        .iter()
        .map(|d| d["batch"].as_u64().expect("batch"))
        .collect();
    assert_eq!(batches, [1, 2]);
    assert!(v["device"].is_null(), "no device section on the CPU: {v}");
    // The matrices a step streams (the tiny model's 195,008 parameters
    // less its norms and the embedding, read by rows), as f32.
    assert_eq!(
        v["roofline"]["weight_bytes"].as_u64(),
        Some(4 * (195_008 - (3 * 2 * 64 + 64) - 512 * 64)),
        "{v}"
    );
    // The int8 dot-product ceiling is measured only for the class that
    // multiplies in integers (int8, the default; f32 here).
    assert!(v["roofline"]["int8_peak_gops"].is_null(), "{v}");
    assert!(v["roofline"]["int8_cached_gops"].is_null(), "{v}");
    // The share of the CPU the hypervisor took meanwhile (Linux's steal
    // time; 0 on a machine of its own).
    if cfg!(target_os = "linux") {
        let steal = v["steal_share"].as_f64().expect("a steal share on Linux");
        assert!((0.0..=1.0).contains(&steal), "{v}");
    }
}

/// The 8-bit-activation class reports its two ceilings, measured: the dot
/// product's peak and its own matmul on operands in cache (no value is
/// asserted: these machines are shared).
#[test]
fn the_int8_class_reports_its_peak_and_its_matmul_in_cache() {
    let v = bench_random("int8");
    assert_eq!(v["activations"], "int8", "{v}");
    let rf = &v["roofline"];
    let peak = rf["int8_peak_gops"].as_f64().expect("a peak");
    let cached = rf["int8_cached_gops"]
        .as_f64()
        .expect("the matmul in cache");
    assert!(peak > 0.0 && cached > 0.0, "{v}");
}

#[test]
fn flags_that_cannot_apply_are_refused() {
    let dir = shape_only();
    let d = dir.path().to_str().expect("utf-8");
    let base = [
        "bench-engine",
        "--prompt-tokens",
        "8",
        "--batch",
        "1",
        "--decode-tokens",
        "1",
        "--repeats",
        "1",
    ];
    for (extra, want) in [
        (
            &[
                "--model",
                d,
                "--random-weights",
                "1",
                "--device-weights",
                "bf16",
            ][..],
            "applies to a CUDA device only",
        ),
        (
            &["--model", d, "--random-weights", "1", "--exact"][..],
            "--exact adds nothing",
        ),
        (
            &["--random-weights", "1"][..],
            "--random-weights needs --model DIR",
        ),
    ] {
        let out = run_kvmesh(&[&base[..], extra].concat(), &[]);
        let (_, stderr) = texts(&out);
        assert!(!out.status.success(), "{extra:?} ran");
        assert!(stderr.contains(want), "{extra:?}: {stderr}");
    }
}
