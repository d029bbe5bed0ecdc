//! `kvmesh doctor --config mesh.yaml`: checks a mesh as its operator would
//! after every change, from the mesh file and from each node's own answer
//! (its load report, asked with the mesh file's secret). One row per check;
//! the exit code is non-zero when any check fails.
//!
//! Checks, per node: its pool can hold one request of the whole context
//! (the mesh file's `kv_pool_tokens`, then the size the node reports: the
//! check the incident's operator was told to do by hand), its gRPC port and
//! (decode) its KV transport answer, it accepts the mesh secret, it is the
//! node the mesh file names, and its clock is within the mesh-auth window
//! of this host's. Across the mesh: one kvmesh version (this binary's too),
//! one model, one context limit, one KV element type, the mesh file's page
//! size. The router: its HTTP port answers `/health` and `/version`. With
//! `mesh.tls`, the nodes are asked inside mutual TLS with the router's
//! certificate (`{name}` = `router`), as the router asks them.
//!
//! `kvmesh doctor --url http://HOST:PORT` checks a running mesh through its
//! router instead (a `kvmesh serve`, whose secret never leaves the
//! process, or any mesh whose file is not at hand): the router's
//! `/version`, `/health` and `/metrics`, where it relays each node's last
//! load report. A node is up there only if it accepted the router's proof
//! of the mesh secret; then the same pool, clock (against the router's
//! clock) and agreement checks run on what it reported. What the router
//! cannot see (the KV transport's port) is not checked in this mode.

use std::net::ToSocketAddrs;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use clap::Args;
use kvmesh_kvxfer::transport::Control;
use kvmesh_proto::internal::v1::{LoadReport, LoadRequest, NodeRole};
use kvmesh_proto::peer::{decode_client, prefill_client};
use serde::Serialize;
use serde_json::json;

use crate::config::{MeshConfig, NodeSection};

mod router;
use router::{router, through_router};

/// Proofs of the mesh secret more than this far from a node's clock are
/// refused (`kvmesh_meshauth`'s window).
const AUTH_WINDOW: Duration = Duration::from_secs(60);
/// Skew worth a warning: a sixth of the window.
const SKEW_WARN: Duration = Duration::from_secs(10);

/// `kvmesh doctor` flags.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// The mesh file.
    #[arg(
        long,
        env = "KVMESH_CONFIG",
        required_unless_present = "url",
        conflicts_with = "url"
    )]
    pub config: Option<PathBuf>,
    /// Instead of a mesh file: a running router's HTTP address
    /// (`http://127.0.0.1:8080`, say; a `kvmesh serve`), checked through
    /// its view of the nodes.
    #[arg(long)]
    pub url: Option<String>,
    /// Print the checks as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// How long to wait for each node, milliseconds.
    #[arg(long, default_value_t = 3000)]
    pub timeout_ms: u64,
    /// With `--url` on a router with API keys: a key with the `metrics`
    /// scope (the router's `/metrics`, where doctor reads the nodes) and
    /// the `inference` scope (`/v1/models`).
    #[arg(long, env = "KVMESH_API_KEY")]
    pub api_key: Option<String>,
}

/// A check's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Warn,
    Fail,
    /// Not run: what it needs failed first.
    Skip,
}

/// One row of the report.
#[derive(Debug, Serialize)]
pub struct Check {
    pub node: String,
    pub role: String,
    pub check: &'static str,
    pub status: Status,
    pub detail: String,
}

struct Report {
    checks: Vec<Check>,
}

impl Report {
    fn add(&mut self, node: &str, role: &str, check: &'static str, status: Status, detail: String) {
        self.checks.push(Check {
            node: node.to_owned(),
            role: role.to_owned(),
            check,
            status,
            detail,
        });
    }
}

/// Runs every check and prints the report; exits 1 when one failed.
pub fn run(a: DoctorArgs) -> Result<()> {
    let timeout = Duration::from_millis(a.timeout_ms.max(1));
    let (report, source) = match (&a.config, &a.url) {
        (Some(config), _) => (from_file(config, timeout)?, json!({ "config": config })),
        (None, Some(url)) => (
            through_router(url, timeout, a.api_key.as_deref())?,
            json!({ "url": url }),
        ),
        (None, None) => anyhow::bail!("give --config FILE or --url http://ROUTER"),
    };
    let failed = report.checks.iter().any(|c| c.status == Status::Fail);
    if a.json {
        let mut out = source;
        out["ok"] = json!(!failed);
        out["checks"] = serde_json::to_value(&report.checks)?;
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_table(&report.checks);
        let n_fail = report
            .checks
            .iter()
            .filter(|c| c.status == Status::Fail)
            .count();
        println!(
            "{}",
            if failed {
                format!("{n_fail} check(s) failed")
            } else {
                "all checks passed".into()
            }
        );
    }
    if failed {
        std::process::exit(1);
    }
    Ok(())
}

