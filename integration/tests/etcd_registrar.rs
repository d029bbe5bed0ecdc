//! The etcd registrar itself, in process against a real etcd on loopback
//! (one for this binary, a key prefix per test): two processes of one name
//! do not overwrite each other, and a lease etcd lost (revoked, or expired
//! while the node was cut off from etcd, or lost with etcd's data) is
//! replaced. The membership of whole processes is `etcd.rs`.

use std::time::{Duration, Instant};

use kvmesh_integration::etcd::Etcd;

/// Bound on anything a test waits for.
const WITHIN: Duration = Duration::from_secs(30);

fn discovery_config(etcd: &Etcd, test: &str) -> kvmesh_discovery::EtcdConfig {
    logs();
    kvmesh_discovery::EtcdConfig::new(
        &[etcd.endpoint()],
        &kvmesh_integration::etcd::unique_prefix(test),
        2,
        Duration::from_secs(2),
        None,
    )
    .expect("config")
}

fn decode_member(grpc: &str) -> kvmesh_discovery::Member {
    kvmesh_discovery::Member::new(
        "decode-0",
        kvmesh_discovery::Role::Decode,
        grpc,
        Some("tcp://127.0.0.1:2"),
        "test",
    )
    .expect("member")
}

/// The in-process registrar's and watcher's logs on the test's output, as
/// `RUST_LOG` asks (none without it).
fn logs() {
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("RUST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_test_writer()
            .try_init();
    }
}

