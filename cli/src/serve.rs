//! Running the mesh: `kvmesh serve` (router, one prefill and one decode
//! node on loopback in one process, each a real gRPC service on its own
//! port, KV over the chosen transport) and `kvmesh router|prefill|decode
//! --config mesh.yaml` (one service per process, for several processes or
//! hosts; each role's process is in `roles`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::Args;
use kvmesh_decode::Drained;
use kvmesh_kernels::cpu::{Activations, CpuKernels};
use kvmesh_kvxfer::transport::{ListenSettings, TransportKind};
use kvmesh_local::{LocalMesh, Models, Settings, DECODE_NAME, PREFILL_NAME};
use kvmesh_model::default_model;
use kvmesh_model::Precision;
use kvmesh_router::parsing::{ReasoningParserSetting, ToolParserSetting};
use kvmesh_router::{Listeners, Router, RouterConfig};
use kvmesh_tokenizer::ModelInfo;
use tokio::net::TcpListener;

use crate::config::MeshConfig;
use crate::ModelArgs;

/// How long a grant may wait for its transfer (`--lease-ms`, `lease_ms:`).
pub(crate) const LEASE: Duration = Duration::from_secs(60);
/// How long an abort may wait for the writer's confirmation
/// (`--abort-timeout-ms`, `abort_timeout_ms:`).
pub(crate) const ABORT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a drain lets work in flight finish (`--drain-timeout`,
/// `drain_timeout_ms:`).
pub(crate) const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// `--drain-timeout`: seconds (`30`, `30s`) or milliseconds (`500ms`).
pub(crate) fn parse_duration(v: &str) -> Result<Duration, String> {
    let v = v.trim();
    let (digits, scale) = if let Some(ms) = v.strip_suffix("ms") {
        (ms, 1)
    } else {
        (v.strip_suffix('s').unwrap_or(v), 1000)
    };
    digits
        .trim()
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{v:?}: expected seconds (30, 30s) or milliseconds (500ms)"))
}

/// A switch given as `on` or `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OnOff(pub bool);

impl std::str::FromStr for OnOff {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "on" => Ok(Self(true)),
            "off" => Ok(Self(false)),
            _ => Err(format!("{s:?}: expected on or off")),
        }
    }
}

/// `--transport`'s parser: the names and help lines of the transport
/// table ([`TransportKind::ALL`]), listed as a `ValueEnum`'s would be
/// (kvxfer does not link clap).
pub fn transport_parser() -> impl TypedValueParser<Value = TransportKind> {
    PossibleValuesParser::new(
        TransportKind::ALL.map(|k| PossibleValue::new(k.name()).help(k.about())),
    )
    .try_map(|s| s.parse::<TransportKind>())
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
    #[arg(long, env = "KVMESH_TRANSPORT", default_value = "tcp", value_parser = transport_parser())]
    pub transport: TransportKind,
    /// Prefix cache on both nodes: on or off. Cached pages are shared only
    /// within a tenant (the API key's; `cache_salt` narrows it).
    #[arg(long, env = "KVMESH_PREFIX_CACHE", default_value = "on")]
    pub prefix_cache: OnOff,
    /// Directory of the shared-memory pool mapping (`--transport shm`).
    #[arg(long, env = "KVMESH_SHM_DIR", default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// An API key and its tenant, KEY=TENANT, optionally with its scopes,
    /// KEY=TENANT:inference+metrics (repeat for more; in the environment,
    /// comma-separated; default scope: inference). With any key set,
    /// requests without a known `Authorization: Bearer KEY` get 401, and
    /// `/metrics` needs a key with the metrics scope.
    #[arg(long = "api-key", env = "KVMESH_API_KEYS", value_delimiter = ',')]
    pub api_keys: Vec<String>,
    #[command(flatten)]
    pub admission: AdmissionArgs,
    /// How long a grant may wait for its transfer, in milliseconds.
    #[arg(long, env = "KVMESH_LEASE_MS", default_value_t = LEASE.as_millis() as u64)]
    pub lease_ms: u64,
    /// How long an abort may wait for the writer's confirmation before
    /// its path is revoked, in milliseconds.
    #[arg(long, env = "KVMESH_ABORT_TIMEOUT_MS", default_value_t = ABORT_TIMEOUT.as_millis() as u64)]
    pub abort_timeout_ms: u64,
    /// On SIGTERM or ctrl-c, how long requests in flight may run on before
    /// they end with an error (seconds, or e.g. 500ms).
    #[arg(long, env = "KVMESH_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    #[command(flatten)]
    pub parsers: ParserArgs,
    #[command(flatten)]
    pub testing: TestingArgs,
}

