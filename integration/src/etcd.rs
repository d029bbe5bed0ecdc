//! A real etcd on loopback for the membership tests (Debian's
//! `etcd-server`; `scripts/test.sh` installs it when missing), and meshes
//! whose nodes find each other through it (`discovery: etcd`).
//!
//! One etcd per test binary ([`Etcd::shared`]), each test under a key
//! prefix of its own ([`unique_prefix`]); a test that stops etcd starts its
//! own ([`Etcd::start`]). Every etcd runs on free ports with its data in a
//! temporary directory, and dies with the test process even if that is
//! killed (it is spawned by a thread that lives as long as the process,
//! with `PR_SET_PDEATHSIG`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crate::roles::{free_port, start_logged_with, start_with, write_secret, Proc};

/// The `etcd` binary: `$KVMESH_ETCD`, or `etcd` on `PATH`.
pub fn etcd_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVMESH_ETCD") {
        return PathBuf::from(p);
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "no `etcd` on PATH: the membership tests run a real etcd; install Debian's \
                 etcd-server (`apt-get install -y etcd-server`; scripts/test.sh does) or set KVMESH_ETCD"
            )
        })
}

/// Spawns `cmd` from a thread that never ends, with the child set to get
/// SIGKILL when that thread (so the test process) dies: no etcd (or lab
/// process) outlives its tests.
pub(crate) fn spawn_owned(mut cmd: Command) -> Child {
    type Job = (Command, mpsc::Sender<std::io::Result<Child>>);
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::spawn(move || {
            for (mut cmd, reply) in rx {
                let _ = reply.send(cmd.spawn());
            }
            // Every sender is static: this is never reached while the
            // process lives; park anyway rather than end the thread.
            loop {
                std::thread::park();
            }
        });
        Mutex::new(tx)
    });
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl(2) with PR_SET_PDEATHSIG and a valid signal is
    // async-signal-safe and touches nothing of the parent's memory.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let (tx, rx) = mpsc::channel();
    spawner
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .send((cmd, tx))
        .expect("the spawner thread");
    rx.recv()
        .expect("the spawner thread")
        .unwrap_or_else(|e| panic!("spawn: {e}"))
}

/// One etcd member on loopback, or on a lab host's address inside its
/// network namespace ([`Etcd::start_in`]).
#[derive(Debug)]
pub struct Etcd {
    child: Mutex<Option<Child>>,
    host: String,
    client_port: u16,
    peer_port: u16,
    /// Plain HTTP `/health` and `/metrics` (its client URL may be TLS).
    metrics_port: u16,
    dir: tempfile::TempDir,
    /// The network namespace it runs in (`None`: this process's).
    netns: Option<String>,
    tls: Option<EtcdServerTls>,
}

/// The files of an etcd that serves clients over TLS and asks each for a
/// certificate of `ca` (`--client-cert-auth`).
#[derive(Clone, Debug)]
pub struct EtcdServerTls {
    /// Its certificate (naming 127.0.0.1).
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
    /// The CA client certificates must chain to.
    pub ca: PathBuf,
}

