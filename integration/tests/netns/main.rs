//! Hosts with their own network (issue 36 item 2): etcd, the router, 2
//! prefill and 2 decode nodes, each a real process in a network namespace
//! of its own, joined by links that `kvmesh_integration::netlab` shapes
//! and cuts (the kernel's `netem` where it has it, else the lab's TUN
//! switch; each run prints which).
//!
//! One lab per transport and TLS setting; on each, in order:
//! - [`links::lossy`]: 2 ms +- 0.5 ms and 0.5% loss on every link; the
//!   outputs equal `kvmesh generate`, every page comes back;
//! - [`links::bandwidth`]: 100 Mbit/s links; the KV bytes shipped per
//!   prompt token (checked against the pool geometry), the transfer's
//!   time at the link's rate and the TTFT, reported;
//! - [`partition::decode`]: a decode host cut off mid-transfer for 10 s;
//! - [`partition::prefill`]: a prefill host cut off mid-transfer for 10 s.
//!
//! [`links::mechanisms`] checks the links themselves on both mechanisms.
//!
//! They need root (namespaces, TUN or veth), so they are ignored by
//! `cargo test`; `scripts/netns-check.sh` runs them one at a time and
//! prints each `CHECKED` line. Each test bounds its own time
//! ([`Deadline`]); its lab deletes its namespaces on every way out, and
//! a lab started later sweeps those of a run that was killed.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvmesh_integration::netlab::mesh::{LabMesh, Options, Transport, NODES};
use kvmesh_integration::netlab::Shape;
use kvmesh_integration::{reference_text, tiny_model_dir};

mod links;
mod partition;

/// The most one lab's whole run may take.
const WHOLE: Duration = Duration::from_secs(300);

/// Aborts the test process if a test outlives its bound: with a
/// partition, a bug can make a wait block forever. The lab's processes
/// die with the process (`PR_SET_PDEATHSIG`), its TUN devices close, and
/// the next lab sweeps its namespaces; `scripts/netns-check.sh` sweeps at
/// its end too.
struct Deadline(mpsc::Sender<()>);

impl Deadline {
    fn new(what: &'static str, within: Duration) -> Self {
        let (tx, rx) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(within) {
                eprintln!("FAILED: {what} did not finish within {within:?}; aborting");
                std::process::abort();
            }
        });
        Self(tx)
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

/// Runs `f` on a thread and waits at most `within` for it; panics (the
/// thread is left behind) if it does not end in time.
fn within<T: Send + 'static>(what: &str, d: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(d)
        .unwrap_or_else(|_| panic!("{what}: no answer within {d:?}"))
}

/// Polls `cond` every 50 ms until it holds; how long that took. Panics
/// after `bound`.
fn wait_until(what: &str, bound: Duration, mut cond: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < bound, "{what}: not within {bound:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    t0.elapsed()
}

/// The reference answer of `prompt`, `max_tokens` greedy tokens.
fn reference(prompt: &str, max_tokens: usize) -> String {
    reference_text(&tiny_model_dir(), prompt, false, max_tokens)
}

/// A prompt of about `words` words, distinct per `tag` (the prefix cache
/// must not turn a transfer into a hit).
fn long_prompt(tag: &str, words: usize) -> String {
    let pool = [
        "river", "stone", "lamp", "north", "quiet", "garden", "copper", "wind", "seven", "paper",
    ];
    let mut p = format!("{tag}:");
    for i in 0..words {
        p.push(' ');
        p.push_str(pool[(i * 7 + tag.len()) % pool.len()]);
    }
    p
}

