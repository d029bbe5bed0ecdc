//! Mesh roles as separate processes from one mesh file (`kvmesh
//! router|prefill|decode --config F`), and the per-mesh secret file they
//! share.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A port that was free a moment ago, for a mesh file (which must name
/// its ports before any process binds them). Drawn below Linux's ephemeral
/// range (32768 and up), so the many outbound connections of the tests
/// running meanwhile cannot take it between this call and the bind, and
/// never handed out twice by one test process.
pub fn free_port() -> u16 {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static GIVEN: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    let given = GIVEN.get_or_init(Mutex::default);
    let mut seed = std::process::id() as u64
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    for _ in 0..10_000 {
        // xorshift: spread the draws over 20000..32000.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let port = 20_000 + (seed % 12_000) as u16;
        let mut g = given
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if g.contains(&port) {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            g.insert(port);
            return port;
        }
    }
    panic!("no free port in 20000..32000")
}

/// Writes 32 random bytes to `dir/name` (owner-only), as an operator makes
/// a mesh secret; returns the path.
pub fn write_secret(dir: &Path, name: &str) -> PathBuf {
    use std::os::unix::fs::OpenOptionsExt;
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|f| f.take(32).read_exact(&mut b))
        .expect("random bytes");
    let p = dir.join(name);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&p)
        .expect("create secret file");
    std::io::Write::write_all(&mut f, &b).expect("write secret");
    p
}

/// A running role; killed on drop.
#[derive(Debug)]
pub struct Proc {
    child: Child,
    logs: Option<mpsc::Receiver<String>>,
    /// Its stdout.
    out: mpsc::Receiver<String>,
    /// What it said with `READY=1`.
    ready: kvmesh_ready::Ready,
    /// Its notify socket, for what it says after (`STOPPING=1`).
    notices: kvmesh_ready::Waiter,
}

impl Proc {
    /// Sends SIGTERM, as an orchestrator stops a process.
    pub fn terminate(&self) {
        terminate(&self.child);
    }

    /// Its process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status, waiting at most `within`; `None` if still running.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        wait_exit(&mut self.child, within)
    }

    /// What it said with `READY=1` (`KVMESH_HTTP`, `KVMESH_LISTEN`, ...).
    pub fn ready(&self) -> &kvmesh_ready::Ready {
        &self.ready
    }

    /// Whether it said `KEY=value` (`STOPPING=1`, say) within `within`,
    /// running or exited since.
    pub fn notified(&self, key: &str, value: &str, within: Duration) -> bool {
        self.notices
            .wait_for(within, || None, |r| r.get(key) == Some(value))
            .is_ok()
    }

    /// The next line of its stdout containing `needle` (lines before are
    /// skipped), waiting at most `within`.
    pub fn out_line(&self, needle: &str, within: Duration) -> Option<String> {
        next_line(&self.out, |l| l.contains(needle), within)
    }

    /// The next line of its log (stderr) containing `needle`, waiting at
    /// most `within`; only for [`start_logged`] processes.
    pub fn log_line(&self, needle: &str, within: Duration) -> Option<String> {
        next_line(self.logs.as_ref()?, |l| l.contains(needle), within)
    }
}

/// The next line from `lines` that `wanted` accepts, waiting at most
/// `within`.
pub(crate) fn next_line(
    lines: &mpsc::Receiver<String>,
    wanted: impl Fn(&str) -> bool,
    within: Duration,
) -> Option<String> {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        match lines.recv_timeout(left) {
            Ok(l) if wanted(&l) => return Some(l),
            Ok(_) => {}
            Err(_) => return None,
        }
    }
}

/// A child's stderr, piped: echoed to the test's stderr and sent on, line
/// by line (`None` if it was not piped).
pub(crate) fn capture_stderr(child: &mut Child) -> Option<mpsc::Receiver<String>> {
    child.stderr.take().map(|err| {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("{l}");
                let _ = tx.send(l);
            }
        });
        rx
    })
}

/// Sends `child` SIGTERM, as an orchestrator stops a process.
pub(crate) fn terminate(child: &Child) {
    let pid = libc::pid_t::try_from(child.id()).expect("pid");
    // SAFETY: kill(2) with a pid this test spawned and still holds (not
    // yet reaped, so not reused) and a valid signal number.
    let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
    assert_eq!(rc, 0, "kill -TERM {pid}");
}

