//! Prometheus on every node (issue 19 items 2 and 3), against a real
//! Prometheus (Debian's `prometheus` package; `scripts/test.sh` installs
//! it): a mesh of 2 prefill and 2 decode processes and its router, the
//! scrape configuration `kvmesh prometheus-config` writes, load through the
//! gateway; then TTFT and ITL quantiles, free pages and transfer rates are
//! read back through Prometheus's query API, the nodes' own byte counters
//! are checked against each other and the router's relayed view, and every
//! query of the Grafana dashboard (`deploy/grafana/kvmesh.json`) returns
//! data.
//!
//! A second test runs a mesh inside mutual TLS (`mesh.tls`): its nodes
//! serve `/metrics` only to clients with a certificate of the mesh's CA,
//! and Prometheus scrapes them through the configuration
//! `kvmesh prometheus-config --tls-identity prometheus` writes.

use std::io::Write;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvmesh_integration::roles::{
    free_port, start, start_two_by_two, two_by_two_mesh_file, wait_healthy, write_secret,
};
use kvmesh_integration::{http, run_kvmesh, texts};
use kvmesh_testkit::tls::{TestCa, Validity};
use serde_json::{json, Value};

/// The Prometheus binary: `$PROMETHEUS`, or Debian's.
fn prometheus_bin() -> PathBuf {
    let bin = std::env::var_os("PROMETHEUS")
        .map_or_else(|| PathBuf::from("/usr/bin/prometheus"), PathBuf::from);
    assert!(
        bin.exists(),
        "{} not found: install Debian's prometheus package (scripts/test.sh does), or set PROMETHEUS",
        bin.display()
    );
    bin
}

