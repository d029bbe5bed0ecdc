//! The real [`Mesh`]: one request through the prefill and decode nodes
//! over gRPC. Pick a decode and a prefill node, open the decode node's
//! Generate stream (its first event is the grant, or a typed refusal),
//! prefill into the grant, then turn the streamed token ids into text
//! (incremental detokenization, stop strings) for the gateway.
//! Every way out of a request drops the decode stream, which aborts the
//! reservation at decode through the confirmation path, and the prefill
//! call's [`AbortOnDrop`] guard, which tells prefill to stop unless it
//! finished: no path sends an abort by hand.
//!
//! Failures keep the node's name and status in [`DispatchError`]; they
//! reach the logs when `crate::error` maps them, never a client.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_faults::{Action, FaultPlan, PlantedBug, Point};
use kvmesh_proto::internal::v1::{
    decode_event, AbortRequest, DecodeEvent, FinishReason, GenerateRequest, Granted, LoadReport,
    Logprobs, PrefillRequest, RefuseKind,
};
use kvmesh_tokenizer::{TextOut, TextTokenizer};
use tokio::sync::mpsc;
use tracing::Instrument;

use super::{Admitted, Event, Finish, Job, Mesh, PromptScore, PromptToken, TokenLogprob};
use crate::error::{DispatchError, Rejection};
use crate::metrics::Metrics;
use crate::nodes::{Node, Nodes, Prefix, Role};
use kvmesh_prefix::Namespace;

/// Abort reason code sent to decode when the client is gone (kvxfer's
/// `AbortReason::CLIENT_GONE`).
const CLIENT_GONE: u32 = 1;

/// How long a request retries a decode node that refuses because the
/// prefill node's KV connection to it is not up: the time a prefill node
/// takes to connect to a decode node that just registered (it connects as
/// soon as its own watch sees it, and retries every 500 ms).
const WRITER_CONNECT_WAIT: Duration = Duration::from_secs(2);

/// How long the end of an answer waits for prefill's reply, which is
/// already on its way (the transfer it answers for is done).
const PREFILL_REPLY_WAIT: Duration = Duration::from_secs(2);

/// The prefill and decode nodes behind the gateway. Cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct GrpcMesh {
    nodes: Nodes,
    tokenizer: Arc<TextTokenizer>,
    stop_ids: Arc<[u32]>,
    /// How long a request waits for decode pages (a full pool is
    /// transient) before the refusal reaches the client.
    queue_timeout: Duration,
    /// TTFT and inter-token latency are measured here, at the tokens.
    metrics: Arc<Metrics>,
    /// Requests carry their namespace to the nodes' prefix caches.
    prefix_cache: bool,
}

impl GrpcMesh {
    /// `nodes`, detokenizing with `tokenizer`, ending generation at
    /// `stop_ids` (unless a request ignores end-of-sequence).
    pub(crate) fn new(
        nodes: Nodes,
        tokenizer: Arc<TextTokenizer>,
        stop_ids: Arc<[u32]>,
        queue_timeout: Duration,
        metrics: Arc<Metrics>,
        prefix_cache: bool,
    ) -> Self {
        Self {
            nodes,
            tokenizer,
            stop_ids,
            queue_timeout,
            metrics,
            prefix_cache,
        }
    }
}

impl Mesh for GrpcMesh {
    fn capacity(&self) -> Option<usize> {
        self.nodes.capacity()
    }

