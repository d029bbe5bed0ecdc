//! A writer in another process, killed or hanging up in the middle of a
//! one-sided write: the decode node must not free the pages while that
//! process can still write them, and must free them once it cannot.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvmesh_kvwire::{decode_message, Message, WriterId};
use kvmesh_kvxfer::handshake::{Outcome, RevokeCause};
use kvmesh_kvxfer::shm::{ShmRegion, WriteKey};
use kvmesh_kvxfer::transport::client::KvClient;
use kvmesh_meshauth::MeshSecret;
use tokio::sync::mpsc;

use super::common::*;

const ENV_ENDPOINT: &str = "KVMESH_TEST_WRITER_ENDPOINT";
const ENV_SHM: &str = "KVMESH_TEST_WRITER_SHM";
const ENV_MODE: &str = "KVMESH_TEST_WRITER_MODE";
const ENV_SECRET: &str = "KVMESH_TEST_WRITER_SECRET_FILE";

/// The child's side. Does nothing unless started by the tests below.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run as a child process by the writer-crash tests"]
async fn child_writer() {
    let (Ok(endpoint), Ok(shm), Ok(mode), Ok(secret)) = (
        std::env::var(ENV_ENDPOINT),
        std::env::var(ENV_SHM),
        std::env::var(ENV_MODE),
        std::env::var(ENV_SECRET),
    ) else {
        return;
    };
    let secret = MeshSecret::load(std::path::Path::new(&secret)).expect("mesh secret");
    let client = KvClient::connect(&endpoint, WriterId::mint().expect("rng"), &secret)
        .await
        .expect("connect");
    println!("connected");
    let line = tokio::task::spawn_blocking(|| {
        let mut l = String::new();
        std::io::stdin().read_line(&mut l).map(|_| l)
    })
    .await
    .expect("join")
    .expect("grant line");
    let bytes: Vec<u8> = (0..line.trim().len() / 2)
        .map(|i| u8::from_str_radix(&line.trim()[2 * i..2 * i + 2], 16).expect("hex"))
        .collect();
    let Message::Grant(grant) = decode_message(&bytes).expect("grant").0 else {
        panic!("not a grant")
    };
    let key = WriteKey::from_u64(grant.write_key);
    let mut w = client.begin(grant).expect("begin");
    write_layers(&mut w, 0..1, 42.0).await;
    if shm.is_empty() {
        // UCX: the endpoint is bound and layer 0's puts are posted, not
        // flushed; the parent kills this process now.
        println!("posted");
        tokio::time::sleep(Duration::from_secs(120)).await;
        return;
    }
    let region = ShmRegion::open(std::path::Path::new(&shm), None).expect("map");
    region.freeze_inside_lane(key).expect("freeze");
    println!("frozen");
    if mode == "hang_up" {
        drop(w);
        drop(client);
        println!("hung up");
    }
    tokio::time::sleep(Duration::from_secs(120)).await;
}

