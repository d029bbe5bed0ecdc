//! A node's own Prometheus series: what its load report says
//! ([`render_report`]), under the labels every one of its series carries
//! ([`node_labels`]). The load report is what the node builds for the
//! router, so what a node says about itself on `/metrics` and what the
//! router relays are the same numbers. The text format itself (histograms,
//! headers, escaping) is `kvmesh_telemetry::metrics`.

use std::sync::Arc;

use kvmesh_proto::internal::v1::{LoadReport, NodeRole};
use kvmesh_telemetry::metrics::{escape, header, sample};

/// What serves a node's `/metrics`: renders its text when scraped.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// A map's entries as one series each, label `key` = the map's key,
/// sorted so the text is stable.
fn by_label(
    out: &mut String,
    name: &str,
    labels: &str,
    key: &str,
    map: &std::collections::HashMap<String, u64>,
) {
    let mut v: Vec<_> = map.iter().collect();
    v.sort();
    for (k, n) in v {
        sample(out, name, &format!("{labels},{key}=\"{}\"", escape(k)), n);
    }
}

/// A node's own series from its load report `r`: identity, pool, queue,
/// reservations, transfers received, refusals, the prefix cache. Every
/// sample carries `node` and `role` (a scrape configuration adds
/// `instance` and `job` besides). Series of the other role are left out.
pub fn render_report(r: &LoadReport, out: &mut String) {
    let decode = r.role() == NodeRole::Decode;
    let role = if decode { "decode" } else { "prefill" };
    let labels = format!("node=\"{}\",role=\"{role}\"", escape(&r.node));
    header(
        out,
        "kvmesh_node_info",
        "The node's build, model, KV layout and CPU kernels (value 1).",
        "gauge",
    );
    sample(
        out,
        "kvmesh_node_info",
        &format!(
            "{labels},version=\"{}\",model=\"{}\",kv_dtype=\"{}\",max_model_len=\"{}\",cpu_kernels=\"{}\",cpu_numerics=\"{}\"",
            escape(&r.version),
            escape(&r.model),
            escape(&r.kv_dtype),
            r.max_model_len,
            escape(&r.cpu_kernels),
            escape(&r.cpu_numerics)
        ),
        1,
    );
    let gauges: [(&str, &str, u64); 6] = [
        ("kvmesh_kv_pool_pages", "KV pool pages in all.", r.kv_pages_total),
        (
            "kvmesh_kv_pool_free_pages",
            "KV pool pages a reservation can get now: free, plus cached pages no sequence leases.",
            r.kv_pages_free,
        ),
        (
            "kvmesh_kv_page_size_tokens",
            "Token slots per KV page.",
            u64::from(r.page_size),
        ),
        (
            "kvmesh_max_sequence_tokens",
            "The longest prompt plus completion the node accepts: the smaller of the context window and its pool.",
            r.max_seq_tokens,
        ),
        (
            "kvmesh_queue_depth",
            "Requests queued or running on the node.",
            u64::from(r.queue_depth),
        ),
        (
            "kvmesh_draining",
            "1 while the node drains (it refuses new work).",
            u64::from(r.draining),
        ),
    ];
    for (name, help, v) in gauges {
        header(out, name, help, "gauge");
        sample(out, name, &labels, v);
    }
    header(
        out,
        "kvmesh_kv_guard_violations_total",
        "Reads the pool's guards refused (I1 page ownership, I2 written slots).",
        "counter",
    );
    sample(
        out,
        "kvmesh_kv_guard_violations_total",
        &labels,
        r.guard_violations,
    );
    header(
        out,
        "kvmesh_auth_refused_total",
        "Calls (via=grpc) and KV connections (via=kv) refused for not proving the mesh secret, and connections refused by mutual TLS (via=tls), by kind.",
        "counter",
    );
    by_label(
        out,
        "kvmesh_auth_refused_total",
        &format!("{labels},via=\"grpc\""),
        "kind",
        &r.grpc_auth_refused,
    );
    by_label(
        out,
        "kvmesh_auth_refused_total",
        &format!("{labels},via=\"tls\""),
        "kind",
        &r.tls_refused,
    );
    if decode {
        by_label(
            out,
            "kvmesh_auth_refused_total",
            &format!("{labels},via=\"kv\""),
            "kind",
            &r.kv_auth_refused,
        );
        header(
            out,
            "kvmesh_reservations_granted_total",
            "Reservations the node granted.",
            "counter",
        );
        sample(
            out,
            "kvmesh_reservations_granted_total",
            &labels,
            r.reservations_granted,
        );
        header(
            out,
            "kvmesh_reservations_ended_total",
            "Reservations ended, by outcome.",
            "counter",
        );
        by_label(
            out,
            "kvmesh_reservations_ended_total",
            &labels,
            "outcome",
            &r.reservations_ended,
        );
        header(
            out,
            "kvmesh_kv_received_bytes_total",
            "KV bytes received in completed transfers (positions the prefix cache had are not shipped).",
            "counter",
        );
        sample(
            out,
            "kvmesh_kv_received_bytes_total",
            &labels,
            r.kv_bytes_received,
        );
        header(
            out,
            "kvmesh_kv_refused_total",
            "KV-transport messages refused (late, stale, forged or malformed), by kind.",
            "counter",
        );
        by_label(
            out,
            "kvmesh_kv_refused_total",
            &labels,
            "kind",
            &r.kv_refused,
        );
    }
    let cache = [
        (
            "lookup_tokens",
            "kvmesh_prefix_cache_lookup_tokens_total",
            "counter",
            "Prompt tokens looked up in the prefix cache (full pages).",
        ),
        (
            "hit_tokens",
            "kvmesh_prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens the prefix cache supplied.",
        ),
        (
            "inserted_pages",
            "kvmesh_prefix_cache_inserted_pages_total",
            "counter",
            "Pages that entered the prefix cache.",
        ),
        (
            "evicted_pages",
            "kvmesh_prefix_cache_evicted_pages_total",
            "counter",
            "Pages evicted from the prefix cache.",
        ),
        (
            "entries",
            "kvmesh_prefix_cache_pages",
            "gauge",
            "Pages in the prefix cache.",
        ),
        (
            "leased_pages",
            "kvmesh_prefix_cache_leased_pages",
            "gauge",
            "Cached pages running sequences lease.",
        ),
        (
            "max_pages",
            "kvmesh_prefix_cache_max_pages",
            "gauge",
            "The bound on the prefix cache, in pages (0: off).",
        ),
    ];
    for (field, name, kind, help) in cache {
        if let Some(v) = r.prefix_cache.get(field) {
            header(out, name, help, kind);
            sample(out, name, &labels, v);
        }
    }
}

