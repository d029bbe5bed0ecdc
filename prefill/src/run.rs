//! The prefill node's lifecycle: serve until told to stop, then drain
//! (see the crate docs).

use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvmesh_proto::serve::{serve, settle, Drained};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::{PrefillError, PrefillNode};

/// How long stopped calls may take to return, and the server to end.
const GRACE: Duration = Duration::from_secs(5);

/// Serves `node` on `listener` until `shutdown` resolves, then drains it
/// and returns what the drain found (its own pool: every page a prompt
/// was computed in is back).
pub async fn run<F>(
    node: PrefillNode,
    listener: TcpListener,
    shutdown: F,
) -> Result<Drained, PrefillError>
where
    F: Future<Output = ()>,
{
    let (stop, stopped) = oneshot::channel::<()>();
    let mut server = serve(
        tonic::service::Routes::new(node.service()),
        listener,
        async {
            let _ = stopped.await;
        },
    );
    tokio::select! {
        () = shutdown => {}
        r = &mut server => {
            node.join_compute().await?;
            return match r {
                Ok(Err(e)) => Err(PrefillError::Serve(e)),
                _ => Err(PrefillError::Invalid("the prefill gRPC server ended".into())),
            };
        }
    }
    let inner = &node.inner;
    inner.draining.store(true, Ordering::Release);
    let open = || inner.open.load(Ordering::Acquire);
    tracing::info!(open = open(), "prefill node draining");
    let mut cut = 0;
    if !settle(Instant::now() + inner.drain_timeout, || open() == 0).await {
        cut = open();
        tracing::warn!(cut, "drain deadline: stopping the prompts left");
        inner.cut.send_replace(true);
        settle(Instant::now() + GRACE, || open() == 0).await;
    }
    let _ = stop.send(());
    match tokio::time::timeout(GRACE, server).await {
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "prefill gRPC server"),
        Ok(_) => {}
        Err(_) => tracing::warn!("prefill gRPC server did not end within its grace"),
    }
    node.join_compute().await?;
    let pool = node.pool().stats();
    Ok(Drained {
        cut,
        reservations_open: 0,
        pages_in_use: pool.capacity_pages - pool.free_pages,
        pages_total: pool.capacity_pages,
    })
}
