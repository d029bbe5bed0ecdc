//! Per-tenant admission through the real mesh (router -> prefill ->
//! decode, the tiny model): several requests of many choices from one
//! tenant and another tenant's single request, together on fewer slots
//! than their choices, all complete (a request's choices are admitted
//! together, so no two requests each hold part of the slots waiting for
//! the rest), and the other tenant's answer is what it gets alone.
//! Timing is the benchmark's (`kvmesh bench-router --fairness`), not
//! this test's.

use std::thread;

use kvmesh_integration::http;
use kvmesh_integration::inproc::{InProcessMesh, Options};
use kvmesh_integration::tiny_model_dir;
use serde_json::{json, Value};

fn post_as(addr: &str, key: &str, body: &Value) -> http::Response {
    http::request_with(
        addr,
        "POST",
        "/v1/completions",
        Some(&body.to_string()),
        Some(&format!("Bearer {key}")),
    )
}

#[test]
fn a_tenants_many_choices_and_another_tenants_request_all_complete_on_few_slots() {
    let mesh = InProcessMesh::start(
        &tiny_model_dir(),
        Options {
            api_keys: vec![
                ("sk-alpha".into(), "alpha".into()),
                ("sk-beta".into(), "beta".into()),
            ],
            max_running: 16,
            ..Options::default()
        },
    )
    .unwrap_or_else(|e| panic!("starting the mesh: {e:#}"));
    let beta = json!({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0});
    let alone = post_as(&mesh.http, "sk-beta", &beta);
    assert_eq!(alone.status, 200, "{}", alone.body);
    let alone = alone.json()["choices"][0]["text"].clone();
    let addr = mesh.http.clone();
    let alpha: Vec<_> = (0..3)
        .map(|i| {
            let addr = addr.clone();
            thread::spawn(move || {
                let body = json!({"prompt": format!("Request {i} of many"), "max_tokens": 8,
                    "n": 16, "temperature": 0.8, "seed": i});
                post_as(&addr, "sk-alpha", &body)
            })
        })
        .collect();
    let loaded = post_as(&mesh.http, "sk-beta", &beta);
    assert_eq!(loaded.status, 200, "{}", loaded.body);
    assert_eq!(loaded.json()["choices"][0]["text"], alone);
    for a in alpha {
        let r = a.join().expect("alpha's thread");
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["choices"].as_array().map(Vec::len), Some(16));
    }
    let text = mesh.metrics();
    assert!(!text.contains("alpha") && !text.contains("beta"), "{text}");
    assert!(!text.contains("tenant_share_exceeded"), "{text}");
    mesh.assert_pages_come_back();
    let drained = mesh.shutdown().unwrap_or_else(|e| panic!("drain: {e:#}"));
    assert!(drained.decode.is_clean(), "{}", drained.decode);
    assert!(drained.prefill.is_clean(), "{}", drained.prefill);
}
