//! The tally of outcomes: by fault, by error kind, mismatches.

use super::*;

/// Per fault spec (and "none").
#[derive(Clone, Debug, Default)]
pub(super) struct FaultRow {
    pub(super) sent: u64,
    pub(super) equal: u64,
    pub(super) expected_error: u64,
    pub(super) unexpected: u64,
    pub(super) mismatch: u64,
    pub(super) disconnected: u64,
    pub(super) shed: u64,
}

#[derive(Debug)]
pub(super) struct Mismatch {
    pub(super) prompt: &'static str,
    pub(super) chat: bool,
    pub(super) stream: bool,
    pub(super) fault: &'static str,
    pub(super) expected: String,
    pub(super) expected_finish: &'static str,
    pub(super) got: String,
    pub(super) got_finish: String,
}

#[derive(Debug, Default)]
pub(super) struct Tally {
    pub(super) requests: u64,
    pub(super) streamed: u64,
    pub(super) equal: u64,
    /// Failing-fault requests that completed with the reference output.
    pub(super) harmless_fault: u64,
    pub(super) mismatches: Vec<Mismatch>,
    pub(super) expected_errors: BTreeMap<String, u64>,
    pub(super) unexpected_errors: BTreeMap<String, u64>,
    /// One example per unexpected kind: prompt, fault, message.
    pub(super) unexpected_examples: BTreeMap<String, String>,
    pub(super) shed: BTreeMap<String, u64>,
    pub(super) disconnected: u64,
    pub(super) faults_injected: u64,
    pub(super) failing_faults_injected: u64,
    pub(super) guard_faults_injected: u64,
    pub(super) per_fault: BTreeMap<&'static str, FaultRow>,
}

impl Tally {
    pub(super) fn completed(&self) -> u64 {
        self.equal + self.harmless_fault + self.mismatches.len() as u64
    }
    pub(super) fn count(map: &BTreeMap<String, u64>) -> u64 {
        map.values().sum()
    }

    pub(super) fn record(&mut self, r: &Reference, plan: Plan, ending: Ending) {
        self.requests += 1;
        self.streamed += u64::from(plan.stream);
        let fault = plan.fault.map(|i| &FAULTS[i]);
        let spec = fault.map_or("none", |f| f.spec);
        let expect_fail = fault.is_some_and(|f| f.expect.fails());
        if let Some(f) = fault {
            self.faults_injected += 1;
            self.failing_faults_injected += u64::from(expect_fail);
            self.guard_faults_injected += u64::from(f.expect.trips_guard());
        }
        let row = self.per_fault.entry(spec).or_default();
        row.sent += 1;
        let mut unexpected = |kind: String, message: String, row: &mut FaultRow| {
            row.unexpected += 1;
            self.unexpected_examples
                .entry(kind.clone())
                .or_insert_with(|| {
                    format!(
                        "prompt {} ({}, {}), fault {spec}: {message}",
                        r.name,
                        if r.chat { "chat" } else { "completion" },
                        if plan.stream { "stream" } else { "whole" }
                    )
                });
            *self.unexpected_errors.entry(kind).or_default() += 1;
        };
        match ending {
            Ending::Completed { text, finish } => {
                if text == r.want && finish == r.finish {
                    row.equal += 1;
                    if expect_fail {
                        self.harmless_fault += 1;
                    } else {
                        self.equal += 1;
                    }
                } else {
                    row.mismatch += 1;
                    self.mismatches.push(Mismatch {
                        prompt: r.name,
                        chat: r.chat,
                        stream: plan.stream,
                        fault: spec,
                        expected: r.want.clone(),
                        expected_finish: r.finish,
                        got: text,
                        got_finish: finish,
                    });
                }
            }
            Ending::Http { status, .. } if status == 429 || status == 503 => {
                row.shed += 1;
                *self.shed.entry(format!("HTTP {status}")).or_default() += 1;
            }
            Ending::Http {
                status,
                kind,
                message,
            } => {
                let kind = format!("HTTP {status} {kind}");
                if expect_fail {
                    row.expected_error += 1;
                    *self.expected_errors.entry(kind).or_default() += 1;
                } else {
                    unexpected(kind, message, row);
                }
            }
            Ending::SseError { kind, .. } if sse_shed(&kind) => {
                row.shed += 1;
                *self.shed.entry(format!("SSE error {kind}")).or_default() += 1;
            }
            Ending::SseError { kind, message } => {
                let kind = format!("SSE error {kind}");
                if expect_fail {
                    row.expected_error += 1;
                    *self.expected_errors.entry(kind).or_default() += 1;
                } else {
                    unexpected(kind, message, row);
                }
            }
            Ending::Disconnected => {
                row.disconnected += 1;
                self.disconnected += 1;
            }
            // Never a clear error, whatever the fault.
            Ending::Broken(what) => {
                let kind = format!(
                    "no clear ending: {}",
                    what.split(':').next().unwrap_or(&what)
                );
                unexpected(kind, what, row);
            }
        }
    }
}

/// An SSE error that is the streamed form of a 429 or 503 (the status was
/// already 200 when the router found out), told by its `type/code`: every
/// 429 is a `rate_limit_error` (the queue stayed full, or the decode nodes'
/// pools stayed out of pages for the queue timeout), every 503 a
/// `service_unavailable` (no healthy node was left).
pub(super) fn sse_shed(kind: &str) -> bool {
    kind.starts_with("rate_limit_error/") || kind.ends_with("/service_unavailable")
}
