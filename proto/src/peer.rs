//! Internal clients whose calls prove the mesh secret and whose answers
//! must prove the node called (the client channel and the server wrapper
//! are `kvmesh_meshauth::grpc`), and which carry the calling
//! span's trace context (`traceparent` metadata, when tracing is on): the
//! one place every router-to-node call passes through; over channels that
//! run inside mutual TLS when the mesh has certificates ([`channel`]).

use std::sync::Arc;
use std::time::Duration;

use kvmesh_meshauth::grpc::{PeerChannel, SignedChannel};
use kvmesh_meshauth::tls::{MeshTls, Purpose};
use kvmesh_meshauth::MeshSecret;
use tonic::transport::{Channel, Endpoint};

use crate::internal::v1::decode_client::DecodeClient;
use crate::internal::v1::prefill_client::PrefillClient;

/// A channel to node `name` whose calls prove `secret` and carry the
/// current span's trace context, and whose answers must prove the node.
pub fn peer_channel(channel: Channel, secret: MeshSecret, name: &str) -> PeerChannel {
    SignedChannel::new(channel, secret, name)
        .with_metadata(kvmesh_telemetry::propagate::inject_grpc)
}

/// A Decode client for node `name`; its calls prove `secret`, its answers
/// the node.
pub fn decode_client(
    channel: Channel,
    secret: MeshSecret,
    name: &str,
) -> DecodeClient<PeerChannel> {
    DecodeClient::new(peer_channel(channel, secret, name))
}

/// A Prefill client for node `name`; its calls prove `secret`, its answers
/// the node.
pub fn prefill_client(
    channel: Channel,
    secret: MeshSecret,
    name: &str,
) -> PrefillClient<PeerChannel> {
    PrefillClient::new(peer_channel(channel, secret, name))
}

/// How often each end of an internal HTTP/2 connection pings a silent
/// peer ([`channel`] here, the node's server in `kvmesh_node::serve`).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
/// How long a ping may go unanswered before the connection is closed and
/// every stream on it fails (UNAVAILABLE). Without it, a peer cut off by
/// the network (no FIN, no RST) held its streams open until TCP gave up,
/// about 15 minutes: a client's stream to a partitioned decode node hung
/// (measured: 119 s, ended only by decode's retransmission after the link
/// came back). With it, such a stream fails within
/// `KEEPALIVE_INTERVAL + KEEPALIVE_TIMEOUT` (7 s), inside the default
/// abort timeout (10 s) and lease (60 s). Generous on purpose: the
/// connection tasks answer pings on the async runtime, which the model's
/// compute threads do not occupy, but a saturated host can still delay
/// them.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// A lazily connecting channel to the node at `url` (`http://HOST:PORT`),
/// TCP_NODELAY, connecting within `connect_timeout`, with HTTP/2
/// keep-alive pings ([`KEEPALIVE_INTERVAL`], [`KEEPALIVE_TIMEOUT`]); with
/// `tls`, every connection runs mutual TLS first (the node's certificate
/// must name HOST). Refuses an address that is not a URI.
pub fn channel(
    url: &str,
    tls: Option<&Arc<MeshTls>>,
    connect_timeout: Duration,
) -> Result<Channel, String> {
    let endpoint = Endpoint::from_shared(url.to_owned())
        .map_err(|e| format!("bad address {url:?}: {e}"))?
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true);
    let Some(tls) = tls else {
        return Ok(endpoint.connect_lazy());
    };
    let tls = Arc::clone(tls);
    let connector = tower::service_fn(move |uri: tonic::codegen::http::Uri| {
        let tls = Arc::clone(&tls);
        async move {
            let bad = || {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{uri}: no host and port"),
                )
            };
            let host = uri.host().ok_or_else(bad)?;
            let port = uri.port_u16().ok_or_else(bad)?;
            let addr = format!("{host}:{port}");
            let tcp = tokio::time::timeout(connect_timeout, tokio::net::TcpStream::connect(&addr))
                .await
                .map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::TimedOut, format!("connect {addr}"))
                })??;
            tcp.set_nodelay(true)?;
            let stream = tls.connect(tcp, &addr, Purpose::Grpc).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
        }
    });
    Ok(endpoint.connect_with_connector_lazy(connector))
}
