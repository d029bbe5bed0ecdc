//! The numbers an operator plans with (issue 36 item 3): TTFT and ITL
//! p50/p99 on the netlab's six hosts against each link's latency (0, 1,
//! 5, 20 ms one way) and rate (100 Mbit/s, 1 and 10 Gbit/s), on tcp with
//! and without mutual TLS and on ucx, for the default model (SmolLM2-135M:
//! 23 KB of KV per prompt token, compute-bound on a CPU) and the tiny test
//! model (768 B per token, where the network and the protocol's round
//! trips show); with the KV bytes each request shipped, the prefill nodes'
//! mean transfer time, the link mechanism's own ceiling, and how long a
//! partitioned decode node takes to leave routing and to come back. A
//! benchmark, never a check: it asserts only that each run completed, and
//! prints Markdown (also written to `$KVMESH_NETLAB_BENCH_OUT` when set)
//! for docs/network.md.
//!
//! `cargo test -p kvmesh-integration --test netns_bench -- --ignored
//! --nocapture` as root: about 12 minutes for SmolLM2 and 5 for the tiny
//! model on two cores. `KVMESH_NETLAB_BENCH_MODELS` (`smollm2,tiny`)
//! picks the passes, `KVMESH_NETLAB_BENCH_REQUESTS` (8; three times that
//! for the tiny model) the requests per cell.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kvmesh_integration::netlab::mesh::{LabMesh, Options, Transport, ROUTER_HTTP};
use kvmesh_integration::netlab::Shape;

const OUTPUT_TOKENS: usize = 16;

/// One cell's figures, ms: TTFT p50, p99, ITL p50, p99.
type Cell = [f64; 4];

/// The decode nodes' verified KV bytes, as the router last heard.
fn kv_bytes(mesh: &LabMesh) -> f64 {
    mesh.wait_fresh_reports(&["decode-0", "decode-1"]);
    ["decode-0", "decode-1"]
        .iter()
        .map(|n| {
            mesh.node_value("kvmesh_node_kv_bytes_received_total", n)
                .unwrap_or(0.0)
        })
        .sum()
}

/// The prefill nodes' KV transfer time histogram, summed: (seconds,
/// transfers), scraped from their own `/metrics` (from the router's
/// host); `None` with mutual TLS, where that port wants a certificate.
fn transfer_totals(mesh: &LabMesh) -> Option<(f64, f64)> {
    if mesh.options.tls {
        return None;
    }
    let addrs: Vec<String> = ["prefill-0", "prefill-1"]
        .iter()
        .map(|p| format!("{}:7101", mesh.lab.host(p).addr))
        .collect();
    Some(mesh.client(|_| {
        addrs.iter().fold((0.0, 0.0), |(s, n), a| {
            let m = kvmesh_integration::http::metrics(a);
            (
                s + m.sum("kvmesh_kv_transfer_duration_seconds_sum", &[]),
                n + m.sum("kvmesh_kv_transfer_duration_seconds_count", &[]),
            )
        })
    }))
}

