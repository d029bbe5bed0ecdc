//! Shaped links: lossy and jittery ones change no output and leak no
//! page; a 100 Mbit/s one is measured against the pool geometry.

use std::time::Duration;

use kvmesh_integration::http;
use kvmesh_integration::netlab::mesh::{LabMesh, HOSTS};
use kvmesh_integration::netlab::{Lab, Mechanism, Shape};

use super::{assert_nothing_leaked, long_prompt, reference, stream, within};

const MBIT: u64 = 1_000_000;

/// Packets delivered and lost over every link so far (`None` on veth,
/// where the kernel's qdiscs count them).
fn packets(mesh: &LabMesh) -> Option<(u64, u64)> {
    HOSTS.iter().try_fold((0, 0), |(d, l), h| {
        let s = mesh.lab.link_stats(h)?;
        Some((d + s.delivered, l + s.lost))
    })
}

/// TCP segments retransmitted by every host's kernel so far.
fn retransmits(mesh: &LabMesh) -> u64 {
    HOSTS.iter().map(|h| mesh.lab.tcp_retransmits(h)).sum()
}

/// 2 ms +- 0.5 ms and 0.5% loss on every link: 8 completions, 4 at a
/// time, equal `kvmesh generate`'s; the RTT the kernels see is the one
/// asked for; every page comes back and every grant ends once.
pub fn lossy(mesh: &LabMesh, what: &str) {
    let shape = Shape {
        latency: Duration::from_millis(2),
        jitter: Duration::from_micros(500),
        loss: 0.005,
        rate_bps: None,
    };
    mesh.lab.shape_all(shape);
    let (p0, r0) = (packets(mesh), retransmits(mesh));
    // A connect is one round trip: two one-way crossings of 2 ms.
    let rtt = mesh.lab.connect_rtt("router", "decode-0", 7101, 9);
    assert!(
        (Duration::from_micros(3500)..Duration::from_millis(12)).contains(&rtt),
        "[{what}] a round trip over two 2 ms links took {rtt:?}"
    );
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("Lossy link {i}: the old lighthouse keeper said"))
        .collect();
    let want: Vec<String> = prompts.iter().map(|p| reference(p, 16)).collect();
    let got: Vec<String> = mesh.client(|addr| {
        prompts
            .chunks(4)
            .flat_map(|chunk| {
                std::thread::scope(|s| {
                    let hs: Vec<_> = chunk
                        .iter()
                        .map(|p| {
                            s.spawn(move || {
                                let body = serde_json::json!({"prompt": p, "max_tokens": 16, "temperature": 0});
                                let r = http::post(addr, "/v1/completions", &body);
                                assert_eq!(r.status, 200, "{}", r.body);
                                r.json()["choices"][0]["text"]
                                    .as_str()
                                    .unwrap_or_default()
                                    .to_owned()
                            })
                        })
                        .collect();
                    hs.into_iter()
                        .map(|h| h.join().expect("request thread"))
                        .collect::<Vec<_>>()
                })
            })
            .collect()
    });
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "[{what}] prompt {i} over lossy links");
    }
    let ends = assert_nothing_leaked(mesh, what);
    let retrans = retransmits(mesh) - r0;
    let lost = match (p0, packets(mesh)) {
        (Some((d0, l0)), Some((d1, l1))) => {
            let (d, l) = (d1 - d0, l1 - l0);
            // At 0.5%, 1500 packets lose none with probability e^-7.5.
            assert!(
                d < 1500 || l > 0,
                "[{what}] {d} packets crossed and none was lost"
            );
            format!("{l} of {} packets lost by the switch", d + l)
        }
        _ => "loss by netem".to_owned(),
    };
    mesh.lab.shape_all(Shape::default());
    println!(
        "CHECKED [{what}] {shape} on every link (router->decode-0 connect RTT {:.2} ms): \
         8 completions equal `kvmesh generate`; {lost}, {retrans} TCP segments retransmitted; \
         every pool whole and every grant ended once {ends:?}",
        rtt.as_secs_f64() * 1e3
    );
}

/// The decode nodes' verified KV bytes, as the router last heard.
fn kv_bytes(mesh: &LabMesh) -> f64 {
    ["decode-0", "decode-1"]
        .iter()
        .map(|n| {
            mesh.node_value("kvmesh_node_kv_bytes_received_total", n)
                .unwrap_or(0.0)
        })
        .sum()
}

/// K and V bytes of one token in every layer with `elem`-byte elements,
/// from the tiny model's `config.json`.
fn geometry_bytes_per_token(elem: u64) -> u64 {
    let text = std::fs::read_to_string(kvmesh_integration::tiny_model_dir().join("config.json"))
        .expect("config.json");
    let c: serde_json::Value = serde_json::from_str(&text).expect("config JSON");
    let n = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("config {k}"));
    n("num_hidden_layers") * 2 * n("num_key_value_heads") * n("head_dim") * elem
}

