//! The summary table, the JSON report and the verdict.

use super::*;

#[derive(Debug)]
pub(super) struct Summary<'a> {
    pub(super) refs: &'a [Reference],
    pub(super) tally: &'a Tally,
    pub(super) before: &'a MeshFigures,
    pub(super) after: &'a MeshFigures,
    pub(super) idle: bool,
    pub(super) mesh_exit: Option<String>,
    pub(super) rss: Rss,
    pub(super) load_secs: f64,
    pub(super) seed: u64,
    pub(super) kv_pool_tokens: usize,
    pub(super) started_mesh: bool,
}

pub(super) fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// The catalogue's faults whose reservation ends only by lease expiry.
const LEASE_ENDED_FAULTS: [&str; 2] = ["grant=drop", "done=drop"];

pub(super) fn summarize(a: &SoakArgs, s: &Summary<'_>) -> Report {
    let t = s.tally;
    let mut failures = Vec::new();
    let held = s.after.held();
    let leaked = held.values().fold(0.0, |s, h| s + h.unwrap_or(0.0));
    let silent: Vec<&String> = held
        .iter()
        .filter(|(_, h)| h.is_none())
        .map(|(n, _)| n)
        .collect();
    let guard = delta(&s.after.guard, &s.before.guard);
    let guard_total = guard.values().fold(0.0, |s, v| s + v);
    let cache_hits = delta(&s.after.cache_hits, &s.before.cache_hits);
    let cache_total = cache_hits.values().fold(0.0, |s, v| s + v);
    let reservations = delta(&s.after.reservations, &s.before.reservations);
    let requests = delta(&s.after.requests, &s.before.requests);
    let unexpected = Tally::count(&t.unexpected_errors);
    let expected = Tally::count(&t.expected_errors);
    let shed = Tally::count(&t.shed);
    let rss_growth = match (s.rss.start, s.rss.end) {
        (Some(a), Some(b)) if a > 0 => Some((b as f64 - a as f64) / a as f64 * 100.0),
        _ => None,
    };
    let rss_checked = a.duration >= RSS_CHECK_MIN_SECS;

    if let Some(status) = &s.mesh_exit {
        failures.push(format!("the mesh process exited during the run ({status})"));
    }
    if !t.mismatches.is_empty() {
        failures.push(format!("{} mismatches", t.mismatches.len()));
    }
    if unexpected > 0 {
        failures.push(format!("{unexpected} unexpected errors"));
    }
    if t.completed() == 0 {
        failures.push("no request completed".into());
    }
    if s.mesh_exit.is_none() && (held.is_empty() || !silent.is_empty()) {
        failures.push(format!(
            "pages not reported by {}",
            if held.is_empty() {
                "any node".to_owned()
            } else {
                silent
                    .iter()
                    .map(|n| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        ));
    }
    if leaked > 0.0 {
        failures.push(format!(
            "{leaked} pages still held {:.1} s after the load (leaked)",
            (a.lease_ms + a.abort_timeout_ms) as f64 / 1e3 + 5.0
        ));
    }
    if guard_total > t.guard_faults_injected as f64 {
        failures.push(format!(
            "{guard_total} guard violations, more than the {} requests with a fault that corrupts a page table",
            t.guard_faults_injected
        ));
    }
    let harmless_only = t.failing_faults_injected >= 10 && expected == 0;
    if harmless_only {
        failures.push(format!(
            "none of {} failing faults took effect: does the mesh honour {FAULT_HEADER} (serve --fault-injection, a build with fault injection)?",
            t.failing_faults_injected
        ));
    }
    if let Some(g) = rss_growth {
        if rss_checked && g > a.max_rss_growth_pct {
            failures.push(format!(
                "resident memory grew {g:.1} % (over {} %)",
                a.max_rss_growth_pct
            ));
        }
    }

    let mut o = String::new();
    let transport = if s.started_mesh {
        a.transport.name()
    } else {
        "as running"
    };
    let _ = writeln!(o, "kvmesh soak summary");
    let _ = writeln!(
        o,
        "  load                {:.1} s, {} streams, transport {transport}, fault rate {}, disconnect rate {}, seed {}",
        s.load_secs, a.streams, a.fault_rate, a.disconnect_rate, s.seed
    );
    if s.started_mesh {
        let _ = writeln!(
            o,
            "  mesh                kv pool {} tokens, {}",
            s.kv_pool_tokens,
            if a.fault_rate > 0.0 {
                format!(
                    "fault injection, lease {} ms, abort timeout {} ms",
                    a.lease_ms, a.abort_timeout_ms
                )
            } else {
                "no fault injection, serve's lease and abort timeout".to_owned()
            } + if a.model.poison || !a.no_poison {
                ", poison"
            } else {
                ""
            }
        );
    }
    let _ = writeln!(o, "  prompts             {}", s.refs.len());
    let _ = writeln!(
        o,
        "  requests            {} ({} streamed)",
        t.requests, t.streamed
    );
    let _ = writeln!(
        o,
        "  completed           {} (equal to the reference {}, failing fault harmless {})",
        t.completed(),
        t.equal,
        t.harmless_fault
    );
    let _ = writeln!(o, "  mismatches          {}", t.mismatches.len());
    let _ = writeln!(o, "  errors as expected  {expected}");
    let _ = writeln!(o, "  unexpected errors   {unexpected}");
    let _ = writeln!(o, "  shed (429/503)      {shed}");
    let _ = writeln!(o, "  disconnected        {}", t.disconnected);
    let _ = writeln!(
        o,
        "  faults injected     {} ({} must fail, {} must recover)",
        t.faults_injected,
        t.failing_faults_injected,
        t.faults_injected - t.failing_faults_injected
    );
    let _ = writeln!(
        o,
        "  pages leaked        {leaked}{}",
        if s.idle {
            ""
        } else {
            " (the mesh did not go idle)"
        }
    );
    let _ = writeln!(
        o,
        "  guard violations    {guard_total} ({} requests with a page-table fault)",
        t.guard_faults_injected
    );
    // Outputs served from the prefix cache are checked like the rest: the
    // soak's prompts repeat, so with the cache on most hit.
    let _ = writeln!(
        o,
        "  cached tokens       {cache_total} (prefix cache hits: {})",
        if cache_hits.is_empty() {
            "none".to_owned()
        } else {
            cache_hits
                .iter()
                .map(|(n, v)| format!("{n} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    );
    let fmt_rss =
        |k: Option<u64>| k.map_or("not measured".to_owned(), |k| format!("{:.1} MiB", mib(k)));
    let _ = writeln!(
        o,
        "  rss start           {}{}",
        fmt_rss(s.rss.start),
        s.rss.start_at.map_or(String::new(), |t| format!(
            " (at idle after {t:.0} s of load{})",
            if s.rss.start_idle {
                ""
            } else {
                ", not quite idle"
            }
        ))
    );
    let _ = writeln!(
        o,
        "  rss end             {} (at idle after the load)",
        fmt_rss(s.rss.end)
    );
    let _ = writeln!(o, "  rss peak under load {}", fmt_rss(s.rss.peak));
    let _ = writeln!(
        o,
        "  rss growth          {}",
        match rss_growth {
            None => "not measured".to_owned(),
            Some(g) if rss_checked => format!("{g:.1} % (limit {} %)", a.max_rss_growth_pct),
            Some(g) => format!(
                "{g:.1} % (not checked: runs under {RSS_CHECK_MIN_SECS} s are dominated by allocator warm-up)"
            ),
        }
    );
    if !t.expected_errors.is_empty() || !t.unexpected_errors.is_empty() || !t.shed.is_empty() {
        let _ = writeln!(o, "errors by kind");
        for (what, map) in [
            ("expected", &t.expected_errors),
            ("UNEXPECTED", &t.unexpected_errors),
            ("shed", &t.shed),
        ] {
            for (k, v) in map {
                let _ = writeln!(o, "  {what:<11} {k:<52} {v:>7}");
            }
        }
        for (k, e) in &t.unexpected_examples {
            let _ = writeln!(o, "  example of {k}: {e}");
        }
        // Clients are not told why a node failed (the router logs it), so
        // a lease running out shows in the decode nodes' reservation
        // outcomes: more than the faults that end by lease explain.
        let expired: f64 = reservations
            .iter()
            .filter(|((_, outcome), _)| outcome == "lease_expired")
            .map(|(_, v)| v)
            .sum();
        let by_fault = t
            .per_fault
            .iter()
            .filter(|(spec, _)| LEASE_ENDED_FAULTS.contains(spec))
            .map(|(_, r)| r.sent)
            .sum::<u64>();
        if unexpected > 0 && expired > by_fault as f64 {
            let _ = writeln!(
                o,
                "  hint: {} reservations ran out of their lease beyond the {by_fault} faults that end that way: prefill under this load may take longer than --lease-ms {} (raise it for a larger model)",
                expired - by_fault as f64,
                a.lease_ms
            );
        }
    }
    let _ = writeln!(
        o,
        "{:<22} {:>6} {:>6} {:>6} {:>10} {:>8} {:>6} {:>5}",
        "fault", "sent", "equal", "error", "unexpected", "mismatch", "disc", "shed"
    );
    for (spec, r) in &t.per_fault {
        let _ = writeln!(
            o,
            "  {spec:<20} {:>6} {:>6} {:>6} {:>10} {:>8} {:>6} {:>5}",
            r.sent, r.equal, r.expected_error, r.unexpected, r.mismatch, r.disconnected, r.shed
        );
    }
    let _ = writeln!(
        o,
        "{:<22} {:>11} {:>6} {:>6}",
        "node", "pages total", "free", "held"
    );
    for (n, (total, free)) in &s.after.pages {
        let f = |v: &Option<f64>| v.map_or("-".to_owned(), |v| v.to_string());
        let h = held.get(n).copied().flatten();
        let _ = writeln!(o, "  {n:<20} {:>11} {:>6} {:>6}", f(total), f(free), f(&h));
    }
    if !reservations.is_empty() {
        let _ = writeln!(o, "reservations ended during the soak");
        for ((n, outcome), v) in &reservations {
            let _ = writeln!(o, "  {n:<20} {outcome:<28} {v:>7}");
        }
    }
    if !requests.is_empty() {
        let _ = writeln!(o, "router requests by outcome during the soak");
        for (outcome, v) in &requests {
            let _ = writeln!(o, "  {outcome:<49} {v:>7}");
        }
    }
    for m in t.mismatches.iter().take(10) {
        let _ = writeln!(
            o,
            "MISMATCH prompt {} ({}, {}), fault {}:\n  expected ({}): {:?}\n  got      ({}): {:?}",
            m.prompt,
            if m.chat { "chat" } else { "completion" },
            if m.stream { "stream" } else { "whole" },
            m.fault,
            m.expected_finish,
            m.expected,
            m.got_finish,
            m.got
        );
    }
    if t.mismatches.len() > 10 {
        let _ = writeln!(o, "({} more mismatches not shown)", t.mismatches.len() - 10);
    }
    if failures.is_empty() {
        let _ = writeln!(o, "result: PASS");
    } else {
        let _ = writeln!(o, "result: FAIL: {}", failures.join("; "));
    }

    let json = json!({
        "load_secs": s.load_secs,
        "streams": a.streams,
        "transport": transport,
        "fault_rate": a.fault_rate,
        "disconnect_rate": a.disconnect_rate,
        "seed": s.seed,
        "kv_pool_tokens": if s.started_mesh { json!(s.kv_pool_tokens) } else { Value::Null },
        "prompts": s.refs.iter().map(|r| json!({
            "name": r.name, "chat": r.chat, "prompt_tokens": r.prompt_tokens,
            "max_tokens": r.max_tokens, "reference_finish": r.finish,
        })).collect::<Vec<_>>(),
        "requests": t.requests,
        "streamed": t.streamed,
        "completed": t.completed(),
        "equal": t.equal,
        "failing_fault_harmless": t.harmless_fault,
        "mismatches": t.mismatches.iter().map(|m| json!({
            "prompt": m.prompt, "chat": m.chat, "stream": m.stream, "fault": m.fault,
            "expected": m.expected, "expected_finish": m.expected_finish,
            "got": m.got, "got_finish": m.got_finish,
        })).collect::<Vec<_>>(),
        "errors_expected": t.expected_errors,
        "errors_unexpected": t.unexpected_errors,
        "errors_unexpected_examples": t.unexpected_examples,
        "shed": t.shed,
        "disconnected": t.disconnected,
        "faults_injected": t.faults_injected,
        "failing_faults_injected": t.failing_faults_injected,
        "per_fault": t.per_fault.iter().map(|(spec, r)| (spec.to_string(), json!({
            "sent": r.sent, "equal": r.equal, "expected_error": r.expected_error,
            "unexpected": r.unexpected, "mismatch": r.mismatch,
            "disconnected": r.disconnected, "shed": r.shed,
        }))).collect::<serde_json::Map<_, _>>(),
        "pages": s.after.pages.iter().map(|(n, (total, free))| (n.clone(), json!({
            "total": total, "free": free,
        }))).collect::<serde_json::Map<_, _>>(),
        "pages_leaked": leaked,
        "idle": s.idle,
        "guard_violations": guard_total,
        "prefix_cache_hit_tokens": cache_hits,
        "guard_faults_injected": t.guard_faults_injected,
        "reservations_ended": reservations.iter().map(|((n, o), v)| json!({
            "node": n, "outcome": o, "count": v,
        })).collect::<Vec<_>>(),
        "router_requests": requests,
        "rss_start_kib": s.rss.start,
        "rss_end_kib": s.rss.end,
        "rss_peak_kib": s.rss.peak,
        "rss_start_at_secs": s.rss.start_at,
        "rss_pause_secs": s.rss.pause_secs,
        "rss_samples": s.rss.samples,
        "rss_growth_pct": rss_growth,
        "rss_checked": rss_checked,
        "mesh_exit": s.mesh_exit,
        "failures": failures,
        "pass": failures.is_empty(),
    });
    Report {
        table: o,
        json,
        failures,
    }
}
