//! The router's Prometheus metrics, rendered by hand in the text format:
//! request outcomes, rejections by reason, TTFT and inter-token latency
//! histograms, then the mesh's own series ([`crate::mesh::Mesh::render_metrics`]:
//! for the gRPC mesh, per node the figures of its last load report,
//! [`render_nodes`]).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::mesh::Mesh;
use crate::nodes::Nodes;

/// Histogram bucket bounds, seconds.
const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    n: u64,
}

impl Histogram {
    fn observe(&mut self, secs: f64) {
        for (c, b) in self.counts.iter_mut().zip(BUCKETS) {
            if secs <= b {
                *c += 1;
            }
        }
        self.sum += secs;
        self.n += 1;
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, b) in self.counts.iter().zip(BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.n);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.n);
    }
}

#[derive(Debug, Default)]
struct State {
    requests: BTreeMap<&'static str, u64>,
    rejected: BTreeMap<&'static str, u64>,
    ttft: Histogram,
    itl: Histogram,
}

/// The counters.
#[derive(Debug, Default)]
pub struct Metrics {
    state: Mutex<State>,
}

impl Metrics {
    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        f(&mut self.state.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// A dispatched request ended with `outcome` ("stop", "length",
    /// "client_gone", or an error kind).
    pub fn finished(&self, outcome: &'static str) {
        self.with(|s| *s.requests.entry(outcome).or_default() += 1);
    }

    /// A request was refused before dispatch.
    pub fn rejected(&self, reason: &'static str) {
        self.with(|s| {
            *s.rejected.entry(reason).or_default() += 1;
            *s.requests.entry("rejected").or_default() += 1;
        });
    }

    /// Time to first token.
    pub fn ttft(&self, d: Duration) {
        self.with(|s| s.ttft.observe(d.as_secs_f64()));
    }

    /// Time between tokens.
    pub fn itl(&self, d: Duration) {
        self.with(|s| s.itl.observe(d.as_secs_f64()));
    }

    /// The Prometheus text: the gateway's series, then `mesh`'s.
    pub fn render(&self, mesh: &dyn Mesh) -> String {
        let mut out = String::new();
        self.with(|s| {
            let _ = writeln!(out, "# HELP kvmesh_requests_total Requests by outcome.\n# TYPE kvmesh_requests_total counter");
            for (k, v) in &s.requests {
                let _ = writeln!(out, "kvmesh_requests_total{{outcome=\"{k}\"}} {v}");
            }
            let _ = writeln!(out, "# HELP kvmesh_requests_rejected_total Requests refused before dispatch, by reason.\n# TYPE kvmesh_requests_rejected_total counter");
            for (k, v) in &s.rejected {
                let _ = writeln!(out, "kvmesh_requests_rejected_total{{reason=\"{k}\"}} {v}");
            }
            s.ttft.render("kvmesh_time_to_first_token_seconds", "Time from dispatch to the first token.", &mut out);
            s.itl.render("kvmesh_inter_token_latency_seconds", "Time between consecutive tokens.", &mut out);
        });
        mesh.render_metrics(&mut out);
        out
    }
}

/// Per node, the figures of its last load report (and whether it is up).
pub(crate) fn render_nodes(nodes: &Nodes, out: &mut String) {
    let gauges = [
            (
                "kvmesh_node_kv_pages_total",
                "KV pool pages of the node.",
                "gauge",
            ),
            (
                "kvmesh_node_kv_pages_free",
                "KV pool pages a reservation can get on the node: free, plus cached pages no sequence leases.",
                "gauge",
            ),
            (
                "kvmesh_node_kv_guard_violations_total",
                "Guard violations counted by the node's pool.",
                "counter",
            ),
            (
                "kvmesh_node_reservations_total",
                "Reservations ended on the node, by outcome.",
                "counter",
            ),
            (
                "kvmesh_node_reservations_granted_total",
                "Reservations granted by the node.",
                "counter",
            ),
            (
                "kvmesh_node_kv_bytes_received_total",
                "KV bytes the decode node received in completed transfers (positions its prefix cache had are not shipped).",
                "counter",
            ),
            (
                "kvmesh_node_kv_refused_total",
                "KV-transport messages the decode node refused, by kind.",
                "counter",
            ),
            (
                "kvmesh_node_auth_refused_total",
                "Calls (via=grpc) and KV connections (via=kv) the node refused for not proving the mesh secret, by kind.",
                "counter",
            ),
            (
                "kvmesh_node_up",
                "1 when the node's last load report arrived in time.",
                "gauge",
            ),
        ];
    for (name, help, ty) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {ty}");
        for n in nodes.all() {
            let report = n.report();
            let labels = format!("node=\"{}\",role=\"{}\"", n.name, n.role.as_str());
            match (name, &report) {
                ("kvmesh_node_up", r) => {
                    let _ = writeln!(out, "{name}{{{labels}}} {}", u8::from(r.is_some()));
                }
                (_, None) => {}
                ("kvmesh_node_kv_pages_total", Some(r)) => {
                    let _ = writeln!(out, "{name}{{{labels}}} {}", r.kv_pages_total);
                }
                ("kvmesh_node_kv_pages_free", Some(r)) => {
                    let _ = writeln!(out, "{name}{{{labels}}} {}", r.kv_pages_free);
                }
                ("kvmesh_node_reservations_granted_total", Some(r)) => {
                    if n.role == crate::nodes::Role::Decode {
                        let _ = writeln!(
                            out,
                            "{name}{{node=\"{}\"}} {}",
                            n.name, r.reservations_granted
                        );
                    }
                }
                ("kvmesh_node_kv_bytes_received_total", Some(r)) => {
                    if n.role == crate::nodes::Role::Decode {
                        let _ =
                            writeln!(out, "{name}{{node=\"{}\"}} {}", n.name, r.kv_bytes_received);
                    }
                }
                ("kvmesh_node_kv_refused_total", Some(r)) => {
                    let mut refused: Vec<_> = r.kv_refused.iter().collect();
                    refused.sort();
                    for (kind, v) in refused {
                        let _ = writeln!(out, "{name}{{node=\"{}\",kind=\"{kind}\"}} {v}", n.name);
                    }
                }
                ("kvmesh_node_auth_refused_total", Some(r)) => {
                    for (via, map) in [("grpc", &r.grpc_auth_refused), ("kv", &r.kv_auth_refused)] {
                        let mut refused: Vec<_> = map.iter().collect();
                        refused.sort();
                        for (kind, v) in refused {
                            let _ = writeln!(
                                out,
                                "{name}{{node=\"{}\",via=\"{via}\",kind=\"{kind}\"}} {v}",
                                n.name
                            );
                        }
                    }
                }
                ("kvmesh_node_kv_guard_violations_total", Some(r)) => {
                    let _ = writeln!(out, "{name}{{node=\"{}\"}} {}", n.name, r.guard_violations);
                }
                (_, Some(r)) => {
                    let mut ended: Vec<_> = r.reservations_ended.iter().collect();
                    ended.sort();
                    for (outcome, v) in ended {
                        let _ = writeln!(
                            out,
                            "{name}{{node=\"{}\",outcome=\"{outcome}\"}} {v}",
                            n.name
                        );
                    }
                }
            }
        }
    }
    render_prefix_cache(nodes, out);
}

