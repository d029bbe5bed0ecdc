//! A kvmesh mesh on a lab: etcd, the router, 2 prefill and 2 decode
//! nodes, each a real process in its own host's namespace, finding each
//! other through etcd (`discovery: etcd`), with mutual TLS on or off and
//! KV over tcp or ucx. The test talks to the router from inside the
//! router's namespace (the client's own link is not the one under test).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::etcd::Etcd;
use crate::http::{self, Response};
use crate::roles::{start_in_netns, write_secret, Proc};

use super::Lab;

/// The lab's hosts, in address order (`198.18.0.10` is etcd).
pub const HOSTS: [&str; 6] = [
    "etcd",
    "router",
    "prefill-0",
    "prefill-1",
    "decode-0",
    "decode-1",
];
/// The nodes, in start order.
pub const NODES: [&str; 4] = ["decode-0", "decode-1", "prefill-0", "prefill-1"];
/// The router's HTTP address as seen from its own namespace.
pub const ROUTER_HTTP: &str = "127.0.0.1:8080";

/// The KV transport between hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// kvmesh's TCP transport (every frame checked on arrival).
    Tcp,
    /// UCX (its `tcp` transport here: no RDMA device in a namespace).
    Ucx,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Ucx => "ucx",
        }
    }
}

/// What the mesh runs with.
#[derive(Clone, Debug)]
pub struct Options {
    /// The KV transport.
    pub transport: Transport,
    /// Mutual TLS on every internal channel.
    pub tls: bool,
    /// The model every node loads.
    pub model: PathBuf,
    /// How long a grant waits for its transfer.
    pub lease_ms: u64,
    /// How long an abort waits for the writer's confirmation.
    pub abort_timeout_ms: u64,
    /// etcd lease TTL of each registration.
    pub lease_ttl_s: u64,
    /// Tokens per KV page.
    pub page_size: usize,
    /// Tokens of each node's pool.
    pub kv_pool_tokens: usize,
}

impl Options {
    /// The committed tiny model over `transport`, short bounds (a lease of
    /// 8 s, aborts 3 s, etcd TTL 3 s) so partitions resolve quickly.
    pub fn tiny(transport: Transport, tls: bool) -> Self {
        Self {
            transport,
            tls,
            model: crate::tiny_model_dir(),
            lease_ms: 8000,
            abort_timeout_ms: 3000,
            lease_ttl_s: 3,
            page_size: 8,
            kv_pool_tokens: 2048,
        }
    }

    /// In words, for the tests' output.
    pub fn describe(&self) -> String {
        format!(
            "{}, mutual TLS {}",
            self.transport.name(),
            if self.tls { "on" } else { "off" }
        )
    }
}

/// The running mesh. Drop order: processes, etcd, the lab, the files.
pub struct LabMesh {
    procs: Vec<(String, Proc)>,
    /// Its etcd, in the `etcd` host.
    pub etcd: Etcd,
    /// The hosts and links.
    pub lab: Lab,
    /// The key prefix of the registrations.
    pub prefix: String,
    /// What it runs with.
    pub options: Options,
    dir: tempfile::TempDir,
}

impl std::fmt::Debug for LabMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LabMesh")
            .field("lab", &self.lab)
            .field("options", &self.options)
            .finish()
    }
}