/// `child`'s exit status, waiting at most `within`; `None` if it still runs.
pub(crate) fn wait_exit(child: &mut Child, within: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            return Some(s);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How long a role may take to say it serves (loading the model included,
/// on a loaded CI machine).
const READY_WITHIN: Duration = Duration::from_secs(300);

/// Starts `kvmesh ROLE --config F [--name N]` (log level warn, stderr
/// inherited); returns once it said `READY=1` ([`kvmesh_ready`]).
pub fn start(role: &str, config: &Path, name: Option<&str>) -> Proc {
    spawn(role, config, name, None, &[])
}

/// [`start`] with extra flags (`--fault-injection`, say).
pub fn start_with(role: &str, config: &Path, name: Option<&str>, args: &[&str]) -> Proc {
    spawn(role, config, name, None, args)
}

/// [`start`] with the log filter `filter` (`KVMESH_LOG`) and its stderr
/// captured for [`Proc::log_line`] (and echoed to the test's stderr).
pub fn start_logged(role: &str, config: &Path, name: Option<&str>, filter: &str) -> Proc {
    spawn(role, config, name, Some(filter), &[])
}

/// [`start_logged`] with extra flags.
pub fn start_logged_with(
    role: &str,
    config: &Path,
    name: Option<&str>,
    filter: &str,
    args: &[&str],
) -> Proc {
    spawn(role, config, name, Some(filter), args)
}

fn spawn(
    role: &str,
    config: &Path,
    name: Option<&str>,
    filter: Option<&str>,
    args: &[&str],
) -> Proc {
    spawn_in(None, role, config, name, filter, args, &[])
}

/// [`start_logged_with`] (or [`start_with`], `filter` `None`) with the
/// environment variables `envs`, inside the network namespace `netns` (`ip
/// netns exec`, which also shows the process that namespace's
/// `/sys/class/net`, as UCX reads it); the process gets SIGKILL if this
/// test process dies, so it cannot outlive its lab. The readiness socket
/// is a path, which a process in another network namespace reaches too.
pub fn start_in_netns(
    netns: &str,
    role: &str,
    config: &Path,
    name: Option<&str>,
    filter: Option<&str>,
    args: &[&str],
    envs: &[(&str, &str)],
) -> Proc {
    spawn_in(Some(netns), role, config, name, filter, args, envs)
}

fn spawn_in(
    netns: Option<&str>,
    role: &str,
    config: &Path,
    name: Option<&str>,
    filter: Option<&str>,
    args: &[&str],
    envs: &[(&str, &str)],
) -> Proc {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(crate::kvmesh_bin());
            c
        }
        None => Command::new(crate::kvmesh_bin()),
    };
    cmd.arg(role).arg("--config").arg(config).args(args);
    if let Some(n) = name {
        cmd.args(["--name", n]);
    }
    let waiter = kvmesh_ready::Waiter::new().expect("a readiness socket");
    cmd.envs(envs.iter().copied())
        .env("KVMESH_LOG", filter.unwrap_or("warn"))
        .env(kvmesh_ready::NOTIFY_SOCKET, waiter.path())
        .stdout(Stdio::piped())
        .stderr(if filter.is_some() {
            Stdio::piped()
        } else {
            Stdio::inherit()
        });
    let mut child = match netns {
        Some(_) => crate::etcd::spawn_owned(cmd),
        None => cmd.spawn().expect("spawn"),
    };
    let logs = capture_stderr(&mut child);
    let out = forward_lines(child.stdout.take().expect("stdout"));
    let ready = waiter.wait(READY_WITHIN, || {
        child.try_wait().ok().flatten().map(|s| s.to_string())
    });
    let ready = match ready {
        Ok(r) => r,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{role} {} never ready: {e}", name.unwrap_or_default());
        }
    };
    Proc {
        child,
        logs,
        out,
        ready,
        notices: waiter,
    }
}

/// `out`'s lines, sent on as they come.
pub(crate) fn forward_lines(out: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    rx
}

