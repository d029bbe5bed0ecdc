//! `kvmesh prometheus-config --config mesh.yaml`: the Prometheus scrape
//! configuration of a mesh, from its mesh file. Two jobs: `kvmesh-router`
//! (the gateway's `/metrics`: requests, TTFT, ITL, and its relayed view of
//! every node) and `kvmesh-nodes` (each prefill and decode node's own
//! `/metrics`, served on its gRPC port). The nodes' series carry their own
//! `node` and `role` labels, so the targets add none (a target label of
//! the same name would rename the series' to `exported_node`).
//!
//! With `mesh.tls` the nodes serve `/metrics` inside mutual TLS, so the
//! nodes' job scrapes over HTTPS and presents a client certificate of the
//! mesh's CA: the `{name}` identity `--tls-identity` names (`router` by
//! default, whose files every such mesh has; a dedicated `prometheus`
//! certificate keeps the router's key off the Prometheus host). The files'
//! paths are written absolute (Prometheus reads relative ones from its own
//! configuration's folder). No `server_name`: Prometheus checks each node's
//! certificate against the host it dials, the `grpc` address, which the
//! certificate names already because the router checks it the same way.
//! The router's job stays plain HTTP: its public port is not inside the
//! mesh's TLS.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use serde::Serialize;

use crate::config::MeshConfig;

/// `kvmesh prometheus-config` flags.
#[derive(Args, Debug)]
pub struct ScrapeArgs {
    /// The mesh file.
    #[arg(long, env = "KVMESH_CONFIG")]
    pub config: PathBuf,
    /// How often Prometheus scrapes (a Prometheus duration: 15s, 1s, 1m).
    #[arg(long, default_value = "15s")]
    pub interval: String,
    /// With `mesh.tls`: whose certificate and key (`{name}` in the mesh
    /// file's `mesh.tls` paths) Prometheus presents to the nodes.
    #[arg(long, env = "KVMESH_PROMETHEUS_TLS_IDENTITY", default_value = "router")]
    pub tls_identity: String,
}

#[derive(Serialize)]
struct File {
    scrape_configs: Vec<Job>,
}

#[derive(Serialize)]
struct Job {
    job_name: &'static str,
    scrape_interval: String,
    metrics_path: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    scheme: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls_config: Option<TlsConfig>,
    static_configs: Vec<Targets>,
}

/// Prometheus's `tls_config`: the CA the nodes' certificates chain to, and
/// the client certificate and key it presents.
#[derive(Serialize)]
struct TlsConfig {
    ca_file: PathBuf,
    cert_file: PathBuf,
    key_file: PathBuf,
}

#[derive(Serialize)]
struct Targets {
    targets: Vec<String>,
}

/// Prints the scrape configuration.
pub fn run(a: ScrapeArgs) -> Result<()> {
    let cfg = MeshConfig::load(&a.config)?;
    print!("{}", render(&cfg, &a.interval, &a.tls_identity)?);
    Ok(())
}

/// The configuration's text. A wildcard listen address of the router is
/// scraped on loopback (the file names no address others dial for it).
/// With `mesh.tls`, `tls_identity`'s files must load (a missing or
/// mismatched file is named now, not seen later as targets down).
pub fn render(cfg: &MeshConfig, interval: &str, tls_identity: &str) -> Result<String> {
    if !interval
        .strip_suffix(['s', 'm', 'h'])
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    {
        anyhow::bail!("--interval {interval:?}: expected a Prometheus duration such as 15s or 1m");
    }
    let router = cfg
        .router
        .http
        .replace("0.0.0.0:", "127.0.0.1:")
        .replace("[::]:", "[::1]:");
    let nodes = cfg
        .prefill
        .iter()
        .chain(&cfg.decode)
        .map(|n| n.grpc.clone())
        .collect();
    let tls_config = match cfg.tls_for(tls_identity)? {
        None => None,
        Some(tls) => {
            let f = tls.files();
            Some(TlsConfig {
                ca_file: std::path::absolute(&f.ca)?,
                cert_file: std::path::absolute(&f.cert)?,
                key_file: std::path::absolute(&f.key)?,
            })
        }
    };
    let job = |job_name, targets| Job {
        job_name,
        scrape_interval: interval.to_owned(),
        metrics_path: "/metrics",
        scheme: None,
        tls_config: None,
        static_configs: vec![Targets { targets }],
    };
    let file = File {
        scrape_configs: vec![
            job("kvmesh-router", vec![router]),
            Job {
                scheme: tls_config.is_some().then_some("https"),
                tls_config,
                ..job("kvmesh-nodes", nodes)
            },
        ],
    };
    Ok(format!(
        "# Prometheus scrape configuration of the mesh in {}, from `kvmesh prometheus-config`.\n{}",
        cfg.file.display(),
        serde_yaml_ng::to_string(&file)?
    ))
}
