//! The decode node's drain, on a real node (the committed tiny model, a
//! heap pool, a TCP KV listener on port 0) without a mesh around it.

use std::path::PathBuf;
use std::time::Duration;

use kvmesh_kvwire::{decode_message, FirstToken, Message, PromptScore, TokenLogprobs, WriterId};
use kvmesh_kvxfer::transport::client::KvClient;
use kvmesh_kvxfer::transport::{ListenSettings, TransportKind};
use kvmesh_meshauth::MeshSecret;
use kvmesh_model::engine::EngineConfig;
use kvmesh_model::Precision;
use kvmesh_proto::internal::v1::decode_server::Decode;
use kvmesh_proto::internal::v1::{
    decode_event, GenerateRequest, LoadRequest, RefuseKind, Sampling,
};

use crate::{run, DecodeConfig, DecodeNode};

async fn node() -> DecodeNode {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/tiny-llama");
    let model = kvmesh_model::load_with(&dir, Precision::Exact).expect("tiny model");
    DecodeNode::start(
        DecodeConfig {
            name: "decode-test".into(),
            engine: EngineConfig::default(),
            allow_small_pool: true,
            transport: ListenSettings {
                kind: TransportKind::Tcp,
                control: "127.0.0.1:0".into(),
                shm_dir: "/dev/shm".into(),
                ucx_listen: ([127, 0, 0, 1], 0).into(),
            },
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
        sampling: None,
        stop_token_ids: vec![],
        cache_namespace: Vec::new(),
    };
    next(&mut open(n, req).await).await
}

type Stream =
    tokio::sync::mpsc::Receiver<Result<kvmesh_proto::internal::v1::DecodeEvent, tonic::Status>>;

/// A Generate call's event stream.
async fn open(n: &DecodeNode, req: GenerateRequest) -> Stream {
    n.generate(tonic::Request::new(req))
        .await
        .expect("a stream")
        .into_inner()
        .into_inner()
}

/// The stream's first event, which must be the grant.
async fn granted(rx: &mut Stream) -> kvmesh_proto::internal::v1::Granted {
    match next(rx).await {
        decode_event::Event::Granted(g) => g,
        other => panic!("no grant: {other:?}"),
    }
}

/// The stream's next event, which must not be an error.
async fn next(rx: &mut Stream) -> decode_event::Event {
    rx.recv()
        .await
        .expect("an event")
        .expect("not an error")
        .event
        .expect("set")
}

/// Writes the granted prompt's K/V (every value 0.5), as prefill would.
async fn write_prompt(
    client: &KvClient,
    g: &kvmesh_proto::internal::v1::Granted,
    tokens: usize,
    first: FirstToken,
) {
    let Message::Grant(grant) = decode_message(&g.grant).expect("grant").0 else {
        panic!("not a grant")
    };
    let geometry = grant.geometry;
    let kv = tokens * usize::from(geometry.n_kv_heads) * usize::from(geometry.head_dim);
    let mut w = client.begin(grant).expect("begin");
    for layer in 0..geometry.n_layers {
        let values = vec![0.5f32; kv];
        w.write_layer(layer, &values, &values)
            .await
            .expect("write layer");
    }
    w.finish(first).await.expect("transfer-done");
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

/// What prefill sends with the transfer reaches the router on this one
/// stream, in the protocol's order: the grant, prefill's report
/// (`prefilled`: its cached count and the prompt's scores, as sent), the
/// first token with its logprobs, decode's tokens with theirs, the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefills_report_comes_first_and_the_first_token_carries_its_logprobs() {
    let n = node().await;
    let writer = WriterId::mint().expect("rng");
    let client = KvClient::connect(n.kv_endpoint(), writer, MeshSecret::insecure())
        .await
        .expect("KV connection");
    let req = GenerateRequest {
        prompt_ids: vec![1, 2, 3],
        max_new_tokens: 3,
        writer_id: writer.to_bytes().to_vec(),
        sampling: Some(Sampling {
            temperature: 0.0,
            top_p: 1.0,
            seed: 1,
            logprobs: Some(1),
            ..Sampling::default()
        }),
        stop_token_ids: vec![],
        cache_namespace: Vec::new(),
    };
    let mut rx = open(&n, req).await;
    let g = granted(&mut rx).await;
    let first = FirstToken {
        id: 5,
        logprobs: Some(TokenLogprobs {
            logprob: -0.75,
            top: vec![(5, -0.75)],
        }),
        // Relayed as prefill said it: decode does not interpret it.
        cached_tokens: 2,
        prompt_scores: vec![
            PromptScore {
                logprob: -1.0,
                rank: 2,
                top: vec![(9, -0.5)],
            },
            PromptScore {
                logprob: -3.0,
                rank: 7,
                top: vec![(4, -0.25)],
            },
        ],
    };
    write_prompt(&client, &g, 3, first).await;
    let decode_event::Event::Prefilled(p) = next(&mut rx).await else {
        panic!("prefill's report is not first")
    };
    assert_eq!(p.cached_tokens, 2);
    let scores: Vec<_> = p
        .prompt_logprobs
        .iter()
        .map(|s| (s.logprob, s.rank, s.top_ids.clone(), s.top_logprobs.clone()))
        .collect();
    assert_eq!(
        scores,
        [
            (-1.0, 2, vec![9], vec![-0.5]),
            (-3.0, 7, vec![4], vec![-0.25])
        ]
    );
    let decode_event::Event::Token(t) = next(&mut rx).await else {
        panic!("no first token")
    };
    let lp = t.logprobs.expect("the first token's logprobs");
    assert_eq!((t.id, lp.logprob, lp.top_ids), (5, -0.75, vec![5]));
    let mut tokens = 1;
    loop {
        match next(&mut rx).await {
            decode_event::Event::Token(t) => {
                assert!(t.logprobs.is_some(), "decode's tokens have theirs");
                tokens += 1;
            }
            decode_event::Event::Finished(_) => break,
            other => panic!("{other:?}"),
        }
    }
    assert!((1..=3).contains(&tokens), "{tokens}");
}

/// A sequence's pages are offered to the prefix cache before its stream
/// ends: a client that sends its next turn the moment this one finishes
/// finds this turn's answer at decode (the pages decode wrote, which
/// prefill never saw).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_answers_pages_are_cached_before_its_stream_ends() {
    let n = node().await;
    let pages = |n: &DecodeNode| n.table().pool().stats().cache.entries;
    for turn in 0..4u32 {
        let writer = WriterId::mint().expect("rng");
        let client = KvClient::connect(n.kv_endpoint(), writer, MeshSecret::insecure())
            .await
            .expect("KV connection");
        // Three prompt tokens and 21 generated: 23 written, one full page
        // (16), all of it but the prompt written by decode.
        let req = GenerateRequest {
            prompt_ids: vec![1, 2, 3 + turn],
            max_new_tokens: 21,
            writer_id: writer.to_bytes().to_vec(),
            sampling: None,
            stop_token_ids: vec![],
            cache_namespace: vec![7; 32],
        };
        let mut rx = open(&n, req).await;
        let g = granted(&mut rx).await;
        let before = pages(&n);
        let first = FirstToken {
            id: 5,
            logprobs: None,
            cached_tokens: 0,
            prompt_scores: vec![],
        };
        write_prompt(&client, &g, 3, first).await;
        let mut tokens = 0;
        loop {
            match next(&mut rx).await {
                decode_event::Event::Prefilled(_) => {}
                decode_event::Event::Token(_) => tokens += 1,
                decode_event::Event::Finished(_) => break,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(tokens, 21, "turn {turn}: the whole budget");
        // Read at once, on this thread: nothing waits for the batcher.
        assert_eq!(
            pages(&n),
            before + 1,
            "turn {turn}: the written full page is cached when Finished arrives"
        );
    }
}
