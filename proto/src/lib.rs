//! kvmesh's gRPC API: the public `kvmesh.v1.Generation` service (Generate,
//! Tokenize, ListModels) and the internal `kvmesh.internal.v1` Decode and
//! Prefill services the router drives. The `.proto` files under `proto/`
//! are the source of truth, every field documented there; `build.rs`
//! compiles them with protox (pure Rust, no system `protoc`) and
//! tonic-prost-build. [`peer`] builds the internal clients whose calls
//! prove the mesh secret (`kvmesh_meshauth::grpc` holds the interceptor and
//! the server wrapper that refuses calls without a proof); [`serve`] how
//! every node serves its service and drains.

#![allow(missing_docs, clippy::all)]

pub mod metrics;
pub mod peer;
#[cfg(feature = "sampling")]
pub mod sampling;
pub mod serve;

/// The most alternatives per token a public-API `logprobs` may ask for.
pub const LOGPROBS_MAX: u64 = 20;

/// The public API.
pub mod v1 {
    tonic::include_proto!("kvmesh.v1");
}

/// The internal node services.
pub mod internal {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("kvmesh.internal.v1");
    }
}

impl internal::v1::LoadReport {
    /// A report with only the cache-routing fields set: the node's model
    /// tag, its cache epoch and, when given, every cached page's routing
    /// id. What the nodes fill the rest of a report around.
    pub fn cache_advert(model_tag: &[u8], epoch: u64, ids: Option<Vec<u64>>) -> Self {
        Self {
            cache_model_tag: model_tag.to_vec(),
            cache_epoch: epoch,
            cache_page_ids_sent: ids.is_some(),
            cache_page_ids: ids.unwrap_or_default(),
            ..Self::default()
        }
    }

    /// This report with what `kvmesh doctor` compares across a mesh: this
    /// build's version, the node's model (family, weights' fingerprint and
    /// precision), context
    /// limit, KV element type and CPU kernels (path and numerics), and the
    /// node's clock now.
    pub fn with_identity(
        self,
        model: &str,
        max_model_len: usize,
        kv_dtype: &str,
        (cpu_kernels, cpu_numerics): (&str, &str),
    ) -> Self {
        Self {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            model: model.to_owned(),
            max_model_len: max_model_len as u64,
            kv_dtype: kv_dtype.to_owned(),
            cpu_kernels: cpu_kernels.to_owned(),
            cpu_numerics: cpu_numerics.to_owned(),
            unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            ..self
        }
    }
}

/// The encoded `FileDescriptorSet` of the public API (`kvmesh.v1`) alone,
/// for the public port's gRPC server reflection: the internal services are
/// not served there, so reflection does not name them.
pub const PUBLIC_FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/kvmesh_public_descriptor.bin"));