/// A Prometheus server; killed on drop.
struct Prometheus {
    child: Child,
    addr: String,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    fn start(config: &Path, dir: &Path) -> Self {
        let addr = format!("127.0.0.1:{}", free_port());
        let child = Command::new(prometheus_bin())
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .spawn()
            .expect("start prometheus");
        let p = Self { child, addr };
        // Until it is ready Prometheus may refuse a connection, drop one
        // it accepted, or answer 503: all mean "poll again".
        let t0 = Instant::now();
        loop {
            let last = match http::try_get(&p.addr, "/-/ready") {
                Ok(r) if r.status == 200 => break,
                Ok(r) => format!("status {}: {}", r.status, r.body),
                Err(e) => e.to_string(),
            };
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "prometheus never ready: {last}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        p
    }

    /// An instant query's result vector (`status` must be success).
    fn query(&self, q: &str) -> Vec<Value> {
        let r = http::get(&self.addr, &format!("/api/v1/query?query={}", encode(q)));
        let v = r.json();
        assert_eq!(v["status"], "success", "{q}: {}", r.body);
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// The finite values of a query's result, by series labels.
    fn values(&self, q: &str) -> Vec<(Value, f64)> {
        self.query(q)
            .into_iter()
            .filter_map(|s| {
                let v: f64 = s["value"][1].as_str()?.parse().ok()?;
                v.is_finite().then(|| (s["metric"].clone(), v))
            })
            .collect()
    }

    /// Polls `q` until `ok` holds for its values (bounded).
    fn wait(&self, what: &str, q: &str, ok: impl Fn(&[(Value, f64)]) -> bool) -> Vec<(Value, f64)> {
        let t0 = Instant::now();
        loop {
            let v = self.values(q);
            if ok(&v) {
                return v;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "{what}: `{q}` never held; last {v:?}"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

/// Percent-encodes a query string value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Load: clients at once, and requests each.
const CLIENTS: usize = 4;
const PER_CLIENT: usize = 10;

fn sum(v: &[(Value, f64)]) -> f64 {
    v.iter().map(|(_, x)| x).sum()
}

#[test]
fn prometheus_reads_every_node_and_the_dashboard_queries_all_return_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (file, addr) = two_by_two_mesh_file(dir.path());
    let _procs = start_two_by_two(&file, &addr);

    // The scrape configuration, as an operator makes it.
    let file_arg = file.to_str().expect("utf-8 path");
    let out = run_kvmesh(
        &[
            "prometheus-config",
            "--config",
            file_arg,
            "--interval",
            "1s",
        ],
        &[],
    );
    let (scrape, err) = texts(&out);
    assert!(out.status.success(), "prometheus-config failed: {err}");
    let config = dir.path().join("prometheus.yml");
    std::fs::write(&config, &scrape).expect("write scrape config");
    let bad = run_kvmesh(
        &[
            "prometheus-config",
            "--config",
            file_arg,
            "--interval",
            "soon",
        ],
        &[],
    );
    assert!(!bad.status.success(), "a bad interval was accepted");
    let prom = Prometheus::start(&config, dir.path());
    prom.wait("every target up", "up", |v| {
        v.len() == 5 && v.iter().all(|(_, x)| *x == 1.0)
    });

    // Load: four clients, prompts that share a head (prefix-cache hits)
    // and a tail each.
    let head = "The ships of the northern fleet sailed at dawn, and every captain read the orders twice before the wind turned. ";
    let started = Instant::now();
    // Tokens the decode nodes sampled: all but the first of each answer
    // (prefill's), plus the end-of-sequence token of an answer that
    // stopped (sampled, not returned).
    let decoded: usize = std::thread::scope(|s| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let addr = addr.clone();
                s.spawn(move || {
                    let mut decoded = 0;
                    for i in 0..PER_CLIENT {
                        let body = json!({
                            "prompt": format!("{head}Client {c}, question {i}: where to?"),
                            "max_tokens": 16,
                            "temperature": 0,
                        });
                        let r = http::complete(&addr, "/v1/completions", &body);
                        let n = r["usage"]["completion_tokens"].as_u64().expect("usage") as usize;
                        let stopped = r["choices"][0]["finish_reason"] == "stop";
                        decoded += n - 1 + usize::from(stopped);
                    }
                    decoded
                })
            })
            .collect();
        clients.into_iter().map(|c| c.join().expect("client")).sum()
    });
    let requests = (CLIENTS * PER_CLIENT) as f64;
    eprintln!(
        "load: {requests} requests in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // One connection to a decode node's KV port that never proves the
    // mesh secret: a refusal the nodes count and Prometheus must show.
    let kv_port = std::fs::read_to_string(&file)
        .expect("mesh file")
        .split("kv: \"127.0.0.1:")
        .nth(1)
        .and_then(|rest| rest.split('"').next().map(str::to_owned))
        .expect("decode-0's kv port");
    {
        let mut junk = TcpStream::connect(format!("127.0.0.1:{kv_port}")).expect("kv port");
        let _ = junk.write_all(&[0xAB; 64]);
    }

    // What an operator reads back.
    prom.wait("the router's requests", "sum(kvmesh_requests_total)", |v| {
        sum(v) >= requests
    });
    prom.wait(
        "the refused KV connection",
        "sum(kvmesh_auth_refused_total{role=\"decode\",via=\"kv\"})",
        |v| sum(v) >= 1.0,
    );
    for (what, metric) in [
        ("TTFT", "kvmesh_time_to_first_token_seconds"),
        ("ITL", "kvmesh_inter_token_latency_seconds"),
    ] {
        for q in [0.5, 0.99] {
            let v = prom.wait(
                what,
                &format!("histogram_quantile({q}, sum by (le) (rate({metric}_bucket[1m])))"),
                |v| v.len() == 1,
            );
            let secs = v[0].1;
            assert!(secs > 0.0 && secs < 30.0, "{what} p{q}: {secs}");
            eprintln!("{what} p{}: {:.1} ms", q * 100.0, secs * 1000.0);
        }
    }
    let free = prom.wait(
        "free pages of every node",
        "kvmesh_kv_pool_free_pages",
        |v| v.len() == 4,
    );
    let total = prom.values("kvmesh_kv_pool_pages");
    for (labels, f) in &free {
        let all = total
            .iter()
            .find(|(l, _)| l["node"] == labels["node"])
            .map(|(_, x)| *x)
            .expect("pool size of the same node");
        assert!(*f > 0.0 && *f <= all, "{labels}: {f} free of {all}");
    }
    for q in [
        "sum(rate(kvmesh_kv_sent_bytes_total[1m]))",
        "sum(rate(kvmesh_kv_received_bytes_total[1m]))",
    ] {
        let rate = sum(&prom.wait("a transfer rate", q, |v| sum(v) > 0.0));
        eprintln!("{q}: {:.0} B/s", rate);
    }
    // Once the counters settle, prefill's bytes sent are decode's bytes
    // received, and the nodes' own counters are what the router relays.
    let t0 = Instant::now();
    loop {
        let sent = sum(&prom.values("sum(kvmesh_kv_sent_bytes_total)"));
        let received = sum(&prom.values("sum(kvmesh_kv_received_bytes_total)"));
        let relayed = sum(&prom.values("sum(kvmesh_node_kv_bytes_received_total)"));
        let transfers = sum(&prom.values("sum(kvmesh_kv_transfers_total{outcome=\"completed\"})"));
        if sent > 0.0 && sent == received && received == relayed && transfers >= requests {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "sent {sent} B, received {received} B, relayed {relayed} B, {transfers} transfers"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let steps = prom.wait(
        "decode steps",
        "sum(kvmesh_decode_step_duration_seconds_count)",
        |v| sum(v) > 0.0,
    );
    let tokens = prom.wait("decode tokens", "sum(kvmesh_decode_tokens_total)", |v| {
        sum(v) >= decoded as f64
    });
    assert_eq!(
        sum(&tokens),
        decoded as f64,
        "decode tokens ({} steps)",
        sum(&steps)
    );

    // The dashboard: every panel's every query returns data.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/kvmesh.json");
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("dashboard")).expect("JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10, "{} panels", panels.len());
    let mut queries = 0;
    for p in panels {
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
        for t in targets {
            let expr = t["expr"].as_str().expect("expr");
            // Grafana's range variable, at this test's scrape interval.
            let q = expr.replace("$__rate_interval", "1m");
            assert!(!q.contains('$'), "{expr}: an unknown variable");
            prom.wait(&format!("panel {}", p["title"]), &q, |v| !v.is_empty());
            queries += 1;
        }
    }
    eprintln!("{queries} dashboard queries, each returned data");
}

#[test]
fn prometheus_scrapes_a_mutual_tls_mesh_through_the_generated_configuration() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = dir.path().join("certs");
    std::fs::create_dir(&certs).expect("certs dir");
    let ca = TestCa::new(dir.path(), "mesh").expect("ca");
    // Prometheus's own identity beside the processes'.
    for name in ["router", "prefill-0", "decode-0", "prometheus"] {
        ca.write_node(&certs, name, &["127.0.0.1", "localhost"], Validity::Current)
            .expect("certificate");
    }
    let secret = write_secret(dir.path(), "mesh.secret");
    let [http_port, grpc_port, prefill_port, decode_port, kv_port] =
        std::array::from_fn(|_| free_port());
    // Relative paths, resolved from the mesh file's folder.
    let text = format!(
        "model: {model}\n\
         mesh:\n  secret_file: {secret}\n  tls: {{ca_file: mesh-ca.pem, cert_file: \"certs/{{name}}.pem\", key_file: \"certs/{{name}}-key.pem\"}}\n\
         router: {{http: \"127.0.0.1:{http_port}\", grpc: \"127.0.0.1:{grpc_port}\"}}\n\
         prefill:\n  - {{name: prefill-0, grpc: \"127.0.0.1:{prefill_port}\"}}\n\
         decode:\n  - {{name: decode-0, grpc: \"127.0.0.1:{decode_port}\", kv: \"127.0.0.1:{kv_port}\"}}\n",
        model = kvmesh_integration::tiny_model_dir().display(),
        secret = secret.display(),
    );
    let file = dir.path().join("mesh.yaml");
    std::fs::write(&file, text).expect("mesh file");
    let file_arg = file.to_str().expect("utf-8 path");

    let config = |identity: &str| {
        run_kvmesh(
            &[
                "prometheus-config",
                "--config",
                file_arg,
                "--interval",
                "1s",
                "--tls-identity",
                identity,
            ],
            &[],
        )
    };
    // An identity without files is named now, not found later as targets
    // down.
    let out = config("nobody");
    let (_, err) = texts(&out);
    assert!(!out.status.success());
    assert!(err.contains("mesh.tls") && err.contains("nobody"), "{err}");
    let out = config("prometheus");
    let (scrape, err) = texts(&out);
    assert!(out.status.success(), "prometheus-config failed: {err}");
    let parsed: serde_yaml_ng::Value = serde_yaml_ng::from_str(&scrape).expect("YAML");
    let jobs = parsed["scrape_configs"].as_sequence().expect("jobs");
    let job = |name: &str| {
        jobs.iter()
            .find(|j| j["job_name"] == name)
            .unwrap_or_else(|| panic!("job {name}: {scrape}"))
    };
    // The router's public port is outside the mesh's TLS.
    let router = job("kvmesh-router");
    assert!(
        router.get("scheme").is_none() && router.get("tls_config").is_none(),
        "{scrape}"
    );
    let nodes = job("kvmesh-nodes");
    assert_eq!(nodes["scheme"], "https", "{scrape}");
    let tls = &nodes["tls_config"];
    for (field, want) in [
        ("ca_file", dir.path().join("mesh-ca.pem")),
        ("cert_file", certs.join("prometheus.pem")),
        ("key_file", certs.join("prometheus-key.pem")),
    ] {
        assert_eq!(tls[field].as_str(), want.to_str(), "{field}: {scrape}");
    }
    let config_file = dir.path().join("prometheus.yml");
    std::fs::write(&config_file, &scrape).expect("write scrape config");

    let _decode = start("decode", &file, Some("decode-0"));
    let _prefill = start("prefill", &file, Some("prefill-0"));
    let _router = start("router", &file, None);
    let addr = format!("127.0.0.1:{http_port}");
    wait_healthy(&addr);
    // The nodes' /metrics is not served in plaintext: without the
    // generated `scheme` and `tls_config` these targets would be down.
    for port in [prefill_port, decode_port] {
        let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .expect("write");
        let mut answer = Vec::new();
        let _ = std::io::Read::read_to_end(&mut s, &mut answer);
        assert!(
            !answer.starts_with(b"HTTP/"),
            "port {port} answered plain HTTP: {}",
            String::from_utf8_lossy(&answer)
        );
    }
    let t0 = Instant::now();
    let prom = Prometheus::start(&config_file, dir.path());
    let up = prom.wait("every target up", "up", |v| {
        v.len() == 3 && v.iter().all(|(_, x)| *x == 1.0)
    });
    eprintln!(
        "MEASURED: a real Prometheus had every target of the TLS mesh up {:.2} s after it was started",
        t0.elapsed().as_secs_f64()
    );
    let https: Vec<&str> = up
        .iter()
        .filter(|(l, _)| l["job"] == "kvmesh-nodes")
        .filter_map(|(l, _)| l["instance"].as_str())
        .collect();
    assert_eq!(https.len(), 2, "{up:?}");
    // The nodes' own series came through: each pool, by node.
    prom.wait("both nodes' pools", "kvmesh_kv_pool_pages", |v| {
        let mut nodes: Vec<&str> = v.iter().filter_map(|(l, _)| l["node"].as_str()).collect();
        nodes.sort();
        nodes == ["decode-0", "prefill-0"]
    });
}
