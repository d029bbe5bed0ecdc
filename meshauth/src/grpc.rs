//! Mesh authentication of the internal gRPC services, both ways: the tower
//! glue over [`crate::call`] (the token formats, the checks and why are
//! there).
//!
//! - Server side, [`Authenticated`]: wraps a generated server (Decode,
//!   Prefill). It reads the call's body (at most [`MAX_CALL_BODY`] bytes,
//!   within [`BODY_TIMEOUT`]; every internal call sends one message),
//!   answers any call without a valid `x-kvmesh-peer` proof for its method,
//!   this node's name and that body UNAUTHENTICATED before the service sees
//!   the request, and puts the node's `x-kvmesh-node` proof on the answer
//!   to every call it admitted; refusals are counted by kind in the shared
//!   [`CallVerifier`], which the node reports in its `LoadReport`.
//! - Client side, [`SignedChannel`]: a channel to one named node that signs
//!   every call (method, node name, body) and checks the node's proof in
//!   the answer's headers before any of the answer is used. An answer
//!   without it is dropped unread and turned into UNAUTHENTICATED with
//!   [`UNPROVEN_HEADER`] ([`is_unproven`]), counted by kind in the
//!   channel's [`UnprovenReplies`]. `kvmesh_proto::peer` builds the
//!   internal clients over it.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http_body_util::{BodyExt, Full, Limited};
use kvmesh_counters::KindCounters;
use tonic::body::Body;
use tonic::codegen::{http, BoxFuture, Bytes, Service, StdError};
use tonic::metadata::MetadataMap;
use tonic::server::NamedService;
use tonic::transport::Channel;
use tonic::Status;

use crate::call::{
    body_digest, check_reply, Call, ReplyRefusal, REPLY_HEADER, REPLY_REFUSAL_KINDS,
};
use crate::{sign_call, CallVerifier, MeshSecret, CALL_HEADER};

/// Most bytes of one call's body: tonic's default limit on a decoded
/// message (4 MiB) and the 5-byte gRPC frame header.
pub const MAX_CALL_BODY: usize = (4 << 20) + 5;
/// How long a call's body may take to arrive once its headers did.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// Metadata of the UNAUTHENTICATED status a [`SignedChannel`] answers in
/// place of a node's unproven answer; its value is the refusal's kind.
pub const UNPROVEN_HEADER: &str = "x-kvmesh-unproven";

/// Milliseconds since the Unix epoch by this host's clock (0 before it).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A gRPC server that serves only calls proving the mesh secret, and
/// proves it back on every answer.
#[derive(Clone, Debug)]
pub struct Authenticated<S> {
    inner: S,
    verifier: Arc<CallVerifier>,
}

impl<S> Authenticated<S> {
    /// `inner`, behind `verifier`'s checks.
    pub fn new(inner: S, verifier: Arc<CallVerifier>) -> Self {
        Self { inner, verifier }
    }
}

fn status_response(status: Status) -> BoxFuture<http::Response<Body>, Infallible> {
    Box::pin(async move { Ok(status.into_http()) })
}

impl<S> Service<http::Request<Body>> for Authenticated<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let token = req.headers().get(CALL_HEADER).map(|v| v.as_bytes());
        let pending = match self.verifier.admit_header(token, unix_ms()) {
            Ok(p) => p,
            Err(refusal) => return status_response(Status::unauthenticated(refusal.to_string())),
        };
        // The service that was polled ready serves this call; a clone
        // takes its place for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let verifier = Arc::clone(&self.verifier);
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let read =
                tokio::time::timeout(BODY_TIMEOUT, Limited::new(body, MAX_CALL_BODY).collect());
            let bytes = match read.await {
                Ok(Ok(collected)) => collected.to_bytes(),
                Ok(Err(e)) => {
                    return Ok(Status::invalid_argument(format!(
                        "call body unreadable or over {MAX_CALL_BODY} bytes: {e}"
                    ))
                    .into_http())
                }
                Err(_) => {
                    return Ok(Status::deadline_exceeded(format!(
                        "call body not received within {BODY_TIMEOUT:?}"
                    ))
                    .into_http())
                }
            };
            let admitted = match verifier.admit_body(
                pending,
                parts.uri.path(),
                &body_digest(&bytes),
                unix_ms(),
            ) {
                Ok(a) => a,
                Err(refusal) => return Ok(Status::unauthenticated(refusal.to_string()).into_http()),
            };
            let proof = http::HeaderValue::try_from(verifier.reply_proof(&admitted));
            let req = http::Request::from_parts(parts, Body::new(Full::new(bytes)));
            let mut resp = inner.call(req).await?;
            if let Ok(proof) = proof {
                resp.headers_mut().insert(REPLY_HEADER, proof);
            }
            Ok(resp)
        })
    }
}

impl<S: NamedService> NamedService for Authenticated<S> {
    const NAME: &'static str = S::NAME;
}

/// Answers of one node refused because they did not prove it, by kind
/// ([`REPLY_REFUSAL_KINDS`]).
#[derive(Debug, Default)]
pub struct UnprovenReplies(KindCounters<{ REPLY_REFUSAL_KINDS.len() }>);

