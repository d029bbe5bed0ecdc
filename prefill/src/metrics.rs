//! The prefill node's own Prometheus series (`GET /metrics` on its gRPC
//! port): what its load report says ([`kvmesh_node::metrics::render_report`]),
//! the compute thread's batches and each request's transfer. Observed once
//! per batch and once per transfer, lock-free.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use kvmesh_telemetry::metrics::{escape, header, sample, Histogram, BATCH, SECONDS};

/// Transfer outcomes: `completed`, or a writer error's kind, or `failed`.
#[derive(Debug)]
pub(crate) struct PrefillMetrics {
    /// Wall time of one batch's forward pass (its layers' transfers
    /// overlap it).
    batch_seconds: Histogram,
    /// Prompts in a batch.
    batch: Histogram,
    /// Prompt tokens computed, and supplied by the prefix cache.
    computed_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    /// From the first layer handed to the writer to transfer-done.
    transfer_seconds: Histogram,
    sent_bytes: AtomicU64,
    /// Transfers ended, by outcome (a small fixed set of labels).
    transfers: Mutex<BTreeMap<&'static str, u64>>,
}

impl Default for PrefillMetrics {
    fn default() -> Self {
        Self {
            batch_seconds: Histogram::new(SECONDS),
            batch: Histogram::new(BATCH),
            computed_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            transfer_seconds: Histogram::new(SECONDS),
            sent_bytes: AtomicU64::new(0),
            transfers: Mutex::default(),
        }
    }
}

impl PrefillMetrics {
    /// A batch of `prompts` took `took`, computing `computed` prompt
    /// tokens and taking `cached` from the prefix cache.
    pub(crate) fn batch(&self, prompts: usize, took: Duration, computed: usize, cached: usize) {
        self.batch_seconds.observe(took.as_secs_f64());
        self.batch.observe(prompts as f64);
        self.computed_tokens
            .fetch_add(computed as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(cached as u64, Ordering::Relaxed);
    }

    /// A transfer ended with `outcome` after `took`, having written
    /// `bytes` of K and V.
    pub(crate) fn transfer(&self, outcome: &'static str, took: Duration, bytes: u64) {
        self.transfer_seconds.observe(took.as_secs_f64());
        self.sent_bytes.fetch_add(bytes, Ordering::Relaxed);
        *self
            .transfers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(outcome)
            .or_default() += 1;
    }

    /// Writes the series with `labels` (the node's).
    pub(crate) fn render(&self, labels: &str, out: &mut String) {
        self.batch_seconds.render(
            "kvmesh_prefill_batch_duration_seconds",
            "Wall time of one prefill batch's forward pass (its layers' transfers overlap it).",
            labels,
            out,
        );
        self.batch.render(
            "kvmesh_prefill_batch_size",
            "Prompts in one prefill batch.",
            labels,
            out,
        );
        let name = "kvmesh_prefill_prompt_tokens_total";
        header(
            out,
            name,
            "Prompt tokens admitted, by source: computed here, or cached (the prefix cache supplied them).",
            "counter",
        );
        for (source, n) in [
            ("computed", &self.computed_tokens),
            ("cached", &self.cached_tokens),
        ] {
            sample(
                out,
                name,
                &format!("{labels},source=\"{source}\""),
                n.load(Ordering::Relaxed),
            );
        }
        self.transfer_seconds.render(
            "kvmesh_kv_transfer_duration_seconds",
            "Time from a transfer's first layer to its transfer-done (or its failure).",
            labels,
            out,
        );
        header(
            out,
            "kvmesh_kv_sent_bytes_total",
            "KV bytes written to decode nodes (K and V as the grant's dtype encodes them).",
            "counter",
        );
        sample(
            out,
            "kvmesh_kv_sent_bytes_total",
            labels,
            self.sent_bytes.load(Ordering::Relaxed),
        );
        let name = "kvmesh_kv_transfers_total";
        header(out, name, "KV transfers ended, by outcome.", "counter");
        let transfers = self
            .transfers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        for (outcome, n) in transfers {
            sample(
                out,
                name,
                &format!("{labels},outcome=\"{}\"", escape(outcome)),
                n,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_and_transfers_are_counted() {
        let m = PrefillMetrics::default();
        m.batch(2, Duration::from_millis(30), 100, 32);
        m.transfer("completed", Duration::from_millis(40), 4096);
        m.transfer("aborted", Duration::from_millis(5), 512);
        m.transfer("completed", Duration::from_millis(60), 4096);
        let mut out = String::new();
        m.render("node=\"p\"", &mut out);
        for line in [
            "kvmesh_prefill_batch_size_bucket{node=\"p\",le=\"2\"} 1",
            "kvmesh_prefill_batch_duration_seconds_count{node=\"p\"} 1",
            "kvmesh_prefill_prompt_tokens_total{node=\"p\",source=\"computed\"} 100",
            "kvmesh_prefill_prompt_tokens_total{node=\"p\",source=\"cached\"} 32",
            "kvmesh_kv_sent_bytes_total{node=\"p\"} 8704",
            "kvmesh_kv_transfers_total{node=\"p\",outcome=\"aborted\"} 1",
            "kvmesh_kv_transfers_total{node=\"p\",outcome=\"completed\"} 2",
            "kvmesh_kv_transfer_duration_seconds_bucket{node=\"p\",le=\"0.05\"} 2",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} missing in\n{out}");
        }
    }
}
