//! `kvmesh doctor` against real processes: a healthy mesh passes every
//! check (exit 0); a planted undersized decode pool, a mesh file with the
//! wrong secret and a node that is gone each fail the check that names
//! them (exit 1), in the table and in `--json`.

use std::path::Path;
use std::time::{Duration, Instant};

use kvmesh_integration::roles::{
    start, start_logged, start_with, tiny_mesh_file, wait_healthy, write_secret,
};
use kvmesh_integration::{http, reference_text, run_kvmesh, texts, tiny_model_dir};
use serde_json::{json, Value};

/// `kvmesh doctor --config FILE --json`: (exit code, report).
fn doctor(file: &Path) -> (i32, Value) {
    doctor_with(&["--config", &file.to_string_lossy()])
}

/// `kvmesh doctor ARGS --json`: (exit code, report).
fn doctor_with(args: &[&str]) -> (i32, Value) {
    let out = run_kvmesh(&[&["doctor", "--json"], args].concat(), &[]);
    let (stdout, stderr) = texts(&out);
    let v: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("doctor's JSON: {e}: {stdout} {stderr}"));
    (out.status.code().expect("exit code"), v)
}

/// The status of `check` for `node`.
fn status<'a>(v: &'a Value, node: &str, check: &str) -> &'a str {
    v["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["node"] == node && c["check"] == check)
        .and_then(|c| c["status"].as_str())
        .unwrap_or_else(|| panic!("no {check:?} for {node}: {v:#}"))
}

/// Every across-the-mesh check passed.
fn assert_mesh_agrees(v: &Value) {
    for check in [
        "version",
        "model",
        "context limit",
        "KV element type",
        "CPU kernel numerics",
        "page size",
    ] {
        assert_eq!(status(v, "mesh", check), "ok", "{check}: {v:#}");
    }
}

/// The detail of `check` for `node`.
fn detail<'a>(v: &'a Value, node: &str, check: &str) -> &'a str {
    v["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["node"] == node && c["check"] == check)
        .and_then(|c| c["detail"].as_str())
        .unwrap_or_else(|| panic!("no {check:?} for {node}: {v:#}"))
}

fn failed(v: &Value) -> Vec<String> {
    v["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .filter(|c| c["status"] == "fail")
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
            format!("{} {}", s("node"), s("check"))
        })
        .collect()
}

#[test]
fn doctor_passes_a_healthy_mesh_and_names_what_is_wrong() {
    // A healthy mesh: every check passes, and the table says so.
    let dir = tempfile::tempdir().expect("tempdir");
    let (file, ports) = tiny_mesh_file(dir.path());
    let mut procs = vec![
        start("decode", &file, Some("decode-0")),
        start("prefill", &file, Some("prefill-0")),
        start("router", &file, None),
    ];
    wait_healthy(&format!("127.0.0.1:{}", ports[0]));
    let (code, v) = doctor(&file);
    assert_eq!(code, 0, "{v:#}");
    assert_eq!(v["ok"], true);
    assert!(failed(&v).is_empty(), "{v:#}");
    for node in ["prefill-0", "decode-0"] {
        for check in [
            "gRPC reachable",
            "mesh secret accepted",
            "node identity",
            "pool holds a context",
            "clock",
        ] {
            assert_eq!(status(&v, node, check), "ok", "{node} {check}: {v:#}");
        }
    }
    assert_eq!(status(&v, "decode-0", "KV transport reachable"), "ok");
    assert_mesh_agrees(&v);
    assert_eq!(status(&v, "router", "health"), "ok");
    // The model as the router describes it, from its metadata.
    assert_eq!(status(&v, "router", "model"), "ok");
    let model = detail(&v, "router", "model");
    assert!(model.contains(": llama, weights "), "{model}");
    let f = file.to_string_lossy();
    let table = run_kvmesh(&["doctor", "--config", &f], &[]);
    let (stdout, _) = texts(&table);
    assert!(table.status.success());
    assert!(
        stdout.starts_with("NODE") && stdout.contains("all checks passed"),
        "{stdout}"
    );

    // The same mesh file with another secret: both nodes refuse it.
    let other = tempfile::tempdir().expect("tempdir");
    write_secret(other.path(), "mesh.secret");
    let wrong = other.path().join("mesh.yaml");
    std::fs::copy(&file, &wrong).expect("copy");
    let (code, v) = doctor(&wrong);
    assert_eq!(code, 1);
    assert_eq!(v["ok"], false);
    for node in ["prefill-0", "decode-0"] {
        assert_eq!(status(&v, node, "mesh secret accepted"), "fail", "{v:#}");
        assert_eq!(status(&v, node, "gRPC reachable"), "ok");
    }

    // A node that is gone: its port and what needs it.
    procs.remove(1);
    let (code, v) = doctor(&file);
    assert_eq!(code, 1);
    assert_eq!(status(&v, "prefill-0", "gRPC reachable"), "fail", "{v:#}");
    assert_eq!(status(&v, "prefill-0", "mesh secret accepted"), "skip");
    assert_eq!(status(&v, "decode-0", "mesh secret accepted"), "ok");
    drop(procs);
}

