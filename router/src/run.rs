//! The gateway's lifecycle: serve the HTTP gateway and the public gRPC API
//! until told to stop, then drain.
//!
//! The drain, in order:
//! 1. admission refuses (`503 shutting_down`), new requests and those
//!    waiting for a slot alike, `/health` answers 503 and
//!    the gRPC health service `NOT_SERVING`; both servers stop accepting
//!    connections (requests already in flight go on);
//! 2. requests in flight finish, for at most the drain timeout;
//! 3. at the deadline, what is left ends with a terminal error event
//!    (`shutting_down`) and its decode stream and prefill call are dropped,
//!    which abort through the confirmation path at the nodes;
//! 4. the servers end once their responses are written.

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;

use crate::Router;

/// How often [`settle`] looks.
const SETTLE_POLL: Duration = Duration::from_millis(10);

/// How long requests cut at the deadline, and the servers, may take to end.
const GRACE: Duration = Duration::from_secs(5);

/// The gateway's two listeners.
#[derive(Debug)]
pub struct Listeners {
    /// The OpenAI-compatible HTTP gateway.
    pub http: TcpListener,
    /// The public gRPC API.
    pub grpc: TcpListener,
}

impl Listeners {
    /// Binds both.
    pub async fn bind(http: &str, grpc: &str) -> std::io::Result<Self> {
        Ok(Self {
            http: TcpListener::bind(http).await?,
            grpc: TcpListener::bind(grpc).await?,
        })
    }

    /// Their addresses (HTTP, gRPC).
    pub fn addrs(&self) -> std::io::Result<(SocketAddr, SocketAddr)> {
        Ok((self.http.local_addr()?, self.grpc.local_addr()?))
    }
}

/// Serves `router` on `listeners` until `shutdown` resolves, then drains
/// (see the module docs). The caller keeps the mesh's view fresh (the
/// nodes' load poller, `nodes::Nodes::spawn_poller`) while this runs.
pub async fn run<F>(router: Router, listeners: Listeners, shutdown: F) -> std::io::Result<()>
where
    F: Future<Output = ()>,
{
    // The structured-output vocabulary (a token trie, a few hundred ms for
    // a large vocabulary) is built off the async workers now, so the first
    // constrained request does not wait for it.
    let warm = router.clone();
    tokio::task::spawn_blocking(move || warm.vocabulary().is_ok());
    if let Some(warning) = router.config().api_keys.shared_namespace_warning() {
        tracing::warn!("{warning}");
    }
    let draining = router.draining.subscribe();
    let stop = move || {
        let mut d = draining.clone();
        async move {
            let _ = d.wait_for(|d| *d).await;
        }
    };
    let grpc = tokio::spawn(
        crate::grpc::service(router.clone()).serve_with_incoming_shutdown(
            TcpIncoming::from(listeners.grpc).with_nodelay(Some(true)),
            stop(),
        ),
    );
    // Tokens are small writes: without TCP_NODELAY the first one waits for
    // the client's delayed ACK (about 40 ms of TTFT).
    let http_listener = listeners.http.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let app = router.http();
    let http_stop = stop();
    let http = tokio::spawn(async move {
        axum::serve(http_listener, app)
            .with_graceful_shutdown(http_stop)
            .await
    });
    shutdown.await;
    router.start_drain();
    tracing::info!(in_flight = router.in_flight(), "router draining");
    let deadline = Instant::now() + router.config().drain_timeout;
    if !settle(deadline, || router.in_flight() == 0).await {
        tracing::warn!(
            in_flight = router.in_flight(),
            "drain deadline: ending the requests left"
        );
        router.cut.send_replace(true);
        settle(Instant::now() + GRACE, || router.in_flight() == 0).await;
    }
    let ended = tokio::time::timeout(GRACE, async {
        let h = http.await;
        let g = grpc.await;
        (h, g)
    })
    .await;
    match ended {
        Ok((Ok(Err(e)), _)) => Err(e),
        Ok((_, Ok(Err(e)))) => Err(std::io::Error::other(e)),
        Ok(_) => Ok(()),
        Err(_) => {
            tracing::warn!("router servers did not end within their grace");
            Ok(())
        }
    }
}

/// Waits until `done()` holds or `deadline` passes; whether it held. (The
/// nodes' drain has the same helper in `kvmesh_node::serve`, which the
/// router does not link: that crate links the model runtime.)
async fn settle(deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
    loop {
        if done() {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        tokio::time::sleep(SETTLE_POLL.min(deadline - now)).await;
    }
}

#[cfg(test)]
mod tests;
