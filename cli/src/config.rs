//! The mesh file: one YAML document describing every node of a mesh, read
//! by `kvmesh router|prefill|decode --config mesh.yaml`. A bad file is
//! refused naming the field, its value and the reason.
//!
//! ```yaml
//! model: /models/SmolLM2-135M-Instruct.Q4_1.gguf   # omit: the default model
//! max_model_len: 2048          # omit: the model's
//! exact: false                 # true: f32 weights (default: GGUF blocks as stored)
//! kv_cache_dtype: auto         # f16 or f32; auto: f16 with quantized weights, f32 exact
//! cpu_kernels: auto            # or avx512, avx2, portable (a node may set its own;
//!                              #   --cpu-kernels overrides both)
//! activations: int8            # or f32: the quantized matmuls' numerics class,
//!                              #   one per mesh (--activations overrides it)
//! device: cpu                  # or cuda, cuda:N: where prefill and decode nodes
//!                              #   compute (a node may set its own; --device
//!                              #   overrides both)
//! device_weights: f32          # on a CUDA device: f32, f16 or bf16 dense weights
//!                              #   (a node may set its own; refused on the CPU)
//! page_size: 16
//! transport: tcp               # or shm (prefill and decode on one host), or ucx
//!                              # (one-sided UCX puts; RDMA where the fabric has it)
//! allow_small_pool: false
//! lease_ms: 60000              # how long a grant waits for its transfer
//! abort_timeout_ms: 10000      # how long an abort waits for the writer's confirmation
//! drain_timeout_ms: 30000      # on SIGTERM: how long work in flight may run on
//! scrub: off                   # zero KV pages: off, on-release or on-allocate
//! poison: false                # debug: a canary in free pages, checked on every read
//! prefix_cache: on             # reuse a tenant's cached prompt pages (on or off)
//! mesh:                        # mesh-internal authentication (required)
//!   secret_file: mesh.secret   # 32+ random bytes, the same file on every
//!                              #   node; relative to this file's folder
//!   # insecure_no_mesh_auth: true   # instead: no authentication (tests)
//!   # tls:                     # mutual TLS on every internal channel too
//!   #   ca_file: certs/ca.pem  #   (relative to this file; {name} is the
//!   #   cert_file: certs/{name}.pem   #   process's node name, `router`
//!   #   key_file: certs/{name}-key.pem  #   for the router; `kvmesh certs`
//!   #                          #   mints them)
//! tracing:                     # omit: no traces (OTEL_* variables still apply)
//!   otlp_endpoint: http://collector:4317   # OTLP over gRPC
//!   sample_ratio: 0.1          # new traces kept; a client's sampled
//!                              #   traceparent is always followed
//!   # The standard variables win over this section, per process:
//!   # OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, OTEL_TRACES_SAMPLER(_ARG),
//!   # OTEL_SERVICE_NAME (default kvmesh-router, -prefill, -decode; a
//!   # node's name is its service.instance.id), OTEL_SDK_DISABLED.
//! router:
//!   http: 0.0.0.0:8080
//!   grpc: 0.0.0.0:50051
//!   max_running: 64            # choices dispatched at once (n: 16 holds 16)
//!   max_queued: 256            # choices waiting at most
//!   admission: fair            # or fifo: per-tenant queues served fairly,
//!                              #   or one queue in arrival order
//!   # reserve: 8                 # slots only a tenant running nothing may
//!                              #   take (default: max_running / 8 with keys
//!                              #   of several tenants, else 0)
//!   # default_share: {max_running: 48}   # every tenant's; keys override
//!   api_keys:                  # omit: no authentication
//!     - {key: sk-alpha-..., tenant: alpha}
//!     - {key: sk-beta-..., tenant: beta, weight: 2, max_running: 16,
//!        max_queued_tokens: 65536}   # optional, per tenant (its keys agree)
//!   tool_call_parser: auto     # or hermes, llama3_json, mistral (auto: from
//!                              #   the chat template; --tool-call-parser wins)
//!   reasoning_parser: auto     # or none, qwen3, deepseek_r1 (auto: qwen3 when
//!                              #   the template has <think>; --reasoning-parser wins)
//! discovery: static             # or etcd: nodes register themselves (below)
//! # etcd:                        # with discovery: etcd only
//! #   endpoints: [etcd-0:2379]   # HOST:PORT or http://HOST:PORT, one per member
//! #   tls: {ca_file: certs/ca.pem, cert_file: "certs/{name}.pem",  # etcd with
//! #         key_file: "certs/{name}-key.pem"}   # --client-cert-auth (https://)
//! #   prefix: /kvmesh/prod/      # this mesh's keys (one prefix per mesh)
//! #   lease_ttl_s: 3             # a killed node leaves every view within this
//! #   dial_timeout_ms: 2000      # bound on connecting and on each etcd call
//! prefill:                     # static: every node; etcd: each node's own
//!                              #   settings (the router takes the members from etcd)
//!   - name: prefill-0
//!     grpc: prefill-0:7101       # what the router dials
//!     listen: 0.0.0.0:7101       # omit: same as grpc
//!     kv_pool_tokens: 4096
//! decode:
//!   - name: decode-0
//!     grpc: decode-0:7201
//!     listen: 0.0.0.0:7201
//!     kv: decode-0:7301          # KV transport: what prefill dials (tcp),
//!     kv_listen: 0.0.0.0:7301    #   or a Unix socket path (shm)
//!     ucx_listen: 0.0.0.0:7401   # ucx only: UCX's listener (default 0.0.0.0:0)
//!     kv_pool_tokens: 4096
//!     # cpu_kernels: avx2        # this node's, over the mesh's
//!     # device: cuda:1           # this node's, over the mesh's
//!     # device_weights: bf16     # this node's, over the mesh's
//! ```
//!
//! With `discovery: etcd`, each prefill and decode node registers its
//! `name`, role, `grpc` and (decode) `kv` under `prefix` with a lease of
//! `lease_ttl_s` and keeps it alive; SIGTERM revokes it before the drain.
//! The router and the prefill nodes watch the prefix, so nodes join and
//! leave without a restart, and the `prefill`/`decode` lists may be empty
//! for the router. Registrations carry no secret: a registered node that
//! lacks `mesh.secret_file` fails every call's authentication and is never
//! chosen (`docs/membership.md`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::time::Duration;

