//! `kvmesh prometheus-config --config mesh.yaml`: the Prometheus scrape
//! configuration of a mesh, from its mesh file. Two jobs: `kvmesh-router`
//! (the gateway's `/metrics`: requests, TTFT, ITL, and its relayed view of
//! every node) and `kvmesh-nodes` (each prefill and decode node's own
//! `/metrics`, served on its gRPC port). The nodes' series carry their own
//! `node` and `role` labels, so the targets add none (a target label of
//! the same name would rename the series' to `exported_node`).

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
    static_configs: Vec<Targets>,
}

#[derive(Serialize)]
struct Targets {
    targets: Vec<String>,
}

/// Prints the scrape configuration.
pub fn run(a: ScrapeArgs) -> Result<()> {
    let cfg = MeshConfig::load(&a.config)?;
    print!("{}", render(&cfg, &a.interval)?);
    Ok(())
}

/// The configuration's text. A wildcard listen address of the router is
/// scraped on loopback (the file names no address others dial for it).
pub fn render(cfg: &MeshConfig, interval: &str) -> Result<String> {
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
    let job = |job_name, targets| Job {
        job_name,
        scrape_interval: interval.to_owned(),
        metrics_path: "/metrics",
        static_configs: vec![Targets { targets }],
    };
    let file = File {
        scrape_configs: vec![
            job("kvmesh-router", vec![router]),
            job("kvmesh-nodes", nodes),
        ],
    };
    Ok(format!(
        "# Prometheus scrape configuration of the mesh in {}, from `kvmesh prometheus-config`.\n{}",
        cfg.file.display(),
        serde_yaml_ng::to_string(&file)?
    ))
}
