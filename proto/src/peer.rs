//! Internal clients whose calls prove the mesh secret (the interceptor and
//! the server wrapper are `kvmesh_meshauth::grpc`) and carry the calling
//! span's trace context (`traceparent` metadata, when tracing is on): the
//! one place every router-to-node call passes through.

use kvmesh_meshauth::grpc::{PeerChannel, Signer};
use kvmesh_meshauth::MeshSecret;
use tonic::transport::Channel;

use crate::internal::v1::decode_client::DecodeClient;
use crate::internal::v1::prefill_client::PrefillClient;

/// What every internal call carries: the proof of `secret`, and the
/// current span's trace context.
fn signer(secret: MeshSecret) -> Signer {
    Signer::new(secret).with_metadata(kvmesh_telemetry::propagate::inject_grpc)
}

/// A Decode client whose calls prove `secret`.
pub fn decode_client(channel: Channel, secret: MeshSecret) -> DecodeClient<PeerChannel> {
    DecodeClient::with_interceptor(channel, signer(secret))
}

/// A Prefill client whose calls prove `secret`.
pub fn prefill_client(channel: Channel, secret: MeshSecret) -> PrefillClient<PeerChannel> {
    PrefillClient::with_interceptor(channel, signer(secret))
}