use anyhow::{bail, Context, Result};
use kvmesh_discovery::EtcdConfig;
use kvmesh_kvpool::{ParseScrubModeError, ScrubMode};
use kvmesh_kvxfer::transport::TransportKind;
use kvmesh_meshauth::tls::{MeshTls, TlsFiles};
use kvmesh_meshauth::{readable_by_others, MeshSecret};
use serde::Deserialize;

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeshConfig {
    /// Model file or directory; `None`: the default model.
    pub model: Option<PathBuf>,
    /// Context window.
    pub max_model_len: Option<usize>,
    /// f32 weights and activations on every node (the exact mode); default:
    /// a GGUF's Q4_1 / Q8_0 blocks as stored, with f32 activations. Every
    /// node of a mesh runs the same mode, so a transfer carries the KV the
    /// decode node would have computed itself.
    #[serde(default)]
    pub exact: bool,
    /// Element type of every node's KV pool: `auto` (f16 with quantized
    /// weights, f32 in the exact mode), `f16` or `f32`. One for the whole
    /// mesh: a prefill node refuses grants of another dtype.
    #[serde(default = "default_kv_cache_dtype")]
    pub kv_cache_dtype: String,
    /// Every node's CPU kernel path (`auto`, `avx512`, `avx2`, `portable`)
    /// unless the node sets its own. `auto` is each host's widest: avx512
    /// and avx2 compute the same bits, so a mesh of mixed CPU generations
    /// pairs freely; the router pairs a portable node only with portable
    /// ones.
    #[serde(default = "default_cpu_kernels")]
    pub cpu_kernels: String,
    /// The quantized matmuls' activation class for every node (`f32` or
    /// `int8`): one per mesh, since it is part of the numerics the router
    /// pairs nodes by.
    #[serde(default = "default_activations")]
    pub activations: String,
    /// Where prefill and decode nodes compute: `cpu`, `cuda` or `cuda:N`
    /// (a node's own `device` over this; `--device` over both).
    #[serde(default = "default_device")]
    pub device: String,
    /// On a CUDA device, the type dense weights are held in: `f32`, `f16`
    /// or `bf16` (a node's own over this).
    #[serde(default = "default_device_weights")]
    pub device_weights: String,
    /// Token slots per page.
    #[serde(default = "default_page_size")]
    pub page_size: usize,
    /// The KV transport's name (`tcp`, `shm` or `ucx`: a
    /// [`TransportKind`]); read it through [`Self::transport_kind`].
    #[serde(default = "default_transport")]
    pub transport: String,
    /// Directory of shared-memory pool mappings.
    #[serde(default = "default_shm_dir")]
    pub shm_dir: PathBuf,
    /// Start nodes whose pool cannot hold one max-context request.
    #[serde(default)]
    pub allow_small_pool: bool,
    /// How long a decode node's grant may wait for its transfer before the
    /// lease ends it (revoked, then freed), milliseconds.
    #[serde(default = "default_lease_ms")]
    pub lease_ms: u64,
    /// How long a decode node waits for a writer's abort confirmation
    /// before it revokes the writer's path, milliseconds.
    #[serde(default = "default_abort_timeout_ms")]
    pub abort_timeout_ms: u64,
    /// On SIGTERM or ctrl-c, how long every node lets work in flight run
    /// on before it ends it, milliseconds (`--drain-timeout` overrides).
    #[serde(default = "default_drain_timeout_ms")]
    pub drain_timeout_ms: u64,
    /// Zeroing of every node's KV pages (I6): `off`, `on-release` or
    /// `on-allocate`; parsed once, here.
    #[serde(default, deserialize_with = "scrub_mode")]
    pub scrub: ScrubMode,
    /// Debug poison mode on every node: free pages hold a canary that any
    /// read refuses (costs a scan per read; off in production).
    #[serde(default)]
    pub poison: bool,
    /// The prefix cache on every node (`on` or `off`, or a YAML boolean);
    /// on by default. `--prefix-cache` overrides it.
    #[serde(default = "default_on", deserialize_with = "on_off")]
    pub prefix_cache: bool,
    /// Mesh-internal authentication; required.
    pub mesh: Option<MeshSection>,
    /// How the router and the prefill nodes find the nodes: `static` (the
    /// lists below) or `etcd` (the `etcd` section).
    #[serde(default, deserialize_with = "discovery_kind")]
    pub discovery: DiscoveryKind,
    /// With `discovery: etcd`: where etcd is, and the mesh's key prefix.
    pub etcd: Option<EtcdSection>,
    /// Traces; none: off unless the `OTEL_*` variables say otherwise.
    #[serde(default)]
    pub tracing: Option<TracingSection>,
    /// The router.
    pub router: RouterSection,
    /// Prefill nodes (with etcd: only each node's own settings).
    #[serde(default)]
    pub prefill: Vec<NodeSection>,
    /// Decode nodes (with etcd: only each node's own settings).
    #[serde(default)]
    pub decode: Vec<NodeSection>,
    /// The file this was read from (relative paths in it are relative to
    /// its folder).
    #[serde(skip)]
    pub file: PathBuf,
}

