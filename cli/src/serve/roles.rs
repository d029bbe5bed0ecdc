//! One service per process (`kvmesh router|prefill|decode --config
//! mesh.yaml`): each role's process, from the mesh file's settings to its
//! drain.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use kvmesh_decode::{DecodeConfig, DecodeNode};
use kvmesh_discovery::EtcdConfig;
use kvmesh_kvxfer::transport::ListenSettings;
use kvmesh_meshauth::tls::MeshTls;
use kvmesh_meshauth::MeshSecret;
use kvmesh_model::engine::EngineConfig;
use kvmesh_prefill::{PrefillConfig, PrefillNode};
use kvmesh_router::nodes::{Nodes, Role};
use kvmesh_router::parsing::{ReasoningParserSetting, ToolParserSetting};
use kvmesh_router::{Router, RouterConfig};

use super::{
    announce, drained, listen, load, model_id, model_info, model_path, node_device,
    router_listeners, terminated,
};
use crate::config::MeshConfig;
use crate::membership;

/// A prefill or decode node's engine settings: the mesh's, its pool, and
/// its device ([`node_device`]).
fn engine_config(
    cfg: &MeshConfig,
    role: &str,
    name: &str,
    kv_pool_tokens: Option<usize>,
) -> Result<EngineConfig> {
    let (device, device_weights) = node_device(cfg, role, name)?;
    Ok(EngineConfig {
        kv_pool_tokens,
        page_size: cfg.page_size,
        max_model_len: cfg.max_model_len,
        precision: cfg.precision(),
        kv_dtype: cfg.kv_dtype(),
        scrub: cfg.scrub,
        poison: cfg.poison,
        device,
        device_weights,
    })
}

pub(super) async fn decode_process(
    cfg: &MeshConfig,
    etcd: Option<&EtcdConfig>,
    name: &str,
    mesh_secret: MeshSecret,
    tls: Option<Arc<MeshTls>>,
    drain: Duration,
) -> Result<()> {
    let n = cfg.node("decode", name)?;
    let path = model_path(&cfg.model)?;
    let kv = n.kv.clone().unwrap_or_default();
    let transport = ListenSettings {
        kind: cfg.transport_kind(),
        control: n.kv_listen.clone().unwrap_or(kv),
        shm_dir: cfg.shm_dir.clone(),
        // Read by the ucx transport only, and checked by validation
        // there; other transports ignore it, as they always did.
        ucx_listen: n
            .ucx_listen_addr()
            .unwrap_or_else(|_| std::net::SocketAddr::from(([0, 0, 0, 0], 0))),
    };
    let node = DecodeNode::start(
        DecodeConfig {
            name: name.to_owned(),
            engine: engine_config(cfg, "decode", name, n.kv_pool_tokens)?,
            allow_small_pool: cfg.allow_small_pool,
            transport,
            lease: cfg.lease(),
            abort_timeout: cfg.abort_timeout(),
            kv_advertise: Some(cfg.kv_endpoint(n)),
            mesh_secret,
            tls,
            drain_timeout: drain,
            prefix_cache: cfg.prefix_cache,
        },
        load(&path, cfg.precision())?,
    )
    .await?;
    let l = listen(n.listen.as_deref().unwrap_or(&n.grpc), "the decode node").await?;
    // Listening on both ports: only now may routers and prefill nodes learn
    // of it.
    let reg = match etcd {
        Some(e) => Some(membership::register(e, cfg.member("decode", n)?).await?),
        None => None,
    };
    let at = l.local_addr()?;
    println!(
        "decode node {name} ready: gRPC {at}, KV {}",
        node.kv_endpoint()
    );
    kvmesh_ready::ready(
        "decode",
        &[("KVMESH_NODE", name), ("KVMESH_LISTEN", &at.to_string())],
    );
    let d = kvmesh_decode::run(node, l, membership::leave_first(terminated(drain), reg)).await?;
    drained("decode", name, &d)
}

