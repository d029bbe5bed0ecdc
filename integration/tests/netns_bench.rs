//! The numbers an operator plans with (issue 36 item 3): TTFT and ITL
//! p50/p99 of the default model (SmolLM2-135M) on the netlab's six hosts
//! against each link's latency (0, 1, 5, 20 ms one way) and rate (100
//! Mbit/s, 1 and 10 Gbit/s), on tcp with and without mutual TLS and on
//! ucx; and how long a partitioned decode node takes to leave routing and
//! to come back. A benchmark, never a check: it asserts only that each
//! run completed, and prints a Markdown table (and writes it to
//! `$KVMESH_NETLAB_BENCH_OUT` when set) for docs/network.md.
//!
//! `cargo test -p kvmesh-integration --test netns_bench -- --ignored
//! --nocapture` as root, on an otherwise idle host: about 15 minutes on
//! two cores. `KVMESH_NETLAB_BENCH_REQUESTS` (default 8) sets the
//! requests per cell.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kvmesh_integration::netlab::mesh::{LabMesh, Options, Transport, ROUTER_HTTP};
use kvmesh_integration::netlab::Shape;

const PROMPT_TOKENS: usize = 256;
const OUTPUT_TOKENS: usize = 16;

/// One cell's figures, ms: TTFT p50, p99, ITL p50, p99.
type Cell = [f64; 4];

/// `kvmesh bench` against the router, run inside its namespace.
fn bench(mesh: &LabMesh, model: &Path, requests: usize, dir: &Path, tag: &str) -> Cell {
    let json = dir.join(format!("{tag}.json"));
    let out = Command::new("ip")
        .args(["netns", "exec", &mesh.lab.host("router").ns.name])
        .arg(kvmesh_integration::kvmesh_bin())
        .arg("bench")
        .args(["--url", &format!("http://{ROUTER_HTTP}")])
        .arg("--model")
        .arg(model)
        .args(["--requests", &requests.to_string()])
        .args(["--warmup", "2", "--concurrency", "2"])
        .args(["--prompt-len", &format!("fixed:{PROMPT_TOKENS}")])
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
    [
        f("ttft_ms", "p50"),
        f("ttft_ms", "p99"),
        f("itl_ms", "p50"),
        f("itl_ms", "p99"),
    ]
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
            assert!(t0.elapsed() < Duration::from_secs(40), "bench: partition timing");
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
        .chain([100_000_000u64, 1_000_000_000, 10_000_000_000].iter().map(|r| {
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
        }))
        .collect();
    let mut table = String::new();
    let mut notes = String::new();
    let _ = writeln!(
        table,
        "| link (each host, one way) | mesh | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |\n|---|---|---|---|---|---|"
    );
    for (transport, tls) in [
        (Transport::Tcp, false),
        (Transport::Tcp, true),
        (Transport::Ucx, false),
    ] {
        let mut o = Options::tiny(transport, tls);
        o.model = model.clone();
        o.page_size = 16;
        o.kv_pool_tokens = 8192;
        let what = o.describe();
        let mesh = LabMesh::start(o);
        let gbit = ceiling(&mesh);
        let _ = writeln!(
            notes,
            "- {what}: links by {}; unshaped bulk TCP between two hosts {gbit:.2} Gbit/s",
            mesh.lab.mechanism()
        );
        for (name, shape) in &links {
            mesh.lab.shape_all(*shape);
            let tag = format!("{}-{}", what.replace([' ', ','], ""), name.replace([' ', ','], ""));
            let [t50, t99, i50, i99] = bench(&mesh, &model, requests, dir.path(), &tag);
            let row = format!("| {name} | {what} | {t50:.0} ms | {t99:.0} ms | {i50:.1} ms | {i99:.1} ms |");
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
    let text = format!(
        "SmolLM2-135M Q4_1 on CPU, {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output tokens, \
         {requests} requests per cell (2 at a time, after 2 warm-up), p99 of {requests} TTFT samples is \
         their maximum.\n\n{table}\n{notes}"
    );
    println!("{text}");
    if let Ok(p) = std::env::var("KVMESH_NETLAB_BENCH_OUT") {
        std::fs::write(&p, &text).expect("write the table");
    }
}