#[test]
fn doctor_catches_a_pool_that_cannot_hold_the_context() {
    // The incident's mistake, planted: a decode pool of 64 tokens under a
    // 256-token context, started anyway (allow_small_pool).
    let dir = tempfile::tempdir().expect("tempdir");
    let (file, ports) = tiny_mesh_file(dir.path());
    let text = std::fs::read_to_string(&file).expect("mesh file");
    let text = text.replace(
        &format!("kv: \"127.0.0.1:{}\"}}", ports[4]),
        &format!("kv: \"127.0.0.1:{}\", kv_pool_tokens: 64}}", ports[4]),
    );
    assert!(text.contains("kv_pool_tokens: 64"), "{text}");
    std::fs::write(
        &file,
        format!("{text}allow_small_pool: true\nmax_model_len: 256\n"),
    )
    .expect("write");
    let _d = start("decode", &file, Some("decode-0"));
    let _p = start("prefill", &file, Some("prefill-0"));
    let (code, v) = doctor(&file);
    assert_eq!(code, 1, "{v:#}");
    assert_eq!(
        status(&v, "decode-0", "pool holds a context"),
        "fail",
        "{v:#}"
    );
    assert_eq!(status(&v, "decode-0", "pool in mesh file"), "warn");
    assert_eq!(status(&v, "prefill-0", "pool holds a context"), "ok");
    // No router runs here: that fails too, and nothing else does.
    let mut f = failed(&v);
    f.sort();
    assert_eq!(
        f,
        ["decode-0 pool holds a context", "router HTTP reachable"],
        "{v:#}"
    );
}

/// `kvmesh doctor --url http://ADDR --json`: (exit code, report).
fn doctor_url(addr: &str) -> (i32, Value) {
    doctor_with(&["--url", &format!("http://{addr}")])
}

#[test]
fn doctor_checks_a_running_serve_through_its_router() {
    let model = kvmesh_integration::tiny_model_dir();
    // A healthy `kvmesh serve` (its secret never leaves the process):
    // every node is up at the router, holds a context, and agrees.
    let mesh = kvmesh_integration::mesh::Mesh::start(&model, &[]);
    let (code, v) = doctor_url(&mesh.http);
    assert_eq!(code, 0, "{v:#}");
    assert_eq!(v["url"], format!("http://{}", mesh.http));
    for node in ["prefill-0", "decode-0"] {
        for check in ["up at the router", "pool holds a context", "clock"] {
            assert_eq!(status(&v, node, check), "ok", "{node} {check}: {v:#}");
        }
    }
    assert_mesh_agrees(&v);
    drop(mesh);

    // A planted undersized pool on both nodes: each fails the pool check.
    let small = kvmesh_integration::mesh::Mesh::start(
        &model,
        &["--kv-pool-tokens", "32", "--allow-small-pool"],
    );
    let (code, v) = doctor_url(&small.http);
    assert_eq!(code, 1, "{v:#}");
    let mut fails = failed(&v);
    fails.sort();
    assert_eq!(
        fails,
        [
            "decode-0 pool holds a context",
            "prefill-0 pool holds a context"
        ],
        "{v:#}"
    );
    drop(small);

    // Nothing listening: the router check fails, and nothing else runs.
    let port = kvmesh_integration::roles::free_port();
    let (code, v) = doctor_url(&format!("127.0.0.1:{port}"));
    assert_eq!(code, 1, "{v:#}");
    assert_eq!(failed(&v), ["router HTTP reachable"], "{v:#}");
    // A bad address is refused before anything is asked.
    let out = run_kvmesh(&["doctor", "--url", "https://x:1"], &[]);
    assert!(!out.status.success());
    assert!(
        texts(&out).1.contains("expected http://HOST:PORT"),
        "{:?}",
        texts(&out)
    );
}

/// Whether this CPU runs the AVX2 kernels (every x86-64 server CPU since
/// 2013): the mixed-kernels test needs a path other than portable.
fn has_avx2() -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| {
        ["avx2", "fma", "f16c"]
            .iter()
            .all(|f| c.split_whitespace().any(|w| w == *f))
    })
}