/// How the mesh's own services know each other: one secret, or (test
/// meshes only) none.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeshSection {
    /// The per-mesh secret's file (at least 32 bytes, used verbatim; the
    /// same file on every node), relative to the mesh file's folder.
    pub secret_file: Option<PathBuf>,
    /// No authentication: anyone who reaches a node's ports may reserve,
    /// abort and write KV. For test meshes only; each process warns.
    #[serde(default)]
    pub insecure_no_mesh_auth: bool,
    /// Mutual TLS on every internal gRPC channel and the TCP KV transport,
    /// on top of the secret.
    pub tls: Option<TlsSection>,
}

/// `mesh.tls`: PEM files, relative to the mesh file's folder; `{name}` in
/// a path is the process's node name (`router` for the router), so one
/// mesh file names every node's own certificate and key.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    /// The mesh's CA certificate: every peer's certificate must chain to it.
    pub ca_file: String,
    /// The node's certificate chain (it must name, as a DNS or IP subject
    /// alternative name, the host its peers dial: its `grpc` and `kv`).
    pub cert_file: String,
    /// The node's private key.
    pub key_file: String,
}

/// `discovery:`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DiscoveryKind {
    /// The mesh file's node lists, read once at start.
    #[default]
    Static,
    /// Nodes register in etcd; the router and prefill nodes watch it.
    Etcd,
}