/// 100 Mbit/s links: one long prompt streamed; the KV bytes decode
/// verified must be the prompt's tokens times the pool geometry's bytes
/// per token; the wire time at the link's rate and the TTFT (against the
/// same on unshaped links) are reported.
pub fn bandwidth(mesh: &LabMesh, what: &str) {
    let ttft = |tag: &str| {
        let rx = stream(mesh, &long_prompt(tag, 55), 4);
        let s = within("a stream", Duration::from_secs(60), move || {
            rx.recv().expect("stream result")
        });
        assert!(s.finished, "[{what}] {tag}: {s:?}");
        (
            s.ttft.expect("a first token"),
            s.prompt_tokens.expect("usage"),
        )
    };
    mesh.lab.shape_all(Shape::default());
    let (free_ttft, _) = ttft("unshaped");
    let rate = 100 * MBIT;
    mesh.lab.shape_all(Shape {
        rate_bps: Some(rate),
        ..Shape::default()
    });
    // Reports taken after the last transfer.
    mesh.wait_fresh_reports(&["decode-0", "decode-1"]);
    let b0 = kv_bytes(mesh);
    let (t, n) = ttft("100mbit");
    mesh.wait_fresh_reports(&["decode-0", "decode-1"]);
    let shipped = kv_bytes(mesh) - b0;
    let per_token = shipped / n as f64;
    let elem = [2, 4]
        .into_iter()
        .find(|e| (geometry_bytes_per_token(*e) as f64 - per_token).abs() < 0.5)
        .unwrap_or_else(|| {
            panic!(
                "[{what}] {shipped} KV bytes for {n} prompt tokens ({per_token} per token): \
                 not the geometry's {} (f16) or {} (f32)",
                geometry_bytes_per_token(2),
                geometry_bytes_per_token(4)
            )
        });
    let wire = shipped * 8.0 / rate as f64;
    mesh.lab.shape_all(Shape::default());
    println!(
        "CHECKED [{what}] 100 Mbit/s links: a {n}-token prompt shipped {shipped} KV bytes = {per_token} B/token \
         (3 layers x K,V x 2 KV heads x 16 x {elem} B, as the geometry says); at the link's rate that is \
         {:.2} ms on the wire; TTFT {:.1} ms (unshaped links: {:.1} ms)",
        wire * 1e3,
        t.as_secs_f64() * 1e3,
        free_ttft.as_secs_f64() * 1e3
    );
}

/// Bulk TCP from host `from` to `to` for `secs`: Mbit/s.
fn bulk_mbit(lab: &Lab, from: &str, to: &str, secs: f64) -> f64 {
    use std::io::{Read, Write};
    let addr = std::net::SocketAddr::from((lab.host(to).addr, 9100));
    let listener = lab
        .host(to)
        .ns
        .enter(|| std::net::TcpListener::bind(addr).expect("bind"));
    let sink = std::thread::spawn(move || {
        let Ok((mut s, _)) = listener.accept() else {
            return;
        };
        let mut buf = vec![0u8; 1 << 16];
        while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
    });
    let mbit = lab.host(from).ns.enter(|| {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        let buf = vec![7u8; 1 << 16];
        let (t0, mut n) = (std::time::Instant::now(), 0u64);
        while t0.elapsed().as_secs_f64() < secs {
            s.write_all(&buf).expect("write");
            n += buf.len() as u64;
        }
        // What left the sender's buffer is not all delivered yet; the
        // rate is the sender's, which the link caps after a second.
        n as f64 * 8.0 / t0.elapsed().as_secs_f64() / 1e6
    });
    let _ = sink.join();
    mbit
}

/// The links themselves, on both mechanisms (the veth path without its
/// netem qdisc where the kernel lacks it): a round trip, a rate cap
/// measured by bulk TCP, a cut that stops a connect and a heal that lets
/// it through.
pub fn mechanisms() {
    for m in [Mechanism::Switch, Mechanism::Veth] {
        let lab = Lab::with(&["a", "b"], m);
        let listen = std::net::SocketAddr::from((lab.host("b").addr, 9000));
        let l = lab
            .host("b")
            .ns
            .enter(|| std::net::TcpListener::bind(listen).expect("bind"));
        let free = lab.connect_rtt("a", "b", 9000, 5);
        // Delay where the mechanism has it (veth only with netem).
        let delay = (m == Mechanism::Switch || lab.mechanism().contains("tc netem"))
            .then_some(Duration::from_millis(5));
        let shaped = delay.map(|d| {
            lab.shape_all(Shape {
                latency: d,
                ..Shape::default()
            });
            let rtt = lab.connect_rtt("a", "b", 9000, 5);
            assert!(
                rtt >= 2 * d && rtt < 2 * d + Duration::from_millis(5),
                "{m:?}: {rtt:?} for two 5 ms crossings"
            );
            rtt
        });
        lab.shape_all(Shape {
            rate_bps: Some(50 * MBIT),
            ..Shape::default()
        });
        let mbit = bulk_mbit(&lab, "a", "b", 3.0);
        assert!(
            (30.0..65.0).contains(&mbit),
            "{m:?}: {mbit:.1} Mbit/s through a 50 Mbit/s link"
        );
        lab.shape_all(Shape::default());
        lab.set_link("b", false);
        let cut = lab
            .host("a")
            .ns
            .enter(|| std::net::TcpStream::connect_timeout(&listen, Duration::from_millis(800)));
        assert!(cut.is_err(), "{m:?}: a connect crossed a cut link");
        lab.set_link("b", true);
        let healed = lab.connect_rtt("a", "b", 9000, 3);
        drop(l);
        println!(
            "CHECKED links by {}: RTT {:.2} ms unshaped{}; bulk TCP {mbit:.1} Mbit/s through a 50 Mbit/s cap; \
             a cut link stops a connect; healed, RTT {:.2} ms",
            lab.mechanism(),
            free.as_secs_f64() * 1e3,
            shaped.map_or(String::new(), |r| format!(
                ", {:.2} ms with 5 ms on each link",
                r.as_secs_f64() * 1e3
            )),
            healed.as_secs_f64() * 1e3
        );
    }
}