pub(super) async fn prefill_process(
    cfg: &MeshConfig,
    etcd: Option<&EtcdConfig>,
    name: &str,
    mesh_secret: MeshSecret,
    tls: Option<Arc<MeshTls>>,
    drain: Duration,
) -> Result<()> {
    let n = cfg.node("prefill", name)?;
    let path = model_path(&cfg.model)?;
    let node = PrefillNode::start(
        PrefillConfig {
            name: name.to_owned(),
            engine: engine_config(cfg, "prefill", name, n.kv_pool_tokens)?,
            allow_small_pool: cfg.allow_small_pool,
            mesh_secret,
            tls,
            drain_timeout: drain,
            prefix_cache: cfg.prefix_cache,
        },
        load(&path, cfg.precision())?,
    )?;
    // With etcd: connect to the decode nodes registered now, and from then
    // on to every one that registers (or whose connection broke). Static:
    // connect to every decode node's KV listener (retrying while they
    // start), so each can grant to this writer, then keep connected the
    // same way (a decode node restarted at its address needs a new
    // connection).
    let peers = match etcd {
        Some(e) => membership::DecodePeers::start(e, &node).await,
        None => {
            let mut fixed = Vec::new();
            for d in &cfg.decode {
                let ep = cfg.kv_endpoint(d);
                let mut tries = 0;
                while let Err(e) = node.connect(&ep).await {
                    tries += 1;
                    if tries % 10 == 1 {
                        tracing::warn!(decode = %d.name, endpoint = %ep, error = %e, "waiting for the decode node's KV listener");
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                fixed.push((d.name.clone(), ep));
            }
            membership::DecodePeers::fixed(&node, fixed)
        }
    };
    let l = listen(n.listen.as_deref().unwrap_or(&n.grpc), "the prefill node").await?;
    let reg = match etcd {
        Some(e) => Some(membership::register(e, cfg.member("prefill", n)?).await?),
        None => None,
    };
    let at = l.local_addr()?;
    println!("prefill node {name} ready: gRPC {at}");
    kvmesh_ready::ready(
        "prefill",
        &[("KVMESH_NODE", name), ("KVMESH_LISTEN", &at.to_string())],
    );
    let d = kvmesh_prefill::run(node, l, membership::leave_first(terminated(drain), reg)).await?;
    peers.stop().await;
    drained("prefill", name, &d)
}

pub(super) async fn router_process(
    cfg: &MeshConfig,
    etcd: Option<&EtcdConfig>,
    fault_injection: bool,
    mesh_secret: MeshSecret,
    tls: Option<Arc<MeshTls>>,
    drain: Duration,
    parsers: (ToolParserSetting, ReasoningParserSetting),
) -> Result<()> {
    let path = model_path(&cfg.model)?;
    // The router needs only the tokenizer and limits: no weight is read.
    let info = model_info(&path)?;
    let max_model_len = cfg.max_model_len.unwrap_or(info.context_length);
    let stop_ids = info.stop_token_ids();
    tracing::info!(
        model = %path.display(),
        architecture = %info.architecture,
        quantization = %info.quantization,
        "model metadata read"
    );
    let model_description = info.description();
    let tokenizer = info.tokenizer;
    let admission = cfg.router.admission(&cfg.file)?;
    // Static: the file's nodes. Etcd: none until the watcher's first view,
    // then whatever registers.
    let specs: Vec<(String, Role, String)> = cfg
        .prefill
        .iter()
        .map(|n| (n.name.clone(), Role::Prefill, format!("http://{}", n.grpc)))
        .chain(
            cfg.decode
                .iter()
                .map(|n| (n.name.clone(), Role::Decode, format!("http://{}", n.grpc))),
        )
        .filter(|_| etcd.is_none())
        .collect();
    let nodes = Nodes::with_tls(&specs, mesh_secret, tls).map_err(anyhow::Error::msg)?;
    let following = match etcd {
        Some(e) => Some(membership::follow(e, &nodes).await),
        None => None,
    };
    nodes.poll_all().await;
    let poller = nodes.spawn_poller();
    let router = Router::new(
        RouterConfig {
            model_id: model_id(&path),
            model_description,
            max_model_len,
            max_running: cfg.router.max_running,
            max_queued: cfg.router.max_queued,
            admission: admission.0,
            reserve: cfg.router.reserve,
            shares: admission.1,
            fault_injection,
            drain_timeout: drain,
            prefix_cache: cfg.prefix_cache,
            tool_call_parser: parsers.0,
            reasoning_parser: parsers.1,
            api_keys: kvmesh_router::auth::ApiKeys::with_scopes(
                cfg.router
                    .api_keys
                    .iter()
                    .enumerate()
                    .map(|(i, k)| {
                        Ok((
                            k.key.clone(),
                            k.tenant.clone(),
                            k.parsed_scopes(i, &cfg.file)?,
                        ))
                    })
                    .collect::<Result<Vec<_>>>()?,
            )
            .map_err(anyhow::Error::msg)?,
            ..RouterConfig::default()
        },
        tokenizer,
        stop_ids,
        nodes,
    );
    let listeners = router_listeners(&cfg.router.http, &cfg.router.grpc).await?;
    let (http, grpc) = listeners.addrs()?;
    announce("router", &router, http, grpc);
    let served = kvmesh_router::run(router, listeners, terminated(drain)).await;
    poller.abort();
    if let Some(f) = following {
        f.stop().await;
    }
    served.context("the gateway")?;
    println!("kvmesh router drained, exiting");
    Ok(())
}
