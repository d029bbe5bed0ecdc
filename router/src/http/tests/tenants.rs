//! Per-tenant admission through the gateway over the scripted mesh: the
//! order in which tenants' waiting requests reach the mesh, share
//! refusals as 429s with their own code, and `/metrics` naming no tenant.

use crate::admission::{Policy, Share, Shares};

use super::*;

/// Two tenants, `alpha` (which may also read /metrics) and `beta`.
fn two_tenants(max_running: usize, admission: Policy, shares: Shares) -> RouterConfig {
    RouterConfig {
        api_keys: ApiKeys::with_scopes([
            (
                "k-alpha".to_owned(),
                "alpha".to_owned(),
                vec![Scope::Inference, Scope::Metrics],
            ),
            ("k-beta".into(), "beta".into(), vec![Scope::Inference]),
        ])
        .expect("keys"),
        max_running,
        admission,
        shares,
        ..RouterConfig::default()
    }
}

fn post_as(key: &str, body: &str) -> Request<Body> {
    Request::post("/v1/completions")
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {key}"))
        .body(Body::from(body.to_owned()))
        .expect("request")
}

/// Sends in a task of its own; the status comes back when it ends.
fn spawn_send(r: &Router, key: &str, body: &str) -> tokio::task::JoinHandle<StatusCode> {
    let (r, req) = (r.clone(), post_as(key, body));
    tokio::spawn(async move { send(&r, req).await.0 })
}

async fn until_queued(r: &Router, n: usize) {
    while r.admission.queued() != n {
        tokio::task::yield_now().await;
    }
}

/// Alpha's `n: 2` request holds both slots; alpha queues three more, then
/// beta one. When alpha's first choice ends, fair admission sends beta's
/// request to the mesh next; arrival order (fifo) sends alpha's.
#[tokio::test]
async fn another_tenants_request_is_dispatched_before_a_tenants_backlog() {
    for (policy, next) in [(Policy::Fair, "beta"), (Policy::Fifo, "alpha")] {
        let mesh = FakeMesh::new(Some(256));
        let r = router(&mesh, two_tenants(2, policy, Shares::default()));
        let gates = [Arc::new(Notify::new()), Arc::new(Notify::new())];
        for g in &gates {
            mesh.push(Script::Play(vec![
                Step::Send(text("a")),
                Step::Gate(Arc::clone(g)),
                Step::Send(done(Finish::Stop, 1)),
            ]));
        }
        let streamed = spawn_send(
            &r,
            "k-alpha",
            r#"{"prompt":"hi","n":2,"max_tokens":2,"stream":true}"#,
        );
        while mesh.received().len() < 2 {
            tokio::task::yield_now().await;
        }
        let mut waiting = Vec::new();
        for i in 0..3 {
            waiting.push(spawn_send(
                &r,
                "k-alpha",
                r#"{"prompt":"hi","max_tokens":2}"#,
            ));
            until_queued(&r, i + 1).await;
        }
        waiting.push(spawn_send(
            &r,
            "k-beta",
            r#"{"prompt":"hi","max_tokens":2}"#,
        ));
        until_queued(&r, 4).await;
        for _ in 0..4 {
            mesh.play(vec![text("b"), done(Finish::Stop, 1)]);
        }
        gates[0].notify_one();
        while mesh.received().len() < 3 {
            tokio::task::yield_now().await;
        }
        assert_eq!(mesh.received()[2].tenant.0, next, "{policy:?}");
        gates[1].notify_one();
        assert_eq!(streamed.await.expect("ran"), StatusCode::OK);
        for w in waiting {
            assert_eq!(w.await.expect("ran"), StatusCode::OK);
        }
        let tenants: Vec<String> = mesh.received().iter().map(|j| j.tenant.0.clone()).collect();
        assert_eq!(tenants.iter().filter(|t| *t == "beta").count(), 1);
        assert_eq!(tenants.len(), 6);
    }
}