/// How the router reads answers: tool calls and reasoning (vLLM's
/// `--tool-call-parser` and `--reasoning-parser`).
// The fields' docs are `--help` text, which names tags and tokens as users
// see them (`<think>`, `[TOOL_CALLS]`), not rustdoc markup.
#[allow(rustdoc::invalid_html_tags, rustdoc::broken_intra_doc_links)]
#[derive(Args, Debug, Clone, Default)]
pub struct ParserArgs {
    /// How tool_choice auto reads calls out of the text: auto (from the chat template: <tool_call> hermes, <|python_tag|> or Llama's "parameters" instruction llama3_json, [TOOL_CALLS] mistral, else hermes), hermes, llama3_json or mistral [default: auto; kvmesh router: the mesh file's tool_call_parser, else auto].
    #[arg(long, env = "KVMESH_TOOL_CALL_PARSER")]
    pub tool_call_parser: Option<ToolParserSetting>,
    /// How chat answers' reasoning becomes reasoning_content: auto (qwen3 when the chat template has <think>, else none), none, qwen3 or deepseek_r1 [default: auto; kvmesh router: the mesh file's reasoning_parser, else auto].
    #[arg(long, env = "KVMESH_REASONING_PARSER")]
    pub reasoning_parser: Option<ReasoningParserSetting>,
}

impl ParserArgs {
    /// The flags over `file`'s settings.
    fn over(
        &self,
        file: (ToolParserSetting, ReasoningParserSetting),
    ) -> (ToolParserSetting, ReasoningParserSetting) {
        (
            self.tool_call_parser.unwrap_or(file.0),
            self.reasoning_parser.unwrap_or(file.1),
        )
    }

    fn given(&self) -> bool {
        self.tool_call_parser.is_some() || self.reasoning_parser.is_some()
    }
}

/// Test-only switches, refused by builds without fault injection (see
/// `kvmesh_faults`).
#[derive(Args, Debug, Clone, Default)]
pub struct TestingArgs {
    /// Testing builds: honour the `x-kvmesh-fault` request header.
    #[arg(long)]
    pub fault_injection: bool,
    /// Testing builds: switch off one defence (no-admission,
    /// no-verification, no-confirm-or-revoke); repeat for more.
    #[arg(long = "plant-bug")]
    pub plant_bugs: Vec<String>,
}

impl TestingArgs {
    /// Plants the bugs; whether the router honours fault headers.
    /// Refused in a build without fault injection.
    pub fn apply(&self) -> Result<bool> {
        if !self.fault_injection && self.plant_bugs.is_empty() {
            return Ok(false);
        }
        if !kvmesh_faults::enabled() {
            return Err(kvmesh_faults::NotAvailable.into());
        }
        for name in &self.plant_bugs {
            let bug = kvmesh_faults::PlantedBug::from_name(name).ok_or_else(|| {
                let known: Vec<&str> = kvmesh_faults::PlantedBug::ALL
                    .iter()
                    .map(|(_, n)| *n)
                    .collect();
                anyhow::anyhow!("--plant-bug {name}: unknown; one of {}", known.join(", "))
            })?;
            kvmesh_faults::plant(bug)?;
        }
        Ok(self.fault_injection)
    }
}

