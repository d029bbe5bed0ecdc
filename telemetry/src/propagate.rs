//! W3C trace context (`traceparent`, `tracestate`) across process
//! boundaries: read from a client's HTTP headers or gRPC metadata, written
//! into the metadata of the mesh's internal calls.
//!
//! What a client sends is untrusted input: a missing, malformed or
//! invalid `traceparent` (wrong version, length or hex, all-zero ids) is
//! ignored, and the span then starts a new trace; nothing here fails or
//! panics on it. A valid one is honoured as given, sampled flag included
//! (with the default parent-based sampler, a client can ask for its own
//! request to be traced, or not; it cannot change what else is traced).

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::codegen::http::HeaderMap;
use tonic::metadata::{KeyRef, MetadataKey, MetadataMap, MetadataValue};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The header (and metadata key) that carries the parent span.
pub const TRACEPARENT: &str = "traceparent";

fn propagator() -> TraceContextPropagator {
    TraceContextPropagator::new()
}

/// Whether `tp` has the shape W3C Trace Context gives a `traceparent`:
/// `VV-TTTT...(32)-SSSS...(16)-FF`, lower-case hex; a version after 00
/// may append `-...`. The SDK's parser is laxer (it takes a 31-digit trace
/// id), so this runs first; the parser then refuses version ff and
/// all-zero ids.
fn well_formed(tp: &str) -> bool {
    let b = tp.as_bytes();
    let hex = |r: std::ops::Range<usize>| {
        b[r].iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    };
    let head = b.len() >= 55
        && hex(0..2)
        && b[2] == b'-'
        && hex(3..35)
        && b[35] == b'-'
        && hex(36..52)
        && b[52] == b'-'
        && hex(53..55);
    head && (b.len() == 55 || (&b[..2] != b"00" && b[55] == b'-'))
}

/// A carrier's value for `key`, with a `traceparent` that is not
/// [`well_formed`] left out.
fn checked<'a>(key: &str, value: Option<&'a str>) -> Option<&'a str> {
    value.filter(|v| !key.eq_ignore_ascii_case(TRACEPARENT) || well_formed(v))
}

struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        checked(key, self.0.get(key).and_then(|v| v.to_str().ok()))
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

struct Metadata<'a>(&'a MetadataMap);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        checked(key, self.0.get(key).and_then(|v| v.to_str().ok()))
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                KeyRef::Ascii(k) => Some(k.as_str()),
                KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

struct MetadataOut<'a>(&'a mut MetadataMap);

impl Injector for MetadataOut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value),
        ) {
            self.0.insert(k, v);
        }
    }
}

/// The remote parent `extractor` names, if it names a valid one.
fn remote(extractor: &dyn Extractor) -> Option<Context> {
    let cx = propagator().extract(extractor);
    cx.span().span_context().is_valid().then_some(cx)
}

/// The remote parent in HTTP headers, if valid.
pub fn from_http(headers: &HeaderMap) -> Option<Context> {
    remote(&Headers(headers))
}

/// The remote parent in gRPC metadata, if valid.
pub fn from_grpc(metadata: &MetadataMap) -> Option<Context> {
    remote(&Metadata(metadata))
}

/// `span` continues the trace of the client's `traceparent` header (when
/// valid); otherwise it stays a root. Nothing when tracing is off.
pub fn continue_http(span: &Span, headers: &HeaderMap) {
    if span.is_disabled() {
        return;
    }
    if let Some(cx) = from_http(headers) {
        let _ = span.set_parent(cx);
    }
}

/// `span` continues the trace of the caller's `traceparent` metadata
/// (the router's, for a node; a client's, for the public gRPC API).
pub fn continue_grpc(span: &Span, metadata: &MetadataMap) {
    if span.is_disabled() {
        return;
    }
    if let Some(cx) = from_grpc(metadata) {
        let _ = span.set_parent(cx);
    }
}

/// Writes the current span's context into an outgoing call's `metadata`:
/// the hook every internal client runs (`kvmesh_proto::peer`). Nothing
/// when tracing is off or no span is current.
pub fn inject_grpc(metadata: &mut MetadataMap) {
    if !crate::enabled() {
        return;
    }
    let span = Span::current();
    if span.is_disabled() {
        return;
    }
    let cx = span.context();
    if cx.span().span_context().is_valid() {
        propagator().inject_context(&cx, &mut MetadataOut(metadata));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::codegen::http::HeaderValue;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn headers(tp: &[u8]) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Ok(v) = HeaderValue::from_bytes(tp) {
            h.insert(TRACEPARENT, v);
        }
        h
    }

    #[test]
    fn a_valid_traceparent_is_honoured() {
        let cx = from_http(&headers(GOOD.as_bytes())).expect("valid");
        let sc = cx.span().span_context().clone();
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(sc.is_sampled());
        assert!(sc.is_remote());
        let mut md = MetadataMap::new();
        md.insert(TRACEPARENT, GOOD.parse().expect("ascii"));
        // A garbage tracestate beside it is dropped, not an error.
        md.insert(
            "tracestate",
            "=,=,,x=\u{7f}"
                .parse()
                .unwrap_or_else(|_| "=".parse().expect("ascii")),
        );
        let cx = from_grpc(&md).expect("valid");
        assert_eq!(
            cx.span().span_context().trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
    }

    #[test]
    fn a_malformed_traceparent_is_ignored_never_an_error() {
        let long = format!("{GOOD}{}", "0".repeat(10_000));
        let bad: Vec<&[u8]> = vec![
            b"",
            b"garbage",
            b"00",
            b"00-",
            b"----",
            // All-zero trace id, all-zero span id.
            b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // Version ff is forbidden; upper-case hex; wrong lengths.
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            b"00-\xc3\xa9bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            b"\xff\xfe\xfd",
            long.as_bytes(),
        ];
        for tp in bad {
            assert!(
                from_http(&headers(tp)).is_none(),
                "{:?}",
                String::from_utf8_lossy(tp)
            );
            let mut md = MetadataMap::new();
            if let Ok(v) = MetadataValue::try_from(tp) {
                md.insert(TRACEPARENT, v);
            }
            assert!(from_grpc(&md).is_none());
        }
        assert!(from_http(&HeaderMap::new()).is_none());
        // A later version may append fields; version 00 may not.
        let v1 = GOOD.replacen("00", "01", 1) + "-more";
        assert!(from_http(&headers(v1.as_bytes())).is_some());
        // With no layer installed, continuing a trace on a live span is a
        // no-op too.
        continue_http(&Span::none(), &headers(GOOD.as_bytes()));
        continue_grpc(&Span::none(), &MetadataMap::new());
    }

    #[test]
    fn nothing_is_injected_while_tracing_is_off() {
        let mut md = MetadataMap::new();
        inject_grpc(&mut md);
        assert!(md.is_empty());
    }
}
