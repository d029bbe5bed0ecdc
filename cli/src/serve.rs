//! `kvmesh serve`: the router, one prefill node and one decode node on
//! loopback in one process, each a real gRPC service on its own port (the
//! nodes' KV moves over the chosen KV transport), behind the
//! OpenAI-compatible HTTP gateway.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use kvmesh_decode::{DecodeConfig, DecodeNode, Transport};
use kvmesh_model::default_model;
use kvmesh_model::engine::EngineConfig;
use kvmesh_prefill::{PrefillConfig, PrefillNode};
use kvmesh_router::nodes::{Nodes, Role};
use kvmesh_router::{Router, RouterConfig};
use tokio::net::TcpListener;

use crate::ModelArgs;

/// How KV pages travel from prefill to decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TransportKind {
    /// KV frames over TCP, checked by the receiver before they land.
    Tcp,
    /// One-sided writes into the decode pool's shared-memory mapping.
    Shm,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address the gateway and the gRPC API listen on.
    #[arg(long, env = "KVMESH_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port of the OpenAI-compatible HTTP gateway (0: any free port).
    #[arg(long, env = "KVMESH_HTTP_PORT", default_value_t = 8080)]
    pub http_port: u16,
    /// Port of the public gRPC API (0: any free port).
    #[arg(long, env = "KVMESH_GRPC_PORT", default_value_t = 50051)]
    pub grpc_port: u16,
    /// Start even if a node's KV pool cannot hold one max-context request;
    /// nodes then advertise their real capacity and the router enforces it.
    #[arg(long, env = "KVMESH_ALLOW_SMALL_POOL")]
    pub allow_small_pool: bool,
    /// KV transport between prefill and decode.
    #[arg(long, env = "KVMESH_TRANSPORT", value_enum, default_value = "tcp")]
    pub transport: TransportKind,
    /// Directory of the shared-memory pool mapping (`--transport shm`).
    #[arg(long, env = "KVMESH_SHM_DIR", default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
}

async fn grpc_listener(addr: &str) -> Result<(TcpListener, SocketAddr)> {
    let l = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let a = l.local_addr()?;
    Ok((l, a))
}

pub fn run(a: ServeArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(serve(a))
}

async fn serve(a: ServeArgs) -> Result<()> {
    let path = match &a.model.model {
        Some(p) => p.clone(),
        None => default_model::ensure_default_model(&mut |msg| eprintln!("{msg}"))?,
    };
    let engine = EngineConfig {
        kv_pool_tokens: a.model.kv_pool_tokens,
        page_size: a.model.page_size,
        max_model_len: a.model.max_model_len,
        scrub: a.model.scrub,
        poison: a.model.poison,
    };
    let load =
        || kvmesh_model::load(&path).with_context(|| format!("loading model {}", path.display()));
    let decode_model = load()?;
    let max_model_len = engine
        .max_model_len
        .unwrap_or(decode_model.config.max_position_embeddings);
    let tokenizer = decode_model.tokenizer.clone();
    let stop_ids = decode_model.stop_token_ids();

    let transport = match a.transport {
        TransportKind::Tcp => Transport::Tcp("127.0.0.1:0".into()),
        TransportKind::Shm => Transport::Shm {
            dir: a.shm_dir.clone(),
            socket: std::env::temp_dir()
                .join(format!("kvmesh-{}-decode-0.sock", std::process::id())),
        },
    };
    let decode = DecodeNode::start(
        DecodeConfig {
            name: "decode-0".into(),
            engine: engine.clone(),
            allow_small_pool: a.allow_small_pool,
            transport,
            lease: Duration::from_secs(60),
            abort_timeout: Duration::from_secs(10),
        },
        decode_model,
    )
    .await?;
    let prefill = PrefillNode::start(
        PrefillConfig {
            name: "prefill-0".into(),
            engine,
            allow_small_pool: a.allow_small_pool,
        },
        load()?,
    )?;
    prefill
        .connect(decode.kv_endpoint())
        .await
        .context("connecting prefill to the decode node's KV transport")?;

    let (dl, daddr) = grpc_listener("127.0.0.1:0").await?;
    let (pl, paddr) = grpc_listener("127.0.0.1:0").await?;
    let dsvc = decode.service();
    let psvc = prefill.service();
    tokio::spawn(async move {
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(dl);
        if let Err(e) = tonic::transport::Server::builder()
            .add_service(dsvc)
            .serve_with_incoming(incoming)
            .await
        {
            tracing::error!(error = %e, "decode gRPC server");
        }
    });
    tokio::spawn(async move {
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(pl);
        if let Err(e) = tonic::transport::Server::builder()
            .add_service(psvc)
            .serve_with_incoming(incoming)
            .await
        {
            tracing::error!(error = %e, "prefill gRPC server");
        }
    });

    let nodes = Nodes::new(&[
        ("prefill-0".into(), Role::Prefill, format!("http://{paddr}")),
        ("decode-0".into(), Role::Decode, format!("http://{daddr}")),
    ])
    .map_err(anyhow::Error::msg)?;
    nodes.poll_all().await;
    let _poller = nodes.spawn_poller();
    let model_id = path
        .file_stem()
        .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
    let router = Router::new(
        RouterConfig {
            model_id,
            max_model_len,
            ..RouterConfig::default()
        },
        tokenizer,
        stop_ids,
        nodes,
    );
    let http = TcpListener::bind((a.host.as_str(), a.http_port))
        .await
        .with_context(|| format!("binding the HTTP gateway to {}:{}", a.host, a.http_port))?;
    let http_addr = http.local_addr()?;
    let (gl, gaddr) = grpc_listener(&format!("{}:{}", a.host, a.grpc_port)).await?;
    let public = kvmesh_router::grpc::service(router.clone());
    tokio::spawn(async move {
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(gl);
        if let Err(e) = public.serve_with_incoming(incoming).await {
            tracing::error!(error = %e, "public gRPC server");
        }
    });
    println!("kvmesh ready: model {}", router.config().model_id);
    println!("  OpenAI API  http://{http_addr}/v1");
    println!("  gRPC API    grpc://{gaddr}");
    println!("  metrics     http://{http_addr}/metrics");
    axum::serve(http, router.http())
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .context("HTTP gateway")?;
    Ok(())
}
