//! kvmesh traces: OpenTelemetry spans of one request across the router,
//! the decode node and the prefill node, exported over OTLP/gRPC; the
//! logs, which every process sets up here too; and the Prometheus text
//! writer every process's `/metrics` is written with.
//!
//! # Layout
//! - [`settings`]: where a process's tracing comes from: the standard
//!   `OTEL_*` variables over the mesh file's `tracing:` section
//!   ([`Settings::resolve`]); typed errors naming the variable or field.
//! - [`install`]: [`install::init`] sets the process's `tracing`
//!   subscriber once (logs to stderr, filtered by `KVMESH_LOG`) and, when
//!   an OTLP endpoint is configured, the OpenTelemetry layer, its sampler,
//!   batch processor and exporter; [`Telemetry::shutdown`] flushes.
//! - [`propagate`]: W3C `traceparent`/`tracestate` read from HTTP headers
//!   and gRPC metadata (a malformed one is ignored: the span starts a new
//!   trace) and written into the metadata of every internal call.
//! - [`metrics`]: Prometheus text exposition: a lock-free
//!   [`metrics::Histogram`], family headers, samples and label escaping,
//!   shared by the router's `/metrics` and the nodes'. No state of its own:
//!   each process owns its series.
//!
//! # Invariants
//! - Off costs nothing beyond an atomic load per would-be span: every span
//!   of the request path is made through [`span!`], which makes
//!   `Span::none()` unless [`enabled`] (an exporter is installed). The
//!   KV handshake's spans (`kvmesh-kvxfer`, which does not link this
//!   crate) are made only as children of a span handed to it, so they
//!   follow the same switch. With tracing off the subscriber is exactly
//!   the log formatter the binary always had.
//! - Span attributes name ids (reservation, request), counts, sizes, node
//!   names and outcomes: never prompt or answer text, token ids, tenants or
//!   API keys (`docs/tracing.md`, "What attributes may say", says why;
//!   the integration test `tracing.rs` checks every exported attribute).

pub mod install;
pub mod metrics;
pub mod propagate;
pub mod settings;

use std::sync::atomic::{AtomicBool, Ordering};

pub use install::{init, Service, Telemetry, TelemetryError};
pub use settings::{FileSettings, Settings, SettingsError};

/// The `tracing` target of every span that becomes an OpenTelemetry span
/// (only these are exported; kvxfer spells it out, as it does not link
/// this crate).
pub const TARGET: &str = "kvmesh_trace";

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether spans are exported in this process: false until [`init`]
/// installs an exporter.
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

pub(crate) fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// A span of the request path: `tracing::info_span!` with the [`TARGET`]
/// target when tracing is on ([`enabled`]), else `Span::none()` (nothing
/// recorded, nothing allocated). Takes what `info_span!` takes after the
/// target: `span!("name", field = value)`, `span!(parent: &p, "name")`.
#[macro_export]
macro_rules! span {
    ($($t:tt)*) => {
        if $crate::enabled() {
            ::tracing::info_span!(target: $crate::TARGET, $($t)*)
        } else {
            ::tracing::Span::none()
        }
    };
}

/// The current span while tracing is on, else `Span::none()` without
/// looking (no thread-local lookup with tracing off).
#[inline]
pub fn current() -> tracing::Span {
    if enabled() {
        tracing::Span::current()
    } else {
        tracing::Span::none()
    }
}

/// Sets attribute `key` of `span` to `value` after the span was made (an
/// id or a count known only later: the reservation once granted, the
/// finish reason). Nothing when the span is off.
pub fn record(span: &tracing::Span, key: &'static str, value: impl Into<opentelemetry::Value>) {
    if !span.is_disabled() {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        span.set_attribute(key, value);
    }
}

/// Marks `span` as failed with a short, fixed `kind` (an error kind or a
/// refusal's label, never a message that could carry request text): the
/// span's status is ERROR with `kind` as its description, and attribute
/// `error.kind` says it too.
pub fn fail(span: &tracing::Span, kind: &'static str) {
    if !span.is_disabled() {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        span.set_status(opentelemetry::trace::Status::error(kind));
        span.set_attribute("error.kind", kind);
    }
}
