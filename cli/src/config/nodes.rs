//! The mesh file's prefill and decode nodes: each node's section, and the
//! settings a node takes from its own section over the mesh's.

use anyhow::Result;
use kvmesh_cuda::ops::WeightDtype;
use kvmesh_cuda::DeviceSpec;
use kvmesh_kernels::cpu::CpuKernels;
use serde::Deserialize;

use super::MeshConfig;

/// One node.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSection {
    /// Unique name.
    pub name: String,
    /// Address others dial for its gRPC service.
    pub grpc: String,
    /// Address it listens on; default `grpc`.
    pub listen: Option<String>,
    /// Decode only: KV transport address prefill dials (TCP `HOST:PORT`, or
    /// a Unix socket path with `transport: shm`).
    pub kv: Option<String>,
    /// Decode only: where the KV listener binds; default `kv`.
    pub kv_listen: Option<String>,
    /// Decode only, `transport: ucx`: where UCX's listener binds, `IP:PORT`
    /// (default `0.0.0.0:0`: every interface, any port; writers reach it
    /// at the host they dialled for `kv`).
    pub ucx_listen: Option<String>,
    /// Its KV pool, tokens; default one full context.
    pub kv_pool_tokens: Option<usize>,
    /// Its CPU kernel path, over the mesh's `cpu_kernels`.
    pub cpu_kernels: Option<String>,
    /// Its device, over the mesh's `device`.
    pub device: Option<String>,
    /// Its device weight type, over the mesh's `device_weights`.
    pub device_weights: Option<String>,
}

impl NodeSection {
    /// Where a decode node's UCX listener binds (`ucx_listen`, checked by
    /// validation); by default the IP its `kv` address names (resolved if
    /// a host name), any port, so UCX answers only where the node is
    /// advertised; every interface only when `kv` names none.
    pub fn ucx_listen_addr(&self) -> anyhow::Result<std::net::SocketAddr> {
        use std::net::ToSocketAddrs;
        match &self.ucx_listen {
            None => {
                let ip = self
                    .kv
                    .as_deref()
                    .and_then(|kv| kv.to_socket_addrs().ok()?.next())
                    .map(|a| a.ip())
                    .filter(|ip| !ip.is_unspecified())
                    .unwrap_or(std::net::IpAddr::from([0, 0, 0, 0]));
                Ok(std::net::SocketAddr::new(ip, 0))
            }
            Some(u) => u
                .parse()
                .map_err(|_| anyhow::anyhow!("{}.ucx_listen {u:?}: expected IP:PORT", self.name)),
        }
    }
}

impl MeshConfig {
    /// What node `n` of `role` registers in etcd: its name, role, the
    /// `grpc` address the router dials and (decode) the KV endpoint
    /// prefill dials.
    pub fn member(
        &self,
        role: &str,
        n: &NodeSection,
    ) -> Result<kvmesh_discovery::Member, kvmesh_discovery::MemberError> {
        let (role, kv) = if role == "decode" {
            (kvmesh_discovery::Role::Decode, Some(self.kv_endpoint(n)))
        } else {
            (kvmesh_discovery::Role::Prefill, None)
        };
        kvmesh_discovery::Member::new(
            &n.name,
            role,
            &n.grpc,
            kv.as_deref(),
            env!("CARGO_PKG_VERSION"),
        )
    }

    /// The node named `name` of `role`.
    pub fn node(&self, role: &str, name: &str) -> Result<&NodeSection> {
        let nodes = if role == "prefill" {
            &self.prefill
        } else {
            &self.decode
        };
        nodes.iter().find(|n| n.name == name).ok_or_else(|| {
            let known: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
            anyhow::anyhow!("no {role} node named {name:?} in the mesh file (it has {known:?})")
        })
    }

    /// A node setting: the node named `name`'s own value (`own`), else the
    /// mesh's (`mesh`), parsed. The router (`name` None) takes the mesh's.
    fn node_setting<T>(
        &self,
        role: &str,
        name: Option<&str>,
        own: impl Fn(&NodeSection) -> Option<&str>,
        mesh: &str,
    ) -> Result<T>
    where
        T: std::str::FromStr,
        T::Err: std::error::Error + Send + Sync + 'static,
    {
        let node = name.and_then(|n| self.node(role, n).ok());
        Ok(node.and_then(own).unwrap_or(mesh).parse::<T>()?)
    }

    /// The CPU kernel path the node named `name` asks for (its own
    /// `cpu_kernels`, else the mesh's; the router: the mesh's). Checked by
    /// validation.
    pub fn cpu_kernels_for(&self, role: &str, name: Option<&str>) -> Result<CpuKernels> {
        self.node_setting(role, name, |n| n.cpu_kernels.as_deref(), &self.cpu_kernels)
    }

    /// The mesh's activation class. Checked by validation.
    pub fn activations(&self) -> Result<kvmesh_kernels::cpu::Activations> {
        Ok(self.activations.parse()?)
    }

    /// The device the node named `name` computes on (its own `device`,
    /// else the mesh's). Checked by validation.
    pub fn device_for(&self, role: &str, name: Option<&str>) -> Result<DeviceSpec> {
        self.node_setting(role, name, |n| n.device.as_deref(), &self.device)
    }

    /// The device weight type of the node named `name` (its own
    /// `device_weights`, else the mesh's). Checked by validation.
    pub fn device_weights_for(&self, role: &str, name: Option<&str>) -> Result<WeightDtype> {
        self.node_setting(
            role,
            name,
            |n| n.device_weights.as_deref(),
            &self.device_weights,
        )
    }

    /// A decode node's KV endpoint as grants and prefill name it (UCX's
    /// control connection is TCP).
    pub fn kv_endpoint(&self, n: &NodeSection) -> String {
        let kv = n.kv.as_deref().unwrap_or_default();
        self.transport_kind().control().endpoint(kv).to_string()
    }
}
