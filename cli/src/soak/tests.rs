//! Unit tests of the soak's tables and parsers.

use super::*;

#[test]
fn metrics_are_parsed_and_leaks_found() {
    let text = "# HELP x\nkvmesh_node_kv_pages_total{node=\"decode-0\",role=\"decode\"} 16\n\
                kvmesh_node_kv_pages_free{node=\"decode-0\",role=\"decode\"} 14\n\
                kvmesh_node_kv_pages_total{node=\"prefill-0\",role=\"prefill\"} 16\n\
                kvmesh_node_kv_pages_free{node=\"prefill-0\",role=\"prefill\"} 16\n\
                kvmesh_node_reservations_total{node=\"decode-0\",outcome=\"completed\"} 3\n\
                kvmesh_requests_total{outcome=\"length\"} 3\n";
    let f = MeshFigures::from_text(text);
    assert!(!f.idle());
    assert_eq!(f.held()["decode-0"], Some(2.0));
    assert_eq!(f.held()["prefill-0"], Some(0.0));
    assert_eq!(
        f.reservations[&("decode-0".into(), "completed".into())],
        3.0
    );
    assert_eq!(f.requests["length"], 3.0);
    let whole = MeshFigures::from_text(&text.replace("} 14", "} 16"));
    assert!(whole.idle());
    assert!(!MeshFigures::from_text("").idle());
}

fn reference() -> Reference {
    Reference {
        name: "p",
        text: "x".into(),
        chat: false,
        max_tokens: 8,
        prompt_tokens: 1,
        want: "abc".into(),
        finish: "length",
    }
}

fn plan(fault: Option<&str>) -> Plan {
    Plan {
        prompt: 0,
        stream: true,
        fault: fault.map(|s| {
            FAULTS
                .iter()
                .position(|f| f.spec == s)
                .expect("a listed fault")
        }),
        disconnect_after: None,
    }
}

fn done(text: &str) -> Ending {
    Ending::Completed {
        text: text.into(),
        finish: "length".into(),
    }
}

fn err(status: u16) -> Ending {
    Ending::Http {
        status,
        kind: "server_error/decode_failed".into(),
        message: "m".into(),
    }
}

#[test]
fn outcomes_are_classified_against_the_fault() {
    let r = reference();
    let mut t = Tally::default();
    t.record(&r, plan(None), done("abc"));
    t.record(&r, plan(Some("frame:1=reorder")), done("abc"));
    t.record(&r, plan(Some("step:2=corrupt")), done("abc"));
    assert_eq!((t.equal, t.harmless_fault, t.mismatches.len()), (2, 1, 0));
    t.record(&r, plan(Some("step:2=corrupt")), done("abd"));
    t.record(&r, plan(None), done("ab"));
    assert_eq!(t.mismatches.len(), 2);
    t.record(&r, plan(Some("grant=corrupt")), err(502));
    t.record(
        &r,
        plan(Some("done=corrupt")),
        Ending::SseError {
            kind: "server_error/decode_failed".into(),
            message: "m".into(),
        },
    );
    assert_eq!(Tally::count(&t.expected_errors), 2);
    assert_eq!(Tally::count(&t.unexpected_errors), 0);
    t.record(&r, plan(None), err(502));
    t.record(&r, plan(Some("done=duplicate")), err(502));
    t.record(
        &r,
        plan(Some("grant=drop")),
        Ending::Broken("timeout: no end".into()),
    );
    assert_eq!(Tally::count(&t.unexpected_errors), 3);
    t.record(&r, plan(None), err(429));
    t.record(&r, plan(Some("frame:5=drop")), err(503));
    assert_eq!(Tally::count(&t.shed), 2);
    assert_eq!(Tally::count(&t.unexpected_errors), 3);
    t.record(&r, plan(Some("done=drop")), Ending::Disconnected);
    assert_eq!(t.disconnected, 1);
    assert_eq!(t.requests, 13);
    assert_eq!(t.faults_injected, 9);
    assert_eq!(t.per_fault["step:2=corrupt"].mismatch, 1);
    // A finish reason that differs is a mismatch too.
    t.record(
        &r,
        plan(None),
        Ending::Completed {
            text: "abc".into(),
            finish: "stop".into(),
        },
    );
    assert_eq!(t.mismatches.len(), 3);
    // Streamed 429s and 503s are shed, told by type and code (the message
    // is the router's fixed sentence, never the node's words).
    let before = Tally::count(&t.shed);
    for kind in [
        "rate_limit_error/decode_refused",
        "rate_limit_error/rate_limit_exceeded",
        "server_error/service_unavailable",
    ] {
        t.record(
            &r,
            plan(None),
            Ending::SseError {
                kind: kind.into(),
                message: "m".into(),
            },
        );
    }
    assert_eq!(Tally::count(&t.shed), before + 3);
    assert!(!tally::sse_shed("server_error/decode_refused"));
    assert!(!tally::sse_shed("server_error/decode_failed"));
}

#[test]
fn a_paused_gate_lets_no_request_in() {
    let g = Gate::default();
    g.set_deadline(Duration::from_secs(60));
    let started = Instant::now();
    assert!(g.running(started));
    assert!(g.enter());
    g.paused.store(true, Ordering::SeqCst);
    assert!(!g.enter());
    assert_eq!(g.inflight.load(Ordering::SeqCst), 1);
    g.leave();
    assert_eq!(g.inflight.load(Ordering::SeqCst), 0);
    g.paused.store(false, Ordering::SeqCst);
    assert!(g.enter());
    g.set_deadline(Duration::ZERO);
    assert!(!g.running(started));
    g.set_deadline(Duration::from_secs(60));
    g.stop.store(true, Ordering::SeqCst);
    assert!(!g.running(started));
}

#[test]
fn urls_become_host_port() {
    for u in [
        "http://127.0.0.1:8080",
        "http://127.0.0.1:8080/v1",
        "127.0.0.1:8080/",
    ] {
        assert_eq!(host_port(u), "127.0.0.1:8080");
    }
}