/// `kvmesh bench` against the router, run inside its namespace, with
/// prompts of their own (`seed`: the nodes' prefix caches must not turn
/// a transfer into a hit); its figures, the KV bytes shipped per request
/// and the prefill nodes' mean transfer time (first layer to
/// transfer-done, overlapping the forward pass), ms.
fn bench(
    mesh: &LabMesh,
    model: &Path,
    prompt_tokens: usize,
    requests: usize,
    dir: &Path,
    tag: &str,
    seed: u64,
) -> (Cell, f64, Option<f64>) {
    let json = dir.join(format!("{tag}.json"));
    let b0 = kv_bytes(mesh);
    let x0 = transfer_totals(mesh);
    let out = Command::new("ip")
        .args(["netns", "exec", &mesh.lab.host("router").ns.name])
        .arg(kvmesh_integration::kvmesh_bin())
        .arg("bench")
        .args(["--url", &format!("http://{ROUTER_HTTP}")])
        .arg("--model")
        .arg(model)
        .args(["--requests", &requests.to_string()])
        .args(["--warmup", "2", "--concurrency", "1"])
        .args(["--seed", &seed.to_string()])
        .args(["--prompt-len", &format!("fixed:{prompt_tokens}")])
        .args(["--output-len", &format!("fixed:{OUTPUT_TOKENS}")])
        .arg("--json")
        .arg(&json)
        .env("KVMESH_LOG", "warn")
        .output()
        .expect("kvmesh bench");
    assert!(
        out.status.success(),
        "bench {tag}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("report")).expect("JSON");
    let m = &v["mesh"];
    let f = |k: &str, p: &str| m[k][p].as_f64().unwrap_or(f64::NAN);
    let shipped = (kv_bytes(mesh) - b0) / (requests + 2) as f64;
    let transfer = match (x0, transfer_totals(mesh)) {
        (Some((s0, n0)), Some((s1, n1))) if n1 > n0 => Some((s1 - s0) / (n1 - n0) * 1e3),
        _ => None,
    };
    (
        [
            f("ttft_ms", "p50"),
            f("ttft_ms", "p99"),
            f("itl_ms", "p50"),
            f("itl_ms", "p99"),
        ],
        shipped,
        transfer,
    )
}

/// Bulk TCP from decode-0 to decode-1 for 2 s on unshaped links: the
/// link mechanism's own ceiling, Gbit/s.
fn ceiling(mesh: &LabMesh) -> f64 {
    let addr = std::net::SocketAddr::from((mesh.lab.host("decode-1").addr, 9099));
    let listener = mesh
        .lab
        .host("decode-1")
        .ns
        .enter(|| std::net::TcpListener::bind(addr).expect("bind"));
    let sink = std::thread::spawn(move || {
        use std::io::Read;
        let (mut s, _) = listener.accept().expect("accept");
        let mut buf = vec![0u8; 1 << 20];
        let mut n = 0u64;
        while let Ok(k) = s.read(&mut buf) {
            if k == 0 {
                break;
            }
            n += k as u64;
        }
        n
    });
    let t = mesh.lab.host("decode-0").ns.enter(|| {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        let buf = vec![7u8; 1 << 20];
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(2) {
            s.write_all(&buf).expect("write");
        }
        t0.elapsed()
    });
    let n = sink.join().expect("sink");
    n as f64 * 8.0 / t.as_secs_f64() / 1e9
}

/// Cuts decode-1 (idle) off: seconds until the router stops choosing it
/// and until etcd drops it; heals after 10 s: seconds until it is
/// registered and routed again.
fn partition_times(mesh: &LabMesh) -> [f64; 4] {
    let up = || mesh.node_value("kvmesh_node_up", "decode-1") == Some(1.0);
    let registered = || mesh.registered().iter().any(|n| n == "decode-1");
    let wait = |cond: &dyn Fn() -> bool, t0: Instant| {
        while !cond() {
            assert!(
                t0.elapsed() < Duration::from_secs(40),
                "bench: partition timing"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        t0.elapsed().as_secs_f64()
    };
    mesh.lab.set_link("decode-1", false);
    let cut = Instant::now();
    let left = wait(&|| !up(), cut);
    let expired = wait(&|| !registered(), cut);
    std::thread::sleep(Duration::from_secs(10).saturating_sub(cut.elapsed()));
    mesh.lab.set_link("decode-1", true);
    let healed = Instant::now();
    let back_etcd = wait(&registered, healed);
    let back = wait(&up, healed);
    [left, expired, back_etcd, back]
}

#[test]
#[ignore = "a benchmark on network namespaces (root, ~15 min): see the module docs"]
fn link_latency_and_rate_against_ttft_and_itl() {
    let model = kvmesh_model::default_model::cached_default_model()
        .expect("the default model: run `kvmesh fetch-model` first");
    let requests: usize = std::env::var("KVMESH_NETLAB_BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let dir = tempfile::tempdir().expect("tempdir");
    let links: Vec<(String, Shape)> = [0u64, 1, 5, 20]
        .iter()
        .map(|ms| {
            (
                format!("{ms} ms, unlimited"),
                Shape {
                    latency: Duration::from_millis(*ms),
                    ..Shape::default()
                },
            )
        })
        .chain(
            [100_000_000u64, 1_000_000_000, 10_000_000_000]
                .iter()
                .map(|r| {
                    (
                        format!(
                            "0 ms, {}",
                            Shape {
                                rate_bps: Some(*r),
                                ..Shape::default()
                            }
                            .to_string()
                            .rsplit(", ")
                            .next()
                            .unwrap_or_default()
                        ),
                        Shape {
                            rate_bps: Some(*r),
                            ..Shape::default()
                        },
                    )
                }),
        )
        .collect();
    // The default model (compute dominates on CPU), then the tiny one
    // (the network and the protocol's round trips dominate);
    // KVMESH_NETLAB_BENCH_MODELS picks (`smollm2`, `tiny`, or both).
    let which = std::env::var("KVMESH_NETLAB_BENCH_MODELS").unwrap_or("smollm2,tiny".into());
    let mut text = String::new();
    let mut seed = 0u64;
    for (label, model, prompt_tokens, n) in [
        ("smollm2", model, 256, requests),
        (
            "tiny",
            kvmesh_integration::tiny_model_dir(),
            200,
            requests * 3,
        ),
    ] {
        if !which.split(',').any(|w| w == label) {
            continue;
        }
        let pass = Pass {
            model: &model,
            prompt_tokens,
            requests: n,
            dir: dir.path(),
        };
        text.push_str(&pass.run(label, &links, &mut seed));
    }
    println!("{text}");
    if let Ok(p) = std::env::var("KVMESH_NETLAB_BENCH_OUT") {
        std::fs::write(&p, &text).expect("write the table");
    }
}

/// One model's grid.
struct Pass<'a> {
    model: &'a Path,
    prompt_tokens: usize,
    requests: usize,
    dir: &'a Path,
}

impl Pass<'_> {
    /// Every link setting on tcp, tcp with mutual TLS and ucx, and a
    /// partition's timings on each: the Markdown section.
    fn run(&self, label: &str, links: &[(String, Shape)], seed: &mut u64) -> String {
        let mut table = String::new();
        let mut notes = String::new();
        let _ = writeln!(
            table,
            "| link (each host, one way) | mesh | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | KV per request | mean KV transfer |\n|---|---|---|---|---|---|---|---|"
        );
        for (transport, tls) in [
            (Transport::Tcp, false),
            (Transport::Tcp, true),
            (Transport::Ucx, false),
        ] {
            let mut o = Options::tiny(transport, tls);
            if label != "tiny" {
                o.model = self.model.to_owned();
                o.page_size = 16;
                o.kv_pool_tokens = 8192;
            }
            let what = o.describe();
            let mesh = LabMesh::start(o);
            let gbit = ceiling(&mesh);
            // Every node's first requests are slow (pages faulted in,
            // caches cold): a discarded round first.
            *seed += 1;
            bench(
                &mesh,
                self.model,
                self.prompt_tokens,
                8,
                self.dir,
                "warmup",
                *seed,
            );
            let _ = writeln!(
                notes,
                "- {what}: links by {}; unshaped bulk TCP between two hosts {gbit:.2} Gbit/s",
                mesh.lab.mechanism()
            );
            for (name, shape) in links {
                mesh.lab.shape_all(*shape);
                let tag: String = format!("{label}-{what}-{name}")
                    .chars()
                    .filter(char::is_ascii_alphanumeric)
                    .collect();
                *seed += 1;
                let ([t50, t99, i50, i99], kv, xfer) = bench(
                    &mesh,
                    self.model,
                    self.prompt_tokens,
                    self.requests,
                    self.dir,
                    &tag,
                    *seed,
                );
                let xfer = xfer.map_or("n/a (TLS)".to_owned(), |ms| format!("{ms:.0} ms"));
                let row = format!(
                    "| {name} | {what} | {t50:.0} ms | {t99:.0} ms | {i50:.1} ms | {i99:.1} ms | {:.2} MB | {xfer} |",
                    kv / 1e6
                );
                println!("{row}");
                let _ = writeln!(table, "{row}");
            }
            mesh.lab.shape_all(Shape::default());
            let [left, expired, back_etcd, back] = partition_times(&mesh);
            let _ = writeln!(
                notes,
                "- {what}: decode-1 cut: out of routing after {left:.2} s, etcd lease gone after {expired:.2} s (TTL 3 s); \
                 healed after 10 s: registered again after {back_etcd:.2} s, routed after {back:.2} s"
            );
        }
        format!(
            "### {label}: {}-token prompts, {OUTPUT_TOKENS} output tokens, {} requests per cell \
             (one at a time, after 2 warm-up); p99 of {} TTFT samples is close to their maximum\n\n{table}\n{notes}\n",
            self.prompt_tokens, self.requests, self.requests
        )
    }
}
