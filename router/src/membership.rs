//! Where the router's membership comes from ([`Discovery`]), and its
//! Prometheus series: whether it is degraded, the members by role, the
//! registrations the source refused.

use std::fmt::Write;
use std::time::Instant;

use crate::nodes::{Nodes, Role};

/// Where the router's membership comes from, and whether it is current.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Discovery {
    /// A fixed list (the mesh file, or `kvmesh serve`'s own nodes).
    Static,
    /// A membership service (`source`: "etcd") the router follows.
    Watched {
        /// Its name (a metric label).
        source: &'static str,
        /// `Some` while it cannot be reached: since when. The router then
        /// routes on its last view (whose nodes still answer load polls or
        /// are taken out by them, as always) and reports itself degraded.
        degraded_since: Option<Instant>,
    },
}

impl Discovery {
    /// The source's name: `static`, or the service's.
    pub fn source(&self) -> &'static str {
        match self {
            Self::Static => "static",
            Self::Watched { source, .. } => source,
        }
    }

    /// Since when the membership is stale, if it is.
    pub fn degraded_since(&self) -> Option<Instant> {
        match self {
            Self::Static => None,
            Self::Watched { degraded_since, .. } => *degraded_since,
        }
    }
}

/// `kvmesh_discovery_*`: degraded (0/1), members by role, refused
/// registrations.
pub(crate) fn render(nodes: &Nodes, out: &mut String) {
    let d = nodes.discovery();
    let source = d.source();
    let _ = writeln!(
        out,
        "# HELP kvmesh_discovery_degraded 1 while the membership source cannot be reached and the router routes on its last view.\n\
         # TYPE kvmesh_discovery_degraded gauge\n\
         kvmesh_discovery_degraded{{source=\"{source}\"}} {}",
        u8::from(d.degraded_since().is_some())
    );
    let all = nodes.all();
    let _ = writeln!(
        out,
        "# HELP kvmesh_discovery_members Nodes in the router's membership view, by role (healthy or not).\n\
         # TYPE kvmesh_discovery_members gauge"
    );
    for role in [Role::Prefill, Role::Decode] {
        let n = all.iter().filter(|n| n.role == role).count();
        let _ = writeln!(
            out,
            "kvmesh_discovery_members{{role=\"{}\"}} {n}",
            role.as_str()
        );
    }
    let _ = writeln!(
        out,
        "# HELP kvmesh_discovery_refused_registrations_total Entries under the mesh's prefix that were not valid registrations (each is logged).\n\
         # TYPE kvmesh_discovery_refused_registrations_total counter\n\
         kvmesh_discovery_refused_registrations_total {}",
        nodes.refused()
    );
}

#[cfg(test)]
mod tests;