/// `etcd:`, with `discovery: etcd`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdSection {
    /// `HOST:PORT` or `http://HOST:PORT` of each etcd member.
    pub endpoints: Vec<String>,
    /// The key prefix of this mesh's registrations (`/kvmesh/prod/`);
    /// required, so two meshes sharing an etcd cannot mix by default.
    pub prefix: Option<String>,
    /// Lease TTL of every registration, seconds: how long a node killed
    /// without a word stays in the views.
    #[serde(default = "default_lease_ttl_s")]
    pub lease_ttl_s: u64,
    /// Bound on connecting to etcd and on each call, milliseconds.
    #[serde(default = "default_dial_timeout_ms")]
    pub dial_timeout_ms: u64,
    /// TLS to etcd with a client certificate (etcd's `--client-cert-auth`):
    /// its CA, and each process's certificate and key (`{name}` as in
    /// `mesh.tls`).
    pub tls: Option<TlsSection>,
    /// Accepts `discovery: etcd` without `mesh.tls`. Anything that can
    /// write to that etcd can then register an address the router sends
    /// prompts to over plain gRPC: mesh authentication keeps a process
    /// without the secret from ever being chosen, but nothing hides the
    /// traffic from the network. Test meshes only; warned every minute.
    #[serde(default)]
    pub allow_insecure_etcd: bool,
}

fn default_lease_ttl_s() -> u64 {
    kvmesh_discovery::config::DEFAULT_LEASE_TTL_S
}

fn default_dial_timeout_ms() -> u64 {
    kvmesh_discovery::config::DEFAULT_DIAL_TIMEOUT.as_millis() as u64
}

/// `discovery:` as its typed value, refused naming the field and the value.
fn discovery_kind<'de, D: serde::Deserializer<'de>>(d: D) -> Result<DiscoveryKind, D::Error> {
    let s = String::deserialize(d)?;
    match s.as_str() {
        "static" => Ok(DiscoveryKind::Static),
        "etcd" => Ok(DiscoveryKind::Etcd),
        _ => Err(serde::de::Error::custom(format!(
            "discovery = {s:?}: expected static or etcd"
        ))),
    }
}

/// Where every process of the mesh sends its spans (`kvmesh_telemetry`;
/// the `OTEL_*` variables override it per process).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingSection {
    /// The OTLP/gRPC collector, `http://host:4317`.
    pub otlp_endpoint: Option<String>,
    /// The share of new traces kept, 0 to 1 (default 1).
    pub sample_ratio: Option<f64>,
}