impl LabMesh {
    /// A lab of [`HOSTS`] with etcd and every role started, and the
    /// router seeing all four nodes up (bounded: 90 s).
    pub fn start(options: Options) -> Self {
        let lab = Lab::new(&HOSTS);
        let dir = tempfile::tempdir().expect("tempdir");
        let etcd = Etcd::start_in(&lab.host("etcd").ns.name, lab.host("etcd").addr);
        let prefix = crate::etcd::unique_prefix("netlab");
        let file = write_mesh_file(dir.path(), &lab, &etcd, &prefix, &options);
        let mut mesh = Self {
            procs: Vec::new(),
            etcd,
            lab,
            prefix,
            options,
            dir,
        };
        for name in NODES {
            mesh.start_role(name, &file);
        }
        mesh.start_role("router", &file);
        let t0 = Instant::now();
        loop {
            let m = mesh.metrics();
            let up = NODES
                .iter()
                .all(|n| m.first("kvmesh_node_up", &[("node", n)]) == Some(1.0));
            if up {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(90),
                "the router never saw every node up:\n{}",
                m.text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        mesh
    }

    fn start_role(&mut self, name: &str, file: &Path) {
        let role = name.split('-').next().unwrap_or(name);
        // UCX on the lab's interface only (not loopback): its traffic
        // crosses the links under test.
        let dev = if self.lab.mechanism().starts_with("veth") {
            "eth0"
        } else {
            "lab0"
        };
        let envs = [("UCX_NET_DEVICES", dev)];
        let node = (role != "router").then_some(name);
        let p = start_in_netns(
            &self.lab.host(name).ns.name,
            role,
            file,
            node,
            Some("warn"),
            &[],
            &envs,
        );
        self.procs.push((name.to_owned(), p));
    }

    /// The process of `name`.
    pub fn proc(&mut self, name: &str) -> &mut Proc {
        &mut self
            .procs
            .iter_mut()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no process {name}"))
            .1
    }

    /// Runs `f` with the router's HTTP address, inside its namespace.
    pub fn client<T: Send>(&self, f: impl FnOnce(&str) -> T + Send) -> T {
        self.lab.host("router").ns.enter(|| f(ROUTER_HTTP))
    }

    /// The router's metrics.
    pub fn metrics(&self) -> kvmesh_client::Metrics {
        self.client(http::metrics)
    }

    /// Waits until the router has two load reports from each of `nodes`
    /// newer than this call ([`http::wait_fresh_reports`]).
    pub fn wait_fresh_reports(&self, nodes: &[&str]) {
        self.client(|a| http::wait_fresh_reports(a, nodes));
    }

    /// A greedy completion of `prompt`.
    pub fn complete(&self, prompt: &str, max_tokens: usize) -> Response {
        let body =
            serde_json::json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
        self.client(|a| http::post(a, "/v1/completions", &body))
    }

    /// The registered node names (etcd keys under the prefix, last part).
    pub fn registered(&self) -> Vec<String> {
        self.etcd
            .keys(&self.prefix)
            .iter()
            .filter_map(|k| k.rsplit('/').next().map(str::to_owned))
            .collect()
    }

    /// The node gauge or counter `name{node=NODE}` in the router's metrics.
    pub fn node_value(&self, name: &str, node: &str) -> Option<f64> {
        self.metrics().first(name, &[("node", node)])
    }

    /// The mesh's temporary directory (mesh file, certificates, secret).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for LabMesh {
    fn drop(&mut self) {
        // The router first, then the nodes: nothing is left calling a
        // node that is gone.
        while let Some((_, p)) = self.procs.pop() {
            drop(p);
        }
    }
}

fn write_mesh_file(dir: &Path, lab: &Lab, etcd: &Etcd, prefix: &str, o: &Options) -> PathBuf {
    let secret = write_secret(dir, "mesh.secret");
    let tls = if o.tls {
        let certs = dir.join("certs");
        std::fs::create_dir(&certs).expect("certs dir");
        let ca = kvmesh_testkit::tls::TestCa::new(dir, "lab").expect("test CA");
        for name in ["router", "prefill-0", "prefill-1", "decode-0", "decode-1"] {
            let addr = lab.host(name).addr.to_string();
            ca.write_node(
                &certs,
                name,
                &[&addr],
                kvmesh_testkit::tls::Validity::Current,
            )
            .expect("node certificate");
        }
        format!(
            "\n  tls: {{ca_file: {}, cert_file: \"certs/{{name}}.pem\", key_file: \"certs/{{name}}-key.pem\"}}",
            ca.ca_file.display()
        )
    } else {
        String::new()
    };
    let mut text = format!(
        "model: {model}\npage_size: {page}\ntransport: {transport}\n\
         lease_ms: {lease}\nabort_timeout_ms: {abort}\n\
         mesh:\n  secret_file: {secret}{tls}\n\
         discovery: etcd\n\
         etcd: {{endpoints: [\"{endpoint}\"], prefix: \"{prefix}\", lease_ttl_s: {ttl}{insecure}}}\n\
         router: {{http: \"0.0.0.0:8080\", grpc: \"0.0.0.0:50051\", max_running: 64}}\n",
        model = o.model.display(),
        page = o.page_size,
        transport = o.transport.name(),
        lease = o.lease_ms,
        abort = o.abort_timeout_ms,
        secret = secret.display(),
        endpoint = etcd.endpoint(),
        ttl = o.lease_ttl_s,
        // Without mutual TLS an etcd mesh must say it means it.
        insecure = if tls.is_empty() {
            ", allow_insecure_etcd: true"
        } else {
            ""
        },
    );
    for role in ["prefill", "decode"] {
        text.push_str(&format!("{role}:\n"));
        for i in 0..2 {
            let name = format!("{role}-{i}");
            let a = lab.host(&name).addr;
            let extra = if role == "decode" {
                let ucx = if o.transport == Transport::Ucx {
                    format!(", ucx_listen: \"{a}:7401\"")
                } else {
                    String::new()
                };
                format!(", kv: \"{a}:7301\", kv_listen: \"0.0.0.0:7301\"{ucx}")
            } else {
                String::new()
            };
            text.push_str(&format!(
                "  - {{name: {name}, grpc: \"{a}:7101\", listen: \"0.0.0.0:7101\", kv_pool_tokens: {}{extra}}}\n",
                o.kv_pool_tokens
            ));
        }
    }
    let file = dir.join("mesh.yaml");
    std::fs::write(&file, text).expect("write mesh file");
    file
}
