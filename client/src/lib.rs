//! kvmesh's client toolkit: what its tools (`kvmesh soak`, `bench`,
//! `bench-router`, `bench-cache`, `doctor`) and its end-to-end tests use to
//! talk to a gateway: one HTTP/1.1 client that also reads server-sent
//! events, and one parser of the Prometheus text format. The `kvmesh`
//! binary links it; test-only fixtures are `kvmesh-testkit`'s.
//!
//! Layout:
//! - [`http`]: the async client on hyper: a [`http::Request`] (method,
//!   path, body, headers), one-shot calls on a fresh connection
//!   ([`http::send`], [`http::request`], [`http::get`]), a keep-alive
//!   [`http::Connection`], and [`http::SseReader`] for `text/event-stream`
//!   bodies. A response held open owns its connection: dropping it closes
//!   the socket, which is how a client "goes away".
//! - [`blocking`]: the same client for synchronous tests: each call runs on
//!   a current-thread runtime of its own, and a [`blocking::Streaming`]
//!   owns the runtime its connection lives on.
//! - [`metrics`]: `parse(text) -> Vec<Sample>` (escaped label values,
//!   `+Inf`, comments, histograms, timestamps), lookups by name and labels
//!   or by a selector (`name{label="v"}`), and [`metrics::scrape`].
//!
//! Invariants: nothing here panics on what a server sends; a malformed
//! metrics line is skipped, a malformed or oversized response is an
//! [`http::Error`]. Every read that a blocking call makes is bounded by a
//! timeout, so a test that waits on a hung server fails instead of hanging.

pub mod blocking;
pub mod http;
pub mod metrics;

pub use http::{Error, Reply, Request};
pub use metrics::{Metrics, Sample};