impl MeshConfig {
    /// The file's tracing section as the telemetry settings take it.
    pub fn tracing(&self) -> Option<kvmesh_telemetry::FileSettings> {
        self.tracing
            .as_ref()
            .map(|t| kvmesh_telemetry::FileSettings {
                otlp_endpoint: t.otlp_endpoint.clone(),
                sample_ratio: t.sample_ratio,
            })
    }
}

/// How a process of the mesh authenticates its peers.
#[derive(Debug)]
pub enum MeshAuth {
    /// The secret read from this file.
    Secret(MeshSecret, PathBuf),
    /// `insecure_no_mesh_auth: true`.
    Insecure,
}

impl MeshAuth {
    /// The secret the services use (the public insecure key for
    /// [`MeshAuth::Insecure`]).
    pub fn secret(&self) -> MeshSecret {
        match self {
            Self::Secret(s, _) => s.clone(),
            Self::Insecure => MeshSecret::insecure(),
        }
    }

    /// One line for `--check-config` and the logs.
    pub fn describe(&self) -> String {
        match self {
            Self::Secret(_, p) => format!("mesh auth: secret file {}", p.display()),
            Self::Insecure => "mesh auth: OFF (insecure_no_mesh_auth)".into(),
        }
    }
}

fn default_page_size() -> usize {
    16
}
fn default_transport() -> String {
    "tcp".into()
}
fn default_shm_dir() -> PathBuf {
    "/dev/shm".into()
}

fn refuse(file: &Path, field: &str, value: &str, reason: &str) -> anyhow::Error {
    anyhow::anyhow!("{}: {field} = {value:?}: {reason}", file.display())
}

fn host_port(file: &Path, field: &str, v: &str) -> Result<()> {
    match v.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(()),
        _ => Err(refuse(file, field, v, "expected HOST:PORT")),
    }
}

fn default_cpu_kernels() -> String {
    "auto".into()
}
fn default_activations() -> String {
    kvmesh_kernels::cpu::Activations::default().name().into()
}
fn default_device() -> String {
    "cpu".into()
}
fn default_device_weights() -> String {
    "f32".into()
}
fn default_kv_cache_dtype() -> String {
    "auto".into()
}

fn default_lease_ms() -> u64 {
    crate::serve::LEASE.as_millis() as u64
}

fn default_abort_timeout_ms() -> u64 {
    crate::serve::ABORT_TIMEOUT.as_millis() as u64
}

fn default_drain_timeout_ms() -> u64 {
    crate::serve::DRAIN_TIMEOUT.as_millis() as u64
}

fn default_on() -> bool {
    true
}

/// `prefix_cache:`: `on`, `off`, or a boolean.
fn on_off<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Switch {
        Bool(bool),
        Word(String),
    }
    match Switch::deserialize(d)? {
        Switch::Bool(b) => Ok(b),
        Switch::Word(w) => w
            .parse::<crate::serve::OnOff>()
            .map(|o| o.0)
            .map_err(|e| serde::de::Error::custom(format!("prefix_cache = {e}"))),
    }
}

/// `scrub:` as its typed value, refused naming the field and the value.
fn scrub_mode<'de, D: serde::Deserializer<'de>>(d: D) -> Result<ScrubMode, D::Error> {
    let s = String::deserialize(d)?;
    s.parse()
        .map_err(|e: ParseScrubModeError| serde::de::Error::custom(format!("scrub = {s:?}: {e}")))
}

impl MeshConfig {
    /// The KV transport; the file was validated, so the value parses.
    pub fn transport_kind(&self) -> TransportKind {
        self.transport.parse().unwrap_or_default()
    }

    /// The KV pool element type of every node (`None`: auto); the file was
    /// validated, so the value parses.
    pub fn kv_dtype(&self) -> Option<kvmesh_kvpool::KvDtype> {
        self.kv_cache_dtype
            .parse::<crate::KvCacheDtype>()
            .ok()
            .and_then(|d| d.0)
    }

