//! The prefill node's lifecycle: serve until told to stop, then drain
//! (see the crate docs).

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_node::serve::{settle, Drained, Serving};
use tokio::net::TcpListener;

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
    let metrics = {
        let node = node.clone();
        Arc::new(move || node.metrics_text())
    };
    let mut server = Serving::start(
        tonic::service::Routes::new(node.service()),
        listener,
        Some(metrics),
        node.inner.tls.clone(),
    );
    // The structured-output vocabulary (a token trie, a few hundred ms for
    // a large vocabulary) is built off the async workers now, so the first
    // constrained request does not wait for it.
    let engine = Arc::clone(&node.inner.engine);
    tokio::task::spawn_blocking(move || engine.vocabulary().is_ok());
    if let Err(e) = server.until(shutdown).await {
        // The server ended before any signal: it failed.
        node.join_compute().await?;
        return Err(e.map_or_else(
            || PrefillError::Invalid("the prefill gRPC server ended".into()),
            PrefillError::Serve,
        ));
    }
    let inner = &node.inner;
    inner.draining.store(true, Ordering::Release);
    server.draining().await;
    let open = || inner.open.load(Ordering::Acquire);
    tracing::info!(open = open(), "prefill node draining");
    let mut cut = 0;
    if !settle(Instant::now() + inner.drain_timeout, || open() == 0).await {
        cut = open();
        tracing::warn!(cut, "drain deadline: stopping the prompts left");
        inner.cut.send_replace(true);
        settle(Instant::now() + GRACE, || open() == 0).await;
    }
    server.stop(GRACE, "prefill").await;
    node.join_compute().await?;
    // The cache's unleased pages are not in use: scrub them back to the
    // free list, so what is left counts only pages something still holds.
    let scrubbed = node.pool().clear_cache();
    tracing::info!(scrubbed, "prefix cache cleared");
    let pool = node.pool().stats();
    Ok(Drained {
        cut,
        reservations_open: 0,
        pages_in_use: pool.capacity_pages - pool.free_pages,
        pages_total: pool.capacity_pages,
    })
}
