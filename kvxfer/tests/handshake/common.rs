//! A decode node (pool, reservation table, listener) and writers on
//! 127.0.0.1 or a Unix socket with a shared-memory pool, for the handshake
//! tests.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_kernels::{PageRef, PagedKv};
use kvmesh_kvpool::{KvDtype, PoolConfig, Reservation, ScrubMode};
use kvmesh_kvwire::DataPath;
use kvmesh_kvwire::{
    decode_message, peek_header, DecodeLimits, Grant, Hello, Message, WriterId, HEADER_LEN,
    NONCE_LEN,
};
use kvmesh_kvxfer::handshake::{ReservationTable, ReserveRequest, TableConfig};
use kvmesh_kvxfer::transport::client::{GrantWriter, KvClient};
use kvmesh_kvxfer::transport::server::KvServer;
use kvmesh_kvxfer::transport::{KvAuth, ListenSettings};
use kvmesh_meshauth::kv::{hello_proof, welcome_ok};
use kvmesh_meshauth::MeshSecret;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Which transport a test runs over (UCX: the pool registered with UCX,
/// puts over its `tcp` transport on loopback; control on TCP).
pub use kvmesh_kvxfer::transport::TransportKind;

pub const PAGE_SIZE: usize = 4;
pub const N_PAGES: usize = 8;
pub const N_LAYERS: usize = 2;
pub const KV_DIM: usize = 4;

pub fn pool_config() -> PoolConfig {
    pool_config_of(KvDtype::F32)
}

pub fn pool_config_of(dtype: KvDtype) -> PoolConfig {
    PoolConfig {
        page_size: PAGE_SIZE,
        n_pages: N_PAGES,
        n_layers: N_LAYERS,
        n_kv_heads: 1,
        head_dim: KV_DIM,
        entry: kvmesh_kvpool::KvEntry::KeyValue,
        dtype,
        scrub: ScrubMode::Off,
        // Released pages hold the canary: any read of one fails loudly.
        poison: true,
    }
}

pub struct Node {
    pub table: ReservationTable,
    pub server: KvServer,
    /// The mesh secret the listener checks, and the file it was read from
    /// (for writer processes).
    pub secret: MeshSecret,
    pub secret_file: std::path::PathBuf,
    /// The pool's mapping file, for a shared-memory node.
    pub shm: Option<std::path::PathBuf>,
    _dir: tempfile::TempDir,
    /// UCX nodes run one at a time in this process (dropped last, after
    /// the node's target): see [`UCX_ONE_AT_A_TIME`].
    _ucx: Option<tokio::sync::MutexGuard<'static, ()>>,
}

/// UCX 1.13 keeps one process-wide table of async event handlers keyed by
/// file descriptor; with several UCX contexts opening and closing sockets
/// at once on different threads, a reused descriptor meets another
/// context's handler (`async.c:643 Assertion handler->async == async`, or
/// a crash in `ucp_cm_server_conn_request_cb`): 2 runs in 8 of this suite
/// aborted with the ucx tests running in parallel. A node process has one
/// context (one target or one writer), so the suite runs its UCX nodes
/// one at a time, as the nodes do.
pub static UCX_ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// 32 random bytes in a file, as an operator makes one.
pub fn secret_file(dir: &std::path::Path) -> std::path::PathBuf {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).expect("rng");
    let p = dir.join("mesh.secret");
    std::fs::write(&p, b).expect("write secret");
    p
}

pub fn table_config() -> TableConfig {
    TableConfig {
        lease: Duration::from_secs(3),
        abort_timeout: Duration::from_millis(300),
        max_seq_tokens: 32,
    }
}

impl Node {
    pub async fn start(kind: TransportKind) -> Self {
        Self::with(kind, table_config()).await
    }

    pub async fn with(kind: TransportKind, cfg: TableConfig) -> Self {
        Self::with_pool(kind, cfg, pool_config()).await
    }

    pub async fn with_pool(kind: TransportKind, cfg: TableConfig, pool_cfg: PoolConfig) -> Self {
        Self::with_tls(kind, cfg, pool_cfg, None).await
    }

