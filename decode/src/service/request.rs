//! What a decode request carries, checked before anything is reserved:
//! its faults (testing builds), its ids, its sampling and namespace; the
//! one mapping from reserve refusals to the wire; and a reservation
//! abandoned when the router goes away.

use kvmesh_faults::{Action, FaultPlan, Point};
use kvmesh_kvpool::Namespace;
use kvmesh_kvwire::{AbortReason, ReservationId, WriterId};
use kvmesh_kvxfer::handshake::{ReservationTable, ReserveError};
use kvmesh_model::sampling::SamplingParams;
use kvmesh_model::structured::{StructuredError, Vocabulary};
use kvmesh_proto::internal::v1::{decode_event, DecodeEvent, GenerateRequest, RefuseKind, Refused};
use tonic::{Request, Status};

/// The faults a request carries in its metadata (testing builds; none
/// otherwise).
pub(super) fn request_faults<T>(req: &Request<T>) -> Result<FaultPlan, Status> {
    FaultPlan::from_header(
        req.metadata()
            .get(kvmesh_faults::HEADER)
            .and_then(|v| v.to_str().ok()),
    )
    .map_err(|e| Status::invalid_argument(e.to_string()))
}

pub(super) fn reservation_id(bytes: &[u8]) -> Result<ReservationId, Status> {
    <[u8; 16]>::try_from(bytes)
        .ok()
        .and_then(ReservationId::from_bytes)
        .ok_or_else(|| Status::invalid_argument("reservation_id: 16 bytes, not all zero"))
}

/// The one mapping from reserve refusals to their typed kind on the wire.
pub(super) fn refuse_kind(e: &ReserveError) -> RefuseKind {
    match e {
        ReserveError::EmptyPrompt => RefuseKind::EmptyPrompt,
        ReserveError::TooLong { .. } => RefuseKind::TooLong,
        ReserveError::OverCapacity { .. } => RefuseKind::OverCapacity,
        ReserveError::Exhausted { .. } => RefuseKind::Exhausted,
        ReserveError::WriterNotConnected { .. } => RefuseKind::WriterNotConnected,
        ReserveError::Transport(_) | ReserveError::Mint(_) | ReserveError::Pool(_) => {
            RefuseKind::Internal
        }
    }
}

pub(super) fn refused(kind: RefuseKind, message: String) -> DecodeEvent {
    DecodeEvent {
        event: Some(decode_event::Event::Refused(Refused {
            kind: kind.into(),
            message,
        })),
    }
}

/// A Generate request, checked: what the reservation and the sampler need.
pub(super) struct Checked {
    pub(super) writer: WriterId,
    pub(super) max_new: usize,
    pub(super) params: SamplingParams,
    /// The prefix-cache namespace, when the router sent one.
    pub(super) ns: Option<Namespace>,
}

/// `r` checked; a grammar is compiled over `vocabulary` (the engine's).
pub(super) fn check<'v>(
    r: &GenerateRequest,
    vocabulary: impl FnOnce() -> Result<&'v Vocabulary, StructuredError>,
) -> Result<Checked, String> {
    let writer = <[u8; 16]>::try_from(r.writer_id.as_slice())
        .ok()
        .and_then(WriterId::from_bytes)
        .ok_or("writer_id: 16 bytes, not all zero")?;
    let params =
        kvmesh_node::sampling::params(&r.sampling.clone().unwrap_or_default(), vocabulary)?;
    let ns = match r.cache_namespace.as_slice() {
        [] => None,
        b => Some(Namespace::from_slice(b).ok_or("cache_namespace: 32 bytes or none")?),
    };
    Ok(Checked {
        writer,
        max_new: r.max_new_tokens as usize,
        params,
        ns,
    })
}

/// The router went away (it dropped the stream) before the transfer was
/// verified: the caller then drops `wait`, whose `Pending` aborts through
/// the confirmation path. `abort` faults (testing builds) lose, delay or
/// repeat that abort, as a lost or late cancellation would.
pub(super) async fn abandon<F: std::future::Future>(
    table: &ReservationTable,
    id: ReservationId,
    wait: std::pin::Pin<&mut F>,
    faults: &FaultPlan,
) {
    match faults.at(Point::Abort) {
        Some(Action::Drop) => {
            // The abort is lost: the lease ends the reservation.
            let _ = wait.await;
        }
        Some(Action::Delay(d)) => tokio::time::sleep(d).await,
        Some(Action::Duplicate) => {
            // This one, then the handle's own when the caller drops it.
            let state = table.abort(id, AbortReason::CLIENT_GONE);
            tracing::debug!(reservation = %id, ?state, "first of a duplicated abort");
        }
        _ => {}
    }
}
