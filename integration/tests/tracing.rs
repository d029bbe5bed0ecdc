//! Traces across the mesh's three processes (`kvmesh router`, `prefill`,
//! `decode`, one mesh file with a `tracing:` section), exported over
//! OTLP/gRPC to a real receiver: `integration/python/otlp_receiver.py`,
//! opentelemetry-proto's TraceService served by grpcio (pip-installed into
//! the kvmesh cache on first use). One mesh and one receiver for all of it:
//! a completed request (HTTP, with the client's `traceparent`), the same
//! over the public gRPC API, an aborted one (the client leaves while the
//! transfer is held back by an injected delay) and a refused one (over the
//! context window, with a malformed `traceparent`). The processes are then
//! stopped with SIGTERM, so what arrives is also what their flush at
//! shutdown sent.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvmesh_integration::http::{metrics_with, post_streaming_headers, request_headers};
use kvmesh_integration::python::{pip_install, python};
use kvmesh_integration::roles::{self, free_port, wait_healthy, write_secret};
use kvmesh_integration::tiny_model_dir;
use kvmesh_proto::v1::generation_client::GenerationClient;
use kvmesh_proto::v1::{generate_request, GenerateRequest};
use serde_json::{json, Value};

/// Pinned for reproducible runs.
const GRPCIO: &str = "grpcio==1.85.1";
const OTEL_PROTO: &str = "opentelemetry-proto==1.45.2";

/// What no exported attribute may contain: the prompts' text, the API key
/// and its tenant.
const PROMPT: &str = "zebra quartz lantern";
const API_KEY: &str = "sk-trace-7f3a9c1e5b";
const TENANT: &str = "tenant-okapi";

/// The clients' trace ids and parent span ids.
const HTTP_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const HTTP_PARENT: &str = "00f067aa0ba902b7";
const GRPC_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const GRPC_PARENT: &str = "b7ad6b7169203331";
const ABORT_TRACE: &str = "5c2e6a3f0b8d4e1fa7c9d2b4e6f80a1b";
const ABORT_PARENT: &str = "1a2b3c4d5e6f7081";

fn traceparent(trace: &str, parent: &str) -> String {
    format!("00-{trace}-{parent}-01")
}

/// The receiver: its port, the spans it printed so far, its stdin (closing
/// it stops it).
struct Receiver {
    child: Child,
    stdin: Option<ChildStdin>,
    port: u16,
    spans: Arc<Mutex<Vec<Value>>>,
}

