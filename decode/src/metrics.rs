//! The decode node's own Prometheus series (`GET /metrics` on its gRPC
//! port): what its load report says ([`kvmesh_node::metrics::render_report`])
//! and the batcher's steps, observed on the batcher thread: one lock-free
//! histogram update per step, not per token.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvmesh_telemetry::metrics::{header, sample, Histogram, BATCH, SECONDS};

/// The batcher's steps.
#[derive(Debug)]
pub(crate) struct StepMetrics {
    /// Wall time of one decode step (the batch's forward pass and sampling).
    seconds: Histogram,
    /// Sequences in a step.
    batch: Histogram,
    /// Tokens sampled by steps (the first token of each sequence is
    /// prefill's).
    tokens: AtomicU64,
}

impl Default for StepMetrics {
    fn default() -> Self {
        Self {
            seconds: Histogram::new(SECONDS),
            batch: Histogram::new(BATCH),
            tokens: AtomicU64::new(0),
        }
    }
}

impl StepMetrics {
    /// A step of `batch` sequences took `took` and sampled `tokens`.
    pub(crate) fn step(&self, batch: usize, took: Duration, tokens: usize) {
        self.seconds.observe(took.as_secs_f64());
        self.batch.observe(batch as f64);
        self.tokens.fetch_add(tokens as u64, Ordering::Relaxed);
    }

    /// Writes the step series with `labels` (the node's).
    pub(crate) fn render(&self, labels: &str, out: &mut String) {
        self.seconds.render(
            "kvmesh_decode_step_duration_seconds",
            "Wall time of one decode step: the running batch's forward pass and sampling.",
            labels,
            out,
        );
        self.batch.render(
            "kvmesh_decode_batch_size",
            "Sequences in one decode step.",
            labels,
            out,
        );
        header(
            out,
            "kvmesh_decode_tokens_total",
            "Tokens sampled by decode steps.",
            "counter",
        );
        sample(
            out,
            "kvmesh_decode_tokens_total",
            labels,
            self.tokens.load(Ordering::Relaxed),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_counted_by_duration_batch_and_tokens() {
        let m = StepMetrics::default();
        m.step(3, Duration::from_millis(20), 3);
        m.step(1, Duration::from_millis(2), 0);
        let mut out = String::new();
        m.render("node=\"d\"", &mut out);
        for line in [
            "kvmesh_decode_step_duration_seconds_bucket{node=\"d\",le=\"0.0025\"} 1",
            "kvmesh_decode_step_duration_seconds_bucket{node=\"d\",le=\"0.025\"} 2",
            "kvmesh_decode_batch_size_bucket{node=\"d\",le=\"2\"} 1",
            "kvmesh_decode_batch_size_bucket{node=\"d\",le=\"4\"} 2",
            "kvmesh_decode_batch_size_sum{node=\"d\"} 4",
            "kvmesh_decode_tokens_total{node=\"d\"} 3",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} missing in\n{out}");
        }
    }
}