/// A mesh file in `dir` for one prefill and one decode node on the
/// committed tiny model, with a fresh secret (`mesh.secret` beside it) and
/// free ports; returns the file and the ports: router HTTP, router gRPC,
/// prefill gRPC, decode gRPC, decode KV.
pub fn tiny_mesh_file(dir: &Path) -> (PathBuf, [u16; 5]) {
    let p: [u16; 5] = std::array::from_fn(|_| free_port());
    write_secret(dir, "mesh.secret");
    let text = format!(
        "model: {}\nmesh: {{secret_file: mesh.secret}}\n\
         router: {{http: \"127.0.0.1:{}\", grpc: \"127.0.0.1:{}\"}}\n\
         prefill:\n  - {{name: prefill-0, grpc: \"127.0.0.1:{}\"}}\n\
         decode:\n  - {{name: decode-0, grpc: \"127.0.0.1:{}\", kv: \"127.0.0.1:{}\"}}\n",
        crate::tiny_model_dir().display(),
        p[0],
        p[1],
        p[2],
        p[3],
        p[4]
    );
    let file = dir.join("mesh.yaml");
    std::fs::write(&file, text).expect("write mesh file");
    (file, p)
}

/// A mesh file in `dir` for 2 prefill and 2 decode nodes (`prefill-0`,
/// `prefill-1`, `decode-0`, `decode-1`) on the committed tiny model, pages
/// of 8 tokens, pools of 2048 tokens (room for every conversation of a
/// test in the prefix cache), room for 32 running requests, a fresh secret and free
/// ports; returns the file and the router's HTTP address.
pub fn two_by_two_mesh_file(dir: &Path) -> (PathBuf, String) {
    let p: Vec<u16> = (0..8).map(|_| free_port()).collect();
    let secret = write_secret(dir, "mesh.secret");
    let text = format!(
        "model: {model}\npage_size: 8\nmesh: {{secret_file: {secret}}}\n\
         router: {{http: \"127.0.0.1:{}\", grpc: \"127.0.0.1:{}\", max_running: 32}}\n\
         prefill:\n  - {{name: prefill-0, grpc: \"127.0.0.1:{}\", kv_pool_tokens: 2048}}\n  - {{name: prefill-1, grpc: \"127.0.0.1:{}\", kv_pool_tokens: 2048}}\n\
         decode:\n  - {{name: decode-0, grpc: \"127.0.0.1:{}\", kv: \"127.0.0.1:{}\", kv_pool_tokens: 2048}}\n  - {{name: decode-1, grpc: \"127.0.0.1:{}\", kv: \"127.0.0.1:{}\", kv_pool_tokens: 2048}}\n",
        p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7],
        model = crate::tiny_model_dir().display(),
        secret = secret.display(),
    );
    let file = dir.join("mesh.yaml");
    std::fs::write(&file, text).expect("write mesh file");
    (file, format!("127.0.0.1:{}", p[0]))
}

/// The processes of [`two_by_two_mesh_file`]'s mesh, started and healthy,
/// with every node's first load report in: decode-0, decode-1, prefill-0,
/// prefill-1, router.
pub fn start_two_by_two(file: &Path, addr: &str) -> Vec<Proc> {
    let mut procs = Vec::new();
    for (role, name) in [
        ("decode", "decode-0"),
        ("decode", "decode-1"),
        ("prefill", "prefill-0"),
        ("prefill", "prefill-1"),
    ] {
        procs.push(start(role, file, Some(name)));
    }
    procs.push(start("router", file, None));
    wait_healthy(addr);
    wait_nodes_up(addr, &["decode-0", "decode-1", "prefill-0", "prefill-1"]);
    procs
}

/// Waits (bounded: 30 s) until the router at `addr` reports every one of
/// `nodes` up (`kvmesh_node_up`: a load poll found it).
pub fn wait_nodes_up(addr: &str, nodes: &[&str]) {
    wait_nodes(addr, nodes, true);
}

/// Waits (bounded: 30 s) until the router at `addr` has taken `node` out
/// (`kvmesh_node_up` 0: a load poll or a failed request found it down).
pub fn wait_node_down(addr: &str, node: &str) {
    wait_nodes(addr, &[node], false);
}

fn wait_nodes(addr: &str, nodes: &[&str], up: bool) {
    let want = if up { 1.0 } else { 0.0 };
    let t0 = Instant::now();
    loop {
        let m = crate::http::metrics(addr);
        if nodes
            .iter()
            .all(|n| m.first("kvmesh_node_up", &[("node", n)]) == Some(want))
        {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the router never saw {nodes:?} {}:\n{}",
            if up { "up" } else { "down" },
            m.text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits (bounded: 30 s) until the gateway at `addr` answers `/health`.
pub fn wait_healthy(addr: &str) {
    let t0 = Instant::now();
    while crate::http::get(addr, "/health").status != 200 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "router at {addr} never healthy"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