impl Receiver {
    fn start() -> Self {
        let path = std::env::join_paths([pip_install(GRPCIO), pip_install(OTEL_PROTO)])
            .expect("PYTHONPATH");
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/otlp_receiver.py");
        let mut child = Command::new(python())
            .arg(script)
            .env("PYTHONPATH", path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the OTLP receiver");
        let stdin = child.stdin.take();
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let first = lines
            .next()
            .and_then(Result::ok)
            .expect("the receiver's first line");
        let port = first
            .strip_prefix("listening ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("not a port: {first:?}"));
        let spans = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&spans);
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                let v: Value = serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: {l}"));
                sink.lock().expect("spans").push(v);
            }
        });
        Self {
            child,
            stdin,
            port,
            spans,
        }
    }

    fn spans(&self) -> Vec<Value> {
        self.spans.lock().expect("spans").clone()
    }

    /// Waits (bounded) until a span named `name` of trace `trace` arrived.
    fn wait_for(&self, trace: &str, name: &str, within: Duration) -> bool {
        let t0 = Instant::now();
        while t0.elapsed() < within {
            if self
                .spans()
                .iter()
                .any(|s| s["trace_id"] == trace && s["name"] == name)
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A mesh file for one prefill and one decode node on the tiny model, with
/// an API key and the receiver as its collector; the router's HTTP and
/// gRPC addresses.
fn mesh_file(dir: &std::path::Path, collector: u16) -> (PathBuf, String, String) {
    let p: [u16; 5] = std::array::from_fn(|_| free_port());
    write_secret(dir, "mesh.secret");
    let text = format!(
        "model: {model}\nmesh: {{secret_file: mesh.secret}}\n\
         tracing: {{otlp_endpoint: \"http://127.0.0.1:{collector}\", sample_ratio: 1}}\n\
         router:\n  http: \"127.0.0.1:{}\"\n  grpc: \"127.0.0.1:{}\"\n  api_keys: [{{key: {API_KEY}, tenant: {TENANT}, scopes: [inference, metrics]}}]\n\
         prefill:\n  - {{name: prefill-0, grpc: \"127.0.0.1:{}\"}}\n\
         decode:\n  - {{name: decode-0, grpc: \"127.0.0.1:{}\", kv: \"127.0.0.1:{}\"}}\n",
        p[0],
        p[1],
        p[2],
        p[3],
        p[4],
        model = tiny_model_dir().display(),
    );
    let file = dir.join("mesh.yaml");
    std::fs::write(&file, text).expect("write mesh file");
    (
        file,
        format!("127.0.0.1:{}", p[0]),
        format!("127.0.0.1:{}", p[1]),
    )
}

fn bearer() -> String {
    format!("Bearer {API_KEY}")
}

/// One trace's spans, by span id.
struct Trace<'a> {
    id: &'a str,
    spans: Vec<&'a Value>,
}

impl<'a> Trace<'a> {
    fn of(all: &'a [Value], id: &'a str) -> Self {
        Self {
            id,
            spans: all.iter().filter(|s| s["trace_id"] == id).collect(),
        }
    }

    fn named(&self, name: &str) -> Vec<&'a Value> {
        self.spans
            .iter()
            .copied()
            .filter(|s| s["name"] == name)
            .collect()
    }

    fn one(&self, name: &str) -> &'a Value {
        let found = self.named(name);
        assert_eq!(found.len(), 1, "trace {}: {name}: {found:#?}", self.id);
        found[0]
    }

    fn services(&self) -> HashSet<&'a str> {
        self.spans
            .iter()
            .filter_map(|s| s["service"].as_str())
            .collect()
    }

    /// Every span's parent is in the trace, except the root's, which is
    /// `root_parent` (the client's span, or none).
    fn assert_linked(&self, root_parent: &str) {
        let ids: HashSet<&str> = self
            .spans
            .iter()
            .filter_map(|s| s["span_id"].as_str())
            .collect();
        let root = self.one("router.request");
        assert_eq!(root["parent_span_id"], root_parent, "trace {}", self.id);
        for s in &self.spans {
            if std::ptr::eq(*s, root) {
                continue;
            }
            let parent = s["parent_span_id"].as_str().unwrap_or_default();
            assert!(
                ids.contains(parent),
                "trace {}: {} has parent {parent:?}, not in the trace",
                self.id,
                s["name"]
            );
        }
    }

    fn assert_names(&self, names: &[&str]) {
        let have: HashSet<&str> = self
            .spans
            .iter()
            .filter_map(|s| s["name"].as_str())
            .collect();
        for n in names {
            assert!(have.contains(n), "trace {}: no {n} in {have:?}", self.id);
        }
    }

    /// Each span named `name` comes from `service`, node `instance`.
    fn assert_from(&self, prefix: &str, service: &str, instance: &str) {
        for s in &self.spans {
            if s["name"].as_str().is_some_and(|n| n.starts_with(prefix)) {
                assert_eq!(s["service"], service, "{s}");
                assert_eq!(s["instance"], instance, "{s}");
            }
        }
    }
}

/// `s`'s attribute `key` as text.
fn attr<'a>(s: &'a Value, key: &str) -> &'a str {
    s["attributes"][key].as_str().unwrap_or_default()
}

