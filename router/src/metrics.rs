//! The router's Prometheus metrics, rendered by hand in the text format:
//! request outcomes, rejections by reason, TTFT and inter-token latency
//! histograms, then the mesh's own series ([`crate::mesh::Mesh::render_metrics`]:
//! for the gRPC mesh, per node the figures of its last load report,
//! [`render_nodes`]).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use kvmesh_proto::internal::v1::LoadReport;
use kvmesh_telemetry::metrics::{escape, header, sample, Histogram, SECONDS};

use crate::mesh::Mesh;
use crate::nodes::Nodes;

#[derive(Debug, Default)]
struct State {
    requests: BTreeMap<&'static str, u64>,
    rejected: BTreeMap<&'static str, u64>,
}

/// The counters.
#[derive(Debug)]
pub struct Metrics {
    state: Mutex<State>,
    ttft: Histogram,
    itl: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            ttft: Histogram::new(SECONDS),
            itl: Histogram::new(SECONDS),
        }
    }
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
        self.ttft.observe(d.as_secs_f64());
    }

    /// Time between tokens.
    pub fn itl(&self, d: Duration) {
        self.itl.observe(d.as_secs_f64());
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
        });
        self.ttft.render(
            "kvmesh_time_to_first_token_seconds",
            "Time from dispatch to the first token.",
            "",
            &mut out,
        );
        self.itl.render(
            "kvmesh_inter_token_latency_seconds",
            "Time between consecutive tokens.",
            "",
            &mut out,
        );
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
                "Calls (via=grpc) and KV connections (via=kv) the node refused for not proving the mesh secret, and connections its mutual TLS refused (via=tls), by kind.",
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
                    for (via, map) in [
                        ("grpc", &r.grpc_auth_refused),
                        ("kv", &r.kv_auth_refused),
                        ("tls", &r.tls_refused),
                    ] {
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
    render_identity(nodes, out);
    render_prefix_cache(nodes, out);
    render_unproven(nodes, out);
    render_reports(nodes, out);
}

/// Per node, the load reports this router received from it: a poller
/// that stalls shows as a count that stops; a test that needs figures
/// newer than an event waits for the count to move twice (one poll may
/// have been in flight before it).
fn render_reports(nodes: &Nodes, out: &mut String) {
    const NAME: &str = "kvmesh_router_node_load_reports_total";
    header(
        out,
        NAME,
        "Load reports received from the node (every 200 ms while it answers).",
        "counter",
    );
    for n in nodes.all().iter() {
        sample(
            out,
            NAME,
            &format!("node=\"{}\",role=\"{}\"", escape(&n.name), n.role.as_str()),
            n.reports(),
        );
    }
}

/// Per node, its answers this router refused because they did not prove
/// the node (no proof, a malformed one, or one not over the call made):
/// nonzero means something answers on the node's address without the
/// mesh secret, or a node of another name does.
fn render_unproven(nodes: &Nodes, out: &mut String) {
    const NAME: &str = "kvmesh_router_node_unproven_total";
    header(
        out,
        NAME,
        "Answers from the node refused for not proving the mesh secret and the node's name over the call, by kind.",
        "counter",
    );
    for n in nodes.all().iter() {
        for (kind, v) in n.unproven() {
            sample(
                out,
                NAME,
                &format!(
                    "node=\"{}\",role=\"{}\",kind=\"{kind}\"",
                    escape(&n.name),
                    n.role.as_str()
                ),
                v,
            );
        }
    }
}

/// Per node, what `kvmesh doctor --url` compares across the mesh: its
/// build, model and KV layout, the longest request it takes, and its clock
/// against the router's (read when its last load report was rendered, so
/// good to a poll interval: far inside mesh auth's 60-s window).
fn render_identity(nodes: &Nodes, out: &mut String) {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i128);
    let members = nodes.all();
    let reports: Vec<_> = members
        .iter()
        .filter_map(|n| Some((n, n.report()?)))
        .collect();
    let node = |n: &crate::nodes::Node| {
        format!("node=\"{}\",role=\"{}\"", escape(&n.name), n.role.as_str())
    };
    header(
        out,
        "kvmesh_node_info",
        "The node's build, model and KV layout, from its last load report (value 1).",
        "gauge",
    );
    for (n, r) in &reports {
        sample(
            out,
            "kvmesh_node_info",
            &format!(
                "{},version=\"{}\",model=\"{}\",kv_dtype=\"{}\",max_model_len=\"{}\",cpu_kernels=\"{}\",cpu_numerics=\"{}\"",
                node(n),
                escape(&r.version),
                escape(&r.model),
                escape(&r.kv_dtype),
                r.max_model_len,
                escape(&r.cpu_kernels),
                escape(&r.cpu_numerics)
            ),
            1,
        );
    }
    type Get = fn(&LoadReport, i128) -> String;
    let series: [(&str, &str, Get); 3] = [
        (
            "kvmesh_node_max_sequence_tokens",
            "The longest prompt plus completion the node accepts: the smaller of the context window and its pool.",
            |r, _| r.max_seq_tokens.to_string(),
        ),
        (
            "kvmesh_node_page_size_tokens",
            "Token slots per KV page of the node.",
            |r, _| r.page_size.to_string(),
        ),
        (
            "kvmesh_node_clock_skew_seconds",
            "The node's clock minus the router's, as of its last load report (positive: the node is ahead).",
            |r, now_ms| format!("{:.3}", (i128::from(r.unix_ms) - now_ms) as f64 / 1000.0),
        ),
    ];
    for (name, help, get) in series {
        header(out, name, help, "gauge");
        for (n, r) in &reports {
            if name == "kvmesh_node_clock_skew_seconds" && r.unix_ms == 0 {
                continue;
            }
            sample(out, name, &node(n), get(r, now_ms));
        }
    }
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
