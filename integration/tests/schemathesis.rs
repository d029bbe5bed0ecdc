//! The gateway's published OpenAPI document (`GET /openapi.json`) checked by
//! a schema-driven fuzzer, schemathesis, against `kvmesh serve` on the tiny
//! model with an API key: requests generated from the document (valid ones,
//! and ones that break it), each response checked for server errors, a
//! documented status code, a documented content type and a body matching
//! the document's schema (server-sent events too, event by event); requests
//! that break the document refused, undocumented methods answered 405, and
//! the bearer scheme enforced (401 without a key or with a wrong one).
//! Afterwards the mesh must have generated, failed no dispatch, and have
//! every KV page back in its pool. schemathesis is installed from PyPI with
//! the machine's pip into the kvmesh cache (outside the repository) on first
//! use; offline (`KVMESH_SKIP_MODEL_FETCH=1`) a missing install skips the
//! test with a note.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use kvmesh_integration::inproc::{InProcessMesh, Options};
use kvmesh_integration::python::{is_installed, package_dir, pip_install, python};
use kvmesh_integration::tiny_model_dir;

/// Pinned for reproducible runs (works with Python 3.11).
const SCHEMATHESIS: &str = "schemathesis==4.32.5";

/// Test cases per operation and phase: with the context window below, the
/// whole run stays well under a minute on two cores.
const MAX_EXAMPLES: &str = "50";

/// A small context window keeps every generation short.
const MAX_MODEL_LEN: &str = "64";

/// The same cases every run (given the same responses).
const SEED: &str = "20261130";

const KEY: &str = "k-schemathesis";

/// The checks, each a claim of the document (schemathesis names).
const CHECKS: &str = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,negative_data_rejection,unsupported_method,ignored_auth";

/// The directory schemathesis is installed into, or `None` when it is not
/// there and the run is offline.
fn schemathesis_dir() -> Option<PathBuf> {
    if !is_installed(SCHEMATHESIS)
        && std::env::var("KVMESH_SKIP_MODEL_FETCH").is_ok_and(|v| v == "1")
    {
        eprintln!(
            "note: {SCHEMATHESIS} is not in {} and KVMESH_SKIP_MODEL_FETCH=1 (offline); the schemathesis test is skipped",
            package_dir(SCHEMATHESIS).display()
        );
        return None;
    }
    Some(pip_install(SCHEMATHESIS))
}

#[test]
fn the_gateway_conforms_to_its_openapi_document() {
    let Some(dir) = schemathesis_dir() else {
        return;
    };
    let mut opts = Options {
        api_keys: vec![(KEY.to_owned(), "fuzz".to_owned())],
        ..Options::default()
    };
    opts.engine.max_model_len = Some(MAX_MODEL_LEN.parse().expect("a number"));
    let mesh = InProcessMesh::start(&tiny_model_dir(), opts).expect("the mesh");
    // What schemathesis loads is the committed document.
    let served = kvmesh_integration::http::get(&mesh.http, "/openapi.json");
    assert_eq!(served.status, 200);
    let committed: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../router/openapi.json"),
        )
        .expect("router/openapi.json"),
    )
    .expect("committed document is JSON");
    assert_eq!(served.json(), committed);
    // schemathesis writes its example database and reports under the
    // working directory: a scratch one.
    let work = tempfile::tempdir().expect("scratch dir");
    let report = work.path().join("report.json");
    let base = format!("http://{}", mesh.http);
    let args = [
        "-m".to_owned(),
        "schemathesis.cli".into(),
        "run".into(),
        format!("{base}/openapi.json"),
        "--url".into(),
        base.clone(),
        "--header".into(),
        format!("Authorization: Bearer {KEY}"),
        "--checks".into(),
        CHECKS.into(),
        "--phases".into(),
        "examples,coverage,fuzzing".into(),
        "--max-examples".into(),
        MAX_EXAMPLES.into(),
        "--seed".into(),
        SEED.into(),
        "--generation-database".into(),
        "none".into(),
        "--workers".into(),
        "1".into(),
        "--request-timeout".into(),
        "30".into(),
        "--report".into(),
        "json".into(),
        "--report-json-path".into(),
        report.display().to_string(),
        "--no-color".into(),
    ];
    eprintln!("running: {} {}", python(), args.join(" "));
    let start = Instant::now();
    let out = Command::new(python())
        .args(&args)
        .current_dir(work.path())
        .env("PYTHONPATH", &dir)
        .output()
        .expect("run schemathesis");
    let elapsed = start.elapsed();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    println!("{stdout}");
    eprintln!("{stderr}");
    eprintln!("schemathesis ran {:.1} s", elapsed.as_secs_f64());
    assert!(
        out.status.success(),
        "schemathesis found the gateway out of step with its document (exit {:?}): see above",
        out.status.code()
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("schemathesis JSON report"))
            .expect("report is JSON");
    let (operations, cases) = (&report["operations"], &report["test_cases"]);
    println!(
        "schemathesis {}: {} operations tested, {} test cases, {} with failures, {} errored; checks {CHECKS}; seed {}",
        report["schemathesis_version"],
        operations["tested"],
        cases["generated"],
        cases["with_failures"],
        cases["errored"],
        report["seed"]
    );
    // Loaded from its URL, the document's own operation (GET /openapi.json)
    // is left out; the rest are all tested.
    assert_eq!(operations["total"], 8, "{operations}");
    assert_eq!(
        operations["tested"], 8,
        "every operation tested: {operations}"
    );
    assert_eq!(operations["errored"], 0, "{operations}");
    assert!(
        cases["generated"].as_u64().is_some_and(|n| n >= 200),
        "too few test cases: {cases}"
    );
    assert_eq!(
        report["failures"],
        serde_json::json!([]),
        "{}",
        report["failures"]
    );

    // The fuzzing reached generation, not only refusals, and left nothing
    // behind: no failed dispatch, no guard violation, every page back.
    let generated = ["stop", "length"]
        .iter()
        .filter_map(|o| mesh.metric(&format!("kvmesh_requests_total{{outcome=\"{o}\"}}")))
        .sum::<f64>();
    assert!(
        generated >= 10.0,
        "only {generated} requests generated:\n{}",
        mesh.metrics()
    );
    let metrics = mesh.metrics();
    for failed in [
        "prefill_failed",
        "decode_failed",
        "decode_refused",
        "tokenizer",
    ] {
        assert!(
            !metrics.contains(&format!("kvmesh_requests_total{{outcome=\"{failed}\"}}")),
            "{failed} after fuzzing:\n{metrics}"
        );
    }
    for node in ["prefill-0", "decode-0"] {
        assert_eq!(
            mesh.metric(&format!(
                "kvmesh_node_kv_guard_violations_total{{node=\"{node}\"}}"
            )),
            Some(0.0),
            "{node}"
        );
    }
    mesh.assert_pages_come_back();
}
