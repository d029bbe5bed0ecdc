//! `kvmesh bench` end to end on the tiny model: closed and open loop, each
//! with `--reference --json`, checked on the report's structure and counts
//! (never its timings); and the gateway's `ignore_eos`, which the bench
//! relies on for exact output lengths.

use kvmesh_integration::http::post;
use kvmesh_integration::inproc::{InProcessMesh, Options};
use kvmesh_integration::{run_reported, tiny_model_dir};
use kvmesh_model::engine::{Engine, EngineConfig, FinishReason, Prompt};
use kvmesh_model::sampling::SamplingParams;
use serde_json::{json, Value};

/// Runs `kvmesh bench` on the tiny model with `args` plus `--reference
/// --json`, and returns the JSON report.
fn bench(args: &[&str]) -> Value {
    let model = tiny_model_dir().to_string_lossy().into_owned();
    let mut all = vec!["bench", "--model", &model, "--reference"];
    all.extend(args);
    let (stdout, report) = run_reported(&all);
    for row in [
        "completed",
        "TTFT p50 ms",
        "ITL p99 ms",
        "E2E p90 ms",
        "output tokens/s",
    ] {
        assert!(stdout.contains(row), "no {row:?} row:\n{stdout}");
    }
    assert!(stdout.contains("mesh/ref"), "{stdout}");
    report
}

/// The checks both loops share: every request completed on both targets,
/// with exactly the drawn prompt and output lengths, the same workload on
/// both, and every latency and ratio reported.
fn check(v: &Value, requests: usize) -> (Vec<u64>, Vec<u64>) {
    let mut per_target = Vec::new();
    for target in ["mesh", "reference"] {
        let t = &v[target];
        assert_eq!(t["requests"], requests, "{target}: {t}");
        assert_eq!(t["completed"], requests, "{target}: {t}");
        assert_eq!(t["failed"], 0, "{target}: {t}");
        assert_eq!(t["errors"], json!({}), "{target}");
        let rows = t["per_request"].as_array().expect("per_request");
        assert_eq!(rows.len(), requests);
        let drawn: u64 = rows
            .iter()
            .map(|r| r["output_len"].as_u64().expect("len"))
            .sum();
        assert_eq!(t["expected_output_tokens"], drawn, "{target}");
        assert_eq!(
            t["output_tokens"], drawn,
            "{target}: ignore_eos must give exactly the drawn lengths"
        );
        for r in rows {
            assert_eq!(r["output_tokens"], r["output_len"], "{target}: {r}");
            assert!(r["error"].is_null(), "{target}: {r}");
            assert!(r["ttft_ms"].is_number(), "{target}: {r}");
        }
        for key in ["ttft_ms", "itl_ms", "e2e_ms"] {
            for p in ["p50", "p90", "p99", "mean"] {
                assert!(t[key][p].is_number(), "{target} {key} {p}: {t}");
            }
        }
        assert!(t["output_tokens_per_s"].as_f64().is_some_and(|x| x > 0.0));
        per_target.push(
            rows.iter()
                .map(|r| {
                    (
                        r["prompt_tokens"].as_u64().expect("prompt"),
                        r["output_len"].as_u64().expect("len"),
                    )
                })
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(
        per_target[0], per_target[1],
        "the same workload on both targets"
    );
    // The gateway counted every prompt as drawn.
    assert_eq!(v["mesh"]["prompt_len_mismatches"], 0);
    for r in v["mesh"]["per_request"].as_array().expect("rows") {
        assert_eq!(r["server_prompt_tokens"], r["prompt_tokens"], "{r}");
    }
    for key in [
        "ttft_p50_ms",
        "itl_p99_ms",
        "e2e_p90_ms",
        "requests_s",
        "output_tokens_s",
    ] {
        assert!(v["ratios"][key].is_number(), "ratio {key}: {}", v["ratios"]);
    }
    per_target.swap_remove(0).into_iter().unzip()
}

#[test]
fn closed_loop_with_reference_reports_exact_counts() {
    let v = bench(&[
        "--concurrency",
        "2",
        "--requests",
        "6",
        "--warmup",
        "2",
        "--prompt-len",
        "uniform:4-40",
        "--output-len",
        "fixed:12",
        "--seed",
        "3",
    ]);
    assert_eq!(v["config"]["mode"], "closed");
    assert_eq!(v["config"]["concurrency"], 2);
    let (prompts, outputs) = check(&v, 6);
    assert_eq!(outputs, vec![12; 6]);
    assert_eq!(v["mesh"]["output_tokens"], 72);
    assert!(prompts.iter().all(|p| (4..=40).contains(p)), "{prompts:?}");
}

#[test]
fn open_loop_with_reference_reports_exact_counts() {
    let v = bench(&[
        "--rate",
        "20",
        "--requests",
        "6",
        "--prompt-len",
        "normal:30,10",
        "--output-len",
        "uniform:4-16",
        "--seed",
        "4",
    ]);
    assert_eq!(v["config"]["mode"], "open");
    assert_eq!(v["config"]["rate"], 20.0);
    let (_, outputs) = check(&v, 6);
    assert!(outputs.iter().all(|o| (4..=16).contains(o)), "{outputs:?}");
}

#[test]
fn ignore_eos_generates_exactly_max_tokens() {
    // A prompt whose greedy output ends early at an end-of-sequence token.
    let model = tiny_model_dir();
    let engine = Engine::load(&model, &EngineConfig::default()).expect("tiny model");
    let max_tokens = 24;
    let (prompt, stopped) = (0..300)
        .find_map(|i| {
            let p = format!("item {i}: the and of");
            let g = engine
                .generate(
                    &Prompt::Text(p.clone()),
                    max_tokens,
                    SamplingParams::greedy(),
                    |_| {},
                )
                .expect("generate");
            (g.finish_reason == FinishReason::Stop).then_some((p, g.tokens.len()))
        })
        .expect("a prompt whose greedy output stops early");
    drop(engine);

    let mesh = InProcessMesh::start(&model, Options::default()).expect("the mesh");
    let ask = |ignore_eos: bool| {
        let r = post(
            &mesh.http,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        (
            v["choices"][0]["finish_reason"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            v["usage"]["completion_tokens"].as_u64().expect("usage"),
        )
    };
    assert_eq!(ask(false), ("stop".to_owned(), stopped as u64));
    assert_eq!(ask(true), ("length".to_owned(), max_tokens as u64));
    mesh.assert_pages_come_back();
}