/// Posts `body` until the router refuses it as `mixed_cpu_kernels` (until
/// both load reports are in it may say "no healthy node"; then it must say
/// why it pairs nothing); never served.
fn refused_as_mixed(addr: &str, body: &Value) -> http::Response {
    let t0 = Instant::now();
    loop {
        let r = http::post(addr, "/v1/completions", body);
        if r.status == 503 && r.json()["error"]["code"] == "mixed_cpu_kernels" {
            return r;
        }
        assert_ne!(
            r.status, 200,
            "nodes of different numerics paired: {}",
            r.body
        );
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "never refused: {} {}",
            r.status,
            r.body
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_mesh_mixing_cpu_kernel_numerics_is_refused_and_named_while_avx2_and_avx512_pair() {
    if !has_avx2() {
        eprintln!("not run: no AVX2 on this CPU (only the portable path: nothing to mix)");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (file, ports) = tiny_mesh_file(dir.path());
    let addr = format!("127.0.0.1:{}", ports[0]);
    // Decode on this CPU's widest path (avx512 where it has it), prefill
    // forced to the portable kernels.
    let _decode = start("decode", &file, Some("decode-0"));
    let prefill = start_with(
        "prefill",
        &file,
        Some("prefill-0"),
        &["--cpu-kernels", "portable"],
    );
    let router = start_logged("router", &file, None, "warn");
    wait_healthy(&addr);
    // A mesh file without API keys: the router says once, at start, what
    // that means for the prefix cache.
    let warning = router
        .log_line("one prefix-cache namespace", Duration::from_secs(10))
        .expect("the router warns that every client shares one namespace");
    assert!(warning.contains("no API keys configured"), "{warning}");
    let prompt = "The capital of France is";
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
    let refused = refused_as_mixed(&addr, &body);
    // The client learns neither node names nor paths; the router's log does.
    assert!(!refused.body.contains("prefill-0"), "{}", refused.body);
    let line = router
        .log_line("refusing to pair nodes", Duration::from_secs(10))
        .expect("the router logs the refusal");
    // Both in the default int8 class: the numerics differ by the path.
    assert!(
        line.contains("prefill-0 runs portable (portable-i8)"),
        "{line}"
    );
    assert!(line.contains("x86-i8"), "{line}");
    // The node's series and doctor name the odd one out.
    let info = http::metrics(&addr);
    assert!(
        info.first(
            "kvmesh_node_info",
            &[
                ("node", "prefill-0"),
                ("cpu_kernels", "portable"),
                ("cpu_numerics", "portable-i8")
            ]
        )
        .is_some(),
        "kvmesh_node_info has the prefill node's kernels"
    );
    let (code, v) = doctor(&file);
    assert_eq!(code, 1, "{v:#}");
    assert_eq!(status(&v, "mesh", "CPU kernel numerics"), "fail", "{v:#}");
    assert_eq!(
        failed(&v),
        vec!["mesh CPU kernel numerics".to_owned()],
        "only the numerics differ: {v:#}"
    );

    // The same path in the f32 class: other numerics, so refused alike,
    // and named.
    drop(prefill);
    let prefill = start_with(
        "prefill",
        &file,
        Some("prefill-0"),
        &["--activations", "f32"],
    );
    // Until the new node's load report is in, the router may still refuse
    // on the portable one's: ask until it names the f32 class.
    let t0 = Instant::now();
    let line = loop {
        refused_as_mixed(&addr, &body);
        if let Some(line) = router.log_line("x86-fma", Duration::from_millis(300)) {
            break line;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the router never named the f32 class"
        );
    };
    assert!(
        line.contains("refusing to pair") && line.contains("x86-i8"),
        "{line}"
    );

    // Prefill on avx2 instead: avx2 and avx512 compute the same bits, so
    // this mesh (avx2 prefill, and avx512 decode where the CPU has it)
    // serves, and its greedy text equals the reference engine's.
    drop(prefill);
    let _prefill = start_with(
        "prefill",
        &file,
        Some("prefill-0"),
        &["--cpu-kernels", "avx2"],
    );
    let want = reference_text(&tiny_model_dir(), prompt, false, 8);
    let t0 = Instant::now();
    let got = loop {
        let r = http::post(&addr, "/v1/completions", &body);
        if r.status == 200 {
            break r.json()["choices"][0]["text"]
                .as_str()
                .expect("text")
                .to_owned();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "never served: {} {}",
            r.status,
            r.body
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(got, want);
    let (code, v) = doctor(&file);
    assert_eq!(code, 0, "{v:#}");
    assert_mesh_agrees(&v);
}