/// The checks of a mesh file's mesh, asking each node itself.
fn from_file(config: &std::path::Path, timeout: Duration) -> Result<Report> {
    let cfg = MeshConfig::load(config)?;
    let secret = cfg.mesh_auth()?.secret();
    // With mutual TLS, the nodes are asked as the router is: with its
    // certificate.
    let tls = cfg.tls_for("router")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut report = Report { checks: Vec::new() };
    // The context limit the mesh runs: the file's, else the model's (its
    // metadata only), when this host has the model.
    let model_len = cfg.max_model_len.or_else(|| {
        let path = cfg
            .model
            .clone()
            .or_else(kvmesh_model::default_model::cached_default_model)?;
        kvmesh_tokenizer::ModelInfo::read(&path)
            .ok()
            .map(|i| i.context_length)
    });

    let mut reports: Vec<(String, &'static str, LoadReport)> = Vec::new();
    for (role, nodes) in [("prefill", &cfg.prefill), ("decode", &cfg.decode)] {
        for n in nodes.iter() {
            pool_in_file(&mut report, &cfg, n, role, model_len);
            if let Some(r) = rt.block_on(node(
                &mut report,
                &cfg,
                n,
                role,
                &secret,
                tls.as_ref(),
                timeout,
            )) {
                reports.push((n.name.clone(), role, r));
            }
        }
    }
    across(&mut report, Some(cfg.page_size), &reports);
    // A wildcard listen address is dialled on loopback.
    let addr = cfg
        .router
        .http
        .replace("0.0.0.0:", "127.0.0.1:")
        .replace("[::]:", "[::1]:");
    router(&mut report, &addr, timeout, None);
    Ok(report)
}

/// The pool the mesh file gives a node against the context.
fn pool_in_file(
    report: &mut Report,
    cfg: &MeshConfig,
    n: &NodeSection,
    role: &str,
    model_len: Option<usize>,
) {
    let (status, detail) = match (n.kv_pool_tokens, model_len) {
        (None, _) => (Status::Ok, "kv_pool_tokens unset: one full context".into()),
        (Some(t), Some(len)) if t >= len => (
            Status::Ok,
            format!("kv_pool_tokens {t} >= max_model_len {len}"),
        ),
        (Some(t), Some(len)) => (
            // allow_small_pool makes it a choice, still worth saying.
            if cfg.allow_small_pool {
                Status::Warn
            } else {
                Status::Fail
            },
            format!(
                "kv_pool_tokens {t} < max_model_len {len}: a request of the whole context cannot fit{}",
                if cfg.allow_small_pool {
                    " (allow_small_pool is set)"
                } else {
                    ""
                }
            ),
        ),
        (Some(t), None) => (
            Status::Skip,
            format!("kv_pool_tokens {t}; max_model_len unknown here (no max_model_len in the file, model not on this host)"),
        ),
    };
    report.add(&n.name, role, "pool in mesh file", status, detail);
}

/// One node's live checks; its load report when it answered.
async fn node(
    report: &mut Report,
    cfg: &MeshConfig,
    n: &NodeSection,
    role: &'static str,
    secret: &kvmesh_meshauth::MeshSecret,
    tls: Option<&std::sync::Arc<kvmesh_meshauth::tls::MeshTls>>,
    timeout: Duration,
) -> Option<LoadReport> {
    let reach = tcp_reachable(&n.grpc, timeout).await;
    let ok = reach.is_ok();
    report.add(
        &n.name,
        role,
        "gRPC reachable",
        if ok { Status::Ok } else { Status::Fail },
        reach.unwrap_or_else(|e| e),
    );
    if role == "decode" {
        let kv = n.kv.as_deref().unwrap_or_default();
        let r = match cfg.transport_kind().control() {
            Control::Unix => unix_reachable(kv, timeout).await,
            Control::Tcp => tcp_reachable(kv, timeout).await,
        };
        let status = if r.is_ok() { Status::Ok } else { Status::Fail };
        report.add(
            &n.name,
            role,
            "KV transport reachable",
            status,
            r.unwrap_or_else(|e| e),
        );
    }
    let skip = |report: &mut Report, check| {
        report.add(
            &n.name,
            role,
            check,
            Status::Skip,
            "the node did not answer".into(),
        );
    };
    let checks_after = [
        "mesh secret accepted",
        "node identity",
        "pool holds a context",
        "clock",
    ];
    if !ok {
        for c in checks_after {
            skip(report, c);
        }
        return None;
    }
    let channel = match kvmesh_proto::peer::channel(&format!("http://{}", n.grpc), tls, timeout) {
        Ok(c) => c,
        Err(e) => {
            report.add(&n.name, role, "mesh secret accepted", Status::Fail, e);
            return None;
        }
    };
    let req = LoadRequest {
        known_cache_epoch: 0,
    };
    let sent = SystemTime::now();
    let started = Instant::now();
    let ask = async {
        if role == "decode" {
            decode_client(channel, secret.clone(), &n.name)
                .load(req)
                .await
        } else {
            prefill_client(channel, secret.clone(), &n.name)
                .load(req)
                .await
        }
    };
    let answer = tokio::time::timeout(timeout, ask)
        .await
        .unwrap_or_else(|_| {
            Err(tonic::Status::deadline_exceeded(format!(
                "no answer within {} ms",
                timeout.as_millis()
            )))
        });
    let rtt = started.elapsed();
    let r = match answer {
        Ok(r) => r.into_inner(),
        Err(s) => {
            let detail = if s.code() == tonic::Code::Unauthenticated {
                format!("the secret was not proved both ways ({}): a different secret, another node's name at this address, or clocks more than 60 s apart", s.message())
            } else {
                format!("{}: {}", s.code(), s.message())
            };
            report.add(&n.name, role, "mesh secret accepted", Status::Fail, detail);
            for c in &checks_after[1..] {
                skip(report, c);
            }
            return None;
        }
    };
    report.add(
        &n.name,
        role,
        "mesh secret accepted",
        Status::Ok,
        format!("load report in {} ms", rtt.as_millis()),
    );

    let want_role = if role == "decode" {
        NodeRole::Decode
    } else {
        NodeRole::Prefill
    };
    let (status, detail) = if r.node != n.name || r.role() != want_role {
        (
            Status::Fail,
            format!(
                "answers as {:?} ({:?}): the mesh file's address reaches another node",
                r.node,
                r.role()
            ),
        )
    } else {
        (Status::Ok, format!("{} {}", r.node, role))
    };
    report.add(&n.name, role, "node identity", status, detail);

    pool_holds_context(
        report,
        &n.name,
        role,
        &r,
        cfg.max_model_len.unwrap_or(0) as u64,
    );

    // The node stamped its clock between our send and the answer: compare
    // with the midpoint.
    let mid = sent + rtt / 2;
    let ours = mid
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i128);
    let skew = (r.unix_ms != 0).then(|| i128::from(r.unix_ms) - ours);
    clock(report, &n.name, role, skew, rtt / 2, "this host");
    Some(r)
}