    /// Refused before anything is allocated when no node can take it.
    fn generate(&self, req: Admitted) -> Result<mpsc::Receiver<Event>, Rejection> {
        let (job, slot) = req.into_parts();
        let total = job.prompt_ids.len() + job.max_tokens;
        let span = kvmesh_telemetry::span!(
            parent: &job.trace,
            "router.dispatch",
            prompt_tokens = job.prompt_ids.len() as u64,
            max_tokens = job.max_tokens as u64
        );
        let ns = self.namespace(&job);
        let prefix = ns.as_ref().map(|ns| Prefix {
            ns,
            prompt: &job.prompt_ids,
        });
        let choice = kvmesh_telemetry::span!(parent: &span, "router.node_choice", role = "prefill");
        let picked = choice.in_scope(|| {
            // Fail fast with no node; the node itself is chosen again per
            // try, among those computing like the prefill node.
            let decodes = self.nodes.numerics(Role::Decode, needed(total));
            if decodes.is_empty() {
                return Err(Rejection::NoHealthyNode { role: "decode" });
            }
            let near = job.placement.as_ref().and_then(|p| p.get());
            // A prompt to be scored is computed whole (prefill skips its cache
            // for it), so where its pages are cached does not matter: the
            // prefill node is chosen by load alone (or the first sample's).
            let prefill_prefix = prefix.as_ref().filter(|_| job.prompt_logprobs.is_none());
            self.nodes.pick_near(
                Role::Prefill,
                needed(job.prompt_ids.len()),
                prefill_prefix,
                near.map(|(prefill, _)| prefill),
                Some(&decodes),
            )
        });
        let (prefill, p_report) = match picked {
            Ok(p) => p,
            Err(e) => {
                kvmesh_telemetry::fail(&choice, e.reason());
                kvmesh_telemetry::fail(&span, e.reason());
                return Err(e);
            }
        };
        kvmesh_telemetry::record(&choice, "node", prefill.name.clone());
        kvmesh_telemetry::record(&span, "prefill.node", prefill.name.clone());
        drop(choice);
        let busy = prefill.busy();
        let (tx, rx) = mpsc::channel(64);
        let mesh = self.clone();
        tokio::spawn(
            async move {
                let _slot = slot;
                let _busy = busy;
                run(&mesh, job, ns, &prefill, p_report, &tx, Instant::now()).await;
            }
            .instrument(span),
        );
        Ok(rx)
    }

    fn render_metrics(&self, out: &mut String) {
        crate::metrics::render_nodes(&self.nodes, out);
        crate::membership::render(&self.nodes, out);
    }

    fn discovery(&self) -> tokio::sync::watch::Receiver<crate::membership::Discovery> {
        self.nodes.discovery_changes()
    }
}

/// `msg` as a gRPC request carrying `faults` in its metadata.
fn with_faults<T>(msg: T, faults: &FaultPlan) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if !faults.is_empty() {
        if let Ok(v) = faults.to_string().parse() {
            req.metadata_mut().insert(kvmesh_faults::HEADER, v);
        }
    }
    req
}

impl GrpcMesh {
    /// The request's namespace, `None` with the prefix cache off. Rule 1
    /// of design/prefix-cache.md: it comes from the authenticated tenant,
    /// narrowed by the client's salt, derived here and nowhere downstream.
    fn namespace(&self, job: &Job) -> Option<Namespace> {
        self.prefix_cache.then(|| {
            self.nodes
                .cache_keys()
                .namespace(&job.tenant.0, job.cache_salt.as_deref())
        })
    }
}

/// Capacity the node must have: none asked when a test planted the bug
/// that switches admission off (the nodes' re-checks must then refuse).
fn needed(tokens: usize) -> Option<usize> {
    (!kvmesh_faults::planted(PlantedBug::NoAdmission)).then_some(tokens)
}