struct Writer {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Writer {
    fn spawn(node: &Node, mode: &str) -> Self {
        let shm = node.shm.clone().unwrap_or_default();
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "child::child_writer",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ENV_ENDPOINT, node.endpoint())
            .env(ENV_SHM, shm)
            .env(ENV_MODE, mode)
            .env(ENV_SECRET, &node.secret_file)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn writer process");
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel(16);
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                // Shown with the test's output if it fails.
                println!("writer process: {l}");
                if tx.blocking_send(l).is_err() {
                    break;
                }
            }
        });
        Self { child, lines }
    }

    async fn expect_line(&mut self, want: &str) {
        let got = tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(l) = self.lines.recv().await {
                // libtest prints "test NAME ... " before the first line.
                if l.trim().ends_with(want) {
                    return true;
                }
            }
            false
        })
        .await;
        assert_eq!(got, Ok(true), "the writer process never said {want:?}");
    }

    fn send_grant(&mut self, grant: &kvmesh_kvwire::Grant) {
        let mut bytes = Vec::new();
        grant.encode(&mut bytes).expect("encode");
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let stdin = self.child.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{hex}").expect("send grant");
    }

    fn kill(mut self) {
        self.child.kill().expect("kill");
        self.child.wait().expect("reap");
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a writer process, grants it 12 + 2 tokens (4 pages), and waits
/// until it is frozen inside a one-sided write.
async fn frozen_writer(node: &Node, mode: &str) -> (Writer, kvmesh_kvxfer::handshake::Pending) {
    let mut w = Writer::spawn(node, mode);
    w.expect_line("connected").await;
    wait_for("writer registered", || {
        node.table.connected_writers().len() == 1
    })
    .await;
    let writer = node.table.connected_writers()[0];
    let (grant, pending) = node
        .table
        .reserve(Node::request(12, 2, writer))
        .expect("reserve");
    w.send_grant(&grant);
    w.expect_line("frozen").await;
    (w, pending)
}

/// Killed mid-write: the connection resets and the pidfd says the process
/// is gone, so the frozen write can never land; the pages are freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_process_killed_mid_write_shm() {
    let node = Node::start(TransportKind::Shm).await;
    let (w, pending) = frozen_writer(&node, "kill").await;
    assert_eq!(node.free(), N_PAGES - 4);
    w.kill();
    let ended = pending.wait().await.expect_err("revoked");
    assert_eq!(ended.outcome, Outcome::Revoked(RevokeCause::WriterLost));
    node.assert_idle().await;
    assert_eq!(node.table.stats().ended_total(), 1);
}

/// The writer hangs up but its process lives on inside a write: the
/// revocation cannot complete, so the pages stay quarantined (never freed
/// on the hang-up, never on a timer) until the process is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_hangs_up_inside_a_write_pages_stay_quarantined_shm() {
    let node = Node::start(TransportKind::Shm).await;
    let (mut w, pending) = frozen_writer(&node, "hang_up").await;
    w.expect_line("hung up").await;
    wait_for("quarantined", || node.table.stats().revoking == 1).await;
    // Well past the abort timeout (300 ms) and many ticks: still held.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let s = node.table.stats();
    assert_eq!((s.revoking, s.ended_total()), (1, 0), "{s:?}");
    assert_eq!(
        node.free(),
        N_PAGES - 4,
        "pages a live writer can reach stay held"
    );
    w.kill();
    let ended = pending.wait().await.expect_err("revoked");
    assert_eq!(ended.outcome, Outcome::Revoked(RevokeCause::WriterLost));
    node.assert_idle().await;
    assert_eq!(node.table.stats().ended_total(), 1);
}

/// UCX: a writer process killed with its endpoint bound and puts posted.
/// Its endpoint fails at the decode node, the connection is lost, and the
/// revocation (the endpoint's close) completes: the pages are freed, the
/// reservation ends once, as writer lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_process_killed_mid_put_ucx() {
    if let Err(e) = kvmesh_ucx::load() {
        eprintln!("not run: {e}");
        return;
    }
    let node = Node::start(TransportKind::Ucx).await;
    let mut w = Writer::spawn(&node, "kill");
    w.expect_line("connected").await;
    wait_for("writer registered", || {
        node.table.connected_writers().len() == 1
    })
    .await;
    let writer = node.table.connected_writers()[0];
    let (grant, pending) = node
        .table
        .reserve(Node::request(12, 2, writer))
        .expect("reserve");
    w.send_grant(&grant);
    w.expect_line("posted").await;
    assert_eq!(node.free(), N_PAGES - 4);
    w.kill();
    let ended = pending.wait().await.expect_err("revoked");
    assert_eq!(ended.outcome, Outcome::Revoked(RevokeCause::WriterLost));
    node.assert_idle().await;
    assert_eq!(node.table.stats().ended_total(), 1);
}
