use super::*;

#[test]
fn percentiles_are_the_loadgen_ones() {
    let xs: Vec<f64> = (1..=100).rev().map(f64::from).collect();
    let p = Percentiles::of(xs).expect("samples");
    // Interpolated between ranks, as `kvmesh bench` reports them.
    for (got, want) in [(p.p50, 50.5), (p.p90, 90.1), (p.p99, 99.01)] {
        assert!((got - want).abs() < 1e-9, "{got} vs {want}");
    }
    let one = Percentiles::of(vec![4.5]).expect("a sample");
    assert_eq!((one.p50, one.p99), (4.5, 4.5));
    assert!(Percentiles::of(Vec::new()).is_none());
}

#[test]
fn sized_prompt_is_the_fewest_repeats_that_reach_the_target() {
    // One "token" per 10 characters.
    let count = |t: &str| Ok(t.chars().count() / 10);
    for target in [1, 13, 500, 2000] {
        let (text, n) = sized_prompt(target, count).expect("sized");
        assert!(n >= target, "{n} < {target}");
        assert_eq!(text.len() % FILLER.len(), 0);
        let repeats = text.len() / FILLER.len();
        let fewer = FILLER.repeat(repeats - 1);
        assert!(repeats == 1 || count(&fewer).expect("count") < target);
    }
    // A counter that never reaches the target is an error, not a hang.
    assert!(sized_prompt(10, |_| Ok(0)).is_err());
}

#[test]
fn only_the_over_length_refusal_counts() {
    let refusal = br#"{"error":{"message":"too long","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#;
    assert_eq!(classify(400, refusal), Ok(()));
    assert_eq!(
        classify(503, refusal),
        Err("HTTP 503 context_length_exceeded".into())
    );
    let invalid = br#"{"error":{"message":"x","code":"invalid_value"}}"#;
    assert_eq!(classify(400, invalid), Err("HTTP 400 invalid_value".into()));
    assert_eq!(classify(200, b"{\"choices\":[]}"), Err("HTTP 200".into()));
    assert_eq!(classify(400, b"not json"), Err("HTTP 400".into()));
}

const METRICS: &str = "\
# HELP kvmesh_requests_rejected_total Requests refused before dispatch, by reason.
# TYPE kvmesh_requests_rejected_total counter
kvmesh_requests_rejected_total{reason=\"context_length_exceeded\"} 7
kvmesh_requests_rejected_total{reason=\"invalid_request\"} 2
kvmesh_node_reservations_granted_total{node=\"decode-0\"} 3
kvmesh_node_kv_pages_free{node=\"decode-0\"} 16
";

fn live_run(sent: u64, grants: (f64, f64), rejected: (f64, f64)) -> Live {
    let counters = |g: f64, r: f64| Counters {
        granted: BTreeMap::from([("decode-0".to_owned(), g)]),
        rejected: BTreeMap::from([("context_length_exceeded".to_owned(), r)]),
    };
    Live {
        url: "http://127.0.0.1:1".into(),
        max_model_len: 256,
        clients: 2,
        secs: 2.0,
        tally: LiveTally {
            sent,
            refused: sent,
            latency_us: vec![100.0; sent as usize],
            ..LiveTally::default()
        },
        before: counters(grants.0, rejected.0),
        after: counters(grants.1, rejected.1),
    }
}

#[test]
fn counters_come_from_the_metrics_text() {
    let c = Counters::from_text(METRICS);
    assert_eq!(c.granted_total(), 3.0);
    assert_eq!(c.rejected_total(), 9.0);
    assert_eq!(c.rejected.get("context_length_exceeded"), Some(&7.0));
}

#[test]
fn the_live_verdict_is_the_counts() {
    assert!(live_run(10, (3.0, 3.0), (5.0, 15.0)).failures().is_empty());
    let granted = live_run(10, (3.0, 4.0), (5.0, 15.0)).failures();
    assert!(granted.iter().any(|f| f.contains("granted")), "{granted:?}");
    let short = live_run(10, (3.0, 3.0), (5.0, 14.0)).failures();
    assert!(short.iter().any(|f| f.contains("rose by 9")), "{short:?}");
    assert!(!live_run(0, (3.0, 3.0), (5.0, 5.0)).failures().is_empty());
    let mut errors = live_run(10, (3.0, 3.0), (5.0, 15.0));
    errors.tally.error("HTTP 200".into(), "an answer".into());
    assert_eq!(errors.failures().len(), 1, "{:?}", errors.failures());
    let mut no_metric = live_run(10, (3.0, 3.0), (5.0, 15.0));
    no_metric.after.granted.clear();
    assert!(no_metric
        .failures()
        .iter()
        .any(|f| f.contains("no kvmesh_node_reservations_granted_total")));
}

#[test]
fn report_table_and_json_carry_the_figures() {
    let us = Percentiles::of(vec![10.0, 20.0, 30.0]).expect("samples");
    let report = |live| Report {
        model: "tiny".into(),
        threads: 2,
        iterations: 3,
        warmup: 1,
        completion_tokens: 2001,
        chat_tokens: 2005,
        steps: vec![StepRow {
            prompt: "chat",
            step: "validate + admit",
            us,
        }],
        live,
    };
    let pass = report(Some(live_run(10, (3.0, 3.0), (5.0, 15.0))));
    let table = pass.table();
    assert!(table.contains("validate + admit"), "{table}");
    assert!(table.contains("result: PASS"), "{table}");
    let v = pass.json();
    assert_eq!(v["pass"], true);
    assert_eq!(v["in_process"]["steps"][0]["p50_us"], 20.0);
    // Interpolated: 20 + 0.98 * (30 - 20).
    assert_eq!(v["in_process"]["steps"][0]["p99_us"], 29.8);
    assert_eq!(v["live"]["sent"], 10);
    assert_eq!(v["live"]["rejected_after"].as_f64(), Some(15.0));
    assert_eq!(v["live"]["refusals_per_s"].as_f64(), Some(5.0));
    assert_eq!(
        v["live"]["rejected_rise_by_reason"]["context_length_exceeded"].as_f64(),
        Some(10.0)
    );

    let fail = report(Some(live_run(10, (3.0, 4.0), (5.0, 15.0))));
    assert!(fail.table().contains("result: FAIL"));
    assert_eq!(fail.json()["pass"], false);

    let skipped = report(None);
    assert!(skipped.table().contains("live: skipped"));
    assert_eq!(skipped.json()["pass"], true);
    assert!(skipped.json()["live"].is_null());
}