    /// A node whose TCP listener runs mutual TLS with `tls`.
    pub async fn with_tls(
        kind: TransportKind,
        cfg: TableConfig,
        pool_cfg: PoolConfig,
        tls: Option<Arc<kvmesh_meshauth::tls::MeshTls>>,
    ) -> Self {
        let ucx = match kind {
            TransportKind::Ucx => Some(UCX_ONE_AT_A_TIME.lock().await),
            TransportKind::Tcp | TransportKind::Shm => None,
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let settings = ListenSettings::loopback(kind, dir.path().to_owned(), || {
            dir.path().join("kv.sock").into_os_string().into_string()
        })
        .expect("settings");
        let (pool, landing) = settings.land(pool_cfg, "test").expect("pool");
        let shm = match landing.data_path() {
            DataPath::SharedMemory { path } => Some(std::path::PathBuf::from(path)),
            _ => None,
        };
        let table = ReservationTable::new(pool, landing, cfg).expect("table");
        let secret_file = secret_file(dir.path());
        let secret = MeshSecret::load(&secret_file).expect("secret");
        let auth = KvAuth {
            secret: secret.clone(),
            tls,
        };
        let server = settings.listen(table.clone(), auth).await.expect("listen");
        Self {
            table,
            server,
            secret,
            secret_file,
            shm,
            _dir: dir,
            _ucx: ucx,
        }
    }

    /// The shared-memory mapping's file (shared-memory nodes only).
    pub fn shm_path(&self) -> std::path::PathBuf {
        self.shm.clone().expect("a shared-memory node")
    }

    /// The UCX region its Welcome describes, for a writer outside the
    /// transport (UCX nodes only).
    pub fn ucx_remote(&self) -> std::sync::Arc<kvmesh_ucx::Remote> {
        let kvmesh_kvwire::DataPath::Ucx {
            address,
            base,
            len,
            rkey,
        } = self.table.landing().data_path()
        else {
            panic!("not a UCX node")
        };
        std::sync::Arc::new(kvmesh_ucx::Remote {
            address: address.parse().expect("addr"),
            base,
            len,
            rkey,
        })
    }

    pub fn endpoint(&self) -> String {
        self.server.endpoint().to_owned()
    }

    pub async fn client(&self) -> KvClient {
        KvClient::connect(
            &self.endpoint(),
            WriterId::mint().expect("rng"),
            &self.secret,
        )
        .await
        .expect("connect")
    }

    pub fn request(
        prompt_tokens: usize,
        max_new_tokens: usize,
        writer: WriterId,
    ) -> ReserveRequest {
        ReserveRequest {
            prompt_tokens,
            max_new_tokens,
            writer,
            cached: None,
        }
    }

    pub fn free(&self) -> usize {
        self.table.pool().free_pages()
    }

    /// Waits (bounded) until every page is free and no reservation is
    /// open, then checks it stays so.
    pub async fn assert_idle(&self) {
        wait_for("pool whole and table empty", || {
            self.free() == N_PAGES && self.table.stats().open == 0
        })
        .await;
        assert_eq!(self.table.pool().guard_violations(), 0);
    }
}

/// Polls `cond` every 5 ms for at most 5 s; panics with `what` if it never
/// holds. Bounded: a hang is a failure, not a stuck test.
pub async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The K and V of every prompt position at `layer`, distinct per
/// position, layer, dimension and `seed`.
pub fn layer_kv(prompt: usize, layer: u16, seed: f32) -> (Vec<f32>, Vec<f32>) {
    let k = (0..prompt * KV_DIM)
        .map(|i| seed + f32::from(layer) * 1000.0 + i as f32)
        .collect();
    let v = (0..prompt * KV_DIM)
        .map(|i| -(seed + f32::from(layer) * 1000.0 + i as f32))
        .collect();
    (k, v)
}

pub async fn write_layers(w: &mut GrantWriter, layers: std::ops::Range<u16>, seed: f32) {
    let n = w.grant().prompt_tokens as usize;
    for layer in layers {
        let (k, v) = layer_kv(n, layer, seed);
        w.write_layer(layer, &k, &v).await.expect("write layer");
    }
}

/// Reads every prompt position of `res` through the checked reader and
/// compares with the data written with `seed` (as an f16 pool rounds it,
/// for one); checks that exactly the prompt is readable (watermarks),
/// nothing past it.
pub fn assert_prompt(res: &Reservation, prompt: usize, seed: f32) {
    let reader = res.reader();
    for layer in 0..N_LAYERS as u16 {
        assert_eq!(
            res.written_tokens(layer.into()),
            prompt,
            "readable = the prompt, layer {layer}"
        );
        let (k, v) = layer_kv(prompt, layer, seed);
        for (i, entry) in res.table().iter().enumerate() {
            let before = i * PAGE_SIZE;
            if before >= prompt {
                break;
            }
            let slots = (prompt - before).min(PAGE_SIZE);
            let s = reader
                .read_page(*entry, layer.into(), slots)
                .expect("verified prompt is readable");
            let stored = |x: &[f32]| -> Vec<f32> {
                match s.k.dtype() {
                    KvDtype::F32 => x.to_vec(),
                    KvDtype::F16 => x.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
                }
            };
            assert_eq!(
                s.k.to_f32(),
                stored(&k[before * KV_DIM..(before + slots) * KV_DIM])
            );
            assert_eq!(
                s.v.to_f32(),
                stored(&v[before * KV_DIM..(before + slots) * KV_DIM])
            );
        }
    }
}

/// A writer that speaks the wire protocol by hand (TCP), to send what a
/// correct writer never would: late, duplicate, forged, short.
pub struct RawWriter {
    pub id: WriterId,
    stream: TcpStream,
}

impl RawWriter {
    /// A TCP connection that has not said anything yet (the decode node's
    /// Challenge waits in it).
    pub async fn unauthenticated(node: &Node) -> Self {
        let addr = node
            .endpoint()
            .strip_prefix("tcp://")
            .expect("tcp node")
            .to_owned();
        let stream = TcpStream::connect(addr).await.expect("connect");
        Self {
            id: WriterId::mint().expect("rng"),
            stream,
        }
    }

