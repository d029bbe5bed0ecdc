//! Mesh authentication of the internal gRPC services: the tonic glue over
//! [`crate::call`] (the token format, the checks and why are there).
//!
//! - Server side, [`Authenticated`]: wraps a generated server (Decode,
//!   Prefill) and answers any call without a valid `x-kvmesh-peer` proof
//!   for its method UNAUTHENTICATED, before the service sees the request;
//!   refusals are counted by kind in the shared [`CallVerifier`], which the
//!   node reports in its `LoadReport`.
//! - Client side, [`Signer`]: a tonic interceptor that adds a fresh proof
//!   to every call, bound to the method the generated client names
//!   ([`GrpcMethod`]); `kvmesh_proto::peer::decode_client` and
//!   `prefill_client` build the internal clients with it.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::{sign_call, CallVerifier, MeshSecret, CALL_HEADER};
use tonic::codegen::{http, BoxFuture, GrpcMethod, InterceptedService, Service};
use tonic::metadata::MetadataValue;
use tonic::server::NamedService;
use tonic::service::Interceptor;
use tonic::transport::Channel;
use tonic::{Request, Status};

/// Milliseconds since the Unix epoch by this host's clock (0 before it).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A gRPC server that serves only calls proving the mesh secret.
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

impl<S, B> Service<http::Request<B>> for Authenticated<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let token = req.headers().get(CALL_HEADER).map(|v| v.as_bytes());
        match self.verifier.check(token, req.uri().path(), unix_ms()) {
            Ok(()) => Box::pin(self.inner.call(req)),
            Err(refusal) => {
                let status = Status::unauthenticated(refusal.to_string());
                Box::pin(async move { Ok(status.into_http()) })
            }
        }
    }
}

impl<S: NamedService> NamedService for Authenticated<S> {
    const NAME: &'static str = S::NAME;
}

/// Adds a fresh proof of the mesh secret to every call, and whatever else
/// every internal call carries ([`Signer::with_metadata`]).
#[derive(Clone, Debug)]
pub struct Signer {
    secret: MeshSecret,
    also: Option<fn(&mut tonic::metadata::MetadataMap)>,
}

impl Signer {
    /// A signer for peers of the mesh holding `secret`.
    pub fn new(secret: MeshSecret) -> Self {
        Self { secret, also: None }
    }

    /// Also runs `add` on every call's metadata, in the calling task (the
    /// trace context: `kvmesh_proto::peer` passes
    /// `kvmesh_telemetry::propagate::inject_grpc`). A plain function, so
    /// this crate stays free of what it adds.
    pub fn with_metadata(self, add: fn(&mut tonic::metadata::MetadataMap)) -> Self {
        Self {
            also: Some(add),
            ..self
        }
    }
}

impl Interceptor for Signer {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let method = req
            .extensions()
            .get::<GrpcMethod>()
            .ok_or_else(|| Status::internal("no gRPC method to sign the call for"))?;
        let path = format!("/{}/{}", method.service(), method.method());
        let token = sign_call(&self.secret, &path, unix_ms())
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let value = MetadataValue::try_from(token)
            .map_err(|_| Status::internal("call proof is not a metadata value"))?;
        req.metadata_mut().insert(CALL_HEADER, value);
        if let Some(add) = self.also {
            add(req.metadata_mut());
        }
        Ok(req)
    }
}

/// A channel whose calls carry the mesh proof.
pub type PeerChannel = InterceptedService<Channel, Signer>;