/// Every node's pool whole again in a report newer than this call, and
/// every decode grant ended exactly once (granted = sum of outcomes): no
/// page leaked. Returns the decode nodes' outcome counts (those above 0).
fn assert_nothing_leaked(mesh: &LabMesh, what: &str) -> Vec<(String, String, f64)> {
    // Figures from reports taken after this call.
    mesh.wait_fresh_reports(&NODES);
    let t0 = Instant::now();
    loop {
        let m = mesh.metrics();
        let whole = NODES.iter().all(|n| {
            let total = m.first("kvmesh_node_kv_pages_total", &[("node", n)]);
            total.is_some() && total == m.first("kvmesh_node_kv_pages_free", &[("node", n)])
        });
        let closed = NODES.iter().filter(|n| n.starts_with("decode")).all(|n| {
            let granted = m
                .first("kvmesh_node_reservations_granted_total", &[("node", n)])
                .unwrap_or(-1.0);
            let ended: f64 = outcomes(&m, n).iter().map(|(_, v)| v).sum();
            granted == ended
        });
        if whole && closed {
            return NODES
                .iter()
                .filter(|n| n.starts_with("decode"))
                .flat_map(|n| {
                    outcomes(&m, n)
                        .into_iter()
                        .filter(|(_, v)| *v > 0.0)
                        .map(|(k, v)| (n.to_string(), k, v))
                })
                .collect();
        }
        let last = m.text();
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{what}: pages or reservations did not close within 20 s:\n{last}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `kvmesh_node_reservations_total{node=NODE,outcome=K}` for each K.
fn outcomes(m: &kvmesh_client::Metrics, node: &str) -> Vec<(String, f64)> {
    m.named("kvmesh_node_reservations_total")
        .filter(|s| s.label("node") == Some(node))
        .filter_map(|s| Some((s.label("outcome")?.to_owned(), s.value)))
        .collect()
}

fn run(transport: Transport, tls: bool) {
    let options = Options::tiny(transport, tls);
    let what = options.describe();
    let _deadline = Deadline::new("a netns lab run", WHOLE);
    let t0 = Instant::now();
    let mut mesh = LabMesh::start(options);
    println!(
        "CHECKED [{what}] lab up in {:.1} s: etcd, router, prefill-0/1, decode-0/1 in 6 namespaces, 198.18.0.10-15; links: {}",
        t0.elapsed().as_secs_f64(),
        mesh.lab.mechanism()
    );
    links::lossy(&mesh, &what);
    links::bandwidth(&mesh, &what);
    mesh.lab.shape_all(Shape::default());
    partition::decode(&mut mesh, &what);
    partition::prefill(&mut mesh, &what);
    println!(
        "CHECKED [{what}] whole run in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

#[test]
#[ignore = "needs root and network namespaces: scripts/netns-check.sh runs it"]
fn the_links_delay_cap_and_cut_on_both_mechanisms() {
    let _deadline = Deadline::new("the link mechanisms", Duration::from_secs(120));
    links::mechanisms();
}

#[test]
#[ignore = "needs root and network namespaces: scripts/netns-check.sh runs it"]
fn tcp_without_tls() {
    run(Transport::Tcp, false);
}

#[test]
#[ignore = "needs root and network namespaces: scripts/netns-check.sh runs it"]
fn tcp_with_mutual_tls() {
    run(Transport::Tcp, true);
}

#[test]
#[ignore = "needs root, network namespaces and libucx0: scripts/netns-check.sh runs it"]
fn ucx_without_tls() {
    run(Transport::Ucx, false);
}

#[test]
#[ignore = "needs root, network namespaces and libucx0: scripts/netns-check.sh runs it"]
fn ucx_with_mutual_tls() {
    run(Transport::Ucx, true);
}

/// How a streamed completion went.
#[derive(Debug)]
struct Streamed {
    /// Time to its first text chunk.
    ttft: Option<Duration>,
    /// When its last event came (or the stream broke).
    ended: Instant,
    /// The text of its chunks, concatenated.
    text: String,
    /// The usage's prompt tokens, if its last chunk had them.
    prompt_tokens: Option<u64>,
    /// The error event's code, if it ended with one.
    error: Option<String>,
    /// Whether it ended with a finish reason and `[DONE]`.
    finished: bool,
}

/// Starts a streamed greedy completion from inside the router's
/// namespace, on a thread of its own; its result comes on the receiver.
fn stream(mesh: &LabMesh, prompt: &str, max_tokens: usize) -> mpsc::Receiver<Streamed> {
    let (tx, rx) = mpsc::channel();
    let ns = mesh.lab.host("router").ns.name.clone();
    let body = serde_json::json!({
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true,
    });
    std::thread::spawn(move || {
        let r = kvmesh_integration::netlab::ns::enter(&ns, || {
            let sent = Instant::now();
            let mut s = kvmesh_integration::http::post_streaming(
                kvmesh_integration::netlab::mesh::ROUTER_HTTP,
                "/v1/completions",
                &body,
            );
            let mut r = Streamed {
                ttft: None,
                ended: sent,
                text: String::new(),
                prompt_tokens: None,
                error: None,
                finished: false,
            };
            let mut finish = false;
            while let Some(e) = s.next_event() {
                if e == "[DONE]" {
                    r.finished = finish && r.error.is_none();
                    break;
                }
                let v: serde_json::Value = serde_json::from_str(&e).unwrap_or_default();
                if let Some(code) = v["error"]["code"].as_str() {
                    r.error = Some(code.to_owned());
                }
                if let Some(t) = v["choices"][0]["text"].as_str() {
                    if r.ttft.is_none() && !t.is_empty() {
                        r.ttft = Some(sent.elapsed());
                    }
                    r.text.push_str(t);
                }
                if v["choices"][0]["finish_reason"].is_string() {
                    finish = true;
                }
                if let Some(n) = v["usage"]["prompt_tokens"].as_u64() {
                    r.prompt_tokens = Some(n);
                }
            }
            r.ended = Instant::now();
            r
        });
        let _ = tx.send(r);
    });
    rx
}
