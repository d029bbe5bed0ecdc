//! The decode node's lifecycle: serve until told to stop, then drain.
//!
//! The drain, in order:
//! 1. the node is marked draining: Generate answers
//!    `RefuseKind::Draining` and the load report says `draining`, so the
//!    router stops choosing it (within one load poll);
//! 2. every stream already granted runs on, to its end, for at most the
//!    drain timeout;
//! 3. at the deadline, what is left is cut: transfers still awaited are
//!    given up (the reservation aborts through the confirmation path,
//!    bounded by the abort timeout: confirmed, or revoked) and running
//!    sequences end with a terminal `UNAVAILABLE` their router passes on
//!    to its client as an error event;
//! 4. once the reservation table is empty the gRPC server stops (no stream
//!    is cut by the transport) and the batcher thread is joined;
//! 5. the pool is counted: [`Drained::pages_in_use`] is zero unless a page
//!    leaked.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_node::serve::{settle, Drained, Serving};
use tokio::net::TcpListener;

use crate::{DecodeNode, NodeError};

/// How long the server may take to end once nothing is in flight.
const SERVER_GRACE: Duration = Duration::from_secs(5);

/// Serves `node` on `listener` until `shutdown` resolves, then drains it
/// (see the module docs) and returns what the drain found.
pub async fn run<F>(
    node: DecodeNode,
    listener: TcpListener,
    shutdown: F,
) -> Result<Drained, NodeError>
where
    F: Future<Output = ()>,
{
    let metrics = {
        let node = node.clone();
        std::sync::Arc::new(move || node.metrics_text())
    };
    let mut server = Serving::start(
        tonic::service::Routes::new(node.service()),
        listener,
        Some(metrics),
        node.inner().tls.clone(),
    );
    // The structured-output vocabulary (a token trie, a few hundred ms for
    // a large vocabulary) is built off the async workers now, so the first
    // constrained request does not wait for it.
    let engine = Arc::clone(&node.inner().engine);
    tokio::task::spawn_blocking(move || engine.vocabulary().is_ok());
    if let Err(e) = server.until(shutdown).await {
        // The server ended before any signal: it failed.
        node.join_batcher().await?;
        return Err(e.map_or_else(
            || NodeError::Config("the decode gRPC server ended".into()),
            NodeError::Serve,
        ));
    }
    let inner = node.inner();
    inner.draining.store(true, Ordering::Release);
    server.draining().await;
    let table = node.table();
    tracing::info!(
        open = inner.open.load(Ordering::Acquire),
        "decode node draining"
    );
    let deadline = Instant::now() + inner.drain_timeout;
    let open = || inner.open.load(Ordering::Acquire);
    let mut cut = 0;
    if !settle(deadline, || open() == 0).await {
        cut = open();
        tracing::warn!(cut, "drain deadline: ending the streams left");
        inner.cut.send_replace(true);
    }
    // Cut streams end within a step; their aborts within the abort
    // timeout (confirmed, or the path is revoked).
    let bound = Instant::now() + inner.abort_timeout + Duration::from_secs(2);
    settle(bound, || open() == 0 && table.stats().open == 0).await;
    server.stop(SERVER_GRACE, "decode").await;
    node.join_batcher().await?;
    // The cache's unleased pages are not in use: scrub them back to the
    // free list, so what is left counts only pages something still holds.
    let scrubbed = table.pool().clear_cache();
    tracing::info!(scrubbed, "prefix cache cleared");
    let pool = table.pool().stats();
    Ok(Drained {
        cut,
        reservations_open: table.stats().open,
        pages_in_use: pool.capacity_pages - pool.free_pages,
        pages_total: pool.capacity_pages,
    })
}
