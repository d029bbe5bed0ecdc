//! Prometheus text exposition (format 0.0.4), the one writer the router's
//! `/metrics` and every node's share: a lock-free [`Histogram`], the
//! family header, one sample, label escaping. A node's own series, rendered
//! from its load report, are `kvmesh_node::metrics`'.
//!
//! Names follow the Prometheus conventions: the unit in the name in base
//! units (`_seconds`, `_bytes`), counters end in `_total`, gauges never do,
//! and labels carry only bounded sets (kinds, outcomes, the node's own
//! name): never a reservation id, a prompt or a tenant.
//!
//! Cost: a histogram observation is one relaxed atomic add per bucket at or
//! above the value plus a compare-and-swap on the sum; rendering allocates
//! the text only when scraped.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bucket bounds for durations, seconds: 1 ms to 30 s.
pub const SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Bucket bounds for batch sizes (sequences or prompts per step).
pub const BATCH: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// The content type of the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A cumulative histogram with fixed bucket bounds, observed from any
/// thread without a lock.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations at or below each bound (cumulative, as exposed).
    counts: Box<[AtomicU64]>,
    /// The sum of observations, as `f64` bits.
    sum: AtomicU64,
    n: AtomicU64,
}

impl Histogram {
    /// An empty histogram over `bounds` (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0f64.to_bits()),
            n: AtomicU64::new(0),
        }
    }

    /// Records `v` (a NaN counts in `+Inf` only and leaves the sum alone).
    pub fn observe(&self, v: f64) {
        for (c, b) in self.counts.iter().zip(self.bounds) {
            if v <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        if !v.is_nan() {
            let _ = self
                .sum
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                    Some((f64::from_bits(bits) + v).to_bits())
                });
        }
        self.n.fetch_add(1, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.n.load(Ordering::Relaxed)
    }

    /// Writes the family `name` (header and series) with `labels`
    /// (`a="x",b="y"`, or empty) on every sample.
    pub fn render(&self, name: &str, help: &str, labels: &str, out: &mut String) {
        header(out, name, help, "histogram");
        self.render_series(name, labels, out);
    }

    /// Writes this histogram's samples of family `name` (no header: for a
    /// family with several label sets).
    pub fn render_series(&self, name: &str, labels: &str, out: &mut String) {
        let sep = if labels.is_empty() { "" } else { "," };
        // The count first: a scrape racing observations must never show a
        // bucket above `+Inf`.
        let n = self.n.load(Ordering::Relaxed);
        for (c, b) in self.counts.iter().zip(self.bounds) {
            let c = c.load(Ordering::Relaxed).min(n);
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {n}");
        let sum = f64::from_bits(self.sum.load(Ordering::Relaxed));
        let braces = |l: &str| {
            if l.is_empty() {
                String::new()
            } else {
                format!("{{{l}}}")
            }
        };
        let _ = writeln!(out, "{name}_sum{} {sum}", braces(labels));
        let _ = writeln!(out, "{name}_count{} {n}", braces(labels));
    }
}

/// Writes a family's `# HELP` and `# TYPE` lines.
pub fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Writes one sample: `name{labels} value`.
pub fn sample(out: &mut String, name: &str, labels: &str, value: impl std::fmt::Display) {
    if labels.is_empty() {
        let _ = writeln!(out, "{name} {value}");
    } else {
        let _ = writeln!(out, "{name}{{{labels}}} {value}");
    }
}

/// A label value escaped for the text format (backslash, quote, newline).
pub fn escape(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_is_cumulative_and_ends_at_its_count() {
        let h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.5, 1.5, 7.0, f64::NAN] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render("x_seconds", "X.", "a=\"b\"", &mut out);
        assert_eq!(
            out,
            "# HELP x_seconds X.\n# TYPE x_seconds histogram\n\
             x_seconds_bucket{a=\"b\",le=\"1\"} 1\n\
             x_seconds_bucket{a=\"b\",le=\"2\"} 3\n\
             x_seconds_bucket{a=\"b\",le=\"+Inf\"} 5\n\
             x_seconds_sum{a=\"b\"} 10.5\n\
             x_seconds_count{a=\"b\"} 5\n"
        );
        let mut bare = String::new();
        Histogram::new(&[1.0]).render_series("y", "", &mut bare);
        assert_eq!(
            bare,
            "y_bucket{le=\"1\"} 0\ny_bucket{le=\"+Inf\"} 0\ny_sum 0\ny_count 0\n"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