/// A tenant's cap on queued prompt tokens refuses a request that would
/// wait with 429 `tenant_share_exceeded` while the other tenant still
/// queues; more choices than the tenant may run is a 400 naming `n`. The
/// refusal is counted by reason only: `/metrics` names no tenant.
#[tokio::test]
async fn share_limits_refuse_with_their_own_code_and_metrics_name_no_tenant() {
    let mut shares = Shares::default();
    shares
        .set(
            "alpha",
            Share::parse_fields("max_running=2:max_queued_tokens=0").expect("share"),
        )
        .expect("set");
    let mesh = FakeMesh::new(Some(256));
    let r = router(&mesh, two_tenants(1, Policy::Fair, shares));
    let gate = Arc::new(Notify::new());
    mesh.push(Script::Play(vec![
        Step::Send(text("a")),
        Step::Gate(Arc::clone(&gate)),
        Step::Send(done(Finish::Stop, 1)),
    ]));
    let held = spawn_send(&r, "k-alpha", r#"{"prompt":"hi","max_tokens":2}"#);
    while mesh.received().is_empty() {
        tokio::task::yield_now().await;
    }
    let (status, body) = send(&r, post_as("k-alpha", r#"{"prompt":"hi","max_tokens":2}"#)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(v["error"]["code"], "tenant_share_exceeded");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert!(!body.contains("alpha") && !body.contains("beta"), "{body}");
    let (status, body) = send(
        &r,
        post_as("k-alpha", r#"{"prompt":"hi","max_tokens":2,"n":3}"#),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(v["error"]["param"], "n");
    // Beta has no cap of its own: it waits for the slot.
    let beta = spawn_send(&r, "k-beta", r#"{"prompt":"hi","max_tokens":2}"#);
    until_queued(&r, 1).await;
    mesh.play(vec![text("b"), done(Finish::Stop, 1)]);
    gate.notify_one();
    assert_eq!(held.await.expect("ran"), StatusCode::OK);
    assert_eq!(beta.await.expect("ran"), StatusCode::OK);
    let req = Request::get("/metrics")
        .header("authorization", "Bearer k-alpha")
        .body(Body::empty())
        .expect("request");
    let m = send(&r, req).await.1;
    assert!(
        m.contains("kvmesh_requests_rejected_total{reason=\"tenant_share_exceeded\"} 1"),
        "{m}"
    );
    assert!(!m.contains("alpha") && !m.contains("beta"), "{m}");
}

/// The default reserve (an eighth of the slots where the keys name two
/// tenants: 1 of 8): alpha runs 4 of 8 slots and its next `n: 4` waits
/// (it would take the last free slot), while beta's request, its first,
/// goes to the mesh at once. A reserve of 0 starts alpha's second request
/// at once instead, and beta's comes after it.
#[tokio::test]
async fn the_default_reserve_starts_another_tenants_first_request_at_once() {
    for (reserve, beta_first) in [(None, true), (Some(0), false)] {
        let mesh = FakeMesh::new(Some(256));
        let mut cfg = two_tenants(8, Policy::Fair, Shares::default());
        cfg.reserve = reserve;
        let r = router(&mesh, cfg);
        let gates: Vec<Arc<Notify>> = (0..4).map(|_| Arc::new(Notify::new())).collect();
        for g in &gates {
            mesh.push(Script::Play(vec![
                Step::Send(text("a")),
                Step::Gate(Arc::clone(g)),
                Step::Send(done(Finish::Stop, 1)),
            ]));
        }
        let first = spawn_send(&r, "k-alpha", r#"{"prompt":"hi","n":4,"max_tokens":2}"#);
        while mesh.received().len() < 4 {
            tokio::task::yield_now().await;
        }
        for _ in 0..5 {
            mesh.play(vec![text("b"), done(Finish::Stop, 1)]);
        }
        let second = spawn_send(&r, "k-alpha", r#"{"prompt":"hi","n":4,"max_tokens":2}"#);
        if beta_first {
            until_queued(&r, 4).await;
        } else {
            while mesh.received().len() < 8 {
                tokio::task::yield_now().await;
            }
        }
        let beta = spawn_send(&r, "k-beta", r#"{"prompt":"hi","max_tokens":2}"#);
        assert_eq!(beta.await.expect("ran"), StatusCode::OK);
        if beta_first {
            assert_eq!(r.admission.queued(), 4, "alpha's second still waits");
        }
        for g in &gates {
            g.notify_one();
        }
        assert_eq!(first.await.expect("ran"), StatusCode::OK);
        assert_eq!(second.await.expect("ran"), StatusCode::OK);
        let tenants: Vec<String> = mesh.received().iter().map(|j| j.tenant.0.clone()).collect();
        let beta_at = tenants.iter().position(|t| t == "beta").expect("beta ran");
        assert_eq!(
            beta_at,
            if beta_first { 4 } else { 8 },
            "{reserve:?}: {tenants:?}"
        );
    }
}