/// The `node="..",role=".."` labels of [`render_report`], for a node's
/// series of its own.
pub fn node_labels(node: &str, role: NodeRole) -> String {
    let role = if role == NodeRole::Decode {
        "decode"
    } else {
        "prefill"
    };
    format!("node=\"{}\",role=\"{role}\"", escape(node))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_renders_its_role_series_only_with_bounded_labels() {
        let mut r = LoadReport {
            node: "decode-\"0\"".into(),
            kv_pages_total: 64,
            kv_pages_free: 60,
            guard_violations: 2,
            reservations_granted: 5,
            kv_bytes_received: 4096,
            version: "0.1.0".into(),
            ..LoadReport::default()
        };
        r.set_role(NodeRole::Decode);
        r.reservations_ended.insert("completed".into(), 4);
        r.reservations_ended.insert("aborted".into(), 1);
        r.prefix_cache.insert("hit_tokens".into(), 32);
        let mut out = String::new();
        render_report(&r, &mut out);
        let l = "node=\"decode-\\\"0\\\"\",role=\"decode\"";
        for line in [
            format!("kvmesh_kv_pool_pages{{{l}}} 64"),
            format!("kvmesh_kv_pool_free_pages{{{l}}} 60"),
            format!("kvmesh_kv_guard_violations_total{{{l}}} 2"),
            format!("kvmesh_reservations_ended_total{{{l},outcome=\"aborted\"}} 1"),
            format!("kvmesh_reservations_ended_total{{{l},outcome=\"completed\"}} 4"),
            format!("kvmesh_kv_received_bytes_total{{{l}}} 4096"),
            format!("kvmesh_prefix_cache_hit_tokens_total{{{l}}} 32"),
        ] {
            assert!(out.lines().any(|x| x == line), "{line} missing in\n{out}");
        }
        // Every gauge's name is free of `_total`; every counter's has it.
        let mut kind = "";
        for line in out.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, k) = rest.split_once(' ').expect("type line");
                kind = k;
                assert_eq!(name.ends_with("_total"), k == "counter", "{line}");
            } else if !line.starts_with('#') {
                assert!(!kind.is_empty(), "sample before any TYPE: {line}");
            }
        }
        r.set_role(NodeRole::Prefill);
        let mut prefill = String::new();
        render_report(&r, &mut prefill);
        assert!(!prefill.contains("kvmesh_reservations_granted_total"));
        assert!(!prefill.contains("kvmesh_kv_received_bytes_total"));
        assert!(prefill.contains("role=\"prefill\""));
    }
}