/// Runs one request to its end; every failure is sent as the terminal
/// [`Event::Error`], and a client that leaves ends it silently (the
/// gateway counts that).
async fn run(
    r: &GrpcMesh,
    job: Job,
    ns: Option<Namespace>,
    prefill: &Arc<Node>,
    p_report: LoadReport,
    tx: &mpsc::Sender<Event>,
    started: Instant,
) {
    let node_err = |role, node: &Arc<Node>, status: tonic::Status| {
        if matches!(
            status.code(),
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
        ) {
            node.mark_down();
        }
        DispatchError::Node {
            role,
            node: node.name.clone(),
            status,
        }
    };
    // The dispatch span's outcome: a finish reason, an error kind, or
    // `client_gone` when the request ends with neither.
    let outcome = Outcome::new(kvmesh_telemetry::current());
    let outcome = &outcome;
    let fail = |e: DispatchError| async move {
        outcome.fail(e.kind());
        let _ = tx.send(Event::Error(e)).await;
    };
    let cache_namespace = ns.map(|ns| ns.as_bytes().to_vec()).unwrap_or_default();
    let prefix = ns.as_ref().map(|ns| Prefix {
        ns,
        prompt: &job.prompt_ids,
    });
    let sampling = job.sampling.clone();
    let wants_logprobs = sampling.logprobs.is_some();
    // The request's own stop ids, and end-of-sequence unless ignored.
    let mut stop_token_ids = job.stop_token_ids.clone();
    if !job.ignore_eos {
        stop_token_ids.extend(
            r.stop_ids
                .iter()
                .filter(|id| !job.stop_token_ids.contains(id)),
        );
    }
    let generate = GenerateRequest {
        prompt_ids: job.prompt_ids.clone(),
        max_new_tokens: job.max_tokens as u32,
        writer_id: p_report.writer_id.clone(),
        tenant: job.tenant.0.clone(),
        sampling: Some(sampling.clone()),
        stop_token_ids: stop_token_ids.clone(),
        cache_namespace: cache_namespace.clone(),
    };
    // Reserve at the decode node with the most free pages. A full pool is
    // transient: wait (bounded by the queue timeout, with backoff, giving
    // up at once if the client leaves) and choose again, rather than fail.
    let total = job.prompt_ids.len() + job.max_tokens;
    let deadline = started + r.queue_timeout;
    let mut backoff = Duration::from_millis(2);
    // An injected `reserve=duplicate`: a first Generate whose answer is
    // lost; held unread to the end of the request, so its reservation ends
    // by lease (or by the drop at the end).
    let mut _lost = None;
    let (_busy, decode, mut stream, granted) = loop {
        let near = job.placement.as_ref().and_then(|p| p.get());
        let choice = kvmesh_telemetry::span!("router.node_choice", role = "decode");
        let decode = match choice.in_scope(|| {
            r.nodes.pick_near(
                Role::Decode,
                needed(total),
                prefix.as_ref(),
                near.map(|(_, decode)| decode),
                Some(std::slice::from_ref(&p_report.cpu_numerics)),
            )
        }) {
            Ok((n, _)) => n,
            Err(e) => {
                kvmesh_telemetry::fail(&choice, e.reason());
                return fail(DispatchError::NoHealthyNode { role: Role::Decode }).await;
            }
        };
        kvmesh_telemetry::record(&choice, "node", decode.name.clone());
        drop(choice);
        // The wait for the grant (or a refusal); the Generate call itself
        // is made under the dispatch span, whose child the decode node's
        // stream is.
        let reserve = kvmesh_telemetry::span!("router.reserve", node = %decode.name);
        match job.faults.at(Point::Reserve) {
            Some(Action::Drop) => {
                return fail(DispatchError::Injected("the reserve request was lost")).await
            }
            Some(Action::Delay(d)) => tokio::time::sleep(d).await,
            Some(Action::Duplicate) if _lost.is_none() => {
                _lost = decode
                    .decode()
                    .generate(with_faults(generate.clone(), &job.faults))
                    .await
                    .ok();
            }
            _ => {}
        }
        let mut stream = match decode
            .decode()
            .generate(with_faults(generate.clone(), &job.faults))
            .await
        {
            Ok(s) => s.into_inner(),
            Err(s) => {
                kvmesh_telemetry::fail(&reserve, "node_error");
                return fail(node_err(Role::Decode, &decode, s)).await;
            }
        };
        let first = tokio::select! {
            ev = stream.message() => ev,
            () = tx.closed() => return,
        };
        match first {
            Ok(Some(DecodeEvent {
                event: Some(decode_event::Event::Granted(g)),
            })) => {
                kvmesh_telemetry::record(
                    &reserve,
                    "reservation.id",
                    reservation(&g.reservation_id),
                );
                break (decode.busy(), decode, stream, g);
            }
            Ok(Some(DecodeEvent {
                event: Some(decode_event::Event::Refused(refused)),
            })) => {
                let kind = refused.kind();
                kvmesh_telemetry::fail(&reserve, kind.as_str_name());
                if kind == RefuseKind::Draining {
                    // It was told to stop before our poll saw it: out of
                    // the choice from now on; another node may take this.
                    decode.mark_down();
                    continue;
                }
                // A decode node that just joined may be chosen a moment
                // before the prefill node's KV connection to it is up (both
                // learn of it at once): also transient, for a short while.
                let transient = match kind {
                    RefuseKind::Exhausted => Instant::now() < deadline,
                    RefuseKind::WriterNotConnected => {
                        Instant::now() < deadline.min(started + WRITER_CONNECT_WAIT)
                    }
                    _ => false,
                };
                if transient {
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => {}
                        () = tx.closed() => return,
                    }
                    backoff = (backoff * 2).min(Duration::from_millis(50));
                    continue;
                }
                return fail(DispatchError::Refused {
                    node: decode.name.clone(),
                    kind,
                    message: refused.message,
                })
                .await;
            }
            Ok(_) => {
                let status = tonic::Status::internal("Generate did not start with a grant");
                return fail(node_err(Role::Decode, &decode, status)).await;
            }
            Err(s) => return fail(node_err(Role::Decode, &decode, s)).await,
        }
    };
    let decode = &decode;
    if !outcome.span.is_disabled() {
        kvmesh_telemetry::record(&outcome.span, "decode.node", decode.name.clone());
        kvmesh_telemetry::record(
            &outcome.span,
            "reservation.id",
            reservation(&granted.reservation_id),
        );
    }
    if let Some(p) = &job.placement {
        p.set(&prefill.name, &decode.name);
    }
    let Granted {
        grant: mut grant_bytes,
        reservation_id: rid,
        cached_tokens: _,
    } = granted;
    match job.faults.at(Point::Grant) {
        Some(Action::Delay(d)) => tokio::time::sleep(d).await,
        Some(Action::Corrupt) => {
            let mid = grant_bytes.len() / 2;
            if let Some(b) = grant_bytes.get_mut(mid) {
                *b ^= 0x40;
            }
        }
        Some(Action::Duplicate) => {
            // A second copy of the grant reaches the same prefill node
            // just after the first: it must be refused (one writer per
            // grant) and change nothing.
            let copy = PrefillRequest {
                prompt_ids: job.prompt_ids.clone(),
                grant: grant_bytes.clone(),
                sampling: Some(sampling.clone()),
                cache_namespace: cache_namespace.clone(),
                stop_token_ids: stop_token_ids.clone(),
                prompt_logprobs: job.prompt_logprobs,
            };
            let (node, faults) = (Arc::clone(prefill), job.faults.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                let r = node.prefill().prefill(with_faults(copy, &faults)).await;
                tracing::debug!(refused = r.is_err(), "duplicate grant delivered");
            });
        }
        _ => {}
    }
    let mut p = prefill.prefill();
    // Tells prefill to stop unless the call finished, however this
    // function returns.
    let mut prefill_guard = AbortOnDrop::new(Arc::clone(prefill), rid);
    let prefill_call = p.prefill(with_faults(
        PrefillRequest {
            prompt_ids: job.prompt_ids.clone(),
            grant: grant_bytes,
            sampling: Some(sampling),
            cache_namespace,
            stop_token_ids,
            prompt_logprobs: job.prompt_logprobs,
        },
        &job.faults,
    ));
    tokio::pin!(prefill_call);
    let mut prefill_done = false;
    // Prompt tokens prefill took from its prefix cache (its reply says).
    let mut prefill_cached = 0usize;
    // The first token's logprobs, from prefill's reply.
    let mut first_logprobs = None;
    // The prompt's scores, from prefill's reply (when asked), and whether
    // they went out: `Event::Prompt` comes before any other event.
    let mut prompt_scores = None;
    let mut prompt_sent = job.prompt_logprobs.is_none();
    // The answer can outrun prefill's reply (one token, an early stop):
    // before the end is reported, or the first token's logprobs are
    // needed, the reply is awaited (briefly; the transfer it answers for
    // is done) for its cached count and logprobs.
    macro_rules! settle_prefill {
        () => {
            // At the end of a request the flags are read no more.
            #[allow(unused_assignments)]
            if !prefill_done {
                if let Ok(Ok(resp)) =
                    tokio::time::timeout(PREFILL_REPLY_WAIT, &mut prefill_call).await
                {
                    prefill_done = true;
                    prefill_cached = resp.get_ref().cached_tokens as usize;
                    let resp = resp.into_inner();
                    first_logprobs = resp.first_logprobs;
                    prompt_scores = Some(resp.prompt_logprobs);
                    prefill_guard.disarm();
                }
            }
        };
    }
    // Sends `Event::Prompt` once, before the first text or the end: the
    // reply is awaited for it if the token stream overtook it.
    macro_rules! send_prompt {
        () => {
            // At the end of a request the flag is read no more.
            #[allow(unused_assignments)]
            if !prompt_sent {
                settle_prefill!();
                prompt_sent = true;
                match prompt_event(&job.prompt_ids, prompt_scores.take()) {
                    Ok(ev) => {
                        if tx.send(ev).await.is_err() {
                            return;
                        }
                    }
                    Err(status) => return fail(node_err(Role::Prefill, prefill, status)).await,
                }
            }
        };
    }
    let mut text = TextOut::new(&r.tokenizer, &job.stop)
        .min_tokens(job.sampling.min_tokens as usize)
        .keep(&job.keep_special);
    let mut completion = 0usize;
    let mut last = None::<Instant>;
    // Every return below drops `stream` (decode aborts the reservation or
    // drops the sequence) and `prefill_guard`.
    loop {
        tokio::select! {
            res = &mut prefill_call, if !prefill_done => {
                prefill_done = true;
                prefill_guard.disarm();
                // Another copy of this grant is being written (a duplicated
                // delivery): that writer's transfer is what decode verifies;
                // the token stream tells how it ends.
                let duplicate = matches!(&res, Err(s) if s.code() == tonic::Code::AlreadyExists);
                if let Ok(resp) = &res {
                    prefill_cached = resp.get_ref().cached_tokens as usize;
                    first_logprobs = resp.get_ref().first_logprobs.clone();
                    prompt_scores = Some(resp.get_ref().prompt_logprobs.clone());
                }
                if let (Err(s), false) = (res, duplicate) {
                    if kvmesh_proto::serve::is_draining(&s) {
                        // Told to stop before our poll saw it: out of the
                        // choice; the client may retry (503).
                        prefill.mark_down();
                        return fail(DispatchError::NoHealthyNode { role: Role::Prefill }).await;
                    }
                    return fail(node_err(Role::Prefill, prefill, s)).await;
                }
                if !duplicate {
                    send_prompt!();
                }
            }
            () = tx.closed() => return,
            ev = stream.message() => {
                let ev = match ev {
                    Ok(Some(e)) => e,
                    Ok(None) => return fail(DispatchError::Node { role: Role::Decode, node: decode.name.clone(), status: tonic::Status::internal("token stream ended without a finish") }).await,
                    Err(s) => return fail(node_err(Role::Decode, decode, s)).await,
                };
                match ev.event {
                    Some(decode_event::Event::Token(t)) => {
                        send_prompt!();
                        let logprobs = if !wants_logprobs {
                            Vec::new()
                        } else {
                            let lp = if completion == 0 {
                                settle_prefill!();
                                first_logprobs.take()
                            } else {
                                t.logprobs
                            };
                            match lp {
                                Some(lp) => vec![token_logprob(t.id, lp)],
                                None => {
                                    let status = tonic::Status::internal("a token without the logprobs the request asked for");
                                    let (role, node) = if completion == 0 { (Role::Prefill, prefill) } else { (Role::Decode, decode) };
                                    return fail(node_err(role, node, status)).await;
                                }
                            }
                        };
                        let t = t.id;
                        let now = Instant::now();
                        match last {
                            None => r.metrics.ttft(now - started),
                            Some(prev) => r.metrics.itl(now - prev),
                        }
                        last = Some(now);
                        completion += 1;
                        match text.push(t).map_err(|e| DispatchError::Tokenizer(e.to_string())) {
                            Ok((piece, hit_stop)) => {
                                if (!piece.is_empty() || !logprobs.is_empty()) && tx.send(Event::Text { text: piece, logprobs }).await.is_err() {
                                    return;
                                }
                                if hit_stop {
                                    // Ends the stream: the decode node drops the sequence.
                                    drop(stream);
                                    settle_prefill!();
                                    outcome.finish(Finish::Stop, completion);
                                    let _ = tx.send(Event::Done { finish: Finish::Stop, completion_tokens: completion, cached_tokens: prefill_cached }).await;
                                    return;
                                }
                            }
                            Err(e) => return fail(e).await,
                        }
                    }
                    Some(decode_event::Event::Finished(f)) => {
                        send_prompt!();
                        match text.finish().map_err(|e| DispatchError::Tokenizer(e.to_string())) {
                            Ok(piece) if !piece.is_empty() => { let _ = tx.send(Event::Text { text: piece, logprobs: Vec::new() }).await; }
                            Ok(_) => {}
                            Err(e) => return fail(e).await,
                        }
                        let finish = match f.reason() {
                            FinishReason::Length => Finish::Length,
                            FinishReason::Stop | FinishReason::Unspecified => Finish::Stop,
                        };
                        settle_prefill!();
                        outcome.finish(finish, completion);
                        let _ = tx.send(Event::Done { finish, completion_tokens: completion, cached_tokens: prefill_cached }).await;
                        return;
                    }
                    Some(decode_event::Event::Granted(_) | decode_event::Event::Refused(_)) | None => {
                        let status = tonic::Status::internal("a grant or refusal after the grant");
                        return fail(node_err(Role::Decode, decode, status)).await;
                    }
                }
            }
        }
    }
}

