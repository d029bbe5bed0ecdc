//! Percentiles (`crate::percentile`), and the table and JSON of a run.

use super::*;
use crate::percentile::percentile;

/// p50, p90 and p99 of some samples, in their unit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Percentiles {
    pub(super) p50: f64,
    pub(super) p90: f64,
    pub(super) p99: f64,
}

impl Percentiles {
    /// `None` when there is no sample.
    pub(super) fn of(mut samples: Vec<f64>) -> Option<Self> {
        samples.sort_by(f64::total_cmp);
        Some(Self {
            p50: percentile(&samples, 50.0)?,
            p90: percentile(&samples, 90.0)?,
            p99: percentile(&samples, 99.0)?,
        })
    }

    pub(super) fn json(&self) -> Value {
        json!({"p50_us": round1(self.p50), "p90_us": round1(self.p90), "p99_us": round1(self.p99)})
    }
}

pub(super) fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// Everything one run measured.
#[derive(Debug)]
pub(super) struct Report {
    pub(super) model: String,
    pub(super) threads: usize,
    pub(super) iterations: usize,
    pub(super) warmup: usize,
    pub(super) completion_tokens: usize,
    pub(super) chat_tokens: usize,
    pub(super) steps: Vec<StepRow>,
    pub(super) live: Option<Live>,
}

impl Report {
    pub(super) fn failures(&self) -> Vec<String> {
        self.live.as_ref().map(Live::failures).unwrap_or_default()
    }

    pub(super) fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "kvmesh bench-router  ({}, {} cores)",
            self.model, self.threads
        );
        let _ = writeln!(
            s,
            "\nin process: completion prompt {} tokens, chat prompt {} tokens; {} iterations after {} warm-up",
            self.completion_tokens, self.chat_tokens, self.iterations, self.warmup
        );
        let _ = writeln!(
            s,
            "{:<12} {:<22} {:>10} {:>10} {:>10}",
            "prompt", "step", "p50 us", "p90 us", "p99 us"
        );
        for r in &self.steps {
            let _ = writeln!(
                s,
                "{:<12} {:<22} {:>10.1} {:>10.1} {:>10.1}",
                r.prompt, r.step, r.us.p50, r.us.p90, r.us.p99
            );
        }
        let _ = writeln!(
            s,
            "(validate: JSON body, fields, chat template, tokenization; admit: context window and node \
             capacity, ending at no_healthy_node as no node is registered, so the queue slot is not included)"
        );
        let Some(l) = &self.live else {
            let _ = writeln!(s, "\nlive: skipped (--duration 0)");
            return s;
        };
        let t = &l.tally;
        let _ = writeln!(
            s,
            "\nlive: over-length prompts to {} (max_model_len {}), {} keep-alive clients, {:.1} s",
            l.url, l.max_model_len, l.clients, l.secs
        );
        let fig = |s: &mut String, k: &str, v: String| {
            let _ = writeln!(s, "  {k:<36} {v}");
        };
        fig(&mut s, "requests sent", t.sent.to_string());
        fig(&mut s, "400 context_length_exceeded", t.refused.to_string());
        fig(
            &mut s,
            "other answers and errors",
            t.errors.values().sum::<u64>().to_string(),
        );
        for (k, v) in &t.errors {
            fig(&mut s, &format!("  {k}"), v.to_string());
        }
        fig(
            &mut s,
            "refusals per second",
            format!("{:.1}", l.refusals_per_s()),
        );
        if let Some(p) = Percentiles::of(t.latency_us.clone()) {
            fig(
                &mut s,
                "latency p50 / p90 / p99 (us)",
                format!("{:.0} / {:.0} / {:.0}", p.p50, p.p90, p.p99),
            );
        }
        fig(
            &mut s,
            "reservations granted (before, after)",
            format!("{}, {}", l.before.granted_total(), l.after.granted_total()),
        );
        fig(
            &mut s,
            "requests rejected (rise)",
            format!("{}", l.after.rejected_total() - l.before.rejected_total()),
        );
        for e in &t.examples {
            let _ = writeln!(s, "  e.g. {e}");
        }
        let failures = self.failures();
        if failures.is_empty() {
            let _ = writeln!(
                s,
                "result: PASS (grants unchanged, refusals counted = requests sent)"
            );
        } else {
            let _ = writeln!(s, "result: FAIL: {}", failures.join("; "));
        }
        s
    }

    pub(super) fn json(&self) -> Value {
        let steps: Vec<Value> = self
            .steps
            .iter()
            .map(|r| {
                let mut v = r.us.json();
                v["prompt"] = json!(r.prompt);
                v["step"] = json!(r.step);
                v
            })
            .collect();
        let live = self.live.as_ref().map(|l| {
            let t = &l.tally;
            let diff =
                |a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>| -> BTreeMap<String, f64> {
                    a.iter()
                        .map(|(k, v)| (k.clone(), v - b.get(k).copied().unwrap_or(0.0)))
                        .collect()
                };
            json!({
                "url": l.url,
                "max_model_len": l.max_model_len,
                "clients": l.clients,
                "duration_s": round1(l.secs),
                "sent": t.sent,
                "refused_context_length": t.refused,
                "errors": t.errors,
                "examples": t.examples,
                "refusals_per_s": round1(l.refusals_per_s()),
                "latency": Percentiles::of(t.latency_us.clone()).map(|p| p.json()),
                "granted_before": l.before.granted,
                "granted_after": l.after.granted,
                "rejected_before": l.before.rejected_total(),
                "rejected_after": l.after.rejected_total(),
                "rejected_rise_by_reason": diff(&l.after.rejected, &l.before.rejected),
            })
        });
        let failures = self.failures();
        json!({
            "model": self.model,
            "threads": self.threads,
            "in_process": {
                "iterations": self.iterations,
                "warmup": self.warmup,
                "completion_prompt_tokens": self.completion_tokens,
                "chat_prompt_tokens": self.chat_tokens,
                "steps": steps,
            },
            "live": live,
            "pass": failures.is_empty(),
            "failures": failures,
        })
    }
}