/// `KEY=TENANT[:SCOPE+SCOPE]` values into the key table.
fn api_keys(pairs: &[String]) -> Result<kvmesh_router::auth::ApiKeys> {
    let parsed = pairs
        .iter()
        .map(|p| {
            let (key, rest) = p.split_once('=').ok_or_else(|| {
                anyhow::anyhow!(
                    "--api-key: expected KEY=TENANT[:SCOPES] (the value is a secret, so it is not shown)"
                )
            })?;
            let (tenant, scopes) = match rest.split_once(':') {
                None => (rest, vec![kvmesh_router::auth::Scope::Inference]),
                Some((t, s)) => (
                    t,
                    s.split('+')
                        .map(|s| s.parse().map_err(|e: String| anyhow::anyhow!("--api-key: {e}")))
                        .collect::<Result<Vec<_>>>()?,
                ),
            };
            Ok((key.to_owned(), tenant.to_owned(), scopes))
        })
        .collect::<Result<Vec<_>>>()?;
    kvmesh_router::auth::ApiKeys::with_scopes(parsed).map_err(anyhow::Error::msg)
}

/// `kvmesh router|prefill|decode` flags.
#[derive(Args, Debug)]
pub struct RoleArgs {
    /// The mesh file.
    #[arg(long, env = "KVMESH_CONFIG")]
    pub config: PathBuf,
    /// This node's name in the mesh file (prefill and decode).
    #[arg(long, env = "KVMESH_NODE")]
    pub name: Option<String>,
    /// Check the mesh file and these flags, print what would run, and exit
    /// without loading the model or opening a port.
    #[arg(long)]
    pub check_config: bool,
    /// On SIGTERM or ctrl-c, how long work in flight may run on before it
    /// is ended (seconds, or e.g. 500ms); default: the mesh file's
    /// `drain_timeout_ms`.
    #[arg(long, env = "KVMESH_DRAIN_TIMEOUT", value_parser = parse_duration)]
    pub drain_timeout: Option<Duration>,
    /// Prefix cache: on or off; default: the mesh file's `prefix_cache`.
    #[arg(long, env = "KVMESH_PREFIX_CACHE")]
    pub prefix_cache: Option<OnOff>,
    /// The router's parsers (refused for prefill and decode nodes).
    #[command(flatten)]
    pub parsers: ParserArgs,
    #[command(flatten)]
    pub testing: TestingArgs,
}

/// Which service a process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoleKind {
    /// The gateway.
    Router,
    /// A prefill node.
    Prefill,
    /// A decode node.
    Decode,
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")
}

fn model_path(model: &Option<PathBuf>) -> Result<PathBuf> {
    match model {
        Some(p) => Ok(p.clone()),
        None => Ok(default_model::ensure_default_model(&mut |msg| {
            eprintln!("{msg}")
        })?),
    }
}

fn load(path: &Path, precision: Precision) -> Result<kvmesh_model::LoadedModel> {
    kvmesh_model::load_with(path, precision)
        .with_context(|| format!("loading model {}", path.display()))
}

/// What the router needs of the model (tokenizer, context length, stop
/// ids), read from the GGUF header or the Hugging Face directory's JSON
/// files: no weight is read.
fn model_info(path: &Path) -> Result<ModelInfo> {
    ModelInfo::read(path).with_context(|| format!("reading model metadata {}", path.display()))
}

async fn listen(addr: &str, what: &str) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr} ({what})"))
}

/// Resolves at the first SIGTERM or ctrl-c: the start of a drain.
async fn terminated(drain: Duration) {
    let term = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch for SIGTERM; ctrl-c still drains");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
    kvmesh_ready::stopping();
    eprintln!(
        "kvmesh: shutting down: draining (at most {} ms)",
        drain.as_millis()
    );
}

/// The gateway's listeners, bound.
async fn router_listeners(http: &str, grpc: &str) -> Result<Listeners> {
    Ok(Listeners {
        http: listen(http, "the HTTP gateway").await?,
        grpc: listen(grpc, "the public gRPC API").await?,
    })
}

