//! Graceful drain (issue 15, item 5): SIGTERM to each role of a
//! three-process mesh (tiny model) while streams are in flight.
//!
//! For every role it holds that no client sees a stream that breaks off
//! without a terminal event (a finish, or an error event, then `[DONE]`),
//! that no page is left in use (each node prints what its drain found as
//! it exits), and that the process exits 0. Each role is tried twice: with
//! a drain timeout long enough for the streams to finish (they do, whole),
//! and with one that passes while they are held up by an injected delay
//! (they end with an error event, and their pages still come back).

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvmesh_integration::roles::{self, Proc};
use kvmesh_integration::{http, mesh, tiny_model_dir};
use serde_json::{json, Value};

const FAULT: &str = "x-kvmesh-fault";
/// Bound on anything the tests wait for.
const WITHIN: Duration = Duration::from_secs(30);
/// A drain that outlasts the held-up streams.
const LONG: &str = "20s";
/// A drain that passes while they are held up.
const SHORT: &str = "300ms";
const PROMPT: &str = "Once upon a time there was a little robot who";

/// How a client's stream ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// A chunk with this finish reason and completion token count, then
    /// `[DONE]`.
    Finished(String, u64),
    /// An error event with this code, then `[DONE]`.
    Error(String),
    /// Anything else: the stream broke off.
    Broken(Vec<String>),
}

fn classify(events: Vec<String>) -> End {
    if let [.., last, done] = events.as_slice() {
        if done == "[DONE]" {
            let v: Value = serde_json::from_str(last).unwrap_or(Value::Null);
            if let Some(code) = v["error"]["code"].as_str() {
                return End::Error(code.to_owned());
            }
            if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
                let n = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                return End::Finished(f.to_owned(), n);
            }
        }
    }
    End::Broken(events)
}

/// A streaming completion of `max_tokens` carrying the fault `fault`, read
/// on its own thread; the receiver hears once its first event arrived.
fn stream(addr: &str, max_tokens: u64, fault: &str) -> (mpsc::Receiver<()>, JoinHandle<End>) {
    let (tx, first) = mpsc::channel();
    let (addr, fault) = (addr.to_owned(), fault.to_owned());
    let h = std::thread::spawn(move || {
        let body =
            json!({"prompt": PROMPT, "max_tokens": max_tokens, "stream": true, "ignore_eos": true});
        let mut s =
            http::post_streaming_headers(&addr, "/v1/completions", &body, &[(FAULT, &fault)]);
        assert_eq!(s.status, 200, "the stream was refused");
        let mut events = Vec::new();
        while let Some(e) = s.next_event() {
            if events.is_empty() {
                let _ = tx.send(());
            }
            events.push(e);
        }
        classify(events)
    });
    (first, h)
}

/// One mesh of three processes; the role under test gets `--drain-timeout`.
struct Mesh {
    _dir: tempfile::TempDir,
    addr: String,
    router: Proc,
    prefill: Proc,
    decode: Proc,
}

impl Mesh {
    fn start(role: &str, drain: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let (file, p) = roles::tiny_mesh_file(dir.path());
        let flags = |r: &str| -> Vec<&str> {
            if r == role {
                vec!["--drain-timeout", drain]
            } else {
                Vec::new()
            }
        };
        let decode = roles::start_with("decode", &file, Some("decode-0"), &flags("decode"));
        // Prefill's debug log says when a call was accepted: the prefill
        // test stops the node exactly then.
        let prefill = roles::start_logged_with(
            "prefill",
            &file,
            Some("prefill-0"),
            "warn,kvmesh_prefill=debug",
            &flags("prefill"),
        );
        let mut rf = flags("router");
        rf.push("--fault-injection");
        let router = roles::start_with("router", &file, None, &rf);
        let addr = format!("127.0.0.1:{}", p[0]);
        roles::wait_healthy(&addr);
        Self {
            _dir: dir,
            addr,
            router,
            prefill,
            decode,
        }
    }
}

/// SIGTERM, then: exit 0 within [`WITHIN`], and (nodes) the drain line,
/// which must report nothing left behind; returns that line.
fn stop(p: &mut Proc, what: &str, drained: &str) -> String {
    p.terminate();
    // A supervisor on `$NOTIFY_SOCKET` hears that the drain began.
    assert!(
        p.notified("STOPPING", "1", WITHIN),
        "{what}: no STOPPING=1 after SIGTERM"
    );
    let line = p
        .out_line(drained, WITHIN)
        .unwrap_or_else(|| panic!("{what}: no {drained:?} line"));
    let status = p
        .wait_exit(WITHIN)
        .unwrap_or_else(|| panic!("{what} still running after SIGTERM"));
    assert!(status.success(), "{what} exited with {status}: {line}");
    line
}

fn assert_clean(line: &str) {
    assert!(
        line.contains(" 0 reservations open, 0 of "),
        "state left behind: {line}"
    );
}

/// New requests to a mesh whose node is draining are refused with 503 (a
/// request the node took before its drain began is still served: 200).
fn refused_while_draining(addr: &str) -> Value {
    let t0 = Instant::now();
    loop {
        let r = http::post(
            addr,
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 2}),
        );
        match r.status {
            503 => return r.json(),
            200 => {}
            s => panic!("while draining: {s} {}", r.body),
        }
        assert!(t0.elapsed() < WITHIN, "never refused while draining");
    }
}