/// Per node, its prefix cache (from the load report's `prefix_cache` map).
fn render_prefix_cache(nodes: &Nodes, out: &mut String) {
    let series = [
        (
            "lookup_tokens",
            "_total",
            "counter",
            "Prompt tokens looked up in the node's prefix cache (full pages).",
        ),
        (
            "hit_tokens",
            "_total",
            "counter",
            "Prompt tokens the node's prefix cache supplied.",
        ),
        (
            "inserted_pages",
            "_total",
            "counter",
            "Pages that entered the node's prefix cache.",
        ),
        (
            "evicted_pages",
            "_total",
            "counter",
            "Pages evicted from the node's prefix cache.",
        ),
        ("entries", "", "gauge", "Pages in the node's prefix cache."),
        (
            "leased_pages",
            "",
            "gauge",
            "Cached pages that running sequences lease.",
        ),
        (
            "max_pages",
            "",
            "gauge",
            "The bound on the node's prefix cache, in pages (0: off).",
        ),
    ];
    for (field, suffix, ty, help) in series {
        let name = format!("kvmesh_node_prefix_cache_{field}{suffix}");
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {ty}");
        for n in nodes.all() {
            if let Some(v) = n.report().and_then(|r| r.prefix_cache.get(field).copied()) {
                let _ = writeln!(
                    out,
                    "{name}{{node=\"{}\",role=\"{}\"}} {v}",
                    n.name,
                    n.role.as_str()
                );
            }
        }
    }
}
