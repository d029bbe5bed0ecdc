//! The prefill phase: the grant goes to the prefill node, whose call runs
//! while the relay reads decode's stream. Its reply is only a status: the
//! first token and prefill's report reach the router through decode.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_faults::{Action, Point};
use kvmesh_proto::internal::v1::{AbortRequest, Granted, PrefillRequest};
use tracing::Instrument;

use super::{reservation, with_faults, Route};
use crate::nodes::Node;

/// Abort reason code sent to prefill when the client is gone (kvxfer's
/// `AbortReason::CLIENT_GONE`).
const CLIENT_GONE: u32 = 1;

/// The prefill call in flight, and the guard that stops prefill's work if
/// the request ends before that work is over.
pub(super) struct Prefilling {
    /// The call; it answers once transfer-done is sent, or why not.
    pub call: Pin<Box<dyn Future<Output = Result<(), tonic::Status>> + Send>>,
    /// Set once the call answered: it is not polled again.
    pub answered: bool,
    /// Disarmed once prefill's work is over (its call answered, or decode
    /// verified the transfer).
    pub guard: AbortOnDrop,
}

impl Route<'_> {
    /// Hands the grant to the prefill node (with the injected grant
    /// faults). The call starts when the relay first polls it.
    pub(super) async fn prefill(&self, grant: Granted) -> Prefilling {
        let Granted {
            grant: mut bytes,
            reservation_id,
        } = grant;
        match self.job.faults.at(Point::Grant) {
            Some(Action::Delay(d)) => tokio::time::sleep(d).await,
            Some(Action::Corrupt) => {
                let mid = bytes.len() / 2;
                if let Some(b) = bytes.get_mut(mid) {
                    *b ^= 0x40;
                }
            }
            Some(Action::Duplicate) => {
                // A second copy of the grant reaches the same prefill node
                // just after the first: it must be refused (one writer per
                // grant) and change nothing.
                let copy = self.prefill_request(bytes.clone());
                let (node, faults) = (Arc::clone(self.prefill), self.job.faults.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let r = node.prefill().prefill(with_faults(copy, &faults)).await;
                    tracing::debug!(refused = r.is_err(), "duplicate grant delivered");
                });
            }
            _ => {}
        }
        // Tells prefill to stop unless its work is over, however the
        // request ends.
        let guard = AbortOnDrop::new(Arc::clone(self.prefill), reservation_id);
        let request = with_faults(self.prefill_request(bytes), &self.job.faults);
        let node = Arc::clone(self.prefill);
        Prefilling {
            call: Box::pin(async move { node.prefill().prefill(request).await.map(|_| ()) }),
            answered: false,
            guard,
        }
    }

    /// What the prefill node is asked for, around the grant's bytes.
    fn prefill_request(&self, grant: Vec<u8>) -> PrefillRequest {
        PrefillRequest {
            prompt_ids: self.job.prompt_ids.clone(),
            grant,
            sampling: Some(self.job.sampling.clone()),
            cache_namespace: self.cache_namespace(),
            stop_token_ids: self.stop_token_ids.clone(),
            prompt_logprobs: self.job.prompt_logprobs,
        }
    }
}

/// Tells a prefill node to stop work for a reservation when dropped,
/// unless [`AbortOnDrop::disarm`]ed first (its work is over): the one
/// place the router aborts prefill, whichever way a request ends.
pub(super) struct AbortOnDrop {
    node: Arc<Node>,
    rid: Vec<u8>,
    armed: bool,
    /// The dispatch span, parent of the abort's.
    span: tracing::Span,
}

impl AbortOnDrop {
    fn new(node: Arc<Node>, rid: Vec<u8>) -> Self {
        Self {
            node,
            rid,
            armed: true,
            span: kvmesh_telemetry::current(),
        }
    }

    pub(super) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let node = Arc::clone(&self.node);
        let span = kvmesh_telemetry::span!(
            parent: &self.span,
            "router.abort",
            node = %node.name,
            reservation.id = reservation(&self.rid),
            reason = "client_gone"
        );
        let req = AbortRequest {
            reservation_id: std::mem::take(&mut self.rid),
            reason: CLIENT_GONE,
        };
        // Without waiting: a drop cannot await. Outside a runtime (the
        // process is ending) there is nothing to tell.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(
                async move {
                    if let Err(e) = node.prefill().abort(req).await {
                        tracing::debug!(node = %node.name, error = %e, "prefill abort");
                        kvmesh_telemetry::fail(&kvmesh_telemetry::current(), "node_error");
                    }
                }
                .instrument(span),
            );
        }
    }
}
