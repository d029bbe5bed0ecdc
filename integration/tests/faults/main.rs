//! The fault matrix (issue 5, items 1-3): faults injected at each step of
//! the handshake and of decoding, through the `x-kvmesh-fault` header of a
//! testing build started with `--fault-injection`; the cross-tenant leak
//! test; planted bugs that switch one defence off at a time.
//!
//! Every case asserts its outcome: output equal to the reference engine's
//! (`kvmesh generate`) or a clear error to the client; the pages back to
//! free on every node within a bound; the guard-violation counter at zero
//! except where a case plants a violation on purpose (and then that
//! request fails).

use std::path::Path;
use std::time::{Duration, Instant};

use kvmesh_faults::{Expect, CATALOG};
use kvmesh_integration::http::{self, post_streaming_headers};
use kvmesh_integration::mesh::Mesh;
use kvmesh_integration::{roles, tiny_model_dir};
use kvmesh_kvxfer::transport::TransportKind;
use serde_json::{json, Value};

mod planted;

/// Lease and abort timeout of the meshes here: short, so that the cases
/// that end by lease expiry or revocation end quickly.
const LEASE_MS: &str = "2000";
const ABORT_TIMEOUT_MS: &str = "1000";

/// The matrix: one request without a fault, then one per entry of the
/// fault catalogue (`kvmesh_faults::CATALOG`, which the soak draws from
/// too), each held to its expected outcome.
fn matrix() -> impl Iterator<Item = (&'static str, Expect)> {
    std::iter::once(("", Expect::Equal)).chain(CATALOG.iter().map(|e| (e.spec, e.expect)))
}