/// The node's pool holds one request of the whole context (its own
/// `max_model_len`, else `fallback`).
fn pool_holds_context(report: &mut Report, name: &str, role: &str, r: &LoadReport, fallback: u64) {
    let need = if r.max_model_len > 0 {
        r.max_model_len
    } else {
        fallback
    };
    let (status, detail) = if r.max_seq_tokens >= need {
        (
            Status::Ok,
            format!(
                "holds {} tokens a request, context {need}",
                r.max_seq_tokens
            ),
        )
    } else {
        (
            Status::Fail,
            format!(
                "its pool holds {} tokens a request; max_model_len is {need}: long requests are refused at this node",
                r.max_seq_tokens
            ),
        )
    };
    report.add(name, role, "pool holds a context", status, detail);
}

/// The node's clock `skew_ms` from `whose` (unknown: `None`), give or take
/// `slack`, against mesh auth's window.
fn clock(
    report: &mut Report,
    name: &str,
    role: &str,
    skew_ms: Option<i128>,
    slack: Duration,
    whose: &str,
) {
    let Some(skew_ms) = skew_ms else {
        report.add(
            name,
            role,
            "clock",
            Status::Skip,
            "the node did not say its time".into(),
        );
        return;
    };
    let abs = Duration::from_millis(skew_ms.unsigned_abs().min(u64::MAX as u128) as u64);
    let status = if abs + slack >= AUTH_WINDOW {
        Status::Fail
    } else if abs >= SKEW_WARN {
        Status::Warn
    } else {
        Status::Ok
    };
    report.add(
        name,
        role,
        "clock",
        status,
        format!(
            "{skew_ms:+} ms from {whose} (mesh auth allows {} s)",
            AUTH_WINDOW.as_secs()
        ),
    );
}