/// Prefill's prompt scores (entry `i` for token `i + 1`) with the prompt's
/// tokens as one [`Event::Prompt`]; a reply without them, or with another
/// count, is the node's fault.
fn prompt_event(
    prompt: &[u32],
    scores: Option<Vec<kvmesh_proto::internal::v1::PromptLogprob>>,
) -> Result<Event, tonic::Status> {
    let scores = scores.unwrap_or_default();
    if scores.len() + 1 != prompt.len() {
        return Err(tonic::Status::internal(format!(
            "{} prompt scores for a prompt of {} tokens",
            scores.len(),
            prompt.len()
        )));
    }
    let rest = prompt[1..].iter().zip(scores).map(|(&id, s)| PromptToken {
        id,
        score: Some(PromptScore {
            logprob: s.logprob,
            rank: s.rank,
            top: s.top_ids.into_iter().zip(s.top_logprobs).collect(),
        }),
    });
    let first = PromptToken {
        id: prompt[0],
        score: None,
    };
    Ok(Event::Prompt(std::iter::once(first).chain(rest).collect()))
}

/// A node's report of a token's logprobs as the gateway's.
fn token_logprob(id: u32, lp: Logprobs) -> TokenLogprob {
    TokenLogprob {
        id,
        logprob: lp.logprob,
        top: lp.top_ids.into_iter().zip(lp.top_logprobs).collect(),
    }
}

