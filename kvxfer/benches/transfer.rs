//! One prompt's KV transfer through the whole handshake, per transport, in
//! one run, against a memcpy of the same bytes as the baseline.
//!
//! `cargo bench -p kvmesh-kvxfer --bench transfer`
//!
//! Geometry of the default model (SmolLM2-135M: 30 layers, 3 KV heads of
//! 64, page_size 16); prompts of 128 and 512 tokens (512 tokens: 32 pages,
//! 23.6 MB of f32 K and V). One timed transfer = reserve, grant, write every
//! layer (one write per page and layer, as prefill produces them), drain,
//! transfer-done, verification (I4: generation, owner and checksum of
//! every page as it landed), live, release. Writer and decode node run in
//! one process on 127.0.0.1 (TCP) or a Unix socket plus a /dev/shm mapping
//! (shared memory), on a 2-thread runtime. Baselines in the same run:
//! `memcpy` (the bytes copied once into a buffer of the same size) and
//! `checksum` (xxh3 over the same bytes: what verification reads). Each
//! cell is the median of 15 timed runs after 3 warm-ups.
//!
//! Transfers into an f32 pool and into an f16 pool (half the bytes: the
//! writer converts as it sends, the checksum covers the f16 bytes), and on
//! TCP with and without mutual TLS (`+tls`: TLS 1.3 through rustls, ECDSA
//! P-256 certificates of a test CA; the handshake is made once per
//! connection, at setup, as the mesh keeps its connections), and over UCX
//! (`ucx`: one-sided puts into the registered pool over UCX's `tcp`
//! transport on loopback, one endpoint per grant connected and bound
//! inside each timed transfer, a flush before transfer-done, the
//! endpoint's close before verification).
//!
//! Prints ms per transfer, GB/s of KV moved (as sent: f16 rows move half the
//! bytes), and the ratio to memcpy of the f32 KV.
//!
//! Then latent entries against key-value ones at a DeepSeek-V2-Lite-sized
//! geometry (27 layers): a latent entry of 512 + 64 values (one block per
//! layer) against a grouped-query model of the same size's 8 KV heads of
//! 128 (K and V), 512-token prompts in f16, over TCP and shared memory:
//! bytes per token and ms per transfer side by side.

use std::time::{Duration, Instant};

use kvmesh_kvpool::{KvDtype, KvEntry, PoolConfig, ScrubMode};
use kvmesh_kvwire::WriterId;
use kvmesh_kvxfer::handshake::{ReservationTable, ReserveRequest, TableConfig};
use kvmesh_kvxfer::transport::client::KvClient;
use kvmesh_kvxfer::transport::server::KvServer;
use kvmesh_kvxfer::transport::{KvAuth, ListenSettings, TransportKind};
use kvmesh_meshauth::tls::{MeshTls, TlsFiles};
use kvmesh_meshauth::MeshSecret;
use kvmesh_testkit::tls::{TestCa, Validity};

const PAGE_SIZE: usize = 16;
const N_LAYERS: usize = 30;
const KV_DIM: usize = 192;
const REPS: usize = 15;
const WARMUP: usize = 3;

