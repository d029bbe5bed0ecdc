//! A membership that changes under the router: members swapped whole with
//! each kept node's state, and a degraded source reported by `/health`,
//! the gRPC health entry and `/metrics`, while the router goes on serving.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use kvmesh_meshauth::MeshSecret;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tower::ServiceExt;

use super::Discovery;
use crate::grpc::MEMBERSHIP_HEALTH;
use crate::mesh::fake::{router, FakeMesh};
use crate::nodes::{Nodes, Role};
use crate::RouterConfig;

fn spec(name: &str, role: Role, port: u16) -> (String, Role, String) {
    (name.into(), role, format!("http://127.0.0.1:{port}"))
}

fn rendered(nodes: &Nodes) -> Vec<String> {
    let mut out = String::new();
    super::render(nodes, &mut out);
    out.lines()
        .filter(|l| !l.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn members_are_swapped_whole_and_unchanged_nodes_keep_their_state() {
    let nodes = Nodes::new(
        &[spec("p0", Role::Prefill, 1), spec("d0", Role::Decode, 2)],
        MeshSecret::insecure(),
    )
    .expect("nodes");
    let before = nodes.all();
    let d0 = Arc::clone(&before[1]);
    // A request at d0 while the membership changes.
    let busy = d0.busy();
    nodes.set_members(&[
        spec("p0", Role::Prefill, 11),
        spec("d0", Role::Decode, 2),
        spec("d1", Role::Decode, 3),
        spec("bad", Role::Decode, 4),
    ]);
    let after = nodes.all();
    let names: Vec<(&str, &str)> = after
        .iter()
        .map(|n| (n.name.as_str(), n.url.as_str()))
        .collect();
    assert_eq!(
        names,
        [
            ("p0", "http://127.0.0.1:11"),
            ("d0", "http://127.0.0.1:2"),
            ("d1", "http://127.0.0.1:3"),
            ("bad", "http://127.0.0.1:4"),
        ]
    );
    // Same name, role and address: the same node (its counts, report and
    // cache index); a new address is a new node.
    assert!(Arc::ptr_eq(&after[1], &d0));
    assert!(!Arc::ptr_eq(&after[0], &before[0]));
    // The snapshot taken before still holds the old members.
    assert_eq!(before.len(), 2);
    nodes.set_members(&[spec("d1", Role::Decode, 3)]);
    assert_eq!(nodes.all().len(), 1);
    // A node that left lives on in the request that holds it.
    drop(busy);
    assert_eq!(d0.name, "d0");
    // A spec that is not a URL is left out, not fatal.
    nodes.set_members(&[
        ("x".into(), Role::Decode, "not a url".into()),
        spec("d1", Role::Decode, 3),
    ]);
    let names: Vec<String> = nodes.all().iter().map(|n| n.name.clone()).collect();
    assert_eq!(names, ["d1"]);
}

#[tokio::test]
async fn discovery_metrics_say_the_source_whether_it_is_degraded_and_the_members() {
    let nodes = Nodes::new(&[spec("p0", Role::Prefill, 1)], MeshSecret::insecure()).expect("nodes");
    assert_eq!(
        rendered(&nodes),
        [
            "kvmesh_discovery_degraded{source=\"static\"} 0",
            "kvmesh_discovery_members{role=\"prefill\"} 1",
            "kvmesh_discovery_members{role=\"decode\"} 0",
            "kvmesh_discovery_refused_registrations_total 0",
        ]
    );
    let mut changes = nodes.discovery_changes();
    nodes.set_members(&[
        spec("p0", Role::Prefill, 1),
        spec("d0", Role::Decode, 2),
        spec("d1", Role::Decode, 3),
    ]);
    nodes.set_refused(3);
    nodes.set_discovery(Discovery::Watched {
        source: "etcd",
        degraded_since: Some(Instant::now()),
    });
    assert!(changes.has_changed().expect("sender alive"));
    assert_eq!(
        rendered(&nodes),
        [
            "kvmesh_discovery_degraded{source=\"etcd\"} 1",
            "kvmesh_discovery_members{role=\"prefill\"} 1",
            "kvmesh_discovery_members{role=\"decode\"} 2",
            "kvmesh_discovery_refused_registrations_total 3",
        ]
    );
    changes.borrow_and_update();
    // The same state again is no change.
    let d = nodes.discovery();
    nodes.set_discovery(d);
    assert!(!changes.has_changed().expect("sender alive"));
    nodes.set_discovery(Discovery::Watched {
        source: "etcd",
        degraded_since: None,
    });
    assert_eq!(
        rendered(&nodes)[0],
        "kvmesh_discovery_degraded{source=\"etcd\"} 0"
    );
}

async fn health(r: &crate::Router) -> (StatusCode, String) {
    let resp = r
        .http()
        .oneshot(
            Request::get("/health")
                .body(Body::empty())
                .expect("request"),
        )
        .await
        .expect("infallible");
    let status = resp.status();
    let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
        .await
        .expect("body");
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn a_degraded_membership_is_reported_and_the_router_still_serves() {
    let mesh = FakeMesh::new(Some(256));
    let r = router(&mesh, RouterConfig::default());
    assert_eq!(health(&r).await, (StatusCode::OK, "ok\n".into()));
    mesh.set_discovery(Discovery::Watched {
        source: "etcd",
        degraded_since: Some(Instant::now() - Duration::from_secs(7)),
    });
    assert_eq!(
        health(&r).await,
        (
            StatusCode::OK,
            "ok, degraded: membership source etcd unreachable for 7 s, routing on the last view\n"
                .into()
        )
    );
    // With no node to route to it is unavailable, and says both.
    mesh.set_capacity(None);
    assert_eq!(
        health(&r).await,
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "no healthy prefill or decode node\ndegraded: membership source etcd unreachable for 7 s, routing on the last view\n"
                .into()
        )
    );
}

#[tokio::test]
async fn the_grpc_health_entry_of_the_membership_follows_the_source() {
    let mesh = FakeMesh::new(Some(256));
    let r = router(&mesh, RouterConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(
        crate::grpc::service(r.clone())
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("url")
        .connect_lazy();
    let mut client = HealthClient::new(ch);
    let s = until(&mut client, MEMBERSHIP_HEALTH, ServingStatus::Serving).await;
    assert_eq!(s, ServingStatus::Serving);
    mesh.set_discovery(Discovery::Watched {
        source: "etcd",
        degraded_since: Some(Instant::now()),
    });
    let s = until(&mut client, MEMBERSHIP_HEALTH, ServingStatus::NotServing).await;
    assert_eq!(s, ServingStatus::NotServing);
    // The server, and the API, still serve.
    assert_eq!(check(&mut client, "").await, ServingStatus::Serving);
    assert_eq!(
        check(&mut client, "kvmesh.v1.Generation").await,
        ServingStatus::Serving
    );
    mesh.set_discovery(Discovery::Watched {
        source: "etcd",
        degraded_since: None,
    });
    let s = until(&mut client, MEMBERSHIP_HEALTH, ServingStatus::Serving).await;
    assert_eq!(s, ServingStatus::Serving);
    server.abort();
}

type Health = HealthClient<tonic::transport::Channel>;

/// `service`'s status; `Unknown` while the server does not know it yet
/// (NOT_FOUND before the health task's first write).
async fn check(client: &mut Health, service: &str) -> ServingStatus {
    client
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .map_or(ServingStatus::Unknown, |r| r.into_inner().status())
}

/// `service`'s status once it is `want` (the health task follows the
/// mesh's channel), or whatever it is after 5 s.
async fn until(client: &mut Health, service: &str, want: ServingStatus) -> ServingStatus {
    let t0 = Instant::now();
    loop {
        let s = check(client, service).await;
        if s == want || t0.elapsed() > Duration::from_secs(5) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
