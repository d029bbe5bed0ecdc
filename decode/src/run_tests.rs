//! The decode node's drain, on a real node (the committed tiny model, a
//! heap pool, a TCP KV listener on port 0) without a mesh around it.

use std::path::PathBuf;
use std::time::Duration;

use kvmesh_kvwire::WriterId;
use kvmesh_meshauth::MeshSecret;
use kvmesh_model::engine::EngineConfig;
use kvmesh_model::Precision;
use kvmesh_proto::internal::v1::decode_server::Decode;
use kvmesh_proto::internal::v1::{decode_event, GenerateRequest, LoadRequest, RefuseKind};

use crate::{run, DecodeConfig, DecodeNode, Transport};

async fn node() -> DecodeNode {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/tiny-llama");
    let model = kvmesh_model::load_with(&dir, Precision::Exact).expect("tiny model");
    DecodeNode::start(
        DecodeConfig {
            name: "decode-test".into(),
            engine: EngineConfig::default(),
            allow_small_pool: true,
            transport: Transport::Tcp("127.0.0.1:0".into()),
            lease: Duration::from_secs(5),
            abort_timeout: Duration::from_secs(1),
            kv_advertise: None,
            mesh_secret: MeshSecret::insecure(),
            tls: None,
            drain_timeout: Duration::from_secs(5),
            prefix_cache: true,
        },
        model,
    )
    .await
    .expect("decode node")
}

/// The first event of a Generate call for `writer`.
async fn first_event(n: &DecodeNode, writer: WriterId) -> decode_event::Event {
    let req = GenerateRequest {
        prompt_ids: vec![1, 2, 3],
        max_new_tokens: 4,
        writer_id: writer.to_bytes().to_vec(),
        tenant: "t".into(),
        sampling: None,
        stop_token_ids: vec![],
        cache_namespace: Vec::new(),
    };
    let mut rx = n
        .generate(tonic::Request::new(req))
        .await
        .expect("a stream")
        .into_inner()
        .into_inner();
    rx.recv()
        .await
        .expect("an event")
        .expect("not an error")
        .event
        .expect("set")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_node_refuses_as_draining_reports_it_and_has_every_page_back() {
    let n = node().await;
    // A writer that never connected: refused as such before the drain.
    let writer = WriterId::mint().expect("rng");
    match first_event(&n, writer).await {
        decode_event::Event::Refused(r) => assert_eq!(r.kind(), RefuseKind::WriterNotConnected),
        other => panic!("{other:?}"),
    }
    let report = n
        .load(tonic::Request::new(LoadRequest::default()))
        .await
        .expect("load");
    assert!(!report.get_ref().draining);
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
    assert_eq!((drained.cut, drained.pages_in_use), (0, 0));
    assert!(drained.pages_total > 0);
    // Draining now: refused as draining before anything else is looked
    // at, and the load report tells the router.
    match first_event(&n, writer).await {
        decode_event::Event::Refused(r) => assert_eq!(r.kind(), RefuseKind::Draining),
        other => panic!("{other:?}"),
    }
    let report = n
        .load(tonic::Request::new(LoadRequest::default()))
        .await
        .expect("load");
    assert!(report.get_ref().draining);
    // The batcher thread was joined: stopping again has nothing to join.
    n.join_batcher().await.expect("already joined");
}
