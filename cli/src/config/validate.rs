//! Validation of a parsed mesh file: every field checked, each refusal
//! naming the file, the field, the value and the reason.

use std::collections::HashSet;
use std::path::Path;

use anyhow::{bail, Result};
use kvmesh_cuda::ops::WeightDtype;
use kvmesh_cuda::DeviceSpec;
use kvmesh_kernels::cpu::CpuKernels;
use kvmesh_kvxfer::transport::{Control, TransportKind};

use super::{host_port, refuse, MeshConfig, MeshSection};

impl MeshConfig {
    pub(super) fn validate(&self, file: &Path) -> Result<()> {
        if let Err(e) = self.kv_cache_dtype.parse::<crate::KvCacheDtype>() {
            bail!(refuse(file, "kv_cache_dtype", &self.kv_cache_dtype, &e));
        }
        if let Err(e) = self.cpu_kernels.parse::<CpuKernels>() {
            bail!(refuse(
                file,
                "cpu_kernels",
                &self.cpu_kernels,
                &e.to_string()
            ));
        }
        if let Err(e) = self.activations.parse::<kvmesh_kernels::cpu::Activations>() {
            bail!(refuse(
                file,
                "activations",
                &self.activations,
                &e.to_string()
            ));
        }
        if let Err(e) = self.device.parse::<DeviceSpec>() {
            bail!(refuse(file, "device", &self.device, &e.to_string()));
        }
        if let Err(e) = self.device_weights.parse::<WeightDtype>() {
            bail!(refuse(
                file,
                "device_weights",
                &self.device_weights,
                &e.to_string()
            ));
        }
        if self.page_size == 0 {
            bail!(refuse(file, "page_size", "0", "must be at least 1"));
        }
        if self.max_model_len == Some(0) {
            bail!(refuse(file, "max_model_len", "0", "must be at least 1"));
        }
        if self.lease_ms == 0 {
            bail!(refuse(file, "lease_ms", "0", "must be at least 1"));
        }
        if self.abort_timeout_ms == 0 {
            bail!(refuse(file, "abort_timeout_ms", "0", "must be at least 1"));
        }
        // The section alone (no variables): its own errors name its fields.
        if let Err(e) = kvmesh_telemetry::Settings::resolve(|_| None, self.tracing().as_ref()) {
            bail!("{}: {e}", file.display());
        }
        match &self.mesh {
            None
            | Some(MeshSection {
                secret_file: None,
                insecure_no_mesh_auth: false,
                ..
            }) => bail!(refuse(
                file,
                "mesh.secret_file",
                "",
                "the internal services accept only peers that prove the per-mesh secret: \
                 name a file of at least 32 random bytes (e.g. `head -c 32 /dev/urandom > mesh.secret`), \
                 or set mesh.insecure_no_mesh_auth: true for a test mesh"
            )),
            Some(MeshSection {
                secret_file: Some(_),
                insecure_no_mesh_auth: true,
                ..
            }) => bail!(refuse(
                file,
                "mesh.insecure_no_mesh_auth",
                "true",
                "contradicts mesh.secret_file: choose one"
            )),
            Some(_) => {}
        }
        if let Err(e) = self.transport.parse::<TransportKind>() {
            bail!(refuse(file, "transport", &self.transport, &e.to_string()));
        }
        let transport = self.transport_kind();
        host_port(file, "router.http", &self.router.http)?;
        host_port(file, "router.grpc", &self.router.grpc)?;
        self.router.parsers(file)?;
        for (i, k) in self.router.api_keys.iter().enumerate() {
            k.parsed_scopes(i, file)?;
        }
        self.router.admission(file)?;
        if self.router.max_running == 0 {
            bail!(refuse(
                file,
                "router.max_running",
                "0",
                "must be at least 1"
            ));
        }
        let etcd = self.etcd("router")?.is_some();
        for (role, nodes) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            if nodes.is_empty() && !etcd {
                bail!(refuse(
                    file,
                    role,
                    "[]",
                    "the mesh needs at least one node of each role"
                ));
            }
        }
        let mut names = HashSet::new();
        for (role, nodes) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            for (i, n) in nodes.iter().enumerate() {
                let f = |k: &str| format!("{role}[{i}].{k}");
                if n.name.is_empty() || !names.insert(n.name.as_str()) {
                    bail!(refuse(
                        file,
                        &f("name"),
                        &n.name,
                        "names must be non-empty and unique"
                    ));
                }
                // With etcd the node writes a registration of these fields:
                // refuse now what it could not register.
                if etcd && kvmesh_discovery::member::check_name(&n.name).is_err() {
                    bail!(refuse(
                        file,
                        &f("name"),
                        &n.name,
                        "with discovery: etcd, letters, digits, '.', '_' and '-' (at most 63, not starting with '.' or '-')"
                    ));
                }
                host_port(file, &f("grpc"), &n.grpc)?;
                if let Some(c) = &n.cpu_kernels {
                    if let Err(e) = c.parse::<CpuKernels>() {
                        bail!(refuse(file, &f("cpu_kernels"), c, &e.to_string()));
                    }
                }
                if let Some(d) = &n.device {
                    if let Err(e) = d.parse::<DeviceSpec>() {
                        bail!(refuse(file, &f("device"), d, &e.to_string()));
                    }
                }
                if let Some(w) = &n.device_weights {
                    if let Err(e) = w.parse::<WeightDtype>() {
                        bail!(refuse(file, &f("device_weights"), w, &e.to_string()));
                    }
                }
                if let Some(l) = &n.listen {
                    host_port(file, &f("listen"), l)?;
                }
                if n.kv_pool_tokens == Some(0) {
                    bail!(refuse(
                        file,
                        &f("kv_pool_tokens"),
                        "0",
                        "must be at least 1"
                    ));
                }
                match (role, &n.kv) {
                    ("decode", None) => bail!(refuse(
                        file,
                        &f("kv"),
                        "",
                        "a decode node needs a KV transport address"
                    )),
                    ("decode", Some(kv)) if transport.control() == Control::Tcp => {
                        host_port(file, &f("kv"), kv)?;
                        if let Some(l) = &n.kv_listen {
                            host_port(file, &f("kv_listen"), l)?;
                        }
                        match (&n.ucx_listen, transport) {
                            (Some(u), TransportKind::Ucx) => {
                                if u.parse::<std::net::SocketAddr>().is_err() {
                                    bail!(refuse(
                                        file,
                                        &f("ucx_listen"),
                                        u,
                                        "expected IP:PORT (UCX binds an address, not a name)"
                                    ));
                                }
                            }
                            (Some(u), _) => bail!(refuse(
                                file,
                                &f("ucx_listen"),
                                u,
                                "only with transport: ucx"
                            )),
                            (None, _) => {}
                        }
                    }
                    ("decode", Some(kv)) if !kv.starts_with('/') => {
                        bail!(refuse(
                            file,
                            &f("kv"),
                            kv,
                            &format!("with transport {transport}, an absolute Unix socket path")
                        ))
                    }
                    ("prefill", Some(kv)) => bail!(refuse(
                        file,
                        &f("kv"),
                        kv,
                        "only decode nodes have a KV listener"
                    )),
                    _ => {}
                }
                if etcd {
                    match self.member(role, n) {
                        Ok(_) => {}
                        Err(kvmesh_discovery::MemberError::Field {
                            field,
                            value,
                            reason,
                        }) => bail!(refuse(file, &f(field), &value, reason)),
                        Err(e) => bail!(refuse(file, &f("grpc"), &n.grpc, &e.to_string())),
                    }
                }
            }
        }
        Ok(())
    }
}