/// Prints the gateway's URLs and tells a supervisor waiting on
/// `$NOTIFY_SOCKET` that this process serves (`kvmesh_ready`).
fn announce(role: &str, router: &Router, http: SocketAddr, grpc: SocketAddr) {
    println!("kvmesh ready: model {}", router.config().model_id);
    println!("  parsers     {}", router.parsers().describe());
    println!("  OpenAI API  http://{http}/v1");
    println!("  gRPC API    grpc://{grpc}");
    println!("  metrics     http://{http}/metrics");
    kvmesh_ready::ready(
        role,
        &[
            ("KVMESH_HTTP", &http.to_string()),
            ("KVMESH_GRPC", &grpc.to_string()),
        ],
    );
}

/// Prints what a node's drain found; an error if it left anything behind.
fn drained(role: &str, name: &str, d: &Drained) -> Result<()> {
    println!("{role} node {name} drained: {d}");
    anyhow::ensure!(d.is_clean(), "{role} node {name} left state behind: {d}");
    Ok(())
}

fn model_id(path: &Path) -> String {
    path.file_stem()
        .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
}

pub fn run(a: ServeArgs) -> Result<()> {
    runtime()?.block_on(serve(a))
}

async fn serve(a: ServeArgs) -> Result<()> {
    let fault_injection = a.testing.apply()?;
    let path = model_path(&a.model.model)?;
    let engine = a.model.engine_config();
    let keys = api_keys(&a.api_keys)?;
    let shares = a.admission.shares()?;
    let models = Models {
        id: model_id(&path),
        decode: load(&path, engine.precision)?,
        prefill: load(&path, a.model.precision())?,
    };
    // A Unix control socket (the shm transport's) lives in a directory
    // only this user can enter (0700, a random name), removed when serve
    // returns: a predictable path in the shared temporary directory could
    // be taken first, or reached, by another user.
    let mut _socket_dir = None;
    let transport =
        ListenSettings::loopback(a.transport, a.shm_dir.clone(), || -> Result<String> {
            let dir = tempfile::Builder::new()
                .prefix("kvmesh-serve-")
                .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .tempdir()
                .context("creating a private directory for the KV socket")?;
            let socket = dir.path().join("decode-0.sock");
            tracing::info!(socket = %socket.display(), "KV socket in a private directory");
            let socket = socket
                .to_str()
                .context("the KV socket's path is not UTF-8")?
                .to_owned();
            _socket_dir = Some(dir);
            Ok(socket)
        })?;
    let listeners = router_listeners(
        &format!("{}:{}", a.host, a.http_port),
        &format!("{}:{}", a.host, a.grpc_port),
    )
    .await?;
    let settings = Settings {
        engine,
        transport,
        allow_small_pool: a.allow_small_pool,
        lease: Duration::from_millis(a.lease_ms),
        abort_timeout: Duration::from_millis(a.abort_timeout_ms),
        drain_timeout: a.drain_timeout,
        prefix_cache: a.prefix_cache.0,
        router: RouterConfig {
            api_keys: keys,
            max_running: a.admission.max_running,
            max_queued: a.admission.max_queued,
            admission: a.admission.admission,
            reserve: a.admission.reserve,
            shares,
            fault_injection,
            tool_call_parser: a.parsers.tool_call_parser.unwrap_or_default(),
            reasoning_parser: a.parsers.reasoning_parser.unwrap_or_default(),
            ..RouterConfig::default()
        },
    };
    let mesh = LocalMesh::start(models, settings, listeners, terminated(a.drain_timeout)).await?;
    announce("serve", mesh.router(), mesh.http(), mesh.grpc());
    let d = mesh.wait().await?;
    drained("prefill", PREFILL_NAME, &d.prefill)?;
    drained("decode", DECODE_NAME, &d.decode)?;
    println!("kvmesh: drained, exiting");
    Ok(())
}