fn config(dtype: KvDtype) -> PoolConfig {
    PoolConfig {
        page_size: PAGE_SIZE,
        n_pages: 64,
        n_layers: N_LAYERS,
        n_kv_heads: 3,
        head_dim: 64,
        entry: KvEntry::KeyValue,
        dtype,
        scrub: ScrubMode::Off,
        poison: false,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct Setup {
    table: ReservationTable,
    client: KvClient,
    n_layers: usize,
    _server: KvServer,
    _dir: tempfile::TempDir,
}

async fn setup(kind: TransportKind, tls: bool, dtype: KvDtype) -> Setup {
    setup_pool(kind, tls, config(dtype)).await
}

async fn setup_pool(kind: TransportKind, tls: bool, pool_cfg: PoolConfig) -> Setup {
    let dir = tempfile::tempdir().expect("tempdir");
    let settings = ListenSettings::loopback(kind, "/dev/shm".into(), || {
        dir.path().join("kv.sock").into_os_string().into_string()
    })
    .expect("settings");
    let n_layers = pool_cfg.n_layers;
    let (pool, landing) = settings.land(pool_cfg, "bench").expect("pool");
    let cfg = TableConfig {
        lease: Duration::from_secs(30),
        abort_timeout: Duration::from_secs(5),
        max_seq_tokens: 1024,
    };
    let table = ReservationTable::new(pool, landing, cfg).expect("table");
    let secret = MeshSecret::generate().expect("rng");
    let identity = |stem: &str| -> KvAuth {
        let tls = tls.then(|| {
            let ca = TestCa::new(dir.path(), stem).expect("ca");
            let f = ca
                .write_node(dir.path(), stem, &["127.0.0.1"], Validity::Current)
                .expect("node");
            // Both ends trust this one CA: the client's files name it too.
            MeshTls::load(TlsFiles {
                ca: f.ca,
                cert: f.cert,
                key: f.key,
            })
            .expect("tls")
        });
        KvAuth {
            secret: secret.clone(),
            tls,
        }
    };
    let server_auth = identity("bench");
    let server = settings
        .listen(table.clone(), server_auth.clone())
        .await
        .expect("listen");
    // The writer presents the same identity (one CA for the bench).
    let client = KvClient::connect(
        server.endpoint(),
        WriterId::mint().expect("rng"),
        server_auth,
    )
    .await
    .expect("connect");
    Setup {
        table,
        client,
        n_layers,
        _server: server,
        _dir: dir,
    }
}

async fn transfer(s: &Setup, prompt: usize, k: &[f32], v: &[f32]) -> f64 {
    let t = Instant::now();
    let req = ReserveRequest {
        prompt_tokens: prompt,
        max_new_tokens: 0,
        writer: s.client.writer(),
        cached: None,
    };
    let (grant, pending) = s.table.reserve(req).expect("reserve");
    let mut w = s.client.begin(grant).expect("begin");
    for layer in 0..s.n_layers as u16 {
        w.write_layer(layer, k, v).await.expect("write");
    }
    w.finish(1).await.expect("finish");
    let live = pending.wait().await.expect("live");
    drop(live);
    t.elapsed().as_secs_f64()
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!("prompt  path           ms/transfer    GB/s   vs memcpy");
    for prompt in [128usize, 512] {
        let n = prompt * KV_DIM;
        let k: Vec<f32> = (0..n).map(|i| (i % 977) as f32 * 0.001).collect();
        let v: Vec<f32> = (0..n).map(|i| (i % 613) as f32 * -0.002).collect();
        let bytes = (N_LAYERS * 2 * n * 4) as f64;
        // Baselines.
        let src: Vec<u8> = (0..bytes as usize).map(|i| (i * 31 % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let mut copy = Vec::new();
        let mut sum = Vec::new();
        for i in 0..WARMUP + REPS {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            let c = t.elapsed().as_secs_f64();
            let t = Instant::now();
            std::hint::black_box(kvmesh_kvwire::checksum(std::hint::black_box(&dst)));
            let h = t.elapsed().as_secs_f64();
            if i >= WARMUP {
                copy.push(c);
                sum.push(h);
            }
        }
        let memcpy = median(copy);
        let row = |name: &str, secs: f64, bytes: f64| {
            println!(
                "{prompt:>6}  {name:<13} {:>12.3} {:>7.2} {:>10.2}x",
                secs * 1e3,
                bytes / secs / 1e9,
                secs / memcpy
            );
        };
        row("memcpy", memcpy, bytes);
        row("checksum", median(sum), bytes);
        for (name, path, tls, dtype) in [
            ("tcp", TransportKind::Tcp, false, KvDtype::F32),
            ("tcp+tls", TransportKind::Tcp, true, KvDtype::F32),
            ("shared-memory", TransportKind::Shm, false, KvDtype::F32),
            ("ucx", TransportKind::Ucx, false, KvDtype::F32),
            ("tcp f16", TransportKind::Tcp, false, KvDtype::F16),
            ("tcp+tls f16", TransportKind::Tcp, true, KvDtype::F16),
            ("shm f16", TransportKind::Shm, false, KvDtype::F16),
            ("ucx f16", TransportKind::Ucx, false, KvDtype::F16),
        ] {
            if let Err(e) = path.available() {
                println!("{prompt:>6}  {name:<13} not run: {e}");
                continue;
            }
            let secs = rt.block_on(async {
                let s = setup(path, tls, dtype).await;
                let mut times = Vec::new();
                for i in 0..WARMUP + REPS {
                    let t = transfer(&s, prompt, &k, &v).await;
                    if i >= WARMUP {
                        times.push(t);
                    }
                }
                assert_eq!(s.table.pool().free_pages(), s.table.pool().capacity_pages());
                median(times)
            });
            row(name, secs, bytes * dtype.size() as f64 / 4.0);
        }
    }
    latent_against_key_value(&rt);
}

/// The latent section (see the module docs).
fn latent_against_key_value(rt: &tokio::runtime::Runtime) {
    const LAYERS: usize = 27;
    const PROMPT: usize = 512;
    println!();
    println!("entry (27 layers, 512 tokens, f16)   path     values/token/layer  bytes/token  ms/transfer");
    let shapes = [
        ("key-value, 8 heads x 128", 8, 128, KvEntry::KeyValue),
        ("latent, 512 + 64", 1, 576, KvEntry::Latent),
    ];
    for (name, heads, dim, entry) in shapes {
        let cfg = PoolConfig {
            page_size: PAGE_SIZE,
            n_pages: PROMPT / PAGE_SIZE + 1,
            n_layers: LAYERS,
            n_kv_heads: heads,
            head_dim: dim,
            entry,
            dtype: KvDtype::F16,
            scrub: ScrubMode::Off,
            poison: false,
        };
        let per_layer = entry.blocks() * heads * dim;
        let n = PROMPT * heads * dim;
        let k: Vec<f32> = (0..n).map(|i| (i % 977) as f32 * 0.001).collect();
        let v: Vec<f32> = match entry {
            KvEntry::KeyValue => (0..n).map(|i| (i % 613) as f32 * -0.002).collect(),
            KvEntry::Latent => Vec::new(),
        };
        for (path_name, path) in [("tcp", TransportKind::Tcp), ("shm", TransportKind::Shm)] {
            let secs = rt.block_on(async {
                let s = setup_pool(path, false, cfg.clone()).await;
                let mut times = Vec::new();
                for i in 0..WARMUP + REPS {
                    let t = transfer(&s, PROMPT, &k, &v).await;
                    if i >= WARMUP {
                        times.push(t);
                    }
                }
                median(times)
            });
            println!(
                "{name:<36} {path_name:<8} {per_layer:>18} {:>12} {:>12.3}",
                per_layer * LAYERS * 2,
                secs * 1e3
            );
        }
    }
}