impl UnprovenReplies {
    /// Refusals by kind, zeros included, in [`REPLY_REFUSAL_KINDS`] order.
    pub fn by_kind(&self) -> [(&'static str, u64); REPLY_REFUSAL_KINDS.len()] {
        self.0.by_kind(&REPLY_REFUSAL_KINDS)
    }

    /// Refusals in all.
    pub fn total(&self) -> u64 {
        self.0.total()
    }
}

/// Whether `status` is a [`SignedChannel`]'s refusal of an answer that did
/// not prove its node (not anything the node said).
pub fn is_unproven(status: &Status) -> bool {
    status.metadata().contains_key(UNPROVEN_HEADER)
}

/// A channel to the node named `recipient` whose calls prove the mesh
/// secret and whose answers must prove the node; cheap to clone (clones
/// share the connection and the counters).
#[derive(Clone, Debug)]
pub struct SignedChannel {
    inner: Channel,
    secret: MeshSecret,
    recipient: Arc<str>,
    also: Option<fn(&mut MetadataMap)>,
    unproven: Arc<UnprovenReplies>,
}

impl SignedChannel {
    /// Calls over `inner` to node `recipient` of the mesh holding `secret`.
    pub fn new(inner: Channel, secret: MeshSecret, recipient: &str) -> Self {
        Self {
            inner,
            secret,
            recipient: Arc::from(recipient),
            also: None,
            unproven: Arc::default(),
        }
    }

    /// Also runs `add` on every call's metadata, in the calling task (the
    /// trace context: `kvmesh_proto::peer` passes
    /// `kvmesh_telemetry::propagate::inject_grpc`). A plain function, so
    /// this crate stays free of what it adds.
    pub fn with_metadata(self, add: fn(&mut MetadataMap)) -> Self {
        Self {
            also: Some(add),
            ..self
        }
    }

    /// The node this channel calls.
    pub fn recipient(&self) -> &str {
        &self.recipient
    }

    /// The answers refused so far for not proving the node.
    pub fn unproven(&self) -> &Arc<UnprovenReplies> {
        &self.unproven
    }
}

/// What a [`SignedChannel`] answers in place of an unproven answer: the
/// refusal, and what the node's headers claimed (unverified: a node whose
/// clock is off still says why it refused us).
fn unproven_response(
    recipient: &str,
    refusal: &ReplyRefusal,
    claimed: &http::HeaderMap,
) -> http::Response<Body> {
    let said = claimed
        .get("grpc-message")
        .map(|m| {
            let m = percent_decoded(m.as_bytes());
            format!(
                " (its unverified answer: {})",
                m.chars().take(200).collect::<String>()
            )
        })
        .unwrap_or_default();
    let mut status = Status::unauthenticated(format!("node {recipient}: {refusal}{said}"));
    status.metadata_mut().insert(
        UNPROVEN_HEADER,
        tonic::metadata::MetadataValue::from_static(refusal.kind()),
    );
    status.into_http()
}

/// A `grpc-message` header as text: gRPC percent-encodes it; anything
/// not valid UTF-8 after decoding is replaced.
fn percent_decoded(raw: &[u8]) -> String {
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let h = raw.get(i + 1).copied().and_then(hex);
        let l = raw.get(i + 2).copied().and_then(hex);
        match (raw[i], h, l) {
            (b'%', Some(h), Some(l)) => {
                out.push(h << 4 | l);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Service<http::Request<Body>> for SignedChannel {
    type Response = http::Response<Body>;
    type Error = StdError;
    type Future = BoxFuture<Self::Response, StdError>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StdError>> {
        Service::<http::Request<Body>>::poll_ready(&mut self.inner, cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        if let Some(add) = self.also {
            let mut md = MetadataMap::from_headers(std::mem::take(req.headers_mut()));
            add(&mut md);
            *req.headers_mut() = md.into_headers();
        }
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (secret, recipient, unproven) = (
            self.secret.clone(),
            Arc::clone(&self.recipient),
            Arc::clone(&self.unproven),
        );
        Box::pin(async move {
            let (mut parts, body) = req.into_parts();
            // Every internal call sends one message: the body ends once
            // it is encoded.
            let bytes: Bytes = body.collect().await?.to_bytes();
            let signed = sign_call(
                &secret,
                &Call {
                    path: parts.uri.path(),
                    recipient: &recipient,
                    body: &body_digest(&bytes),
                },
                unix_ms(),
            )?;
            parts.headers.insert(
                CALL_HEADER,
                http::HeaderValue::try_from(signed.token.as_str())?,
            );
            let req = http::Request::from_parts(parts, Body::new(Full::new(bytes)));
            let resp = inner.call(req).await?;
            let proof = resp.headers().get(REPLY_HEADER).map(|v| v.as_bytes());
            match check_reply(&secret, &recipient, &signed, proof) {
                Ok(()) => Ok(resp),
                Err(refusal) => {
                    unproven.0.bump(refusal.index());
                    // The answer's body is dropped unread.
                    Ok(unproven_response(&recipient, &refusal, resp.headers()))
                }
            }
        })
    }
}

/// A channel whose calls carry the mesh proof and whose answers must carry
/// the node's.
pub type PeerChannel = SignedChannel;