    /// The decode node's Challenge nonce.
    pub async fn challenge(&mut self) -> [u8; NONCE_LEN] {
        let bytes = self.recv().await.expect("a challenge");
        match decode_message(&bytes).expect("challenge").0 {
            Message::Challenge(c) => c.nonce,
            other => panic!("expected a challenge, got {other:?}"),
        }
    }

    /// The Hello a writer holding `secret` sends for `challenge`.
    pub fn hello(&self, secret: &MeshSecret, challenge: &[u8; NONCE_LEN]) -> Hello {
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).expect("rng");
        Hello {
            writer: self.id,
            nonce,
            proof: hello_proof(secret, challenge, &nonce, self.id),
        }
    }

    /// Connects and authenticates with the node's secret, checking the
    /// Welcome's proof.
    pub async fn connect(node: &Node) -> Self {
        let mut raw = Self::unauthenticated(node).await;
        let challenge = raw.challenge().await;
        let hello = raw.hello(&node.secret, &challenge);
        raw.send(&Message::Hello(hello)).await;
        match raw.recv().await {
            Some(bytes) => match decode_message(&bytes).expect("welcome").0 {
                Message::Welcome(w) => {
                    assert!(welcome_ok(&node.secret, &challenge, &hello, &w))
                }
                other => panic!("expected a welcome, got {other:?}"),
            },
            None => panic!("no welcome"),
        }
        raw
    }

    /// Whether the decode node closed the connection within 5 s (whatever
    /// it sent before is read and dropped).
    pub async fn closed_by_peer(&mut self) -> bool {
        self.closed_within(Duration::from_secs(5)).await
    }

    /// Whether the decode node closed the connection within `d`.
    pub async fn closed_within(&mut self, d: Duration) -> bool {
        let mut b = [0u8; 4096];
        let drain = async {
            loop {
                match self.stream.read(&mut b).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        };
        tokio::time::timeout(d, drain).await.is_ok()
    }

    pub async fn send(&mut self, m: &Message<'_>) {
        let mut bytes = Vec::new();
        m.encode(&mut bytes).expect("encode");
        self.send_bytes(&bytes).await;
    }

    pub async fn send_bytes(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("send");
    }

    /// The next whole message, or `None` at end of stream.
    pub async fn recv(&mut self) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; HEADER_LEN];
        if self.stream.read_exact(&mut buf).await.is_err() {
            return None;
        }
        let h = peek_header(&buf, &DecodeLimits::default()).expect("header");
        buf.resize(h.message_len(), 0);
        self.stream.read_exact(&mut buf[HEADER_LEN..]).await.ok()?;
        Some(buf)
    }
}

/// Encodes the frames a correct writer would send for `grant`'s layer
/// `layer`, one per page.
pub fn frames_for(grant: &Grant, layer: u16, seed: f32) -> Vec<Vec<u8>> {
    use kvmesh_kvwire::{f32s_to_le, KvFrame};
    let n = grant.prompt_tokens as usize;
    let (k, v) = layer_kv(n, layer, seed);
    let mut out = Vec::new();
    for (i, page) in grant.pages.iter().enumerate() {
        let slots = grant.prompt_slots(i).expect("page") as usize;
        let r = i * PAGE_SIZE * KV_DIM..(i * PAGE_SIZE + slots) * KV_DIM;
        let mut payload = Vec::new();
        f32s_to_le(&k[r.clone()], &mut payload);
        f32s_to_le(&v[r], &mut payload);
        let f = KvFrame {
            reservation: grant.reservation,
            capability: grant.capability.clone(),
            page_index: i as u32,
            page: PageRef {
                page: page.page,
                generation: page.generation,
            },
            geometry: grant.geometry,
            layers: layer..layer + 1,
            slots: 0..slots as u32,
            payload: &payload,
        };
        let mut bytes = Vec::new();
        f.encode(&mut bytes).expect("encode frame");
        out.push(bytes);
    }
    out
}

/// The checksums `TransferDone` carries for data written with `seed`.
pub fn checksums_for(grant: &Grant, seed: f32) -> Vec<u64> {
    use kvmesh_kvwire::Checksummer;
    let n = grant.prompt_tokens as usize;
    let mut sums = vec![Checksummer::new(); grant.pages.len()];
    for layer in 0..grant.geometry.n_layers {
        let (k, v) = layer_kv(n, layer, seed);
        for (i, h) in sums.iter_mut().enumerate() {
            let slots = grant.prompt_slots(i).expect("page") as usize;
            let r = i * PAGE_SIZE * KV_DIM..(i * PAGE_SIZE + slots) * KV_DIM;
            h.update_f32s(&k[r.clone()]);
            h.update_f32s(&v[r]);
        }
    }
    sums.iter().map(Checksummer::finish).collect()
}
