//! How a node serves its gRPC service and drains: the one shape prefill
//! and decode share. (The draining refusal a node answers with is part of
//! the contract with the router: `kvmesh_proto::refusal`.)
//!
//! A node's `run` serves on a listener it is handed ([`serve`]), waits for
//! its shutdown signal, then drains: it refuses new work, waits for what it
//! holds to end ([`settle`], bounded by its drain timeout), ends the rest
//! through the handshake, and only then stops the server (so no stream in
//! flight is cut by the transport) and joins its compute thread.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_meshauth::tls::{MeshTls, Purpose};
use kvmesh_telemetry::metrics::CONTENT_TYPE;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::service::Routes;
use tonic::transport::server::TcpIncoming;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::metrics::Render;

/// How often [`settle`] looks.
const SETTLE_POLL: Duration = Duration::from_millis(10);

/// Serves `routes` on `listener` (TCP_NODELAY on every connection: a
/// streamed token is one small write, which Nagle's algorithm would hold
/// until the peer's delayed ACK, about 40 ms; HTTP/2 keep-alive pings, so a
/// peer that vanished from the network fails its streams) until `stop` resolves; then
/// stops accepting and ends once every call in flight has ended.
pub fn serve<F>(
    routes: Routes,
    listener: TcpListener,
    tls: Option<Arc<MeshTls>>,
    stop: F,
) -> JoinHandle<Result<(), tonic::transport::Error>>
where
    F: Future<Output = ()> + Send + 'static,
{
    // HTTP/1.1 for `/metrics` (a Prometheus scrape); gRPC stays HTTP/2,
    // and a gRPC path asked over HTTP/1.1 fails as gRPC.
    // Keep-alive pings from this end too: a router cut off by the network
    // would otherwise hold a decode stream (and its sequence's pages) until
    // TCP gave up.
    let server = tonic::transport::Server::builder()
        .accept_http1(true)
        .http2_keepalive_interval(Some(kvmesh_proto::peer::KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(kvmesh_proto::peer::KEEPALIVE_TIMEOUT))
        .add_routes(routes);
    match tls {
        None => {
            let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
            tokio::spawn(server.serve_with_incoming_shutdown(incoming, stop))
        }
        Some(tls) => {
            tokio::spawn(server.serve_with_incoming_shutdown(tls_incoming(listener, tls), stop))
        }
    }
}

/// How many accepted TLS connections may wait for the server at once.
const TLS_BACKLOG: usize = 64;

/// The connections `listener` accepts whose mutual-TLS handshake
/// succeeds (each made on its own task, bounded by the handshake timeout,
/// so a slow or hostile peer holds up no one; a refused one is counted by
/// `tls` and dropped). Ends when the server stops taking them.
fn tls_incoming(
    listener: TcpListener,
    tls: Arc<MeshTls>,
) -> tokio_stream::wrappers::ReceiverStream<Result<TlsConn, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel(TLS_BACKLOG);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                r = listener.accept() => r,
                () = tx.closed() => return,
            };
            let Ok((tcp, _)) = accepted else {
                // A failed accept (out of descriptors): the next may work.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let (tx, tls) = (tx.clone(), Arc::clone(&tls));
            tokio::spawn(async move {
                if let Ok(s) = tls.accept(tcp, Purpose::Grpc).await {
                    let _ = tx.send(Ok(TlsConn(s))).await;
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// A connection inside mutual TLS, as the gRPC server takes it.
#[derive(Debug)]
pub struct TlsConn(tokio_rustls::server::TlsStream<tokio::net::TcpStream>);

impl tonic::transport::server::Connected for TlsConn {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.0.get_ref().0.connect_info()
    }
}

impl tokio::io::AsyncRead for TlsConn {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for TlsConn {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

/// What a drain found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Drained {
    /// Streams still open at the deadline, ended with an error.
    pub cut: usize,
    /// Reservations still in the table when the node stopped (decode).
    pub reservations_open: usize,
    /// Pool pages not free when the node stopped: zero unless one leaked.
    pub pages_in_use: usize,
    /// Pool pages in all.
    pub pages_total: usize,
}

impl Drained {
    /// Nothing left behind.
    pub fn is_clean(&self) -> bool {
        self.reservations_open == 0 && self.pages_in_use == 0
    }
}

impl std::fmt::Display for Drained {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} streams cut at the deadline, {} reservations open, {} of {} pages in use",
            self.cut, self.reservations_open, self.pages_in_use, self.pages_total
        )
    }
}

/// A node's gRPC server, serving until [`Serving::stop`].
#[derive(Debug)]
pub struct Serving {
    stop: oneshot::Sender<()>,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    health: HealthReporter,
}

impl Serving {
    /// Serves `routes` on `listener` ([`serve`]), with the standard gRPC
    /// health service (`grpc.health.v1`) beside them: the whole server
    /// (service `""`) is SERVING until [`Serving::draining`]. It is what
    /// an orchestrator's readiness probe asks (Kubernetes' `grpc` probe),
    /// so it answers without the mesh secret's proof; it tells nothing
    /// but that status. With `metrics`, `GET /metrics` on the same port
    /// answers the node's Prometheus text (HTTP/1.1, no proof either:
    /// counts and gauges, never a prompt, key or reservation id).
    /// With `tls`, every connection runs mutual TLS first (health and
    /// `/metrics` included: a probe or scrape then needs a certificate of
    /// the mesh's CA).
    pub fn start(
        routes: Routes,
        listener: TcpListener,
        metrics: Option<Render>,
        tls: Option<Arc<MeshTls>>,
    ) -> Self {
        let (health, health_service) = tonic_health::server::health_reporter();
        let (stop, stopped) = oneshot::channel::<()>();
        let mut routes = routes.add_service(health_service);
        if let Some(render) = metrics {
            let route = axum::routing::get(move || {
                let text = render();
                async move { ([(axum::http::header::CONTENT_TYPE, CONTENT_TYPE)], text) }
            });
            let router = std::mem::take(routes.axum_router_mut()).route("/metrics", route);
            *routes.axum_router_mut() = router;
        }
        let server = serve(routes, listener, tls, async {
            let _ = stopped.await;
        });
        Self {
            stop,
            server,
            health,
        }
    }

    /// A drain began: health says NOT_SERVING from now on, so a readiness
    /// probe takes the node out while its work in flight finishes.
    pub async fn draining(&self) {
        self.health
            .set_service_status("", ServingStatus::NotServing)
            .await;
    }

    /// Resolves when `shutdown` does; or, if the server ends first (it
    /// failed), with its error (`None`: it ended without one).
    pub async fn until<F: Future<Output = ()>>(
        &mut self,
        shutdown: F,
    ) -> Result<(), Option<tonic::transport::Error>> {
        tokio::select! {
            () = shutdown => Ok(()),
            r = &mut self.server => Err(r.ok().and_then(Result::err)),
        }
    }

    /// Stops accepting and waits, at most `grace`, for the calls in
    /// flight to end; what went wrong is logged as `what`'s.
    pub async fn stop(self, grace: Duration, what: &str) {
        let _ = self.stop.send(());
        match tokio::time::timeout(grace, self.server).await {
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "{what} gRPC server"),
            Ok(_) => {}
            Err(_) => tracing::warn!("{what} gRPC server did not end within its grace"),
        }
    }
}