/// A request's result: the text, or the error the client saw.
fn complete(
    addr: &str,
    prompt: &str,
    max_tokens: usize,
    stream: bool,
    headers: &[(&str, &str)],
) -> Result<String, String> {
    let body =
        json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream});
    if !stream {
        let r = http::request_headers(
            addr,
            "POST",
            "/v1/completions",
            Some(&body.to_string()),
            headers,
        );
        if r.status != 200 {
            return Err(format!("{}: {}", r.status, r.body));
        }
        return Ok(r.json()["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_owned());
    }
    let mut s = post_streaming_headers(addr, "/v1/completions", &body, headers);
    if s.status != 200 {
        return Err(format!("status {}", s.status));
    }
    let mut text = String::new();
    while let Some(d) = s.next_event() {
        if d == "[DONE]" {
            return Ok(text);
        }
        let v: Value = serde_json::from_str(&d).map_err(|e| format!("{e}: {d}"))?;
        if v.get("error").is_some() {
            return Err(d);
        }
        text.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
    }
    Err("stream ended without [DONE]".into())
}

/// The HTTP status and error code of a failure [`complete`] returned: an
/// unstreamed `STATUS: BODY`, or a stream's error event (status 200: the
/// stream had begun). `None` for a stream refused before it began (only
/// its status is read) or anything that is not an OpenAI-style error.
fn failure(e: &str) -> Option<(u16, String)> {
    let (status, body) = match e.split_once(": {") {
        Some((s, rest)) if s.parse::<u16>().is_ok() => (s.parse().ok()?, format!("{{{rest}")),
        _ => (200, e.to_owned()),
    };
    let v: Value = serde_json::from_str(&body).ok()?;
    Some((status, v["error"]["code"].as_str()?.to_owned()))
}

fn guard_violations(mesh: &Mesh) -> f64 {
    mesh.metric("kvmesh_node_kv_guard_violations_total{node=\"decode-0\"")
        .unwrap_or(0.0)
}

/// Runs the matrix against `mesh` (model `model`): case `i` sends
/// `Case i: PROMPT`, so that no case's KV equals what an earlier case left
/// in the same pages (a lost frame over identical stale data would go
/// unnoticed, rightly). Every output must equal the reference or be the
/// expected error, must not contain any of `forbidden`, and every case
/// must leave the pools whole. Returns the number of cases.
fn run_matrix(
    mesh: &Mesh,
    model: &Path,
    prompt: &str,
    max_tokens: usize,
    auth: Option<&str>,
    forbidden: &[&str],
    one_sided: bool,
) -> usize {
    let bearer = auth.map(|k| format!("Bearer {k}"));
    let mut cases = 0;
    for (i, (spec, expect)) in matrix().enumerate() {
        cases += 1;
        let stream = i % 2 == 1;
        // Every case shares the prompt's leading pages, so with the
        // prefix cache on (the default) each fault meets a request served
        // partly from cached pages, on both sides, and a later case would
        // read any page a fault left in the cache; the prompt again after
        // the case number keeps the pages prefill writes (what `frame:N`
        // faults count) as many as the whole prompt's.
        let prompt = format!("{prompt} (case {i}) {prompt}");
        let may_equal = expect == Expect::Equal || (expect == Expect::ErrorInOrder && one_sided);
        let want = may_equal.then(|| reference(model, &prompt, max_tokens));
        let mut headers = vec![("x-kvmesh-fault", spec)];
        if let Some(b) = &bearer {
            headers.push(("Authorization", b.as_str()));
        }
        let before = guard_violations(mesh);
        let t0 = Instant::now();
        let got = complete(&mesh.http, &prompt, max_tokens, stream, &headers);
        let took = t0.elapsed();
        // Bounded: nothing waits past the lease plus margin.
        assert!(took < Duration::from_secs(15), "{spec}: took {took:?}");
        if let Ok(text) = &got {
            for m in forbidden {
                assert!(!text.contains(m), "{spec}: output carries {m:?}: {text:?}");
            }
        }
        match expect {
            Expect::Equal => {
                assert_eq!(
                    got.as_deref().ok(),
                    want.as_deref(),
                    "{spec} (stream={stream}): {got:?}"
                )
            }
            Expect::ErrorInOrder if one_sided && got.is_ok() => {
                assert_eq!(
                    got.as_deref().ok(),
                    want.as_deref(),
                    "{spec} (stream={stream})"
                )
            }
            Expect::Error | Expect::GuardError | Expect::ErrorInOrder => {
                let e = got.expect_err(&format!("{spec} (stream={stream}) must fail"));
                match failure(&e) {
                    Some((status, code)) => assert!(
                        !code.is_empty() && (status == 200 || status >= 400),
                        "{spec}: not a clear error: {e}"
                    ),
                    None => assert!(
                        e.starts_with("status 4") || e.starts_with("status 5"),
                        "{spec}: not a clear error: {e}"
                    ),
                }
                // What the client reads names no node (the router logs it).
                for node in ["decode-0", "prefill-0"] {
                    assert!(!e.contains(node), "{spec}: {node} in {e}");
                }
            }
        }
        mesh.assert_pages_come_back();
        let after = guard_violations(mesh);
        let planted = if expect == Expect::GuardError {
            1.0
        } else {
            0.0
        };
        assert_eq!(after - before, planted, "{spec}: guard violations");
        eprintln!("fault {spec:24} stream={stream:5} -> {expect:?} ok ({took:?})");
    }
    cases
}

fn start_tiny(extra: &[&str]) -> Mesh {
    let mut args = vec![
        "--fault-injection",
        "--lease-ms",
        LEASE_MS,
        "--abort-timeout-ms",
        ABORT_TIMEOUT_MS,
    ];
    args.extend_from_slice(extra);
    Mesh::start(&tiny_model_dir(), &args)
}

/// A prompt of several pages (page size 16) on the tiny model.
const PROMPT: &str =
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the door";
const MAX_TOKENS: usize = 12;

fn reference(model: &Path, prompt: &str, max_tokens: usize) -> String {
    kvmesh_integration::reference_text(model, prompt, false, max_tokens)
}

#[test]
fn fault_matrix_tcp() {
    let mesh = start_tiny(&["--transport", "tcp"]);
    let n = run_matrix(
        &mesh,
        &tiny_model_dir(),
        PROMPT,
        MAX_TOKENS,
        None,
        &[],
        false,
    );
    assert_eq!(n, CATALOG.len() + 1);
    wait_for_cache_hits(&mesh);
}

/// Waits until both nodes' load reports count prefix-cache hits (the
/// matrix ran with cached pages on both sides).
fn wait_for_cache_hits(mesh: &Mesh) {
    for node in ["prefill-0", "decode-0"] {
        let selector = format!("kvmesh_node_prefix_cache_hit_tokens_total{{node=\"{node}\"");
        wait_until(&format!("{node}'s prefix cache hits"), || {
            metric_of(&mesh.http, &selector).is_some_and(|v| v > 0.0)
        });
    }
}

#[test]
fn fault_matrix_shm() {
    let mesh = start_tiny(&["--transport", "shm"]);
    run_matrix(
        &mesh,
        &tiny_model_dir(),
        PROMPT,
        MAX_TOKENS,
        None,
        &[],
        true,
    );
    wait_for_cache_hits(&mesh);
}

#[test]
fn fault_matrix_ucx() {
    if let Err(e) = TransportKind::Ucx.available() {
        eprintln!("not run: {e}");
        return;
    }
    let mesh = start_tiny(&["--transport", "ucx"]);
    run_matrix(
        &mesh,
        &tiny_model_dir(),
        PROMPT,
        MAX_TOKENS,
        None,
        &[],
        true,
    );
    wait_for_cache_hits(&mesh);
}

#[test]
fn bad_fault_specs_are_refused_with_the_header_named() {
    let mesh = start_tiny(&[]);
    for spec in ["frame=drop", "verify=drop", "nonsense", "done=delay:999999"] {
        let r = complete(&mesh.http, "hi", 2, false, &[("x-kvmesh-fault", spec)]);
        let e = r.expect_err(spec);
        assert_eq!(
            failure(&e),
            Some((400, "invalid_fault_spec".to_owned())),
            "{spec}: {e}"
        );
        assert!(e.contains("\"param\":\"x-kvmesh-fault\""), "{spec}: {e}");
    }
    // Without --fault-injection the header is ignored entirely.
    let plain = Mesh::start(&tiny_model_dir(), &[]);
    let want = reference(&tiny_model_dir(), "hi", 2);
    let got = complete(
        &plain.http,
        "hi",
        2,
        false,
        &[("x-kvmesh-fault", "frame:0=drop")],
    );
    assert_eq!(got.as_deref(), Ok(want.as_str()));
}

/// A client that leaves while its prompt is being transferred (the
/// writer held up inside its first page write, 600 ms, shorter than the
/// 1 s abort timeout), with the abort and its confirmation faulted: the
/// reservation ends the way the protocol says (confirmed, revoked when the
/// confirmation is withheld, or by its lease when the abort itself is lost:
/// dropping the Generate stream is the only abort there is) and the pages
/// come back every time.
#[test]
fn vanishing_clients_with_faulted_aborts_and_confirmations() {
    for transport in TransportKind::ALL {
        if let Err(e) = transport.available() {
            eprintln!("{transport}: not run ({e})");
            continue;
        }
        let mesh = start_tiny(&["--transport", transport.name()]);
        for (spec, outcome) in [
            ("frame:0=delay:600", "aborted"),
            ("frame:0=delay:600,confirm=drop", "abort_timed_out"),
            ("frame:0=delay:600,confirm=delay:200", "aborted"),
            ("frame:0=delay:600,confirm=duplicate", "aborted"),
            ("frame:0=delay:600,abort=drop", "lease_expired"),
            ("frame:0=delay:600,abort=duplicate", "aborted"),
            ("frame:0=delay:600,abort=delay:100", "aborted"),
        ] {
            let ended = format!(
                "kvmesh_node_reservations_total{{node=\"decode-0\",outcome=\"{outcome}\"}}"
            );
            let before = mesh.metric(&ended).unwrap_or(0.0);
            let body =
                json!({"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": true});
            let s = post_streaming_headers(
                &mesh.http,
                "/v1/completions",
                &body,
                &[("x-kvmesh-fault", spec)],
            );
            assert_eq!(s.status, 200, "{spec}");
            std::thread::sleep(Duration::from_millis(150));
            drop(s);
            mesh.wait_for_metric(&ended, before + 1.0);
            mesh.assert_pages_come_back();
            assert_eq!(guard_violations(&mesh), 0.0, "{spec}");
            eprintln!("{transport}: vanished with {spec}: {outcome}, pages back");
        }
        // A slow reader gets the whole answer, equal to the reference.
        let want = reference(&tiny_model_dir(), PROMPT, 24);
        let body = json!({"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stream": true});
        let mut s = post_streaming_headers(&mesh.http, "/v1/completions", &body, &[]);
        let mut text = String::new();
        while let Some(d) = s.next_event() {
            std::thread::sleep(Duration::from_millis(40));
            if d == "[DONE]" {
                break;
            }
            let v: Value = serde_json::from_str(&d).expect("event");
            text.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
        }
        assert_eq!(text, want, "{transport}: slow reader");
        mesh.assert_pages_come_back();
    }
}

/// More requests than the decode pool holds at once: they wait for pages
/// (bounded) and all complete equal to the reference; none fails, none
/// hangs, every page comes back.
#[test]
fn exhausted_pool_waits_then_serves_everyone() {
    // 64 slots: one request of ~30 tokens + 12 needs 3 pages of 16; four
    // pages in all, so only one runs at a time.
    let mesh = start_tiny(&["--kv-pool-tokens", "64", "--allow-small-pool"]);
    let want = reference(&tiny_model_dir(), PROMPT, MAX_TOKENS);
    let handles: Vec<_> = (0..6)
        .map(|i| {
            let addr = mesh.http.clone();
            std::thread::spawn(move || complete(&addr, PROMPT, MAX_TOKENS, i % 2 == 0, &[]))
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().expect("client").as_deref(), Ok(want.as_str()));
    }
    mesh.assert_pages_come_back();
}

/// The refusals the decode node counted, all kinds.
fn kv_refused(mesh: &Mesh) -> f64 {
    mesh.metrics()
        .lines()
        .filter(|l| l.starts_with("kvmesh_node_kv_refused_total{node=\"decode-0\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn granted(mesh: &Mesh) -> f64 {
    mesh.metric("kvmesh_node_reservations_granted_total{node=\"decode-0\"")
        .unwrap_or(0.0)
}

/// Secret markers of tenant A.
const MARKERS: [&str; 3] = ["ZEPHYR-7731", "QUOKKA-2208", "MARMOT-9154"];

/// The leak test (item 2) on the default model, scrubbing off, a decode
/// pool smaller than the context window: tenant A fills the pools with
/// prompts carrying secret markers and long answers; once A's pages are
/// released (and so reused: the pool is small), tenant B runs the whole
/// fault matrix and over-length prompts. Every B answer is a clear error
/// or equal to the reference token for token, none carries a marker, the
/// pools come back whole, and the guard counter moves only where a case
/// plants a violation.
#[test]
fn cross_tenant_leak_with_scrubbing_off() {
    let Some(model) = kvmesh_model::default_model::cached_default_model() else {
        eprintln!("note: default model not cached; skipped (run `kvmesh fetch-model`)");
        return;
    };
    let mesh = Mesh::start(
        &model,
        &[
            "--fault-injection",
            // Prefill of the real model on 2 busy cores takes its time.
            "--lease-ms",
            "8000",
            "--abort-timeout-ms",
            ABORT_TIMEOUT_MS,
            "--scrub",
            "off",
            "--max-model-len",
            "1024",
            "--kv-pool-tokens",
            "320",
            "--allow-small-pool",
            "--api-key",
            "key-a=tenant-a",
            "--api-key",
            "key-b=tenant-b",
            "--api-key",
            "kvmesh-test-scrape-key=scraper:metrics",
        ],
    );
    // Tenant A: three long answers at once fill most of the pool.
    let a: Vec<_> = MARKERS
        .iter()
        .map(|m| {
            let addr = mesh.http.clone();
            let prompt = format!(
                "The secret code is {m}. Remember it: {m}. Again, the secret code is {m}. Repeat the secret code ten times:"
            );
            std::thread::spawn(move || {
                complete(&addr, &prompt, 48, true, &[("Authorization", "Bearer key-a")])
            })
        })
        .collect();
    let a: Vec<String> = a
        .into_iter()
        .map(|h| h.join().expect("tenant A").expect("tenant A's answer"))
        .collect();
    // A's own KV carries its markers (its answers repeat them).
    assert!(
        a.iter().zip(MARKERS).any(|(t, m)| t.contains(m)),
        "tenant A's answers never repeat a marker: {a:?}"
    );
    mesh.assert_pages_come_back();

    // Tenant B: the fault matrix on a prompt of its own.
    run_matrix(
        &mesh,
        &model,
        "List three colours:",
        10,
        Some("key-b"),
        &MARKERS,
        false,
    );

    // Over-length for the pool (fits the 1024 window, not the 320-token
    // pool): refused at once, no reservation granted, nothing computed.
    let before = granted(&mesh);
    let long = "word ".repeat(200);
    for stream in [false, true] {
        let r = complete(
            &mesh.http,
            &long,
            200,
            stream,
            &[("Authorization", "Bearer key-b")],
        );
        let e = r.expect_err("over-length must be refused");
        assert!(e.starts_with("400") || e == "status 400", "{e}");
    }
    // The decode node's count, in a report newer than the refusals.
    kvmesh_integration::http::wait_fresh_reports(&mesh.http, &["decode-0"]);
    assert_eq!(granted(&mesh), before, "an over-length prompt got pages");
    mesh.assert_pages_come_back();
}

/// A mesh of three processes from one mesh file (tiny model), the router
/// honouring fault headers: returns the router's address and the
/// processes (router, prefill, decode).
fn process_mesh(dir: &Path) -> (String, [roles::Proc; 3]) {
    let (file, p) = roles::tiny_mesh_file(dir);
    let d = roles::start("decode", &file, Some("decode-0"));
    let pr = roles::start("prefill", &file, Some("prefill-0"));
    let r = roles::start_with("router", &file, None, &["--fault-injection"]);
    let addr = format!("127.0.0.1:{}", p[0]);
    roles::wait_healthy(&addr);
    (addr, [r, pr, d])
}

/// Polls `done` every 100 ms until it holds (bounded: 10 s; node counters
/// arrive with load reports, so they lag a little).
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "never happened: {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn metric_of(addr: &str, selector: &str) -> Option<f64> {
    http::metric(addr, selector)
}

/// The prefill process dies inside the transfer (after one page write):
/// the client gets a clear error within seconds, the decode node revokes
/// the dead writer's grant (its connection is gone) and has every page
/// back, and with no prefill node left the router answers 503.
#[test]
fn prefill_crash_mid_transfer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (addr, procs) = process_mesh(dir.path());
    let t0 = Instant::now();
    let e = complete(
        &addr,
        PROMPT,
        8,
        true,
        &[("x-kvmesh-fault", "frame:1=crash")],
    )
    .expect_err("the prefill process died");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    // The router hears of it from whichever node tells first: the prefill
    // call cut, or decode's stream ending with the writer lost.
    let (status, code) = failure(&e).expect("an error event");
    assert_eq!(status, 200, "the stream had begun: {e}");
    assert!(code == "prefill_failed" || code == "decode_failed", "{e}");
    let lost = "kvmesh_node_reservations_total{node=\"decode-0\",outcome=\"writer_lost\"}";
    wait_until("the dead writer's reservation ended", || {
        metric_of(&addr, lost) == Some(1.0)
    });
    let pages = |name: &str| metric_of(&addr, &format!("{name}{{node=\"decode-0\""));
    assert_eq!(
        pages("kvmesh_node_kv_pages_free"),
        pages("kvmesh_node_kv_pages_total")
    );
    roles::wait_node_down(&addr, "prefill-0");
    let r = http::post(
        &addr,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 2}),
    );
    assert_eq!(r.status, 503, "{}", r.body);
    drop(procs);
}

/// The decode process dies at its second decode step: the client's stream
/// ends with an error event within seconds (no hang), and the router then
/// answers 503.
#[test]
fn decode_crash_mid_generation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (addr, procs) = process_mesh(dir.path());
    let t0 = Instant::now();
    let e = complete(
        &addr,
        PROMPT,
        24,
        true,
        &[("x-kvmesh-fault", "step:1=crash")],
    )
    .expect_err("the decode process died");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert_eq!(failure(&e), Some((200, "decode_failed".to_owned())), "{e}");
    roles::wait_node_down(&addr, "decode-0");
    let r = http::post(
        &addr,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 2}),
    );
    assert_eq!(r.status, 503, "{}", r.body);
    drop(procs);
}