    /// How long a grant may wait for its transfer.
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms)
    }

    /// How long an abort may wait for the writer's confirmation.
    pub fn abort_timeout(&self) -> Duration {
        Duration::from_millis(self.abort_timeout_ms)
    }

    /// How long a drain lets work in flight run on.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms)
    }

    /// The pool and handshake settings, for `--check-config` and the logs.
    pub fn describe_pools(&self) -> String {
        format!(
            "lease {} ms, abort timeout {} ms, drain timeout {} ms, scrub {}, poison {}, prefix cache {}",
            self.lease_ms,
            self.abort_timeout_ms,
            self.drain_timeout_ms,
            self.scrub,
            if self.poison { "on" } else { "off" },
            if self.prefix_cache { "on" } else { "off" }
        )
    }

    /// The etcd settings with `discovery: etcd` (checked), `None` with
    /// `discovery: static`; `etcd.tls` paths as they name the process
    /// `name` (`router`, or a node's name); the files are read when the
    /// client connects.
    pub fn etcd(&self, name: &str) -> Result<Option<EtcdConfig>> {
        let file = &self.file;
        match (self.discovery, &self.etcd) {
            (DiscoveryKind::Static, None) => Ok(None),
            (DiscoveryKind::Static, Some(_)) => Err(refuse(
                file,
                "etcd",
                "{...}",
                "only read with discovery: etcd (the default is static)",
            )),
            (DiscoveryKind::Etcd, None) => Err(refuse(
                file,
                "etcd",
                "",
                "discovery: etcd needs an etcd section (endpoints, prefix)",
            )),
            (DiscoveryKind::Etcd, Some(e)) => {
                let tls = e
                    .tls
                    .as_ref()
                    .map(|t| {
                        Ok::<_, anyhow::Error>(kvmesh_discovery::EtcdTls {
                            ca: self.pem_path("etcd.tls.ca_file", &t.ca_file, name)?,
                            cert: self.pem_path("etcd.tls.cert_file", &t.cert_file, name)?,
                            key: self.pem_path("etcd.tls.key_file", &t.key_file, name)?,
                        })
                    })
                    .transpose()?;
                let prefix = e.prefix.as_deref().ok_or_else(|| {
                    refuse(
                        file,
                        "etcd.prefix",
                        "",
                        "required: the key prefix of this mesh's registrations, such as /kvmesh/prod/",
                    )
                })?;
                let cfg = EtcdConfig::new(
                    &e.endpoints,
                    prefix,
                    e.lease_ttl_s,
                    Duration::from_millis(e.dial_timeout_ms),
                    tls,
                )
                .map_err(|c| refuse(file, &format!("etcd.{}", c.field), &c.value, c.reason))?;
                let mesh_tls = self.mesh.as_ref().is_some_and(|m| m.tls.is_some());
                if !mesh_tls && !e.allow_insecure_etcd {
                    bail!(refuse(
                        file,
                        "mesh.tls",
                        "",
                        "discovery: etcd needs mutual TLS between the nodes: anything that can write to \
                         etcd could register an address the router sends prompts to, in the clear. \
                         Set mesh.tls (and etcd.tls), or etcd.allow_insecure_etcd: true for a test mesh",
                    ));
                }
                Ok(Some(cfg))
            }
        }
    }

    /// The precision every node loads the model in.
    pub fn precision(&self) -> kvmesh_model::Precision {
        if self.exact {
            kvmesh_model::Precision::Exact
        } else {
            kvmesh_model::Precision::Quantized
        }
    }

    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text, path)
    }

    /// Parses and validates `text`, read from `path`.
    fn parse(text: &str, path: &Path) -> Result<Self> {
        let mut cfg: Self = serde_yaml_ng::from_str(text)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        cfg.file = path.to_owned();
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// The TLS identity of the process named `name` (`router`, or a node's
    /// name), loaded from `mesh.tls`; `None` without that section. A
    /// missing or unusable file is refused naming the field and the file.
    pub fn tls_for(&self, name: &str) -> Result<Option<Arc<MeshTls>>> {
        let Some(t) = self.mesh.as_ref().and_then(|m| m.tls.as_ref()) else {
            return Ok(None);
        };
        let files = TlsFiles {
            ca: self.pem_path("mesh.tls.ca_file", &t.ca_file, name)?,
            cert: self.pem_path("mesh.tls.cert_file", &t.cert_file, name)?,
            key: self.pem_path("mesh.tls.key_file", &t.key_file, name)?,
        };
        if readable_by_others(&files.key).unwrap_or(false) {
            tracing::warn!(file = %files.key.display(), "the TLS key file is readable by other users: `chmod 600` it");
        }
        MeshTls::load(files)
            .map(Some)
            .map_err(|e| refuse(&self.file, "mesh.tls", name, &e.to_string()))
    }

    /// `etcd.tls`'s files as the process `name` reads them, loaded as the
    /// mesh's own identity is (PEM that rustls takes, the key of the
    /// certificate), so a missing or bad file is refused at start and by
    /// `--check-config`, naming the field, not at the first call to etcd.
    pub fn check_etcd_tls(&self, t: &kvmesh_discovery::EtcdTls, name: &str) -> Result<()> {
        if readable_by_others(&t.key).unwrap_or(false) {
            tracing::warn!(file = %t.key.display(), "the etcd TLS key file is readable by other users: `chmod 600` it");
        }
        let files = TlsFiles {
            ca: t.ca.clone(),
            cert: t.cert.clone(),
            key: t.key.clone(),
        };
        MeshTls::load(files)
            .map(drop)
            .map_err(|e| refuse(&self.file, "etcd.tls", name, &e.to_string()))
    }

    /// A PEM file's path as field `field` (value `v`) names it for the
    /// process `name`: `{name}` replaced, relative to the mesh file's
    /// folder; refused when empty.
    fn pem_path(&self, field: &str, v: &str, name: &str) -> Result<PathBuf> {
        let p = PathBuf::from(v.replace("{name}", name));
        if v.is_empty() {
            bail!(refuse(&self.file, field, v, "name a PEM file"));
        }
        Ok(match self.file.parent() {
            Some(dir) if p.is_relative() => dir.join(p),
            _ => p,
        })
    }

    /// Reads the mesh secret the file names (or takes the insecure mode it
    /// asks for, with a loud warning). A missing, unreadable, short or
    /// uniform secret is refused, naming the field and the file; one that
    /// other users can read is accepted with a warning.
    pub fn mesh_auth(&self) -> Result<MeshAuth> {
        let file = &self.file;
        match &self.mesh {
            Some(MeshSection {
                secret_file: Some(p),
                ..
            }) => {
                let path = match file.parent() {
                    Some(dir) if p.is_relative() => dir.join(p),
                    _ => p.clone(),
                };
                let secret = MeshSecret::load(&path).map_err(|e| {
                    refuse(
                        file,
                        "mesh.secret_file",
                        &p.to_string_lossy(),
                        &e.to_string(),
                    )
                })?;
                if readable_by_others(&path).unwrap_or(false) {
                    tracing::warn!(file = %path.display(), "the mesh secret file is readable by other users: `chmod 600` it");
                }
                Ok(MeshAuth::Secret(secret, path))
            }
            _ => {
                tracing::warn!(
                    "MESH AUTHENTICATION IS OFF (insecure_no_mesh_auth: true): anyone who can reach \
                     this node's ports can reserve and abort requests and write KV pages; \
                     use mesh.secret_file outside tests"
                );
                Ok(MeshAuth::Insecure)
            }
        }
    }
}

mod nodes;
mod router;
#[cfg(test)]
mod tests;
mod validate;

pub use nodes::NodeSection;
pub use router::RouterSection;
