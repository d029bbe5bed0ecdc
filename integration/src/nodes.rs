//! Helpers for tests that drive the internal node services by hand.

use kvmesh_proto::internal::v1::{decode_event, DecodeEvent, Granted};

/// The grant of a `Decode.Generate` stream: its first event, which must be
/// `Granted`. The stream stays the caller's; dropping it aborts the
/// reservation.
pub async fn first_grant(stream: &mut tonic::Streaming<DecodeEvent>) -> Granted {
    match stream
        .message()
        .await
        .expect("first event")
        .and_then(|e| e.event)
    {
        Some(decode_event::Event::Granted(g)) => g,
        other => panic!("not a grant: {other:?}"),
    }
}
