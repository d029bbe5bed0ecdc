//! Setting up a process's logs and traces, once, and flushing the traces
//! at the end.
//!
//! Tracing off (no endpoint): the subscriber is the log formatter alone,
//! exactly what the binary installed before traces existed. Tracing on:
//! a registry with the same formatter (filtered by `KVMESH_LOG`, and never
//! shown the request path's spans, whose fields it would otherwise format
//! for nothing) and the OpenTelemetry layer, which sees only spans of
//! [`crate::TARGET`]. Finished spans go to a batch processor (its own
//! thread; a full queue drops spans rather than slowing a request) whose
//! OTLP/gRPC exporter runs on a one-worker runtime of its own, so export
//! and the flush at shutdown never wait on, or outlive, the service's
//! runtime.

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanData, SpanExporter};
use opentelemetry_sdk::Resource;
use thiserror::Error;
use tracing_subscriber::filter::{filter_fn, EnvFilter, FilterExt};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

use crate::settings::{Sampling, Settings};

/// Which service a process is, for its `service.name`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Service {
    /// `kvmesh router`.
    Router,
    /// `kvmesh prefill`.
    Prefill,
    /// `kvmesh decode`.
    Decode,
    /// `kvmesh serve`: the three roles in one process.
    Serve,
    /// Any other command (logs only).
    Tool,
}

impl Service {
    /// The default `service.name`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Router => "kvmesh-router",
            Self::Prefill => "kvmesh-prefill",
            Self::Decode => "kvmesh-decode",
            Self::Serve => "kvmesh",
            Self::Tool => "kvmesh-tool",
        }
    }
}

/// Why tracing could not start.
#[derive(Debug, Error)]
pub enum TelemetryError {
    /// The exporter's runtime.
    #[error("starting the OTLP exporter's runtime: {0}")]
    Runtime(std::io::Error),
    /// The exporter (its channel to the endpoint).
    #[error("building the OTLP exporter for {endpoint}: {message}")]
    Exporter {
        /// The endpoint.
        endpoint: String,
        /// The exporter's own words.
        message: String,
    },
    /// A subscriber was already set in this process.
    #[error("the tracing subscriber was already set")]
    AlreadySet,
}

/// The process's telemetry: flushes and stops the exporter on
/// [`Telemetry::shutdown`] (or when dropped).
#[derive(Debug)]
pub struct Telemetry {
    export: Option<Export>,
}

#[derive(Debug)]
struct Export {
    provider: SdkTracerProvider,
    /// Held so the exporter's worker lives until the provider is shut down.
    runtime: tokio::runtime::Runtime,
}

/// How long the flush at shutdown may take.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.export.is_some()
    }

    /// Exports every span ended so far and stops the exporter (bounded by
    /// a few seconds: a collector that is gone does not hold the process).
    /// Call it after the drain, from any thread (it blocks).
    pub fn shutdown(mut self) -> Result<(), String> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), String> {
        let Some(export) = self.export.take() else {
            return Ok(());
        };
        crate::set_enabled(false);
        let r = export
            .provider
            .shutdown_with_timeout(SHUTDOWN_TIMEOUT)
            .map_err(|e| e.to_string());
        export.runtime.shutdown_timeout(Duration::from_secs(1));
        r
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!(error = %e, "flushing traces");
        }
    }
}

/// The log filter: `KVMESH_LOG`, else `info`.
fn log_filter() -> EnvFilter {
    EnvFilter::try_from_env("KVMESH_LOG").unwrap_or_else(|_| EnvFilter::new("info"))
}

/// Sets this process's subscriber: logs to stderr, and spans to
/// `settings.endpoint` when there is one. `instance` is the node's name
/// (`service.instance.id`). Call once, before anything logs.
pub fn init(
    service: Service,
    instance: Option<&str>,
    settings: &Settings,
) -> Result<Telemetry, TelemetryError> {
    let ansi = std::io::stderr().is_terminal();
    let Some(endpoint) = &settings.endpoint else {
        tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .with_env_filter(log_filter())
            .try_init()
            .map_err(|_| TelemetryError::AlreadySet)?;
        return Ok(Telemetry { export: None });
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otlp-export")
        .enable_all()
        .build()
        .map_err(TelemetryError::Runtime)?;
    let name = settings
        .service_name
        .clone()
        .unwrap_or_else(|| service.name().to_owned());
    let mut resource = Resource::builder().with_service_name(name);
    if let Some(i) = instance {
        resource = resource.with_attribute(KeyValue::new("service.instance.id", i.to_owned()));
    }
    let resource = resource.build();
    let mut exporter = {
        // The channel's worker is spawned on the runtime entered here.
        let _entered = runtime.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.clone())
            .build()
            .map_err(|e| TelemetryError::Exporter {
                endpoint: endpoint.clone(),
                message: e.to_string(),
            })?
    };
    exporter.set_resource(&resource);
    let exporter = OnRuntime {
        inner: Arc::new(exporter),
        runtime: runtime.handle().clone(),
    };
    let provider = SdkTracerProvider::builder()
        .with_sampler(sampler(settings.sampling))
        .with_resource(resource)
        .with_batch_exporter(exporter)
        .build();
    let tracer = provider.tracer("kvmesh");
    let spans = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        // Only what the spans say: no source locations, threads, targets
        // or busy/idle clocks read at every enter and exit.
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_level(false)
        .with_tracked_inactivity(false)
        .with_filter(filter_fn(|m| m.is_span() && m.target() == crate::TARGET));
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_filter(
            log_filter().and(filter_fn(|m| !(m.is_span() && m.target() == crate::TARGET))),
        );
    tracing_subscriber::registry()
        .with(logs)
        .with(spans)
        .try_init()
        .map_err(|_| TelemetryError::AlreadySet)?;
    crate::set_enabled(true);
    tracing::info!(
        endpoint = %endpoint,
        ratio = settings.sampling.ratio,
        parent_based = settings.sampling.parent_based,
        "exporting traces over OTLP/gRPC"
    );
    Ok(Telemetry {
        export: Some(Export { provider, runtime }),
    })
}

fn sampler(s: Sampling) -> Sampler {
    let root = if s.ratio >= 1.0 {
        Sampler::AlwaysOn
    } else if s.ratio <= 0.0 {
        Sampler::AlwaysOff
    } else {
        Sampler::TraceIdRatioBased(s.ratio)
    };
    if s.parent_based {
        Sampler::ParentBased(Box::new(root))
    } else {
        root
    }
}

/// The OTLP exporter, run on the exporter's own runtime: the batch
/// processor calls `export` from its own thread, outside any runtime,
/// where tonic's timers and I/O could not run.
#[derive(Debug)]
struct OnRuntime<E> {
    inner: Arc<E>,
    runtime: tokio::runtime::Handle,
}

impl<E: SpanExporter + 'static> SpanExporter for OnRuntime<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let inner = Arc::clone(&self.inner);
        self.runtime
            .spawn(async move { inner.export(batch).await })
            .await
            .map_err(|e| OTelSdkError::InternalFailure(e.to_string()))?
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }
}