/// `kvmesh router|prefill|decode --config mesh.yaml`.
pub fn run_role(
    role: RoleKind,
    a: RoleArgs,
    cpu_kernels: Option<CpuKernels>,
    activations: Option<Activations>,
) -> Result<()> {
    let mut cfg = MeshConfig::load(&a.config)?;
    if let Some(on) = a.prefix_cache {
        cfg.prefix_cache = on.0;
    }
    let name = match (role, &a.name) {
        (RoleKind::Router, _) => None,
        (_, Some(n)) => Some(n.clone()),
        (RoleKind::Prefill, None) => Some(only(&cfg.prefill, "prefill", &a.config)?),
        (RoleKind::Decode, None) => Some(only(&cfg.decode, "decode", &a.config)?),
    };
    let role_name = match role {
        RoleKind::Router => "router",
        RoleKind::Prefill => "prefill",
        RoleKind::Decode => "decode",
    };
    if let Some(n) = &name {
        cfg.node(role_name, n)?;
    }
    if role != RoleKind::Router && a.parsers.given() {
        anyhow::bail!(
            "--tool-call-parser and --reasoning-parser apply to the router only, not to a {role_name} node"
        );
    }
    let parsers = a.parsers.over(cfg.router.parsers(&cfg.file)?);
    // The standard variables over the file's section; `--check-config`
    // checks them too.
    let traces = kvmesh_telemetry::Settings::from_env(cfg.tracing().as_ref())?;
    let telemetry = kvmesh_telemetry::init(
        match role {
            RoleKind::Router => kvmesh_telemetry::Service::Router,
            RoleKind::Prefill => kvmesh_telemetry::Service::Prefill,
            RoleKind::Decode => kvmesh_telemetry::Service::Decode,
        },
        name.as_deref(),
        &if a.check_config {
            kvmesh_telemetry::Settings::off()
        } else {
            traces.clone()
        },
    )?;
    // The flag over the node's own setting over the mesh's.
    let cpu_kernels = match cpu_kernels {
        Some(c) => c,
        None => cfg.cpu_kernels_for(role_name, name.as_deref())?,
    };
    let activations = match activations {
        Some(a) => a,
        None => cfg.activations()?,
    };
    // The router runs no model: its device is the CPU's.
    let (device, device_weights) = match role {
        RoleKind::Router => (
            kvmesh_cuda::DeviceSpec::Cpu,
            kvmesh_cuda::ops::WeightDtype::F32,
        ),
        _ => node_device(&cfg, role_name, name.as_deref().unwrap_or_default())?,
    };
    let auth = cfg.mesh_auth()?;
    let tls = cfg.tls_for(name.as_deref().unwrap_or("router"))?;
    let etcd = cfg.etcd(name.as_deref().unwrap_or("router"))?;
    if let Some(t) = etcd.as_ref().and_then(|e| e.tls.as_ref()) {
        cfg.check_etcd_tls(t, name.as_deref().unwrap_or("router"))?;
    }
    if a.check_config {
        let members = match &etcd {
            None => format!(
                "{} prefill and {} decode nodes",
                cfg.prefill.len(),
                cfg.decode.len()
            ),
            Some(e) => e.describe(),
        };
        let parsers = match role {
            // `auto` reads the chat template at start; no model is read here.
            RoleKind::Router => format!(
                "; tool-call parser {}, reasoning parser {}",
                parsers.0, parsers.1
            ),
            _ => String::new(),
        };
        println!(
            "config ok: {}: {role_name}{}{parsers}; {}; {members}, transport {}; CPU kernels {cpu_kernels}, activations {activations}; device {device}{}; {}; {}; {}; {}",
            a.config.display(),
            name.as_deref().map(|n| format!(" {n}")).unwrap_or_default(),
            describe_model(cfg.model.as_deref()),
            cfg.transport,
            if device.is_cuda() {
                format!(" (weights {device_weights})")
            } else {
                String::new()
            },
            cfg.describe_pools(),
            auth.describe(),
            tls.as_ref().map_or_else(
                || "TLS: off".to_owned(),
                |t| format!("TLS: mutual, certificate {}", t.files().cert.display())
            ),
            match &traces.endpoint {
                Some(e) => format!(
                    "traces to {e} (sample ratio {}{})",
                    traces.sampling.ratio,
                    if traces.sampling.parent_based {
                        ", parent-based"
                    } else {
                        ""
                    }
                ),
                None => "traces off".into(),
            }
        );
        return Ok(());
    }
    // The router runs no model kernels: a mesh's avx512 must not stop a
    // router on an older host.
    if !matches!(role, RoleKind::Router) {
        crate::select_cpu_kernels(cpu_kernels, activations)?;
    }
    let secret = auth.secret();
    let fault_injection = a.testing.apply()?;
    let drain = a.drain_timeout.unwrap_or_else(|| cfg.drain_timeout());
    let name = name.as_deref().unwrap_or_default();
    let insecure_etcd = etcd.is_some() && tls.is_none();
    let served = runtime()?.block_on(async move {
        if insecure_etcd {
            tokio::spawn(crate::membership::warn_insecure_etcd());
        }
        let etcd = etcd.as_ref();
        match role {
            RoleKind::Router => {
                router_process(&cfg, etcd, fault_injection, secret, tls, drain, parsers).await
            }
            RoleKind::Prefill => prefill_process(&cfg, etcd, name, secret, tls, drain).await,
            RoleKind::Decode => decode_process(&cfg, etcd, name, secret, tls, drain).await,
        }
    });
    // Every span of the drain too is exported before the process exits.
    if let Err(e) = telemetry.shutdown() {
        tracing::warn!(error = %e, "flushing traces");
    }
    served
}