#[test]
fn sigterm_to_decode_lets_streams_in_flight_finish() {
    let mut m = Mesh::start("decode", LONG);
    let (first, s) = stream(&m.addr, 16, "step:3=delay:1500");
    first.recv_timeout(WITHIN).expect("first token");
    m.decode.terminate();
    let refused = refused_while_draining(&m.addr);
    assert_eq!(refused["error"]["code"], "service_unavailable", "{refused}");
    assert_eq!(
        s.join().expect("stream"),
        End::Finished("length".into(), 16)
    );
    let line = stop(&mut m.decode, "decode", "drained");
    assert!(line.contains(" 0 streams cut"), "{line}");
    assert_clean(&line);
    assert_clean(&stop(&mut m.prefill, "prefill", "drained"));
    stop(&mut m.router, "router", "drained");
}

#[test]
fn sigterm_to_decode_past_its_deadline_ends_streams_with_an_error() {
    let mut m = Mesh::start("decode", SHORT);
    let (first, s) = stream(&m.addr, 16, "step:3=delay:2500");
    first.recv_timeout(WITHIN).expect("first token");
    let line = stop(&mut m.decode, "decode", "drained");
    assert!(line.contains(" 1 streams cut"), "{line}");
    assert_clean(&line);
    match s.join().expect("stream") {
        End::Error(code) => assert_eq!(code, "decode_failed"),
        other => panic!("the cut stream ended as {other:?}"),
    }
}

#[test]
fn sigterm_to_prefill_lets_prompts_in_flight_finish() {
    let mut m = Mesh::start("prefill", LONG);
    // Transfer-done held back 1.5 s: the prefill call is in flight.
    let (_first, s) = stream(&m.addr, 8, "done=delay:1500");
    m.prefill
        .log_line("prefill accepted", WITHIN)
        .expect("prefill took the call");
    m.prefill.terminate();
    let refused = refused_while_draining(&m.addr);
    assert_eq!(refused["error"]["code"], "service_unavailable", "{refused}");
    assert_eq!(s.join().expect("stream"), End::Finished("length".into(), 8));
    assert_clean(&stop(&mut m.prefill, "prefill", "drained"));
    assert_clean(&stop(&mut m.decode, "decode", "drained"));
}

#[test]
fn sigterm_to_the_router_lets_streams_in_flight_finish() {
    let mut m = Mesh::start("router", LONG);
    let (first, s) = stream(&m.addr, 16, "step:3=delay:1500");
    first.recv_timeout(WITHIN).expect("first token");
    m.router.terminate();
    assert_eq!(
        s.join().expect("stream"),
        End::Finished("length".into(), 16)
    );
    stop(&mut m.router, "router", "router drained");
    // Every page the router's requests held is back at decode.
    assert_clean(&stop(&mut m.decode, "decode", "drained"));
    assert_clean(&stop(&mut m.prefill, "prefill", "drained"));
}

#[test]
fn sigterm_to_the_router_past_its_deadline_ends_streams_with_an_error() {
    let mut m = Mesh::start("router", SHORT);
    let (first, s) = stream(&m.addr, 16, "step:3=delay:2500");
    first.recv_timeout(WITHIN).expect("first token");
    stop(&mut m.router, "router", "router drained");
    match s.join().expect("stream") {
        End::Error(code) => assert_eq!(code, "shutting_down"),
        other => panic!("the cut stream ended as {other:?}"),
    }
    // The cut request's reservation was aborted through the confirmation
    // path: decode has every page back.
    assert_clean(&stop(&mut m.decode, "decode", "drained"));
}

/// `kvmesh serve` (all roles in one process): SIGTERM drains the gateway,
/// then the nodes; the stream in flight finishes and the process exits 0
/// (it exits 1 if a node's drain left a page in use).
#[test]
fn sigterm_to_serve_drains_every_role() {
    let mut m = mesh::Mesh::start(
        &tiny_model_dir(),
        &["--fault-injection", "--drain-timeout", LONG],
    );
    let (first, s) = stream(&m.http, 16, "step:3=delay:1500");
    first.recv_timeout(WITHIN).expect("first token");
    let status = m
        .terminate(WITHIN)
        .expect("serve still running after SIGTERM");
    assert_eq!(
        s.join().expect("stream"),
        End::Finished("length".into(), 16)
    );
    assert!(status.success(), "kvmesh serve exited with {status}");
    assert!(
        m.notified("STOPPING", "1", Duration::from_secs(1)),
        "serve said no STOPPING=1 when its drain began"
    );
}

/// `serve --transport shm` keeps its KV socket in a directory only its user
/// can enter (0700, a random name), answers through it, and removes it,
/// with its pool file, when it exits.
#[test]
fn serve_over_shm_keeps_its_socket_private_and_leaves_nothing() {
    use std::os::unix::fs::PermissionsExt;
    let shm = tempfile::tempdir().expect("tempdir");
    let shm_dir = shm.path().to_str().expect("utf-8 path");
    let mut m = mesh::Mesh::start_logged(
        &tiny_model_dir(),
        &["--transport", "shm", "--shm-dir", shm_dir],
        "info",
    );
    let line = m
        .log_line(&["KV socket in a private directory"], WITHIN)
        .expect("serve names its socket");
    let socket = line
        .split("socket=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .map(std::path::PathBuf::from)
        .expect("socket=PATH");
    let dir = socket.parent().expect("socket directory").to_owned();
    let mode = std::fs::metadata(&dir)
        .expect("directory")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700, "{}", dir.display());
    assert!(socket.exists(), "{}", socket.display());
    let r = http::post(
        &m.http,
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let pools = || std::fs::read_dir(shm.path()).expect("shm dir").count();
    assert_eq!(pools(), 1, "the decode node's pool file");
    let status = m.terminate(WITHIN).expect("serve exits on SIGTERM");
    assert!(status.success(), "kvmesh serve exited with {status}");
    assert!(!dir.exists(), "{} left behind", dir.display());
    assert_eq!(pools(), 0, "the pool file is removed");
}