/// A node's compute thread panicked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadPanicked;

/// Joins a node's compute thread (taken out of its slot, so a second call
/// has nothing to join) without blocking the runtime.
pub async fn join_thread(
    slot: &std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
) -> Result<(), ThreadPanicked> {
    let handle = slot
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    let Some(handle) = handle else {
        return Ok(());
    };
    tokio::task::spawn_blocking(move || handle.join())
        .await
        .map_err(|_| ThreadPanicked)?
        .map_err(|_| ThreadPanicked)
}

/// Resolves once `flag` is set (the drain deadline's cut), or at once if
/// its sender is gone.
pub async fn cut_set(flag: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = flag.wait_for(|set| *set).await;
}

/// Waits until `done()` holds or `deadline` passes; whether it held.
pub async fn settle(deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
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
mod tests {
    use super::*;

    #[tokio::test]
    async fn settle_reports_whether_the_condition_held_in_time() {
        let t0 = Instant::now();
        let mut n = 0;
        assert!(
            settle(t0 + Duration::from_secs(5), || {
                n += 1;
                n == 3
            })
            .await
        );
        assert_eq!(n, 3);
        assert!(!settle(Instant::now() + Duration::from_millis(30), || false).await);
    }

    #[tokio::test]
    async fn health_is_serving_without_a_proof_until_the_drain_begins() {
        use tonic_health::pb::health_check_response::ServingStatus as Status;
        use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let text = Arc::new(|| "kvmesh_up 1\n".to_owned());
        let server = Serving::start(Routes::default(), listener, Some(text), None);
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect");
        let mut client = HealthClient::new(channel);
        let ask = |mut c: HealthClient<_>| async move {
            c.check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .map(|r| r.into_inner().status())
        };
        assert_eq!(ask(client.clone()).await.expect("check"), Status::Serving);
        server.draining().await;
        assert_eq!(
            ask(client.clone()).await.expect("check"),
            Status::NotServing
        );
        // Nothing else is served here: an internal service is not found.
        let err = client
            .check(HealthCheckRequest {
                service: "kvmesh.internal.v1.Decode".into(),
            })
            .await
            .expect_err("unknown service");
        assert_eq!(err.code(), tonic::Code::NotFound);
        // `/metrics` over HTTP/1.1 on the same port, beside gRPC.
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut http = tokio::net::TcpStream::connect(addr).await.expect("connect");
        http.write_all(b"GET /metrics HTTP/1.1\r\nhost: node\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut answer = String::new();
        http.read_to_string(&mut answer).await.expect("read");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains(CONTENT_TYPE), "{answer}");
        assert!(answer.ends_with("\r\n\r\nkvmesh_up 1\n"), "{answer}");
        server.stop(Duration::from_secs(1), "test").await;
    }
}
