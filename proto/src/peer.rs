//! Internal clients whose calls prove the mesh secret (the interceptor and
//! the server wrapper are `kvmesh_meshauth::grpc`).

use kvmesh_meshauth::grpc::{PeerChannel, Signer};
use kvmesh_meshauth::MeshSecret;
use tonic::transport::Channel;

use crate::internal::v1::decode_client::DecodeClient;
use crate::internal::v1::prefill_client::PrefillClient;

/// A Decode client whose calls prove `secret`.
pub fn decode_client(channel: Channel, secret: MeshSecret) -> DecodeClient<PeerChannel> {
    DecodeClient::with_interceptor(channel, Signer::new(secret))
}

/// A Prefill client whose calls prove `secret`.
pub fn prefill_client(channel: Channel, secret: MeshSecret) -> PrefillClient<PeerChannel> {
    PrefillClient::with_interceptor(channel, Signer::new(secret))
}
