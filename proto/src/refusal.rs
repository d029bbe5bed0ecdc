//! The draining refusal: how a node that drains says so on a call it
//! refuses, and how its caller tells that from a node that is down. Both
//! sides of the internal services read this one definition: the nodes
//! answer with [`draining`], the router checks [`is_draining`] and, on a
//! match, takes the node out of its choice and answers its client with a
//! retryable 503 instead of a node failure.

/// The metadata key of a call a draining node refused (value
/// [`DRAINING`]): the caller may choose another node, and its client gets
/// a retryable 503, not a node failure.
pub const REFUSED_KEY: &str = "kvmesh-refused";
/// [`REFUSED_KEY`]'s value for a node that is draining.
pub const DRAINING: &str = "draining";

/// The status of a call refused because the node is draining.
pub fn draining(message: impl Into<String>) -> tonic::Status {
    let mut s = tonic::Status::unavailable(message);
    s.metadata_mut().insert(
        REFUSED_KEY,
        tonic::metadata::MetadataValue::from_static(DRAINING),
    );
    s
}

/// Whether `s` is a draining node's refusal ([`draining`]).
pub fn is_draining(s: &tonic::Status) -> bool {
    s.code() == tonic::Code::Unavailable
        && s.metadata().get(REFUSED_KEY).is_some_and(|v| v == DRAINING)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_draining_refusal_is_told_apart_from_a_node_that_is_down() {
        assert!(is_draining(&draining("prefill node draining")));
        assert!(!is_draining(&tonic::Status::unavailable(
            "connection refused"
        )));
        let mut other = tonic::Status::internal("x");
        other.metadata_mut().insert(
            REFUSED_KEY,
            tonic::metadata::MetadataValue::from_static(DRAINING),
        );
        assert!(!is_draining(&other));
    }
}
