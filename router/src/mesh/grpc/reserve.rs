//! The reserve phase: a grant from a decode node. A full pool is transient
//! (waited out, bounded by the queue timeout, with backoff, given up at
//! once if the client leaves), and so, briefly, is a prefill writer not
//! yet connected to a decode node that just joined; a draining node is
//! left for another.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_faults::{Action, Point};
use kvmesh_proto::internal::v1::{
    decode_event, DecodeEvent, GenerateRequest, Granted, RefuseKind, Refused,
};
use tonic::Streaming;

use super::{needed, node_err, reservation, with_faults, ProtocolViolation, Route, Stop};
use crate::error::DispatchError;
use crate::nodes::{Busy, Node, Role};

/// How long a request retries a decode node that refuses because the
/// prefill node's KV connection to it is not up: the time a prefill node
/// takes to connect to a decode node that just registered (it connects as
/// soon as its own watch sees it, and retries every 500 ms).
const WRITER_CONNECT_WAIT: Duration = Duration::from_secs(2);

/// A grant, and the stream the rest of the request comes on.
pub(super) struct Reserved {
    pub decode: Arc<Node>,
    /// Dropping it aborts the reservation (or ends the sequence).
    pub stream: Streaming<DecodeEvent>,
    pub grant: Granted,
    /// The request, counted in the decode node's load.
    pub busy: Busy,
    /// An injected `reserve=duplicate`: a first Generate whose answer is
    /// lost, held unread to the end of the request, so its reservation
    /// ends by lease (or by the drop at the end).
    pub lost: Option<tonic::Response<Streaming<DecodeEvent>>>,
}

/// A decode node's first answer (the stream boxed: it is most of the
/// size, and a refusal needs none of it).
enum Answer {
    Granted(Box<Streaming<DecodeEvent>>, Granted),
    Refused(Refused),
}

impl Route<'_> {
    /// Reserves at the decode node with the most free pages (or the one
    /// the prompt's first sample ran on), choosing again after a
    /// transient refusal.
    pub(super) async fn reserve(&self) -> Result<Reserved, Stop> {
        let generate = self.generate_request();
        let deadline = self.started + self.mesh.queue_timeout;
        let mut backoff = Duration::from_millis(2);
        let mut lost = None;
        loop {
            let decode = self.pick_decode()?;
            // The wait for the grant (or a refusal); the Generate call
            // itself is made under the dispatch span, whose child the
            // decode node's stream is.
            let reserve = kvmesh_telemetry::span!("router.reserve", node = %decode.name);
            let refused = match self.ask(&decode, &generate, &reserve, &mut lost).await? {
                Answer::Granted(stream, grant) => {
                    let id = reservation(&grant.reservation_id);
                    kvmesh_telemetry::record(&reserve, "reservation.id", id);
                    return Ok(Reserved {
                        busy: decode.busy(),
                        decode,
                        stream: *stream,
                        grant,
                        lost,
                    });
                }
                Answer::Refused(refused) => refused,
            };
            let kind = refused.kind();
            kvmesh_telemetry::fail(&reserve, kind.as_str_name());
            if kind == RefuseKind::Draining {
                // It was told to stop before our poll saw it: out of the
                // choice from now on; another node may take this.
                decode.mark_down();
                continue;
            }
            // A decode node that just joined may be chosen a moment before
            // the prefill node's KV connection to it is up (both learn of
            // it at once): also transient, for a short while.
            let transient = match kind {
                RefuseKind::Exhausted => Instant::now() < deadline,
                RefuseKind::WriterNotConnected => {
                    Instant::now() < deadline.min(self.started + WRITER_CONNECT_WAIT)
                }
                _ => false,
            };
            if !transient {
                return Err(DispatchError::Refused {
                    node: decode.name.clone(),
                    kind,
                    message: refused.message,
                }
                .into());
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = self.tx.closed() => return Err(Stop::ClientGone),
            }
            backoff = (backoff * 2).min(Duration::from_millis(50));
        }
    }

    /// What the decode node is asked for.
    fn generate_request(&self) -> GenerateRequest {
        let job = self.job;
        GenerateRequest {
            prompt_ids: job.prompt_ids.clone(),
            max_new_tokens: job.max_tokens as u32,
            writer_id: self.p_report.writer_id.clone(),
            sampling: Some(job.sampling.clone()),
            stop_token_ids: self.stop_token_ids.clone(),
            cache_namespace: self.cache_namespace(),
        }
    }

    /// A decode node that fits the request and computes like the prefill
    /// node; its prefix cache and the prompt's first sample count.
    fn pick_decode(&self) -> Result<Arc<Node>, Stop> {
        let job = self.job;
        let near = job.placement.as_ref().and_then(|p| p.get());
        let choice = kvmesh_telemetry::span!("router.node_choice", role = "decode");
        let total = job.prompt_ids.len() + job.max_tokens;
        let picked = choice.in_scope(|| {
            self.mesh.nodes.pick_near(
                Role::Decode,
                needed(total),
                self.prefix().as_ref(),
                near.map(|(_, decode)| decode),
                Some(std::slice::from_ref(&self.p_report.cpu_numerics)),
            )
        });
        match picked {
            Ok((node, _)) => {
                kvmesh_telemetry::record(&choice, "node", node.name.clone());
                Ok(node)
            }
            Err(e) => {
                kvmesh_telemetry::fail(&choice, e.reason());
                Err(DispatchError::NoHealthyNode { role: Role::Decode }.into())
            }
        }
    }

    /// Opens `decode`'s Generate stream (with the injected reserve faults)
    /// and reads its first event.
    async fn ask(
        &self,
        decode: &Arc<Node>,
        generate: &GenerateRequest,
        reserve: &tracing::Span,
        lost: &mut Option<tonic::Response<Streaming<DecodeEvent>>>,
    ) -> Result<Answer, Stop> {
        let faults = &self.job.faults;
        let mut client = decode.decode();
        match faults.at(Point::Reserve) {
            Some(Action::Drop) => {
                return Err(DispatchError::Injected("the reserve request was lost").into())
            }
            Some(Action::Delay(d)) => tokio::time::sleep(d).await,
            Some(Action::Duplicate) if lost.is_none() => {
                let call = client.generate(with_faults(generate.clone(), faults));
                *lost = call.await.ok();
            }
            _ => {}
        }
        let call = client.generate(with_faults(generate.clone(), faults));
        let mut stream = match call.await {
            Ok(s) => s.into_inner(),
            Err(s) => {
                kvmesh_telemetry::fail(reserve, "node_error");
                return Err(node_err(Role::Decode, decode, s).into());
            }
        };
        let first = tokio::select! {
            ev = stream.message() => ev,
            () = self.tx.closed() => return Err(Stop::ClientGone),
        };
        match first.map(|ev| ev.and_then(|ev| ev.event)) {
            Ok(Some(decode_event::Event::Granted(g))) => Ok(Answer::Granted(Box::new(stream), g)),
            Ok(Some(decode_event::Event::Refused(r))) => Ok(Answer::Refused(r)),
            Ok(_) => Err(self.violation(ProtocolViolation::NoGrant, decode)),
            Err(s) => Err(node_err(Role::Decode, decode, s).into()),
        }
    }
}
