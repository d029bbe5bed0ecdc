//! The fault catalogue: every fault spec the test tools inject, each with
//! the one outcome it must have. The fault matrix
//! (`integration/tests/faults.rs`) runs every entry once per transport and
//! holds each to its [`Expect`] strictly; `kvmesh soak` draws entries at
//! random under load (where a fault may fall past a request's end, so a
//! failing fault may also end with the reference output, never with any
//! other). A new fault goes here, and both run it.

/// What a request carrying a fault must end with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// As without the fault: the output equals the reference.
    Equal,
    /// A clear error to the client: a status >= 400 before the stream
    /// starts, or an error event in it.
    Error,
    /// A clear error, and the decode node's guard-violation counter rises
    /// by one: a planted page-table fault that the read path refuses (I1).
    GuardError,
    /// A write that goes after transfer-done: a clear error where the
    /// receiver sees frames in order (TCP); on a one-sided transport the
    /// write may land before decode closes the path and verifies (the
    /// transfer is whole and the output equals the reference) or not (a
    /// clear error). Never anything else.
    ErrorInOrder,
}

impl Expect {
    /// Whether the fault may end the request with an error.
    pub fn fails(self) -> bool {
        !matches!(self, Self::Equal)
    }

    /// Whether the fault makes the decode node count a guard violation.
    pub fn trips_guard(self) -> bool {
        matches!(self, Self::GuardError)
    }
}

/// One injectable fault: the value of the [`crate::HEADER`] header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// `POINT=ACTION[,...]`, as [`crate::FaultPlan::parse`] reads it.
    pub spec: &'static str,
    /// The outcome it must have.
    pub expect: Expect,
}

const fn entry(spec: &'static str, expect: Expect) -> Entry {
    Entry { spec, expect }
}

/// Every fault, in handshake order.
pub const CATALOG: &[Entry] = &[
    entry("reserve=delay:100", Expect::Equal),
    entry("reserve=duplicate", Expect::Equal),
    entry("reserve=drop", Expect::Error),
    entry("grant=delay:100", Expect::Equal),
    entry("grant=duplicate", Expect::Equal),
    entry("grant=corrupt", Expect::Error),
    // Ends only when the grant's lease runs out.
    entry("grant=drop", Expect::Error),
    entry("frame:0=delay:100", Expect::Equal),
    entry("frame:1=duplicate", Expect::Equal),
    entry("frame:1=reorder", Expect::Equal),
    // Layer 1 on a prompt of several pages: layer 0's KV depends only on
    // each token and its position, so a lost layer-0 frame over an earlier
    // request's identical data would rightly go unnoticed.
    entry("frame:5=drop", Expect::Error),
    entry("frame:0=corrupt", Expect::Error),
    entry("done=delay:100", Expect::Equal),
    entry("done=duplicate", Expect::Equal),
    // Ends only when the grant's lease runs out.
    entry("done=drop", Expect::Error),
    entry("done=corrupt", Expect::Error),
    entry("done=reorder", Expect::ErrorInOrder),
    entry("verify=corrupt", Expect::Error),
    entry("step:0=delay:100", Expect::Equal),
    entry("step:2=drop", Expect::Error),
    entry("step:2=corrupt", Expect::GuardError),
    entry("release=delay:300", Expect::Equal),
    // These two act only on a request whose client leaves (the soak's
    // disconnects); otherwise the request completes as without them.
    entry("confirm=delay:100", Expect::Equal),
    entry("abort=duplicate", Expect::Equal),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FaultPlan;

    #[test]
    fn every_entry_parses_and_prints_back() {
        for e in CATALOG {
            let plan = FaultPlan::parse(e.spec).unwrap_or_else(|err| panic!("{}: {err}", e.spec));
            assert!(!plan.is_empty(), "{}", e.spec);
            assert_eq!(plan.to_string(), e.spec);
        }
        let mut specs: Vec<_> = CATALOG.iter().map(|e| e.spec).collect();
        specs.sort_unstable();
        specs.dedup();
        assert_eq!(specs.len(), CATALOG.len(), "no spec twice");
    }

    #[test]
    fn the_catalogue_has_every_kind_of_outcome() {
        for want in [
            Expect::Equal,
            Expect::Error,
            Expect::GuardError,
            Expect::ErrorInOrder,
        ] {
            assert!(CATALOG.iter().any(|e| e.expect == want), "{want:?}");
        }
        assert!(!Expect::Equal.fails() && Expect::ErrorInOrder.fails());
        assert!(Expect::GuardError.trips_guard() && !Expect::Error.trips_guard());
    }
}