/// What every node must agree on.
fn across(
    report: &mut Report,
    page_size: Option<usize>,
    reports: &[(String, &'static str, LoadReport)],
) {
    type Field = fn(&LoadReport) -> String;
    let fields: [(&'static str, Field, Option<String>); 6] = [
        (
            "version",
            |r| r.version.clone(),
            Some(env!("CARGO_PKG_VERSION").to_owned()),
        ),
        ("model", |r| r.model.clone(), None),
        ("context limit", |r| r.max_model_len.to_string(), None),
        ("KV element type", |r| r.kv_dtype.clone(), None),
        // The path may differ (avx2 and avx512 compute alike); the
        // numerics may not: the router would not pair such nodes.
        ("CPU kernel numerics", |r| r.cpu_numerics.clone(), None),
        (
            "page size",
            |r| r.page_size.to_string(),
            page_size.map(|p| p.to_string()),
        ),
    ];
    for (check, get, expected) in fields {
        if reports.is_empty() {
            report.add(
                "mesh",
                "all",
                check,
                Status::Skip,
                "no node answered".into(),
            );
            continue;
        }
        let want = expected.clone().unwrap_or_else(|| get(&reports[0].2));
        let odd: Vec<String> = reports
            .iter()
            .filter(|(_, _, r)| get(r) != want)
            .map(|(name, _, r)| format!("{name}: {:?}", get(r)))
            .collect();
        let (status, detail) = if odd.is_empty() {
            (Status::Ok, format!("{want:?} on {} nodes", reports.len()))
        } else {
            let whose = if expected.is_some() {
                "this binary and the mesh file say"
            } else {
                "the first node says"
            };
            (
                Status::Fail,
                format!("{whose} {want:?}; {}", odd.join(", ")),
            )
        };
        report.add("mesh", "all", check, status, detail);
    }
}

async fn tcp_reachable(addr: &str, timeout: Duration) -> Result<String, String> {
    let resolved: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| format!("{addr}: {e}"))?
        .collect();
    let first = *resolved
        .first()
        .ok_or_else(|| format!("{addr}: no address"))?;
    let started = Instant::now();
    match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(first)).await {
        Ok(Ok(_)) => Ok(format!("{addr} in {} ms", started.elapsed().as_millis())),
        Ok(Err(e)) => Err(format!("{addr}: {e}")),
        Err(_) => Err(format!(
            "{addr}: no answer within {} ms",
            timeout.as_millis()
        )),
    }
}

async fn unix_reachable(path: &str, timeout: Duration) -> Result<String, String> {
    match tokio::time::timeout(timeout, tokio::net::UnixStream::connect(path)).await {
        Ok(Ok(_)) => Ok(format!("unix:{path}")),
        Ok(Err(e)) => Err(format!("unix:{path}: {e}")),
        Err(_) => Err(format!(
            "unix:{path}: no answer within {} ms",
            timeout.as_millis()
        )),
    }
}

fn print_table(checks: &[Check]) {
    let w = |f: fn(&Check) -> usize, head: &str| {
        checks.iter().map(f).max().unwrap_or(0).max(head.len())
    };
    let (wn, wr, wc) = (
        w(|c| c.node.len(), "NODE"),
        w(|c| c.role.len(), "ROLE"),
        w(|c| c.check.len(), "CHECK"),
    );
    println!(
        "{:wn$}  {:wr$}  {:wc$}  {:6}  DETAIL",
        "NODE", "ROLE", "CHECK", "STATUS"
    );
    for c in checks {
        let status = match c.status {
            Status::Ok => "ok",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
            Status::Skip => "skip",
        };
        println!(
            "{:wn$}  {:wr$}  {:wc$}  {:6}  {}",
            c.node, c.role, c.check, status, c.detail
        );
    }
}