impl Etcd {
    /// The etcd every test of this binary shares (started on first use).
    pub fn shared() -> &'static Etcd {
        static SHARED: OnceLock<Etcd> = OnceLock::new();
        SHARED.get_or_init(Etcd::start)
    }

    /// A new etcd of its own (for a test that stops and restarts it).
    pub fn start() -> Etcd {
        Self::start_with(None)
    }

    /// A new etcd of its own that serves clients over TLS only and admits
    /// only clients with a certificate of `tls.ca`.
    pub fn start_tls(tls: EtcdServerTls) -> Etcd {
        Self::start_with(Some(tls))
    }

    fn start_with(tls: Option<EtcdServerTls>) -> Etcd {
        let e = Etcd {
            child: Mutex::new(None),
            host: "127.0.0.1".into(),
            client_port: free_port(),
            peer_port: free_port(),
            metrics_port: free_port(),
            dir: tempfile::tempdir().expect("tempdir"),
            tls,
            netns: None,
        };
        e.launch();
        e
    }

    /// A new etcd inside the network namespace `netns`, listening on
    /// `host`'s ports 2379 and 2380 there (a lab host, `crate::netlab`);
    /// this handle's calls to it run inside that namespace too.
    pub fn start_in(netns: &str, host: std::net::Ipv4Addr) -> Etcd {
        let e = Etcd {
            child: Mutex::new(None),
            host: host.to_string(),
            client_port: 2379,
            peer_port: 2380,
            metrics_port: 2381,
            dir: tempfile::tempdir().expect("tempdir"),
            tls: None,
            netns: Some(netns.to_owned()),
        };
        e.launch();
        e
    }

    /// `HOST:PORT` of its client URL (`127.0.0.1` unless in a lab).
    pub fn endpoint(&self) -> String {
        format!("{}:{}", self.host, self.client_port)
    }

    /// Runs `f` where this etcd is reachable: here, or on a thread inside
    /// its namespace.
    fn near<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        match &self.netns {
            Some(ns) => crate::netlab::ns::enter(ns, f),
            None => f(),
        }
    }

    /// Its client URL's scheme.
    fn scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    fn launch(&self) {
        let peer = format!("http://{}:{}", self.host, self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("etcd.log"))
            .expect("etcd log file");
        let mut cmd = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(etcd_bin());
                c
            }
            None => Command::new(etcd_bin()),
        };
        let scheme = self.scheme();
        cmd.arg("--name=kvmesh-test")
            .arg(format!(
                "--data-dir={}",
                self.dir.path().join("data").display()
            ))
            .arg(format!(
                "--listen-client-urls={scheme}://{}",
                self.endpoint()
            ))
            .arg(format!(
                "--advertise-client-urls={scheme}://{}",
                self.endpoint()
            ))
            .arg(format!(
                "--listen-metrics-urls=http://127.0.0.1:{}",
                self.metrics_port
            ))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=kvmesh-test={peer}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(t) = &self.tls {
            cmd.arg(format!("--cert-file={}", t.cert.display()))
                .arg(format!("--key-file={}", t.key.display()))
                .arg(format!("--trusted-ca-file={}", t.ca.display()))
                .arg("--client-cert-auth");
        }
        let started = Instant::now();
        let child = spawn_owned(cmd);
        *self.child.lock().unwrap_or_else(PoisonError::into_inner) = Some(child);
        // Up once it answers its health endpoint (a leader elected).
        loop {
            // Its metrics listener is on the loopback of its namespace.
            let metrics = format!("127.0.0.1:{}", self.metrics_port);
            let ok = self.near(|| {
                kvmesh_client::blocking::get(&metrics, "/health")
                    .is_ok_and(|r| r.status == 200 && r.text().contains("true"))
            });
            if ok {
                break;
            }
            if let Some(status) = self
                .child
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("etcd exited ({status}):\n{}", self.log_tail());
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "etcd never healthy:\n{}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!(
            "etcd up at {} in {:.2} s",
            self.endpoint(),
            started.elapsed().as_secs_f64()
        );
    }

    /// The end of its log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
        crate::tail(&text, 20)
    }

    /// SIGKILL: etcd is gone at once, as a crashed or partitioned one.
    pub fn kill(&self) {
        if let Some(mut c) = self
            .child
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same ports and data (its leases and keys
    /// come back).
    pub fn restart(&self) {
        self.kill();
        self.launch();
    }

    /// Starts it again on the same ports without its data, as a member
    /// whose volume was lost: every lease and key is gone.
    pub fn restart_empty(&self) {
        self.kill();
        let data = self.dir.path().join("data");
        std::fs::remove_dir_all(&data).unwrap_or_else(|e| panic!("{}: {e}", data.display()));
        self.launch();
    }

    /// Runs `f` with a client of this etcd, on a runtime of its own.
    fn with_client<T: Send>(
        &self,
        f: impl AsyncFnOnce(&mut etcd_client::Client) -> Result<T, etcd_client::Error> + Send,
    ) -> Result<T, etcd_client::Error> {
        self.near(|| self.with_client_here(f))
    }

    fn with_client_here<T>(
        &self,
        f: impl AsyncFnOnce(&mut etcd_client::Client) -> Result<T, etcd_client::Error>,
    ) -> Result<T, etcd_client::Error> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let mut c = etcd_client::Client::connect([self.endpoint()], None).await?;
            match tokio::time::timeout(Duration::from_secs(5), f(&mut c)).await {
                Ok(r) => r,
                Err(_) => Err(etcd_client::Error::WatchError("timed out".into())),
            }
        })
    }

    /// The keys under `prefix`, sorted.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        let mut keys: Vec<String> = self
            .with_client(async |c| {
                c.get(
                    prefix,
                    Some(
                        etcd_client::GetOptions::new()
                            .with_prefix()
                            .with_keys_only(),
                    ),
                )
                .await
            })
            .unwrap_or_else(|e| panic!("etcd get {prefix}: {e}"))
            .kvs()
            .iter()
            .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
            .collect();
        keys.sort();
        keys
    }

    /// Deletes `key`.
    pub fn delete(&self, key: &str) {
        self.with_client(async |c| c.delete(key, None).await.map(|_| ()))
            .unwrap_or_else(|e| panic!("etcd delete {key}: {e}"));
    }

    /// Writes `key` = `value` (no lease).
    pub fn put(&self, key: &str, value: &[u8]) {
        self.with_client(async |c| c.put(key, value, None).await.map(|_| ()))
            .unwrap_or_else(|e| panic!("etcd put {key}: {e}"));
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A key prefix no other test (or run) uses: `/kvmesh-test/PID-N-NAME/`.
pub fn unique_prefix(name: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "/kvmesh-test/{}-{}-{name}/",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A mesh whose nodes find each other through etcd: one mesh file (tiny
/// model, free ports, a fresh secret) naming every node it may run.
#[derive(Debug)]
pub struct EtcdMesh {
    dir: tempfile::TempDir,
    /// The mesh file.
    pub file: PathBuf,
    /// The key prefix.
    pub prefix: String,
    /// The router's HTTP `HOST:PORT`.
    pub http: String,
    /// The router's public gRPC `HOST:PORT`.
    pub grpc: String,
}

impl EtcdMesh {
    /// A mesh file for `nodes` (`(role, name)`) on the committed tiny
    /// model, registering in `etcd` under a prefix of its own, with the
    /// default lease TTL.
    pub fn new(etcd: &Etcd, test: &str, nodes: &[(&str, &str)]) -> Self {
        Self::with_model(etcd, test, nodes, &crate::tiny_model_dir(), "")
    }

    /// [`EtcdMesh::new`] on `model`, with `extra` mesh-file lines
    /// (`max_model_len: 1024\n`, say).
    pub fn with_model(
        etcd: &Etcd,
        test: &str,
        nodes: &[(&str, &str)],
        model: &Path,
        extra: &str,
    ) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let prefix = unique_prefix(test);
        let secret = write_secret(dir.path(), "mesh.secret");
        let (file, http, grpc) = mesh_file(dir.path(), etcd, &prefix, &secret, nodes);
        let text = std::fs::read_to_string(&file).expect("mesh file");
        let text = text.replacen(
            &format!("model: {}\n", crate::tiny_model_dir().display()),
            &format!("model: {}\n{extra}", model.display()),
            1,
        );
        std::fs::write(&file, text).expect("write mesh file");
        Self {
            dir,
            file,
            prefix,
            http,
            grpc,
        }
    }

    /// Another mesh file in this mesh's etcd prefix for `nodes`, with a
    /// secret of its own (not this mesh's): what an intruder who can write
    /// to etcd, but lacks the secret, would run. Returns the file and the
    /// secret's path.
    pub fn intruder_file(&self, etcd: &Etcd, nodes: &[(&str, &str)]) -> (PathBuf, PathBuf) {
        let dir = self.dir.path().join("intruder");
        std::fs::create_dir_all(&dir).expect("mkdir");
        let secret = write_secret(&dir, "other.secret");
        (
            mesh_file(&dir, etcd, &self.prefix, &secret, nodes).0,
            secret,
        )
    }

    /// Starts `kvmesh ROLE --config F --name N` with `flags`, its stderr
    /// logged at `info` when `logged` (for [`Proc::log_line`]); returns
    /// once it said `READY=1` (for a node: it is registered).
    pub fn start(&self, role: &str, name: Option<&str>, flags: &[&str], logged: bool) -> Proc {
        if logged {
            start_logged_with(role, &self.file, name, "info", flags)
        } else {
            start_with(role, &self.file, name, flags)
        }
    }
}

fn mesh_file(
    dir: &Path,
    etcd: &Etcd,
    prefix: &str,
    secret: &Path,
    nodes: &[(&str, &str)],
) -> (PathBuf, String, String) {
    let (http, grpc) = (free_port(), free_port());
    let mut text = format!(
        "model: {model}\nmesh: {{secret_file: {secret}}}\n\
         discovery: etcd\netcd: {{endpoints: [\"{endpoint}\"], prefix: \"{prefix}\", allow_insecure_etcd: true}}\n\
         router: {{http: \"127.0.0.1:{http}\", grpc: \"127.0.0.1:{grpc}\"}}\n",
        model = crate::tiny_model_dir().display(),
        secret = secret.display(),
        endpoint = etcd.endpoint(),
    );
    for role in ["prefill", "decode"] {
        text.push_str(&format!("{role}:\n"));
        for (_, name) in nodes.iter().filter(|(r, _)| *r == role) {
            let kv = if role == "decode" {
                format!(", kv: \"127.0.0.1:{}\"", free_port())
            } else {
                String::new()
            };
            text.push_str(&format!(
                "  - {{name: {name}, grpc: \"127.0.0.1:{}\"{kv}}}\n",
                free_port()
            ));
        }
    }
    let file = dir.join("mesh.yaml");
    std::fs::write(&file, text).expect("write mesh file");
    (
        file,
        format!("127.0.0.1:{http}"),
        format!("127.0.0.1:{grpc}"),
    )
}
