//! [`WriterError`]: why a writer refused a grant or stopped writing.

use thiserror::Error;

use kvmesh_kvwire::{Geometry, ReservationId};

use super::TransportError;

/// Why a writer refused or stopped.
#[derive(Debug, Error)]
pub enum WriterError {
    /// The decode node aborted the reservation; the writer has stopped
    /// (and confirmed, or will once its in-flight writes drained).
    #[error("reservation {0} was aborted")]
    Aborted(ReservationId),
    /// The decode node revoked the grant (lease expired or abort timed out).
    #[error("reservation {0} was revoked")]
    Revoked(ReservationId),
    /// The grant's lease is over.
    #[error("the grant of reservation {0} has expired")]
    Expired(ReservationId),
    /// A writer for this grant exists or existed on this connection.
    #[error("reservation {0} already has a writer")]
    DuplicateGrant(ReservationId),
    /// The grant's page shape is not this connection's pool's.
    #[error("the grant's geometry {grant:?} is not the pool's {pool:?}")]
    GeometryMismatch {
        /// In the grant.
        grant: Geometry,
        /// Of the connection.
        pool: Geometry,
    },
    /// Layers must be written in order, each once.
    #[error("layer {got} written out of order: expected layer {expected}")]
    OutOfOrder {
        /// The next layer.
        expected: u16,
        /// What was given.
        got: u16,
    },
    /// K or V do not cover exactly the prompt's tokens.
    #[error("{field} has {got} values, the prompt needs {expected}")]
    BadLength {
        /// `k` or `v`.
        field: &'static str,
        /// Values needed.
        expected: usize,
        /// Values given.
        got: usize,
    },
    /// Transfer-done before every layer was written.
    #[error("transfer incomplete: {written} of {n_layers} layers written")]
    Incomplete {
        /// Layers written.
        written: u16,
        /// Layers in the model.
        n_layers: u16,
    },
    /// The transport failed; the decode node will revoke the grant when it
    /// sees the connection end or the lease run out.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

impl WriterError {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Aborted(_) => "aborted",
            Self::Revoked(_) => "revoked",
            Self::Expired(_) => "expired",
            Self::DuplicateGrant(_) => "duplicate_grant",
            Self::GeometryMismatch { .. } => "geometry_mismatch",
            Self::OutOfOrder { .. } => "out_of_order",
            Self::BadLength { .. } => "bad_length",
            Self::Incomplete { .. } => "incomplete",
            Self::Transport(e) => e.kind(),
        }
    }
}