#[test]
fn one_trace_per_request_across_router_decode_and_prefill() {
    let receiver = Receiver::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let (file, http_addr, grpc_addr) = mesh_file(dir.path(), receiver.port);
    let mut decode = roles::start("decode", &file, Some("decode-0"));
    let mut prefill = roles::start("prefill", &file, Some("prefill-0"));
    let mut router = roles::start_with("router", &file, None, &["--fault-injection"]);
    wait_healthy(&http_addr);
    let auth = bearer();

    // Completed, over HTTP, in the client's trace.
    let tp = traceparent(HTTP_TRACE, HTTP_PARENT);
    let body = json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0}).to_string();
    let r = request_headers(
        &http_addr,
        "POST",
        "/v1/completions",
        Some(&body),
        &[("authorization", &auth), ("traceparent", &tp)],
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // Completed, over the public gRPC API, in the caller's trace.
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut client = GenerationClient::connect(format!("http://{grpc_addr}"))
            .await
            .expect("connect");
        let mut req = tonic::Request::new(GenerateRequest {
            input: Some(generate_request::Input::Prompt(PROMPT.into())),
            max_tokens: 4,
            temperature: Some(0.0),
            ..Default::default()
        });
        let md = req.metadata_mut();
        md.insert("authorization", auth.parse().expect("ascii"));
        md.insert(
            "traceparent",
            traceparent(GRPC_TRACE, GRPC_PARENT).parse().expect("ascii"),
        );
        let mut stream = client.generate(req).await.expect("generate").into_inner();
        while stream.message().await.expect("message").is_some() {}
    });

    // Aborted: the first frame is held back, the client leaves meanwhile;
    // decode's reservation ends `aborted` (confirmed by the writer).
    let aborted = "kvmesh_node_reservations_total{node=\"decode-0\",outcome=\"aborted\"}";
    let metric = |s: &str| metrics_with(&http_addr, &bearer()).get(s);
    let before = metric(aborted).unwrap_or(0.0);
    let tp = traceparent(ABORT_TRACE, ABORT_PARENT);
    let s = post_streaming_headers(
        &http_addr,
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": true}),
        &[
            ("authorization", &auth),
            ("traceparent", &tp),
            ("x-kvmesh-fault", "frame:0=delay:1500"),
        ],
    );
    assert_eq!(s.status, 200);
    std::thread::sleep(Duration::from_millis(300));
    drop(s);
    let t0 = Instant::now();
    while metric(aborted).unwrap_or(0.0) < before + 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "never aborted");
        std::thread::sleep(Duration::from_millis(50));
    }

    // Refused by admission (over the context window: 256 tokens), with a
    // malformed traceparent, which is ignored: a new trace starts.
    let body = json!({"prompt": PROMPT, "max_tokens": 300}).to_string();
    let r = request_headers(
        &http_addr,
        "POST",
        "/v1/completions",
        Some(&body),
        &[
            ("authorization", &auth),
            ("traceparent", "00-not-a-trace-context-01"),
        ],
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");

    // Drain every process: what they still hold is flushed at exit.
    for p in [&mut router, &mut prefill, &mut decode] {
        p.terminate();
        let status = p.wait_exit(Duration::from_secs(30)).expect("exits");
        assert!(status.success(), "{status:?}");
    }
    assert!(
        receiver.wait_for(ABORT_TRACE, "prefill.abort", Duration::from_secs(10)),
        "the abort's spans never arrived"
    );
    let all = receiver.spans();
    assert!(!all.is_empty());

    // Nothing a tenant sent or holds is in any attribute.
    for s in &all {
        let attrs = s["attributes"].as_object().expect("attributes");
        for (k, v) in attrs {
            let v = v.as_str().unwrap_or_default();
            for secret in [PROMPT, "zebra", API_KEY, TENANT] {
                assert!(
                    !v.contains(secret) && !k.contains(secret),
                    "{} carries {secret:?} in {k}={v}",
                    s["name"]
                );
            }
        }
    }

    // Completed: one trace across the three services, linked to the
    // client's span, every stage present, one reservation id throughout.
    let t = Trace::of(&all, HTTP_TRACE);
    assert_eq!(
        t.services(),
        HashSet::from(["kvmesh-router", "kvmesh-decode", "kvmesh-prefill"])
    );
    t.assert_linked(HTTP_PARENT);
    t.assert_names(&[
        "router.request",
        "router.validate",
        "router.admit",
        "router.node_choice",
        "router.dispatch",
        "router.reserve",
        "decode.generate",
        "decode.reserve",
        "kv.verify",
        "decode.adopt",
        "decode.stream",
        "prefill.request",
        "prefill.compute",
        "prefill.transfer",
        "kv.layer",
        "kv.transfer_done",
    ]);
    t.assert_from("decode.", "kvmesh-decode", "decode-0");
    t.assert_from("prefill.", "kvmesh-prefill", "prefill-0");
    t.assert_from("router.", "kvmesh-router", "");
    let layers = t.named("kv.layer");
    assert_eq!(layers.len(), 3, "one per layer of the tiny model");
    for l in &layers {
        assert!(attr(l, "bytes").parse::<u64>().unwrap_or(0) > 0, "{l}");
        assert!(attr(l, "pages").parse::<u64>().unwrap_or(0) > 0, "{l}");
    }
    let rid = attr(t.one("decode.generate"), "reservation.id");
    assert_eq!(rid.len(), 32, "{rid}");
    for name in [
        "router.dispatch",
        "router.reserve",
        "prefill.request",
        "kv.verify",
    ] {
        assert_eq!(attr(t.one(name), "reservation.id"), rid, "{name}");
    }
    assert_eq!(attr(t.one("kv.verify"), "outcome"), "completed");
    assert_eq!(attr(t.one("router.dispatch"), "outcome"), "length");
    // The nodes' server spans are children of the router's dispatch.
    let dispatch = t.one("router.dispatch")["span_id"].clone();
    assert_eq!(t.one("decode.generate")["parent_span_id"], dispatch);
    assert_eq!(t.one("prefill.request")["parent_span_id"], dispatch);

    // The same over the public gRPC API.
    let g = Trace::of(&all, GRPC_TRACE);
    assert_eq!(g.services().len(), 3, "{:?}", g.services());
    g.assert_linked(GRPC_PARENT);
    assert_eq!(
        attr(g.one("router.request"), "rpc.method"),
        "kvmesh.v1.Generation/Generate"
    );
    g.assert_names(&["decode.stream", "prefill.compute", "kv.verify"]);

    // Aborted: the gateway's abort reaches prefill in the same trace,
    // decode's reservation is aborted and revoked there.
    let a = Trace::of(&all, ABORT_TRACE);
    assert_eq!(a.services().len(), 3, "{:?}", a.services());
    a.assert_linked(ABORT_PARENT);
    a.assert_names(&[
        "router.dispatch",
        "router.abort",
        "prefill.abort",
        "decode.generate",
        "kv.abort",
        "kv.abort_confirmed",
        "kv.revoke",
    ]);
    assert_eq!(attr(a.one("router.dispatch"), "outcome"), "client_gone");
    assert_eq!(
        a.one("prefill.abort")["parent_span_id"],
        a.one("router.abort")["span_id"]
    );
    assert_eq!(attr(a.one("kv.revoke"), "outcome"), "aborted");
    assert!(a.named("decode.stream").is_empty(), "nothing was decoded");

    // Refused: the router alone, a new trace (the malformed header was
    // ignored), admission's span failed with the refusal's kind.
    let refused: Vec<&Value> = all
        .iter()
        .filter(|s| {
            s["name"] == "router.admit" && attr(s, "error.kind") == "context_length_exceeded"
        })
        .collect();
    assert_eq!(refused.len(), 1, "{refused:#?}");
    let rid = refused[0]["trace_id"].as_str().expect("trace id");
    let r = Trace::of(&all, rid);
    assert_eq!(r.services(), HashSet::from(["kvmesh-router"]));
    r.assert_linked("");
    r.assert_names(&["router.request", "router.validate", "router.admit"]);
    assert!(r.named("router.dispatch").is_empty());
    assert_eq!(r.one("router.admit")["status"], 2, "ERROR");
    assert_eq!(r.one("router.request")["status"], 2, "ERROR");

    // Every span that was exported belongs to one of these traces (the
    // load polls and health checks make none).
    let traces: HashMap<&str, usize> = all.iter().fold(HashMap::new(), |mut m, s| {
        *m.entry(s["trace_id"].as_str().unwrap_or_default())
            .or_default() += 1;
        m
    });
    assert_eq!(traces.len(), 4, "{traces:?}");
}
