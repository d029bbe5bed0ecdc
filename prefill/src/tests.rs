//! The prefill node's own logic, without a mesh: the re-check of a request
//! against its grant, the refusals before any compute, the one mapping to
//! gRPC codes, and the drain (a real node on the committed tiny model).

use std::path::PathBuf;
use std::time::Duration;

use kvmesh_faults::FaultPlan;
use kvmesh_kvwire::{Capability, Geometry, Grant, ReservationId};
use kvmesh_meshauth::MeshSecret;
use kvmesh_model::engine::EngineConfig;
use kvmesh_model::Precision;
use kvmesh_proto::internal::v1::{PrefillRequest, Sampling};
use tonic::Code;

use super::*;

fn tiny() -> kvmesh_model::LoadedModel {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/tiny-llama");
    kvmesh_model::load_with(&dir, Precision::Exact).expect("tiny model")
}

fn node() -> PrefillNode {
    PrefillNode::start(
        PrefillConfig {
            name: "prefill-test".into(),
            engine: EngineConfig::default(),
            allow_small_pool: true,
            mesh_secret: MeshSecret::insecure(),
            tls: None,
            drain_timeout: Duration::from_secs(5),
            prefix_cache: true,
        },
        tiny(),
    )
    .expect("prefill node")
}

fn grant(prompt_tokens: u64, geometry: Geometry) -> Grant {
    Grant {
        reservation: ReservationId::mint().expect("rng"),
        capability: Capability::mint().expect("rng"),
        geometry,
        prompt_tokens,
        cached_tokens: 0,
        lease_deadline_unix_ms: u64::MAX,
        write_key: 0,
        pages: (0..prompt_tokens.div_ceil(u64::from(geometry.page_size)))
            .map(|i| kvmesh_kernels::PageRef {
                page: u32::try_from(i).expect("page"),
                generation: 1,
            })
            .collect(),
        endpoint: "tcp://127.0.0.1:1".into(),
    }
}

fn request(grant: &Grant, prompt: Vec<u32>) -> PrefillRequest {
    let mut bytes = Vec::new();
    grant.encode(&mut bytes).expect("encode grant");
    PrefillRequest {
        prompt_ids: prompt,
        grant: bytes,
        sampling: Some(Sampling {
            temperature: 0.0,
            top_p: 1.0,
            seed: 1,
            ..Sampling::default()
        }),
        ..PrefillRequest::default()
    }
}

fn geometry(n: &PrefillNode) -> Geometry {
    kvmesh_kvxfer::pool_geometry(n.pool().config()).expect("geometry")
}

#[test]
fn the_prompt_must_be_exactly_the_grants_and_within_the_limit() {
    let g = grant(
        3,
        Geometry::new(
            16,
            2,
            2,
            8,
            kvmesh_kvpool::KvDtype::F32,
            kvmesh_kvwire::KvEntry::KeyValue,
        )
        .expect("geometry"),
    );
    assert!(check(&g, &[1, 2, 3], 8).is_ok());
    for (prompt, limit, says) in [
        (vec![], 8, "0 prompt tokens, but the grant covers 3"),
        (vec![1, 2], 8, "2 prompt tokens, but the grant covers 3"),
        (
            vec![1, 2, 3, 4],
            8,
            "4 prompt tokens, but the grant covers 3",
        ),
        (
            vec![1, 2, 3],
            2,
            "3 prompt tokens exceed this node's limit of 2",
        ),
    ] {
        match check(&g, &prompt, limit) {
            Err(PrefillError::Invalid(m)) => assert_eq!(m, says),
            other => panic!("{prompt:?} within {limit}: {other:?}"),
        }
    }
}

#[test]
fn every_error_has_one_grpc_code_and_draining_is_told_apart() {
    let id = ReservationId::mint().expect("rng");
    let cases = [
        (PrefillError::Invalid("x".into()), Code::InvalidArgument),
        (PrefillError::Grant("x".into()), Code::Internal),
        (WriterError::Aborted(id).into(), Code::Aborted),
        (WriterError::DuplicateGrant(id).into(), Code::AlreadyExists),
        (PrefillError::ShuttingDown, Code::Unavailable),
        (PrefillError::ComputePanicked, Code::Internal),
    ];
    for (e, code) in cases {
        let draining = matches!(e, PrefillError::ShuttingDown);
        let s = Status::from(e);
        assert_eq!(s.code(), code, "{s:?}");
        assert_eq!(kvmesh_proto::refusal::is_draining(&s), draining, "{s:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_refused_before_any_compute_when_they_do_not_fit() {
    let n = node();
    let own = geometry(&n);
    // Not a grant at all.
    let bad = PrefillRequest {
        prompt_ids: vec![1, 2],
        grant: vec![0xde, 0xad],
        ..PrefillRequest::default()
    };
    let e = n
        .prefill(bad, FaultPlan::default())
        .await
        .expect_err("garbage");
    assert!(matches!(e, PrefillError::Grant(_)), "{e:?}");
    // Pages of another shape than this node computes.
    let other = Geometry {
        head_dim: own.head_dim * 2,
        ..own
    };
    let e = n
        .prefill(request(&grant(2, other), vec![1, 2]), FaultPlan::default())
        .await
        .expect_err("other geometry");
    assert!(
        matches!(&e, PrefillError::Invalid(m) if m.contains("--kv-cache-dtype")),
        "{e:?}"
    );
    // The right shape, but no KV connection to the grant's endpoint.
    let e = n
        .prefill(request(&grant(2, own), vec![1, 2]), FaultPlan::default())
        .await
        .expect_err("unreachable decode node");
    assert!(matches!(e, PrefillError::Transport(_)), "{e:?}");
    // Nothing was computed: every page of the node's own pool is free.
    let pool = n.pool().stats();
    assert_eq!(pool.free_pages, pool.capacity_pages);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_refuses_new_work_joins_the_compute_thread_and_counts_the_pool() {
    let n = node();
    let own = geometry(&n);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(run(n.clone(), listener, async {
        let _ = stopped.await;
    }));
    stop.send(()).expect("signal");
    let drained = tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("drained in time")
        .expect("task")
        .expect("drain");
    assert!(drained.is_clean(), "{drained}");
    assert_eq!(drained.cut, 0);
    assert_eq!(drained.pages_in_use, 0);
    assert!(drained.pages_total > 0);
    // Draining: refused before the grant is even read, with the status the
    // router tells apart from a node that is down.
    let e = n
        .prefill(request(&grant(2, own), vec![1, 2]), FaultPlan::default())
        .await
        .expect_err("draining");
    assert!(matches!(e, PrefillError::ShuttingDown), "{e:?}");
    assert!(kvmesh_proto::refusal::is_draining(&Status::from(e)));
    // The compute thread is gone: nothing left to join.
    assert!(n
        .inner
        .compute
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .is_none());
}