/// Tells a prefill node to stop work for a reservation when dropped,
/// unless [`AbortOnDrop::disarm`]ed first (the call finished): the one
/// place the router aborts prefill, whichever way a request ends.
struct AbortOnDrop {
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

    fn disarm(&mut self) {
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

/// A reservation id (16 bytes on the wire) as its hex form, the one
/// attribute that names it in traces and logs; `invalid` for anything else.
fn reservation(bytes: &[u8]) -> String {
    <[u8; 16]>::try_from(bytes)
        .ok()
        .and_then(kvmesh_kvwire::ReservationId::from_bytes)
        .map_or_else(|| "invalid".to_owned(), |id| id.to_string())
}

/// The outcome attribute of a request's dispatch span: a finish reason or
/// an error kind, or `client_gone` if the request ends with neither (the
/// gateway dropped it: its client left).
struct Outcome {
    span: tracing::Span,
    set: std::sync::atomic::AtomicBool,
}

impl Outcome {
    fn new(span: tracing::Span) -> Self {
        Self {
            span,
            set: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn finish(&self, finish: Finish, completion_tokens: usize) {
        self.set.store(true, std::sync::atomic::Ordering::Relaxed);
        kvmesh_telemetry::record(&self.span, "outcome", finish.as_str());
        kvmesh_telemetry::record(&self.span, "completion_tokens", completion_tokens as i64);
    }

    fn fail(&self, kind: &'static str) {
        self.set.store(true, std::sync::atomic::Ordering::Relaxed);
        kvmesh_telemetry::record(&self.span, "outcome", kind);
        kvmesh_telemetry::fail(&self.span, kind);
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        if !self.set.load(std::sync::atomic::Ordering::Relaxed) {
            kvmesh_telemetry::record(&self.span, "outcome", "client_gone");
        }
    }
}
