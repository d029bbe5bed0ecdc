//! The router loses etcd (issue 18 item 2): it keeps serving on its last
//! membership view and reports itself degraded (`/health`, the gRPC health
//! entry `kvmesh.membership`, `kvmesh_discovery_degraded`), the nodes'
//! registrations outlive the outage, and everything recovers when etcd is
//! back. This binary's one etcd is its own, since the test kills it.

use std::time::{Duration, Instant};

use kvmesh_integration::etcd::{Etcd, EtcdMesh};
use kvmesh_integration::http;
use kvmesh_integration::roles::wait_healthy;
use kvmesh_integration::{reference_text, tiny_model_dir};
use serde_json::json;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const WITHIN: Duration = Duration::from_secs(30);

fn complete_checked(addr: &str, i: usize) {
    let prompt = format!("Outage request {i}: once upon a time");
    let want = reference_text(&tiny_model_dir(), &prompt, false, 12);
    let r = http::post(
        addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"][0]["text"], want.as_str());
}

fn degraded(addr: &str) -> Option<f64> {
    http::metric(addr, "kvmesh_discovery_degraded{source=\"etcd\"}")
}

/// Waits until the router's degraded gauge is `v`; how long that took.
fn wait_degraded(addr: &str, v: f64) -> Duration {
    let t0 = Instant::now();
    while degraded(addr) != Some(v) {
        assert!(t0.elapsed() < WITHIN, "degraded never {v}");
        std::thread::sleep(Duration::from_millis(25));
    }
    t0.elapsed()
}

/// The gRPC health status of `service` on the router's public port.
fn grpc_health(grpc: &str, service: &str) -> ServingStatus {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
            .expect("url")
            .connect()
            .await
            .expect("connect");
        let r = HealthClient::new(ch)
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .expect("health check")
            .into_inner();
        r.status()
    })
}

#[test]
fn the_router_serves_its_last_view_while_etcd_is_down_and_recovers() {
    let etcd = Etcd::start();
    let mesh = EtcdMesh::new(
        &etcd,
        "outage",
        &[("prefill", "prefill-0"), ("decode", "decode-0")],
    );
    let _d0 = mesh.start("decode", Some("decode-0"), &[], false);
    let _p0 = mesh.start("prefill", Some("prefill-0"), &[], false);
    let _router = mesh.start("router", None, &[], false);
    wait_healthy(&mesh.http);
    complete_checked(&mesh.http, 0);
    assert_eq!(degraded(&mesh.http), Some(0.0));
    assert_eq!(http::get(&mesh.http, "/health").body, "ok\n");
    assert_eq!(
        grpc_health(&mesh.grpc, "kvmesh.membership"),
        ServingStatus::Serving
    );
    let keys = etcd.keys(&mesh.prefix);
    assert_eq!(keys.len(), 2, "{keys:?}");

    etcd.kill();
    let noticed = wait_degraded(&mesh.http, 1.0);
    let health = http::get(&mesh.http, "/health");
    assert_eq!(health.status, 200, "still serving: {}", health.body);
    assert!(
        health
            .body
            .starts_with("ok, degraded: membership source etcd unreachable"),
        "{}",
        health.body
    );
    assert_eq!(
        grpc_health(&mesh.grpc, "kvmesh.membership"),
        ServingStatus::NotServing
    );
    assert_eq!(grpc_health(&mesh.grpc, ""), ServingStatus::Serving);
    // Longer than a lease TTL: the view is kept, not expired.
    std::thread::sleep(Duration::from_secs(4));
    for i in 1..4 {
        complete_checked(&mesh.http, i);
    }
    let m = http::metrics(&mesh.http);
    assert_eq!(
        m.value("kvmesh_discovery_members", &[("role", "decode")]),
        Some(1.0),
        "{}",
        m.text()
    );

    etcd.restart();
    let back = Instant::now();
    let recovered = wait_degraded(&mesh.http, 0.0);
    assert_eq!(http::get(&mesh.http, "/health").body, "ok\n");
    assert_eq!(
        grpc_health(&mesh.grpc, "kvmesh.membership"),
        ServingStatus::Serving
    );
    // The registrations survived (their leases were kept alive again).
    assert_eq!(etcd.keys(&mesh.prefix), keys);
    complete_checked(&mesh.http, 4);
    // And they stay: past a TTL after the restart, still there.
    std::thread::sleep(Duration::from_secs(4).saturating_sub(back.elapsed()));
    assert_eq!(etcd.keys(&mesh.prefix), keys);
    eprintln!(
        "MEASURED: etcd killed: the router reported degraded after {:.2} s, served throughout; \
         etcd restarted: current again after {:.2} s",
        noticed.as_secs_f64(),
        recovered.as_secs_f64()
    );
}
