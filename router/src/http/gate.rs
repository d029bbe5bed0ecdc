//! The gates in front of the routes: an API key for the keyed ones (and
//! the request's tenant and fault plan taken from its headers), the
//! `metrics` scope for `/metrics`. Both answer before the handler runs.

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use kvmesh_faults::FaultPlan;

use crate::error::GatewayError;
use crate::Router;

/// The request's `Authorization` value, if it is text.
fn authorization(req: &axum::extract::Request) -> Option<&str> {
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
}

/// 401 or 403 before `/metrics` is rendered unless the request may read it
/// ([`crate::auth::ApiKeys::check_metrics`]).
pub(super) async fn authorize_metrics(
    State(r): State<Router>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match r.config().api_keys.check_metrics(authorization(&req)) {
        Ok(()) => next.run(req).await,
        Err(e) => r.fail(e.into()).into_response(),
    }
}

/// 401 before the handler runs (the body is not even read) unless the
/// request carries a known key; the tenant then rides along as an
/// extension, the only place a handler gets it from.
pub(super) async fn authenticate(
    State(r): State<Router>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let tenant = match r.config().api_keys.check(authorization(&req)) {
        Ok(tenant) => tenant,
        Err(e) => return r.fail(e.into()).into_response(),
    };
    req.extensions_mut().insert(tenant);
    // Injected faults: only a testing build started with --fault-injection
    // honours the header.
    if r.config().fault_injection {
        let spec = req
            .headers()
            .get(kvmesh_faults::HEADER)
            .map(|v| v.to_str().unwrap_or("\u{fffd}"));
        match FaultPlan::from_header(spec) {
            Ok(plan) => {
                req.extensions_mut().insert(plan);
            }
            Err(e) => return r.fail(GatewayError::FaultSpec(e)).into_response(),
        }
    }
    next.run(req).await
}