/// The model a mesh file names, for `--check-config`: its architecture and
/// how its weights are stored, read from its metadata without weights, or
/// why it cannot be read on this host (checking a file for another host is
/// not an error; starting without the model is, and says so then).
fn describe_model(path: Option<&Path>) -> String {
    let path = match path {
        Some(p) => p.to_owned(),
        None => match kvmesh_model::default_model::cached_default_model() {
            Some(p) => p,
            None => return "model: the default, not fetched on this host".into(),
        },
    };
    match ModelInfo::read(&path) {
        Ok(info) => {
            let (architecture, quantization) = info.description();
            format!(
                "model {}: {architecture}, weights {quantization}, context {}",
                path.display(),
                info.context_length
            )
        }
        Err(e) => format!("model {}: not readable on this host ({e})", path.display()),
    }
}

fn only(nodes: &[crate::config::NodeSection], role: &str, file: &Path) -> Result<String> {
    match nodes {
        [one] => Ok(one.name.clone()),
        _ => anyhow::bail!(
            "{}: {} {role} nodes: say which with --name",
            file.display(),
            nodes.len()
        ),
    }
}

/// A prefill or decode node's device and device weight type: `--device`
/// over the node's `device` over the mesh's; weights the node's over the
/// mesh's, refused for a node on the CPU (as the engine would refuse them
/// at load, but already at `--check-config`).
fn node_device(
    cfg: &MeshConfig,
    role: &str,
    name: &str,
) -> Result<(kvmesh_cuda::DeviceSpec, kvmesh_cuda::ops::WeightDtype)> {
    let device = match crate::device_flag() {
        Some(d) => d,
        None => cfg.device_for(role, Some(name))?,
    };
    let weights = cfg.device_weights_for(role, Some(name))?;
    if !device.is_cuda() && weights != kvmesh_cuda::ops::WeightDtype::F32 {
        anyhow::bail!(
            "{}: device_weights {weights} applies to a CUDA device only; this node runs on {device}",
            cfg.file.display()
        );
    }
    Ok((device, weights))
}

mod admission;
mod roles;
pub use admission::AdmissionArgs;
use roles::{decode_process, prefill_process, router_process};
