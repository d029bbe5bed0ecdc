//! `kvmesh serve` as a real process for the mesh tests.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::http;

/// A running `kvmesh serve`; killed on drop.
#[derive(Debug)]
pub struct Mesh {
    child: Child,
    /// The gateway's `HOST:PORT`.
    pub http: String,
    /// The public gRPC API's `HOST:PORT`.
    pub grpc: String,
    logs: Option<mpsc::Receiver<String>>,
    /// Its notify socket, for what it says after `READY=1`.
    notices: kvmesh_ready::Waiter,
}

impl Mesh {
    /// Starts `kvmesh serve --model MODEL` with any free ports and `extra`
    /// flags, and waits until it says `READY=1` with its addresses
    /// ([`kvmesh_ready`]) and reports healthy.
    pub fn start(model: &Path, extra: &[&str]) -> Self {
        Self::spawn(model, extra, None)
    }

    /// [`Mesh::start`] with the log filter `filter` (`KVMESH_LOG`) and the
    /// process's log (stderr) captured for [`Mesh::log_line`] (and echoed
    /// to the test's stderr).
    pub fn start_logged(model: &Path, extra: &[&str], filter: &str) -> Self {
        Self::spawn(model, extra, Some(filter))
    }

    /// The next line of the log (stderr) containing every one of
    /// `needles`, waiting at most `within`; only for [`Mesh::start_logged`]
    /// meshes.
    pub fn log_line(&self, needles: &[&str], within: Duration) -> Option<String> {
        crate::roles::next_line(
            self.logs.as_ref()?,
            |l| needles.iter().all(|n| l.contains(n)),
            within,
        )
    }

    fn spawn(model: &Path, extra: &[&str], filter: Option<&str>) -> Self {
        let mut cmd = Command::new(crate::kvmesh_bin());
        cmd.arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--http-port", "0", "--grpc-port", "0"])
            .args(extra)
            .env("KVMESH_LOG", filter.unwrap_or("warn"))
            .stdout(Stdio::piped())
            .stderr(if filter.is_some() {
                Stdio::piped()
            } else {
                Stdio::inherit()
            });
        let waiter = kvmesh_ready::Waiter::new().expect("a readiness socket");
        cmd.env(kvmesh_ready::NOTIFY_SOCKET, waiter.path());
        let mut child = cmd.spawn().expect("spawn kvmesh serve");
        let logs = crate::roles::capture_stderr(&mut child);
        // Stdout is read (and dropped) so the server never blocks on it.
        let _out = crate::roles::forward_lines(child.stdout.take().expect("stdout"));
        let ready = waiter.wait(Duration::from_secs(300), || {
            child.try_wait().ok().flatten().map(|s| s.to_string())
        });
        let (http, grpc) = match ready.and_then(|r| {
            Ok((
                r.require("KVMESH_HTTP")?.to_owned(),
                r.require("KVMESH_GRPC")?.to_owned(),
            ))
        }) {
            Ok(addrs) => addrs,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("kvmesh serve never ready: {e}");
            }
        };
        let mesh = Self {
            child,
            http,
            grpc,
            logs,
            notices: waiter,
        };
        let start = Instant::now();
        while http::get(&mesh.http, "/health").status != 200 {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "mesh never healthy"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        mesh
    }

    /// Whether it said `KEY=value` (`STOPPING=1`, say) within `within`,
    /// running or exited since.
    pub fn notified(&self, key: &str, value: &str, within: Duration) -> bool {
        self.notices
            .wait_for(within, || None, |r| r.get(key) == Some(value))
            .is_ok()
    }

    /// Sends SIGTERM and waits at most `within` for the exit status.
    pub fn terminate(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        crate::roles::terminate(&self.child);
        crate::roles::wait_exit(&mut self.child, within)
    }

    /// The metrics text.
    pub fn metrics(&self) -> String {
        http::get(&self.http, "/metrics").body
    }

    /// The value of the sample `selector` names (`name{label="v"}`
    /// exactly those labels, `name{label="v"` at least those).
    pub fn metric(&self, selector: &str) -> Option<f64> {
        http::metric(&self.http, selector)
    }

    /// Waits (bounded: 10 s) until the metric line starting with `prefix`
    /// has `value` (load reports are polled, so node figures lag a little).
    pub fn wait_for_metric(&self, prefix: &str, value: f64) {
        let start = Instant::now();
        while self.metric(prefix) != Some(value) {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{prefix} never reached {value}:\n{}",
                self.metrics()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits (bounded) until every node's free pages equal its total, in a
    /// load report taken after this call.
    pub fn assert_pages_come_back(&self) {
        // A report older than the call may predate the last request.
        http::wait_fresh_reports(&self.http, &["prefill-0", "decode-0"]);
        let start = Instant::now();
        loop {
            let m = http::metrics(&self.http);
            let value = |name: &str, node: &str| m.first(name, &[("node", node)]);
            let whole = ["prefill-0", "decode-0"].iter().all(|n| {
                let (t, f) = (
                    value("kvmesh_node_kv_pages_total", n),
                    value("kvmesh_node_kv_pages_free", n),
                );
                t.is_some() && t == f
            });
            if whole {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "pages did not come back:\n{}",
                m.text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