/// The value and lease of `key`.
async fn entry(c: &mut etcd_client::Client, key: &str) -> Option<(Vec<u8>, i64)> {
    let r = c.get(key, None).await.expect("get");
    r.kvs().first().map(|kv| (kv.value().to_vec(), kv.lease()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_registrations_of_one_name_do_not_overwrite_each_other() {
    let etcd = Etcd::shared();
    let cfg = discovery_config(etcd, "same-name");
    let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .expect("etcd");
    let first = kvmesh_discovery::register(&cfg, decode_member("127.0.0.1:1"))
        .await
        .expect("first");
    let key = first.key().to_owned();
    // A second process of the same name waits for the first to go...
    let second_cfg = cfg.clone();
    let second = tokio::spawn(async move {
        kvmesh_discovery::register(&second_cfg, decode_member("127.0.0.1:9")).await
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!second.is_finished(), "the second took a live node's key");
    let (value, _) = entry(&mut c, &key).await.expect("first's entry");
    assert_eq!(value, decode_member("127.0.0.1:1").encode());
    first.deregister().await.expect("deregister");
    // ... and takes the name once it is free.
    let second = tokio::time::timeout(WITHIN, second)
        .await
        .expect("second registers")
        .expect("task")
        .expect("second");
    let (value, _) = entry(&mut c, &key).await.expect("second's entry");
    assert_eq!(value, decode_member("127.0.0.1:9").encode());
    // A third, while the second lives, gives up after two TTLs and a
    // second, naming the key.
    let t0 = Instant::now();
    let e = kvmesh_discovery::register(&cfg, decode_member("127.0.0.1:8"))
        .await
        .expect_err("the name is taken");
    assert!(
        matches!(e, kvmesh_discovery::DiscoveryError::NameTaken { .. }),
        "{e}"
    );
    assert!(e.to_string().contains(&key), "{e}");
    assert!(t0.elapsed() >= Duration::from_secs(5), "{:?}", t0.elapsed());
    second.deregister().await.expect("deregister");
    assert!(entry(&mut c, &key).await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_etcd_lost_is_replaced_and_the_key_written_again() {
    let etcd = Etcd::shared();
    let cfg = discovery_config(etcd, "lost-lease");
    let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .expect("etcd");
    let reg = kvmesh_discovery::register(&cfg, decode_member("127.0.0.1:1"))
        .await
        .expect("register");
    let key = reg.key().to_owned();
    let (_, lease) = entry(&mut c, &key).await.expect("entry");
    // What an expiry during a partition does: the lease (and key) gone.
    c.lease_revoke(lease).await.expect("revoke");
    assert!(entry(&mut c, &key).await.is_none());
    let t0 = Instant::now();
    let new_lease = loop {
        if let Some((_, l)) = entry(&mut c, &key).await {
            break l;
        }
        assert!(t0.elapsed() < WITHIN, "never registered again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_ne!(new_lease, lease);
    eprintln!(
        "MEASURED: a revoked lease was replaced and the key written again after {:.2} s (TTL 2 s)",
        t0.elapsed().as_secs_f64()
    );
    // And the watcher sees one member, with the value the node wrote.
    let w = kvmesh_discovery::Watcher::spawn(cfg.clone());
    let view = w.first(WITHIN).await;
    assert_eq!(view.health, kvmesh_discovery::Health::Live);
    let members: Vec<_> = view.members().cloned().collect();
    assert_eq!(members, [decode_member("127.0.0.1:1")]);
    w.stop().await;
    reg.deregister().await.expect("deregister");
}

/// A TCP relay to etcd that can be cut: while cut, its connections are
/// closed and new ones are closed at once (a partition, as the node sees
/// it; etcd itself lives on, so its leases run out).
struct Relay {
    addr: String,
    cut: tokio::sync::watch::Sender<bool>,
}

impl Relay {
    async fn to(upstream: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let (cut, _) = tokio::sync::watch::channel(false);
        let cuts = cut.clone();
        tokio::spawn(async move {
            while let Ok((mut down, _)) = listener.accept().await {
                let mut cut = cuts.subscribe();
                if *cut.borrow() {
                    continue;
                }
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let Ok(mut up) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut down, &mut up) => {}
                        _ = cut.wait_for(|c| *c) => {}
                    }
                });
            }
        });
        Self { addr, cut }
    }

    fn cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

/// What a partition longer than the TTL does: the node's keep-alive stream
/// breaks, etcd expires the lease and deletes the key; once etcd can be
/// reached again, the node reopens its stream for a lease etcd no longer
/// knows, and must register again under a new one. (The client library
/// answers that reopening with a generic error, which the registrar once
/// took for a broken connection and retried for ever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_expired_during_a_partition_is_replaced_once_etcd_is_back() {
    logs();
    let etcd = Etcd::shared();
    let relay = Relay::to(etcd.endpoint()).await;
    let cfg = kvmesh_discovery::EtcdConfig::new(
        std::slice::from_ref(&relay.addr),
        &kvmesh_integration::etcd::unique_prefix("partition"),
        2,
        Duration::from_secs(2),
        None,
    )
    .expect("config");
    let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .expect("etcd");
    let reg = kvmesh_discovery::register(&cfg, decode_member("127.0.0.1:1"))
        .await
        .expect("register");
    let key = reg.key().to_owned();
    let (_, lease) = entry(&mut c, &key).await.expect("entry");
    relay.cut(true);
    let t0 = Instant::now();
    while entry(&mut c, &key).await.is_some() {
        assert!(t0.elapsed() < WITHIN, "the lease never expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let expired = t0.elapsed();
    relay.cut(false);
    let t0 = Instant::now();
    let new_lease = loop {
        if let Some((_, l)) = entry(&mut c, &key).await {
            break l;
        }
        assert!(t0.elapsed() < WITHIN, "never registered again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_ne!(new_lease, lease);
    eprintln!(
        "MEASURED: partition: the lease expired {:.2} s after the cut (TTL 2 s); the key was written \
         again under a new lease {:.2} s after etcd could be reached",
        expired.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
    reg.deregister().await.expect("deregister");
    assert!(entry(&mut c, &key).await.is_none());
}

/// An etcd restarted without its data (the Kubernetes manifests give it no
/// persistent volume): the node's lease means nothing to it, so the node
/// registers again under a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_restarted_empty_is_refilled_by_the_node() {
    logs();
    let etcd = Etcd::start();
    let cfg = kvmesh_discovery::EtcdConfig::new(
        &[etcd.endpoint()],
        &kvmesh_integration::etcd::unique_prefix("emptied"),
        2,
        Duration::from_secs(2),
        None,
    )
    .expect("config");
    let reg = kvmesh_discovery::register(&cfg, decode_member("127.0.0.1:1"))
        .await
        .expect("register");
    let key = reg.key().to_owned();
    tokio::task::block_in_place(|| etcd.restart_empty());
    let back = Instant::now();
    let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .expect("etcd");
    loop {
        if let Some((value, _)) = entry(&mut c, &key).await {
            assert_eq!(value, decode_member("127.0.0.1:1").encode());
            break;
        }
        assert!(back.elapsed() < WITHIN, "never registered again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "MEASURED: an etcd restarted empty had the node's key again {:.2} s after it was healthy (TTL 2 s)",
        back.elapsed().as_secs_f64()
    );
    reg.deregister().await.expect("deregister");
    assert!(entry(&mut c, &key).await.is_none());
}
