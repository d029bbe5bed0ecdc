//! Prometheus text exposition (format 0.0.4), the one writer the router's
//! `/metrics` and every node's share: a lock-free [`Histogram`], the
//! family header, and a node's own series rendered from the load report it
//! builds for the router ([`render_report`]), so what a node says about
//! itself on `/metrics` and what the router relays are the same numbers.
//!
//! Names follow the Prometheus conventions: the unit in the name in base
//! units (`_seconds`, `_bytes`), counters end in `_total`, gauges never do,
//! and labels carry only bounded sets (kinds, outcomes, the node's own
//! name): never a reservation id, a prompt or a tenant.
//!
//! Cost: a histogram observation is one relaxed atomic add per bucket at or
//! above the value plus a compare-and-swap on the sum; rendering allocates
//! the text only when scraped.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::internal::v1::{LoadReport, NodeRole};

/// Bucket bounds for durations, seconds: 1 ms to 30 s.
pub const SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Bucket bounds for batch sizes (sequences or prompts per step).
pub const BATCH: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// What serves a node's `/metrics`: renders its text when scraped.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// The content type of the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A cumulative histogram with fixed bucket bounds, observed from any
/// thread without a lock.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations at or below each bound (cumulative, as exposed).
    counts: Box<[AtomicU64]>,
    /// The sum of observations, as `f64` bits.
    sum: AtomicU64,
    n: AtomicU64,
}

impl Histogram {
    /// An empty histogram over `bounds` (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0f64.to_bits()),
            n: AtomicU64::new(0),
        }
    }

    /// Records `v` (a NaN counts in `+Inf` only and leaves the sum alone).
    pub fn observe(&self, v: f64) {
        for (c, b) in self.counts.iter().zip(self.bounds) {
            if v <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        if !v.is_nan() {
            let _ = self
                .sum
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                    Some((f64::from_bits(bits) + v).to_bits())
                });
        }
        self.n.fetch_add(1, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.n.load(Ordering::Relaxed)
    }

    /// Writes the family `name` (header and series) with `labels`
    /// (`a="x",b="y"`, or empty) on every sample.
    pub fn render(&self, name: &str, help: &str, labels: &str, out: &mut String) {
        header(out, name, help, "histogram");
        self.render_series(name, labels, out);
    }

    /// Writes this histogram's samples of family `name` (no header: for a
    /// family with several label sets).
    pub fn render_series(&self, name: &str, labels: &str, out: &mut String) {
        let sep = if labels.is_empty() { "" } else { "," };
        // The count first: a scrape racing observations must never show a
        // bucket above `+Inf`.
        let n = self.n.load(Ordering::Relaxed);
        for (c, b) in self.counts.iter().zip(self.bounds) {
            let c = c.load(Ordering::Relaxed).min(n);
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {n}");
        let sum = f64::from_bits(self.sum.load(Ordering::Relaxed));
        let braces = |l: &str| {
            if l.is_empty() {
                String::new()
            } else {
                format!("{{{l}}}")
            }
        };
        let _ = writeln!(out, "{name}_sum{} {sum}", braces(labels));
        let _ = writeln!(out, "{name}_count{} {n}", braces(labels));
    }
}

/// Writes a family's `# HELP` and `# TYPE` lines.
pub fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Writes one sample: `name{labels} value`.
pub fn sample(out: &mut String, name: &str, labels: &str, value: impl std::fmt::Display) {
    if labels.is_empty() {
        let _ = writeln!(out, "{name} {value}");
    } else {
        let _ = writeln!(out, "{name}{{{labels}}} {value}");
    }
}

/// A label value escaped for the text format (backslash, quote, newline).
pub fn escape(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

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
    fn a_histogram_is_cumulative_and_ends_at_its_count() {
        let h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.5, 1.5, 7.0, f64::NAN] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render("x_seconds", "X.", "a=\"b\"", &mut out);
        assert_eq!(
            out,
            "# HELP x_seconds X.\n# TYPE x_seconds histogram\n\
             x_seconds_bucket{a=\"b\",le=\"1\"} 1\n\
             x_seconds_bucket{a=\"b\",le=\"2\"} 3\n\
             x_seconds_bucket{a=\"b\",le=\"+Inf\"} 5\n\
             x_seconds_sum{a=\"b\"} 10.5\n\
             x_seconds_count{a=\"b\"} 5\n"
        );
        let mut bare = String::new();
        Histogram::new(&[1.0]).render_series("y", "", &mut bare);
        assert_eq!(
            bare,
            "y_bucket{le=\"1\"} 0\ny_bucket{le=\"+Inf\"} 0\ny_sum 0\ny_count 0\n"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

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
