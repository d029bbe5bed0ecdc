//! The load report's fields both roles fill the same way ([`common`]): the
//! pool, the prefix cache's counters and advert, the gRPC and TLS refusals,
//! and the node's identity. Each role adds its own around them (name,
//! role, queue, and for decode the reservation table's counts and the KV
//! transport's refusals), with struct update syntax over [`common`]'s
//! report.

use std::collections::HashMap;

use kvmesh_kvpool::KvPool;
use kvmesh_meshauth::tls::MeshTls;
use kvmesh_meshauth::CallVerifier;
use kvmesh_model::engine::Engine;
use kvmesh_proto::internal::v1::LoadReport;

/// The report fields every node fills alike, from its `engine`, the `pool`
/// its KV pages are in, its call verifier and its mutual TLS: pages in all
/// and available, the page size, guard violations, the prefix cache's
/// counters, refusals by kind (gRPC proofs, TLS), and what `kvmesh doctor`
/// compares across a mesh (this build's version, the model, the context
/// limit, the KV element type, the CPU kernels, the node's clock). With
/// `known_cache_epoch` (the router's poll, not a `/metrics` scrape) it
/// carries the prefix cache's advert too: the model tag, the epoch and,
/// unless the router already holds this epoch, every cached page's routing
/// id.
pub fn common(
    engine: &Engine,
    pool: &KvPool,
    calls: &CallVerifier,
    tls: Option<&MeshTls>,
    known_cache_epoch: Option<u64>,
) -> LoadReport {
    let stats = pool.stats();
    let advert = known_cache_epoch
        .and_then(|known| engine.cache_advert(known))
        .map_or_else(LoadReport::default, |(tag, ix)| {
            cache_advert(tag.as_bytes(), ix.epoch, ix.ids)
        });
    let report = LoadReport {
        kv_pages_total: stats.capacity_pages as u64,
        // Free, plus cached pages nobody leases (evicted on demand).
        kv_pages_free: stats.available_pages() as u64,
        prefix_cache: stats.cache.report(),
        page_size: pool.config().page_size as u32,
        guard_violations: stats.guard_violations,
        grpc_auth_refused: by_kind(&calls.refused()),
        tls_refused: tls.map(|t| t.refused().seen()).unwrap_or_default(),
        ..advert
    };
    identity(
        report,
        engine.identity(),
        engine.max_model_len(),
        pool.config().dtype.name(),
        engine.cpu_kernels(),
    )
}

/// Counters by kind as a load report's map (zeros included).
pub fn by_kind(counts: &[(&'static str, u64)]) -> HashMap<String, u64> {
    counts.iter().map(|(k, n)| ((*k).to_owned(), *n)).collect()
}

/// A report with only the cache-routing fields set: the node's model tag,
/// its cache epoch and, when given, every cached page's routing id.
fn cache_advert(model_tag: &[u8], epoch: u64, ids: Option<Vec<u64>>) -> LoadReport {
    LoadReport {
        cache_model_tag: model_tag.to_vec(),
        cache_epoch: epoch,
        cache_page_ids_sent: ids.is_some(),
        cache_page_ids: ids.unwrap_or_default(),
        ..LoadReport::default()
    }
}

/// `report` with what `kvmesh doctor` compares across a mesh: this build's
/// version, the node's model (family, weights' fingerprint and precision),
/// context limit, KV element type and CPU kernels (path and numerics), and
/// the node's clock now.
fn identity(
    report: LoadReport,
    model: &str,
    max_model_len: usize,
    kv_dtype: &str,
    (cpu_kernels, cpu_numerics): (&str, &str),
) -> LoadReport {
    LoadReport {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        model: model.to_owned(),
        max_model_len: max_model_len as u64,
        kv_dtype: kv_dtype.to_owned(),
        cpu_kernels: cpu_kernels.to_owned(),
        cpu_numerics: cpu_numerics.to_owned(),
        unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        ..report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_advert_sends_ids_only_when_it_has_them() {
        let with = cache_advert(&[7; 32], 5, Some(vec![1, 2]));
        assert_eq!(
            (
                with.cache_epoch,
                with.cache_page_ids_sent,
                with.cache_page_ids
            ),
            (5, true, vec![1, 2])
        );
        assert_eq!(with.cache_model_tag, vec![7; 32]);
        let known = cache_advert(&[7; 32], 5, None);
        assert!(!known.cache_page_ids_sent && known.cache_page_ids.is_empty());
    }

    #[test]
    fn identity_keeps_the_rest_of_the_report() {
        let r = identity(
            LoadReport {
                node: "decode-0".into(),
                kv_pages_total: 64,
                ..LoadReport::default()
            },
            "smollm2 q4_1",
            2048,
            "f16",
            ("avx2", "f32"),
        );
        assert_eq!((r.node.as_str(), r.kv_pages_total), ("decode-0", 64));
        assert_eq!(r.version, env!("CARGO_PKG_VERSION"));
        assert_eq!(
            (r.model.as_str(), r.max_model_len, r.kv_dtype.as_str()),
            ("smollm2 q4_1", 2048, "f16")
        );
        assert_eq!(
            (r.cpu_kernels.as_str(), r.cpu_numerics.as_str()),
            ("avx2", "f32")
        );
        assert!(r.unix_ms > 0);
        assert_eq!(
            by_kind(&[("bad_mac", 2), ("stale", 0)]),
            [("bad_mac".to_owned(), 2), ("stale".to_owned(), 0)]
                .into_iter()
                .collect()
        );
    }
}
